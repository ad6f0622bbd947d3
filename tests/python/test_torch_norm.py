"""fusekit.torch's LayerNorm / RMSNorm against PyTorch itself: outputs and gradients of the
drop-ins vs torch.nn.LayerNorm / RMSNorm (float64 PyTorch as the reference; fusekit's error at
most twice PyTorch's own in the same dtype), gradcheck, the custom-op registration (opcheck),
torch.compile(fullgraph=True), CUDA graph capture, streams and error reporting.

Every test runs on the CPU backend where PyTorch is installed and again on CUDA where a GPU is
present. Gradcheck runs in float32 with loose tolerances: fusekit takes float32/float16/bfloat16
activations only (no float64 kernels, on the CPU backend either), see test_float64_is_rejected."""
import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the fusekit.torch tests need it")
import fusekit  # noqa: E402
import fusekit.torch as fk  # noqa: E402
from fk_testing import ACCUMULATION_FLOOR  # noqa: E402
from torch_testing import (DEVICES, DTYPES, HAS_CUDA, check_compiled_model,  # noqa: E402
                           check_opcheck, check_vs_pytorch, cuda_only, custom_op_route, rel)


MODULES = {
    "LayerNorm": (torch.nn.LayerNorm, fk.LayerNorm, {}),
    "LayerNorm-no-bias": (torch.nn.LayerNorm, fk.LayerNorm, {"bias": False}),
    "LayerNorm-no-affine": (torch.nn.LayerNorm, fk.LayerNorm, {"elementwise_affine": False}),
    "LayerNorm-2d-shape": (torch.nn.LayerNorm, fk.LayerNorm, {"shape2d": True}),
    "RMSNorm": (torch.nn.RMSNorm, fk.RMSNorm, {"eps": 1e-6}),
    "RMSNorm-default-eps": (torch.nn.RMSNorm, fk.RMSNorm, {}),
    "RMSNorm-no-affine": (torch.nn.RMSNorm, fk.RMSNorm, {"elementwise_affine": False}),
}


