"""fusekit's core bindings with NumPy arrays: LayerNorm/RMSNorm on the CPU backend against a
NumPy float64 implementation, argument conversion through DLPack / the buffer protocol, and every
kind of bad input raising a Python exception (never crashing the interpreter)."""
import numpy as np
import pytest

import fusekit
from fk_testing import (NUMPY_DTYPES, check_close, check_invalid_argument, ml_dtypes,
                        rounding_error, to_f64)

DTYPES = ["f32", "f16", pytest.param("bf16", marks=pytest.mark.skipif(
    ml_dtypes is None, reason="ml_dtypes is not installed (NumPy has no bfloat16)"))]
KINDS = ["layer_norm", "rms_norm"]
EPS = 1e-5


# ---- float64 reference ---------------------------------------------------------------------------
def ref_stats(kind, x, eps):
    x = to_f64(x)
    mean = x.mean(-1, keepdims=True) if kind == "layer_norm" else np.zeros(x.shape[:-1] + (1,))
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)
    return mean, rstd


def ref_forward(kind, x, weight, bias, eps):
    mean, rstd = ref_stats(kind, x, eps)
    y = (to_f64(x) - mean) * rstd
    if weight is not None:
        y = y * to_f64(weight)
    if bias is not None:
        y = y + to_f64(bias)
    return y, mean[..., 0], rstd[..., 0]


def ref_backward(kind, dy, x, weight, eps, y=None, bias=None):
    """From x, or (y given) with x_hat recomputed from the output as the *_from_output ops do:
    the exact result for the rounded y they are given."""
    mean, rstd = ref_stats(kind, x, eps)
    xhat = (to_f64(x) - mean) * rstd
    if y is not None:
        xhat = (to_f64(y) - (to_f64(bias) if bias is not None else 0.0)) / to_f64(weight)
    dy = to_f64(dy)
    g = dy * (to_f64(weight) if weight is not None else 1.0)
    mean_g = g.mean(-1, keepdims=True) if kind == "layer_norm" else 0.0
    dx = rstd * (g - mean_g - xhat * (g * xhat).mean(-1, keepdims=True))
    lead = tuple(range(dy.ndim - 1))
    return dx, (dy * xhat).sum(axis=lead), dy.sum(axis=lead)


def random_inputs(rng, shape, dtype_name, weight_dtype_name=None):
    dt = NUMPY_DTYPES[dtype_name]
    wdt = NUMPY_DTYPES[weight_dtype_name or dtype_name]
    n = shape[-1]
    x = (rng.standard_normal(shape) * 2 + 0.3).astype(dt)
    # Weights away from zero so that the from-output backward is well conditioned.
    weight = (rng.uniform(0.5, 1.5, n) * rng.choice([-1, 1], n)).astype(wdt)
    bias = rng.standard_normal(n).astype(wdt)
    dy = rng.standard_normal(shape).astype(dt)
    return x, weight, bias, dy


def forward(kind, x, weight, bias, eps=EPS, stats=True):
    y = np.full_like(x, np.nan)
    rows = x.shape[:-1]
    mean = np.full(rows, np.nan, np.float32) if stats and kind == "layer_norm" else None
    rstd = np.full(rows, np.nan, np.float32) if stats else None
    if kind == "layer_norm":
        fusekit.layer_norm_forward(x, weight, bias, eps, y, mean, rstd)
    else:
        fusekit.rms_norm_forward(x, weight, eps, y, rstd)
    return y, mean, rstd


