"""Helpers of the Python tests: the tolerance rule of the C++ harness (tests/harness/harness.h),
an error no more than twice the larger of the rounding baseline (the float64 reference merely
rounded to the dtype) and a per-dtype accumulation floor; where a PyTorch counterpart exists, twice
PyTorch's own error in the same dtype counts as a baseline too."""
import math

import numpy as np
import pytest

import fusekit

try:
    import ml_dtypes
except ImportError:  # bfloat16 NumPy tests skip without it
    ml_dtypes = None

# As accumulation_floor() in tests/harness/harness.cpp.
ACCUMULATION_FLOOR = {"f32": 2e-6, "f16": 1e-4, "bf16": 1e-3}

NUMPY_DTYPES = {"f32": np.float32, "f16": np.float16}
if ml_dtypes is not None:
    NUMPY_DTYPES["bf16"] = ml_dtypes.bfloat16


def to_f64(a):
    return np.asarray(a).astype(np.float64)


def rel_l2(got, ref):
    got, ref = to_f64(got), to_f64(ref)
    assert got.shape == ref.shape, f"shape {got.shape} != reference shape {ref.shape}"
    assert np.all(np.isfinite(got)), "non-finite values in the result"
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(got - ref) / (denom if denom > 0 else 1.0))


def rounding_error(ref, numpy_dtype):
    """The error of the float64 reference merely rounded to the dtype."""
    return rel_l2(to_f64(ref).astype(numpy_dtype), ref)


def check_close(name, got, ref, dtype_name, rounding, baseline=0.0):
    """got vs the float64 reference: rel_l2 <= 2 * max(rounding, floor, baseline)."""
    err = rel_l2(got, ref)
    bar = 2.0 * max(rounding, ACCUMULATION_FLOOR[dtype_name], baseline)
    assert err <= bar, (f"{name} ({dtype_name}): rel_l2 {err:.3e} > bar {bar:.3e} "
                        f"(rounding {rounding:.3e}, baseline {baseline:.3e})")
    return err


def check_invalid_argument(call, argument, words):
    """call() raises fusekit.InvalidArgumentError with the C++ message and its parts: naming
    `argument` (None: any) and containing `words` where given. A value of the wrong Python type
    raises its subclass ArgumentTypeError (also a TypeError), worded "must be <type>, not <type>"."""
    with pytest.raises(fusekit.InvalidArgumentError) as info:
        call()
    e = info.value
    assert isinstance(e, ValueError) and isinstance(e, fusekit.Error)
    message = str(e)
    assert message.startswith("fusekit."), message
    if argument is not None:
        assert f"argument '{argument}'" in message and e.argument == argument, message
    assert e.kind == "invalid_argument" and e.op in message
    if isinstance(e, fusekit.ArgumentTypeError):
        assert isinstance(e, TypeError)
        assert e.expected and e.got and f"must be {e.expected}, not {e.got}" in message
    else:
        assert e.expected and e.got and f"expected {e.expected}, got {e.got}" in message
    if words:
        assert words in message, message


def attention_visibility(sq, sk, mask, window):
    """The documented visibility rule of attention (include/fusekit/attention.h) as a bool
    (sq, sk) array: whether query i sees key j under `mask` and `window` (left, right)."""
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    d = 0 if mask == "causal_top_left" else sk - sq
    vis = np.ones((sq, sk), bool)
    if mask != "none":
        vis &= j <= i + d
    if window[0] >= 0:
        vis &= j >= i + d - window[0]
    if window[1] >= 0:
        vis &= j <= i + d + window[1]
    return vis


# ---- activations in float64 (fusekit/activation.h), shared by the dropout and linear tests -----
_erf = np.frompyfunc(math.erf, 1, 1)
_GELU_C = math.sqrt(2.0 / math.pi)


def act(name, h, slope=0.01):
    if name == "none":
        return h
    if name == "relu":
        return np.maximum(h, 0.0)
    if name == "gelu_erf":
        return h * 0.5 * (1.0 + _erf(h / math.sqrt(2.0)).astype(np.float64))
    if name == "gelu_tanh":
        return 0.5 * h * (1.0 + np.tanh(_GELU_C * (h + 0.044715 * h ** 3)))
    if name == "squared_relu":
        return np.maximum(h, 0.0) ** 2
    if name == "leaky_relu":
        return np.where(h >= 0, h, slope * h)
    if name == "silu":
        return h / (1.0 + np.exp(-h))
    raise ValueError(name)


def act_grad(name, h, slope=0.01):
    if name == "none":
        return np.ones_like(h)
    if name == "relu":
        return (h > 0).astype(np.float64)
    if name == "gelu_erf":
        cdf = 0.5 * (1.0 + _erf(h / math.sqrt(2.0)).astype(np.float64))
        return cdf + h * np.exp(-0.5 * h * h) / math.sqrt(2.0 * math.pi)
    if name == "gelu_tanh":
        t = np.tanh(_GELU_C * (h + 0.044715 * h ** 3))
        return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * h * h)
    if name == "squared_relu":
        return 2.0 * np.maximum(h, 0.0)
    if name == "leaky_relu":
        return np.where(h > 0, 1.0, slope)  # slope at 0, as PyTorch
    if name == "silu":
        s = 1.0 / (1.0 + np.exp(-h))
        return s * (1.0 + h * (1.0 - s))
    raise ValueError(name)
