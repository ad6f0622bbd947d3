"""Helpers of the Python tests: the tolerance rule of the C++ harness (tests/harness/harness.h),
an error no more than twice the larger of the rounding baseline (the float64 reference merely
rounded to the dtype) and a per-dtype accumulation floor; where a PyTorch counterpart exists, twice
PyTorch's own error in the same dtype counts as a baseline too."""
import numpy as np

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
