"""fusekit.torch.Linear / fusekit.torch.linear against PyTorch (float64 as the reference; fusekit's
error at most twice PyTorch's own in the same dtype): outputs and gradients on both eager paths,
state_dict compatibility with torch.nn.Linear, the custom-op registration (opcheck),
torch.compile(fullgraph=True) and error reporting. Runs on the CPU backend and again on CUDA where a
GPU is present."""
import importlib

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the fusekit.torch tests need it")
import fusekit  # noqa: E402
import fusekit.torch as fk  # noqa: E402
from torch_testing import (DEVICES, DTYPES, check_compiled_model, check_opcheck,  # noqa: E402
                           check_vs_pytorch, cuda_only)

# The module (fusekit.torch.linear is the function of that name).
_linear_module = importlib.import_module("fusekit.torch.linear")

F = torch.nn.functional
ACTIVATIONS = {
    "none": lambda h: h,
    "relu": F.relu,
    "gelu_erf": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "squared_relu": lambda h: F.relu(h).square(),
    "silu": F.silu,
}


def run(fn, x, dout, params):
    x = x.detach().clone().requires_grad_(True)
    for p in params:
        p.grad = None
    y = fn(x)
    y.backward(dout.to(y.dtype))
    return y, x.grad, [p.grad for p in params]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_module_matches_pytorch(device, dtype_name, activation, bias, path, seed):
    dtype = DTYPES[dtype_name]
    torch.manual_seed(seed)
    k, n, lead = (256, 384, (4, 64)) if device == "cuda" else (48, 40, (3, 5))
    ref = torch.nn.Linear(k, n, bias=bias, device=device, dtype=dtype)
    ours = fk.Linear(k, n, bias=bias, activation=activation, device=device, dtype=dtype)
    assert list(ours.state_dict()) == list(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    ref64 = torch.nn.Linear(k, n, bias=bias, device=device, dtype=torch.float64)
    ref64.load_state_dict({key: v.double() for key, v in ref.state_dict().items()})
    act = ACTIVATIONS[activation]
    x = torch.randn(*lead, k, device=device, dtype=dtype)
    dout = torch.randn(*lead, n, device=device, dtype=dtype)
    y, dx, g = run(ours, x, dout, list(ours.parameters()))
    y_t, dx_t, g_t = run(lambda t: act(ref(t)), x, dout, list(ref.parameters()))
    y_64, dx_64, g_64 = run(lambda t: act(ref64(t)), x.double(), dout.double(), list(ref64.parameters()))
    assert y.dtype == dtype and y.shape == (*lead, n)
    check_vs_pytorch("y", y, y_t, y_64, dtype_name)
    check_vs_pytorch("dx", dx, dx_t, dx_64, dtype_name)
    for name, a, b, c in zip(["dweight", "dbias"], g, g_t, g_64):
        assert a.dtype == dtype
        check_vs_pytorch(name, a, b, c, dtype_name)


@pytest.mark.parametrize("device", DEVICES)
def test_functional_inference_and_partial_gradients(device, seed, path):
    torch.manual_seed(seed)
    x = torch.randn(6, 32, device=device)
    w = torch.randn(16, 32, device=device, requires_grad=True)
    b = torch.randn(16, device=device)
    with torch.no_grad():
        torch.testing.assert_close(fk.linear(x, w, b, "relu"), F.relu(F.linear(x, w, b)))
    y = fk.linear(x, w, b, fusekit.Activation.silu)
    y.sum().backward()
    w_ref = w.detach().clone().requires_grad_(True)
    F.silu(F.linear(x, w_ref, b)).sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-4, atol=1e-5)


@cuda_only
def test_eager_allocations_are_freed(seed):
    """fusekit.torch allocates outputs, gradients and workspace inside fusekit._C (through
    PyTorch's allocator): all of it must go back once the tensors and the graph are gone."""
    torch.manual_seed(seed)
    x = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    m = fk.Linear(96, 80, activation="gelu_tanh", device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # warm the allocator's caches (and create the .grad tensors)
        m(x).float().sum().backward()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    for _ in range(20):
        m(x).float().sum().backward()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == start


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_arguments(device, seed, path):
    """Transposed x and weight, a strided bias and a non-contiguous upstream gradient: made
    contiguous inside fusekit._C on either route; both as F.linear."""
    torch.manual_seed(seed)
    x = torch.randn(32, 6, device=device).t().requires_grad_(True)  # (6, 32), not contiguous
    w = torch.randn(32, 16, device=device).t().requires_grad_(True)  # (16, 32)
    b = torch.randn(32, device=device)[::2].requires_grad_(True)  # (16), stride 2
    y = fk.linear(x, w, b, "relu")
    dy = torch.randn(16, 6, device=device).t()  # (6, 16), not contiguous
    y.backward(dy)
    refs = [t.detach().clone().requires_grad_(True) for t in (x, w, b)]
    y_ref = F.relu(F.linear(*refs))
    y_ref.backward(dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    for got, ref in zip((x, w, b), refs):
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-4, atol=1e-5)


class Conv1DLike(torch.nn.Module):
    """Hugging Face's Conv1D: weight stored (in_features, out_features), y = x W + b."""

    def __init__(self, n_in, n_out, device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_in, n_out, device=device) / n_in**0.5)
        self.bias = torch.nn.Parameter(torch.randn(n_out, device=device))

    def forward(self, x):
        return fk.linear(x, self.weight.t(), self.bias, "gelu_tanh")


