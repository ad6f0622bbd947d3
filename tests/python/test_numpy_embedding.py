"""fusekit's embedding bindings with NumPy arrays: the CPU backend against a NumPy float64
implementation of the documented forward (the token's row plus its position's row) and backward
(per-token and per-position sums, overwritten or accumulated), int32 and int64 tokens, padded rows,
no position table, and bad arguments raising fusekit exceptions with the C++ message."""
import numpy as np
import pytest

import fusekit
from fk_testing import NUMPY_DTYPES, check_close, check_invalid_argument, ml_dtypes, rounding_error, to_f64

DTYPES = ["f32", "f16", pytest.param("bf16", marks=pytest.mark.skipif(
    ml_dtypes is None, reason="ml_dtypes is not installed (NumPy has no bfloat16)"))]


# ---- float64 reference ----------------------------------------------------------------------------
def reference_forward(tokens, weight, position_weight):
    out = to_f64(weight)[np.asarray(tokens).astype(np.int64)]
    if position_weight is not None:
        out = out + to_f64(position_weight)[:tokens.shape[-1]]
    return out


def reference_backward(dout, tokens, vocab, positions, dweight_old=None, dposition_old=None):
    dim = dout.shape[-1]
    T = tokens.shape[-1]
    d = to_f64(dout).reshape(-1, dim)
    dw = np.zeros((vocab, dim))
    np.add.at(dw, np.asarray(tokens).reshape(-1).astype(np.int64), d)
    dp = np.zeros((positions, dim))
    dp[:T] = d.reshape(-1, T, dim).sum(0)
    if dweight_old is not None:
        dw += to_f64(dweight_old)
        dp += to_f64(dposition_old)
    return dw, dp


# ---- results against float64 ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grad_dtype", ["same", "f32"])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("token_dtype", [np.int32, np.int64])
def test_forward_backward_match_float64(rng, dtype, grad_dtype, accumulate, token_dtype):
    np_dtype = NUMPY_DTYPES[dtype]
    g_dtype = np_dtype if grad_dtype == "same" else np.float32
    g_name = dtype if grad_dtype == "same" else "f32"
    vocab, dim, shape = 11, 24, (3, 40)  # many repeats of each token
    tokens = rng.integers(0, vocab, shape).astype(token_dtype)
    weight = rng.standard_normal((vocab, dim)).astype(np_dtype)
    pos = rng.standard_normal((shape[-1] + 2, dim)).astype(np_dtype)
    out = np.full(shape + (dim,), np.nan, np_dtype)
    fusekit.embedding_forward(tokens, weight, pos, out)
    ref = reference_forward(tokens, weight, pos)
    check_close("out", out, ref, dtype, rounding_error(ref, np_dtype))

    dout = rng.standard_normal(shape + (dim,)).astype(np_dtype)
    dw_old = rng.standard_normal((vocab, dim)).astype(g_dtype)
    dp_old = rng.standard_normal(pos.shape).astype(g_dtype)
    dw = dw_old.copy() if accumulate else np.full((vocab, dim), np.nan, g_dtype)
    dp = dp_old.copy() if accumulate else np.full(pos.shape, np.nan, g_dtype)
    fusekit.embedding_backward(dout, tokens, dw, dp, accumulate)
    ref_w, ref_p = reference_backward(dout, tokens, vocab, pos.shape[0], dw_old if accumulate else None,
                                      dp_old if accumulate else None)
    check_close("dweight", dw, ref_w, g_name, rounding_error(ref_w, g_dtype))
    check_close("dposition_weight", dp, ref_p, g_name, rounding_error(ref_p, g_dtype))


def test_unused_tokens_and_positions_past_t_get_zero(rng):
    tokens = np.array([[1, 1, 4]], np.int64)
    dout = rng.standard_normal((1, 3, 5)).astype(np.float32)
    dw, dp = np.full((6, 5), np.nan, np.float32), np.full((4, 5), np.nan, np.float32)
    fusekit.embedding_backward(dout, tokens, dw, dp, False)
    assert np.all(dw[[0, 2, 3, 5]] == 0.0) and np.all(dp[3] == 0.0)
    np.testing.assert_allclose(dw[1], dout[0, 0] + dout[0, 1], rtol=1e-6)
    np.testing.assert_array_equal(dp[:3], dout[0])