# ---- results against float64 ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 33), (3, 5, 64), (2, 1000), (1, 1)])
@pytest.mark.parametrize("affine", ["weight+bias", "weight", "none"])
def test_forward_matches_float64(rng, kind, dtype, shape, affine):
    x, weight, bias, _ = random_inputs(rng, shape, dtype)
    if affine != "weight+bias":
        bias = None
    if affine == "none":
        weight = None
    if kind == "rms_norm":
        bias = None
    y, mean, rstd = forward(kind, x, weight, bias)
    y_ref, mean_ref, rstd_ref = ref_forward(kind, x, weight, bias, EPS)
    if shape[-1] == 1 and kind == "layer_norm":
        # x - mean is exactly 0: y is the bias (or 0); no relative error to speak of.
        np.testing.assert_array_equal(to_f64(y), y_ref)
    else:
        check_close("y", y, y_ref, dtype, rounding_error(y_ref, NUMPY_DTYPES[dtype]))
    check_close("rstd", rstd, rstd_ref, "f32", rounding_error(rstd_ref, np.float32))
    if kind == "layer_norm":
        np.testing.assert_allclose(mean, mean_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("from_output", [False, True], ids=["from_x", "from_y"])
def test_backward_matches_float64(rng, kind, dtype, from_output):
    shape = (37, 96)
    x, weight, bias, dy = random_inputs(rng, shape, dtype)
    if kind == "rms_norm":
        bias = None
    y, mean, rstd = forward(kind, x, weight, bias)
    dx = np.full_like(x, np.nan)
    dweight = np.full_like(weight, np.nan)
    dbias = np.full_like(weight, np.nan)
    if kind == "layer_norm" and not from_output:
        fusekit.layer_norm_backward(dy, x, weight, mean, rstd, dx, dweight, dbias)
    elif kind == "layer_norm":
        fusekit.layer_norm_backward_from_output(dy, y, weight, bias, rstd, dx, dweight, dbias)
    elif not from_output:
        fusekit.rms_norm_backward(dy, x, weight, rstd, dx, dweight)
    else:
        fusekit.rms_norm_backward_from_output(dy, y, weight, rstd, dx, dweight)
    dx_ref, dw_ref, db_ref = ref_backward(kind, dy, x, weight, EPS,
                                          *((y, bias) if from_output else ()))
    np_dtype = NUMPY_DTYPES[dtype]
    check_close("dx", dx, dx_ref, dtype, rounding_error(dx_ref, np_dtype))
    check_close("dweight", dweight, dw_ref, dtype, rounding_error(dw_ref, np_dtype))
    if kind == "layer_norm":
        check_close("dbias", dbias, db_ref, dtype, rounding_error(db_ref, np_dtype))


@pytest.mark.parametrize("kind", KINDS)
def test_float32_weights_with_half_activations(rng, kind):
    x, weight, bias, dy = random_inputs(rng, (9, 128), "f16", weight_dtype_name="f32")
    if kind == "rms_norm":
        bias = None
    y, mean, rstd = forward(kind, x, weight, bias)
    y_ref, _, _ = ref_forward(kind, x, weight, bias, EPS)
    check_close("y", y, y_ref, "f16", rounding_error(y_ref, np.float16))
    dweight = np.full_like(weight, np.nan)
    if kind == "layer_norm":
        fusekit.layer_norm_backward(dy, x, weight, mean, rstd, dweight=dweight)
    else:
        fusekit.rms_norm_backward(dy, x, weight, rstd, dweight=dweight)
    _, dw_ref, _ = ref_backward(kind, dy, x, weight, EPS)
    check_close("dweight", dweight, dw_ref, "f32", rounding_error(dw_ref, np.float32))


@pytest.mark.parametrize("kind", KINDS)
def test_strided_rows_leave_padding_untouched(rng, kind):
    """Rows `stride > N` apart (a slice of a wider array) in and out; the padding between rows
    is never written."""
    n = 40
    wide = (rng.standard_normal((11, 64)) * 2).astype(np.float32)
    x = wide[:, :n]
    weight = rng.uniform(0.5, 1.5, n).astype(np.float32)
    out = np.full((11, 64), np.nan, np.float32)
    y = out[:, :n]
    if kind == "layer_norm":
        fusekit.layer_norm_forward(x, weight, None, EPS, y)
    else:
        fusekit.rms_norm_forward(x, weight, EPS, y)
    assert np.all(np.isnan(out[:, n:])), "padding between rows was written"
    y_ref, _, _ = ref_forward(kind, x, weight, None, EPS)
    check_close("y", y, y_ref, "f32", rounding_error(y_ref, np.float32))
    y_contiguous, _, _ = forward(kind, np.ascontiguousarray(x), weight, None, stats=False)
    np.testing.assert_array_equal(y, y_contiguous)


def test_backward_subsets_and_determinism(rng):
    x, weight, bias, dy = random_inputs(rng, (64, 256), "f32")
    _, mean, rstd = forward("layer_norm", x, weight, bias)
    full = [np.empty_like(x), np.empty_like(weight), np.empty_like(weight)]
    fusekit.layer_norm_backward(dy, x, weight, mean, rstd, *full)
    again = [np.empty_like(x), np.empty_like(weight), np.empty_like(weight)]
    fusekit.layer_norm_backward(dy, x, weight, mean, rstd, *again)
    for a, b in zip(full, again):
        np.testing.assert_array_equal(a, b)  # bitwise: fixed reduction order
    only_dx = np.empty_like(x)
    fusekit.layer_norm_backward(dy, x, weight, mean, rstd, dx=only_dx)
    np.testing.assert_array_equal(only_dx, full[0])
    only_db = np.empty_like(weight)
    fusekit.layer_norm_backward(dy, x, weight, mean, rstd, dbias=only_db)
    np.testing.assert_array_equal(only_db, full[2])


def test_read_only_inputs_are_accepted(rng):
    x, weight, bias, _ = random_inputs(rng, (4, 16), "f32")
    for a in (x, weight, bias):
        a.setflags(write=False)
    y, _, _ = forward("layer_norm", x, weight, bias, stats=False)
    y_ref, _, _ = ref_forward("layer_norm", x, weight, bias, EPS)
    check_close("y", y, y_ref, "f32", rounding_error(y_ref, np.float32))


# ---- residual variants --------------------------------------------------------------------------------
def residual_forward(kind, x, residual, weight, bias, with_sum=True):
    y = np.full_like(x, np.nan)
    s = np.full_like(x, np.nan) if with_sum else None
    rows = x.shape[:-1]
    mean = np.full(rows, np.nan, np.float32) if kind == "layer_norm" else None
    rstd = np.full(rows, np.nan, np.float32)
    if kind == "layer_norm":
        fusekit.layer_norm_residual_forward(x, residual, weight, bias, EPS, y, s, mean, rstd)
    else:
        fusekit.rms_norm_residual_forward(x, residual, weight, EPS, y, s, rstd)
    return y, s, mean, rstd


def residual_backward(kind, dy, s, dsum, weight, mean, rstd, dx):
    dweight = np.full_like(weight, np.nan)
    dbias = np.full_like(weight, np.nan) if kind == "layer_norm" else None
    if kind == "layer_norm":
        fusekit.layer_norm_residual_backward(dy, s, dsum, weight, mean, rstd, dx, dweight, dbias)
    else:
        fusekit.rms_norm_residual_backward(dy, s, dsum, weight, rstd, dx, dweight)
    return dweight, dbias


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 33), (3, 5, 64), (2, 1000)])
@pytest.mark.parametrize("with_dsum", [True, False], ids=["dsum", "no_dsum"])
def test_residual_matches_float64(rng, kind, dtype, shape, with_dsum):
    """sum = x + residual rounded to the dtype; y = norm(sum); dx = the backward at the sum + dsum."""
    x, weight, bias, dy = random_inputs(rng, shape, dtype)
    np_dtype = NUMPY_DTYPES[dtype]
    residual = rng.standard_normal(shape).astype(np_dtype)
    if kind == "rms_norm":
        bias = None
    y, s, mean, rstd = residual_forward(kind, x, residual, weight, bias)
    s_ref = (to_f64(x) + to_f64(residual)).astype(np_dtype)  # one rounding of the exact sum
    np.testing.assert_array_equal(to_f64(s), to_f64(s_ref))
    y_ref, _, rstd_ref = ref_forward(kind, s, weight, bias, EPS)
    check_close("y", y, y_ref, dtype, rounding_error(y_ref, np_dtype))
    check_close("rstd", rstd, rstd_ref, "f32", rounding_error(rstd_ref, np.float32))
    y_no_sum, none, _, _ = residual_forward(kind, x, residual, weight, bias, with_sum=False)
    assert none is None
    np.testing.assert_array_equal(to_f64(y_no_sum), to_f64(y))

    dsum = rng.standard_normal(shape).astype(np_dtype) if with_dsum else None
    dx = np.full_like(x, np.nan)
    dweight, dbias = residual_backward(kind, dy, s, dsum, weight, mean, rstd, dx)
    dx_ref, dw_ref, db_ref = ref_backward(kind, dy, s, weight, EPS)
    if with_dsum:
        dx_ref = dx_ref + to_f64(dsum)
    check_close("dx", dx, dx_ref, dtype, rounding_error(dx_ref, np_dtype))
    check_close("dweight", dweight, dw_ref, dtype, rounding_error(dw_ref, np_dtype))
    if kind == "layer_norm":
        check_close("dbias", dbias, db_ref, dtype, rounding_error(db_ref, np_dtype))


