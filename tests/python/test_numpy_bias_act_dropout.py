"""fusekit's bias + activation + dropout bindings with NumPy arrays: the CPU backend against a
NumPy float64 implementation whose dropout mask is computed here from the mapping documented in
include/fusekit/dropout.h (Philox4x32-10 written out in NumPy, checked against Random123's
known-answer vectors), and bad arguments raising fusekit exceptions with the C++ message."""
import math

import numpy as np
import pytest

import fusekit
from fk_testing import (NUMPY_DTYPES, check_close, check_invalid_argument, ml_dtypes,
                        rounding_error, to_f64)
from fk_testing import act as _act, act_grad as _act_grad

DTYPES = ["f32", "f16", pytest.param("bf16", marks=pytest.mark.skipif(
    ml_dtypes is None, reason="ml_dtypes is not installed (NumPy has no bfloat16)"))]
ACTIVATIONS = ["none", "relu", "gelu_erf", "gelu_tanh", "squared_relu", "leaky_relu", "silu"]
SLOPE = 0.05


def act(name, h):
    return _act(name, h, SLOPE)


def act_grad(name, h):
    return _act_grad(name, h, SLOPE)


# ---- Philox4x32-10 and the documented mask, in NumPy ------------------------------------------------
_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_LOW32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(counter, key):
    """counter: four uint64 arrays holding 32-bit words; key: two ints. Returns four arrays."""
    c0, c1, c2, c3 = (np.asarray(w, np.uint64) for w in counter)
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & 0xFFFFFFFF, (k1 + _W1) & 0xFFFFFFFF
        p0, p1 = _M0 * c0, _M1 * c2  # 32 x 32 -> 64 bits: no overflow in uint64
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ np.uint64(k0), p1 & _LOW32,
                          (p0 >> np.uint64(32)) ^ c3 ^ np.uint64(k1), p0 & _LOW32)
    return c0, c1, c2, c3