def make_modules(name, n, device, dtype, seed):
    torch_class, fk_class, kwargs = MODULES[name]
    kwargs = dict(kwargs)
    shape = (4, n // 4) if kwargs.pop("shape2d", False) else n
    gen = torch.Generator().manual_seed(seed)
    ref = torch_class(shape, **kwargs, device=device, dtype=dtype)
    with torch.no_grad():
        for p in ref.parameters():  # away from zero and one, so that mistakes show
            p.copy_((torch.rand(p.shape, generator=gen) + 0.5) * torch.randn(p.shape, generator=gen).sign())
    ours = fk_class(shape, **kwargs, device=device, dtype=dtype)
    assert list(ours.state_dict()) == list(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    ref64 = torch_class(shape, **kwargs, device=device, dtype=torch.float64)
    ref64.load_state_dict({k: v.double() for k, v in ref.state_dict().items()})
    return ref, ours, ref64


def run(module, x, dy):
    x = x.detach().clone().requires_grad_(True)
    y = module(x)
    y.backward(dy.to(y.dtype))
    grads = {n: p.grad for n, p in module.named_parameters()}
    return y, x.grad, grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("name", list(MODULES))
def test_drop_in_matches_pytorch(device, dtype_name, name, path, seed):
    dtype = DTYPES[dtype_name]
    n = 1024 if device == "cuda" else 256
    lead = (8, 64) if device == "cuda" else (3, 17)
    ref, ours, ref64 = make_modules(name, n, device, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn(*lead, *ref.normalized_shape, generator=gen) * 2 + 0.3).to(device, dtype)
    dy = torch.randn(x.shape, generator=gen).to(device, dtype)
    y, dx, grads = run(ours, x, dy)
    y_t, dx_t, grads_t = run(ref, x, dy)
    y_64, dx_64, grads_64 = run(ref64, x.double(), dy.double())
    assert y.dtype == dtype and y.shape == x.shape
    check_vs_pytorch("y", y, y_t, y_64, dtype_name)
    check_vs_pytorch("dx", dx, dx_t, dx_64, dtype_name)
    for pname in grads_64:
        assert grads[pname].dtype == dtype
        check_vs_pytorch(f"d{pname}", grads[pname], grads_t[pname], grads_64[pname], dtype_name)


@pytest.mark.parametrize("device", DEVICES)
def test_both_paths_give_identical_results(device, seed):
    torch.manual_seed(seed)
    m = fk.LayerNorm(64, device=device, dtype=torch.bfloat16)
    x = torch.randn(5, 64, device=device, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    y1, dx1, g1 = run(m, x, dy)
    m.zero_grad()
    with custom_op_route():
        y2, dx2, g2 = run(m, x, dy)
    assert torch.equal(y1, y2) and torch.equal(dx1, dx2)
    assert all(torch.equal(g1[k], g2[k]) for k in g1)


@pytest.mark.parametrize("device", DEVICES)
def test_inference_and_partial_gradients(device, seed, path):
    """No grad recorded; gradients for a subset of the inputs only."""
    torch.manual_seed(seed)
    ref = torch.nn.LayerNorm(32, device=device)
    ours = fk.LayerNorm(32, device=device)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(6, 32, device=device)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x))
    with torch.inference_mode():
        torch.testing.assert_close(ours(x), ref(x))
    ours.weight.requires_grad_(False)
    xg = x.clone().requires_grad_(True)
    ours(xg).sum().backward()
    assert ours.weight.grad is None and ours.bias.grad is not None and xg.grad is not None
    xr = x.clone().requires_grad_(True)
    ref(xr).sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_input_and_mixed_precision(device, seed, path):
    torch.manual_seed(seed)
    base = torch.randn(16, 8, device=device, dtype=torch.bfloat16)
    x = base.t()  # (8, 16), last dimension strided
    w = torch.randn(16, device=device, dtype=torch.float32, requires_grad=True)
    b = torch.randn(16, device=device, dtype=torch.float32, requires_grad=True)
    y = fk.layer_norm(x, (16,), w, b, 1e-5)
    assert y.dtype == torch.bfloat16 and y.is_contiguous()
    ref = torch.nn.functional.layer_norm(x.double(), (16,), w.double(), b.double(), 1e-5)
    assert rel(y, ref) <= 2 * max(rel(ref.to(torch.bfloat16), ref), ACCUMULATION_FLOOR["bf16"])
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    torch.testing.assert_close(b.grad, torch.full_like(b, 8.0))


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_float32(device, path):
    """float32 gradcheck (fusekit has no float64 kernels): finite differences with eps=1e-3 in
    float32 are accurate to ~1e-4, hence atol/rtol 2e-3."""
    torch.manual_seed(0)
    x = torch.randn(3, 8, device=device, requires_grad=True)
    w = (torch.rand(8, device=device) + 0.5).requires_grad_(True)
    b = torch.randn(8, device=device, requires_grad=True)
    kw = dict(eps=1e-3, atol=2e-3, rtol=2e-3, nondet_tol=0.0)
    with pytest.warns(UserWarning, match="double precision"):
        assert torch.autograd.gradcheck(lambda x, w, b: fk.layer_norm(x, (8,), w, b, 1e-5), (x, w, b), **kw)
        assert torch.autograd.gradcheck(lambda x, w: fk.rms_norm(x, (8,), w, 1e-5), (x, w), **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_float64_is_rejected(device):
    x = torch.randn(2, 8, device=device, dtype=torch.float64)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'x': expected dtype f32, f16 or bf16, got f64"):
        fk.layer_norm(x, (8,))


@pytest.mark.parametrize("device", DEVICES)
def test_custom_op_registration(device):
    """torch.library.opcheck: schema, fake (meta) implementations, autograd registration and
    AOT dispatch of every fusekit norm op."""
    torch.manual_seed(0)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    w = torch.randn(16, device=device, requires_grad=True)
    b = torch.randn(16, device=device, requires_grad=True)
    dy = torch.randn(4, 16, device=device)
    mean = torch.randn(4, device=device)
    rstd = torch.rand(4, device=device) + 0.5
    ops = torch.ops.fusekit
    cases = [
        (ops.layer_norm_fwd.default, (x, w, b, 1e-5)),
        (ops.layer_norm_fwd.default, (x, None, None, 1e-5)),
        (ops.rms_norm_fwd.default, (x, w, 1e-5)),
        (ops.layer_norm_bwd.default, (dy, x.detach(), w.detach(), mean, rstd, False, True, True, True)),
        (ops.layer_norm_bwd.default, (dy, x.detach(), None, mean, rstd, False, True, False, False)),
        (ops.rms_norm_bwd.default, (dy, x.detach(), w.detach(), rstd, False, False, True)),
    ]
    check_opcheck(cases)


class Block(torch.nn.Module):
    def __init__(self, n, device, dtype=torch.float32):
        super().__init__()
        self.up = torch.nn.Linear(n, 2 * n, device=device, dtype=dtype)
        self.ln = fk.LayerNorm(2 * n, device=device, dtype=dtype)
        self.down = torch.nn.Linear(2 * n, n, device=device, dtype=dtype)
        self.rms = fk.RMSNorm(n, device=device, dtype=dtype)

    def forward(self, x):
        return self.rms(x + self.down(torch.nn.functional.gelu(self.ln(self.up(x)))))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device, seed):
    torch.manual_seed(seed)
    torch._dynamo.reset()
    model = Block(64, device)
    x = torch.randn(4, 16, 64, device=device)
    check_compiled_model(model, x, device, "fusekit.layer_norm_fwd", "fusekit.rms_norm_fwd")


@cuda_only
def test_cuda_graph_captured_training_step(seed):
    torch.manual_seed(seed)
    model = Block(256, "cuda", torch.bfloat16)
    eager = Block(256, "cuda", torch.bfloat16)
    eager.load_state_dict(model.state_dict())
    static_x = torch.randn(8, 32, 256, device="cuda", dtype=torch.bfloat16)

    def step(m, x):
        loss = m(x).float().square().mean()
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, as CUDA graphs require
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            step(model, static_x)
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(model, static_x)
    for _ in range(2):  # replays on fresh data match eager steps on the same weights
        static_x.copy_(torch.randn_like(static_x))
        graph.replay()
        eager.zero_grad(set_to_none=True)
        loss = step(eager, static_x.clone())
        torch.cuda.synchronize()
        # Stale or missing work would be off by O(1); the matmuls may pick other algorithms
        # under capture, so not bitwise.
        assert rel(static_loss, loss) <= 1e-3
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            assert rel(p.grad, q.grad) <= 2e-2, n


@cuda_only
def test_workspace_auto_and_saved_statistics_are_freed(seed):
    """The eager path's C++-side allocations (workspace='auto', the mean/rstd capsules) come
    from PyTorch's caching allocator and go back to it: the same results as explicit arrays, and
    no memory left allocated after many steps. An explicit stream with 'auto' is refused (the
    memory belongs to the current stream)."""
    torch.manual_seed(seed)
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    y, mean, rstd = torch.empty_like(x), torch.empty(512, device="cuda"), torch.empty(512, device="cuda")
    fusekit.layer_norm_forward(x, w, None, 1e-5, y, mean, rstd)
    dy = torch.randn_like(x)
    grads = [torch.empty_like(x), torch.empty_like(w)]
    fusekit.layer_norm_backward(dy, x, w, mean, rstd, *grads, None, "auto")
    ws = torch.empty(fusekit.norm_backward_workspace_size(512, 1024, fusekit.DType.bf16, "cuda"),
                     dtype=torch.uint8, device="cuda")
    explicit = [torch.empty_like(x), torch.empty_like(w)]
    fusekit.layer_norm_backward(dy, x, w, mean, rstd, *explicit, None, ws)
    assert torch.equal(grads[0], explicit[0]) and torch.equal(grads[1], explicit[1])
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'stream'"):
        fusekit.layer_norm_backward(dy, x, w, mean, rstd, *grads, None, "auto",
                                    torch.cuda.current_stream().cuda_stream)
    xg = x.clone().requires_grad_(True)
    norm_ln, norm_rms = fk.LayerNorm(1024, device="cuda", dtype=torch.bfloat16), \
        fk.RMSNorm(1024, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # warm the allocator's caches
        (norm_ln(xg) + norm_rms(xg)).float().sum().backward()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(50):
        (norm_ln(xg) + norm_rms(xg)).float().sum().backward()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


@cuda_only
def test_runs_on_the_current_stream(seed):
    """Work queued on a side stream: fusekit must run there, after the producer of its input."""
    torch.manual_seed(seed)
    side = torch.cuda.Stream()
    w = torch.randn(4096, device="cuda")
    with torch.cuda.stream(side):
        x = torch.randn(2048, 4096, device="cuda")
        torch.cuda._sleep(10_000_000)  # keep the side stream busy: a default-stream launch would race
        x.add_(1.0)  # (a shift: RMSNorm does not see a scale)
        y = fk.rms_norm(x, (4096,), w, 1e-6)
        y_ref = torch.nn.functional.rms_norm(x, (4096,), w, 1e-6)
    side.synchronize()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)


@cuda_only
def test_core_api_with_explicit_stream(seed):
    torch.manual_seed(seed)
    x = torch.randn(64, 512, device="cuda", dtype=torch.float16)
    y = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    fusekit.rms_norm_forward(x, None, 1e-5, y, stream=stream.cuda_stream)
    stream.synchronize()
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (512,), None, 1e-5), rtol=2e-3, atol=2e-3)


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_second_device_from_the_first(seed):
    torch.manual_seed(seed)
    x = torch.randn(32, 256, device="cuda:1")
    with torch.cuda.device(0):
        y = fk.layer_norm(x, (256,))
    torch.cuda.synchronize(1)
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (256,)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_errors_surface_as_exceptions(device, path):
    m = fk.LayerNorm(8, device=device)
    with pytest.raises(fusekit.InvalidArgumentError, match=r"fusekit\.layer_norm: argument 'x': expected a tensor whose last dimensions are \(8,\)"):
        m(torch.randn(2, 9, device=device))
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'x'"):
        m(torch.ones(2, 8, device=device, dtype=torch.int32))
    with pytest.raises(ValueError, match="argument 'weight'"):  # InvalidArgumentError is a ValueError
        fk.rms_norm(torch.randn(2, 8, device=device), (8,), torch.randn(8, device=device, dtype=torch.float16))
    if device == "cuda":
        with pytest.raises(fusekit.InvalidArgumentError, match="argument 'weight'") as info:
            fk.layer_norm(torch.randn(2, 8, device="cuda"), (8,), torch.randn(8))
        assert "cpu" in str(info.value) and "cuda" in str(info.value)