@pytest.mark.parametrize("kind", KINDS)
def test_residual_dx_in_place_over_dsum_and_strided_rows(rng, kind):
    """dx written over dsum itself gives the separate dx; every tensor may have its own row stride."""
    n = 40
    x, weight, bias, dy = random_inputs(rng, (11, n), "f32")
    residual = np.ascontiguousarray(rng.standard_normal((11, 64)).astype(np.float32))[:, :n]
    if kind == "rms_norm":
        bias = None
    sum_wide = np.full((11, 48), np.nan, np.float32)
    s = sum_wide[:, :n]
    y = np.full_like(x, np.nan)
    mean = np.full(11, np.nan, np.float32) if kind == "layer_norm" else None
    rstd = np.full(11, np.nan, np.float32)
    if kind == "layer_norm":
        fusekit.layer_norm_residual_forward(x, residual, weight, bias, EPS, y, s, mean, rstd)
    else:
        fusekit.rms_norm_residual_forward(x, residual, weight, EPS, y, s, rstd)
    assert np.all(np.isnan(sum_wide[:, n:])), "padding between rows of sum was written"
    np.testing.assert_array_equal(s, x + residual)
    dsum = rng.standard_normal((11, n)).astype(np.float32)
    dx = np.full_like(x, np.nan)
    dweight, dbias = residual_backward(kind, dy, s, dsum, weight, mean, rstd, dx)
    in_place = dsum.copy()
    dweight2, dbias2 = residual_backward(kind, dy, s, in_place, weight, mean, rstd, in_place)
    np.testing.assert_array_equal(in_place, dx)
    np.testing.assert_array_equal(dweight2, dweight)
    if kind == "layer_norm":
        np.testing.assert_array_equal(dbias2, dbias)


