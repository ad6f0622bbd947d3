"""fusekit.torch under torch.autocast: every op, on both routes (the eager path and the custom op
that tracing sees), with float32 parameters (and a mix of float32 and autocast-dtype
activations, as a model's residual stream and branch outputs are) gives exactly what the op gives
on the inputs cast by hand as PyTorch's counterpart would cast them, in its output dtypes, and
the same gradients for the float32 leaves. No "expected dtype bf16 (as 'x'), got f32".

Autocast runs on the CPU (bfloat16) everywhere and on CUDA (bfloat16 and float16) where a GPU is
present."""
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the fusekit.torch tests need it")
import fusekit  # noqa: E402
import fusekit.torch as fk  # noqa: E402
from torch_testing import compile_recording_graphs, cuda_only  # noqa: E402

F = torch.nn.functional
AUTOCASTS = [pytest.param(("cpu", torch.bfloat16), id="cpu-bf16"),
             pytest.param(("cuda", torch.bfloat16), id="cuda-bf16", marks=cuda_only),
             pytest.param(("cuda", torch.float16), id="cuda-f16", marks=cuda_only)]


def leaf(gen, shape, device, dtype=torch.float32, grad=True, scale=1.0):
    t = (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)
    return t.requires_grad_(grad)


# Each case: (inputs, fn, by_hand, counterpart). inputs: the tensors fn takes (float32 parameters
# and activations in float32 or the autocast dtype dt); fn(*inputs) -> a tensor or a tuple;
# by_hand(device, dt, *inputs) -> the inputs cast as PyTorch's counterpart is cast under autocast,
# made outside autocast; counterpart(*inputs) -> PyTorch's own function (its output dtypes under
# autocast are what fusekit's must be), or None where PyTorch has none.
def case_linear(device, dt, gen):
    inputs = (leaf(gen, (3, 5, 16), device), leaf(gen, (24, 16), device, scale=0.3),
              leaf(gen, (24,), device))
    return (inputs, lambda x, w, b: fk.linear(x, w, b, "gelu_tanh"),
            lambda x, w, b: (x.to(dt), w.to(dt), b.to(dt)),
            lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh"))


def case_linear_branch_input(device, dt, gen):
    """x already in the autocast dtype (a previous linear's output), float32 weight."""
    inputs = (leaf(gen, (7, 16), device, dtype=dt), leaf(gen, (8, 16), device, scale=0.3))
    return (inputs, lambda x, w: fk.linear(x, w), lambda x, w: (x, w.to(dt)),
            lambda x, w: F.linear(x, w))


def case_gated_linear(device, dt, gen):
    """float32 x, weight (2F, K) and bias: all in the autocast dtype, as the F.linear it replaces."""
    inputs = (leaf(gen, (3, 5, 16), device), leaf(gen, (24, 16), device, scale=0.3),
              leaf(gen, (24,), device))

    def counterpart(x, w, b):
        pre = F.linear(x, w, b)
        return F.silu(pre[..., 0::2]) * pre[..., 1::2]

    return (inputs, lambda x, w, b: fk.gated_linear(x, w, b, "silu"),
            lambda x, w, b: (x.to(dt), w.to(dt), b.to(dt)), counterpart)


def case_layer_norm(device, dt, gen):
    """x in the autocast dtype (a branch output): float32 on CUDA, as it comes on the CPU."""
    inputs = (leaf(gen, (4, 6, 32), device, dtype=dt), leaf(gen, (32,), device),
              leaf(gen, (32,), device))
    up = torch.float32 if device == "cuda" else dt
    return (inputs, lambda x, w, b: fk.layer_norm(x, (32,), w, b, 1e-5),
            lambda x, w, b: (x.to(up), w, b),
            lambda x, w, b: F.layer_norm(x, (32,), w, b, 1e-5))


def case_layer_norm_float32_stream(device, dt, gen):
    inputs = (leaf(gen, (4, 6, 32), device), leaf(gen, (32,), device), leaf(gen, (32,), device))
    return (inputs, lambda x, w, b: fk.layer_norm(x, (32,), w, b), lambda x, w, b: (x, w, b),
            lambda x, w, b: F.layer_norm(x, (32,), w, b))


def case_rms_norm(device, dt, gen):
    inputs = (leaf(gen, (5, 32), device, dtype=dt), leaf(gen, (32,), device))
    return (inputs, lambda x, w: fk.rms_norm(x, (32,), w, 1e-6), lambda x, w: (x, w),
            lambda x, w: F.rms_norm(x, (32,), w, 1e-6))


def case_layer_norm_residual(device, dt, gen):
    """A branch output in dt plus a float32 residual stream."""
    inputs = (leaf(gen, (3, 4, 32), device, dtype=dt), leaf(gen, (3, 4, 32), device),
              leaf(gen, (32,), device), leaf(gen, (32,), device))
    return (inputs, lambda x, r, w, b: fk.layer_norm_residual(x, r, w, b, 1e-5),
            lambda x, r, w, b: (x.float(), r, w, b),
            lambda x, r, w, b: (F.layer_norm(x + r, (32,), w, b, 1e-5), x + r))


def case_rms_norm_residual(device, dt, gen):
    inputs = (leaf(gen, (3, 4, 32), device, dtype=dt), leaf(gen, (3, 4, 32), device),
              leaf(gen, (32,), device))
    return (inputs, lambda x, r, w: fk.rms_norm_residual(x, r, w, 1e-6),
            lambda x, r, w: (x.float(), r, w),
            lambda x, r, w: (F.rms_norm(x + r, (32,), w, 1e-6), x + r))


def case_bias_act_dropout(device, dt, gen):
    """x in dt, a float32 bias: taken as they are (the fused op's mixed form)."""
    inputs = (leaf(gen, (6, 40), device, dtype=dt), leaf(gen, (40,), device))
    return (inputs, lambda x, b: fk.bias_act_dropout(x, b, "gelu_tanh", 0.25, seed=17, offset=3),
            lambda x, b: (x, b), None)


def case_bias_act_dropout_low_bias(device, dt, gen):
    """x float32, a bias in dt: the bias goes in as float32 (x + bias would promote it)."""
    inputs = (leaf(gen, (6, 40), device), leaf(gen, (40,), device, dtype=dt))
    return (inputs, lambda x, b: fk.bias_act_dropout(x, b, "relu", 0.25, seed=5),
            lambda x, b: (x, b.float()), lambda x, b: F.relu(x + b))


def case_gated_act_separate(device, dt, gen):
    inputs = (leaf(gen, (4, 24), device, dtype=dt), leaf(gen, (4, 24), device))
    return (inputs, lambda g, u: fk.gated_act_separate(g, u, "silu"),
            lambda g, u: (g.float(), u), lambda g, u: F.silu(g) * u)


def case_gated_act(device, dt, gen):
    inputs = (leaf(gen, (4, 48), device, dtype=dt),)
    return (inputs, lambda gu: fk.gated_act(gu, "gelu_tanh"), lambda gu: (gu,),
            lambda gu: F.gelu(gu[..., :24], approximate="tanh") * gu[..., 24:])


def case_rope(device, dt, gen):
    """q in dt, k float32: rotated in their common dtype."""
    inputs = (leaf(gen, (2, 5, 4, 16), device, dtype=dt), leaf(gen, (2, 5, 2, 16), device))
    return (inputs, lambda q, k: fk.rope(q, k, theta=500.0), lambda q, k: (q.float(), k), None)


def case_apply_rotary_pos_emb(device, dt, gen):
    """Hugging Face's form: (B, H, S, D) q and k from the projections (dt), float32 cos / sin."""
    angles = torch.rand(1, 5, 8, generator=gen).to(device) * 3
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    inputs = (leaf(gen, (2, 4, 5, 16), device, dtype=dt), leaf(gen, (2, 2, 5, 16), device, dtype=dt))
    return (inputs, lambda q, k: fk.apply_rotary_pos_emb(q, k, cos, sin), lambda q, k: (q, k), None)


def case_attention(device, dt, gen):
    """float32 q, k, v (GQA) and a float32 additive bias: all in the autocast dtype."""
    inputs = (leaf(gen, (2, 6, 4, 16), device), leaf(gen, (2, 6, 2, 16), device),
              leaf(gen, (2, 6, 2, 16), device), leaf(gen, (2, 1, 6, 6), device))
    return (inputs,
            lambda q, k, v, b: fk.attention(q, k, v, b, mask="causal_top_left", deterministic=True),
            lambda q, k, v, b: (q.to(dt), k.to(dt), v.to(dt), b.to(dt)),
            lambda q, k, v, b: F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=b,
                enable_gqa=True))