def test_drop_ins_keep_pytorch_interfaces():
    assert inspect.signature(fk.LayerNorm.__init__) == inspect.signature(torch.nn.LayerNorm.__init__)
    assert inspect.signature(fk.RMSNorm.__init__) == inspect.signature(torch.nn.RMSNorm.__init__)
    assert list(fk.LayerNorm(4).state_dict()) == ["weight", "bias"]
    assert list(fk.LayerNorm(4, bias=False).state_dict()) == ["weight"]
    assert list(fk.RMSNorm(4).state_dict()) == ["weight"]
    assert fk.DROP_INS[torch.nn.LayerNorm] is fk.LayerNorm and fk.DROP_INS[torch.nn.RMSNorm] is fk.RMSNorm


def test_patch_retargets_the_drop_ins(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.RMSNorm(8))
    x = torch.randn(3, 8)
    before = model(x)
    assert [e.name for e in fk.patch(model).patched] == ["1", "2"]
    assert type(model[1]) is fk.LayerNorm and type(model[2]) is fk.RMSNorm
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)


def test_numpy_and_torch_share_memory():
    """The core API reads torch tensors in place (no copies): results land in the given output."""
    x = torch.randn(4, 16)
    y = torch.empty_like(x)
    assert fusekit.tensor_info(x)["data"] == x.data_ptr()
    fusekit.layer_norm_forward(x, None, None, 1e-5, y)
    np.testing.assert_allclose(y.numpy(), torch.nn.functional.layer_norm(x, (16,)).numpy(), rtol=1e-5, atol=1e-5)
    assert fusekit.tensor_info(x[1:])["data"] == x[1:].data_ptr()
    assert fusekit.tensor_info(torch.zeros(2, dtype=torch.bfloat16))["dtype"] == "bf16"
    if hasattr(torch, "float8_e4m3fn"):
        assert fusekit.tensor_info(torch.zeros(2, dtype=torch.float8_e4m3fn))["dtype"] == "f8e4m3"
        assert fusekit.tensor_info(torch.zeros(2, dtype=torch.float8_e5m2))["dtype"] == "f8e5m2"


