"""fusekit.torch.bias_act_dropout against PyTorch float64 with the documented mask (reproduced
through fusekit.dropout_keep_mask, itself checked against a NumPy Philox in
test_numpy_bias_act_dropout.py): outputs and gradients on both eager paths, the custom-op
registration (opcheck), torch.compile(fullgraph=True) and error reporting. Runs on the CPU backend
and again on CUDA where a GPU is present."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the fusekit.torch tests need it")
import fusekit  # noqa: E402
import fusekit.torch as fk  # noqa: E402
from torch_testing import (DEVICES, DTYPES, assert_one_graph_calling, check_error,  # noqa: E402
                           check_opcheck, compile_counting_graph_breaks, compile_recording_graphs)

F = torch.nn.functional
SLOPE = 0.05
ACTIVATIONS = {
    "none": lambda h: h,
    "relu": F.relu,
    "gelu_erf": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "squared_relu": lambda h: F.relu(h).square(),
    "leaky_relu": lambda h: F.leaky_relu(h, SLOPE),
    "silu": F.silu,
}


def keep_factor(shape, p, seed, offset, device):
    """keep / (1 - p) in float64, the mask from the documented mapping."""
    if p == 0.0:
        return torch.ones(shape, dtype=torch.float64, device=device)
    mask = np.empty(int(np.prod(shape)), np.uint8)
    fusekit.dropout_keep_mask(seed, offset, p, mask)
    keep = torch.from_numpy(mask.astype(np.float64)).reshape(shape).to(device)
    return keep / (1.0 - float(np.float32(p)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("p", [0.0, 0.25])
def test_matches_float64_with_documented_mask(device, dtype_name, activation, p, path, seed):
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    shape = (4, 33, 96) if device == "cuda" else (3, 7, 40)
    x = (torch.randn(shape, generator=gen) * 1.5).to(device, dtype).requires_grad_(True)
    bias = torch.randn(shape[-1], generator=gen).to(device, dtype).requires_grad_(True)
    dy = torch.randn(shape, generator=gen).to(device, dtype)
    rseed, offset = seed * 7919 + 1, seed % 1000
    y = fk.bias_act_dropout(x, bias, activation, p, seed=rseed, offset=offset, slope=SLOPE)
    y.backward(dy)

    x64 = x.detach().double().requires_grad_(True)
    b64 = bias.detach().double().requires_grad_(True)
    y64 = ACTIVATIONS[activation](x64 + b64) * keep_factor(shape, p, rseed, offset, device)
    y64.backward(dy.double())
    assert y.dtype == dtype and y.shape == x.shape
    check_error("y", y, y64, dtype_name)
    check_error("dx", x.grad, x64.grad, dtype_name)
    check_error("dbias", bias.grad, b64.grad, dtype_name)
    if p > 0:
        dropped = keep_factor(shape, p, rseed, offset, device) == 0
        assert dropped.any() and (y.detach()[dropped] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_eval_seed_and_float32_bias(device, seed):
    x = torch.randn(8, 64, device=device, dtype=torch.bfloat16)
    bias = torch.randn(64, device=device, requires_grad=True)  # float32 bias with bf16 x
    y = fk.bias_act_dropout(x, bias, "gelu_tanh", 0.5, training=False)
    ref = F.gelu(x.double() + bias.detach().double(), approximate="tanh")
    check_error("y (eval)", y, ref, "bf16")
    y.float().sum().backward()
    assert bias.grad.dtype == torch.float32
    torch.manual_seed(seed)
    a = fk.bias_act_dropout(x, None, "relu", 0.5)
    torch.manual_seed(seed)
    b = fk.bias_act_dropout(x, None, "relu", 0.5)
    c = fk.bias_act_dropout(x, None, "relu", 0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("device", DEVICES)
def test_custom_op_registration(device):
    torch.manual_seed(0)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    b = torch.randn(16, device=device, requires_grad=True)
    dy = torch.randn(4, 16, device=device)
    ops = torch.ops.fusekit
    cases = [
        (ops.bias_act_dropout_fwd.default, (x, b, "gelu_erf", 0.3, torch.tensor(11), 2, 0.01)),
        (ops.bias_act_dropout_fwd.default, (x, None, "silu", 0.0, torch.tensor(0), 0, 0.01)),
        (ops.bias_act_dropout_bwd.default, (dy, x.detach(), b.detach(), "relu", 0.3, torch.tensor(11), 2, 0.01, True, True)),
        (ops.bias_act_dropout_bwd.default, (dy, x.detach(), None, "none", 0.1, torch.tensor(-5), 0, 0.01, True, False)),
    ]
    check_opcheck(cases)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_draws_fresh_seeds_without_graph_breaks(device, seed):
    """seed=None under torch.compile: the seed is drawn by an op of the graph (no .item(), zero
    graph breaks), so every run gets a fresh mask, torch.manual_seed reproduces the runs, and the
    backward regenerates the forward's mask."""
    def f(x, b):
        return fk.bias_act_dropout(x, b, "relu", 0.5)

    gen = torch.Generator().manual_seed(seed)
    x = (torch.rand(16, 128, generator=gen) + 1).to(device).requires_grad_(True)
    b = torch.rand(128, generator=gen).to(device).requires_grad_(True)  # x + b > 0: relu passes
    compiled, graphs, graph_breaks = compile_counting_graph_breaks(f, device)
    torch.manual_seed(seed)
    y1 = compiled(x, b)
    y2 = compiled(x, b)
    torch.manual_seed(seed)
    y3 = compiled(x, b)
    assert graph_breaks() == 0 and len(graphs) == 1
    assert not torch.equal(y1 != 0, y2 != 0)  # a fresh mask every run
    assert torch.equal(y1, y3)
    keep = (y1 != 0).float()
    assert 0.3 < keep.mean().item() < 0.7
    y1.backward(torch.ones_like(y1))
    torch.testing.assert_close(x.grad, keep * 2.0, rtol=0, atol=0)  # 1 / (1 - p) where kept
    if device == "cpu":  # the CPU generator's draw is the eager path's: the same mask
        torch.manual_seed(seed)
        assert torch.equal(f(x, b), y1)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device, seed):
    torch._dynamo.reset()

    def f(x, b):
        return fk.bias_act_dropout(x, b, "gelu_tanh", 0.2, seed=1234, offset=3).square().sum()

    x = torch.randn(16, 128, device=device, requires_grad=True)
    b = torch.randn(128, device=device, requires_grad=True)
    compiled, graphs = compile_recording_graphs(f, device)
    loss = compiled(x, b)
    loss.backward()
    gx, gb = x.grad.clone(), b.grad.clone()
    x.grad, b.grad = None, None
    loss_eager = f(x, b)
    loss_eager.backward()
    assert_one_graph_calling(graphs, "fusekit.bias_act_dropout_fwd")
    torch.testing.assert_close(loss, loss_eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gb, b.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_errors_surface_as_exceptions(device, path):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'p'"):
        fk.bias_act_dropout(x, None, "relu", 1.0, seed=1)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'activation'"):
        fk.bias_act_dropout(x, None, "gelu", 0.1, seed=1)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'bias'"):
        fk.bias_act_dropout(x, torch.randn(9, device=device), "relu", 0.1, seed=1)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_module(device, seed):
    """fk.Dropout: torch.nn.Dropout's interface; in training each element is 0 or x / (1 - p),
    about a fraction p dropped, the gradient through the same mask; identity in eval mode."""
    torch.manual_seed(seed)
    m = fk.Dropout(p=0.25)
    assert isinstance(m, torch.nn.Dropout) and m.p == 0.25 and list(m.state_dict()) == []
    x = (torch.rand(64, 256, device=device) + 0.5).requires_grad_(True)
    y = m(x)
    kept = y != 0
    assert torch.allclose(y[kept], x.detach()[kept] / 0.75, rtol=1e-6)
    assert abs(1.0 - kept.double().mean().item() - 0.25) < 0.02
    (dx,) = torch.autograd.grad(y, (x,), torch.ones_like(y))
    assert torch.equal(dx != 0, kept) and torch.allclose(dx[kept], torch.full_like(dx[kept], 1 / 0.75))
    assert not torch.equal(m(x), y)  # a fresh mask per call
    m.eval()
    assert torch.equal(m(x), x)
    torch.manual_seed(seed)
    a = fk.Dropout(0.5)(x)
    torch.manual_seed(seed)
    assert torch.equal(fk.Dropout(0.5)(x), a)  # torch.manual_seed reproduces the masks


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["relu", "gelu_tanh", "silu"])
def test_bias_act_dropout_module(device, activation, seed):
    torch.manual_seed(seed)
    m = fk.BiasActDropout(128, activation, p=0.0, device=device, dtype=torch.float32)
    assert list(m.state_dict()) == ["bias"] and m.bias.shape == (128,)
    m.bias.data.normal_()
    x = torch.randn(16, 128, device=device, requires_grad=True)
    y = m(x)
    x64, b64 = x.detach().double().requires_grad_(True), m.bias.detach().double().requires_grad_(True)
    y64 = ACTIVATIONS[activation](x64 + b64)
    check_error("y", y, y64, "f32")
    dy = torch.randn_like(y)
    dx, db = torch.autograd.grad(y, (x, m.bias), dy)
    dx64, db64 = torch.autograd.grad(y64, (x64, b64), dy.double())
    check_error("dx", dx, dx64, "f32")
    check_error("dbias", db, db64, "f32")
    nobias = fk.BiasActDropout(128, activation, p=0.1, bias=False, device=device)
    assert nobias.bias is None and list(nobias.state_dict()) == []
    nobias.eval()
    check_error("y (no bias, eval)", nobias(x), ACTIVATIONS[activation](x64), "f32")
    with pytest.raises(fusekit.InvalidArgumentError, match="'p'"):
        fk.BiasActDropout(128, p=1.0)
