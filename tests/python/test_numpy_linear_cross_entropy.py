"""fusekit.linear_cross_entropy with NumPy arrays: the CPU backend against a NumPy float64
implementation (the logits h W^T + b, the cross-entropy of fusekit/cross_entropy.h, and the
products dh = dlogits W, dW = dlogits^T h, db = column sums of dlogits), every reduction and
option, the loss-only call, and bad arguments raising fusekit exceptions with the C++ message."""
import numpy as np
import pytest

import fusekit
from fk_testing import check_close, check_invalid_argument, rounding_error
from test_numpy_cross_entropy import reference as cross_entropy_reference

REDUCTIONS = ["none", "mean", "sum"]


def problem(rng, tokens, vocab, hidden, bias, ignore_index=-100):
    h = rng.standard_normal((tokens, hidden)).astype(np.float32)
    w = (rng.standard_normal((vocab, hidden)) / np.sqrt(hidden)).astype(np.float32)
    b = rng.standard_normal(vocab).astype(np.float32) if bias else None
    t = rng.integers(0, vocab, tokens)
    t[rng.random(tokens) < 0.2] = ignore_index
    return h, w, b, t


def reference(h, w, b, t, reduction, **options):
    """(loss, dh, dW, db) in float64: the gradients of the loss itself (dloss = 1; for 'none', of
    the sum of the row losses, each row's gradient scaled by 1)."""
    logits = h.astype(np.float64) @ w.astype(np.float64).T
    if b is not None:
        logits = logits + b.astype(np.float64)
    loss, _, dlogits = cross_entropy_reference(logits, t, reduction, fused=True, **options)
    dh = dlogits @ w.astype(np.float64)
    dw = dlogits.T @ h.astype(np.float64)
    db = dlogits.sum(0)
    return loss, dh, dw, db


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("smoothing,z", [(0.0, 0.0), (0.1, 1e-3)])
def test_matches_float64_reference(reduction, bias, smoothing, z, seed):
    rng = np.random.default_rng(seed)
    h, w, b, t = problem(rng, 24, 37, 16, bias)
    loss = np.full(t.shape if reduction == "none" else (), np.nan, np.float32)
    dh, dw = np.full_like(h, np.nan), np.full_like(w, np.nan)
    db = np.full(w.shape[0], np.nan, np.float32) if bias else None
    fusekit.linear_cross_entropy(h, w, b, t, reduction, loss, dh, dw, db, label_smoothing=smoothing, z_loss=z)
    ref_loss, ref_dh, ref_dw, ref_db = reference(h, w, b, t, reduction, smoothing=smoothing, z=z)
    check_close("loss", loss, ref_loss, "f32", rounding_error(ref_loss, np.float32))
    check_close("dh", dh, ref_dh, "f32", rounding_error(ref_dh, np.float32))
    check_close("dweight", dw, ref_dw, "f32", rounding_error(ref_dw, np.float32))
    if bias:
        check_close("dbias", db, ref_db, "f32", rounding_error(ref_db, np.float32))


def test_loss_only_call_gives_the_same_loss(seed):
    rng = np.random.default_rng(seed)
    h, w, b, t = problem(rng, 16, 29, 8, True)
    with_grads, loss_only = np.zeros((), np.float32), np.zeros((), np.float32)
    fusekit.linear_cross_entropy(h, w, b, t, "mean", with_grads, np.empty_like(h), np.empty_like(w),
                                 np.empty(29, np.float32))
    fusekit.linear_cross_entropy(h, w, b, t, "mean", loss_only)
    assert loss_only == with_grads


def test_workspace_query_on_the_cpu_is_zero():
    assert fusekit.linear_cross_entropy_workspace_size(8192, 50304, 768, fusekit.DType.bf16, fusekit.DType.f32,
                                                       False, "mean", "cpu") == 0


def test_bad_arguments_name_the_argument(seed):
    rng = np.random.default_rng(seed)
    h, w, b, t = problem(rng, 8, 11, 4, True)
    loss = np.zeros((), np.float32)
    check_invalid_argument(lambda: fusekit.linear_cross_entropy(h, w[:, :3], b, t, "mean", loss), "weight", None)
    check_invalid_argument(lambda: fusekit.linear_cross_entropy(h, w, b, t, "mean", loss, label_smoothing=1.0),
                           "label_smoothing", None)
    check_invalid_argument(lambda: fusekit.linear_cross_entropy(h, w, b, t[:5], "mean", loss), "targets", None)
    check_invalid_argument(lambda: fusekit.linear_cross_entropy(h, w, b, t, "average", loss), "reduction", None)