def test_residual_overlaps_are_refused(rng):
    x, weight, bias, dy = random_inputs(rng, (4, 16), "f32")
    residual = rng.standard_normal((4, 16)).astype(np.float32)
    y, rstd = np.empty_like(x), np.empty(4, np.float32)
    check_invalid_argument(lambda: fusekit.rms_norm_residual_forward(x, residual, weight, EPS, y, x, rstd),
                           "sum", "overlap 'x'")
    check_invalid_argument(lambda: fusekit.rms_norm_residual_forward(x, residual, weight, EPS, y, residual, rstd),
                           "sum", "overlap 'residual'")
    check_invalid_argument(lambda: fusekit.rms_norm_residual_forward(x, residual[:3], weight, EPS, y, None, rstd),
                           "residual", "shape")
    s = x + residual
    dsum = rng.standard_normal((4, 16)).astype(np.float32)
    check_invalid_argument(lambda: fusekit.rms_norm_residual_backward(dy, s, dsum, weight, rstd, s),
                           "dx", "overlap 'sum'")
    wide = np.zeros((5, 16), np.float32)
    check_invalid_argument(lambda: fusekit.rms_norm_residual_backward(dy, s, wide[:4], weight, rstd, wide[1:]),
                           "dx", "overlap 'dsum'")
    check_invalid_argument(lambda: fusekit.rms_norm_residual_backward(dy, s, dsum[:, :8], weight, rstd),
                           "dsum", "shape")


# ---- how arrays are seen ----------------------------------------------------------------------------
@pytest.mark.parametrize("np_dtype,name", [(np.float32, "f32"), (np.float16, "f16"),
                                           (np.float64, "f64"), (np.uint8, "u8"),
                                           (np.int32, "i32"), (np.int64, "i64")])
def test_tensor_info_dtypes(np_dtype, name):
    assert fusekit.tensor_info(np.zeros((2, 3), np_dtype))["dtype"] == name


@pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed")
@pytest.mark.parametrize("ext,name", [("bfloat16", "bf16"), ("float8_e4m3fn", "f8e4m3"),
                                      ("float8_e5m2", "f8e5m2")])
def test_tensor_info_ml_dtypes(ext, name):
    a = np.zeros((2, 3), getattr(ml_dtypes, ext))
    info = fusekit.tensor_info(a)
    assert info["dtype"] == name and info["shape"] == "(2, 3)" and info["strides"] == "(3, 1)"
    assert info["data"] == a.ctypes.data