def case_scaled_dot_product_attention(device, dt, gen):
    mask = torch.rand(1, 1, 6, 6, generator=gen).to(device) > 0.3
    mask[..., 0] = True
    inputs = (leaf(gen, (2, 4, 6, 16), device), leaf(gen, (2, 4, 6, 16), device),
              leaf(gen, (2, 4, 6, 16), device))
    return (inputs,
            lambda q, k, v: fk.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                            dropout_p=0.2, seed=9, deterministic=True),
            lambda q, k, v: (q.to(dt), k.to(dt), v.to(dt)),
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def case_cross_entropy(device, dt, gen):
    """Logits in dt: the loss is float32 computed in float32 (PyTorch upcasts the logits; fusekit
    computes in float32 from them: the same function, no float32 copy)."""
    target = torch.randint(0, 40, (12,), generator=gen).to(device)
    target[3] = -100
    inputs = (leaf(gen, (12, 40), device, dtype=dt),)
    return (inputs, lambda logits: fk.cross_entropy(logits, target, z_loss=1e-3),
            lambda logits: (logits,), lambda logits: F.cross_entropy(logits, target))


def case_cross_entropy_float32(device, dt, gen):
    target = torch.randint(0, 40, (12,), generator=gen).to(device)
    inputs = (leaf(gen, (12, 40), device),)
    return (inputs, lambda logits: fk.cross_entropy(logits, target, label_smoothing=0.1),
            lambda logits: (logits,), lambda logits: F.cross_entropy(logits, target))


