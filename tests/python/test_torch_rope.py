"""fusekit.torch's rotary embeddings against PyTorch float64: apply_rotary_pos_emb against the
expression Hugging Face's apply_rotary_pos_emb computes (q * cos + rotate_half(q) * sin) with the
same cos / sin, forward and gradients; rope against the documented definition (float32 angles
fl32(p) * inv_freq[i]) over both pairings, partial rotary, position ids, packed tokens and GQA;
both eager paths; the custom-op registration (opcheck); torch.compile(fullgraph=True); errors.
Runs on the CPU backend and again on CUDA where a GPU is present."""
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the fusekit.torch tests need it")
import fusekit  # noqa: E402
import fusekit.torch as fk  # noqa: E402
from torch_testing import (DEVICES, DTYPES, assert_one_graph_calling, check_error,  # noqa: E402
                           check_opcheck, compile_recording_graphs)


def rotate_half(x):
    """Hugging Face's rotate_half."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_expression(q, k, cos, sin, unsqueeze_dim=1):
    """What Hugging Face's apply_rotary_pos_emb computes (partial rotary: on the first r dims)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]

    def apply(x):
        rot = x[..., :r] * cos + rotate_half(x[..., :r]) * sin
        return torch.cat((rot, x[..., r:]), -1)
    return apply(q), apply(k)


