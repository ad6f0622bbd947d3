"""fusekit.torch's attention against PyTorch itself: outputs and gradients (query, key, value and
an additive attn_mask) of fk.scaled_dot_product_attention vs torch.nn.functional.
scaled_dot_product_attention in float64 as the reference, fusekit's error at most twice PyTorch's
own in the same dtype (or the rounding baseline / accumulation floor); dropout with the
documented mask (fusekit.attention_dropout_keep_mask, itself checked against a NumPy Philox in
test_numpy_attention.py); windows, bottom-right causal masks and variable lengths through
fk.attention; layouts without copies; gradcheck; the custom-op registration (opcheck);
torch.compile(fullgraph=True); CUDA graphs; error reporting.

Runs on the CPU backend (float32, float64: the float64 reference behind both) where PyTorch is
installed and on CUDA (float16, bfloat16: the kernels) where a GPU is present. The CPU backend
saves lse in float32 like the kernels, so its float64 gradients are accurate to ~1e-7 relative:
FLOOR['f64']."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the fusekit.torch tests need it")
import fusekit  # noqa: E402
import fusekit.torch as fk  # noqa: E402
from fk_testing import ACCUMULATION_FLOOR, attention_visibility  # noqa: E402
import torch_testing  # noqa: E402
from torch_testing import (DEVICES, assert_one_graph_calling, check_error,  # noqa: E402
                           check_opcheck, compile_counting_graph_breaks,
                           compile_recording_graphs, cuda_only,
                           custom_op_route, rel)

F = torch.nn.functional
DTYPES = {"f64": torch.float64, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
FLOOR = dict(ACCUMULATION_FLOOR, f64=1e-6)
# (device, dtype): the CPU reference takes f32/f64, the CUDA kernels f16/bf16.
DEVICE_DTYPES = [("cpu", "f64"), ("cpu", "f32")] + [
    pytest.param("cuda", d, marks=cuda_only, id=f"cuda-{d}") for d in ("f16", "bf16")]


def torch_sdpa(q, k, v, attn_mask=None, enable_gqa=False, **kw):
    """PyTorch's SDPA with grouped-query attention written out (key/value heads repeated, as
    enable_gqa does), so that PyTorch versions before 2.5 serve as the reference too."""
    if k.shape[-3] != q.shape[-3]:
        g = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask, **kw)


def gpu_dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def check_vs_pytorch(name, got, torch_same_dtype, ref64, dtype_name):
    """torch_testing.check_vs_pytorch with FLOOR, which has a floor for float64 too."""
    return torch_testing.check_vs_pytorch(name, got, torch_same_dtype, ref64, dtype_name, FLOOR)


# ---- problems -----------------------------------------------------------------------------------
CASES = {
    # N, Hq, Hkv, L, S, E, Ev on the CPU; CUDA scales L, S, E, Ev up (see sizes()).
    "plain": {},
    "causal": {"causal": True},
    "causal_long_keys": {"causal": True, "L": 7, "S": 13},
    "gqa": {"Hq": 6, "Hkv": 2},
    "mqa_causal": {"Hq": 4, "Hkv": 1, "causal": True},
    "ev_differs": {"Ev": 4},
    "head_dim_padded": {"E": 6, "Ev": 10},  # not a multiple of 16 bytes: zero-padded copies
    "scale": {"scale": 0.3},
    "mask_full_grad": {"mask": "full", "mask_grad": True},
    "mask_heads_grad": {"mask": "heads", "mask_grad": True, "Hq": 4, "Hkv": 2},
    "mask_2d_grad": {"mask": "2d", "mask_grad": True},  # (PyTorch refuses a mask with is_causal)
    "mask_keys_only": {"mask": "keys"},
    "mask_bool": {"mask": "bool"},
    "three_d": {"three_d": True},
}


def sizes(c, device):
    s = {"N": 2, "Hq": c.get("Hq", 2), "Hkv": c.get("Hkv", c.get("Hq", 2)), "L": c.get("L", 9),
         "S": c.get("S", 11), "E": c.get("E", 8), "Ev": c.get("Ev", 8)}
    if device == "cuda":
        s["L"], s["S"] = s["L"] * 13, s["S"] * 13  # several kernel tiles, ragged edges
        s["E"], s["Ev"] = s["E"] * 8, s["Ev"] * 8
        if "E" in c:  # head dims that are not multiples of 8 elements: zero-padded
            s["E"], s["Ev"] = 36, 76
    return s


def make_inputs(c, device, dtype, gen):
    s = sizes(c, device)
    N, Hq, Hkv, L, S, E, Ev = (s[k] for k in ("N", "Hq", "Hkv", "L", "S", "E", "Ev"))
    if c.get("three_d"):
        q, k, v = torch.randn(N, L, E, generator=gen), torch.randn(N, S, E, generator=gen), \
            torch.randn(N, S, Ev, generator=gen)
        dout = torch.randn(N, L, Ev, generator=gen)
    else:
        q = torch.randn(N, Hq, L, E, generator=gen)
        k = torch.randn(N, Hkv, S, E, generator=gen)
        v = torch.randn(N, Hkv, S, Ev, generator=gen)
        dout = torch.randn(N, Hq, L, Ev, generator=gen)
    mask = None
    kind = c.get("mask")
    if kind == "full":
        mask = torch.randn(N, Hq, L, S, generator=gen)
    elif kind == "heads":
        mask = torch.randn(Hq, L, S, generator=gen)  # broadcast over N
    elif kind == "2d":
        mask = torch.randn(L, S, generator=gen)
    elif kind == "keys":
        mask = torch.randn(N, 1, 1, S, generator=gen)
    elif kind == "bool":
        mask = torch.rand(N, 1, L, S, generator=gen) > 0.3
        mask[..., 0] = True  # no fully masked row (PyTorch gives NaN there, fusekit 0)
    to = dict(device=device, dtype=dtype)
    q, k, v, dout = (t.to(**to) for t in (q, k, v, dout))
    if mask is not None:
        mask = mask.to(device) if mask.dtype == torch.bool else mask.to(**to)
    return q, k, v, mask, dout


def run(fn, q, k, v, mask, dout, mask_grad, **kw):
    """out and the gradients of (q, k, v[, mask]) of fn on fresh leaves."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    leaves = [q, k, v]
    if mask is not None and mask_grad:
        mask = mask.detach().clone().requires_grad_(True)
        leaves.append(mask)
    out = fn(q, k, v, mask, **kw)
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return out, grads