def case_fp8_rms_norm(device, dt, gen):
    """FP8 in and out: the op's own precision (its y is bfloat16); autocast changes nothing."""
    inputs = (leaf(gen, (4, 256), device), leaf(gen, (256,), device))
    return (inputs, lambda x, w: fk.fp8_rms_norm(x, 256, w).y, lambda x, w: (x, w), None)


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


def run(fn, inputs, weights):
    """The outputs of fn(*inputs) (a tuple) and the gradients of the float32 leaves."""
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    loss = sum((o.float() * w).sum() for o, w in zip(outs, weights))
    leaves = [t for t in inputs if t.requires_grad]
    return outs, torch.autograd.grad(loss, leaves)


def loss_weights(gen, outs):
    return [torch.randn(o.shape, generator=gen).to(o.device) for o in outs]


@pytest.mark.parametrize("amp", AUTOCASTS)
@pytest.mark.parametrize("name", list(CASES))
def test_autocast_is_the_op_on_inputs_cast_by_hand(amp, name, path, seed):
    device, dt = amp
    gen = torch.Generator().manual_seed(seed)
    inputs, fn, by_hand, counterpart = CASES[name](device, dt, gen)
    with torch.autocast(device, dtype=dt):
        outs = fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        ref_dtypes = None
        if counterpart is not None:
            ref = counterpart(*[t.detach() for t in inputs])
            ref_dtypes = [r.dtype for r in (ref if isinstance(ref, tuple) else (ref,))]
    weights = loss_weights(gen, outs)
    with torch.autocast(device, dtype=dt):
        outs, grads = run(fn, inputs, weights)
    expected, expected_grads = run(lambda *t: fn(*by_hand(*t)), inputs, weights)
    for o, e in zip(outs, expected):
        assert o.dtype == e.dtype, (name, o.dtype, e.dtype)
        assert torch.equal(o, e), name
    if ref_dtypes is not None:  # PyTorch's casting semantics: its output dtypes
        assert [o.dtype for o in outs] == ref_dtypes, (name, ref_dtypes)
    for g, e in zip(grads, expected_grads):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("amp", AUTOCASTS)
