"""fusekit.torch.cross_entropy against PyTorch: the loss and the gradient against
torch.nn.functional.cross_entropy in float64 (with PyTorch's own error in the same dtype as a
baseline) on both eager paths, the z-loss against its formula, ignored rows, the input layouts
PyTorch takes, class weights and probability targets (PyTorch's implementation), the custom-op
registration (opcheck), torch.compile(fullgraph=True), the CrossEntropyLoss drop-in and error
reporting. Runs on the CPU backend and again on CUDA where a GPU is present."""
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the fusekit.torch tests need it")
import fusekit  # noqa: E402
import fusekit.torch as fk  # noqa: E402
from torch_testing import (DEVICES, DTYPES, assert_one_graph_calling, check_error,  # noqa: E402
                           check_opcheck, check_vs_pytorch, compile_recording_graphs)

F = torch.nn.functional
REDUCTIONS = ["none", "mean", "sum"]


def make_inputs(device, dtype, rows, classes, seed, ignore_index=-100, ignored=0.2):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, classes, generator=gen) * 2).to(device, dtype)
    t = torch.randint(0, classes, (rows,), generator=gen)
    t[torch.rand(rows, generator=gen) < ignored] = ignore_index
    t[0] = 1 if ignore_index != 1 else 2  # at least one row counted
    return x, t.to(device)