def sdpa_kwargs(c):
    kw = {"is_causal": c.get("causal", False), "scale": c.get("scale")}
    if c.get("Hq", 2) != c.get("Hkv", c.get("Hq", 2)):
        kw["enable_gqa"] = True
    return kw


@pytest.mark.parametrize("device,dtype_name", DEVICE_DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_pytorch(device, dtype_name, case, path, seed):
    c = CASES[case]
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    q, k, v, mask, dout = make_inputs(c, device, dtype, gen)
    kw = sdpa_kwargs(c)
    mask_grad = c.get("mask_grad", False)
    out, grads = run(fk.scaled_dot_product_attention, q, k, v, mask, dout, mask_grad, **kw)
    out_t, grads_t = run(torch_sdpa, q, k, v, mask, dout, mask_grad, **kw)
    to64 = (lambda t: t if t is None or t.dtype == torch.bool else t.double())
    out_64, grads_64 = run(torch_sdpa, *(to64(t) for t in (q, k, v, mask, dout)),
                           mask_grad, **kw)
    assert out.dtype == dtype and out.shape == out_64.shape
    check_vs_pytorch("out", out, out_t, out_64, dtype_name)
    for name, g, g_t, g_64 in zip(("dq", "dk", "dv", "dmask"), grads, grads_t, grads_64):
        assert g.dtype == dtype and g.shape == g_64.shape, name
        check_vs_pytorch(name, g, g_t, g_64, dtype_name)


# ---- features PyTorch's SDPA does not have, against PyTorch with explicit masks ----------------
def visible_keys(L, S, mask, window, device):
    """fk_testing.attention_visibility as a bool (L, S) tensor on `device`."""
    return torch.from_numpy(attention_visibility(L, S, mask, window)).to(device)


def bshd(t):
    return t.transpose(1, 2)


@pytest.mark.parametrize("device,dtype_name", DEVICE_DTYPES)
@pytest.mark.parametrize("mask,window", [("none", (3, 2)), ("causal_top_left", (4, -1)),
                                         ("causal_bottom_right", (-1, -1)),
                                         ("causal_bottom_right", (2, -1)), ("none", (-1, 0))])
def test_windows_and_bottom_right_causal(device, dtype_name, mask, window, path, seed):
    """fk.attention with a mask/window and a bias (with gradient) vs PyTorch's SDPA given the
    same visibility as -inf in its attn_mask (no row is fully masked here)."""
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    c = {"Hq": 4, "Hkv": 2, "mask": "heads", "L": 8, "S": 12}
    q, k, v, bias, dout = make_inputs(c, device, dtype, gen)
    vis = visible_keys(q.shape[2], k.shape[2], mask, window, device)
    assert vis.any(dim=1).all()

    def fusekit_fn(q, k, v, b):
        return bshd(fk.attention(bshd(q), bshd(k), bshd(v), b[None], mask=mask, window=window))

    def torch_fn(q, k, v, b):
        return torch_sdpa(q, k, v, b.masked_fill(~vis, float("-inf")))

    out, grads = run(fusekit_fn, q, k, v, bias, dout, True)
    out_t, grads_t = run(torch_fn, q, k, v, bias, dout, True)
    out_64, grads_64 = run(torch_fn, *(t.double() for t in (q, k, v, bias, dout)), True)
    check_vs_pytorch("out", out, out_t, out_64, dtype_name)
    for name, g, g_t, g_64 in zip(("dq", "dk", "dv", "dbias"), grads, grads_t, grads_64):
        check_vs_pytorch(name, g, g_t, g_64, dtype_name)


def dropout_reference(q, k, v, bias, vis, z):
    """float64 attention with dropout factor z (N, Hq, L, S), (N, H, S, D) layout; differentiable."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + bias
    p = torch.softmax(s.masked_fill(~vis, float("-inf")), dim=-1)
    return (p * z) @ v


@pytest.mark.parametrize("device,dtype_name", DEVICE_DTYPES)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_uses_the_documented_mask(device, dtype_name, p, path, seed):
    """Against float64 PyTorch with the documented mask (fusekit.attention_dropout_keep_mask).
    The same-dtype baseline is PyTorch's own error on the same problem without dropout."""
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    c = {"Hq": 4, "Hkv": 2, "mask": "full", "mask_grad": True}
    q, k, v, bias, dout = make_inputs(c, device, dtype, gen)
    rseed, offset = seed * 7919 + 1, seed % 1000
    out, grads = run(fk.scaled_dot_product_attention, q, k, v, bias, dout, True, dropout_p=p,
                     seed=rseed, offset=offset, is_causal=True, enable_gqa=True)
    N, Hq, L, S = bias.shape
    keep = np.empty((N, Hq, L, S), np.uint8)
    fusekit.attention_dropout_keep_mask(rseed, offset, p, keep)
    z = torch.from_numpy(keep.astype(np.float64)).to(device) / (1.0 - float(np.float32(p)))
    vis = visible_keys(L, S, "causal_top_left", (-1, -1), device)
    leaves64 = [t.detach().double().requires_grad_(True) for t in (q, k, v, bias)]
    ref = dropout_reference(*leaves64, vis, z)
    ref_grads = torch.autograd.grad(ref, leaves64, dout.double())

    def torch_fn(q, k, v, b):  # PyTorch refuses attn_mask with is_causal: the mask goes in b
        return torch_sdpa(q, k, v, b.masked_fill(~vis, float("-inf")))

    base_t = run(torch_fn, q, k, v, bias, dout, True)
    base_64 = run(torch_fn, *(t.double() for t in (q, k, v, bias, dout)), True)
    baselines = [rel(base_t[0], base_64[0])] + [rel(a, b) for a, b in zip(base_t[1], base_64[1])]
    for name, got, r, b in zip(("out", "dq", "dk", "dv", "dbias"), (out, *grads),
                               (ref, *ref_grads), baselines):
        check_error(name, got, r, dtype_name, b, FLOOR)
    dropped = keep == 0
    assert dropped.any() and (~dropped).any()


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_seed_from_torch_generator(device, seed):
    q, k, v = (torch.randn(1, 2, 16, 8, device=device, dtype=gpu_dtype(device)) for _ in range(3))
    torch.manual_seed(seed)
    a = fk.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(seed)
    b = fk.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    c = fk.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)
    d = fk.scaled_dot_product_attention(q, k, v, dropout_p=0.5, seed=123, offset=4)
    e = fk.scaled_dot_product_attention(q, k, v, dropout_p=0.5, seed=123, offset=4)
    f = fk.scaled_dot_product_attention(q, k, v, dropout_p=0.5, seed=123, offset=5)
    assert torch.equal(d, e) and not torch.equal(d, f)