def llama_cos_sin(position_ids, r, theta, dtype):
    """Llama's rotary embedding: cos / sin (B, S, r) in float32, cast to the activations' dtype."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r))
    freqs = position_ids.float()[..., None].cpu() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(position_ids.device), emb.sin().to(dtype).to(position_ids.device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("rotary", ["full", "partial"])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_apply_rotary_pos_emb_matches_hugging_face(device, dtype_name, rotary, unsqueeze_dim, path, seed):
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    B, S, Hq, Hk, D = (2, 67, 8, 2, 128) if device == "cuda" else (2, 9, 4, 2, 32)
    r = D if rotary == "full" else D // 4
    shape_q, shape_k = ((B, Hq, S, D), (B, Hk, S, D)) if unsqueeze_dim == 1 else ((B, S, Hq, D), (B, S, Hk, D))
    q = torch.randn(shape_q, generator=gen).to(device, dtype).requires_grad_(True)
    k = torch.randn(shape_k, generator=gen).to(device, dtype).requires_grad_(True)
    position_ids = torch.randint(0, 40000, (B, S), generator=gen).to(device)
    cos, sin = llama_cos_sin(position_ids, r, 500000.0, dtype)
    q_out, k_out = fk.apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == dtype
    assert q_out.stride() == q.stride()  # the input's layout
    dq_out, dk_out = torch.randn_like(q_out), torch.randn_like(k_out)
    torch.autograd.backward((q_out, k_out), (dq_out, dk_out))

    q64 = q.detach().double().requires_grad_(True)
    k64 = k.detach().double().requires_grad_(True)
    q_ref, k_ref = hf_expression(q64, k64, cos.double(), sin.double(), unsqueeze_dim)
    torch.autograd.backward((q_ref, k_ref), (dq_out.double(), dk_out.double()))
    check_error("q_out", q_out, q_ref, dtype_name)
    check_error("k_out", k_out, k_ref, dtype_name)
    check_error("dq", q.grad, q64.grad, dtype_name)
    check_error("dk", k.grad, k64.grad, dtype_name)


def reference(x, position_ids, style, r, theta, linear_scaling=1.0, attention_scaling=1.0, backward=False):
    """The documented definition in float64 from the float32 angles; x (..., S|T, H, D)."""
    half = r // 2
    theta32 = torch.tensor(theta, dtype=torch.float32).double()
    scaling32 = torch.tensor(linear_scaling, dtype=torch.float32).double()
    i = torch.arange(half, dtype=torch.float64)
    inv_freq = (theta32 ** (-2.0 * i / r) / scaling32).float()
    angle = (position_ids.cpu().float()[..., None] * inv_freq).double()  # float32 product
    m = torch.tensor(attention_scaling, dtype=torch.float32).double()
    c, s = (m * angle.cos())[..., None, :], (m * angle.sin())[..., None, :]
    if backward:
        s = -s
    x = x.detach().cpu().double()
    out = x.clone()
    if style == "rotate_half":
        a, b = x[..., :half], x[..., half:r]
        out[..., :half], out[..., half:r] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., 0:r:2], x[..., 1:r:2]
        out[..., 0:r:2], out[..., 1:r:2] = a * c - b * s, b * c + a * s
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("style", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("layout", ["bshd", "packed"])
def test_rope_matches_definition_with_gradients(device, dtype_name, style, layout, path, seed):
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    Hq, Hk, D, r = 4, 2, 64, 48
    if layout == "packed":
        lengths = [5, 17, 9]
        shape = (sum(lengths),)
        position_ids = torch.cat([torch.arange(n) for n in lengths]).to(device)
    else:
        shape = (2, 13)
        position_ids = torch.randint(0, 100000, shape, generator=gen).to(device)
    q = torch.randn(shape + (Hq, D), generator=gen).to(device, dtype).requires_grad_(True)
    k = torch.randn(shape + (Hk, D), generator=gen).to(device, dtype).requires_grad_(True)
    kw = dict(style=style, rotary_dim=r, theta=500000.0, linear_scaling=2.0, attention_scaling=1.1)
    q_out, k_out = fk.rope(q, k, position_ids, **kw)
    dq_out, dk_out = torch.randn_like(q_out), torch.randn_like(k_out)
    torch.autograd.backward((q_out, k_out), (dq_out, dk_out))
    ref = dict(style=style, r=r, theta=500000.0, linear_scaling=2.0, attention_scaling=1.1)
    check_error("q_out", q_out, reference(q, position_ids, **ref), dtype_name)
    check_error("k_out", k_out, reference(k, position_ids, **ref), dtype_name)
    check_error("dq", q.grad, reference(dq_out, position_ids, **ref, backward=True), dtype_name)
    check_error("dk", k.grad, reference(dk_out, position_ids, **ref, backward=True), dtype_name)


@pytest.mark.parametrize("device", DEVICES)
def test_tables_gqa_without_k_and_no_grad(device, seed):
    gen = torch.Generator().manual_seed(seed)
    B, S, H, D = 2, 6, 3, 16
    q = torch.randn(B, S, H, D, generator=gen).to(device)
    position_ids = torch.randint(0, 20, (1, S), generator=gen).to(device)  # shared by the batch
    half = D // 2
    inv_freq = torch.rand(half, generator=gen).to(device)
    angle = torch.arange(20, dtype=torch.float32)[:, None] * inv_freq.cpu()
    cos, sin = angle.cos().to(device), angle.sin().to(device)
    with torch.no_grad():
        from_inv, none = fk.rope(q, None, position_ids, inv_freq=inv_freq)
        from_cos, _ = fk.rope(q, None, position_ids, cos=cos, sin=sin)
    assert none is None
    check_error("q_out from inv_freq", from_inv, reference_tables(q, position_ids, cos, sin), "f32")
    check_error("q_out from cos/sin", from_cos, reference_tables(q, position_ids, cos, sin), "f32")


def reference_tables(q, position_ids, cos, sin):
    c = cos.cpu().double()[position_ids.cpu()][..., None, :]
    s = sin.cpu().double()[position_ids.cpu()][..., None, :]
    x = q.detach().cpu().double()
    half = cos.shape[-1]
    a, b = x[..., :half], x[..., half:2 * half]
    return torch.cat((a * c - b * s, b * c + a * s, x[..., 2 * half:]), -1)


@pytest.mark.parametrize("device", DEVICES)
def test_custom_op_registration(device):
    torch.manual_seed(0)
    q = torch.randn(2, 5, 4, 16, device=device, requires_grad=True)
    k = torch.randn(2, 5, 2, 16, device=device, requires_grad=True)
    ids = torch.randint(0, 50, (2, 5), device=device)
    cos, sin = torch.rand(50, 6, device=device), torch.rand(50, 6, device=device)
    ops = torch.ops.fusekit
    scalars = ("rotate_half", 0, 10000.0, 1.0, 1.0)
    cases = [
        (ops.rope_fwd.default, (q, k, ids, None, None, None) + scalars),
        (ops.rope_fwd.default, (q, None, None, None, None, None, "interleaved", 8, 500000.0, 2.0, 1.0)),
        (ops.rope_fwd.default, (q, k, ids, None, cos, sin, "rotate_half", 12, 10000.0, 1.0, 1.0)),
        (ops.rope_bwd.default, (q.detach(), k.detach(), ids, None, None, None) + scalars),
        (ops.rope_bwd.default, (q.detach(), None, None, torch.rand(8, device=device), None, None) + scalars),
    ]
    check_opcheck(cases)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()

    def f(q, k, cos, sin, ids):
        a, b = fk.apply_rotary_pos_emb(q, k, cos, sin)
        c, d = fk.rope(a.transpose(1, 2), b.transpose(1, 2), ids, style="interleaved", rotary_dim=8)
        return c.square().sum() + d.sum()

    torch.manual_seed(1)
    q = torch.randn(2, 4, 16, 32, device=device, requires_grad=True)
    k = torch.randn(2, 2, 16, 32, device=device, requires_grad=True)
    ids = torch.randint(0, 1000, (2, 16), device=device)
    cos, sin = llama_cos_sin(torch.arange(16, device=device)[None].expand(2, 16), 32, 10000.0, torch.float32)
    compiled, graphs = compile_recording_graphs(f, device)
    loss = compiled(q, k, cos, sin, ids)
    loss.backward()
    gq, gk = q.grad.clone(), k.grad.clone()
    q.grad, k.grad = None, None
    loss_eager = f(q, k, cos, sin, ids)
    loss_eager.backward()
    assert_one_graph_calling(graphs, "fusekit.rope_fwd")
    torch.testing.assert_close(loss, loss_eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gq, q.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gk, k.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_errors_surface_as_exceptions(device, path):
    q = torch.randn(2, 3, 4, 8, device=device)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'rotary_dim'"):
        fk.rope(q, None, rotary_dim=5)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'style'"):
        fk.rope(q, None, style="neox")
    with pytest.raises(fusekit.ArgumentTypeError, match="argument 'style' must be fusekit.RopeStyle or str, not int"):
        fk.rope(q, None, style=1)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'position_ids'"):
        fk.rope(q, None, torch.zeros(3, 2, dtype=torch.int64, device=device))
    cos = torch.rand(5, 4, device=device, requires_grad=True)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'cos'"):
        fk.rope(q, None, cos=cos, sin=cos.detach())
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'unsqueeze_dim'"):
        fk.apply_rotary_pos_emb(q, q, cos.detach(), cos.detach(), unsqueeze_dim=3)
