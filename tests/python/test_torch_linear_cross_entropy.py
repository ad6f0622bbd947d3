"""fusekit.torch.linear_cross_entropy against the PyTorch expression it replaces,
F.cross_entropy(F.linear(h, W, b).float(), t, ...): the loss and the gradients of h, W and b
against that expression in float64 (with PyTorch's own error in the same dtype as the baseline) on
both eager paths, every reduction (a per-row upstream gradient for 'none', a scalar other than 1
otherwise), ignored rows, label smoothing, the z-loss against its formula, no bias, leading
dimensions, partial gradients, the recomputation in chunks behind reduction 'none', the custom-op
registration (opcheck), torch.compile(fullgraph=True), the LinearCrossEntropyLoss module and error
reporting. Runs on the CPU backend and again on CUDA where a GPU is present (CUDA graph capture,
run-to-run bitwise equality and memory only there)."""
import importlib

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the fusekit.torch tests need it")
import fusekit  # noqa: E402
import fusekit.torch as fk  # noqa: E402
from torch_testing import (DEVICES, DTYPES, assert_one_graph_calling, check_error,  # noqa: E402
                           check_opcheck, check_vs_pytorch, compile_recording_graphs, cuda_only, rel)

F = torch.nn.functional
# The module (fusekit.torch.linear_cross_entropy the attribute is the function).
lce_module = importlib.import_module("fusekit.torch.linear_cross_entropy")
REDUCTIONS = ["none", "mean", "sum"]


def shape_for(device):
    """(tokens, vocabulary, hidden): small on the CPU backend (its float64 reference is slow)."""
    return (256, 3001, 128) if device == "cuda" else (24, 67, 16)