def test_unexportable_tensors_raise_cleanly():
    """Tensors DLPack cannot describe, or that fusekit does not take, raise InvalidArgumentError
    naming the argument, with PyTorch's reason where PyTorch refused."""
    y = torch.empty(2, 4)
    cases = [torch.empty(2, 4, device="meta"), torch.randn(4, 4).to_sparse(),
             torch.quantize_per_tensor(torch.randn(2, 4), 0.1, 0, torch.qint8),
             torch.zeros(2, 4, dtype=torch.bool), torch.zeros(2, 4, dtype=torch.int16)]
    for x in cases:
        with pytest.raises(fusekit.InvalidArgumentError, match="argument 'x'"):
            fusekit.layer_norm_forward(x, None, None, 1e-5, y)


# ---- residual variants ---------------------------------------------------------------------------
def residual_reference(kind, x, residual, w, b, eps, dtype):
    """PyTorch's (y, sum) with the sum rounded to `dtype` before it is normalized (fusekit's
    contract); float64 inputs give the reference."""
    total = (x + residual).to(dtype)
    n = (total.shape[-1],)
    if kind == "layer_norm":
        return torch.nn.functional.layer_norm(total, n, w, b, eps), total
    return torch.nn.functional.rms_norm(total, n, w, eps), total


def run_residual(fn, x, residual, params, dy, dsum):
    x = x.detach().clone().requires_grad_(True)
    residual = residual.detach().clone().requires_grad_(True)
    params = [p.detach().clone().requires_grad_(True) if p is not None else None for p in params]
    y, total = fn(x, residual, *params)
    torch.autograd.backward([y, total], [dy.to(y.dtype), dsum.to(total.dtype)])
    return y, total, x.grad, residual.grad, [p.grad if p is not None else None for p in params]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_residual_matches_pytorch(device, dtype_name, kind, seed):
    """(y, sum) and the gradients of x, residual, weight (and bias) against PyTorch's unfused
    x + residual then norm, in float64 and in the same dtype."""
    dtype = DTYPES[dtype_name]
    n = 1024 if device == "cuda" else 96
    lead = (8, 64) if device == "cuda" else (3, 7)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, n, generator=gen) * 2 + 0.3).to(device, dtype)
    residual = torch.randn(*lead, n, generator=gen).to(device, dtype)
    w = ((torch.rand(n, generator=gen) + 0.5) * torch.randn(n, generator=gen).sign()).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if kind == "layer_norm" else None
    dy = torch.randn(x.shape, generator=gen).to(device, dtype)
    dsum = torch.randn(x.shape, generator=gen).to(device, dtype)
    eps = 1e-5
    if kind == "layer_norm":
        ours = lambda x, r, w, b: fk.layer_norm_residual(x, r, w, b, eps)  # noqa: E731
    else:
        ours = lambda x, r, w, b: fk.rms_norm_residual(x, r, w, eps)  # noqa: E731
    theirs = lambda x, r, w, b: residual_reference(kind, x, r, w, b, eps, x.dtype)  # noqa: E731
    got = run_residual(ours, x, residual, [w, b], dy, dsum)
    same = run_residual(theirs, x, residual, [w, b], dy, dsum)
    # The float64 reference normalizes the sum rounded to the dtype, as fusekit does.
    total = (x.double() + residual.double()).to(dtype).double()
    ref = run_residual(theirs, total, torch.zeros_like(total), [w.double(), b.double() if b is not None else None],
                       dy.double(), dsum.double())
    y, s, dx, dres, (dw, db) = got
    assert y.dtype == dtype and s.dtype == dtype and y.shape == x.shape
    assert torch.equal(s, (x + residual)), "sum: x + residual rounded once"
    check_vs_pytorch("y", y, same[0], ref[0], dtype_name)
    check_vs_pytorch("dx", dx, same[2], ref[2], dtype_name)
    assert torch.equal(dres, dx), "x and residual get the same gradient"
    check_vs_pytorch("dweight", dw, same[4][0], ref[4][0], dtype_name)
    if b is not None:
        check_vs_pytorch("dbias", db, same[4][1], ref[4][1], dtype_name)