@pytest.mark.parametrize("device,dtype_name", DEVICE_DTYPES)
def test_variable_lengths_match_separate_sequences(device, dtype_name, path, seed):
    """Packed sequences (cu_seqlens) vs PyTorch's SDPA on each sequence alone, bottom-right
    causal (every query sees a key: Sq <= Sk)."""
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    up = 13 if device == "cuda" else 1
    lens_q, lens_k = [3 * up, 5 * up, 1, 2 * up], [4 * up, 5 * up, 6, 4 * up]
    Hq, Hkv, D = 4, 2, (64 if device == "cuda" else 8)
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(device, torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(device, torch.int32)
    q = torch.randn(sum(lens_q), Hq, D, generator=gen).to(device, dtype)
    k = torch.randn(sum(lens_k), Hkv, D, generator=gen).to(device, dtype)
    v = torch.randn(sum(lens_k), Hkv, D, generator=gen).to(device, dtype)
    dout = torch.randn(sum(lens_q), Hq, D, generator=gen).to(device, dtype)

    def fusekit_fn(q, k, v, _):
        return fk.attention(q, k, v, mask="causal_bottom_right", cu_seqlens_q=cu_q,
                            cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))

    def torch_fn(q, k, v, _):
        outs = []
        for b in range(len(lens_q)):
            sq = slice(int(cu_q[b]), int(cu_q[b + 1]))
            sk = slice(int(cu_k[b]), int(cu_k[b + 1]))
            vis = visible_keys(lens_q[b], lens_k[b], "causal_bottom_right", (-1, -1), device)
            o = torch_sdpa(bshd(q[None, sq]), bshd(k[None, sk]), bshd(v[None, sk]), vis)
            outs.append(bshd(o)[0])
        return torch.cat(outs)

    out, grads = run(fusekit_fn, q, k, v, None, dout, False)
    out_t, grads_t = run(torch_fn, q, k, v, None, dout, False)
    out_64, grads_64 = run(torch_fn, *(t.double() for t in (q, k, v)), None, dout.double(), False)
    check_vs_pytorch("out", out, out_t, out_64, dtype_name)
    for name, g, g_t, g_64 in zip(("dq", "dk", "dv"), grads, grads_t, grads_64):
        check_vs_pytorch(name, g, g_t, g_64, dtype_name)


