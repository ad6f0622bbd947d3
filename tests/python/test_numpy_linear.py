"""fusekit's fused Linear (+ bias + activation) bindings with NumPy arrays: the CPU backend (float64
reference, and f32/f16/bf16 rounded once) against NumPy float64 matrix products, every activation
the op accepts, and bad arguments raising fusekit exceptions with the C++ message."""
import numpy as np
import pytest

import fusekit
from fk_testing import (NUMPY_DTYPES, act, act_grad, check_close, check_invalid_argument, ml_dtypes,
                        rounding_error, to_f64)

DTYPES = ["f64", "f32", "f16", pytest.param("bf16", marks=pytest.mark.skipif(
    ml_dtypes is None, reason="ml_dtypes is not installed (NumPy has no bfloat16)"))]
ACTIVATIONS = ["none", "relu", "gelu_erf", "gelu_tanh", "squared_relu", "silu"]


def np_dtype(name):
    return np.float64 if name == "f64" else NUMPY_DTYPES[name]


def check(name, got, ref, dtype):
    if dtype == "f64":
        # The CPU backend is the float64 reference: only summation order differs.
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())
    else:
        check_close(name, got, ref, dtype, rounding_error(ref, np_dtype(dtype)))


def inputs(rng, lead, n, k, dtype):
    dt = np_dtype(dtype)
    x = rng.standard_normal(lead + (k,)).astype(dt)
    weight = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(dt)
    bias = rng.standard_normal(n).astype(dt)
    dout = rng.standard_normal(lead + (n,)).astype(dt)
    return x, weight, bias, dout


def forward(x, weight, bias, activation, save_pre=True):
    n = weight.shape[0]
    y = np.full(x.shape[:-1] + (n,), np.nan, x.dtype)
    pre = np.full_like(y, np.nan) if save_pre else None
    fusekit.linear_forward(x, weight, bias, activation, y, pre)
    return y, pre


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_forward_backward_match_float64(rng, activation, dtype, with_bias):
    lead, n, k = (3, 11), 24, 40
    x, weight, bias, dout = inputs(rng, lead, n, k, dtype)
    if not with_bias:
        bias = None
    y, pre = forward(x, weight, bias, activation)
    pre_ref = to_f64(x) @ to_f64(weight).T + (to_f64(bias) if bias is not None else 0.0)
    check("pre_activation", pre, pre_ref, dtype)
    check("y", y, act(activation, pre_ref), dtype)

    dx, dweight = np.full_like(x, np.nan), np.full_like(weight, np.nan)
    dbias = np.full(n, np.nan, x.dtype)
    fusekit.linear_backward(dout, x, weight, pre, activation, dx, dweight, dbias)
    # The backward's exact result for the pre_activation it was given (rounded to the dtype).
    dz = to_f64(dout) * act_grad(activation, to_f64(pre))
    dz2, x2 = dz.reshape(-1, n), to_f64(x).reshape(-1, k)
    check("dx", dx, (dz2 @ to_f64(weight)).reshape(x.shape), dtype)
    check("dweight", dweight, dz2.T @ x2, dtype)
    check("dbias", dbias, dz2.sum(axis=0), dtype)


