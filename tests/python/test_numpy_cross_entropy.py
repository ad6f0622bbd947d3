"""fusekit's cross-entropy bindings with NumPy arrays: the CPU backend against a NumPy float64
implementation of the documented loss and gradient (label smoothing, z-loss, ignore_index, every
reduction), in place, padded rows, int32 targets, and bad arguments raising fusekit exceptions with
the C++ message."""
import numpy as np
import pytest

import fusekit
from fk_testing import NUMPY_DTYPES, check_close, check_invalid_argument, ml_dtypes, rounding_error, to_f64

DTYPES = ["f32", "f16", pytest.param("bf16", marks=pytest.mark.skipif(
    ml_dtypes is None, reason="ml_dtypes is not installed (NumPy has no bfloat16)"))]
REDUCTIONS = ["none", "mean", "sum"]


# ---- float64 reference ----------------------------------------------------------------------------
def reference(logits, targets, reduction, ignore_index=-100, smoothing=0.0, z=0.0, dloss=None, fused=False):
    """(loss, lse, dlogits): dlogits for dloss (the backward) or for the loss itself (fused)."""
    v = logits.shape[-1]
    x = to_f64(logits).reshape(-1, v)
    t = np.asarray(targets).reshape(-1).astype(np.int64)
    m = x.max(1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(1, keepdims=True)))[:, 0]
    ignored = t == ignore_index
    safe = np.where(ignored, 0, t)
    x_t = x[np.arange(len(t)), safe]
    s, z = float(np.float32(smoothing)), float(np.float32(z))
    rows = lse - (1 - s) * x_t - s / v * x.sum(1) + z * lse * lse
    rows[ignored] = 0.0
    counted = int((~ignored).sum())
    if reduction == "none":
        loss = rows.reshape(np.asarray(targets).shape)
    elif reduction == "sum":
        loss = rows.sum()
    else:
        loss = rows.sum() / counted if counted else 0.0
    p = np.exp(x - lse[:, None])
    grad = p * (1 + 2 * z * lse[:, None]) - s / v
    grad[np.arange(len(t)), safe] -= (1 - s)
    grad[ignored] = 0.0
    if fused:
        g = np.ones(len(t))
    else:
        g = np.broadcast_to(to_f64(dloss).reshape(-1), (len(t),)).copy()
    if reduction == "mean":
        g = g / counted if counted else np.zeros_like(g)
    return np.asarray(loss), lse.reshape(np.asarray(targets).shape), (grad * g[:, None]).reshape(logits.shape)


def inputs(rng, shape, dtype, ignore_index=-100, ignored=0.25, target_dtype=np.int64):
    x = (rng.standard_normal(shape) * 2.0).astype(NUMPY_DTYPES[dtype])
    t = rng.integers(0, shape[-1], shape[:-1]).astype(target_dtype)
    t[rng.random(shape[:-1]) < ignored] = ignore_index
    return x, t


def loss_array(targets, reduction):
    return np.full(targets.shape if reduction == "none" else (), np.nan, np.float32)


def dloss_array(rng, targets, reduction):
    if reduction == "none":
        return rng.standard_normal(targets.shape).astype(np.float32)
    return np.array(1.0 + rng.random(), np.float32)


