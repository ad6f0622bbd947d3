"""fusekit.global_norm and fusekit.adamw_step with lists of NumPy arrays: the CPU backend against a
NumPy float64 implementation of the global norm and of PyTorch's AdamW (decoupled weight decay,
bias correction, clipping by the global norm), float16 gradients and parameter copies, lists
longer than the binding layer's fixed slots, and bad arguments naming the list element."""
import numpy as np
import pytest

import fusekit
from fk_testing import check_close, check_invalid_argument, rel_l2, rounding_error

SHAPES = [(7, 3), (1,), (64,), (5, 4, 2)] + [(i + 1,) for i in range(20)]  # 24 tensors


def global_norm_reference(tensors):
    return np.sqrt(sum(float((t.astype(np.float64) ** 2).sum()) for t in tensors))


def adamw_reference(p, g, m, v, lr, beta1, beta2, eps, wd, step, scale, dtype=np.float64):
    """One step of PyTorch's AdamW on copies, computed in `dtype` (float64: the reference;
    float32: the same computation rounded as the op's, whose error is the baseline: a moment
    where beta1 * m and (1 - beta1) * g cancel has a large relative error in any float32 form);
    returns (p, m, v)."""
    p, g, m, v = (a.astype(dtype) for a in (p, g, m, v))
    lr, beta1, beta2, eps, wd, scale = (dtype(x) for x in (lr, beta1, beta2, eps, wd, scale))
    g = g * scale
    m = beta1 * m + (dtype(1) - beta1) * g
    v = beta2 * v + (dtype(1) - beta2) * g * g
    p = p - lr * wd * p
    m_hat, v_hat = m / (dtype(1) - beta1 ** step), v / (dtype(1) - beta2 ** step)
    return p - lr * m_hat / (np.sqrt(v_hat) + eps), m, v


def test_global_norm_matches_float64(seed):
    rng = np.random.default_rng(seed)
    tensors = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    norm = np.full(1, np.nan, np.float32)
    fusekit.global_norm(tensors, norm)
    ref = np.array([global_norm_reference(tensors)])
    check_close("norm", norm, ref, "f32", rounding_error(ref, np.float32))


@pytest.mark.parametrize("grad_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_adamw_matches_pytorch_formula_over_steps(grad_dtype, clip, seed):
    rng = np.random.default_rng(seed)
    lr, beta1, beta2, eps, wd = 1e-2, 0.9, 0.95, 1e-8, 0.1
    params = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    m = [np.zeros(s, np.float32) for s in SHAPES]
    v = [np.zeros(s, np.float32) for s in SHAPES]
    copies = [np.full(s, np.nan, np.float16) for s in SHAPES]
    ref_p, ref_m, ref_v = ([a.astype(np.float64) for a in x] for x in (params, m, v))
    f32_p, f32_m, f32_v = ([a.copy() for a in x] for x in (params, m, v))
    f32 = lambda x: float(np.float32(x))  # noqa: E731  the op receives float32 hyperparameters
    for step in (1, 2, 3):
        grads = [rng.standard_normal(s).astype(grad_dtype) for s in SHAPES]
        norm = np.zeros(1, np.float32)
        fusekit.global_norm(grads, norm)
        scale = min(1.0, f32(clip) / (float(norm[0]) + 1e-6)) if clip > 0 else 1.0
        fusekit.adamw_step(params, grads, m, v, copies, norm if clip > 0 else None, lr=lr, beta1=beta1,
                           beta2=beta2, eps=eps, weight_decay=wd, step=step, max_grad_norm=clip)
        for i in range(len(SHAPES)):
            hyper = (f32(lr), f32(beta1), f32(beta2), f32(eps), f32(wd), step, scale)
            ref_p[i], ref_m[i], ref_v[i] = adamw_reference(ref_p[i], grads[i], ref_m[i], ref_v[i], *hyper)
            f32_p[i], f32_m[i], f32_v[i] = adamw_reference(f32_p[i], grads[i], f32_m[i], f32_v[i], *hyper, np.float32)
    for i in range(len(SHAPES)):
        for name, got, ref, rounded in (("params", params, ref_p, f32_p), ("exp_avg", m, ref_m, f32_m),
                                        ("exp_avg_sq", v, ref_v, f32_v)):
            check_close(f"{name}[{i}]", got[i], ref[i], "f32", rounding_error(ref[i], np.float32),
                        baseline=rel_l2(rounded[i], ref[i]))
        assert np.array_equal(copies[i], params[i].astype(np.float16)), i


def test_bad_arguments_name_the_element(seed):
    rng = np.random.default_rng(seed)
    p = [rng.standard_normal(4).astype(np.float32), rng.standard_normal(3).astype(np.float32)]
    g = [np.ones(4, np.float32), np.ones(2, np.float32)]
    m = [np.zeros(4, np.float32), np.zeros(3, np.float32)]
    v = [np.zeros(4, np.float32), np.zeros(3, np.float32)]
    check_invalid_argument(lambda: fusekit.adamw_step(p, g, m, v), "grads[1]", None)
    check_invalid_argument(lambda: fusekit.adamw_step(p, p[0], m, v), "grads", "a list or tuple of arrays")
    check_invalid_argument(lambda: fusekit.adamw_step(p, [p[0], "x"], m, v), "grads[1]", None)
    check_invalid_argument(lambda: fusekit.adamw_step(p, p, m, v, lr=-1.0), "lr", None)
    check_invalid_argument(lambda: fusekit.global_norm(p, np.zeros(2, np.float32)), "norm", None)