@pytest.mark.parametrize("x_activation", ["gelu_tanh", "relu", "silu"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_through_input_activation(rng, x_activation, dtype):
    """For x = x_act(x_pre): dx_pre = (dz W) * x_act'(x_pre) and its column sums instead of dx."""
    lead, n, k = (5, 7), 24, 40
    x_pre, weight, _, dout = inputs(rng, lead, n, k, dtype)
    x = act(x_activation, to_f64(x_pre)).astype(x_pre.dtype)
    dx_pre = np.full_like(x, np.nan)
    dsum, dweight, dbias = np.full(k, np.nan, x.dtype), np.full_like(weight, np.nan), np.full(n, np.nan, x.dtype)
    fusekit.linear_backward_through_input_activation(dout, x, weight, None, "none", x_pre, x_activation, dx_pre,
                                                     dsum, dweight, dbias)
    dz2 = to_f64(dout).reshape(-1, n)
    want = (dz2 @ to_f64(weight)) * act_grad(x_activation, to_f64(x_pre).reshape(-1, k))
    check("dx_pre_activation", dx_pre, want.reshape(x.shape), dtype)
    check("dx_pre_activation_sum", dsum, want.sum(axis=0), dtype)
    check("dweight", dweight, dz2.T @ to_f64(x).reshape(-1, k), dtype)
    check("dbias", dbias, dz2.sum(axis=0), dtype)
    with pytest.raises(fusekit.InvalidArgumentError, match="x_activation"):
        fusekit.linear_backward_through_input_activation(dout, x, weight, None, "none", x_pre, "none", dx_pre)


def assert_f64_product_close(got, ref, terms):
    """float64 results of sums of products, summed in another order than NumPy's: each element
    within 1e-13 of the sum of its terms' magnitudes (`terms`), not of its own size, which a
    near-cancelling element can make arbitrarily small (a random draw gave an element of 7.9e-5
    differing by 1.6e-16, 2e-12 relative)."""
    assert np.all(np.abs(got - ref) <= 1e-13 * terms), np.max(np.abs(got - ref) / terms)


def test_backward_subsets_and_none_without_pre_activation(rng):
    x, weight, bias, dout = inputs(rng, (17,), 8, 12, "f64")
    y, _ = forward(x, weight, bias, "none", save_pre=False)
    assert_f64_product_close(y, x @ weight.T + bias, np.abs(x) @ np.abs(weight).T + np.abs(bias))
    full = [np.empty_like(x), np.empty_like(weight), np.empty_like(bias)]
    fusekit.linear_backward(dout, x, weight, None, "none", *full)
    assert_f64_product_close(full[0], dout @ weight, np.abs(dout) @ np.abs(weight))
    assert_f64_product_close(full[1], dout.T @ x, np.abs(dout).T @ np.abs(x))
    only_dw = np.empty_like(weight)
    fusekit.linear_backward(dout, x, weight, None, fusekit.Activation.none, dweight=only_dw)
    np.testing.assert_array_equal(only_dw, full[1])
    only_db = np.empty_like(bias)
    fusekit.linear_backward(dout, x, weight, None, "none", dbias=only_db)
    np.testing.assert_array_equal(only_db, full[2])


def test_strided_rows(rng):
    """x and y as column slices of wider arrays (row stride > length); padding never written."""
    wide = rng.standard_normal((9, 32)).astype(np.float32)
    x = wide[:, :20]
    weight = rng.standard_normal((6, 20)).astype(np.float32)
    out = np.full((9, 16), np.nan, np.float32)
    fusekit.linear_forward(x, weight, None, "relu", out[:, :6])
    assert np.all(np.isnan(out[:, 6:]))
    ref = np.maximum(to_f64(x) @ to_f64(weight).T, 0)
    check("y", out[:, :6], ref, "f32")


@pytest.mark.parametrize("dtype", ["f64", "f32"])
def test_weight_stored_transposed(rng, dtype):
    """A (K, N) weight through its transposed view (Hugging Face's Conv1D layout), dweight written
    into the transposed view of a padded (K, N + 3) array: the row-major weight's results, the
    padding never written."""
    dt = np_dtype(dtype)
    x, weight, bias, dout = inputs(rng, (4, 3), 6, 10, dtype)
    stored = np.ascontiguousarray(weight.T)  # (K, N)
    y_ref, pre_ref = forward(x, weight, bias, "gelu_tanh")
    y, pre = forward(x, stored.T, bias, "gelu_tanh")
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(pre, pre_ref)
    dw_ref = np.full((6, 10), np.nan, dt)
    fusekit.linear_backward(dout, x, weight, pre, "gelu_tanh", None, dw_ref, None)
    padded = np.full((10, 9), np.nan, dt)
    fusekit.linear_backward(dout, x, stored.T, pre, "gelu_tanh", None, padded[:, :6].T, None)
    np.testing.assert_array_equal(padded[:, :6].T, dw_ref)
    assert np.all(np.isnan(padded[:, 6:]))


def test_weight_with_no_contiguous_dimension_is_refused(rng):
    weight = np.zeros((12, 20), np.float32)[::2, ::2]  # (6, 10), strides (2 rows, 2 elements)
    y = np.zeros((3, 6), np.float32)
    check_invalid_argument(lambda: fusekit.linear_forward(np.zeros((3, 10), np.float32), weight, None, "none", y),
                           "weight", "rows or columns contiguous")


def test_empty_k_gives_bias(rng):
    """K = 0 (allowed by linear.h): x W^T is an empty sum, y = act(bias)."""
    bias = rng.standard_normal(5)
    y = np.full((3, 5), np.nan)
    fusekit.linear_forward(np.zeros((3, 0)), np.zeros((5, 0)), bias, "relu", y)
    np.testing.assert_array_equal(y, np.broadcast_to(np.maximum(bias, 0), (3, 5)))


def test_workspace_sizes_on_cpu_are_zero():
    for act_name in ACTIVATIONS:
        assert fusekit.linear_forward_workspace_size(64, 32, 16, fusekit.DType.f32, act_name, "cpu") == 0
        assert fusekit.linear_backward_workspace_size(64, 32, 16, fusekit.DType.f64, act_name, "cpu") == 0


# ---- bad input -> exceptions carrying the C++ message -----------------------------------------------
def _f(*shape, dtype=np.float64):
    return np.ones(shape, dtype)


def _fwd(**kw):
    args = dict(x=_f(4, 8), weight=_f(3, 8), bias=_f(3), activation="gelu_tanh", y=_f(4, 3),
                pre_activation=_f(4, 3))
    args.update(kw)
    return lambda: fusekit.linear_forward(**args)


def _bwd(**kw):
    args = dict(dout=_f(4, 3), x=_f(4, 8), weight=_f(3, 8), pre_activation=_f(4, 3),
                activation="gelu_tanh", dx=_f(4, 8), dweight=_f(3, 8), dbias=_f(3))
    args.update(kw)
    return lambda: fusekit.linear_backward(**args)


BAD_CALLS = [
    ("activation_leaky_relu", _fwd(activation="leaky_relu"), "activation", "leaky_relu"),
    ("activation_unknown", _fwd(activation="tanh"), "activation", "'tanh'"),
    ("activation_none_object", _fwd(activation=None), "activation", None),
    ("x_none", _fwd(x=None), "x", "got None"),
    ("weight_k", _fwd(weight=_f(3, 7)), "weight", None),
    ("weight_dtype", _fwd(weight=_f(3, 8, dtype=np.float32)), "weight", "f32"),
    ("bias_length", _fwd(bias=_f(4)), "bias", None),
    ("y_shape", _fwd(y=_f(4, 4)), "y", None),
    ("y_rows", _fwd(y=_f(5, 3)), "y", None),
    ("x_int", _fwd(x=_f(4, 8, dtype=np.int32)), "x", "i32"),
    ("pre_activation_missing", _bwd(pre_activation=None), "pre_activation", None),
    ("dx_shape", _bwd(dx=_f(8, 4)), "dx", None),
    ("dweight_shape", _bwd(dweight=_f(8, 3)), "dweight", None),
    ("workspace_device", lambda: fusekit.linear_forward_workspace_size(
        4, 8, 8, fusekit.DType.f16, "relu", "tpu"), "device", "'tpu'"),
    ("workspace_activation", lambda: fusekit.linear_backward_workspace_size(
        4, 8, 8, fusekit.DType.f16, "swish", "cpu"), "activation", "'swish'"),
]


@pytest.mark.parametrize("call,argument,words", [b[1:] for b in BAD_CALLS],
                         ids=[b[0] for b in BAD_CALLS])
def test_bad_arguments_raise_invalid_argument(call, argument, words):
    check_invalid_argument(call, argument, words)