# ---- results against float64 ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing,z", [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-3), (0.2, 1e-2)])
def test_forward_backward_fused_match_float64(rng, dtype, reduction, smoothing, z):
    shape = (3, 5, 37)  # 15 rows of 37 classes
    x, t = inputs(rng, shape, dtype)
    kw = dict(label_smoothing=smoothing, z_loss=z)
    loss, lse = loss_array(t, reduction), np.full(t.shape, np.nan, np.float32)
    fusekit.cross_entropy_forward(x, t, reduction, loss, lse, **kw)
    ref_loss, ref_lse, _ = reference(x, t, reduction, smoothing=smoothing, z=z, fused=True)
    check_close("loss", loss, ref_loss, "f32", rounding_error(ref_loss, np.float32))
    check_close("lse", lse, ref_lse, "f32", rounding_error(ref_lse, np.float32))

    dloss = dloss_array(rng, t, reduction)
    dx = np.full_like(x, np.nan)
    fusekit.cross_entropy_backward(dloss, x, t, lse, reduction, dx, **kw)
    _, _, ref_dx = reference(x, t, reduction, smoothing=smoothing, z=z, dloss=dloss)
    np_dtype = NUMPY_DTYPES[dtype]
    check_close("dlogits", dx, ref_dx, dtype, rounding_error(ref_dx, np_dtype))

    fused_loss, fused_dx = loss_array(t, reduction), np.full_like(x, np.nan)
    fusekit.cross_entropy_forward_backward(x, t, fusekit.LossReduction.__members__[reduction], fused_loss,
                                           fused_dx, **kw)
    _, _, ref_fused = reference(x, t, reduction, smoothing=smoothing, z=z, fused=True)
    check_close("fused loss", fused_loss, ref_loss, "f32", rounding_error(ref_loss, np.float32))
    check_close("fused dlogits", fused_dx, ref_fused, dtype, rounding_error(ref_fused, np_dtype))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_in_place_padded_rows_and_int32_targets(rng, reduction):
    """dlogits written over the logits (in place), rows 48 apart holding 41 classes, int32 targets
    and an ignore_index that is also a class."""
    wide = (rng.standard_normal((6, 48)) * 2).astype(np.float32)
    padding = wide[:, 41:].copy()
    x = wide[:, :41]
    t = rng.integers(0, 41, 6).astype(np.int32)
    t[1] = 3
    t[4] = 3
    ref_loss, _, ref_dx = reference(x, t, reduction, ignore_index=3, smoothing=0.1, fused=True)
    loss = loss_array(t, reduction)
    fusekit.cross_entropy_forward_backward(x, t, reduction, loss, x, ignore_index=3, label_smoothing=0.1)
    check_close("loss", loss, ref_loss, "f32", rounding_error(ref_loss, np.float32))
    check_close("dlogits (in place)", x, ref_dx, "f32", rounding_error(ref_dx, np.float32))
    assert np.all(x[[1, 4]] == 0.0)
    np.testing.assert_array_equal(wide[:, 41:], padding)


def test_all_ignored_batch_is_zero_not_nan(rng):
    x, t = inputs(rng, (4, 9), "f32", ignored=1.0)
    for reduction in REDUCTIONS:
        loss, dx = loss_array(t, reduction), np.full_like(x, np.nan)
        fusekit.cross_entropy_forward_backward(x, t, reduction, loss, dx)
        assert np.all(loss == 0.0) and np.all(dx == 0.0), reduction
    empty_loss = np.full((), np.nan, np.float32)
    fusekit.cross_entropy_forward(np.zeros((0, 9), np.float32), np.zeros(0, np.int64), "mean", empty_loss)
    assert empty_loss == 0.0


def test_backward_from_forward_matches_fused(rng):
    x, t = inputs(rng, (7, 100), "f32")
    loss, lse = loss_array(t, "mean"), np.empty(7, np.float32)
    fusekit.cross_entropy_forward(x, t, "mean", loss, lse, z_loss=1e-3)
    dx, fused_dx = np.empty_like(x), np.empty_like(x)
    fused_loss, fused_lse = loss_array(t, "mean"), np.empty(7, np.float32)
    fusekit.cross_entropy_backward(np.ones(1, np.float32), x, t, lse, "mean", dx, z_loss=1e-3)
    fusekit.cross_entropy_forward_backward(x, t, "mean", fused_loss, fused_dx, fused_lse, z_loss=1e-3)
    np.testing.assert_allclose(dx, fused_dx, rtol=1e-5, atol=1e-8)
    assert fused_loss == loss and np.array_equal(fused_lse, lse)


