"""Helpers of the fusekit.torch tests (import after pytest.importorskip("torch"))."""
import torch


def rel(a, ref):
    """Relative L2 error of `a` against `ref`, both compared in float64 on the CPU; fails on a
    shape mismatch or a non-finite value."""
    a, ref = a.detach().double().cpu(), ref.detach().double().cpu()
    assert a.shape == ref.shape, f"shape {tuple(a.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a - ref).norm() / ref.norm().clamp_min(1e-300)).item()