def test_drop_in_modules(amp, path, seed):
    """A float32 model under autocast: fusekit's modules run without dtype errors and give what
    PyTorch's modules give in the same dtypes (LayerNorm float32 on CUDA and the autocast-dtype
    linear output on the CPU; the loss float32)."""
    device, dt = amp
    torch.manual_seed(seed)
    torch_model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64),
                                      torch.nn.Linear(64, 32), torch.nn.RMSNorm(32, eps=1e-6)).to(device)
    ours = torch.nn.Sequential(torch.nn.Linear(32, 64), fk.LayerNorm(64), fk.Linear(64, 32, activation="none"),
                               fk.RMSNorm(32, eps=1e-6)).to(device)
    ours.load_state_dict(torch_model.state_dict())
    mlp = fk.GatedMLP(32, 48, "silu", device=device)
    x = torch.randn(3, 5, 32, device=device)
    target = torch.randint(0, 32, (15,), device=device)
    with torch.autocast(device, dtype=dt):
        y_ref = torch_model(x)
        y = ours(x)
        h = mlp(y)
        loss = fk.CrossEntropyLoss()(h.reshape(15, 32), target)
    assert y.dtype == y_ref.dtype and h.dtype == dt and loss.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in ours.parameters())


@pytest.mark.parametrize("amp", AUTOCASTS)
def test_registered_autocast_kernels(amp, seed):
    """torch.ops.fusekit.* called directly under autocast (no functional form) cast too."""
    device, dt = amp
    gen = torch.Generator().manual_seed(seed)
    x, w = leaf(gen, (4, 16), device), leaf(gen, (8, 16), device)
    with torch.autocast(device, dtype=dt):
        y, _ = torch.ops.fusekit.linear_fwd(x, w, None, "none", False)
        z, _, _, _ = torch.ops.fusekit.layer_norm_residual_fwd(y, torch.ones(4, 8, device=device),
                                                               None, None, 1e-5)
    assert y.dtype == dt
    assert z.dtype == torch.float32  # float32 residual (and float32 on CUDA in any case)
    assert torch.equal(y, torch.ops.fusekit.linear_fwd(x.to(dt), w.to(dt), None, "none", False)[0])


@pytest.mark.parametrize("amp", AUTOCASTS)
def test_torch_compile_under_autocast(amp, seed):
    """torch.compile(fullgraph=True) of fusekit ops under autocast: one graph, eager's results."""
    device, dt = amp
    gen = torch.Generator().manual_seed(seed)
    x, w, b = leaf(gen, (4, 16), device), leaf(gen, (32, 16), device), leaf(gen, (32,), device)
    lw = leaf(gen, (32,), device)

    def fn(x, w, b, lw):
        with torch.autocast(device, dtype=dt):
            h = fk.linear(x, w, b, "silu")
            return fk.layer_norm(h, (32,), lw), fk.rms_norm(h, (32,), lw)

    compiled, graphs = compile_recording_graphs(fn, device)
    got = compiled(x, w, b, lw)
    want = fn(x, w, b, lw)
    assert len(graphs) == 1
    assert got[1].dtype == dt  # the linear ran in the autocast dtype, rms_norm kept it
    for g, e in zip(got, want):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_mixed_dtypes_outside_autocast_are_refused(seed):
    """Outside autocast a float32 x with a bfloat16 weight is still the caller's error: only
    autocast casts."""
    gen = torch.Generator().manual_seed(seed)
    x, w = leaf(gen, (4, 16), "cpu"), leaf(gen, (8, 16), "cpu", dtype=torch.bfloat16)
    with pytest.raises(fusekit.InvalidArgumentError, match="expected dtype f32"):
        fk.linear(x, w)