@pytest.mark.parametrize("device", DEVICES)
def test_weight_stored_transposed(device, seed, path):
    """A (K, N) weight through its transposed view (HF Conv1D): F.linear's results and a (K, N)
    gradient, on both routes."""
    torch.manual_seed(seed)
    m = Conv1DLike(32, 48, device)
    x = torch.randn(3, 5, 32, device=device)
    dy = torch.randn(3, 5, 48, device=device)
    y, dx, (dw, db) = run(m, x, dy, [m.weight, m.bias])
    refs = [t.detach().clone().requires_grad_(True) for t in (m.weight, m.bias)]
    y_ref, dx_ref, (dw_ref, db_ref) = run(
        lambda t: F.gelu(torch.addmm(refs[1], t.reshape(-1, 32), refs[0]).view(3, 5, 48),
                         approximate="tanh"), x, dy, refs)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    for got, ref in ((dx, dx_ref), (dw, dw_ref), (db, db_ref)):
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_weight_stored_transposed(device, seed):
    torch.manual_seed(seed)
    torch._dynamo.reset()
    model = torch.nn.Sequential(Conv1DLike(64, 96, device), fk.Linear(96, 64, activation="none", device=device))
    check_compiled_model(model, torch.randn(4, 16, 64, device=device), device, "fusekit.linear_fwd")


@pytest.mark.parametrize("device", DEVICES)
def test_transposed_weight_is_read_in_place(device, seed):
    """Where fusekit's linear takes (K, N) weights, nothing copies them: no copy or clone runs in
    the forward or the backward, and the (K, N) parameter's gradient is contiguous."""
    torch.manual_seed(seed)
    m = Conv1DLike(64, 32, device)
    x = torch.randn(8, 64, device=device, requires_grad=True)
    dy = torch.randn(8, 32, device=device)  # contiguous: nothing else to copy
    with torch.profiler.profile() as prof:
        m(x).backward(dy)
    names = {e.name for e in prof.events()}
    assert not names & {"aten::copy_", "aten::clone", "aten::contiguous"}, sorted(names)
    assert m.weight.grad.shape == (64, 32) and m.weight.grad.is_contiguous()


def test_module_interface():
    m = fk.Linear(8, 4)
    assert isinstance(m, torch.nn.Linear) and m.activation == "gelu_tanh"
    assert "activation=gelu_tanh" in repr(m)
    assert fk.Linear(8, 4, bias=False, activation="none").bias is None
    assert torch.nn.Linear not in fk.DROP_INS  # a fused activation changes what the module computes


@pytest.mark.parametrize("device", DEVICES)
def test_custom_op_registration(device):
    torch.manual_seed(0)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    w = torch.randn(8, 16, device=device, requires_grad=True)
    b = torch.randn(8, device=device, requires_grad=True)
    dout = torch.randn(4, 8, device=device)
    pre = torch.randn(4, 8, device=device)
    wt = torch.randn(16, 8, device=device).t().requires_grad_(True)
    ops = torch.ops.fusekit
    cases = [
        (ops.linear_fwd.default, (x, w, b, "gelu_tanh", True)),
        (ops.linear_fwd.default, (x, w, None, "none", False)),
        (ops.linear_bwd.default, (dout, x.detach(), w.detach(), pre, "silu", True, True, True)),
        (ops.linear_bwd.default, (dout, x.detach(), w.detach(), None, "none", False, True, False)),
        (ops.linear_fwd.default, (x, wt, b, "relu", True)),  # a (K, N) weight's transposed view
        (ops.linear_bwd.default, (dout, x.detach(), wt.detach(), pre, "relu", True, True, True)),
    ]
    check_opcheck(cases)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device, seed):
    torch.manual_seed(seed)
    torch._dynamo.reset()
    model = torch.nn.Sequential(fk.Linear(64, 128, activation="squared_relu", device=device),
                                fk.Linear(128, 64, activation="none", device=device))
    x = torch.randn(4, 16, 64, device=device)
    check_compiled_model(model, x, device, "fusekit.linear_fwd")


@pytest.mark.parametrize("device", DEVICES)
def test_errors_surface_as_exceptions(device, path):
    m = fk.Linear(8, 4, device=device)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'weight'"):
        m(torch.randn(2, 9, device=device))
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'activation'"):
        fk.linear(torch.randn(2, 8, device=device), m.weight, None, "leaky_relu")
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'activation'"):
        fk.Linear(8, 4, activation="tanh", device=device)(torch.randn(2, 8, device=device))
