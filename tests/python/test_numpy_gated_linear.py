"""fusekit's gated linear bindings with NumPy arrays: the CPU backend (float64 reference, and
f32/f16/bf16 rounded once) against NumPy float64 gate and up projections, y = act(gate) * up, in
both weight layouts, with and without a bias, every gate activation; the backward's dx, dW, dbias
and their subsets; weights stored transposed; and bad arguments raising fusekit exceptions with
the C++ message, naming the Python argument."""
import numpy as np
import pytest

import fusekit
from fk_testing import (NUMPY_DTYPES, act, act_grad, check_close, check_invalid_argument, ml_dtypes,
                        rounding_error, to_f64)

DTYPES = ["f64", "f32", "f16", pytest.param("bf16", marks=pytest.mark.skipif(
    ml_dtypes is None, reason="ml_dtypes is not installed (NumPy has no bfloat16)"))]
ACTIVATIONS = ["silu", "gelu_tanh", "gelu_erf", "relu"]
LAYOUTS = ["interleaved", "halves"]


def np_dtype(name):
    return np.float64 if name == "f64" else NUMPY_DTYPES[name]


def check(name, got, ref, dtype):
    if dtype == "f64":
        # The CPU backend is the float64 reference: only summation order differs.
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())
    else:
        check_close(name, got, ref, dtype, rounding_error(ref, np_dtype(dtype)))


def join_rows(gate, up, layout):
    """The (2F, ...) stack of gate's and up's rows (or entries) in `layout`'s order."""
    if layout == "halves":
        return np.concatenate([gate, up], axis=0)
    both = np.empty((2 * gate.shape[0],) + gate.shape[1:], gate.dtype)
    both[0::2], both[1::2] = gate, up
    return both


def split_cols(both, layout):
    """(gate, up) columns of a (..., 2F) array in `layout`."""
    f = both.shape[-1] // 2
    return (both[..., :f], both[..., f:]) if layout == "halves" else (both[..., 0::2], both[..., 1::2])


def inputs(rng, lead, f, k, dtype):
    """x, the gate and up weights (F, K) and biases (F), dy; gate values spread over both sides of
    each activation's bend."""
    dt = np_dtype(dtype)
    x = rng.standard_normal(lead + (k,)).astype(dt)
    w_gate = (rng.standard_normal((f, k)) * 1.5 / np.sqrt(k)).astype(dt)
    w_up = (rng.standard_normal((f, k)) / np.sqrt(k)).astype(dt)
    b_gate, b_up = rng.standard_normal(f).astype(dt), rng.standard_normal(f).astype(dt)
    dy = rng.standard_normal(lead + (f,)).astype(dt)
    return x, (w_gate, w_up), (b_gate, b_up), dy


def forward(x, weight, bias, activation, layout, save_pre=True):
    f = weight.shape[0] // 2
    y = np.full(x.shape[:-1] + (f,), np.nan, x.dtype)
    pre = np.full(x.shape[:-1] + (2 * f,), np.nan, x.dtype) if save_pre else None
    fusekit.gated_linear_forward(x, weight, bias, activation, y, pre, layout=layout)
    return y, pre


def backward_reference(dy, x, weight, pre, activation, layout):
    """dx, dW, dbias in float64 from the pre-activation the backward is given (rounded to the dtype)."""
    gate, up = split_cols(to_f64(pre), layout)
    d = to_f64(dy)
    dpre = np.empty(pre.shape)
    dgate, dup = split_cols(dpre, layout)
    dgate[...] = d * up * act_grad(activation, gate)
    dup[...] = d * act(activation, gate)
    n, k = weight.shape
    dpre2, x2 = dpre.reshape(-1, n), to_f64(x).reshape(-1, k)
    return (dpre2 @ to_f64(weight)).reshape(x.shape), dpre2.T @ x2, dpre2.sum(axis=0)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_forward_backward_match_float64(rng, activation, layout, dtype, with_bias):
    lead, f, k = (3, 7), 13, 40
    x, (w_gate, w_up), (b_gate, b_up), dy = inputs(rng, lead, f, k, dtype)
    weight = join_rows(w_gate, w_up, layout)
    bias = join_rows(b_gate, b_up, layout) if with_bias else None
    y, pre = forward(x, weight, bias, activation, layout)

    gate_ref = to_f64(x) @ to_f64(w_gate).T + (to_f64(b_gate) if with_bias else 0.0)
    up_ref = to_f64(x) @ to_f64(w_up).T + (to_f64(b_up) if with_bias else 0.0)
    gate, up = split_cols(pre, layout)
    check("pre_activation gate", gate, gate_ref, dtype)
    check("pre_activation up", up, up_ref, dtype)
    check("y", y, act(activation, gate_ref) * up_ref, dtype)

    dx, dweight = np.full_like(x, np.nan), np.full_like(weight, np.nan)
    dbias = np.full(2 * f, np.nan, x.dtype)
    fusekit.gated_linear_backward(dy, x, weight, pre, activation, dx, dweight, dbias, layout=layout)
    dx_ref, dweight_ref, dbias_ref = backward_reference(dy, x, weight, pre, activation, layout)
    check("dx", dx, dx_ref, dtype)
    check("dweight", dweight, dweight_ref, dtype)
    check("dbias", dbias, dbias_ref, dtype)


