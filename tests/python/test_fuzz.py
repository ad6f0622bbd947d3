"""Property-based fuzzing of every public entry point on the CPU backend (NumPy arrays).

The contract under test, whatever the arguments: a call either raises a clean fusekit error
(InvalidArgumentError or UnsupportedError, whose message starts with "fusekit.<op>" and names the
argument it is about) or returns a result equal, within the dtype's rounding, to an independent
float64 NumPy reference. Never a crash, never a silent wrong answer. Each example is a valid
problem, optionally with one argument broken (wrong shape, dtype, layout or value); a broken one
must be refused, naming that argument. Scalars of any Python type go into every scalar argument of
every entry point too (test_mistyped_scalars_contract): a wrong type is refused with an
ArgumentTypeError (an InvalidArgumentError and a TypeError) naming the argument, a value its C++
type cannot hold with an InvalidArgumentError naming it, and anything else does exactly what the
same value as a plain Python float / int / bool does.

Time budget: a fixed number of examples per test and no per-example deadline, so that the file
runs in well under two minutes on two cores.
"""
import math

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fusekit  # noqa: E402
from fk_entry_points import (BOOL, BY_NAME, CFG, DEVICE, DTYPE, ENTRY_POINTS, FLOAT,  # noqa: E402
                             INT32, INT64, OPT_FLOAT, OPTIONS, STREAM, UINT64, float32_holds, outcome,
                             summary, with_value)

try:
    import ml_dtypes
except ImportError:  # the FP8 fuzzing skips without it
    ml_dtypes = None

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
INT64_MAX = 2**63 - 1
ACTIVATIONS = ["none", "relu", "gelu_erf", "gelu_tanh", "squared_relu", "leaky_relu", "silu"]
SLOPE = 0.01


# ---- the contract ---------------------------------------------------------------------------------
def expect_contract(call, broken):
    """Runs call(). broken: None (a valid call: it must succeed and returns True) or the name of the
    argument that was broken (the call must raise a clean fusekit error naming it)."""
    try:
        call()
    except fusekit.Error as e:
        message = str(e)
        assert isinstance(e, (fusekit.InvalidArgumentError, fusekit.UnsupportedError)), message
        assert message.startswith("fusekit."), message
        if e.argument:
            assert f"argument '{e.argument}'" in message, message
        assert broken is not None, f"a valid call was refused: {message}"
        assert e.argument == broken, f"expected an error about '{broken}': {message}"
        return False
    assert broken is None, f"a call with a broken '{broken}' was accepted"
    return True


def assert_close(name, got, ref, rtol):
    got = np.asarray(got).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{name}: shape {got.shape} != {ref.shape}"
    assert np.array_equal(np.isnan(got), np.isnan(ref)), f"{name}: NaN where the reference has none"
    fin = np.isfinite(ref)
    assert np.array_equal(got[~fin], ref[~fin]), f"{name}: infinities differ"
    scale = max(1.0, float(np.max(np.abs(ref[fin]), initial=0.0)))
    err = float(np.max(np.abs(got[fin] - ref[fin]), initial=0.0))
    assert err <= rtol * scale, f"{name}: max error {err:.3e} > {rtol:.1e} x {scale:.3e}"


TOL = {np.float32: 2e-5, np.float16: 4e-3, np.float64: 1e-10}


def expanded(a):
    """A writable view of a's first row repeated: an output that overlaps itself (stride 0)."""
    return np.lib.stride_tricks.as_strided(a, shape=a.shape, strides=(0,) * (a.ndim - 1) + (a.strides[-1],))


def expanded_argument(a, lead, name):
    """(expanded(a), name): the output that overlaps itself and the argument its error names; (a,
    None) where the rows are fewer than 2, so that nothing overlaps and the call must succeed."""
    return (a, None) if math.prod(lead) < 2 else (expanded(a), name)


def break_output(kind, a):
    """An output array broken in one way: another leading shape, another dtype, or stride 0."""
    if kind == "shape":
        lead = a.shape[:-1]
        other = lead[::-1] if lead[::-1] != lead else lead + (1,) if len(lead) < 3 else (lead[0] + 1,) + lead[1:]
        if other == lead or len(lead) == 0:
            other = (a.shape[0] + 1,) + a.shape[1:-1] if a.ndim > 1 else (2,)
        return np.zeros(tuple(other) + a.shape[-1:], a.dtype)
    if kind == "dtype":
        return np.zeros(a.shape, np.float64 if a.dtype != np.float64 else np.float16)
    return expanded(a)


def lead_shapes(max_rows=6):
    return st.lists(st.integers(1, 3), min_size=1, max_size=3).filter(lambda s: math.prod(s) <= max_rows)


# ---- norms ---------------------------------------------------------------------------------------
def norm_reference(kind, x, w, b, eps):
    x = x.astype(np.float64)
    mean = x.mean(-1, keepdims=True) if kind == "layer_norm" else np.zeros(x.shape[:-1] + (1,))
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)
    y = (x - mean) * rstd
    if w is not None:
        y = y * w.astype(np.float64)
    if b is not None:
        y = y + b.astype(np.float64)
    return y, mean[..., 0], rstd[..., 0]


@FUZZ
@given(kind=st.sampled_from(["layer_norm", "rms_norm"]), lead=lead_shapes(), n=st.integers(1, 40),
       dtype=st.sampled_from([np.float32, np.float16]), affine=st.booleans(),
       eps=st.sampled_from([1e-5, 0.0, 1.0, 3.0e38]),
       broken=st.sampled_from([None, None, "y", "y_dtype", "y_expanded", "eps", "weight"]),
       seed=st.integers(0, 2**32 - 1))
def test_norm_forward_contract(kind, lead, n, dtype, affine, eps, broken, seed):
    rng = np.random.default_rng(seed)
    if eps == 0.0 and n < 2:  # a constant row and eps = 0: rstd = 1/0, no finite reference
        eps = 1e-5
    x = (rng.standard_normal(tuple(lead) + (n,)) + 0.5).astype(dtype)
    w = rng.uniform(0.5, 1.5, n).astype(dtype) if affine else None
    b = rng.standard_normal(n).astype(dtype) if affine and kind == "layer_norm" else None
    y = np.zeros_like(x)
    rstd = np.zeros(x.shape[:-1], np.float32)
    mean = np.zeros(x.shape[:-1], np.float32)
    arg = broken
    if broken == "y" and (x.ndim > 1 or True):
        y = break_output("shape", y)
    elif broken == "y_dtype":
        y, arg = break_output("dtype", y), "y"
    elif broken == "y_expanded":
        y, arg = expanded_argument(y, lead, "y")
    elif broken == "eps":
        eps = float(rng.choice([math.inf, math.nan, -1e-3, 1e39]))
    elif broken == "weight":
        w = np.ones(n + 1, dtype)
    if kind == "layer_norm":
        call = lambda: fusekit.layer_norm_forward(x, w, b, eps, y, mean, rstd)  # noqa: E731
    else:
        call = lambda: fusekit.rms_norm_forward(x, w, eps, y, rstd)  # noqa: E731
    if expect_contract(call, arg):
        ref_y, ref_mean, ref_rstd = norm_reference(kind, x, w, b, np.float32(eps))
        assert_close("y", y, ref_y, TOL[dtype] * 4)
        assert_close("rstd", rstd, ref_rstd, 2e-5)


@FUZZ
@given(kind=st.sampled_from(["layer_norm", "rms_norm"]), from_output=st.booleans(), lead=lead_shapes(),
       n=st.integers(1, 40), broken=st.sampled_from([None, None, "dx", "dx_expanded", "weight_zero", "dweight"]),
       seed=st.integers(0, 2**32 - 1))