@pytest.mark.parametrize("device", DEVICES)
def test_residual_partial_outputs_and_gradients(device, seed):
    """Only y used (no gradient reaches sum), only sum used, and inputs without requires_grad."""
    torch.manual_seed(seed)
    x = torch.randn(4, 32, device=device, requires_grad=True)
    residual = torch.randn(4, 32, device=device)
    w = (torch.rand(32, device=device) + 0.5).requires_grad_(True)
    y, total = fk.rms_norm_residual(x, residual, w, 1e-5)
    y.sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = w.detach().clone().requires_grad_(True)
    torch.nn.functional.rms_norm(x_ref + residual, (32,), w_ref, 1e-5).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-5)
    x.grad, w.grad = None, None
    y, total = fk.layer_norm_residual(x, residual, w, None, 1e-5)
    (2 * total).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    assert w.grad is None or torch.count_nonzero(w.grad) == 0
    with torch.no_grad():
        y2, total2 = fk.layer_norm_residual(x, residual, w, None, 1e-5)
    torch.testing.assert_close(y2, y.detach())
    torch.testing.assert_close(total2, total.detach())


@pytest.mark.parametrize("device", DEVICES)
def test_residual_gradcheck_float32(device):
    torch.manual_seed(0)
    x = torch.randn(3, 8, device=device, requires_grad=True)
    r = torch.randn(3, 8, device=device, requires_grad=True)
    w = (torch.rand(8, device=device) + 0.5).requires_grad_(True)
    b = torch.randn(8, device=device, requires_grad=True)
    kw = dict(eps=1e-3, atol=2e-3, rtol=2e-3, nondet_tol=0.0)
    with pytest.warns(UserWarning, match="double precision"):
        assert torch.autograd.gradcheck(lambda x, r, w, b: fk.layer_norm_residual(x, r, w, b, 1e-5), (x, r, w, b), **kw)
        assert torch.autograd.gradcheck(lambda x, r, w: fk.rms_norm_residual(x, r, w, 1e-5), (x, r, w), **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_residual_custom_op_registration(device):
    torch.manual_seed(0)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    r = torch.randn(4, 16, device=device, requires_grad=True)
    w = torch.randn(16, device=device, requires_grad=True)
    b = torch.randn(16, device=device, requires_grad=True)
    dy, dsum, total = (torch.randn(4, 16, device=device) for _ in range(3))
    mean = torch.randn(4, device=device)
    rstd = torch.rand(4, device=device) + 0.5
    ops = torch.ops.fusekit
    check_opcheck([
        (ops.layer_norm_residual_fwd.default, (x, r, w, b, 1e-5)),
        (ops.layer_norm_residual_fwd.default, (x, r, None, None, 1e-5)),
        (ops.rms_norm_residual_fwd.default, (x, r, w, 1e-5)),
        (ops.layer_norm_residual_bwd.default, (dy, total, dsum, w.detach(), mean, rstd, False, True, True, True)),
        (ops.layer_norm_residual_bwd.default, (dy, total, None, None, mean, rstd, False, True, False, False)),
        (ops.rms_norm_residual_bwd.default, (dy, total, dsum, w.detach(), rstd, False, True, True)),
    ])


class ResidualBlock(torch.nn.Module):
    """A pre-norm block: h + mlp(norm(h)) with the add and the next norm fused."""

    def __init__(self, n, device):
        super().__init__()
        self.mlp = torch.nn.Linear(n, n, device=device)
        self.ln = fk.LayerNorm(n, device=device)
        self.rms = torch.nn.RMSNorm(n, device=device)

    def forward(self, h):
        y, h = fk.layer_norm_residual(self.mlp(h), h, self.ln.weight, self.ln.bias, self.ln.eps)
        y2, h = fk.rms_norm_residual(self.mlp(y), h, self.rms.weight, 1e-6)
        return y2 + h


@pytest.mark.parametrize("device", DEVICES)
def test_residual_torch_compile_fullgraph(device, seed):
    torch.manual_seed(seed)
    torch._dynamo.reset()
    model = ResidualBlock(64, device)
    x = torch.randn(4, 16, 64, device=device)
    check_compiled_model(model, x, device, "fusekit.layer_norm_residual_fwd", "fusekit.rms_norm_residual_fwd")


@pytest.mark.parametrize("device", DEVICES)
def test_residual_errors_surface_as_exceptions(device):
    x = torch.randn(4, 16, device=device)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'residual'"):
        fk.layer_norm_residual(x, torch.randn(4, 15, device=device))
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'x': expected dtype f32, f16 or bf16"):
        fk.rms_norm_residual(x.double(), x.double())