def test_layouts_and_enum_names_agree(rng):
    """The same gate and up weights in either layout give the same y and gradients (reordered), and
    a fusekit.GatedLayout / fusekit.Activation is its name."""
    x, (w_gate, w_up), (b_gate, b_up), dy = inputs(rng, (9,), 6, 16, "f64")
    results = {}
    for layout in LAYOUTS:
        weight, bias = join_rows(w_gate, w_up, layout), join_rows(b_gate, b_up, layout)
        y, pre = forward(x, weight, bias, "gelu_tanh", layout)
        grads = [np.empty_like(x), np.empty_like(weight), np.empty_like(bias)]
        fusekit.gated_linear_backward(dy, x, weight, pre, fusekit.Activation.gelu_tanh, *grads,
                                      layout=fusekit.GatedLayout.__members__[layout])
        results[layout] = (y, grads[0], split_cols(grads[1].T, layout), split_cols(grads[2], layout))
    a, b = results["interleaved"], results["halves"]
    np.testing.assert_allclose(a[0], b[0], rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(a[1], b[1], rtol=1e-13, atol=1e-13)
    for part_a, part_b in zip(a[2] + a[3], b[2] + b[3]):
        np.testing.assert_allclose(part_a, part_b, rtol=1e-13, atol=1e-13)


def test_pre_activation_optional_and_backward_subsets(rng):
    x, (w_gate, w_up), (b_gate, b_up), dy = inputs(rng, (5, 3), 8, 12, "f32")
    weight, bias = join_rows(w_gate, w_up, "interleaved"), join_rows(b_gate, b_up, "interleaved")
    y, pre = forward(x, weight, bias, "silu", "interleaved")
    y_alone, _ = forward(x, weight, bias, "silu", "interleaved", save_pre=False)
    np.testing.assert_array_equal(y_alone, y)
    full = [np.empty_like(x), np.empty_like(weight), np.empty_like(bias)]
    fusekit.gated_linear_backward(dy, x, weight, pre, "silu", *full)  # layout defaults to interleaved
    for i, name in enumerate(("dx", "dweight", "dbias")):
        alone = np.full_like(full[i], np.nan)
        fusekit.gated_linear_backward(dy, x, weight, pre, "silu", **{name: alone})
        np.testing.assert_array_equal(alone, full[i])
    fusekit.gated_linear_backward(dy, x, weight, pre, "silu")  # nothing asked for: nothing to do


def test_strided_rows(rng):
    """x, y and pre_activation as column slices of wider arrays (row stride > length): the padding
    is never written."""
    wide = rng.standard_normal((9, 32)).astype(np.float32)
    x = wide[:, :20]
    weight = (rng.standard_normal((12, 20)) / 4).astype(np.float32)
    out, pre_out = np.full((9, 16), np.nan, np.float32), np.full((9, 16), np.nan, np.float32)
    fusekit.gated_linear_forward(x, weight, None, "relu", out[:, :6], pre_out[:, :12], layout="halves")
    assert np.all(np.isnan(out[:, 6:])) and np.all(np.isnan(pre_out[:, 12:]))
    pre_ref = to_f64(x) @ to_f64(weight).T
    check("pre_activation", pre_out[:, :12], pre_ref, "f32")
    check("y", out[:, :6], np.maximum(pre_ref[:, :6], 0) * pre_ref[:, 6:], "f32")


@pytest.mark.parametrize("dtype", ["f64", "f32"])
def test_weight_stored_transposed(rng, dtype):
    """A (K, 2F) weight through its transposed view, dweight written into the transposed view of a
    padded (K, 2F + 3) array: the row-major weight's results, the padding never written."""
    dt = np_dtype(dtype)
    x, (w_gate, w_up), (b_gate, b_up), dy = inputs(rng, (4, 3), 5, 10, dtype)
    weight, bias = join_rows(w_gate, w_up, "interleaved"), join_rows(b_gate, b_up, "interleaved")
    stored = np.ascontiguousarray(weight.T)  # (K, 2F)
    y_ref, pre_ref = forward(x, weight, bias, "gelu_erf", "interleaved")
    y, pre = forward(x, stored.T, bias, "gelu_erf", "interleaved")
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(pre, pre_ref)
    dw_ref = np.full((10, 10), np.nan, dt)
    fusekit.gated_linear_backward(dy, x, weight, pre, "gelu_erf", None, dw_ref, None)
    padded = np.full((10, 13), np.nan, dt)
    fusekit.gated_linear_backward(dy, x, stored.T, pre, "gelu_erf", None, padded[:, :10].T, None)
    np.testing.assert_array_equal(padded[:, :10].T, dw_ref)
    assert np.all(np.isnan(padded[:, 10:]))


def test_empty_batch_and_empty_k(rng):
    """M = 0 does nothing; K = 0 (an empty sum) gives pre = bias."""
    fusekit.gated_linear_forward(np.zeros((0, 8)), np.ones((6, 8)), None, "silu", np.zeros((0, 3)))
    bias = rng.standard_normal(6)
    y, pre = np.full((2, 3), np.nan), np.full((2, 6), np.nan)
    fusekit.gated_linear_forward(np.zeros((2, 0)), np.zeros((6, 0)), bias, "relu", y, pre, layout="halves")
    np.testing.assert_array_equal(pre, np.broadcast_to(bias, (2, 6)))
    np.testing.assert_array_equal(y, np.broadcast_to(np.maximum(bias[:3], 0) * bias[3:], (2, 3)))


def test_workspace_sizes_on_cpu_are_zero():
    for name in ACTIVATIONS:
        for layout in LAYOUTS:
            for keeps_pre in (False, True):
                assert fusekit.gated_linear_forward_workspace_size(
                    64, 32, 16, fusekit.DType.f32, name, keeps_pre, "cpu", layout=layout) == 0
            assert fusekit.gated_linear_backward_workspace_size(
                64, 32, 16, fusekit.DType.f64, name, "cpu", layout=layout) == 0


# ---- bad input -> exceptions carrying the C++ message -----------------------------------------------
def _f(*shape, dtype=np.float64):
    return np.ones(shape, dtype)


def _fwd(**kw):
    args = dict(x=_f(4, 8), weight=_f(6, 8), bias=_f(6), activation="silu", y=_f(4, 3), pre_activation=_f(4, 6))
    args.update(kw)
    return lambda: fusekit.gated_linear_forward(**args)


def _bwd(**kw):
    args = dict(dy=_f(4, 3), x=_f(4, 8), weight=_f(6, 8), pre_activation=_f(4, 6), activation="gelu_tanh",
                dx=_f(4, 8), dweight=_f(6, 8), dbias=_f(6))
    args.update(kw)
    return lambda: fusekit.gated_linear_backward(**args)


BAD_CALLS = [
    ("weight_odd_rows", _fwd(weight=_f(5, 8), y=_f(4, 2), pre_activation=_f(4, 5)), "weight",
     "an even number of rows"),
    ("weight_odd_rows_backward", _bwd(weight=_f(7, 8)), "weight", "an even number of rows"),
    ("activation_none", _fwd(activation="none"), "activation", "silu, gelu_tanh"),
    ("activation_squared_relu", _bwd(activation=fusekit.Activation.squared_relu), "activation",
     "got squared_relu"),
    ("activation_name", _fwd(activation="swiglu"), "activation", "'swiglu'"),
    ("activation_type", _fwd(activation=1), "activation", "int"),
    ("layout_name", _fwd(layout="split"), "layout", "'split'"),
    ("layout_type", _bwd(layout=0), "layout", "int"),
    ("x_none", _fwd(x=None), "x", "got None"),
    ("weight_k", _fwd(weight=_f(6, 7)), "weight", None),
    ("bias_length", _fwd(bias=_f(3)), "bias", None),
    ("y_shape", _fwd(y=_f(4, 6)), "y", "(4, 3)"),
    ("pre_activation_shape", _fwd(pre_activation=_f(4, 3)), "pre_activation", "(4, 6)"),
    ("pre_activation_missing", _bwd(pre_activation=None), "pre_activation", "got None"),
    ("dy_shape", _bwd(dy=_f(4, 6)), "dy", None),
    ("dweight_shape", _bwd(dweight=_f(3, 8)), "dweight", None),
    ("dbias_length", _bwd(dbias=_f(3)), "dbias", None),
    ("workspace_f", lambda: fusekit.gated_linear_forward_workspace_size(
        4, -1, 8, fusekit.DType.bf16, "silu", True, "cpu"), "f", "-1"),
    ("workspace_activation", lambda: fusekit.gated_linear_backward_workspace_size(
        4, 8, 8, fusekit.DType.bf16, "none", "cpu"), "activation", "silu, gelu_tanh"),
    ("workspace_device", lambda: fusekit.gated_linear_forward_workspace_size(
        4, 8, 8, fusekit.DType.f16, "relu", False, "tpu"), "device", "'tpu'"),
]


@pytest.mark.parametrize("call,argument,words", [b[1:] for b in BAD_CALLS], ids=[b[0] for b in BAD_CALLS])
def test_bad_arguments_raise_invalid_argument(call, argument, words):
    check_invalid_argument(call, argument, words)