def test_tensor_info_views():
    a = np.zeros((4, 6), np.float32)
    t = fusekit.tensor_info(a.T)
    assert (t["shape"], t["strides"], t["device"]) == ("(6, 4)", "(1, 6)", "cpu")
    s = fusekit.tensor_info(a[1:, ::2])
    assert (s["shape"], s["strides"]) == ("(3, 3)", "(6, 2)")
    assert s["data"] == a.ctypes.data + 6 * 4  # the view's offset is applied
    assert fusekit.tensor_info(np.float32(1.0).reshape(()))["shape"] == "()"


def test_runtime_queries():
    count = fusekit.cuda_device_count()
    assert isinstance(count, int) and count >= 0
    assert "90a" in fusekit.built_cuda_architectures()
    if count == 0:
        with pytest.raises(fusekit.Error):
            fusekit.describe_cuda_device(0)


# ---- bad input -> exceptions carrying the C++ message -----------------------------------------------
def _f32(*shape):
    return np.ones(shape, np.float32)


BAD_CALLS = [
    # (id, call, argument named in the message, words the message must contain)
    ("x_none", lambda: fusekit.layer_norm_forward(None, None, None, EPS, _f32(2, 4)), "x", "got None"),
    ("x_list", lambda: fusekit.layer_norm_forward([[1.0]], None, None, EPS, _f32(1, 1)), "x", "got list"),
    ("x_str", lambda: fusekit.rms_norm_forward("abc", None, EPS, _f32(1, 1)), "x", "got str"),
    ("x_f64", lambda: fusekit.layer_norm_forward(np.ones((2, 4)), None, None, EPS, _f32(2, 4)), "x", "f64"),
    ("x_int8", lambda: fusekit.layer_norm_forward(np.ones((2, 4), np.int8), None, None, EPS, _f32(2, 4)), "x", "int8"),
    ("x_complex", lambda: fusekit.rms_norm_forward(np.ones((2, 4), np.complex64), None, EPS, _f32(2, 4)), "x", "complex64"),
    ("x_bool", lambda: fusekit.rms_norm_forward(np.ones((2, 4), bool), None, EPS, _f32(2, 4)), "x", "bool"),
    ("x_7d", lambda: fusekit.rms_norm_forward(_f32(*[1] * 7), None, EPS, _f32(*[1] * 7)), "x", "7 dimensions"),
    ("x_0d", lambda: fusekit.rms_norm_forward(np.float32(1).reshape(()), None, EPS, _f32(1)), "x", None),
    ("x_strided_last_dim", lambda: fusekit.layer_norm_forward(_f32(4, 8)[:, ::2], None, None, EPS, _f32(4, 4)), "x", None),
    ("x_n_too_large", lambda: fusekit.rms_norm_forward(_f32(1, 70000), None, EPS, _f32(1, 70000)), "x", "65536"),
    ("y_shape", lambda: fusekit.layer_norm_forward(_f32(2, 4), None, None, EPS, _f32(2, 5)), "y", "(2, 5)"),
    ("y_dtype", lambda: fusekit.layer_norm_forward(_f32(2, 4), None, None, EPS, np.ones((2, 4), np.float16)), "y", "f16"),
    ("y_read_only", lambda: fusekit.layer_norm_forward(_f32(2, 4), None, None, EPS, np.broadcast_to(_f32(4), (2, 4))), "y", "read-only"),
    ("weight_length", lambda: fusekit.layer_norm_forward(_f32(2, 4), _f32(5), None, EPS, _f32(2, 4)), "weight", None),
    ("weight_dtype", lambda: fusekit.layer_norm_forward(_f32(2, 4), np.ones(4, np.float16), None, EPS, _f32(2, 4)), "weight", "f16"),
    ("bias_2d", lambda: fusekit.layer_norm_forward(_f32(2, 4), None, _f32(1, 4), EPS, _f32(2, 4)), "bias", None),
    ("mean_f64", lambda: fusekit.layer_norm_forward(_f32(2, 4), None, None, EPS, _f32(2, 4), np.ones(2)), "mean", "float32"),
    ("rstd_count", lambda: fusekit.rms_norm_forward(_f32(2, 4), None, EPS, _f32(2, 4), _f32(3)), "rstd", None),
    ("eps_negative", lambda: fusekit.rms_norm_forward(_f32(2, 4), None, -1.0, _f32(2, 4)), "eps", "non-negative"),
    ("eps_nan", lambda: fusekit.rms_norm_forward(_f32(2, 4), None, float("nan"), _f32(2, 4)), "eps", None),
    ("stream_str", lambda: fusekit.rms_norm_forward(_f32(2, 4), None, EPS, _f32(2, 4), stream="s"), "stream", "not str"),
    ("stream_negative", lambda: fusekit.rms_norm_forward(_f32(2, 4), None, EPS, _f32(2, 4), stream=-1), "stream", "-1"),
    ("dy_none", lambda: fusekit.rms_norm_backward(None, _f32(2, 4), None, _f32(2), _f32(2, 4)), "dy", "got None"),
    ("dx_shape", lambda: fusekit.rms_norm_backward(_f32(2, 4), _f32(2, 4), None, _f32(2), _f32(4, 2)), "dx", None),
    ("dweight_without_weight", lambda: fusekit.rms_norm_backward(_f32(2, 4), _f32(2, 4), None, _f32(2), dweight=_f32(4)), "dweight", None),
    ("input_rows_differ", lambda: fusekit.layer_norm_backward(_f32(2, 4), _f32(3, 4), None, _f32(2), _f32(2)), "x", None),
    ("workspace_device", lambda: fusekit.norm_backward_workspace_size(4, 8, fusekit.DType.f32, "gpu"), "device", "'gpu'"),
]