# ---- layouts, paths, registration ---------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_layouts_without_copies(device, seed, monkeypatch):
    """(N, H, L, E) contiguous tensors and q/k/v slices of one packed (N, L, 3, H, E) tensor reach
    fusekit as they are (no copy): the arrays the binding receives share their memory."""
    torch.manual_seed(seed)
    dtype = gpu_dtype(device)
    N, H, L, E = 2, 4, 16, 64
    qkv = torch.randn(N, L, 3, H, E, device=device, dtype=dtype)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (N, H, L, E) views
    seen = []

    def spy_on(name):  # the public entry point or the eager path's
        forward = getattr(fusekit._C, name)

        def spy(q_, k_, v_, *args, **kwargs):
            seen.extend([q_.data_ptr(), k_.data_ptr(), v_.data_ptr()])
            return forward(q_, k_, v_, *args, **kwargs)

        monkeypatch.setattr(fusekit._C, name, spy)

    spy_on("attention_forward")
    spy_on("_attention_forward_alloc")
    out = fk.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert seen == [q.data_ptr(), k.data_ptr(), v.data_ptr()]
    assert out.shape == (N, H, L, E) and out.transpose(1, 2).is_contiguous()
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert rel(out, ref) <= 2 * max(rel(ref.to(dtype), ref), ACCUMULATION_FLOOR["bf16"])