def make_inputs(device, dtype, tokens, vocab, hidden, bias, seed, ignore_index=-100, ignored=0.2):
    """Fresh random h (T, H), W (V, H) scaled so that the logits spread over a few units, b (V) or
    None, and targets with about `ignored` of the rows ignored (row 0 always counted)."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    w = (torch.randn(vocab, hidden, generator=gen) * (2.0 / hidden ** 0.5)).to(device, dtype)
    b = (torch.randn(vocab, generator=gen) * 0.5).to(device, dtype) if bias else None
    t = torch.randint(0, vocab, (tokens,), generator=gen)
    t[torch.rand(tokens, generator=gen) < ignored] = ignore_index
    t[0] = 1 if ignore_index != 1 else 2
    return h, w, b, t.to(device)


def upstream(loss, reduction, seed):
    """A gradient for the loss: random per row for 'none', a scalar other than 1 otherwise."""
    gen = torch.Generator().manual_seed(seed + 1)
    if reduction == "none":
        return torch.randn(loss.shape, generator=gen).to(loss.device)
    return torch.tensor(1.75, device=loss.device)


def expression(h, w, b, t, reduction, ignore_index=-100, label_smoothing=0.0, z_loss=0.0):
    """The PyTorch expression fusekit's op replaces, in h's dtype up to the float32 logits; the
    z-loss (no PyTorch expression) written out: z * lse^2 per row not ignored, reduced as the loss."""
    logits = F.linear(h, w, b)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    kw = dict(ignore_index=ignore_index, label_smoothing=label_smoothing)
    if not z_loss:
        return F.cross_entropy(logits, t, reduction=reduction, **kw)
    counted = t != ignore_index
    rows = F.cross_entropy(logits, t, reduction="none", **kw)
    rows = rows + z_loss * torch.logsumexp(logits, 1).square() * counted
    return {"none": rows, "sum": rows.sum(), "mean": rows.sum() / counted.sum()}[reduction]


def run_expression(h, w, b, t, reduction, dy, dtype=None, **options):
    """(loss, dh, dW, db) of `expression` on copies of the inputs in `dtype` (h's by default)."""
    dtype = dtype or h.dtype
    leaves = [x.detach().to(dtype).requires_grad_(True) if x is not None else None for x in (h, w, b)]
    loss = expression(*leaves, t, reduction, **options)
    loss.backward(dy.to(loss.dtype))
    return (loss,) + tuple(x.grad if x is not None else None for x in leaves)


def check_against_pytorch(h, w, b, t, reduction, dtype_name, seed, **options):
    """fusekit's loss and gradients against the float64 expression, bar: twice PyTorch's own error
    in the same dtype (or the dtype's rounding / accumulation floor, whichever is larger)."""
    leaves = [x.requires_grad_(True) if x is not None else None for x in (h, w, b)]
    loss = fk.linear_cross_entropy(leaves[0], leaves[1], t, leaves[2], reduction=reduction, **options)
    assert loss.dtype == torch.float32
    assert loss.shape == (t.shape if reduction == "none" else ())
    dy = upstream(loss, reduction, seed)
    loss.backward(dy)
    ref = run_expression(h, w, b, t, reduction, dy, torch.float64, **options)
    same = run_expression(h, w, b, t, reduction, dy, **options)
    check_vs_pytorch("loss", loss, same[0], ref[0], dtype_name)
    for name, leaf, r, s in zip(("dhidden", "dweight", "dbias"), leaves, ref[1:], same[1:]):
        if leaf is None:
            continue
        assert leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape, name
        check_vs_pytorch(name, leaf.grad, s, r, dtype_name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing,ignore_index", [(0.0, -100), (0.1, -100), (0.0, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_pytorch(device, dtype_name, reduction, label_smoothing, ignore_index, bias, path, seed):
    h, w, b, t = make_inputs(device, DTYPES[dtype_name], *shape_for(device), bias, seed, ignore_index)
    check_against_pytorch(h, w, b, t, reduction, dtype_name, seed, ignore_index=ignore_index,
                          label_smoothing=label_smoothing)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", ["f32", "bf16"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_z_loss_adds_z_lse_squared(device, dtype_name, reduction, path, seed):
    h, w, b, t = make_inputs(device, DTYPES[dtype_name], *shape_for(device), True, seed)
    check_against_pytorch(h, w, b, t, reduction, dtype_name, seed, label_smoothing=0.05, z_loss=1e-2)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_float64_on_the_cpu(reduction, path, seed):
    """float64 inputs (the CPU backend only): the gradients stay float64 end to end (the options
    are float32 in fusekit's config: values exact in float32 here)."""
    h, w, b, t = make_inputs("cpu", torch.float64, 24, 67, 16, True, seed)
    leaves = [x.requires_grad_(True) for x in (h, w, b)]
    options = dict(label_smoothing=0.125, z_loss=2.0 ** -10)
    loss = fk.linear_cross_entropy(h, w, t, b, reduction=reduction, **options)
    dy = upstream(loss, reduction, seed)
    loss.backward(dy)
    ref = run_expression(h, w, b, t, reduction, dy, **options)
    torch.testing.assert_close(loss.double(), ref[0], rtol=1e-6, atol=1e-6)  # the loss is float32
    for leaf, r in zip(leaves, ref[1:]):
        assert leaf.grad.dtype == torch.float64
        torch.testing.assert_close(leaf.grad, r, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_leading_dimensions(device, reduction, path, seed):
    """h (B, S, H) with targets (B, S): the loss for 'none' has the targets' shape, dh h's."""
    tokens, vocab, hidden = shape_for(device)
    h, w, b, t = make_inputs(device, torch.float32, tokens, vocab, hidden, True, seed)
    h3, t3 = h.reshape(4, tokens // 4, hidden), t.reshape(4, tokens // 4)
    h3.requires_grad_(True)
    loss = fk.linear_cross_entropy(h3, w, t3, b, reduction=reduction, label_smoothing=0.1)
    assert loss.shape == (t3.shape if reduction == "none" else ())
    dy = upstream(loss, reduction, seed)
    loss.backward(dy)
    ref = run_expression(h, w, b, t, reduction, dy.reshape(-1) if reduction == "none" else dy,
                         torch.float64, label_smoothing=0.1)
    check_error("loss", loss.reshape(ref[0].shape), ref[0], "f32")
    assert h3.grad.shape == h3.shape
    check_error("dhidden", h3.grad.reshape(tokens, hidden), ref[1], "f32")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_ignored_batch_gives_zero(device, reduction, path, seed):
    h, w, b, _ = make_inputs(device, torch.bfloat16, 8, 40, 16, True, seed)
    t = torch.full((8,), -100, device=device)
    for x in (h, w, b):
        x.requires_grad_(True)
    loss = fk.linear_cross_entropy(h, w, t, b, reduction=reduction, z_loss=1e-3)
    assert torch.equal(loss, torch.zeros_like(loss))  # PyTorch's mean: NaN
    loss.backward(torch.ones_like(loss))
    for x in (h, w, b):
        assert torch.equal(x.grad, torch.zeros_like(x)), x.shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_loss_only_and_partial_gradients(device, reduction, path, seed):
    """Without gradients the loss is the same as with them; with only some inputs requiring grad,
    those gradients are the full call's and the others stay None."""
    h, w, b, t = make_inputs(device, torch.float32, *shape_for(device), True, seed)
    with torch.no_grad():
        loss_only = fk.linear_cross_entropy(h, w, t, b, reduction=reduction, label_smoothing=0.1)
    full = [x.clone().requires_grad_(True) for x in (h, w, b)]
    loss = fk.linear_cross_entropy(*full[:2], t, full[2], reduction=reduction, label_smoothing=0.1)
    assert torch.equal(loss_only, loss.detach())
    dy = upstream(loss, reduction, seed)
    loss.backward(dy)
    for wanted in range(3):
        leaves = [x.clone().requires_grad_(i == wanted) for i, x in enumerate((h, w, b))]
        part = fk.linear_cross_entropy(*leaves[:2], t, leaves[2], reduction=reduction, label_smoothing=0.1)
        part.backward(dy)
        for i, leaf in enumerate(leaves):
            if i != wanted:
                assert leaf.grad is None
            else:
                check_error(f"gradient {i} alone", leaf.grad, full[i].grad.double(), "f32")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", ["f32", "bf16"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_recomputation_in_chunks(device, dtype_name, reduction, seed, monkeypatch):
    """linear_cross_entropy_bwd (reduction 'none', or any gradient the forward did not compute)
    over several chunks of rows, the last one shorter: the same gradients as the float64
    expression within the tolerance, dW and db accumulated over the chunks in float32."""
    dtype = DTYPES[dtype_name]
    tokens, vocab, hidden = shape_for(device)
    tokens += 5  # uneven chunks
    h, w, b, t = make_inputs(device, dtype, tokens, vocab, hidden, True, seed)
    monkeypatch.setattr(lce_module, "RECOMPUTE_CHUNK_BYTES", (tokens // 3) * vocab * h.element_size())
    assert lce_module._chunk_rows(tokens, vocab, h.element_size()) < tokens
    dy = torch.randn(tokens if reduction == "none" else (), device=device)
    got = lce_module.linear_cross_entropy_bwd(dy, h, w, b, t, -100, 0.1, 1e-3, reduction, True, True, True)
    ref = run_expression(h, w, b, t, reduction, dy, torch.float64, label_smoothing=0.1, z_loss=1e-3)
    same = run_expression(h, w, b, t, reduction, dy, label_smoothing=0.1, z_loss=1e-3)
    for name, g, r, s, x in zip(("dhidden", "dweight", "dbias"), got, ref[1:], same[1:], (h, w, b)):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        check_vs_pytorch(name, g, s, r, dtype_name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_backward_runs_again_with_retain_graph(device, reduction, path, seed):
    h, w, b, t = make_inputs(device, torch.float32, *shape_for(device), True, seed)
    leaves = [x.requires_grad_(True) for x in (h, w, b)]
    loss = fk.linear_cross_entropy(h, w, t, b, reduction=reduction)
    first = torch.autograd.grad(loss, leaves, torch.ones_like(loss), retain_graph=True)
    second = torch.autograd.grad(loss, leaves, torch.full_like(loss, 2.0))
    for g1, g2 in zip(first, second):
        torch.testing.assert_close(g2, 2 * g1)


@pytest.mark.parametrize("device", DEVICES)
def test_custom_op_registration(device):
    torch.manual_seed(0)
    h = torch.randn(6, 8, device=device, requires_grad=True)
    w = torch.randn(20, 8, device=device, requires_grad=True)
    b = torch.randn(20, device=device, requires_grad=True)
    t = torch.tensor([1, 2, -100, 19, 0, 3], device=device)
    t3 = torch.tensor([1, 2, 3, 19, 0, 3], device=device)  # ignore_index 3: every target valid
    ops = torch.ops.fusekit
    cases = [
        (ops.linear_cross_entropy_fwd.default, (h, w, b, t, -100, 0.1, 1e-3, "mean", True, True, True)),
        (ops.linear_cross_entropy_fwd.default, (h, w, None, t, -100, 0.0, 0.0, "sum", True, False, False)),
        (ops.linear_cross_entropy_fwd.default, (h, w, b, t3, 3, 0.0, 1e-4, "none", False, False, False)),
        (ops.linear_cross_entropy_bwd.default, (torch.randn(6, device=device), h.detach(), w.detach(),
                                                b.detach(), t, -100, 0.1, 0.0, "none", True, True, True)),
        (ops.linear_cross_entropy_bwd.default, (torch.tensor(2.0, device=device), h.detach(), w.detach(),
                                                None, t, -100, 0.0, 1e-3, "mean", True, True, False)),
    ]
    check_opcheck(cases)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", ["f32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_compile_fullgraph(device, dtype_name, reduction, seed):
    """One graph (zero graph breaks) calling the custom op; loss and gradients as in eager mode."""
    torch._dynamo.reset()
    row_weights = torch.rand(shape_for(device)[0], device=device)

    def f(h, w, b, t):
        loss = fk.linear_cross_entropy(h, w, t, b, label_smoothing=0.1, z_loss=1e-4, reduction=reduction)
        return (loss * row_weights).sum() if reduction == "none" else loss * 0.75

    h, w, b, t = make_inputs(device, DTYPES[dtype_name], *shape_for(device), True, seed)
    leaves = [x.requires_grad_(True) for x in (h, w, b)]
    compiled, graphs = compile_recording_graphs(f, device)
    loss = compiled(h, w, b, t)
    loss.backward()
    grads = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    loss_eager = f(h, w, b, t)
    loss_eager.backward()
    assert_one_graph_calling(graphs, "fusekit.linear_cross_entropy_fwd")
    torch.testing.assert_close(loss, loss_eager, rtol=1e-6, atol=1e-6)
    for g, x in zip(grads, leaves):
        assert g.dtype == x.dtype
        assert rel(g, x.grad) <= (1e-6 if dtype_name == "f32" else 8e-3)  # bf16: within a rounding


@pytest.mark.parametrize("device", DEVICES)
def test_linear_cross_entropy_loss_module(device, seed):
    h, w, b, t = make_inputs(device, torch.float32, *shape_for(device), True, seed, ignore_index=5)
    m = fk.LinearCrossEntropyLoss(ignore_index=5, label_smoothing=0.1, z_loss=1e-3, reduction="sum")
    assert list(m.state_dict()) == [] and list(m.parameters()) == []
    assert repr(m) == "LinearCrossEntropyLoss(ignore_index=5, label_smoothing=0.1, z_loss=0.001, reduction=sum)"
    got = m(h, w, t, b)
    ref = expression(h.double(), w.double(), b.double(), t, "sum", ignore_index=5, label_smoothing=0.1,
                     z_loss=1e-3)
    check_error("loss", got, ref, "f32")
    assert torch.equal(fk.LinearCrossEntropyLoss()(h, w, t), fk.linear_cross_entropy(h, w, t))
    assert fk.LinearCrossEntropyLoss(reduction=fusekit.LossReduction.none).reduction == "none"
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'reduction'"):
        fk.LinearCrossEntropyLoss(reduction="avg")


@pytest.mark.parametrize("device", DEVICES)
def test_errors_surface_as_exceptions(device, path):
    h = torch.randn(4, 8, device=device)
    w = torch.randn(10, 8, device=device)
    t = torch.tensor([1, 2, 3, 4], device=device)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'label_smoothing'"):
        fk.linear_cross_entropy(h, w, t, label_smoothing=1.0)
    with pytest.raises(fusekit.InvalidArgumentError,
                       match=r"^fusekit\.linear_cross_entropy: argument 'reduction'"):
        fk.linear_cross_entropy(h, w, t, reduction="avg")
    with pytest.raises(fusekit.ArgumentTypeError,
                       match="argument 'reduction' must be fusekit.LossReduction or str, not NoneType"):
        fk.linear_cross_entropy(h, w, t, reduction=None)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'weight'"):
        fk.linear_cross_entropy(h, w[:, :6], t)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'weight'"):
        fk.linear_cross_entropy(h, w.to(torch.bfloat16), t)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'targets'"):
        fk.linear_cross_entropy(h, w, t[:3])
    if device == "cpu":  # the GPU marks such a row NaN instead (no synchronization to check)
        with pytest.raises(fusekit.InvalidArgumentError, match="argument 'targets'"):
            fk.linear_cross_entropy(h, w, torch.tensor([1, 2, 10, 0]))
    else:
        assert torch.isnan(fk.linear_cross_entropy(h, w, torch.tensor([1, 2, 10, 0], device=device)))


# ---- CUDA only --------------------------------------------------------------------------------
def training_step(h, w, b, t, reduction="mean"):
    loss = fk.linear_cross_entropy(h, w, t, b, reduction=reduction, label_smoothing=0.1)
    (loss.sum() if reduction == "none" else loss).backward()
    return loss


@cuda_only
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cuda_graph_capture(reduction, seed):
    h, w, b, t = make_inputs("cuda", torch.bfloat16, 1024, 8192, 256, True, seed)
    leaves = [x.requires_grad_(True) for x in (h, w, b)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: cuBLASLt's plan choice, the allocator's pools
        for _ in range(2):
            training_step(h, w, b, t, reduction)
    torch.cuda.current_stream().wait_stream(side)
    for x in leaves:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = training_step(h, w, b, t, reduction)
    graph.replay()
    torch.cuda.synchronize()
    captured = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    eager_loss = training_step(h, w, b, t, reduction)
    assert torch.equal(static_loss, eager_loss)
    for g, x in zip(captured, leaves):
        if reduction == "mean":  # fusekit's kernels alone: bitwise
            assert torch.equal(g, x.grad)
        else:  # the recomputation's PyTorch GEMMs, captured on another stream: within a rounding
            assert rel(g, x.grad) <= 8e-3


@cuda_only
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_bitwise_reproducible(reduction, seed):
    h, w, b, t = make_inputs("cuda", torch.bfloat16, 1024, 8192, 256, True, seed)
    runs = []
    for _ in range(3):
        leaves = [x.detach().clone().requires_grad_(True) for x in (h, w, b)]
        loss = training_step(*leaves, t, reduction)
        runs.append([loss] + [x.grad for x in leaves])
    for other in runs[1:]:
        assert all(torch.equal(a, c) for a, c in zip(runs[0], other))


@cuda_only
def test_eager_allocations_are_freed(seed):
    h, w, b, t = make_inputs("cuda", torch.bfloat16, 512, 4096, 256, True, seed)
    leaves = [x.requires_grad_(True) for x in (h, w, b)]
    for _ in range(3):  # warm the allocator's caches (and create the .grad tensors)
        training_step(h, w, b, t)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    for _ in range(10):
        training_step(h, w, b, t)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == start
    assert all(x.grad is not None for x in leaves)


@cuda_only
def test_peak_memory_stays_below_the_logits(seed):
    """A training step's extra memory (mean, bf16): well under the bf16 (T, V) logits an unfused
    layer keeps (here 1 GiB; fusekit's chunk is at most 512 MiB, plus dW in float32)."""
    tokens, vocab, hidden = 8192, 65536, 512
    h, w, _, t = make_inputs("cuda", torch.bfloat16, tokens, vocab, hidden, False, seed)
    h.requires_grad_(True)
    w.requires_grad_(True)
    training_step(h, w, None, t)  # warm-up; creates the .grad tensors
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    training_step(h, w, None, t)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - start
    logits = tokens * vocab * 2
    assert extra < logits, f"peak {extra / 2**20:.0f} MiB over the step, logits {logits / 2**20:.0f} MiB"
