"""fusekit.torch.gated_linear / GatedLinear against the PyTorch expression it replaces,
F.linear(x, W, b) split into gate and up by the layout, then act(gate) * up (float64 as the
reference; fusekit's error at most twice PyTorch's own in the same dtype): outputs and the
gradients of x, W and b on both eager paths, both layouts, with and without a bias; the module;
the custom-op registration (opcheck), torch.compile(fullgraph=True) and error reporting. Runs on
the CPU backend and again on CUDA where a GPU is present."""
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the fusekit.torch tests need it")
import fusekit  # noqa: E402
import fusekit.torch as fk  # noqa: E402
from torch_testing import (DEVICES, DTYPES, check_compiled_model, check_opcheck,  # noqa: E402
                           check_vs_pytorch)

F = torch.nn.functional
ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "gelu_erf": F.gelu,
    "relu": F.relu,
}
LAYOUTS = ["interleaved", "halves"]


def expression(x, weight, bias, activation, layout):
    """The PyTorch code gated_linear replaces."""
    pre = F.linear(x, weight, bias)
    gate, up = pre.chunk(2, dim=-1) if layout == "halves" else (pre[..., 0::2], pre[..., 1::2])
    return ACTIVATIONS[activation](gate) * up


def grads(fn, tensors, dy):
    """fn(*leaves) and the gradients of the leaves (detached copies of `tensors`; None stays None)
    against dy."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in tensors]
    y = fn(*leaves)
    y.backward(dy.to(y.dtype))
    return y, [t.grad if t is not None else None for t in leaves]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_functional_matches_pytorch(device, dtype_name, activation, layout, bias, path, seed):
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    lead, k, f = ((4, 64), 256, 192) if device == "cuda" else ((3, 5), 48, 20)
    x = torch.randn(*lead, k, generator=gen).to(device, dtype)
    w = (torch.randn(2 * f, k, generator=gen) * 1.5 / k ** 0.5).to(device, dtype)
    b = torch.randn(2 * f, generator=gen).to(device, dtype) if bias else None
    dy = torch.randn(*lead, f, generator=gen).to(device, dtype)
    y, g = grads(lambda *t: fk.gated_linear(*t, activation=activation, layout=layout), [x, w, b], dy)
    y_t, g_t = grads(lambda *t: expression(*t, activation, layout), [x, w, b], dy)
    y_64, g_64 = grads(lambda *t: expression(*t, activation, layout),
                       [x.double(), w.double(), b.double() if bias else None], dy.double())
    assert y.dtype == dtype and y.shape == (*lead, f)
    check_vs_pytorch("y", y, y_t, y_64, dtype_name)
    for name, a, b_, c in zip(("dx", "dweight", "dbias"), g, g_t, g_64):
        if c is None:
            assert a is None
            continue
        assert a.dtype == dtype and a.shape == c.shape
        check_vs_pytorch(name, a, b_, c, dtype_name)


def test_float64_on_the_cpu_is_the_reference(seed, path):
    """float64 CPU tensors run the float64 reference: PyTorch's float64 expression up to the order
    of the sums."""
    gen = torch.Generator().manual_seed(seed)
    x, w, b = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((6, 16), (24, 16), (24,)))
    dy = torch.randn(6, 12, generator=gen, dtype=torch.float64)
    y, g = grads(lambda *t: fk.gated_linear(*t, "gelu_erf", "halves"), [x, w, b], dy)
    y_ref, g_ref = grads(lambda *t: expression(*t, "gelu_erf", "halves"), [x, w, b], dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for a, r in zip(g, g_ref):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_inference_and_partial_gradients(device, seed, path):
    torch.manual_seed(seed)
    x = torch.randn(6, 32, device=device)
    w = torch.randn(16, 32, device=device, requires_grad=True)
    b = torch.randn(16, device=device)
    with torch.no_grad():
        torch.testing.assert_close(fk.gated_linear(x, w, b, "relu"), expression(x, w, b, "relu", "interleaved"))
    y = fk.gated_linear(x, w, b, fusekit.Activation.silu, fusekit.GatedLayout.halves)
    y.square().sum().backward()
    # Against float64: no further from it than twice PyTorch's own float32 expression (elementwise
    # bounds on a few-term sum of products fail on cancellation at random seeds).
    w_ref = w.detach().clone().requires_grad_(True)
    expression(x, w_ref, b, "silu", "halves").square().sum().backward()
    w64 = w.detach().double().requires_grad_(True)
    expression(x.double(), w64, b.double(), "silu", "halves").square().sum().backward()
    error = (w.grad.double() - w64.grad).norm()
    torch_error = (w_ref.grad.double() - w64.grad).norm()
    assert error <= 2 * torch_error + 1e-6 * w64.grad.norm(), (error, torch_error)


@pytest.mark.parametrize("device", DEVICES)
def test_op_without_saved_pre_activation_still_differentiates(device, seed):
    """torch.ops.fusekit.gated_linear_fwd called directly with save_pre_activation=False: its
    backward computes the pre-activation again and gives the same gradients."""
    torch.manual_seed(seed)
    x, w, b = (torch.randn(*s, device=device, requires_grad=True) for s in ((5, 24), (16, 24), (16,)))
    dy = torch.randn(5, 8, device=device)
    y, pre = torch.ops.fusekit.gated_linear_fwd(x, w, b, "gelu_tanh", "interleaved", False)
    assert pre.shape == (0,)
    got = torch.autograd.grad(y, (x, w, b), dy)
    want = torch.autograd.grad(expression(x, w, b, "gelu_tanh", "interleaved"), (x, w, b), dy)
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_arguments(device, seed, path):
    """Transposed x, a weight that is the transposed view of a (K, 2F) matrix, a strided bias and a
    non-contiguous upstream gradient, on either route; the gradient of the (K, 2F) matrix is its
    own shape."""
    torch.manual_seed(seed)
    x = torch.randn(32, 6, device=device).t().requires_grad_(True)  # (6, 32), not contiguous
    stored = torch.randn(32, 16, device=device, requires_grad=True)  # (K, 2F)
    b = torch.randn(32, device=device)[::2].requires_grad_(True)  # (16), stride 2
    dy = torch.randn(8, 6, device=device).t()  # (6, 8), not contiguous
    y = fk.gated_linear(x, stored.t(), b, "silu", "halves")
    y.backward(dy)
    refs = [t.detach().clone().requires_grad_(True) for t in (x, stored, b)]
    expression(refs[0], refs[1].t(), refs[2], "silu", "halves").backward(dy)
    torch.testing.assert_close(y, expression(x, stored.t(), b, "silu", "halves"), rtol=1e-4, atol=1e-5)
    for got, ref in zip((x, stored, b), refs):
        assert got.grad.shape == ref.grad.shape
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_module_is_a_gated_mlps_gate_and_up_projections(device, layout, seed):
    """GatedLinear with the weights of two nn.Linear (gate_proj, up_proj) stacked in its layout
    computes act_fn(gate_proj(x)) * up_proj(x), HF LlamaMLP's inner expression, and its parameter
    gradients are theirs, stacked the same way."""
    torch.manual_seed(seed)
    gate_proj = torch.nn.Linear(24, 40, bias=True, device=device)
    up_proj = torch.nn.Linear(24, 40, bias=True, device=device)
    m = fk.GatedLinear(24, 40, activation="silu", layout=layout, device=device)
    assert list(m.state_dict()) == ["weight", "bias"] and m.weight.shape == (80, 24)

    def stack(a, b):
        return torch.cat((a, b)) if layout == "halves" else torch.stack((a, b), dim=1).flatten(0, 1)

    with torch.no_grad():
        m.weight.copy_(stack(gate_proj.weight, up_proj.weight))
        m.bias.copy_(stack(gate_proj.bias, up_proj.bias))
    x = torch.randn(3, 7, 24, device=device)
    dy = torch.randn(3, 7, 40, device=device)
    y = m(x)
    y.backward(dy)
    y_ref = F.silu(gate_proj(x)) * up_proj(x)
    y_ref.backward(dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.weight.grad, stack(gate_proj.weight.grad, up_proj.weight.grad),
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(m.bias.grad, stack(gate_proj.bias.grad, up_proj.bias.grad), rtol=1e-4, atol=1e-5)


def test_module_interface():
    m = fk.GatedLinear(64, 32)
    assert (m.activation, m.layout, m.bias.shape) == ("silu", "interleaved", (64,))
    assert "in_features=64, out_features=32, bias=True, activation=silu, layout=interleaved" in repr(m)
    # torch.nn.Linear's initialization: uniform in +-1/sqrt(in_features).
    bound = 64 ** -0.5
    assert m.weight.abs().max() <= bound and m.bias.abs().max() <= bound
    assert m.weight.abs().max() > 0.9 * bound  # spread over the interval, not a constant
    m = fk.GatedLinear(8, 4, bias=False, activation=fusekit.Activation.gelu_tanh,
                       layout=fusekit.GatedLayout.halves, dtype=torch.float64)
    assert m.bias is None and m.weight.dtype == torch.float64
    assert (m.activation, m.layout) == ("gelu_tanh", "halves")
    assert m(torch.randn(2, 8, dtype=torch.float64)).shape == (2, 4)


@pytest.mark.parametrize("device", DEVICES)
def test_custom_op_registration(device):
    torch.manual_seed(0)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    w = torch.randn(12, 16, device=device, requires_grad=True)
    b = torch.randn(12, device=device, requires_grad=True)
    wt = torch.randn(16, 12, device=device).t().requires_grad_(True)  # a (K, 2F) weight's transposed view
    dy = torch.randn(4, 6, device=device)
    pre = torch.randn(4, 12, device=device)
    ops = torch.ops.fusekit
    cases = [
        (ops.gated_linear_fwd.default, (x, w, b, "silu", "interleaved", True)),
        (ops.gated_linear_fwd.default, (x, w, None, "gelu_erf", "halves", False)),
        (ops.gated_linear_fwd.default, (x, wt, b, "relu", "halves", True)),
        (ops.gated_linear_bwd.default, (dy, x.detach(), w.detach(), pre, "gelu_tanh", "interleaved", True, True,
                                        True)),
        (ops.gated_linear_bwd.default, (dy, x.detach(), w.detach(), pre, "silu", "halves", False, True, False)),
        (ops.gated_linear_bwd.default, (dy, x.detach(), wt.detach(), pre, "relu", "interleaved", True, True,
                                        True)),
    ]
    check_opcheck(cases)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device, seed):
    torch.manual_seed(seed)
    torch._dynamo.reset()
    model = torch.nn.Sequential(fk.GatedLinear(64, 96, activation="gelu_tanh", device=device),
                                fk.Linear(96, 64, activation="none", device=device),
                                fk.GatedLinear(64, 32, bias=False, layout="halves", device=device))
    x = torch.randn(4, 16, 64, device=device)
    check_compiled_model(model, x, device, "fusekit.gated_linear_fwd", "fusekit.linear_fwd")


@pytest.mark.parametrize("device", DEVICES)
def test_errors_surface_as_exceptions(device, path):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'weight': expected an even number of rows"):
        fk.gated_linear(x, torch.randn(5, 8, device=device))
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'weight'"):
        fk.GatedLinear(9, 4, device=device)(x)
    for bad in ("none", "leaky_relu"):
        with pytest.raises(fusekit.InvalidArgumentError, match="argument 'activation': expected silu, gelu_tanh"):
            fk.gated_linear(x, torch.randn(6, 8, device=device), None, bad)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'activation'"):
        fk.GatedLinear(8, 4, activation="swiglu", device=device)(x)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'layout'"):
        fk.gated_linear(x, torch.randn(6, 8, device=device), layout="split")
    with pytest.raises(fusekit.ArgumentTypeError,
                       match="argument 'layout' must be fusekit.GatedLayout or str, not int"):
        fk.gated_linear(x, torch.randn(6, 8, device=device), layout=1)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'bias'"):
        fk.gated_linear(x, torch.randn(6, 8, device=device), torch.randn(3, device=device))

