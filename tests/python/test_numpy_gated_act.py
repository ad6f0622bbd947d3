"""fusekit's gated-activation bindings with NumPy arrays: the CPU backend against a NumPy float64
implementation in every input form (one array in halves or interleaved layout, two arrays), rows
with strides, the in-place backward, optional gradients, and bad arguments raising fusekit
exceptions with the C++ message."""
import numpy as np
import pytest

import fusekit
from fk_testing import (NUMPY_DTYPES, act, act_grad, check_close, check_invalid_argument, ml_dtypes,
                        rounding_error, to_f64)

DTYPES = ["f32", "f16", pytest.param("bf16", marks=pytest.mark.skipif(
    ml_dtypes is None, reason="ml_dtypes is not installed (NumPy has no bfloat16)"))]
ACTIVATIONS = ["silu", "gelu_tanh", "gelu_erf", "relu"]
FORMS = ["halves", "interleaved", "separate"]


def ref(gate, up, name, dy):
    """y, dgate, dup in float64."""
    g, u, d = to_f64(gate), to_f64(up), to_f64(dy)
    return act(name, g) * u, d * u * act_grad(name, g), d * act(name, g)


def join(gate, up, layout):
    """One (..., 2F) array holding gate and up in `layout`."""
    if layout == "halves":
        return np.concatenate([gate, up], axis=-1)
    both = np.empty(gate.shape[:-1] + (2 * gate.shape[-1],), gate.dtype)
    both[..., 0::2], both[..., 1::2] = gate, up
    return both


def split(both, layout):
    f = both.shape[-1] // 2
    return (both[..., :f], both[..., f:]) if layout == "halves" else (both[..., 0::2], both[..., 1::2])


def inputs(rng, shape, dtype):
    dt = NUMPY_DTYPES[dtype]
    gate = (rng.standard_normal(shape) * 1.5).astype(dt)  # both sides of every activation's bend
    up = rng.standard_normal(shape).astype(dt)
    dy = rng.standard_normal(shape).astype(dt)
    return gate, up, dy


def run(form, activation, gate, up, dy):
    """(y, dgate, dup) through the op of `form`, outputs starting as NaN."""
    y = np.full_like(gate, np.nan)
    if form == "separate":
        dgate, dup = np.full_like(gate, np.nan), np.full_like(gate, np.nan)
        fusekit.gated_act_forward_separate(gate, up, activation, y)
        fusekit.gated_act_backward_separate(dy, gate, up, activation, dgate, dup)
        return y, dgate, dup
    gate_up = join(gate, up, form)
    dgate_up = np.full_like(gate_up, np.nan)
    fusekit.gated_act_forward(gate_up, activation, y, layout=form)
    fusekit.gated_act_backward(dy, gate_up, activation, dgate_up, layout=form)
    return (y,) + split(dgate_up, form)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", FORMS)
def test_forward_backward_match_float64(rng, activation, dtype, form):
    gate, up, dy = inputs(rng, (3, 5, 37), dtype)  # leading dimensions, F odd
    y, dgate, dup = run(form, activation, gate, up, dy)
    np_dtype = NUMPY_DTYPES[dtype]
    for name, got, expected in zip(("y", "dgate", "dup"), (y, dgate, dup), ref(gate, up, activation, dy)):
        check_close(name, got, expected, dtype, rounding_error(expected, np_dtype))


def test_forms_agree_bit_for_bit(rng):
    gate, up, dy = inputs(rng, (16, 24), "f16")
    results = [run(form, "gelu_tanh", gate, up, dy) for form in FORMS]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layout", ["halves", "interleaved"])
def test_in_place_backward(rng, layout):
    gate, up, dy = inputs(rng, (6, 40), "f32")
    gate_up = join(gate, up, layout)
    with pytest.raises(fusekit.InvalidArgumentError, match="argument 'dgate_up'"):
        fusekit.gated_act_backward(dy, gate_up, "silu", gate_up, layout=layout)
    fusekit.gated_act_backward(dy, gate_up, fusekit.Activation.silu, gate_up,
                               layout=fusekit.GatedLayout.__members__[layout], in_place_backward=True)
    _, dgate_ref, dup_ref = ref(gate, up, "silu", dy)
    dgate, dup = split(gate_up, layout)
    check_close("dgate in place", dgate, dgate_ref, "f32", rounding_error(dgate_ref, np.float32))
    check_close("dup in place", dup, dup_ref, "f32", rounding_error(dup_ref, np.float32))
    # The two-array form, over the halves of one array (what gate_up.chunk(2, -1) gives).
    wide = join(gate, up, "halves")
    g, u = wide[:, :40], wide[:, 40:]
    fusekit.gated_act_backward_separate(dy, g, u, "silu", g, u, in_place_backward=True)
    np.testing.assert_array_equal(g, dgate)
    np.testing.assert_array_equal(u, dup)


