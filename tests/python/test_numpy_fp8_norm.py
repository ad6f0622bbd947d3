"""fusekit's FP8 RMSNorm bindings with NumPy arrays (ml_dtypes float8 / bfloat16): the CPU backend
against the float32 operation sequence documented in include/fusekit/fp8_norm.h, rebuilt here in
NumPy (bit-exact outputs given the saved rstd), the backward against float64, and bad arguments
raising fusekit exceptions with the C++ message."""
import numpy as np
import pytest

import fusekit
from fk_testing import check_close, check_invalid_argument, rounding_error, to_f64

ml_dtypes = pytest.importorskip(
    "ml_dtypes", reason="ml_dtypes is not installed: the FP8 RMSNorm NumPy tests need its float8 "
                        "and bfloat16 dtypes")
BF16 = ml_dtypes.bfloat16
FP8 = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}
SCALE_DTYPES = {"bf16": BF16, "f32": np.float32}
EPS = 1e-6


def quantized_input(rng, rows, n, group, fmt, scale_dtype):
    fp8, _ = FP8[fmt]
    q = (rng.standard_normal((rows, n)) * 40).astype(np.float32).astype(fp8)
    scales = np.exp2(rng.uniform(-6, 2, (rows, n // group))).astype(SCALE_DTYPES[scale_dtype])
    return q, scales


def run_forward(q, scales, weight, out_fmt, group, want_y=True):
    rows, n = q.shape
    fp8, _ = FP8[out_fmt]
    qy = np.zeros((rows, n), fp8)
    qy_t = np.zeros((n, rows), fp8)
    y_scale = np.full(1, np.nan, np.float32)
    rstd = np.full(rows, np.nan, np.float32)
    y = np.full((rows, n), np.nan, BF16) if want_y else None
    fusekit.fp8_rms_norm_forward(q, scales, weight, EPS, qy, qy_t, y_scale, rstd, y,
                                 group_size=group)
    return qy, qy_t, y_scale, rstd, y


def reference_forward(q, scales, weight, out_fmt, group, rstd):
    """The documented float32 sequence, with the op's rstd (checked separately) plugged in."""
    fp8, fp8_max = FP8[out_fmt]
    q32 = q.astype(np.float32)
    scale = np.repeat(scales.astype(np.float32), group, axis=1)
    w = weight.astype(np.float32)
    y = ((q32 * scale) * w) * rstd[:, None]
    amax = np.float32(max(np.abs(y).max(), fusekit.FP8_NORM_AMAX_FLOOR))
    s = np.float32(amax / np.float32(fp8_max))
    m = np.float32(np.float32(fp8_max) / amax)
    # qy = fp8(fl(q w) * fl(scale * fl(rstd m))): y / s with one factor per row and group.
    factor = scale * (rstd[:, None] * m)
    qy = np.clip((q32 * w) * factor, -fp8_max, fp8_max).astype(np.float32).astype(fp8)
    return y, s, qy


def reference_rstd(q, scales, group):
    xd = to_f64(q) * np.repeat(to_f64(scales), group, axis=1)
    return (1.0 / np.sqrt((xd * xd).mean(axis=1) + float(np.float32(EPS)))).astype(np.float32), xd


@pytest.mark.parametrize("in_fmt,out_fmt", [("e4m3", "e4m3"), ("e5m2", "e5m2"), ("e4m3", "e5m2")])
@pytest.mark.parametrize("scale_dtype", ["bf16", "f32"])
@pytest.mark.parametrize("weight_dtype", ["bf16", "f32"])
@pytest.mark.parametrize("group", [16, 32])
def test_forward_is_the_documented_sequence(rng, in_fmt, out_fmt, scale_dtype, weight_dtype, group):
    rows, n = 37, 128
    q, scales = quantized_input(rng, rows, n, group, in_fmt, scale_dtype)
    weight = rng.uniform(0.5, 1.5, n).astype(SCALE_DTYPES[weight_dtype])
    qy, qy_t, y_scale, rstd, y = run_forward(q, scales, weight, out_fmt, group)
    rstd_ref, _ = reference_rstd(q, scales, group)
    np.testing.assert_array_max_ulp(rstd, rstd_ref, maxulp=1)
    y_ref, s_ref, qy_ref = reference_forward(q, scales, weight, out_fmt, group, rstd)
    np.testing.assert_array_equal(y.view(np.uint16), y_ref.astype(BF16).view(np.uint16))
    assert y_scale[0] == s_ref
    np.testing.assert_array_equal(qy.view(np.uint8), qy_ref.view(np.uint8))
    np.testing.assert_array_equal(qy_t.view(np.uint8), qy.T.view(np.uint8))
    # The largest |y| maps to exactly +-fp8_max.
    assert np.abs(qy.astype(np.float32)).max() == FP8[out_fmt][1]


def test_all_zero_input_is_finite(rng):
    q = np.zeros((4, 32), ml_dtypes.float8_e4m3fn)
    scales = np.ones((4, 2), np.float32)
    weight = np.ones(32, np.float32)
    qy, qy_t, y_scale, rstd, y = run_forward(q, scales, weight, "e4m3", 16)
    assert np.all(qy.astype(np.float32) == 0) and np.all(np.isfinite(rstd))
    assert y_scale[0] == np.float32(np.float32(fusekit.FP8_NORM_AMAX_FLOOR) / np.float32(448.0))


@pytest.mark.parametrize("weight_dtype", ["bf16", "f32"])
def test_backward_matches_float64(rng, weight_dtype):
    rows, n, group = 29, 96, 16
    q, scales = quantized_input(rng, rows, n, group, "e4m3", "bf16")
    weight = (rng.uniform(0.5, 1.5, n) * rng.choice([-1, 1], n)).astype(SCALE_DTYPES[weight_dtype])
    _, _, _, rstd, _ = run_forward(q, scales, weight, "e4m3", group, want_y=False)
    dy = rng.standard_normal((rows, n)).astype(BF16)
    dx = np.full((rows, n), np.nan, BF16)
    dweight = np.full(n, np.nan, weight.dtype)
    fusekit.fp8_rms_norm_backward(dy, q, scales, weight, rstd, dx, dweight, group_size=group)
    _, xd = reference_rstd(q, scales, group)
    x_hat = xd * to_f64(rstd)[:, None]
    g = to_f64(dy) * to_f64(weight)
    dx_ref = to_f64(rstd)[:, None] * (g - x_hat * (g * x_hat).mean(axis=1, keepdims=True))
    dw_ref = (to_f64(dy) * x_hat).sum(axis=0)
    check_close("dx", dx, dx_ref, "bf16", rounding_error(dx_ref, BF16))
    check_close("dweight", dweight, dw_ref, weight_dtype, rounding_error(dw_ref, weight.dtype))
    again = np.full(n, np.nan, weight.dtype)
    fusekit.fp8_rms_norm_backward(dy, q, scales, weight, rstd, dweight=again, group_size=group)
    np.testing.assert_array_equal(again, dweight)


def test_workspace_sizes_and_constants():
    assert fusekit.fp8_rms_norm_forward_workspace_size(64, 128, "cpu") == 0
    assert fusekit.fp8_rms_norm_backward_workspace_size(64, 128, "cpu") == 0
    assert fusekit.FP8_NORM_DEFAULT_GROUP_SIZE == 16 and fusekit.FP8_NORM_MAX_COLS == 65536


# ---- bad input -> exceptions carrying the C++ message -----------------------------------------------
def _fwd(**kw):
    e4m3 = ml_dtypes.float8_e4m3fn
    args = dict(x=np.zeros((4, 32), e4m3), x_scales=np.ones((4, 2), np.float32),
                weight=np.ones(32, np.float32), eps=EPS, qy=np.zeros((4, 32), e4m3),
                qy_t=np.zeros((32, 4), e4m3), y_scale=np.zeros(1, np.float32),
                rstd=np.zeros(4, np.float32))
    args.update(kw)
    return lambda: fusekit.fp8_rms_norm_forward(**args)


def _bwd(**kw):
    args = dict(dy=np.zeros((4, 32), BF16), x=np.zeros((4, 32), ml_dtypes.float8_e4m3fn),
                x_scales=np.ones((4, 2), np.float32), weight=np.ones(32, np.float32),
                rstd=np.ones(4, np.float32), dx=np.zeros((4, 32), BF16))
    args.update(kw)
    return lambda: fusekit.fp8_rms_norm_backward(**args)


BAD_CALLS = [
    ("x_bf16", _fwd(x=np.zeros((4, 32), BF16)), "x", "bf16"),
    ("x_scales_shape", _fwd(x_scales=np.ones((4, 3), np.float32)), "x_scales", None),
    ("group_size_not_pow2", _fwd(group_size=12), "group_size", "12"),
    ("group_size_not_dividing", _fwd(group_size=64), "x", None),
    ("eps_zero", _fwd(eps=0.0), "eps", None),
    ("qy_t_shape", _fwd(qy_t=np.zeros((4, 32), ml_dtypes.float8_e4m3fn)), "qy_t", None),
    ("y_scale_dtype", _fwd(y_scale=np.zeros(1, BF16)), "y_scale", "bf16"),
    ("rstd_dtype", _fwd(rstd=np.zeros(4, BF16)), "rstd", None),
    ("y_dtype", _fwd(y=np.zeros((4, 32), np.float32)), "y", "f32"),
    ("dy_dtype", _bwd(dy=np.zeros((4, 32), np.float32)), "dy", "f32"),
    ("dx_shape", _bwd(dx=np.zeros((32, 4), BF16)), "dx", None),
    ("dweight_dtype", _bwd(dweight=np.zeros(32, BF16)), "dweight", None),
    ("workspace_device", lambda: fusekit.fp8_rms_norm_backward_workspace_size(4, 32, "cuda:x"),
     "device", "'cuda:x'"),
]


@pytest.mark.parametrize("call,argument,words", [b[1:] for b in BAD_CALLS],
                         ids=[b[0] for b in BAD_CALLS])
def test_bad_arguments_raise_invalid_argument(call, argument, words):
    check_invalid_argument(call, argument, words)