@pytest.mark.parametrize("call,argument,words", [b[1:] for b in BAD_CALLS], ids=[b[0] for b in BAD_CALLS])
def test_bad_arguments_raise_invalid_argument(call, argument, words):
    check_invalid_argument(call, argument, words)


GARBAGE = [None, 1, 2.5, "x", b"x", [1, 2], {"a": 1}, object(), np.float32(1.0), (np.ones(3),),
           np.array(["a", "b"]), np.array([object()]), np.zeros((0, 4), np.float32),
           np.zeros((4, 0), np.float32), np.ones((2, 3), np.float32)[:, None]]


@pytest.mark.parametrize("value", GARBAGE, ids=[type(g).__name__ + str(i) for i, g in enumerate(GARBAGE)])
@pytest.mark.parametrize("position", range(4))
def test_garbage_never_crashes(value, position):
    """Any object in any array slot: either a valid call or a Python exception."""
    args = [_f32(2, 4), _f32(4), _f32(2, 4), _f32(2)]
    args[position] = value
    x, weight, y, rstd = args
    try:
        fusekit.rms_norm_forward(x, weight, EPS, y, rstd)
    except (fusekit.Error, TypeError):
        pass


def test_empty_rows_are_fine_or_rejected_cleanly():
    x = np.zeros((0, 8), np.float32)
    try:
        fusekit.layer_norm_forward(x, None, None, EPS, np.zeros_like(x))
    except fusekit.InvalidArgumentError as e:
        assert "argument 'x'" in str(e)


def test_error_classes():
    assert issubclass(fusekit.InvalidArgumentError, ValueError)
    for cls in (fusekit.UnsupportedError, fusekit.CudaError):
        assert issubclass(cls, RuntimeError) and issubclass(cls, fusekit.Error)
        assert not issubclass(cls, ValueError)


def test_workspace_auto_and_bad_strings():
    """workspace='auto' takes scratch memory from the arrays' framework when the op needs any:
    the CPU backend needs none, so NumPy arrays run; any other string is refused clearly."""
    x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    w = np.ones(32, np.float32)
    y, mean, rstd = np.empty_like(x), np.empty(4, np.float32), np.empty(4, np.float32)
    fusekit.layer_norm_forward(x, w, None, 1e-5, y, mean, rstd)
    dy = np.ones_like(x)
    dx, dw = np.empty_like(x), np.empty_like(w)
    fusekit.layer_norm_backward(dy, x, w, mean, rstd, dx, dw, None, "auto")
    dx2, dw2 = np.empty_like(x), np.empty_like(w)
    fusekit.layer_norm_backward(dy, x, w, mean, rstd, dx2, dw2, None, None)
    assert np.array_equal(dx, dx2) and np.array_equal(dw, dw2)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'workspace'.*'auto'"):
        fusekit.layer_norm_backward(dy, x, w, mean, rstd, dx, dw, None, "automatic")