def test_norm_backward_contract(kind, from_output, lead, n, broken, seed):
    rng = np.random.default_rng(seed)
    shape = tuple(lead) + (n,)
    x = (rng.standard_normal(shape) + 0.5).astype(np.float32)
    w = (rng.uniform(0.5, 1.5, n) * rng.choice([-1, 1], n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if kind == "layer_norm" else None
    dy = rng.standard_normal(shape).astype(np.float32)
    y = np.zeros_like(x)
    mean = np.zeros(x.shape[:-1], np.float32)
    rstd = np.zeros(x.shape[:-1], np.float32)
    if kind == "layer_norm":
        fusekit.layer_norm_forward(x, w, b, 1e-5, y, mean, rstd)
    else:
        fusekit.rms_norm_forward(x, w, 1e-5, y, rstd)
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    db = np.zeros_like(w) if kind == "layer_norm" else None
    arg = broken
    if broken == "dx":
        dx = break_output("shape", dx)
    elif broken == "dx_expanded":
        dx, arg = expanded_argument(dx, lead, "dx")
    elif broken == "weight_zero":
        if from_output:
            w = w.copy()
            w[rng.integers(0, n)] = 0.0
            arg = "weight"
        else:
            arg = None
            w = w.copy()
            w[rng.integers(0, n)] = 0.0
    elif broken == "dweight":
        dw = np.zeros(n + 1, np.float32)
    if kind == "layer_norm" and from_output:
        call = lambda: fusekit.layer_norm_backward_from_output(dy, y, w, b, rstd, dx, dw, db)  # noqa: E731
    elif kind == "layer_norm":
        call = lambda: fusekit.layer_norm_backward(dy, x, w, mean, rstd, dx, dw, db)  # noqa: E731
    elif from_output:
        call = lambda: fusekit.rms_norm_backward_from_output(dy, y, w, rstd, dx, dw)  # noqa: E731
    else:
        call = lambda: fusekit.rms_norm_backward(dy, x, w, rstd, dx, dw)  # noqa: E731
    if expect_contract(call, arg):
        xd = x.astype(np.float64)
        mu = mean[..., None].astype(np.float64) if kind == "layer_norm" else 0.0
        r = rstd[..., None].astype(np.float64)
        xhat = (xd - mu) * r
        if from_output:
            xhat = (y.astype(np.float64) - (b.astype(np.float64) if b is not None else 0.0)) / w.astype(np.float64)
        g = dy.astype(np.float64) * w.astype(np.float64)
        mean_g = g.mean(-1, keepdims=True) if kind == "layer_norm" else 0.0
        ref_dx = r * (g - mean_g - xhat * (g * xhat).mean(-1, keepdims=True))
        lead_axes = tuple(range(dy.ndim - 1))
        assert_close("dx", dx, ref_dx, 1e-4)
        assert_close("dweight", dw, (dy.astype(np.float64) * xhat).sum(axis=lead_axes), 1e-4)


@FUZZ
@given(kind=st.sampled_from(["layer_norm", "rms_norm"]), lead=lead_shapes(), n=st.integers(1, 40),
       with_sum=st.booleans(), with_dsum=st.booleans(), in_place=st.booleans(),
       broken=st.sampled_from([None, None, "residual", "sum", "sum_over_x", "dsum", "dx_over_sum"]),
       seed=st.integers(0, 2**32 - 1))
def test_norm_residual_contract(kind, lead, n, with_sum, with_dsum, in_place, broken, seed):
    """The residual forward and backward: y = norm(x + residual), dx = the backward at the sum plus
    dsum (dx may be dsum itself); any broken argument is refused, naming it."""
    rng = np.random.default_rng(seed)
    shape = tuple(lead) + (n,)
    x = (rng.standard_normal(shape) + 0.5).astype(np.float32)
    res = rng.standard_normal(shape).astype(np.float32)
    w = rng.uniform(0.5, 1.5, n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if kind == "layer_norm" else None
    y, s = np.zeros_like(x), np.zeros_like(x)
    mean, rstd = np.zeros(shape[:-1], np.float32), np.zeros(shape[:-1], np.float32)
    fwd_arg = broken if broken in ("residual", "sum", "sum_over_x") else None
    if broken == "residual":
        res = break_output("shape", res)
    elif broken == "sum":
        s = break_output("shape", s)
    elif broken == "sum_over_x":
        s, fwd_arg = x, "sum"
    sum_arg = s if (with_sum or fwd_arg == "sum") else None
    if kind == "layer_norm":
        call = lambda: fusekit.layer_norm_residual_forward(x, res, w, b, 1e-5, y, sum_arg, mean, rstd)  # noqa: E731
    else:
        call = lambda: fusekit.rms_norm_residual_forward(x, res, w, 1e-5, y, sum_arg, rstd)  # noqa: E731
    if not expect_contract(call, fwd_arg):
        return
    total = x.astype(np.float64) + res.astype(np.float64)
    if with_sum:
        assert np.array_equal(s, (x + res).astype(np.float32)), "sum"
    ref_y, _, ref_rstd = norm_reference(kind, total.astype(np.float32), w, b, np.float32(1e-5))
    assert_close("y", y, ref_y, TOL[np.float32] * 4)
    s = (x + res).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    dsum = rng.standard_normal(shape).astype(np.float32) if with_dsum else None
    dx = dsum if (with_dsum and in_place) else np.zeros_like(x)
    dw = np.zeros_like(w)
    db = np.zeros_like(w) if kind == "layer_norm" else None
    dsum_ref = None if dsum is None else dsum.astype(np.float64).copy()
    bwd_arg = None
    if broken == "dsum" and with_dsum:
        dsum, bwd_arg = break_output("shape", dsum), "dsum"
        dx = np.zeros_like(x)
    elif broken == "dx_over_sum":
        dx, bwd_arg = s, "dx"
    if kind == "layer_norm":
        call = lambda: fusekit.layer_norm_residual_backward(dy, s, dsum, w, mean, rstd, dx, dw, db)  # noqa: E731
    else:
        call = lambda: fusekit.rms_norm_residual_backward(dy, s, dsum, w, rstd, dx, dw)  # noqa: E731
    if expect_contract(call, bwd_arg):
        mu = mean[..., None].astype(np.float64) if kind == "layer_norm" else 0.0
        r = rstd[..., None].astype(np.float64)
        xhat = (s.astype(np.float64) - mu) * r
        g = dy.astype(np.float64) * w.astype(np.float64)
        mean_g = g.mean(-1, keepdims=True) if kind == "layer_norm" else 0.0
        ref_dx = r * (g - mean_g - xhat * (g * xhat).mean(-1, keepdims=True))
        if dsum_ref is not None:
            ref_dx = ref_dx + dsum_ref
        assert_close("dx", dx, ref_dx, 1e-4)
        assert_close("dweight", dw, (dy.astype(np.float64) * xhat).sum(axis=tuple(range(dy.ndim - 1))), 1e-4)


@FUZZ
@given(rows=st.integers(-2**63, INT64_MAX), cols=st.integers(-2**63, INT64_MAX),
       small=st.booleans(), which=st.sampled_from(["norm", "dropout", "fp8_fwd", "fp8_bwd"]))
def test_row_workspace_queries_contract(rows, cols, small, which):
    if small:
        rows, cols = abs(rows) % 5000, abs(cols) % 5000
    limit = {"norm": 65536, "dropout": 2**31 - 1, "fp8_fwd": 65536, "fp8_bwd": 65536}[which]
    broken = "rows" if not 0 <= rows <= 2**31 - 1 else "cols" if not 0 <= cols <= limit else None
    if which == "norm":
        call = lambda: fusekit.norm_backward_workspace_size(rows, cols, fusekit.DType.f32, "cpu")  # noqa: E731
    elif which == "dropout":
        call = lambda: fusekit.bias_act_dropout_backward_workspace_size(rows, cols, fusekit.DType.f16, "cpu")  # noqa: E731
    elif which == "fp8_fwd":
        call = lambda: fusekit.fp8_rms_norm_forward_workspace_size(rows, cols, "cpu")  # noqa: E731
    else:
        call = lambda: fusekit.fp8_rms_norm_backward_workspace_size(rows, cols, "cpu")  # noqa: E731
    if expect_contract(call, broken):
        assert call() == 0


# ---- bias + activation + dropout -------------------------------------------------------------------
def act_reference(name, h):
    erf = np.vectorize(math.erf)
    if name == "none":
        return h, np.ones_like(h)
    if name == "relu":
        return np.maximum(h, 0), (h > 0).astype(np.float64)
    if name == "leaky_relu":
        return np.where(h > 0, h, SLOPE * h), np.where(h > 0, 1.0, SLOPE)
    if name == "squared_relu":
        return np.maximum(h, 0) ** 2, 2 * np.maximum(h, 0)
    if name == "silu":
        s = 1 / (1 + np.exp(-h))
        return h * s, s * (1 + h * (1 - s))
    if name == "gelu_erf":
        cdf = 0.5 * (1 + erf(h / math.sqrt(2)))
        return h * cdf, cdf + h * np.exp(-h * h / 2) / math.sqrt(2 * math.pi)
    c = math.sqrt(2 / math.pi)
    t = np.tanh(c * (h + 0.044715 * h ** 3))
    return 0.5 * h * (1 + t), 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * c * (1 + 3 * 0.044715 * h * h)


@FUZZ
@given(lead=lead_shapes(), n=st.integers(1, 24), activation=st.sampled_from(ACTIVATIONS), with_bias=st.booleans(),
       p=st.sampled_from([0.0, 0.0, 0.5]), seed=st.integers(0, 2**32 - 1), offset=st.integers(0, 2**40),
       broken=st.sampled_from([None, None, "y", "y_expanded", "p", "dx", "dbias"]))
def test_bias_act_dropout_contract(lead, n, activation, with_bias, p, seed, offset, broken):
    rng = np.random.default_rng(seed)
    shape = tuple(lead) + (n,)
    x = rng.standard_normal(shape).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    y, dy, dx = np.zeros_like(x), rng.standard_normal(shape).astype(np.float32), np.zeros_like(x)
    dbias = np.zeros(n, np.float32)
    arg = broken
    if broken == "y":
        y = break_output("shape", y)
    elif broken == "y_expanded":
        y, arg = expanded_argument(y, lead, "y")
    elif broken == "p":
        p = float(rng.choice([1.0, -0.1, math.nan]))
    elif broken == "dx":
        dx = break_output("shape", dx)
    elif broken == "dbias":
        dbias = np.zeros(n + 1, np.float32)
    fwd = lambda: fusekit.bias_act_dropout_forward(x, bias, activation, p, seed, offset, y, slope=SLOPE)  # noqa: E731
    bwd = lambda: fusekit.bias_act_dropout_backward(dy, x, bias, activation, p, seed, offset, dx, dbias,  # noqa: E731
                                                    slope=SLOPE)
    fwd_broken = arg if arg in ("y", "p") else None
    bwd_broken = arg if arg in ("dx", "dbias", "p") else None
    fwd_ok = expect_contract(fwd, fwd_broken)
    bwd_ok = expect_contract(bwd, bwd_broken)
    if not (fwd_ok or bwd_ok):
        return
    h = x.astype(np.float64) + (bias.astype(np.float64) if bias is not None else 0.0)
    a, da = act_reference(activation, h)
    keep = np.ones(shape, np.float64)
    if p > 0:
        mask = np.zeros(shape, np.uint8)
        fusekit.dropout_keep_mask(seed, offset, p, mask)
        keep = mask.astype(np.float64) / np.float64(np.float32(1) - np.float32(p))
    if fwd_ok:
        assert_close("y", y, a * keep, 1e-5)
    if bwd_ok:
        ref_dx = dy.astype(np.float64) * keep * da
        assert_close("dx", dx, ref_dx, 1e-5)
        assert_close("dbias", dbias, ref_dx.reshape(-1, n).sum(0), 1e-4)


# ---- gated activations ---------------------------------------------------------------------------
GATES = ["silu", "gelu_tanh", "gelu_erf", "relu"]


@FUZZ
@given(lead=lead_shapes(), n=st.integers(1, 24), activation=st.sampled_from(GATES),
       form=st.sampled_from(["halves", "interleaved", "separate"]), in_place=st.booleans(),
       broken=st.sampled_from([None, None, "y", "y_expanded", "activation", "gate_up", "up", "dgate_up", "dgate"]),
       seed=st.integers(0, 2**32 - 1))
def test_gated_act_contract(lead, n, activation, form, in_place, broken, seed):
    rng = np.random.default_rng(seed)
    shape = tuple(lead) + (n,)
    gate = (rng.standard_normal(shape) * 1.5).astype(np.float32)
    up = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    g0, u0 = gate.astype(np.float64), up.astype(np.float64)  # the reference's inputs (in place overwrites)
    y = np.zeros_like(gate)
    fused = form != "separate"
    if fused:
        gate_up = np.empty(shape[:-1] + (2 * n,), np.float32)
        if form == "halves":
            gate_up[..., :n], gate_up[..., n:] = gate, up
        else:
            gate_up[..., 0::2], gate_up[..., 1::2] = gate, up
        dgate_up = gate_up if in_place else np.zeros_like(gate_up)
    else:
        dgate, dup = (gate, up) if in_place else (np.zeros_like(gate), np.zeros_like(up))
    arg = broken
    if broken == "y":
        y = break_output("shape", y)
    elif broken == "y_expanded":
        y, arg = expanded_argument(y, lead, "y")
    elif broken == "activation":
        activation = str(rng.choice(["none", "squared_relu", "leaky_relu"]))
    elif broken == "gate_up":
        if fused:
            gate_up = np.zeros(shape[:-1] + (2 * n + 1,), np.float32)
        else:
            arg = None
    elif broken == "up":
        if fused:
            arg = None
        else:
            up = np.zeros(shape[:-1] + (n + 1,), np.float32)
    elif broken == "dgate_up":
        if fused:
            dgate_up = break_output("shape", dgate_up)
        else:
            arg = None
    elif broken == "dgate":
        if fused:
            arg = None
        else:
            dgate = up  # over another input: refused with or without in_place_backward
    if fused:
        fwd = lambda: fusekit.gated_act_forward(gate_up, activation, y, layout=form)  # noqa: E731
        bwd = lambda: fusekit.gated_act_backward(dy, gate_up, activation, dgate_up, layout=form,  # noqa: E731
                                                 in_place_backward=in_place)
    else:
        fwd = lambda: fusekit.gated_act_forward_separate(gate, up, activation, y)  # noqa: E731
        bwd = lambda: fusekit.gated_act_backward_separate(dy, gate, up, activation, dgate, dup,  # noqa: E731
                                                          in_place_backward=in_place)
    fwd_broken = arg if arg in ("y", "activation", "gate_up", "up") else None
    bwd_broken = arg if arg in ("activation", "gate_up", "up", "dgate_up", "dgate") else None
    fwd_ok = expect_contract(fwd, fwd_broken)
    a, da = act_reference(activation, g0)
    if fwd_ok:
        assert_close("y", y, a * u0, 1e-5)
    if expect_contract(bwd, bwd_broken):
        d = dy.astype(np.float64)
        if fused:
            got_dg, got_du = (dgate_up[..., :n], dgate_up[..., n:]) if form == "halves" else \
                (dgate_up[..., 0::2], dgate_up[..., 1::2])
        else:
            got_dg, got_du = dgate, dup
        assert_close("dgate", got_dg, d * u0 * da, 1e-5)
        assert_close("dup", got_du, d * a, 1e-5)


# ---- linear --------------------------------------------------------------------------------------
@FUZZ
@given(lead=lead_shapes(), n=st.integers(1, 12), k=st.integers(0, 12),
       activation=st.sampled_from([a for a in ACTIVATIONS if a != "leaky_relu"]), with_bias=st.booleans(),
       broken=st.sampled_from([None, None, "y", "y_expanded", "weight", "dx", "dweight"]),
       seed=st.integers(0, 2**32 - 1))
def test_linear_contract(lead, n, k, activation, with_bias, broken, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(tuple(lead) + (k,))
    w = rng.standard_normal((n, k))
    bias = rng.standard_normal(n) if with_bias else None
    y, pre = np.zeros(tuple(lead) + (n,)), np.zeros(tuple(lead) + (n,))
    dout = rng.standard_normal(y.shape)
    dx, dw, db = np.zeros_like(x), np.zeros_like(w), np.zeros(n)
    arg = broken
    if broken == "y":
        y = break_output("shape", y)
    elif broken == "y_expanded":
        y, arg = expanded_argument(y, lead, "y")
    elif broken == "weight":
        w = rng.standard_normal((n, k + 1))
    elif broken == "dx":
        dx = break_output("shape", dx) if k > 0 else np.zeros(x.shape[:-1] + (k + 1,))
    elif broken == "dweight":
        dw = np.zeros((n + 1, k))
    fwd_broken = arg if arg in ("y", "weight") else None
    fwd_ok = expect_contract(lambda: fusekit.linear_forward(x, w, bias, activation, y, pre), fwd_broken)
    if arg == "weight":
        return
    z = x @ w.T + (bias if bias is not None else 0.0)
    a, da = act_reference(activation, z)
    if fwd_ok:
        assert_close("y", y, a, 1e-10)
        assert_close("pre_activation", pre, z, 1e-10)
    pre_in = z
    bwd_broken = arg if arg in ("dx", "dweight") else None
    bwd_ok = expect_contract(lambda: fusekit.linear_backward(dout, x, w, pre_in, activation, dx, dw, db), bwd_broken)
    if bwd_ok:
        dz = dout * da
        assert_close("dx", dx, dz @ w, 1e-10)
        lead_axes = tuple(range(x.ndim - 1))
        assert_close("dweight", dw, np.tensordot(dz, x, axes=(lead_axes, lead_axes)), 1e-10)
        assert_close("dbias", db, dz.reshape(-1, n).sum(0), 1e-10)


@FUZZ
@given(m=st.integers(-2**63, INT64_MAX), n=st.integers(-2**63, INT64_MAX), k=st.integers(-2**63, INT64_MAX),
       small=st.sampled_from([0, 1, 2]), backward=st.booleans(),
       activation=st.sampled_from([a for a in ACTIVATIONS if a != "leaky_relu"]))
def test_linear_workspace_queries_contract(m, n, k, small, backward, activation):
    if small == 1:
        m, n, k = abs(m) % 100000, abs(n) % 100000, abs(k) % 100000
    elif small == 2:
        m, n, k = abs(m) % 2**31, abs(n) % 2**31, abs(k) % 2**31
    limit = 2**31 - 1
    broken = next((name for name, v in (("m", m), ("n", n), ("k", k)) if not 0 <= v <= limit), None)
    if broken is None and m * ((n + 7) // 8 * 8) * 16 > INT64_MAX:
        broken = "m"
    fn = fusekit.linear_backward_workspace_size if backward else fusekit.linear_forward_workspace_size
    if expect_contract(lambda: fn(m, n, k, fusekit.DType.f16, activation, "cpu"), broken):
        assert fn(m, n, k, fusekit.DType.f16, activation, "cpu") == 0


# ---- gated linear --------------------------------------------------------------------------------
@FUZZ
@given(lead=lead_shapes(), f=st.integers(1, 8), k=st.integers(0, 12), activation=st.sampled_from(GATES),
       layout=st.sampled_from(["halves", "interleaved"]), with_bias=st.booleans(),
       broken=st.sampled_from([None, None, "y", "y_expanded", "activation", "weight", "pre_activation", "dx",
                               "dweight"]),
       seed=st.integers(0, 2**32 - 1))
def test_gated_linear_contract(lead, f, k, activation, layout, with_bias, broken, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(tuple(lead) + (k,))
    w = rng.standard_normal((2 * f, k))
    bias = rng.standard_normal(2 * f) if with_bias else None
    y, pre = np.zeros(tuple(lead) + (f,)), np.zeros(tuple(lead) + (2 * f,))
    dy = rng.standard_normal(y.shape)
    dx, dw, db = np.zeros_like(x), np.zeros_like(w), np.zeros(2 * f)
    arg = broken
    if broken == "y":
        y = break_output("shape", y)
    elif broken == "y_expanded":
        y, arg = expanded_argument(y, lead, "y")
    elif broken == "activation":
        activation = str(rng.choice(["none", "squared_relu", "leaky_relu"]))
    elif broken == "weight":
        w = rng.standard_normal((2 * f + 1, k))  # an odd row count: no (gate, up) pairs
    elif broken == "pre_activation":
        pre = break_output("shape", pre)
    elif broken == "dx":
        dx = break_output("shape", dx) if k > 0 else np.zeros(x.shape[:-1] + (k + 1,))
    elif broken == "dweight":
        dw = np.zeros((2 * f, k + 1))
    fwd_broken = arg if arg in ("y", "activation", "weight", "pre_activation") else None
    fwd_ok = expect_contract(lambda: fusekit.gated_linear_forward(x, w, bias, activation, y, pre, layout=layout),
                             fwd_broken)
    if arg == "weight":
        return
    z = x @ w.T + (bias if bias is not None else 0.0)
    cols = (slice(0, f), slice(f, 2 * f)) if layout == "halves" else (slice(0, 2 * f, 2), slice(1, 2 * f, 2))
    gate, up = z[..., cols[0]], z[..., cols[1]]
    a, da = act_reference(activation, gate) if arg != "activation" else (gate, gate)
    if fwd_ok:
        assert_close("y", y, a * up, 1e-10)
        assert_close("pre_activation", pre, z, 1e-10)
    bwd_broken = arg if arg in ("activation", "dx", "dweight") else None
    bwd_ok = expect_contract(lambda: fusekit.gated_linear_backward(dy, x, w, z, activation, dx, dw, db, layout=layout),
                             bwd_broken)
    if bwd_ok:
        dpre = np.empty_like(z)
        dpre[..., cols[0]], dpre[..., cols[1]] = dy * up * da, dy * a
        assert_close("dx", dx, dpre @ w, 1e-10)
        lead_axes = tuple(range(x.ndim - 1))
        assert_close("dweight", dw, np.tensordot(dpre, x, axes=(lead_axes, lead_axes)), 1e-10)
        assert_close("dbias", db, dpre.reshape(-1, 2 * f).sum(0), 1e-10)


# ---- cross-entropy -------------------------------------------------------------------------------
REDUCTIONS = ["none", "mean", "sum"]


def cross_entropy_reference(x, t, reduction, ignore_index, s, z):
    """(loss, lse, the loss's own gradient) in float64."""
    n = x.shape[-1]
    x = x.astype(np.float64).reshape(-1, n)
    t = t.reshape(-1).astype(np.int64)
    m = x.max(1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(1, keepdims=True)))[:, 0]
    ignored = t == ignore_index
    safe = np.where(ignored, 0, t)
    s, z = float(np.float32(s)), float(np.float32(z))
    rows = lse - (1 - s) * x[np.arange(len(t)), safe] - s / n * x.sum(1) + z * lse * lse
    rows[ignored] = 0.0
    counted = int((~ignored).sum())
    grad = np.exp(x - lse[:, None]) * (1 + 2 * z * lse[:, None]) - s / n
    grad[np.arange(len(t)), safe] -= 1 - s
    grad[ignored] = 0.0
    if reduction == "none":
        return rows, lse, grad
    if reduction == "sum":
        return rows.sum(), lse, grad
    scale = 1.0 / counted if counted else 0.0
    return rows.sum() * scale, lse, grad * scale


@FUZZ
@given(lead=lead_shapes(), n=st.integers(1, 40), reduction=st.sampled_from(REDUCTIONS),
       target_dtype=st.sampled_from([np.int32, np.int64]), smoothing=st.sampled_from([0.0, 0.1, 0.9]),
       z=st.sampled_from([0.0, 1e-3]), ignore_index=st.sampled_from([-100, 0, 2]), in_place=st.booleans(),
       broken=st.sampled_from([None, None, "loss", "lse", "dloss", "dlogits", "dlogits_expanded", "targets",
                               "label_smoothing", "z_loss"]),
       seed=st.integers(0, 2**32 - 1))
def test_cross_entropy_contract(lead, n, reduction, target_dtype, smoothing, z, ignore_index, in_place, broken,
                                seed):
    rng = np.random.default_rng(seed)
    lead = tuple(lead)
    x = (rng.standard_normal(lead + (n,)) * 2).astype(np.float32)
    t = rng.integers(0, n, lead).astype(target_dtype)
    t[rng.random(lead) < 0.3] = ignore_index
    loss_shape = lead if reduction == "none" else ()
    loss, loss2 = np.zeros(loss_shape, np.float32), np.zeros(loss_shape, np.float32)
    lse = np.zeros(lead, np.float32)
    dloss = (rng.standard_normal(loss_shape) if reduction == "none" else np.array(rng.uniform(0.5, 2))).astype(np.float32)
    dx = np.zeros_like(x)
    arg = broken
    if broken == "loss":
        loss = np.zeros(math.prod(loss_shape) + 1, np.float32)
        loss2 = loss
    elif broken == "lse":
        lse = np.zeros(math.prod(lead) + 1, np.float32)
    elif broken == "dloss":
        dloss = np.zeros(math.prod(loss_shape) + 1, np.float32)
    elif broken == "dlogits":
        dx = break_output("shape", dx)
    elif broken == "dlogits_expanded":
        dx, arg = expanded_argument(dx, lead, "dlogits")
    elif broken == "targets":
        t = t.copy()
        t.reshape(-1)[rng.integers(0, t.size)] = n + 5  # neither a class nor ignore_index
    elif broken == "label_smoothing":
        smoothing = float(rng.choice([1.0, -0.5, math.nan]))
    elif broken == "z_loss":
        z = float(rng.choice([-1.0, math.inf, math.nan]))
    kw = dict(ignore_index=ignore_index, label_smoothing=smoothing, z_loss=z)
    options = ("targets", "label_smoothing", "z_loss")
    if arg == "targets":  # refused before any value is used
        valid_lse = np.zeros(lead, np.float32)
    else:
        ref_loss, ref_lse, ref_grad = cross_entropy_reference(x, t, reduction, ignore_index, smoothing, z)
        valid_lse = ref_lse.astype(np.float32).reshape(lead)

    def output_for(logits):  # dlogits: the logits themselves in place, unless dlogits is the broken one
        return logits if in_place and arg != "dlogits" else dx

    fwd_ok = expect_contract(lambda: fusekit.cross_entropy_forward(x, t, reduction, loss, lse, **kw),
                             arg if arg in ("loss", "lse") + options else None)
    logits_b = x.copy()
    bwd_ok = expect_contract(
        lambda: fusekit.cross_entropy_backward(dloss, logits_b, t, lse if arg == "lse" else valid_lse, reduction,
                                               output_for(logits_b), **kw),
        arg if arg in ("lse", "dloss", "dlogits") + options else None)
    grad_b = output_for(logits_b).copy()
    logits_f = x.copy()
    fused_ok = expect_contract(
        lambda: fusekit.cross_entropy_forward_backward(logits_f, t, reduction, loss2, output_for(logits_f), **kw),
        arg if arg in ("loss", "dlogits") + options else None)
    if fwd_ok:
        assert_close("loss", loss.reshape(-1), np.reshape(ref_loss, -1), 1e-5)
        assert_close("lse", lse.reshape(-1), ref_lse, 1e-6)
    if bwd_ok:
        g = dloss.astype(np.float64).reshape(-1, 1) if reduction == "none" else float(dloss)
        assert_close("dlogits (backward)", grad_b.reshape(-1, n), ref_grad * g, 1e-5)
    if fused_ok:
        assert_close("fused loss", loss2.reshape(-1), np.reshape(ref_loss, -1), 1e-5)
        assert_close("dlogits (fused)", output_for(logits_f).reshape(-1, n), ref_grad, 1e-5)


@FUZZ
@given(rows=st.integers(-2**63, INT64_MAX), classes=st.integers(-2**63, INT64_MAX), small=st.booleans(),
       reduction=st.sampled_from(REDUCTIONS))
def test_cross_entropy_workspace_query_contract(rows, classes, small, reduction):
    if small:
        rows, classes = abs(rows) % 5000, abs(classes) % 300000
    broken = "rows" if not 0 <= rows <= 2**31 - 1 else "classes" if not 1 <= classes <= 262144 else None
    call = lambda: fusekit.cross_entropy_workspace_size(rows, classes, reduction, "cpu")  # noqa: E731
    if expect_contract(call, broken):
        assert call() == 0


# ---- embeddings ----------------------------------------------------------------------------------
@FUZZ
@given(lead=lead_shapes(), vocab=st.integers(1, 9), dim=st.integers(1, 12), extra=st.integers(0, 2),
       token_dtype=st.sampled_from([np.int32, np.int64]), positions=st.booleans(), accumulate=st.booleans(),
       broken=st.sampled_from([None, None, "tokens", "out", "position_weight", "dweight", "dposition_weight",
                               "dout_expanded"]),
       seed=st.integers(0, 2**32 - 1))
def test_embedding_contract(lead, vocab, dim, extra, token_dtype, positions, accumulate, broken, seed):
    rng = np.random.default_rng(seed)
    lead = tuple(lead)
    T = lead[-1]
    tokens = rng.integers(0, vocab, lead).astype(token_dtype)
    weight = rng.standard_normal((vocab, dim)).astype(np.float32)
    pos = rng.standard_normal((T + extra, dim)).astype(np.float32)
    dout = rng.standard_normal(lead + (dim,)).astype(np.float32)
    out = np.zeros(lead + (dim,), np.float32)
    dw_old = rng.standard_normal((vocab, dim)).astype(np.float32)
    dp_old = rng.standard_normal((T + extra, dim)).astype(np.float32)
    dw, dp = dw_old.copy(), dp_old.copy()
    arg = broken
    if broken == "tokens":
        tokens.reshape(-1)[rng.integers(0, tokens.size)] = rng.choice([vocab, -1])
    elif broken == "out":
        out = break_output("shape", out)
    elif broken == "position_weight":
        positions, pos = True, np.zeros((T - 1, dim), np.float32) if T > 1 else np.zeros((1, dim + 1), np.float32)
    elif broken == "dweight":
        dw = np.zeros((vocab, dim + 1), np.float32)
    elif broken == "dposition_weight":
        positions, dp = True, np.zeros((max(T - 1, 1), dim + 1), np.float32)
    elif broken == "dout_expanded":
        dout, arg = expanded_argument(dout, lead, "dout")
    p = pos if positions else None
    fwd_ok = expect_contract(lambda: fusekit.embedding_forward(tokens, weight, p, out),
                             arg if arg in ("tokens", "out", "position_weight") else None)
    bwd_ok = expect_contract(
        lambda: fusekit.embedding_backward(dout, tokens, dw, dp if positions else None, accumulate),
        arg if arg in ("tokens", "dout", "dweight", "dposition_weight") else None)
    flat = tokens.reshape(-1).astype(np.int64)
    if fwd_ok:
        ref = weight.astype(np.float64)[flat].reshape(lead + (dim,))
        if positions:
            ref = ref + pos.astype(np.float64)[:T]
        assert_close("out", out, ref, 1e-6)
    if bwd_ok:
        d = dout.astype(np.float64).reshape(-1, dim)
        ref_w = np.zeros((vocab, dim))
        np.add.at(ref_w, flat, d)
        ref_p = np.zeros((T + extra, dim))
        ref_p[:T] = dout.astype(np.float64).reshape(-1, T, dim).sum(0)
        if accumulate:
            ref_w += dw_old
            ref_p += dp_old
        assert_close("dweight", dw, ref_w, 1e-5)
        if positions:
            assert_close("dposition_weight", dp, ref_p, 1e-5)


@FUZZ
@given(tokens=st.integers(-2**63, INT64_MAX), vocab=st.integers(-2**63, INT64_MAX),
       dim=st.integers(-2**63, INT64_MAX), small=st.booleans())
def test_embedding_workspace_query_contract(tokens, vocab, dim, small):
    if small:
        tokens, vocab, dim = abs(tokens) % 5000, abs(vocab) % 300000, abs(dim) % 70000
    broken = ("tokens" if not 0 <= tokens <= 2**31 - 1 else "vocab" if not 1 <= vocab <= 2**31 - 1
              else "dim" if not 1 <= dim <= 65536 else None)
    call = lambda: fusekit.embedding_backward_workspace_size(tokens, vocab, dim, "cpu")  # noqa: E731
    if expect_contract(call, broken):
        assert call() == 0


# ---- FP8 RMSNorm ---------------------------------------------------------------------------------
@pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed (NumPy has no FP8 types)")
@FUZZ
@given(rows=st.integers(1, 6), groups=st.integers(1, 3), group=st.sampled_from([1, 4, 16]),
       eps=st.sampled_from([1e-5, 1.0]), broken=st.sampled_from([None, None, "eps", "qy", "x", "dx"]),
       seed=st.integers(0, 2**32 - 1))
def test_fp8_rms_norm_contract(rows, groups, group, eps, broken, seed):
    rng = np.random.default_rng(seed)
    n = groups * group
    e4m3 = ml_dtypes.float8_e4m3fn
    q = rng.uniform(-4, 4, (rows, n)).astype(e4m3)
    scales = rng.uniform(0.5, 2, (rows, n // group)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, n).astype(np.float32)
    qy, qy_t = np.zeros((rows, n), e4m3), np.zeros((n, rows), e4m3)
    y_scale, rstd = np.zeros(1, np.float32), np.zeros(rows, np.float32)
    y = np.zeros((rows, n), ml_dtypes.bfloat16)
    dy = rng.standard_normal((rows, n)).astype(ml_dtypes.bfloat16)
    dx, dw = np.zeros((rows, n), ml_dtypes.bfloat16), np.zeros(n, np.float32)
    x_bwd = q
    if broken == "eps":
        eps = float(rng.choice([0.0, -1.0, math.inf, math.nan]))
    elif broken == "qy":
        qy = np.zeros((rows + 1, n), e4m3)
    elif broken == "x":
        x_bwd = np.zeros((rows + 1, n), e4m3)
    elif broken == "dx":
        dx = np.zeros((rows, n + 1), ml_dtypes.bfloat16)
    fwd_broken = broken if broken in ("eps", "qy") else None
    fwd = lambda: fusekit.fp8_rms_norm_forward(q, scales, w, eps, qy, qy_t, y_scale, rstd, y,  # noqa: E731
                                               group_size=group)
    if expect_contract(fwd, fwd_broken):
        xd = q.astype(np.float64) * np.repeat(scales.astype(np.float64), group, axis=1)
        ref_rstd = 1 / np.sqrt((xd * xd).mean(1) + np.float64(np.float32(eps)))
        assert_close("rstd", rstd, ref_rstd, 1e-6)
        assert_close("y", y.astype(np.float64), xd * w * ref_rstd[:, None], 1e-2)
    if fwd_broken:
        return
    bwd_broken = broken if broken in ("x", "dx") else None
    x_scales = scales if x_bwd is q else np.ones((rows + 1, n // group), np.float32)
    bwd = lambda: fusekit.fp8_rms_norm_backward(dy, x_bwd, x_scales, w, rstd, dx, dw, group_size=group)  # noqa: E731
    if expect_contract(bwd, bwd_broken):
        xd = q.astype(np.float64) * np.repeat(scales.astype(np.float64), group, axis=1)
        r = rstd.astype(np.float64)[:, None]
        xhat = xd * r
        g = dy.astype(np.float64) * w
        ref_dx = r * (g - xhat * (g * xhat).mean(1, keepdims=True))
        assert_close("dx", dx.astype(np.float64), ref_dx, 2e-2)
        assert_close("dweight", dw, (dy.astype(np.float64) * xhat).sum(0), 1e-4)


# ---- attention -----------------------------------------------------------------------------------
def attention_reference(q, k, v, bias, scale, mask, wl, wr, dout):
    """out, lse, dq, dk, dv in float64 (fixed lengths, no dropout)."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    out, lse = np.zeros(q.shape[:3] + (v.shape[3],)), np.zeros((B, Hq, Sq))
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    d = 0 if mask == "causal_top_left" else Sk - Sq
    i = np.arange(Sq, dtype=object)[:, None]  # Python integers: windows near 2^63 must not wrap here
    j = np.arange(Sk, dtype=object)[None, :]
    visible = np.ones((Sq, Sk), bool)
    if mask != "none":
        visible &= j <= i + d
    if wr >= 0:
        visible &= j <= i + d + wr
    if wl >= 0:
        visible &= j >= i + d - wl
    for b in range(B):
        for h in range(Hq):
            hk = h // g
            S = scale * q[b, :, h] @ k[b, :, hk].T
            if bias is not None:
                S = S + bias[b % bias.shape[0], h % bias.shape[1]][:Sq if bias.shape[2] > 1 else 1, :Sk]
            S = np.where(visible, S, -np.inf)
            m = S.max(axis=1, initial=-np.inf)
            live = np.isfinite(m)
            P = np.zeros_like(S)
            P[live] = np.exp(S[live] - m[live, None])
            total = P.sum(axis=1)
            row_lse = np.full(Sq, -np.inf)
            row_lse[live] = m[live] + np.log(total[live])
            P[live] /= total[live, None]
            o = P @ v[b, :, hk]
            out[b, :, h], lse[b, h] = o, row_lse
            do = dout[b, :, h]
            dv[b, :, hk] += P.T @ do
            dP = do @ v[b, :, hk].T
            dS = P * (dP - (do * o).sum(1, keepdims=True))
            dq[b, :, h] = scale * dS @ k[b, :, hk]
            dk[b, :, hk] += scale * dS.T @ q[b, :, h]
    return out, lse, dq, dk, dv


WINDOWS = [-1, 0, 1, 3, 2**32, 2**62, INT64_MAX - 1, INT64_MAX]


@FUZZ
@given(B=st.integers(1, 2), Sq=st.integers(0, 6), Sk=st.integers(0, 6), Hkv=st.integers(1, 2),
       group=st.integers(1, 2), D=st.sampled_from([2, 4]), Dv=st.sampled_from([2, 4]),
       mask=st.sampled_from(["none", "causal_top_left", "causal_bottom_right"]),
       wl=st.sampled_from(WINDOWS), wr=st.sampled_from(WINDOWS), bias_kind=st.sampled_from([None, "full", "keys"]),
       broken=st.sampled_from([None, None, "out", "bias", "dq", "dk", "dv", "window_left"]),
       seed=st.integers(0, 2**32 - 1))
def test_attention_contract(B, Sq, Sk, Hkv, group, D, Dv, mask, wl, wr, bias_kind, broken, seed):
    rng = np.random.default_rng(seed)
    Hq = Hkv * group
    q = rng.standard_normal((B, Sq, Hq, D))
    k = rng.standard_normal((B, Sk, Hkv, D))
    v = rng.standard_normal((B, Sk, Hkv, Dv))
    dout = rng.standard_normal((B, Sq, Hq, Dv))
    bias = None
    if bias_kind is not None:
        shape = (B, Hq, Sq, Sk) if bias_kind == "full" else (1, 1, 1, Sk)
        padded = np.zeros(shape[:3] + (Sk + Sk % 2,))  # key rows a multiple of 16 bytes
        bias = padded[..., :Sk]
        bias[...] = rng.standard_normal(shape)
        if Sk > 0 and rng.random() < 0.3:
            bias[..., 0] = -np.inf  # a mask: allowed
    out, lse = np.zeros((B, Sq, Hq, Dv)), np.zeros((B, Hq, Sq), np.float32)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    arg = broken
    if broken == "out":
        if Sq * Hq < 2:
            arg = None
        else:
            out = np.lib.stride_tricks.as_strided(out, shape=out.shape, strides=(0, 0, 0, 8))
    elif broken == "bias":
        if bias is None or Sk == 0:
            arg = None
        else:
            bias[(0,) * 3 + (Sk - 1,)] = rng.choice([np.inf, np.nan])
    elif broken == "window_left":
        wl = -2 - int(rng.integers(0, 2**62))
    elif broken in ("dq", "dk", "dv"):
        a = {"dq": dq, "dk": dk, "dv": dv}[broken]
        if a.shape[1] * a.shape[2] < 2:
            arg = None
        else:
            a = np.lib.stride_tricks.as_strided(a, shape=a.shape, strides=(0, 0, 0, 8))
            dq, dk, dv = (a if broken == name else t for name, t in (("dq", dq), ("dk", dk), ("dv", dv)))
    kw = dict(mask=mask, window_left=wl, window_right=wr)
    fwd_broken = arg if arg in ("out", "bias", "window_left") else None
    fwd_ok = expect_contract(lambda: fusekit.attention_forward(q, k, v, bias, out, lse, **kw), fwd_broken)
    if fwd_broken:
        return
    ref = attention_reference(q, k, v, bias, 1 / math.sqrt(D), mask, wl, wr, dout)
    if fwd_ok:
        assert_close("out", out, ref[0], 1e-10)
        assert_close("lse", lse, ref[1].astype(np.float32), 1e-6)
    bwd_broken = arg if arg in ("dq", "dk", "dv") else None
    if expect_contract(lambda: fusekit.attention_backward(dout, q, k, v, out, lse, bias, dq, dk, dv, None, **kw),
                       bwd_broken):
        # The backward recomputes P from the float32 lse, as documented: float32-level agreement.
        assert_close("dq", dq, ref[2], 1e-5)
        assert_close("dk", dk, ref[3], 1e-5)
        assert_close("dv", dv, ref[4], 1e-5)


@FUZZ
@given(sizes=st.lists(st.integers(-2**63, INT64_MAX), min_size=7, max_size=7), small=st.sampled_from([0, 1, 2]),
       backward=st.booleans(), deterministic=st.booleans())
def test_attention_workspace_queries_contract(sizes, small, backward, deterministic):
    if small == 1:
        sizes = [abs(s) % 300 for s in sizes]
    elif small == 2:
        sizes = [abs(s) % 2**40 for s in sizes]
    B, Sq, Sk, Hq, Hkv, D, Dv = sizes
    broken = None
    if any(s < 0 for s in sizes) or D > 256 or Dv > 256 or B * Sq * Hq * max(D, 1) * 4 > INT64_MAX:
        broken = "shape"
    if backward:
        call = lambda: fusekit.attention_backward_workspace_size(B, Sq, Sk, Hq, Hkv, D, Dv, fusekit.DType.f64,  # noqa: E731
                                                                 "cpu", deterministic=deterministic)
    else:
        call = lambda: fusekit.attention_forward_workspace_size(B, Sq, Sk, Hq, Hkv, D, Dv, fusekit.DType.f64,  # noqa: E731
                                                                "cpu")
    if expect_contract(call, broken):
        assert call() == 0


@FUZZ
@given(seed=st.integers(0, 2**64 - 1), offset=st.integers(0, 2**33), p=st.one_of(st.floats(-1, 2), st.just(math.nan)),
       attention=st.booleans())
def test_dropout_mask_helpers_contract(seed, offset, p, attention):
    mask = np.zeros((1, 2, 3, 5), np.uint8) if attention else np.zeros(13, np.uint8)
    fn = fusekit.attention_dropout_keep_mask if attention else fusekit.dropout_keep_mask
    p32 = float(np.float32(p))  # what the op gets: -5e-93 is -0.0 there, 1 - 1e-9 is 1.0
    broken = None if 0 <= p32 < 1 else "p"
    if attention and broken is None and offset >= 2**32:
        broken = "offset"
    try:
        ok = expect_contract(lambda: fn(seed, offset, p, mask), broken)
    except AssertionError:
        if broken == "offset":  # the plain helper's offset is a full 64-bit Philox subsequence
            return
        raise
    if ok:
        assert set(np.unique(mask)) <= {0, 1}


# ---- mistyped scalars ----------------------------------------------------------------------------
SCALAR_ARGUMENTS = [(e.name, a) for e in ENTRY_POINTS if e.available() for a in e.scalars()
                    if e.kinds[a] != CFG]
ANY_SCALAR = st.one_of(
    st.none(), st.booleans(), st.booleans().map(np.bool_), st.integers(-2**70, 2**70),
    st.sampled_from([0, 1, -1, 4, 2**31, 2**32, 2**63, 2**64, -2**63 - 1, 2**1024]),
    st.integers(-2**63, INT64_MAX).map(np.int64), st.integers(0, 2**64 - 1).map(np.uint64),
    st.integers(-128, 127).map(np.int8), st.floats(), st.floats(width=32).map(np.float32),
    st.floats(width=16).map(np.float16), st.sampled_from([1e-5, 0.5, 1e39, -3.5e38, math.inf, math.nan]),
    st.text(max_size=4),
    st.sampled_from(ACTIVATIONS + ["causal_top_left", "cpu", "cuda:x", "f32", "mean", "sum", "halves",
                                   "interleaved", "rotate_half"]),
    st.sampled_from([m for e in OPTIONS.values() for m in e] + list(fusekit.DType)),
    st.complex_numbers(max_magnitude=4), st.lists(st.integers(0, 3), max_size=2), st.binary(max_size=2))


def _integer(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _real(value):
    return _integer(value) or isinstance(value, (float, np.floating))


def scalar_model(kind, value):
    """What fusekit must do with `value` for an argument of `kind`: 'type' (ArgumentTypeError),
    'range' (InvalidArgumentError: the C++ type cannot hold it) or ('same as', the plain Python
    value it must behave exactly like)."""
    if kind in (FLOAT, OPT_FLOAT):
        if value is None and kind == OPT_FLOAT:
            return ("same as", None)
        if not _real(value):
            return "type"
        return ("same as", float(value)) if float32_holds(value) else "range"
    if kind in (INT64, INT32, UINT64) or (kind == STREAM and value is not None):
        if not _integer(value):
            return "type"
        lo, hi = {INT64: (-2**63, 2**63), INT32: (-2**31, 2**31)}.get(kind, (0, 2**64))
        return ("same as", int(value)) if lo <= int(value) < hi else "range"
    if kind == STREAM:
        return ("same as", None)
    if kind == BOOL:
        return ("same as", bool(value)) if isinstance(value, (bool, np.bool_)) else "type"
    if kind == DTYPE:
        return ("same as", value) if isinstance(value, fusekit.DType) else "type"
    if kind == DEVICE:
        return ("same as", value) if isinstance(value, str) else "type"
    return ("same as", value) if isinstance(value, (str, OPTIONS[kind])) else "type"


@FUZZ
@given(which=st.sampled_from(SCALAR_ARGUMENTS), value=ANY_SCALAR, seed=st.integers(0, 2**32 - 1))
def test_mistyped_scalars_contract(which, value, seed):
    name, argument = which
    entry = BY_NAME[name]
    model = scalar_model(entry.kinds[argument], value)
    got = outcome(entry, with_value(entry, seed, argument, value))
    if model in ("type", "range"):
        assert got[0] == "error", f"{value!r} for '{argument}' was accepted"
        cls, message = got[1], got[2]
        assert cls == ("ArgumentTypeError" if model == "type" else "InvalidArgumentError"), message
        assert message.startswith(f"fusekit.{entry.op}: argument '{argument}'"), message
        return
    # A value of an accepted type: exactly what the plain Python value does (a result, or the same
    # clean error, e.g. a probability outside [0, 1) or an unknown activation name).
    want = outcome(entry, with_value(entry, seed, argument, model[1]))
    assert got == want, f"{value!r} gave {summary(got)}, {model[1]!r} gave {summary(want)}"
    if got[0] == "error":
        assert got[1] in ("InvalidArgumentError", "UnsupportedError"), got
        assert got[2].startswith(f"fusekit.{entry.op}:"), got
# ---- rotary embeddings -----------------------------------------------------------------------------
def rope_reference(x, positions, style, r, inv_freq, cos, sin, m, backward):
    """The documented definition (include/fusekit/rope.h) in float64 from the float32 angles; x
    (..., H, D), positions (...)."""
    if cos is not None:
        c, s = cos.astype(np.float64)[positions], sin.astype(np.float64)[positions]
    else:
        angle = positions.astype(np.float32)[..., None] * inv_freq  # the float32 product
        c, s = np.cos(angle.astype(np.float64)), np.sin(angle.astype(np.float64))
    m = np.float64(np.float32(m))
    c, s = m * c[..., None, :], (-m if backward else m) * s[..., None, :]
    x = x.astype(np.float64)
    out = x.copy()
    half = r // 2
    first = (slice(0, half), slice(half, r)) if style == "rotate_half" else (slice(0, r, 2), slice(1, r, 2))
    a, b = x[..., first[0]], x[..., first[1]]
    out[..., first[0]], out[..., first[1]] = a * c - b * s, b * c + a * s
    return out


@FUZZ
@given(packed=st.booleans(), B=st.integers(1, 2), S=st.integers(1, 5), Hq=st.integers(1, 3), Hk=st.integers(0, 2),
       D=st.sampled_from([2, 4, 6, 8, 10]), rotary=st.integers(0, 5),
       style=st.sampled_from(["rotate_half", "interleaved"]), positions=st.sampled_from(["implicit", "ids", "shared"]),
       source=st.sampled_from(["theta", "inv_freq", "cos_sin"]), with_k=st.booleans(), in_place=st.booleans(),
       backward=st.booleans(), dtype=st.sampled_from([np.float32, np.float16]),
       broken=st.sampled_from([None, None, "q_out", "k_out", "rotary_dim", "position_ids", "theta", "cos"]),
       seed=st.integers(0, 2**32 - 1))
def test_rope_contract(packed, B, S, Hq, Hk, D, rotary, style, positions, source, with_k, in_place, backward, dtype,
                       broken, seed):
    rng = np.random.default_rng(seed)
    lead = (S,) if packed else (B, S)
    r = 2 * rotary if 0 < 2 * rotary <= D else 0
    half = (r or D) // 2
    q = rng.standard_normal(lead + (Hq, D)).astype(dtype)
    k = rng.standard_normal(lead + (Hk, D)).astype(dtype) if with_k else None
    q_in, k_in = q.copy(), (k.copy() if with_k else None)
    q_out = q if in_place else np.zeros_like(q)
    k_out = (k if in_place else np.zeros_like(k)) if with_k else None
    table_rows = S + 3
    ids = None
    if positions == "ids" or packed and positions != "implicit":
        ids = rng.integers(0, table_rows, lead)
    elif positions == "shared":
        ids = rng.integers(0, table_rows, (1, S)).astype(np.int32)
    kw = dict(style=style, rotary_dim=r, theta=float(rng.choice([10000.0, 500000.0])),
              attention_scaling=float(rng.choice([1.0, 0.5])))
    inv_freq = (np.float64(np.float32(kw["theta"])) ** (-2.0 * np.arange(half) / (2 * half))).astype(np.float32)
    tables = {}
    if source == "inv_freq":
        inv_freq = rng.uniform(0, 1, half).astype(np.float32)
        tables = dict(inv_freq=inv_freq)
    elif source == "cos_sin":
        angles = rng.uniform(-10, 10, (table_rows, half))
        tables = dict(cos=np.cos(angles).astype(np.float32), sin=np.sin(angles).astype(np.float32))
    arg = broken
    if broken == "q_out":
        q_out = np.zeros(q.shape[:-1] + (D + 2,), dtype)
    elif broken == "k_out":
        if with_k and k.size // D > 1:
            k_out = np.lib.stride_tricks.as_strided(np.zeros_like(k), shape=k.shape,
                                                    strides=(0,) * (k.ndim - 1) + (k.strides[-1],))
        else:
            arg = None
    elif broken == "rotary_dim":
        kw["rotary_dim"] = int(rng.choice([1, 3, D + 2]))
    elif broken == "position_ids":
        ids = np.zeros(lead[:-1] + (S + 1,), np.int64)
    elif broken == "theta":
        kw["theta"] = float(rng.choice([0.0, -1.0, math.inf, math.nan]))
    elif broken == "cos":
        tables = dict(cos=np.ones((table_rows, half + 1), np.float32), sin=np.ones((table_rows, half + 1), np.float32))
    op = fusekit.rope_backward if backward else fusekit.rope_forward
    if backward:  # the backward's names of the outputs
        arg = {"q_out": "dq", "k_out": "dk"}.get(arg, arg)
    if not expect_contract(lambda: op(q, k, ids, q_out, k_out, **kw, **tables), arg):
        return
    pos = ids if ids is not None else (np.arange(S) if packed else np.arange(S)[None, :])
    pos = np.broadcast_to(pos, lead) if not packed else pos
    ref = dict(style=style, r=r or D, inv_freq=inv_freq, cos=tables.get("cos"), sin=tables.get("sin"),
               m=kw["attention_scaling"], backward=backward)
    assert_close("q_out", q_out, rope_reference(q_in, pos, **ref), TOL[dtype])
    if with_k:
        assert_close("k_out", k_out, rope_reference(k_in, pos, **ref), TOL[dtype])