@pytest.mark.parametrize("device", DEVICES)
def test_misaligned_and_oddly_strided_inputs_are_copied(device, seed, path):
    """Views fusekit cannot read as they are (a data pointer off 16 bytes, a strided head dim, a
    mask row of an odd length): copied or padded on the way in, same results, gradients in the
    callers' shapes."""
    torch.manual_seed(seed)
    dtype = gpu_dtype(device)
    N, H, L, E = 2, 2, 12, 16
    flat = torch.randn(N * H * L * E + 1, device=device, dtype=dtype)
    q = flat[1:].view(N, H, L, E).requires_grad_(True)  # data pointer off by one element
    assert q.data_ptr() % 16 != 0
    k = torch.randn(N, H, L, 2 * E, device=device, dtype=dtype)[..., ::2].requires_grad_(True)
    v = torch.randn(N, H, L, E, device=device, dtype=dtype, requires_grad=True)
    mask = torch.randn(L, L + 1, device=device, dtype=dtype)[:, 1:].requires_grad_(True)
    dout = torch.randn(N, H, L, E, device=device, dtype=dtype)
    out, grads = run(fk.scaled_dot_product_attention, q, k, v, mask, dout, True, deterministic=True)
    clean = [t.detach().contiguous() for t in (q, k, v, mask)]
    out_c, grads_c = run(fk.scaled_dot_product_attention, *clean, dout, True, deterministic=True)
    assert torch.equal(out, out_c)
    for g, gc, t in zip(grads, grads_c, (q, k, v, mask)):
        assert g.shape == t.shape and torch.equal(g, gc)


@pytest.mark.parametrize("device", DEVICES)
def test_both_paths_give_identical_results(device, seed):
    torch.manual_seed(seed)
    dtype = gpu_dtype(device)
    q, k, v = (torch.randn(2, 4, 24, 16, device=device, dtype=dtype) for _ in range(3))
    bias = torch.randn(1, 4, 24, 24, device=device, dtype=dtype)
    dout = torch.randn(2, 4, 24, 16, device=device, dtype=dtype)
    def attend():
        return run(fk.scaled_dot_product_attention, q, k, v, bias, dout, True, is_causal=True,
                   dropout_p=0.2, seed=7, deterministic=True)

    eager = attend()
    with custom_op_route():
        custom_op = attend()
    (o1, g1), (o2, g2) = eager, custom_op
    assert torch.equal(o1, o2) and all(torch.equal(a, b) for a, b in zip(g1, g2))