def keep_mask(seed, offset, p, count):
    """Element i is kept iff u16(i) >= min(ceil(p * 65536), 65535), u16(i) being half i % 2 of
    word (i % 8) // 2 of philox(counter = (i // 8, offset), key = seed)."""
    i = np.arange(count, dtype=np.uint64)
    n = i // np.uint64(8)
    words = philox4x32_10((n & _LOW32, n >> np.uint64(32),
                           np.full_like(n, offset & 0xFFFFFFFF), np.full_like(n, offset >> 32)),
                          (seed & 0xFFFFFFFF, seed >> 32))
    word = np.choose(((i % np.uint64(8)) // np.uint64(2)).astype(np.intp), words)
    u16 = np.where(i % np.uint64(2) == 1, word >> np.uint64(16), word & np.uint64(0xFFFF))
    threshold = min(math.ceil(float(np.float32(p)) * 65536.0), 65535)
    return u16 >= threshold


def test_philox_known_answers():
    """Random123's kat_vectors for philox4x32 with 10 rounds (counter words, key words -> out)."""
    vectors = [
        ([0, 0, 0, 0], (0, 0), [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        ([0xFFFFFFFF] * 4, (0xFFFFFFFF, 0xFFFFFFFF), [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], (0xA4093822, 0x299F31D0),
         [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
    ]
    for counter, key, expected in vectors:
        got = [int(w) for w in philox4x32_10([np.uint64(c) for c in counter], key)]
        assert got == expected, [hex(w) for w in got]


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
def test_keep_mask_helper_matches_documented_mapping(rng, p):
    seed = int(rng.integers(0, 2**64, dtype=np.uint64))
    offset = int(rng.integers(0, 2**64, dtype=np.uint64))
    mask = np.full(1003, 7, np.uint8)
    fusekit.dropout_keep_mask(np.uint64(seed), offset, p, mask)  # NumPy integers are accepted
    np.testing.assert_array_equal(mask, keep_mask(seed, offset, p, mask.size).astype(np.uint8))
    if p == 0.0:
        assert mask.all()


def test_keep_fraction_is_one_minus_p(rng):
    seed = int(rng.integers(0, 2**63))
    for p in (0.1, 0.5, 0.9):
        kept = keep_mask(seed, 3, p, 200_000).mean()
        # Binomial standard deviation <= 0.0012 at this size: 6 sigma.
        assert abs(kept - (1 - p)) < 0.007, (p, kept)
    a, b = keep_mask(seed, 0, 0.5, 4096), keep_mask(seed, 1, 0.5, 4096)
    assert 0.4 < (a == b).mean() < 0.6, "offsets must give independent masks"


# ---- float64 reference --------------------------------------------------------------------------
def factor(shape, p, seed, offset):
    """keep / (1 - p) over the logical (M, N) tensor, with p as the float32 the op receives."""
    if p == 0.0:
        return np.ones(shape)
    keep = keep_mask(seed, offset, p, int(np.prod(shape))).reshape(shape)
    return keep / (1.0 - float(np.float32(p)))


def ref(x, bias, name, p, seed, offset, dy=None):
    h = to_f64(x) + (to_f64(bias) if bias is not None else 0.0)
    f = factor(x.shape, p, seed, offset)
    y = act(name, h) * f
    if dy is None:
        return y
    dx = to_f64(dy) * f * act_grad(name, h)
    return y, dx, dx.reshape(-1, x.shape[-1]).sum(axis=0)


def inputs(rng, shape, dtype, bias_dtype=None):
    dt = NUMPY_DTYPES[dtype]
    x = (rng.standard_normal(shape) * 1.5).astype(dt)
    bias = rng.standard_normal(shape[-1]).astype(NUMPY_DTYPES[bias_dtype or dtype])
    dy = rng.standard_normal(shape).astype(dt)
    seed = int(rng.integers(0, 2**64, dtype=np.uint64))
    offset = int(rng.integers(0, 2**40))
    return x, bias, dy, seed, offset


# ---- results against float64 ----------------------------------------------------------------------
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_forward_backward_match_float64(rng, activation, dtype, p):
    shape = (3, 7, 45)  # 945 elements: groups of eight straddle rows
    x, bias, dy, seed, offset = inputs(rng, shape, dtype)
    y = np.full_like(x, np.nan)
    h = np.full_like(x, np.nan)
    fusekit.bias_act_dropout_forward(x, bias, activation, p, seed, offset, y, h, slope=SLOPE)
    y_ref, dx_ref, db_ref = ref(x, bias, activation, p, seed, offset, dy)
    np_dtype = NUMPY_DTYPES[dtype]
    check_close("y", y, y_ref, dtype, rounding_error(y_ref, np_dtype))
    if p > 0:
        dropped = factor(shape, p, seed, offset) == 0
        assert dropped.any() and np.all(to_f64(y)[dropped] == 0.0)
    np.testing.assert_array_equal(h, (to_f64(x) + to_f64(bias)).astype(np_dtype))

    dx, dbias = np.full_like(x, np.nan), np.full_like(bias, np.nan)
    fusekit.bias_act_dropout_backward(dy, x, bias, activation, p, seed, offset, dx, dbias,
                                      slope=SLOPE)
    check_close("dx", dx, dx_ref, dtype, rounding_error(dx_ref, np_dtype))
    check_close("dbias", dbias, db_ref, dtype, rounding_error(db_ref, np_dtype))

    # From the saved pre-activation (h passed as x, no bias): exact for the rounded h.
    dx_h, dbias_h = np.full_like(x, np.nan), np.full_like(bias, np.nan)
    fusekit.bias_act_dropout_backward(dy, h, None, fusekit.Activation.__members__[activation], p,
                                      seed, offset, dx_h, dbias_h, slope=SLOPE)
    _, dxh_ref, dbh_ref = ref(h, None, activation, p, seed, offset, dy)
    check_close("dx from h", dx_h, dxh_ref, dtype, rounding_error(dxh_ref, np_dtype))
    check_close("dbias from h", dbias_h, dbh_ref, dtype, rounding_error(dbh_ref, np_dtype))


def test_float32_bias_with_half_activations_and_no_bias(rng):
    x, bias, dy, seed, offset = inputs(rng, (16, 64), "f16", bias_dtype="f32")
    y = np.full_like(x, np.nan)
    fusekit.bias_act_dropout_forward(x, bias, "silu", 0.2, seed, offset, y)
    y_ref = ref(x, bias, "silu", 0.2, seed, offset)
    check_close("y", y, y_ref, "f16", rounding_error(y_ref, np.float16))
    dbias = np.full_like(bias, np.nan)
    fusekit.bias_act_dropout_backward(dy, x, bias, "silu", 0.2, seed, offset, dbias=dbias)
    _, _, db_ref = ref(x, bias, "silu", 0.2, seed, offset, dy)
    check_close("dbias", dbias, db_ref, "f32", rounding_error(db_ref, np.float32))
    fusekit.bias_act_dropout_forward(x, None, "relu", 0.0, 0, 0, y)
    np.testing.assert_array_equal(y, np.maximum(x, 0))


def test_strided_rows_and_mask_follows_logical_index(rng):
    """Rows 64 apart in memory, 40 long: the mask is indexed by row * 40 + col (the row stride plays
    no part), and the padding between rows is never written."""
    n = 40
    wide = rng.standard_normal((9, 64)).astype(np.float32)
    x = wide[:, :n]
    out = np.full((9, 64), np.nan, np.float32)
    seed, offset = 1234, 5
    fusekit.bias_act_dropout_forward(x, None, "none", 0.5, seed, offset, out[:, :n])
    assert np.all(np.isnan(out[:, n:])), "padding between rows was written"
    contiguous = np.full((9, n), np.nan, np.float32)
    fusekit.bias_act_dropout_forward(np.ascontiguousarray(x), None, "none", 0.5, seed, offset,
                                     contiguous)
    np.testing.assert_array_equal(out[:, :n], contiguous)
    check_close("y", contiguous, ref(x, None, "none", 0.5, seed, offset), "f32", 6e-8)


def test_same_config_same_result_different_offset_different_mask(rng):
    x, bias, _, seed, offset = inputs(rng, (32, 128), "f32")
    runs = []
    for off in (offset, offset, offset + 1):
        y = np.empty_like(x)
        fusekit.bias_act_dropout_forward(x, bias, "gelu_tanh", 0.5, seed, off, y)
        runs.append(y)
    np.testing.assert_array_equal(runs[0], runs[1])
    assert ((runs[0] == 0) != (runs[2] == 0)).mean() > 0.3


def test_workspace_size_and_activation_enum():
    assert fusekit.bias_act_dropout_backward_workspace_size(128, 256, fusekit.DType.f32, "cpu") == 0
    assert [a for a in fusekit.Activation.__members__] == ACTIVATIONS


# ---- bad input -> exceptions carrying the C++ message -----------------------------------------------
def _f32(*shape):
    return np.ones(shape, np.float32)


def _fwd(**kw):
    args = dict(x=_f32(2, 8), bias=_f32(8), activation="relu", p=0.1, seed=1, offset=0,
                y=_f32(2, 8))
    args.update(kw)
    return lambda: fusekit.bias_act_dropout_forward(**args)


def _bwd(**kw):
    args = dict(dy=_f32(2, 8), x=_f32(2, 8), bias=_f32(8), activation="relu", p=0.1, seed=1,
                offset=0, dx=_f32(2, 8))
    args.update(kw)
    return lambda: fusekit.bias_act_dropout_backward(**args)


BAD_CALLS = [
    ("activation_name", _fwd(activation="gelu"), "activation", "'gelu'"),
    ("activation_type", _fwd(activation=3), "activation", "int"),
    ("p_one", _fwd(p=1.0), "p", "[0, 1)"),
    ("p_negative", _fwd(p=-0.1), "p", None),
    ("p_nan", _fwd(p=float("nan")), "p", None),
    ("x_none", _fwd(x=None), "x", "got None"),
    ("x_f64", _fwd(x=np.ones((2, 8))), "x", "f64"),
    ("y_shape", _fwd(y=_f32(2, 9)), "y", None),
    ("y_dtype", _fwd(y=np.ones((2, 8), np.float16)), "y", "f16"),
    ("bias_length", _fwd(bias=_f32(9)), "bias", None),
    ("pre_activation_shape", _fwd(pre_activation=_f32(8, 2)), "pre_activation", None),
    ("seed_negative", _fwd(seed=-1), "seed", "-1"),
    ("seed_too_large", _bwd(seed=2**64), "seed", str(2**64)),
    ("offset_float", _fwd(offset=1.5), "offset", "float"),
    ("offset_bool", _fwd(offset=True), "offset", "bool"),
    ("slope_nan", _fwd(activation="leaky_relu", slope=float("nan")), "slope", None),
    ("dy_shape", _bwd(dy=_f32(3, 8)), None, None),
    ("dbias_length", _bwd(dbias=_f32(7)), "dbias", None),
    ("mask_dtype", lambda: fusekit.dropout_keep_mask(1, 0, 0.5, _f32(8)), "mask", "f32"),
    ("mask_p", lambda: fusekit.dropout_keep_mask(1, 0, 1.5, np.zeros(8, np.uint8)), "p", None),
    ("workspace_device", lambda: fusekit.bias_act_dropout_backward_workspace_size(
        4, 8, fusekit.DType.f32, "gpu"), "device", "'gpu'"),
]


@pytest.mark.parametrize("call,argument,words", [b[1:] for b in BAD_CALLS],
                         ids=[b[0] for b in BAD_CALLS])
def test_bad_arguments_raise_invalid_argument(call, argument, words):
    check_invalid_argument(call, argument, words)