def test_strided_rows_and_optional_gradients(rng):
    """gate and up as views into one padded array (rows 100 apart), outputs into padded arrays: the
    padding is never written; each gradient may be asked for alone."""
    n = 33
    storage = rng.standard_normal((7, 100)).astype(np.float32)
    gate, up = storage[:, :n], storage[:, 50:50 + n]
    dy = rng.standard_normal((7, n)).astype(np.float32)
    out = np.full((7, 64), np.nan, np.float32)
    fusekit.gated_act_forward_separate(gate, up, "relu", out[:, :n])
    assert np.all(np.isnan(out[:, n:])), "padding between rows was written"
    y_ref, dgate_ref, dup_ref = ref(gate, up, "relu", dy)
    np.testing.assert_array_equal(out[:, :n], y_ref.astype(np.float32))
    dgate = np.full((7, 40), np.nan, np.float32)
    fusekit.gated_act_backward_separate(dy, gate, up, "relu", dgate=dgate[:, :n])
    np.testing.assert_array_equal(dgate[:, :n], dgate_ref.astype(np.float32))
    assert np.all(np.isnan(dgate[:, n:]))
    dup = np.full((7, n), np.nan, np.float32)
    fusekit.gated_act_backward_separate(dy, gate, up, "relu", dup=dup)
    np.testing.assert_array_equal(dup, dup_ref.astype(np.float32))
    fusekit.gated_act_backward_separate(dy, gate, up, "relu")  # nothing asked for: nothing to do


def test_empty_batch_and_layout_enum():
    empty = np.zeros((0, 8), np.float32)
    fusekit.gated_act_forward(np.zeros((0, 16), np.float32), "silu", empty)
    fusekit.gated_act_forward_separate(empty, empty, "silu", np.zeros((0, 8), np.float32))
    assert list(fusekit.GatedLayout.__members__) == ["halves", "interleaved"]


# ---- bad input -> exceptions carrying the C++ message -----------------------------------------------
def _f32(*shape):
    return np.ones(shape, np.float32)


def _fwd(**kw):
    args = dict(gate_up=_f32(2, 16), activation="silu", y=_f32(2, 8))
    args.update(kw)
    return lambda: fusekit.gated_act_forward(**args)


def _bwd(**kw):
    args = dict(dy=_f32(2, 8), gate_up=_f32(2, 16), activation="silu", dgate_up=_f32(2, 16))
    args.update(kw)
    return lambda: fusekit.gated_act_backward(**args)


def _sep_bwd(**kw):
    args = dict(dy=_f32(2, 8), gate=_f32(2, 8), up=_f32(2, 8), activation="relu", dgate=_f32(2, 8))
    args.update(kw)
    return lambda: fusekit.gated_act_backward_separate(**args)


_shared = _f32(2, 16)

BAD_CALLS = [
    ("activation_none", _fwd(activation="none"), "activation", "got none"),
    ("activation_leaky", _fwd(activation=fusekit.Activation.leaky_relu), "activation", "(ReGLU)"),
    ("activation_name", _fwd(activation="swiglu"), "activation", "'swiglu'"),
    ("layout_name", _fwd(layout="split"), "layout", "'split'"),
    ("layout_type", _bwd(layout=1), "layout", "int"),
    ("gate_up_odd", _fwd(gate_up=_f32(2, 15)), "gate_up", "even last dimension"),
    ("gate_up_f64", _fwd(gate_up=np.ones((2, 16))), "gate_up", "f64"),
    ("y_shape", _fwd(y=_f32(2, 16)), "y", "F = 8 columns"),
    ("y_dtype", _fwd(y=np.ones((2, 8), np.float16)), "y", "f16"),
    ("dy_shape", _bwd(dy=_f32(3, 8)), "dy", None),
    ("dgate_up_over_gate_up", _bwd(gate_up=_shared, dgate_up=_shared), "dgate_up", "does not overlap"),
    ("up_shape", lambda: fusekit.gated_act_forward_separate(_f32(2, 8), _f32(2, 9), "silu", _f32(2, 8)),
     "up", None),
    ("dgate_over_up", lambda: (lambda up: fusekit.gated_act_backward_separate(
        _f32(2, 8), _f32(2, 8), up, "relu", up, in_place_backward=True))(_f32(2, 8)), "dgate", "'up'"),
    ("dup_dtype", _sep_bwd(dup=np.ones((2, 8), np.float16)), "dup", "f16"),
    ("gate_none", lambda: fusekit.gated_act_forward_separate(None, _f32(2, 8), "silu", _f32(2, 8)),
     "gate", "got None"),
]


@pytest.mark.parametrize("call,argument,words", [b[1:] for b in BAD_CALLS], ids=[b[0] for b in BAD_CALLS])
def test_bad_arguments_raise_invalid_argument(call, argument, words):
    check_invalid_argument(call, argument, words)