@pytest.mark.parametrize("device", DEVICES)
def test_inference_partial_gradients_and_constant_mask(device, seed, path):
    torch.manual_seed(seed)
    dtype = gpu_dtype(device)
    q, k, v = (torch.randn(2, 2, 8, 16, device=device, dtype=dtype) for _ in range(3))
    mask = torch.randn(8, 8, device=device, dtype=dtype, requires_grad=True)
    ref = fk.scaled_dot_product_attention(q, k, v, mask.detach())
    with torch.no_grad():
        assert torch.equal(fk.scaled_dot_product_attention(q, k, v, mask), ref)
    with torch.inference_mode():
        assert torch.equal(fk.scaled_dot_product_attention(q, k, v, mask), ref)
    vg = v.clone().requires_grad_(True)
    out = fk.scaled_dot_product_attention(q, k, vg, mask, bias_requires_grad=False)
    out.float().sum().backward()
    assert vg.grad is not None and mask.grad is None
    out = fk.scaled_dot_product_attention(q, k, vg, mask)
    out.float().sum().backward()
    assert mask.grad is not None and mask.grad.shape == mask.shape and mask.grad.dtype == dtype


@pytest.mark.parametrize("device", DEVICES)
def test_expanded_mask_gets_its_own_gradient(device, seed):
    """An attn_mask that is itself an expanded (stride-0) leaf gets per-element gradients."""
    torch.manual_seed(seed)
    dtype = gpu_dtype(device)
    q, k, v = (torch.randn(3, 2, 8, 16, device=device, dtype=dtype) for _ in range(3))
    base = torch.randn(1, 2, 8, 8, device=device, dtype=dtype)
    leaf = base.expand(3, 2, 8, 8).requires_grad_(True)  # a stride-0 leaf
    fk.scaled_dot_product_attention(q, k, v, leaf).float().square().sum().backward()
    full = base.expand(3, 2, 8, 8).clone().requires_grad_(True)
    F.scaled_dot_product_attention(q.double(), k.double(), v.double(), full.double()) \
        .square().sum().backward()
    assert rel(leaf.grad, full.grad) < 2e-2


