"""fusekit.torch's FP8 RMSNorm against PyTorch float64: y against the RMSNorm of the dequantized
input, qy * y_scale within FP8 rounding of it, qy_t the transpose of qy bit for bit, dx and dweight
against float64 autograd (at most twice PyTorch's own bfloat16 error); the straight-through
gradient of a float input; the module's interface (torch.nn.RMSNorm's constructor and
state_dict); the custom-op registration (opcheck), torch.compile(fullgraph=True) and error
reporting. Runs on the CPU backend and again on CUDA where a GPU is present."""
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the fusekit.torch tests need it")
import fusekit  # noqa: E402
import fusekit.torch as fk  # noqa: E402
from fk_testing import ACCUMULATION_FLOOR  # noqa: E402
from torch_testing import (DEVICES, assert_one_graph_calling,  # noqa: E402
                           compile_recording_graphs, rel)

F = torch.nn.functional
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
EPS = 1e-6


def dequantize(q, scales, group):
    rows = q.shape[:-1]
    n = q.shape[-1]
    return (q.double().reshape(*rows, n // group, group) * scales.double().unsqueeze(-1)).reshape(q.shape)


def fp8_input(shape, group, fmt, scale_dtype, device, gen):
    q = (torch.randn(shape, generator=gen) * 40).to(FP8[fmt]).to(device)
    scales = torch.exp2(torch.empty(*shape[:-1], shape[-1] // group).uniform_(-6, 2, generator=gen))
    return q, scales.to(scale_dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_fmt,out_fmt", [("e4m3", "e4m3"), ("e5m2", "e5m2"), ("e4m3", "e5m2")])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_fp8_input_matches_float64(device, in_fmt, out_fmt, weight_dtype, path, seed):
    gen = torch.Generator().manual_seed(seed)
    group, shape = 16, (3, 5, 128)
    q, scales = fp8_input(shape, group, in_fmt, torch.bfloat16, device, gen)
    w = (torch.randn(128, generator=gen) * 0.5 + 1).to(weight_dtype).to(device).requires_grad_(True)
    out = fk.fp8_rms_norm(q, 128, w, EPS, x_scales=scales, group_size=group, fp8_dtype=FP8[out_fmt])
    xd = dequantize(q, scales, group)
    y64 = F.rms_norm(xd, (128,), w.detach().double(), EPS)
    # y: bfloat16 of the float32 computation.
    assert out.y.dtype == torch.bfloat16 and out.y.shape == shape
    assert rel(out.y, y64) <= 2 * max(rel(y64.to(torch.bfloat16), y64), ACCUMULATION_FLOOR["bf16"])
    # qy * y_scale: y quantized with one scale, y_scale = max |y| / the format's max.
    fmax = torch.finfo(FP8[out_fmt]).max
    s = out.y_scale
    assert out.y_scale.shape == (1,) and out.y_scale.dtype == torch.float32
    assert abs(s.item() - y64.abs().max().item() / fmax) <= 1e-2 * s.item()
    assert out.qy.dtype == FP8[out_fmt] and out.qy.shape == shape
    rounding = rel((y64 / s.double()).clamp(-fmax, fmax).to(FP8[out_fmt]).double() * s.double(), y64)
    assert rel(out.qy.double() * s.double(), y64) <= 2 * rounding
    # qy_t: (N, M) transpose of qy, bit for bit.
    assert out.qy_t.shape == (128, 15)
    assert torch.equal(out.qy_t.view(torch.uint8), out.qy.reshape(15, 128).t().view(torch.uint8))
    assert not out.qy.requires_grad and not out.y_scale.requires_grad
    # dweight through y (x is FP8: no gradient for it, weight gets one).
    dy = torch.randn(shape, generator=gen).to(torch.bfloat16).to(device)
    (dw,) = torch.autograd.grad(out.y, (w,), dy)
    w64 = w.detach().double().requires_grad_(True)
    (dw64,) = torch.autograd.grad(F.rms_norm(xd, (128,), w64, EPS), (w64,), dy.double())
    w16 = w.detach().to(torch.bfloat16).requires_grad_(True)
    (dw16,) = torch.autograd.grad(F.rms_norm(xd.to(torch.bfloat16), (128,), w16, EPS), (w16,), dy)
    assert dw.dtype == weight_dtype
    assert rel(dw, dw64) <= 2 * max(rel(dw16, dw64), ACCUMULATION_FLOOR["bf16"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_float_input_is_quantized_with_straight_through_gradient(device, x_dtype, path, seed):
    """A float x is quantized in groups (fp8_quantize); dx is the gradient for the dequantized
    input, handed to x unchanged (in x's dtype)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (4, 6, 64)
    x = (torch.randn(shape, generator=gen) * 3).to(x_dtype).to(device).requires_grad_(True)
    w = (torch.randn(64, generator=gen) * 0.5 + 1).to(torch.bfloat16).to(device).requires_grad_(True)
    out = fk.fp8_rms_norm(x, (64,), w, EPS)
    q, scales = fk.fp8_quantize(x.detach())
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (4, 6, 4)
    xd = dequantize(q, scales, 16)
    assert rel(xd, x.detach().double()) <= 0.05  # e4m3 keeps 3 mantissa bits
    dy = torch.randn(shape, generator=gen).to(torch.bfloat16).to(device)
    dx, dw = torch.autograd.grad(out.y, (x, w), dy)
    x64, w64 = xd.clone().requires_grad_(True), w.detach().double().requires_grad_(True)
    dx64, dw64 = torch.autograd.grad(F.rms_norm(x64, (64,), w64, EPS), (x64, w64), dy.double())
    x16, w16 = xd.to(torch.bfloat16).requires_grad_(True), w.detach().requires_grad_(True)
    dx16, dw16 = torch.autograd.grad(F.rms_norm(x16, (64,), w16, EPS), (x16, w16), dy)
    assert dx.dtype == x_dtype and dw.dtype == torch.bfloat16
    assert rel(dx, dx64) <= 2 * max(rel(dx16, dx64), ACCUMULATION_FLOOR["bf16"])
    assert rel(dw, dw64) <= 2 * max(rel(dw16, dw64), ACCUMULATION_FLOOR["bf16"])


@pytest.mark.parametrize("device", DEVICES)
def test_module_has_rmsnorm_interface(device, seed):
    torch.manual_seed(seed)
    ref = torch.nn.RMSNorm(64, eps=1e-5, device=device)
    m = fk.FP8RMSNorm(64, eps=1e-5, device=device, group_size=32, fp8_dtype=torch.float8_e5m2)
    assert isinstance(m, torch.nn.RMSNorm)
    assert list(m.state_dict()) == list(ref.state_dict()) == ["weight"]
    ref.weight.data.uniform_(0.5, 1.5)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(8, 64, device=device)
    out = m(x)
    assert isinstance(out, fk.Fp8RMSNormOutput) and out.qy.dtype == torch.float8_e5m2
    q, s = fk.fp8_quantize(x, 32, torch.float8_e5m2)
    y64 = F.rms_norm(dequantize(q, s, 32), (64,), ref.weight.detach().double(), 1e-5)
    assert rel(out.y, y64) <= 2 * max(rel(y64.to(torch.bfloat16), y64), ACCUMULATION_FLOOR["bf16"])
    out.y.float().sum().backward()
    assert m.weight.grad is not None and m.weight.grad.shape == (64,)
    plain = fk.FP8RMSNorm(64, elementwise_affine=False, device=device)
    assert plain.weight is None and list(plain.state_dict()) == []
    y = plain(x).y
    ref_plain = F.rms_norm(dequantize(*fk.fp8_quantize(x), 16), (64,), None, torch.finfo(torch.float32).eps)
    assert rel(y, ref_plain) <= 2 * max(rel(ref_plain.to(torch.bfloat16), ref_plain), ACCUMULATION_FLOOR["bf16"])
    with pytest.raises(fusekit.InvalidArgumentError, match="fp8_dtype"):
        fk.FP8RMSNorm(64, fp8_dtype=torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_custom_op_registration(device):
    torch.manual_seed(0)
    x = torch.randn(4, 32, device=device)
    q, s = fk.fp8_quantize(x)
    w = torch.randn(32, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(4, 32, device=device, dtype=torch.bfloat16)
    rstd = torch.rand(4, device=device) + 0.5
    ops = torch.ops.fusekit
    # opcheck's schema and AOT-dispatch tests do arithmetic on every input and output, and
    # PyTorch has no FP8 kernels for it: both ops (FP8 inputs or outputs) get the fake-tensor
    # check against the real kernels; the autograd formula and AOT dispatch are exercised by the
    # compile test below.
    forward_cases = [
        (q, s, w, 1e-5, 16, torch.float8_e4m3fn),
        (x.requires_grad_(True), None, w, 1e-5, 16, torch.float8_e5m2),
        (q, s, None, 1e-5, 16, torch.float8_e4m3fn),
    ]
    for args in forward_cases:
        result = torch.library.opcheck(ops.fp8_rms_norm_fwd.default, args, test_utils="test_faketensor")
        assert all(v == "SUCCESS" for v in result.values()), (args, result)
    for args in [(dy, q, s, w.detach(), rstd, 16, True, True), (dy, q, s, None, rstd, 16, True, False)]:
        result = torch.library.opcheck(ops.fp8_rms_norm_bwd.default, args, test_utils="test_faketensor")
        assert all(v == "SUCCESS" for v in result.values()), (args, result)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device, seed):
    torch.manual_seed(seed)
    torch._dynamo.reset()
    norm = fk.FP8RMSNorm(64, device=device, dtype=torch.bfloat16)
    norm.weight.data.uniform_(0.5, 1.5)

    def f(x):
        out = norm(x)
        return out.y.float().square().mean() + out.qy.float().mean() * out.y_scale

    compiled, graphs = compile_recording_graphs(f, device)
    x = torch.randn(4, 8, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    loss = compiled(x)
    loss.backward()
    gx, gw = x.grad.clone(), norm.weight.grad.clone()
    x.grad, norm.weight.grad = None, None
    loss_eager = f(x)
    loss_eager.backward()
    assert_one_graph_calling(graphs, "fusekit.fp8_rms_norm_fwd")
    torch.testing.assert_close(loss, loss_eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, x.grad, rtol=1e-2, atol=1e-5)
    torch.testing.assert_close(gw, norm.weight.grad, rtol=1e-2, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_errors_surface_as_exceptions(device, path):
    q = torch.randn(4, 40, device=device).to(torch.float8_e4m3fn)
    s = torch.ones(4, 2, device=device, dtype=torch.bfloat16)
    w = torch.ones(40, device=device, dtype=torch.bfloat16)
    with pytest.raises(fusekit.InvalidArgumentError, match="fp8_rms_norm") as info:
        fk.fp8_rms_norm(q, 40, w, x_scales=s)  # 40 is not a multiple of 16
    assert info.value.op.startswith("fp8_rms_norm")
    with pytest.raises(fusekit.InvalidArgumentError, match="x_scales"):
        fk.fp8_rms_norm(q[:, :32], 32, w[:32])  # an FP8 x needs its scales
    with pytest.raises(fusekit.InvalidArgumentError, match="normalized_shape"):
        fk.fp8_rms_norm(q, (4, 40), None, x_scales=s)
    with pytest.raises(fusekit.InvalidArgumentError, match="group_size"):
        fk.fp8_quantize(torch.randn(2, 20, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_eager_outputs_distinct_writable_and_freed(device, seed):
    """fusekit.torch allocates y, qy and qy_t in one allocator call (and y_scale, rstd and
    the workspace in another): the outputs must not overlap, writing one must leave the others,
    and every byte must go back to the allocator once the outputs and the graph are gone."""
    gen = torch.Generator().manual_seed(seed)
    q, scales = fp8_input((64, 256), 16, "e4m3", torch.bfloat16, device, gen)
    w = (torch.randn(256, generator=gen) * 0.5 + 1).to(torch.bfloat16).to(device).requires_grad_(True)
    out = fk.fp8_rms_norm(q, 256, w, EPS, x_scales=scales)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in out)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, "two outputs overlap"
    before = [t.detach().clone().view(torch.uint8) for t in out]
    with torch.no_grad():
        out.y.fill_(0)
    for t, b in zip(out[1:], before[1:]):
        assert torch.equal(t.view(torch.uint8), b), "writing y changed another output"
    out.y.float().sum().backward()  # the graph still sees the values it saved
    assert w.grad is not None and torch.isfinite(w.grad.float()).all()
    if device == "cuda":
        del out
        w.grad = None
        for _ in range(2):  # warm the allocator's caches
            fk.fp8_rms_norm(q, 256, w, EPS, x_scales=scales).y.float().sum().backward()
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        for _ in range(20):
            o = fk.fp8_rms_norm(q, 256, w, EPS, x_scales=scales)
            o.y.float().sum().backward()
            del o
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == start