def upstream(loss, reduction, seed):
    """A gradient for the loss: random per row for 'none', a scalar other than 1 otherwise."""
    gen = torch.Generator().manual_seed(seed + 1)
    if reduction == "none":
        return torch.randn(loss.shape, generator=gen).to(loss.device)
    return torch.tensor(1.75, device=loss.device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing,ignore_index", [(0.0, -100), (0.1, -100), (0.0, 3)])
def test_matches_pytorch(device, dtype_name, reduction, label_smoothing, ignore_index, path, seed):
    dtype = DTYPES[dtype_name]
    rows, classes = (96, 3001) if device == "cuda" else (24, 67)
    x, t = make_inputs(device, dtype, rows, classes, seed, ignore_index)
    kw = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
    x.requires_grad_(True)
    loss = fk.cross_entropy(x, t, **kw)
    assert loss.dtype == torch.float32 and loss.shape == ((rows,) if reduction == "none" else ())
    dy = upstream(loss, reduction, seed)
    loss.backward(dy)

    x64 = x.detach().double().requires_grad_(True)
    ref = F.cross_entropy(x64, t, **kw)
    ref.backward(dy.double())
    xs = x.detach().clone().requires_grad_(True)  # PyTorch in the same dtype: the baseline
    same = F.cross_entropy(xs, t, **kw)
    same.backward(dy.to(same.dtype))
    check_error("loss", loss, ref, "f32", baseline=0.0)
    check_vs_pytorch("dlogits", x.grad, xs.grad, x64.grad, dtype_name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_z_loss_adds_z_lse_squared(device, reduction, path, seed):
    x, t = make_inputs(device, torch.float32, 32, 50, seed)
    x.requires_grad_(True)
    loss = fk.cross_entropy(x, t, reduction=reduction, label_smoothing=0.05, z_loss=1e-2)
    dy = upstream(loss, reduction, seed)
    loss.backward(dy)
    x64 = x.detach().double().requires_grad_(True)
    rows = F.cross_entropy(x64, t, reduction="none", label_smoothing=0.05)
    counted = t != -100
    rows = rows + 1e-2 * torch.logsumexp(x64, 1).square() * counted
    ref = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / counted.sum()}[reduction]
    ref.backward(dy.double())
    check_error("loss", loss, ref, "f32")
    check_error("dlogits", x.grad, x64.grad, "f32")


@pytest.mark.parametrize("device", DEVICES)
def test_all_ignored_batch_gives_zero(device, path, seed):
    x, _ = make_inputs(device, torch.bfloat16, 8, 40, seed)
    t = torch.full((8,), -100, device=device)
    x.requires_grad_(True)
    loss = fk.cross_entropy(x, t)
    assert loss.item() == 0.0  # PyTorch: NaN
    loss.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("device", DEVICES)
def test_input_layouts_as_pytorch(device, seed):
    """(C) with a 0-d target and (N, C, d) with an (N, d) target, as torch.nn.functional takes them."""
    gen = torch.Generator().manual_seed(seed)
    x1 = torch.randn(30, generator=gen).to(device).requires_grad_(True)
    t1 = torch.tensor(7, device=device)
    for reduction in REDUCTIONS:
        got = fk.cross_entropy(x1, t1, reduction=reduction)
        ref = F.cross_entropy(x1.detach().double(), t1, reduction=reduction)
        assert got.shape == ref.shape
        check_error(f"loss (C) {reduction}", got, ref, "f32")
    x3 = torch.randn(4, 30, 5, generator=gen).to(device).requires_grad_(True)
    t3 = torch.randint(0, 30, (4, 5), generator=gen).to(device)
    got = fk.cross_entropy(x3, t3, reduction="none", label_smoothing=0.1)
    x64 = x3.detach().double().requires_grad_(True)
    ref = F.cross_entropy(x64, t3, reduction="none", label_smoothing=0.1)
    assert got.shape == ref.shape == (4, 5)
    dy = torch.randn(4, 5, generator=gen).to(device)
    got.backward(dy)
    ref.backward(dy.double())
    check_error("loss (N, C, d)", got, ref, "f32")
    check_error("dlogits (N, C, d)", x3.grad, x64.grad, "f32")


@pytest.mark.parametrize("device", DEVICES)
def test_class_weights_and_probabilities_run_pytorch(device, seed):
    x, t = make_inputs(device, torch.float32, 16, 10, seed, ignored=0.0)
    w = torch.rand(10, device=device) + 0.5
    torch.testing.assert_close(fk.cross_entropy(x, t, w), F.cross_entropy(x, t, w))
    probs = torch.softmax(torch.randn(16, 10, device=device), 1)
    torch.testing.assert_close(fk.cross_entropy(x, probs), F.cross_entropy(x, probs))
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'z_loss'"):
        fk.cross_entropy(x, t, w, z_loss=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_runs_again_with_retain_graph(device, path, seed):
    x, t = make_inputs(device, torch.float32, 8, 20, seed)
    x.requires_grad_(True)
    loss = fk.cross_entropy(x, t, reduction="sum")
    (g1,) = torch.autograd.grad(loss, x, retain_graph=True)
    (g2,) = torch.autograd.grad(loss, x, torch.tensor(2.0, device=device))
    torch.testing.assert_close(g2, 2 * g1)


@pytest.mark.parametrize("device", DEVICES)
def test_custom_op_registration(device):
    torch.manual_seed(0)
    x = torch.randn(6, 20, device=device, requires_grad=True)
    t = torch.tensor([1, 2, -100, 19, 0, 3], device=device)
    t3 = torch.tensor([1, 2, 3, 19, 0, 3], device=device)  # ignore_index 3: every target valid
    lse = torch.logsumexp(x.detach(), 1).float()
    ops = torch.ops.fusekit
    cases = [
        (ops.cross_entropy_fwd.default, (x, t, -100, 0.1, 1e-3, "mean")),
        (ops.cross_entropy_fwd.default, (x, t3, 3, 0.0, 0.0, "none")),
        (ops.cross_entropy_bwd.default, (torch.tensor(2.0, device=device), x.detach(), t, lse, -100, 0.1, 0.0, "sum")),
        (ops.cross_entropy_fwd_bwd.default, (x, t, -100, 0.0, 1e-4, "mean")),
        (ops.cross_entropy_fwd_bwd.default, (x, t, -100, 0.2, 0.0, "none")),
    ]
    check_opcheck(cases)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device, seed):
    torch._dynamo.reset()

    def f(x, t):
        return fk.cross_entropy(x, t, label_smoothing=0.1, z_loss=1e-4)

    x, t = make_inputs(device, torch.float32, 16, 128, seed)
    x.requires_grad_(True)
    compiled, graphs = compile_recording_graphs(f, device)
    loss = compiled(x, t)
    loss.backward()
    gx = x.grad.clone()
    x.grad = None
    loss_eager = f(x, t)
    loss_eager.backward()
    assert_one_graph_calling(graphs, "fusekit.cross_entropy_fwd")
    torch.testing.assert_close(loss, loss_eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_loss_module(device, seed):
    assert fk.DROP_INS[torch.nn.CrossEntropyLoss] is fk.CrossEntropyLoss
    x, t = make_inputs(device, torch.float32, 12, 30, seed, ignore_index=5)
    m = fk.CrossEntropyLoss(ignore_index=5, label_smoothing=0.1, reduction="sum")
    assert isinstance(m, torch.nn.CrossEntropyLoss) and list(m.state_dict()) == []
    ref = torch.nn.CrossEntropyLoss(ignore_index=5, label_smoothing=0.1, reduction="sum")
    check_error("loss", m(x, t), ref(x.double(), t), "f32")
    model = torch.nn.Sequential(torch.nn.CrossEntropyLoss())
    assert len(fk.patch(model).patched) == 1 and type(model[0]) is fk.CrossEntropyLoss
    check_error("loss (swapped)", model[0](x, t), F.cross_entropy(x.double(), t), "f32")
    z = fk.CrossEntropyLoss(z_loss=1e-3)
    assert "z_loss=0.001" in repr(z)


@pytest.mark.parametrize("device", DEVICES)
def test_errors_surface_as_exceptions(device, path):
    x = torch.randn(4, 8, device=device)
    t = torch.tensor([1, 2, 3, 4], device=device)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'label_smoothing'"):
        fk.cross_entropy(x, t, label_smoothing=1.0)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'reduction'"):
        fk.cross_entropy(x, t, reduction="avg")
    with pytest.raises(fusekit.ArgumentTypeError,
                       match="argument 'reduction' must be fusekit.LossReduction or str, not NoneType"):
        fk.cross_entropy(x, t, reduction=None)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'logits'"):
        fk.cross_entropy(x.double(), t)
    if device == "cpu":  # the GPU marks such a row NaN instead (no synchronization to check)
        with pytest.raises(fusekit.InvalidArgumentError, match="argument 'targets'"):
            fk.cross_entropy(x, torch.tensor([1, 2, 8, 0]))
    else:
        assert torch.isnan(fk.cross_entropy(x, torch.tensor([1, 2, 8, 0], device=device)))