def test_gradcheck_float64_cpu(path):
    """float64 gradcheck on the CPU reference (lse is float32: ~1e-7 relative, far inside the
    tolerances)."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 5, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 5, 2, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, bias):
        return fk.scaled_dot_product_attention(q, k, v, bias, enable_gqa=True, window=(2, -1),
                                               dropout_p=0.3, seed=5)

    assert torch.autograd.gradcheck(f, (q, k, v, bias), atol=1e-5, rtol=1e-4, nondet_tol=0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_custom_op_registration(device):
    """torch.library.opcheck: schema, fake implementations, autograd registration and AOT
    dispatch of fusekit::attention_fwd / attention_bwd."""
    torch.manual_seed(0)
    dtype = gpu_dtype(device)
    N, L, S, Hq, Hkv, D = 2, 8, 12, 4, 2, 16
    q = torch.randn(N, L, Hq, D, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(N, S, Hkv, D, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(N, S, Hkv, D, device=device, dtype=dtype, requires_grad=True)
    bias = torch.randn(1, Hq, L, 16, device=device, dtype=dtype)[..., :S].requires_grad_(True)
    ops = torch.ops.fusekit
    seed3, seed0 = torch.tensor(3), torch.tensor(0)  # the custom ops take the seed as a tensor
    fwd = (q, k, v, bias, None, "causal_top_left", -1, -1, 0.1, seed3, 1, None, None, 0, 0, False)
    out, lse = ops.attention_fwd(*fwd)
    dout = torch.randn_like(out)
    cu_q = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    qv, kv, vv = (t.detach()[0].clone().requires_grad_(True) for t in (q, k, v))
    cases = [
        (ops.attention_fwd.default, fwd),
        (ops.attention_fwd.default, (q, k, v, None, 0.5, "none", 2, 1, 0.0, seed0, 0, None, None, 0, 0, True)),
        (ops.attention_fwd.default, (qv, kv, vv, None, None, "causal_bottom_right", -1, -1, 0.0, seed0, 0,
                                     cu_q, cu_k, 5, 7, False)),
        (ops.attention_bwd.default, (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse,
                                     bias.detach(), None, "causal_top_left", -1, -1, 0.1, seed3, 1, None,
                                     None, 0, 0, False, True, True, True, True)),
        (ops.attention_bwd.default, (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse,
                                     bias.detach(), None, "causal_top_left", -1, -1, 0.1, seed3, 1, None,
                                     None, 0, 0, True, False, True, False, False)),
    ]
    check_opcheck(cases)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_draws_fresh_seeds_without_graph_breaks(device, seed):
    """Attention dropout with seed=None under torch.compile: zero graph breaks, a fresh mask every
    run, torch.manual_seed reproduces runs (outputs and gradients)."""
    dtype = gpu_dtype(device)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 4, 24, 16, generator=gen).to(device, dtype).requires_grad_(True)
               for _ in range(3))

    def f(q, k, v):
        return fk.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.3)

    compiled, graphs, graph_breaks = compile_counting_graph_breaks(f, device)

    def step():
        out = compiled(q, k, v)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        return out, grads

    torch.manual_seed(seed)
    out1, grads1 = step()
    out2, _ = step()
    torch.manual_seed(seed)
    out3, grads3 = step()
    assert graph_breaks() == 0 and len(graphs) == 1
    assert not torch.equal(out1, out2)
    assert torch.equal(out1, out3)
    for g1, g3 in zip(grads1, grads3):
        assert torch.isfinite(g1).all()
        torch.testing.assert_close(g1, g3, rtol=2e-2, atol=2e-2)  # dq: atomics on the GPU
    if device == "cpu":  # the CPU generator's draw is the eager path's: the same result
        torch.manual_seed(seed)
        out_eager = f(q, k, v)
        grads_eager = torch.autograd.grad(out_eager.float().square().sum(), (q, k, v))
        torch.testing.assert_close(out1, out_eager, rtol=1e-6, atol=1e-6)
        for g1, ge in zip(grads1, grads_eager):
            torch.testing.assert_close(g1, ge, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device, seed):
    torch._dynamo.reset()
    torch.manual_seed(seed)
    dtype = gpu_dtype(device)

    def f(x, w, mask):
        qkv = (x @ w).view(x.shape[0], x.shape[1], 3, 4, 16)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        out = fk.scaled_dot_product_attention(q, k, v, mask, is_causal=True, dropout_p=0.1,
                                              seed=1234, offset=2)
        return out.transpose(1, 2).reshape(x.shape[0], x.shape[1], 64).float().square().sum()

    x = torch.randn(2, 24, 64, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(64, 192, device=device, dtype=dtype) / 8).requires_grad_(True)
    mask = torch.randn(4, 24, 24, device=device, dtype=dtype, requires_grad=True)
    compiled, graphs = compile_recording_graphs(f, device)
    loss = compiled(x, w, mask)
    loss.backward()
    grads = [t.grad.clone() for t in (x, w, mask)]
    for t in (x, w, mask):
        t.grad = None
    loss_eager = f(x, w, mask)
    loss_eager.backward()
    assert_one_graph_calling(graphs, "fusekit.attention_fwd")
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(loss, loss_eager, **tol)
    for g, t in zip(grads, (x, w, mask)):
        assert rel(g, t.grad) <= (1e-5 if dtype == torch.float32 else 2e-2)


@cuda_only
def test_cuda_graph_capture(seed):
    torch.manual_seed(seed)
    q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())

    def step():
        out = fk.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1, seed=3)
        out.float().square().sum().backward()
        return out

    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in (q, k, v):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    graph.replay()
    torch.cuda.synchronize()
    captured = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    eager_out = step()
    assert torch.equal(static_out, eager_out)
    for a, t in zip(captured, (q, k, v)):
        assert rel(a, t.grad) <= 1e-2  # dq may use atomics


@cuda_only
def test_deterministic_backward_is_bitwise_reproducible(seed):
    torch.manual_seed(seed)
    q, k, v = (torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn_like(q)
    runs = [run(fk.scaled_dot_product_attention, q, k, v, None, dout, False, is_causal=True,
                deterministic=True)[1] for _ in range(3)]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


@pytest.mark.parametrize("device", DEVICES)
def test_fully_masked_rows_give_zeros(device):
    q, k, v = (torch.randn(1, 2, 8, 16, device=device, dtype=gpu_dtype(device), requires_grad=True)
               for _ in range(3))
    mask = torch.ones(8, 8, dtype=torch.bool, device=device)
    mask[3] = False  # query 3 sees no key
    out = fk.scaled_dot_product_attention(q, k, v, mask)
    assert torch.isfinite(out).all() and (out[:, :, 3] == 0).all()
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("device", DEVICES)
def test_errors_surface_as_exceptions(device, path):
    dtype = gpu_dtype(device)
    q = torch.randn(1, 4, 8, 16, device=device, dtype=dtype)
    kv = torch.randn(1, 2, 8, 16, device=device, dtype=dtype)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'key'.*enable_gqa"):
        fk.scaled_dot_product_attention(q, kv, kv)
    k3 = torch.randn(1, 3, 8, 16, device=device, dtype=dtype)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'k'.*divides"):
        fk.scaled_dot_product_attention(q, k3, k3, enable_gqa=True)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'dropout_p'"):
        fk.scaled_dot_product_attention(q, q, q, dropout_p=1.0, seed=1)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'offset'"):
        fk.scaled_dot_product_attention(q, q, q, dropout_p=0.1, seed=1, offset=2**32)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'mask'"):
        fk.attention(q, q, q, mask="causal")
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'bias'"):
        fk.scaled_dot_product_attention(q, q, q, torch.randn(3, 8, 8, device=device, dtype=dtype))
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'query'"):
        fk.scaled_dot_product_attention(q[0, 0], q[0, 0], q[0, 0])


@cuda_only
def test_float32_on_cuda_is_refused_clearly():
    q = torch.randn(1, 2, 8, 16, device="cuda")
    with pytest.raises(fusekit.UnsupportedError, match="f16 and bf16"):
        fk.scaled_dot_product_attention(q, q, q)


@pytest.mark.parametrize("device", DEVICES)
def test_core_api_with_torch_tensors(device, seed):
    """fusekit.attention_forward/backward directly on torch tensors (caller-allocated outputs and
    workspace), as the C++ API."""
    torch.manual_seed(seed)
    dtype = gpu_dtype(device)
    N, L, H, D = 2, 32, 4, 64
    q, k, v = (torch.randn(N, L, H, D, device=device, dtype=dtype) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(N, H, L, device=device)
    fusekit.attention_forward(q, k, v, None, out, lse, mask="causal_top_left")
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2).double() for t in (q, k, v)),
                                         is_causal=True).transpose(1, 2)
    assert rel(out, ref) <= 2 * max(rel(ref.to(dtype), ref), ACCUMULATION_FLOOR["bf16"])
    dev = "cuda:0" if device == "cuda" else "cpu"
    fk_dtype = fusekit.DType.bf16 if device == "cuda" else fusekit.DType.f32
    nbytes = fusekit.attention_backward_workspace_size(N, L, L, H, H, D, D, fk_dtype, dev)
    ws = torch.empty(nbytes, dtype=torch.uint8, device=device) if nbytes else None
    dq = torch.empty_like(q)
    fusekit.attention_backward(torch.ones_like(out), q, k, v, out, lse, None, dq,
                               mask="causal_top_left", workspace=ws)
    assert torch.isfinite(dq).all()
    if device == "cuda":
        assert nbytes > 0
        with pytest.raises(fusekit.InvalidArgumentError, match="argument 'workspace'"):
            fusekit.attention_backward(torch.ones_like(out), q, k, v, out, lse, None, dq,
                                       mask="causal_top_left")
