"""fusekit's rotary-embedding bindings with NumPy arrays: the CPU backend against a NumPy float64
implementation of the documented definition (include/fusekit/rope.h: float32 angles
fl32(p) * inv_freq[i], cos / sin and the rotation in float64), over both pairings, partial rotary,
the three angle sources, implicit / given / shared / packed positions, GQA, permuted (B, H, S, D)
storage, in-place calls; and bad arguments raising fusekit exceptions with the C++ message."""
import numpy as np
import pytest

import fusekit
from fk_testing import NUMPY_DTYPES, check_close, check_invalid_argument, ml_dtypes, rounding_error, to_f64

DTYPES = ["f32", "f16", pytest.param("bf16", marks=pytest.mark.skipif(
    ml_dtypes is None, reason="ml_dtypes is not installed (NumPy has no bfloat16)"))]
STYLES = ["rotate_half", "interleaved"]


# ---- float64 reference --------------------------------------------------------------------------
def theta_inv_freq(theta, rotary_dim, linear_scaling=1.0):
    """fl32(theta^(-2i / r) / linear_scaling), computed in float64 from the float32 arguments."""
    i = np.arange(rotary_dim // 2, dtype=np.float64)
    return (np.float64(np.float32(theta)) ** (-2.0 * i / rotary_dim)
            / np.float64(np.float32(linear_scaling))).astype(np.float32)


def cos_sin(positions, inv_freq=None, cos=None, sin=None, attention_scaling=1.0):
    """m cos a and m sin a per token (positions' shape + (r/2,)), float64."""
    m = np.float64(np.float32(attention_scaling))
    if cos is not None:
        return m * to_f64(cos)[positions], m * to_f64(sin)[positions]
    angle = positions.astype(np.float32)[..., None] * inv_freq.astype(np.float32)  # float32 product
    return m * np.cos(angle.astype(np.float64)), m * np.sin(angle.astype(np.float64))


def rotate(x, c, s, style, rotary_dim, backward=False):
    """x (..., H, D) rotated by the per-token (..., r/2) cos / sin, broadcast over heads."""
    x = to_f64(x)
    c, s = c[..., None, :], (-s if backward else s)[..., None, :]
    out = x.copy()
    half = rotary_dim // 2
    if style == "rotate_half":
        a, b = x[..., :half], x[..., half:rotary_dim]
        out[..., :half], out[..., half:rotary_dim] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        out[..., 0:rotary_dim:2], out[..., 1:rotary_dim:2] = a * c - b * s, b * c + a * s
    return out


def default_positions(q):
    """The sequence index of every token: (1, S) for 4-D q, (T) for packed q."""
    s = np.arange(q.shape[-3])
    return s[None, :] if q.ndim == 4 else s


def make(rng, shape, dtype):
    return rng.standard_normal(shape).astype(NUMPY_DTYPES[dtype])


def check_pair(name, got, ref, dtype):
    check_close(name, got, ref, dtype, rounding_error(ref, NUMPY_DTYPES[dtype]))


# ---- results against float64 ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("rotary_dim", [0, 10])
@pytest.mark.parametrize("source", ["theta", "inv_freq", "cos_sin"])
def test_forward_backward_match_float64(rng, dtype, style, rotary_dim, source):
    B, S, Hq, Hk, D = 2, 7, 4, 2, 16
    r = rotary_dim or D
    q, k = make(rng, (B, S, Hq, D), dtype), make(rng, (B, S, Hk, D), dtype)
    ids = rng.integers(0, 50000 if source != "cos_sin" else 30, (B, S))
    kw = dict(style=style, rotary_dim=rotary_dim, attention_scaling=1.25)
    inv = theta_inv_freq(500000.0, r, 4.0)
    tables = {}
    if source == "theta":
        kw.update(theta=500000.0, linear_scaling=4.0)
    elif source == "inv_freq":
        tables = dict(inv_freq=inv)
    else:
        angles = rng.uniform(-50, 50, (30, r // 2))
        tables = dict(cos=np.cos(angles).astype(np.float32), sin=np.sin(angles).astype(np.float32))
    c, s = cos_sin(ids, inv_freq=inv, attention_scaling=1.25, **{n: t for n, t in tables.items() if n != "inv_freq"})
    for backward in (False, True):
        q_out, k_out = np.full_like(q, np.nan), np.full_like(k, np.nan)
        op = fusekit.rope_backward if backward else fusekit.rope_forward
        op(q, k, ids, q_out, k_out, **kw, **tables)
        check_pair("dq" if backward else "q_out", q_out, rotate(q, c, s, style, r, backward), dtype)
        check_pair("dk" if backward else "k_out", k_out, rotate(k, c, s, style, r, backward), dtype)
        np.testing.assert_array_equal(q_out[..., r:], q[..., r:])  # passed through exactly


@pytest.mark.parametrize("style", STYLES)
def test_positions_implicit_shared_and_packed(rng, style):
    """Implicit positions = explicit 0..S-1; (1, S) ids apply to every batch; a packed (T, H, D)
    batch with positions restarting per sequence = the sequences one by one."""
    B, S, H, D = 3, 5, 2, 8
    q = make(rng, (B, S, H, D), "f32")
    implicit = np.empty_like(q)
    fusekit.rope_forward(q, None, None, implicit, None, style=style)
    for ids in (np.tile(np.arange(S), (B, 1)), np.arange(S, dtype=np.int32)[None, :]):
        out = np.empty_like(q)
        fusekit.rope_forward(q, None, ids, out, None, style=style)
        np.testing.assert_array_equal(out, implicit)
    lengths = [2, 6, 4, 3]
    packed_q = make(rng, (sum(lengths), H, D), "f32")
    packed_ids = np.concatenate([np.arange(n) for n in lengths])
    packed = np.empty_like(packed_q)
    fusekit.rope_forward(packed_q, None, packed_ids, packed, None, style=style)
    start = 0
    for n in lengths:
        one = np.empty((1, n, H, D), np.float32)
        fusekit.rope_forward(packed_q[None, start:start + n], None, None, one, None, style=style)
        np.testing.assert_array_equal(packed[start:start + n], one[0])
        start += n
    c, s = cos_sin(packed_ids, inv_freq=theta_inv_freq(10000.0, D))
    check_pair("packed", packed, rotate(packed_q, c, s, style, D), "f32")


def test_permuted_layout_gqa_and_in_place(rng):
    """(B, H, S, D) storage through swapaxes views, k with its own head count, q rotated in
    place: the same values as contiguous (B, S, H, D) arrays."""
    B, S, Hq, Hk, D = 2, 9, 6, 2, 32
    q_bhsd, k_bhsd = make(rng, (B, Hq, S, D), "f16"), make(rng, (B, Hk, S, D), "f16")
    q, k = np.swapaxes(q_bhsd, 1, 2), np.swapaxes(k_bhsd, 1, 2)
    ids = rng.integers(0, 4096, (1, S))
    ref_q, ref_k = np.empty(q.shape, np.float16), np.empty(k.shape, np.float16)
    fusekit.rope_forward(np.ascontiguousarray(q), np.ascontiguousarray(k), ids, ref_q, ref_k, rotary_dim=24)
    out_q_bhsd = np.full_like(q_bhsd, np.nan)
    fusekit.rope_forward(q, k, ids, np.swapaxes(out_q_bhsd, 1, 2), k, rotary_dim=24)  # k in place
    np.testing.assert_array_equal(np.swapaxes(out_q_bhsd, 1, 2), ref_q)
    np.testing.assert_array_equal(k, ref_k)
    fusekit.rope_forward(q, None, ids, q, None, rotary_dim=24)  # q in place
    np.testing.assert_array_equal(q, ref_q)


def test_backward_undoes_forward(rng):
    B, S, H, D = 2, 4, 3, 12
    q = make(rng, (B, S, H, D), "f32")
    ids = rng.integers(0, 100000, (B, S))
    out, back = np.empty_like(q), np.empty_like(q)
    for style in STYLES:
        fusekit.rope_forward(q, None, ids, out, None, style=style, rotary_dim=8)
        fusekit.rope_backward(out, None, ids, back, None, style=fusekit.RopeStyle.__members__[style],
                              rotary_dim=8)
        np.testing.assert_allclose(back, q, atol=2e-6)


def test_module_constants():
    assert fusekit.ROPE_MAX_HEAD_DIM == 512
    assert list(fusekit.RopeStyle.__members__) == STYLES


# ---- bad input -> exceptions carrying the C++ message -----------------------------------------------
def _f32(*shape):
    return np.ones(shape, np.float32)


def _fwd(**kw):
    args = dict(q=_f32(2, 3, 4, 8), k=_f32(2, 3, 2, 8), position_ids=None, q_out=_f32(2, 3, 4, 8),
                k_out=_f32(2, 3, 2, 8))
    args.update(kw)
    return lambda: fusekit.rope_forward(**args)


def _bwd(**kw):
    args = dict(dq_out=_f32(2, 3, 4, 8), dk_out=None, position_ids=None, dq=_f32(2, 3, 4, 8), dk=None)
    args.update(kw)
    return lambda: fusekit.rope_backward(**args)


_shared = _f32(2, 3, 4, 8)

BAD_CALLS = [
    ("q_none", _fwd(q=None), "q", "got None"),
    ("q_f64", _fwd(q=np.ones((2, 3, 4, 8))), "q", "f64"),
    ("q_2d", _fwd(q=_f32(12, 8)), "q", "4 dimensions"),
    ("q_out_shape", _fwd(q_out=_f32(2, 3, 4, 6)), "q_out", "(2, 3, 4, 8)"),
    ("k_out_missing", _fwd(k_out=None), "k_out", "since 'k' is given"),
    ("k_batch", _fwd(k=_f32(1, 3, 2, 8), k_out=_f32(1, 3, 2, 8)), "k", "Hk"),
    ("style_name", _fwd(style="neox"), "style", "'neox'"),
    ("style_type", _fwd(style=1), "style", "int"),
    ("rotary_dim_odd", _fwd(rotary_dim=5), "rotary_dim", "even"),
    ("rotary_dim_large", _fwd(rotary_dim=10), "rotary_dim", "10"),
    ("theta_nan", _fwd(theta=float("nan")), "theta", "nan"),
    ("theta_overflow", _fwd(theta=1e40), "theta", "float32 can hold"),  # refused by the conversion
    ("linear_scaling_zero", _fwd(linear_scaling=0.0), "linear_scaling", "> 0"),
    ("scaling_with_table", _fwd(linear_scaling=2.0, inv_freq=_f32(4)), "linear_scaling", "table"),
    ("attention_scaling_inf", _fwd(attention_scaling=float("inf")), "attention_scaling", "inf"),
    ("ids_dtype", _fwd(position_ids=_f32(2, 3)), "position_ids", "i32 or i64"),
    ("ids_shape", _fwd(position_ids=np.zeros((3, 2), np.int64)), "position_ids", "(2, 3) or (1, 3)"),
    ("inv_freq_length", _fwd(inv_freq=_f32(8)), "inv_freq", "(4)"),
    ("cos_without_sin", _fwd(cos=_f32(5, 4)), "sin", "'cos' is given"),
    ("cos_columns", _fwd(cos=_f32(5, 8), sin=_f32(5, 8)), "cos", "(P, 4)"),
    ("cos_too_short", _fwd(cos=_f32(2, 4), sin=_f32(2, 4)), "cos", "at least 3 rows"),
    ("ids_outside_table", _fwd(cos=_f32(5, 4), sin=_f32(5, 4), position_ids=np.full((2, 3), 5)),
     "position_ids", "[0, 5)"),
    ("out_overlaps_k", _fwd(k=_shared[:, :, :2], q_out=_shared, k_out=_f32(2, 3, 2, 8)), "q_out", "'k'"),
    ("dq_shape", _bwd(dq=_f32(2, 3, 4, 4)), "dq", None),
    ("dk_without_dk_out", _bwd(dk=_f32(2, 3, 2, 8)), "dk_out", "since 'dk' is given"),
]


@pytest.mark.parametrize("call,argument,words", [b[1:] for b in BAD_CALLS], ids=[b[0] for b in BAD_CALLS])
def test_bad_arguments_raise_invalid_argument(call, argument, words):
    check_invalid_argument(call, argument, words)