def test_no_positions_and_padded_rows(rng):
    """No position table: out is exactly the rows; a weight and an out whose rows are padded."""
    wide_w = rng.standard_normal((9, 20)).astype(np.float32)
    weight = wide_w[:, :13]
    wide_out = np.full((2, 5, 16), np.nan, np.float32)
    out = wide_out[..., :13]
    tokens = rng.integers(0, 9, (2, 5))
    fusekit.embedding_forward(tokens, weight, None, out)
    np.testing.assert_array_equal(out, weight[tokens])
    assert np.all(np.isnan(wide_out[..., 13:]))
    dw = np.zeros((9, 13), np.float32)
    fusekit.embedding_backward(np.ones((2, 5, 13), np.float32), tokens, dw, None, False)
    np.testing.assert_array_equal(dw[:, 0], np.bincount(tokens.reshape(-1), minlength=9))


def test_workspace_size():
    assert fusekit.embedding_backward_workspace_size(8192, 50257, 768, "cpu") == 0
    assert fusekit.embedding_backward_workspace_size(0, 50257, 768, "cuda") == 0


# ---- bad input -> exceptions carrying the C++ message -----------------------------------------------
def _fwd(**kw):
    args = dict(tokens=np.array([[1, 2, 3]]), weight=np.ones((5, 4), np.float32),
                position_weight=np.ones((3, 4), np.float32), out=np.zeros((1, 3, 4), np.float32))
    args.update(kw)
    return lambda: fusekit.embedding_forward(**args)


def _bwd(**kw):
    args = dict(dout=np.ones((1, 3, 4), np.float32), tokens=np.array([[1, 2, 3]]),
                dweight=np.zeros((5, 4), np.float32), dposition_weight=np.zeros((3, 4), np.float32),
                accumulate=False)
    args.update(kw)
    return lambda: fusekit.embedding_backward(**args)


_shared = np.zeros((8, 4), np.float32)
BAD_CALLS = [
    ("tokens_float", _fwd(tokens=np.ones((1, 3), np.float32)), "tokens", "i32 or i64"),
    ("token_out_of_range", _fwd(tokens=np.array([[1, 5, 0]])), "tokens", "token 5 at position 1"),
    ("token_negative", _bwd(tokens=np.array([[1, 2, -1]], np.int32)), "tokens", "token -1 at position 2"),
    ("weight_rank", _fwd(weight=np.ones(20, np.float32)), "weight", "2-dimensional"),
    ("weight_f64_mixed", _fwd(weight=np.ones((5, 4))), "position_weight", "f64"),
    ("positions_too_few", _fwd(position_weight=np.ones((2, 4), np.float32)), "position_weight", "P >= T"),
    ("out_shape", _fwd(out=np.zeros((3, 4), np.float32)), "out", "(1, 3, 4)"),
    ("out_dtype", _fwd(out=np.zeros((1, 3, 4), np.float16)), "out", "f16"),
    ("dweight_dtype", _bwd(dout=np.ones((1, 3, 4), np.float16), dweight=np.zeros((5, 4), np.float64)),
     "dweight", "f16 (as 'dout') or f32"),
    ("dweight_dim", _bwd(dweight=np.zeros((5, 3), np.float32)), "dweight", None),
    ("dposition_overlap", _bwd(dweight=_shared[:5], dposition_weight=_shared[4:7]), "dweight", "overlap"),
    ("accumulate_type", _bwd(accumulate=1), "accumulate", "bool"),
    ("workspace_vocab", lambda: fusekit.embedding_backward_workspace_size(4, 0, 8, "cpu"), "vocab", None),
    ("workspace_tokens", lambda: fusekit.embedding_backward_workspace_size(-1, 5, 8, "cpu"), "tokens", None),
    ("workspace_dim", lambda: fusekit.embedding_backward_workspace_size(4, 5, 65537, "cpu"), "dim", None),
]


@pytest.mark.parametrize("call,argument,words", [b[1:] for b in BAD_CALLS], ids=[b[0] for b in BAD_CALLS])
def test_bad_arguments_raise_invalid_argument(call, argument, words):
    check_invalid_argument(call, argument, words)