def test_workspace_size_and_reduction_enum():
    assert fusekit.cross_entropy_workspace_size(8192, 128256, "mean", "cpu") == 0
    assert fusekit.cross_entropy_workspace_size(8192, 128256, fusekit.LossReduction.none, "cuda") == 0
    assert fusekit.cross_entropy_workspace_size(8192, 128256, "sum", "cuda") >= 8192 * 4
    assert list(fusekit.LossReduction.__members__) == REDUCTIONS


# ---- bad input -> exceptions carrying the C++ message -----------------------------------------------
def _x(*shape):
    return np.ones(shape, np.float32)


def _t(n, value=1, dtype=np.int64):
    return np.full(n, value, dtype)


def _fwd(**kw):
    args = dict(logits=_x(4, 8), targets=_t(4), reduction="mean", loss=np.zeros((), np.float32))
    args.update(kw)
    return lambda: fusekit.cross_entropy_forward(**args)


def _bwd(**kw):
    args = dict(dloss=np.ones(1, np.float32), logits=_x(4, 8), targets=_t(4), lse=np.zeros(4, np.float32),
                reduction="mean", dlogits=_x(4, 8))
    args.update(kw)
    return lambda: fusekit.cross_entropy_backward(**args)


def _fused(**kw):
    args = dict(logits=_x(4, 8), targets=_t(4), reduction="sum", loss=np.zeros(1, np.float32), dlogits=_x(4, 8))
    args.update(kw)
    return lambda: fusekit.cross_entropy_forward_backward(**args)


_shared = _x(5, 8)
BAD_CALLS = [
    ("reduction_name", _fwd(reduction="avg"), "reduction", "'avg'"),
    ("reduction_type", _fwd(reduction=1), "reduction", "int"),
    ("smoothing_one", _fwd(label_smoothing=1.0), "label_smoothing", "[0, 1)"),
    ("smoothing_nan", _fused(label_smoothing=float("nan")), "label_smoothing", None),
    ("z_negative", _bwd(z_loss=-1.0), "z_loss", None),
    ("logits_f64", _fwd(logits=np.ones((4, 8))), "logits", "f64"),
    ("logits_too_wide", _fwd(logits=np.ones((1, 262145), np.float16), targets=_t(1)), "logits", "262144"),
    ("targets_float", _fwd(targets=np.ones(4, np.float32)), "targets", "i32 or i64"),
    ("targets_count", _fwd(targets=_t(5)), "targets", "4 elements"),
    ("target_out_of_range", _fwd(targets=_t(4, 8)), "targets", "target 8 at row 0"),
    ("target_negative", _fused(targets=_t(4, -1, np.int32)), "targets", "target -1"),
    ("loss_shape_mean", _fwd(loss=np.zeros(4, np.float32)), "loss", "1 elements"),
    ("loss_shape_none", _fwd(reduction="none"), "loss", "4 elements"),
    ("loss_dtype", _fwd(loss=np.zeros((), np.float64)), "loss", "f64"),
    ("lse_shape", _fwd(lse=np.zeros(3, np.float32)), "lse", None),
    ("dloss_shape", _bwd(reduction="none"), "dloss", "4 elements"),
    ("dlogits_shape", _bwd(dlogits=_x(8, 4)), "dlogits", None),
    ("dlogits_dtype", _fused(dlogits=np.ones((4, 8), np.float16)), "dlogits", "f16"),
    ("dlogits_overlap", _fused(logits=_shared[:4], dlogits=_shared[1:]), "dlogits", "overlap"),
    ("workspace_device", lambda: fusekit.cross_entropy_workspace_size(4, 8, "mean", "gpu"), "device", "'gpu'"),
    ("workspace_classes", lambda: fusekit.cross_entropy_workspace_size(4, 0, "mean", "cpu"), "classes", None),
]


@pytest.mark.parametrize("call,argument,words", [b[1:] for b in BAD_CALLS], ids=[b[0] for b in BAD_CALLS])
def test_bad_arguments_raise_invalid_argument(call, argument, words):
    check_invalid_argument(call, argument, words)
