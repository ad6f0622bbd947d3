"""fusekit.torch.gated_act / gated_act_separate / GatedMLP against the PyTorch expression
act(gate) * up (float64 as the reference; fusekit's error at most twice PyTorch's own in the same
dtype): outputs and gradients on both eager paths, every layout and the two-tensor form, the
Llama-style MLP against HF LlamaMLP's formula, the custom-op registration (opcheck),
torch.compile(fullgraph=True) and error reporting. Runs on the CPU backend and again on CUDA where
a GPU is present."""
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the fusekit.torch tests need it")
import fusekit  # noqa: E402
import fusekit.torch as fk  # noqa: E402
from torch_testing import (DEVICES, DTYPES, assert_one_graph_calling, check_compiled_model,  # noqa: E402
                           check_opcheck, check_vs_pytorch, compile_recording_graphs)

F = torch.nn.functional
ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "gelu_erf": F.gelu,
    "relu": F.relu,
}


def split(gate_up, layout):
    """PyTorch's view of a gate_up tensor: (gate, up)."""
    if layout == "halves":
        return gate_up.chunk(2, dim=-1)
    return gate_up[..., 0::2], gate_up[..., 1::2]


def grads(fn, inputs, dy):
    """fn(*inputs) and its gradients against dy, the inputs detached copies."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    y = fn(*leaves)
    y.backward(dy.to(y.dtype))
    return y, [t.grad for t in leaves]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("layout", ["halves", "interleaved"])
def test_fused_tensor_matches_pytorch(device, dtype_name, activation, layout, path, seed):
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    lead, f = ((4, 65), 1000) if device == "cuda" else ((3, 5), 37)
    gate_up = (torch.randn(*lead, 2 * f, generator=gen) * 1.5).to(device, dtype)
    dy = torch.randn(*lead, f, generator=gen).to(device, dtype)
    act = ACTIVATIONS[activation]

    def expression(t):
        gate, up = split(t, layout)
        return act(gate) * up

    y, (dgu,) = grads(lambda t: fk.gated_act(t, activation, layout), [gate_up], dy)
    y_t, (dgu_t,) = grads(expression, [gate_up], dy)
    y_64, (dgu_64,) = grads(expression, [gate_up.double()], dy.double())
    assert y.dtype == dtype and y.shape == (*lead, f) and dgu.shape == gate_up.shape
    check_vs_pytorch("y", y, y_t, y_64, dtype_name)
    for part, (a, b, c) in zip(("dgate", "dup"), zip(split(dgu, layout), split(dgu_t, layout), split(dgu_64, layout))):
        check_vs_pytorch(part, a, b, c, dtype_name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_two_tensors_match_pytorch(device, dtype_name, activation, path, seed):
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    shape = (4, 33, 512) if device == "cuda" else (2, 7, 24)
    gate = (torch.randn(shape, generator=gen) * 1.5).to(device, dtype)
    up = torch.randn(shape, generator=gen).to(device, dtype)
    dy = torch.randn(shape, generator=gen).to(device, dtype)
    act = ACTIVATIONS[activation]
    y, (dg, du) = grads(lambda g, u: fk.gated_act_separate(g, u, activation), [gate, up], dy)
    y_t, (dg_t, du_t) = grads(lambda g, u: act(g) * u, [gate, up], dy)
    y_64, (dg_64, du_64) = grads(lambda g, u: act(g) * u, [gate.double(), up.double()], dy.double())
    check_vs_pytorch("y", y, y_t, y_64, dtype_name)
    check_vs_pytorch("dgate", dg, dg_t, dg_64, dtype_name)
    check_vs_pytorch("dup", du, du_t, du_64, dtype_name)


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_views_partial_gradients_and_inference(device, seed, path):
    """gate and up as the halves of one tensor (views with a row stride, taken as they are); a
    gradient for one input only; no_grad calls."""
    torch.manual_seed(seed)
    gate_up = torch.randn(6, 64, device=device, requires_grad=True)
    gate, up = gate_up.chunk(2, dim=-1)
    y = fk.gated_act_separate(gate, up, fusekit.Activation.silu)
    ref = gate_up.detach().clone().requires_grad_(True)
    torch.testing.assert_close(y, F.silu(ref[:, :32]) * ref[:, 32:], rtol=1e-6, atol=1e-6)
    y.square().sum().backward()
    (F.silu(ref[:, :32]) * ref[:, 32:]).square().sum().backward()
    torch.testing.assert_close(gate_up.grad, ref.grad, rtol=1e-5, atol=1e-6)
    frozen_gate = torch.randn(6, 32, device=device)
    up_only = torch.randn(6, 32, device=device, requires_grad=True)
    fk.gated_act_separate(frozen_gate, up_only, "gelu_tanh").sum().backward()
    torch.testing.assert_close(up_only.grad, F.gelu(frozen_gate, approximate="tanh"), rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        x = torch.randn(5, 3, 40, device=device)
        torch.testing.assert_close(fk.gated_act(x, "relu", fusekit.GatedLayout.interleaved),
                                   F.relu(x[..., 0::2]) * x[..., 1::2])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", ["f32", "bf16"])
def test_gated_mlp_matches_llama_mlp_formula(device, dtype_name, seed):
    dtype = DTYPES[dtype_name]
    torch.manual_seed(seed)
    hidden, inter = (256, 688) if device == "cuda" else (32, 72)
    mlp = fk.GatedMLP(hidden, inter, "silu", device=device, dtype=dtype)
    assert list(mlp.state_dict()) == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    ref = {k: v.detach().clone() for k, v in mlp.state_dict().items()}
    x = torch.randn(3, 11, hidden, device=device, dtype=dtype)
    dy = torch.randn(3, 11, hidden, device=device, dtype=dtype)

    def llama_mlp(t, weights):  # HF LlamaMLP.forward: down_proj(act_fn(gate_proj(x)) * up_proj(x))
        return F.linear(F.silu(F.linear(t, weights["gate_proj.weight"])) * F.linear(t, weights["up_proj.weight"]),
                        weights["down_proj.weight"])

    xr = x.detach().clone().requires_grad_(True)
    y = mlp(xr)
    y.backward(dy)
    y_t, (dx_t,) = grads(lambda t: llama_mlp(t, ref), [x], dy)
    ref64 = {k: v.double() for k, v in ref.items()}
    y_64, (dx_64,) = grads(lambda t: llama_mlp(t, ref64), [x.double()], dy.double())
    check_vs_pytorch("y", y, y_t, y_64, dtype_name)
    check_vs_pytorch("dx", xr.grad, dx_t, dx_64, dtype_name)
    # HF's activation names.
    assert fk.GatedMLP(8, 16, "gelu_pytorch_tanh").activation == "gelu_tanh"
    assert fk.GatedMLP(8, 16, "gelu").activation == "gelu_erf"
    with pytest.raises(fusekit.InvalidArgumentError, match="'activation'"):
        fk.GatedMLP(8, 16, "leaky_relu")


@pytest.mark.parametrize("device", DEVICES)
def test_custom_op_registration(device):
    torch.manual_seed(0)
    gate_up = torch.randn(4, 2, 32, device=device, requires_grad=True)
    gate = torch.randn(4, 16, device=device, requires_grad=True)
    up = torch.randn(4, 16, device=device, requires_grad=True)
    dy = torch.randn(4, 16, device=device)
    ops = torch.ops.fusekit
    cases = [
        (ops.gated_act_fwd.default, (gate_up, "silu", "halves")),
        (ops.gated_act_fwd.default, (gate_up, "gelu_erf", "interleaved")),
        (ops.gated_act_bwd.default, (torch.randn(4, 2, 16, device=device), gate_up.detach(), "relu", "interleaved")),
        (ops.gated_act_separate_fwd.default, (gate, up, "gelu_tanh")),
        (ops.gated_act_separate_bwd.default, (dy, gate.detach(), up.detach(), "silu", True, True)),
        (ops.gated_act_separate_bwd.default, (dy, gate.detach(), up.detach(), "silu", False, True)),
    ]
    check_opcheck(cases)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device, seed):
    torch._dynamo.reset()

    def f(gate_up, gate, up):
        return (fk.gated_act(gate_up, "silu", "interleaved").square().sum()
                + fk.gated_act_separate(gate, up, "gelu_tanh").square().sum())

    torch.manual_seed(seed)
    inputs = [torch.randn(16, 256, device=device, requires_grad=True),
              torch.randn(16, 64, device=device, requires_grad=True),
              torch.randn(16, 64, device=device, requires_grad=True)]
    compiled, graphs = compile_recording_graphs(f, device)
    loss = compiled(*inputs)
    loss.backward()
    grads_compiled = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    loss_eager = f(*inputs)
    loss_eager.backward()
    assert_one_graph_calling(graphs, "fusekit.gated_act_fwd", "fusekit.gated_act_separate_fwd")
    torch.testing.assert_close(loss, loss_eager, rtol=1e-5, atol=1e-5)
    for a, t in zip(grads_compiled, inputs):
        torch.testing.assert_close(a, t.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_gated_mlp(device, seed):
    torch._dynamo.reset()
    torch.manual_seed(seed)
    mlp = fk.GatedMLP(64, 160, "gelu_tanh", device=device)
    check_compiled_model(mlp, torch.randn(4, 9, 64, device=device), device, "fusekit.gated_act_separate_fwd")


@pytest.mark.parametrize("device", DEVICES)
def test_errors_surface_as_exceptions(device, path):
    x = torch.randn(2, 16, device=device)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'activation'"):
        fk.gated_act(x, "none")
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'layout'"):
        fk.gated_act(x, "silu", "split")
    with pytest.raises(fusekit.ArgumentTypeError, match="argument 'layout' must be fusekit.GatedLayout or str, not int"):
        fk.gated_act(x, "silu", 0)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'gate_up'"):
        fk.gated_act(torch.randn(2, 15, device=device), "silu")
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'up'"):
        fk.gated_act_separate(x, torch.randn(2, 8, device=device))
