"""Helpers of the fusekit.torch tests (import after pytest.importorskip("torch"))."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fk_testing import ACCUMULATION_FLOOR

HAS_CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
#: Every test runs on the CPU backend, and again on CUDA where a GPU is present.
DEVICES = ["cpu", pytest.param("cuda", marks=cuda_only)]
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class _Forwarding(TorchDispatchMode):
    """A dispatch mode that runs every op unchanged."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def custom_op_route():
    """A context in which fusekit.torch's functional forms and modules call the registered custom
    ops (torch.ops.fusekit.*), as under any tracing mode, instead of the eager path."""
    return _Forwarding()


def rel(a, ref):
    """Relative L2 error of `a` against `ref`, both compared in float64 on the CPU; fails on a
    shape mismatch or a non-finite value."""
    a, ref = a.detach().double().cpu(), ref.detach().double().cpu()
    assert a.shape == ref.shape, f"shape {tuple(a.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def check_error(name, got, ref64, dtype_name, baseline=0.0, floors=ACCUMULATION_FLOOR):
    """rel(got, ref64) <= 2 * max(baseline, rounding, floors[dtype_name]), rounding being the
    error of the float64 reference ref64 merely rounded to got's dtype (the tolerance rule of
    fk_testing.check_close). Returns the error."""
    err = rel(got, ref64)
    rounding = rel(ref64.to(got.dtype), ref64)
    bar = 2.0 * max(baseline, rounding, floors[dtype_name])
    assert err <= bar, (f"{name} ({dtype_name}): fusekit {err:.3e} > bar {bar:.3e} "
                        f"(baseline {baseline:.3e}, rounding {rounding:.3e})")
    return err


def check_vs_pytorch(name, got, torch_same_dtype, ref64, dtype_name, floors=ACCUMULATION_FLOOR):
    """check_error with PyTorch's own error in the same dtype (torch_same_dtype against ref64) as
    the baseline; torch_same_dtype None: no baseline."""
    baseline = rel(torch_same_dtype, ref64) if torch_same_dtype is not None else 0.0
    return check_error(name, got, ref64, dtype_name, baseline, floors)


def compile_recording_graphs(fn, device):
    """torch.compile(fn, fullgraph=True) with a backend that records each graph it is given:
    Inductor on CUDA; on the CPU the AOT-autograd path without Inductor's C++ build. Returns
    (the compiled fn, the list the graphs go into)."""
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        backend = "inductor" if device == "cuda" else "aot_eager"
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    return torch.compile(fn, backend=recording_backend, fullgraph=True), graphs


def compile_counting_graph_breaks(fn, device):
    """torch.compile(fn) without fullgraph, so that a graph break is counted instead of raised,
    with compile_recording_graphs' backend. Returns (the compiled fn, the list the graphs go into,
    a function giving the number of graph breaks since this call)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        backend = "inductor" if device == "cuda" else "aot_eager"
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    return (torch.compile(fn, backend=recording_backend), graphs,
            lambda: sum(counters["graph_break"].values()))


def assert_one_graph_calling(graphs, *ops):
    """fullgraph: one graph (no breaks), calling each custom op of `ops` ("fusekit.<op>")."""
    assert len(graphs) == 1
    targets = {str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"}
    for op in ops:
        assert any(op in t for t in targets), (op, targets)


def check_compiled_model(model, x, device, *ops):
    """`model` under torch.compile(fullgraph=True): one graph calling each custom op of `ops`, and
    the output and parameter gradients (of y.square().mean()) of eager mode."""
    compiled, graphs = compile_recording_graphs(model, device)
    y = compiled(x)
    y.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    y_eager = model(x)
    y_eager.square().mean().backward()
    assert_one_graph_calling(graphs, *ops)
    torch.testing.assert_close(y, y_eager, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-5)


def check_opcheck(cases):
    """torch.library.opcheck passes for each (op, args) of `cases`."""
    for op, args in cases:
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)
