"""The dispatch decision of fusekit.torch on GPUs without fusekit kernels (fusekit._policy): pure,
so it is checked on any machine; tests/python/test_torch_fallback.py runs the policies on a GPU."""
import pytest

import fusekit
from fusekit._policy import POLICIES, decide


def test_auto_runs_fusekit_where_it_has_kernels_and_pytorch_elsewhere():
    assert decide("auto", "cuda", True) == "fusekit"
    assert decide("auto", "cuda", False) == "pytorch"
    assert decide("auto", "cpu", False) == "fusekit"  # the float64 reference


def test_strict_never_changes_kernels_silently():
    assert decide("strict", "cuda", True) == "fusekit"
    assert decide("strict", "cuda", False) == "error"
    assert decide("strict", "cpu", False) == "fusekit"


def test_always_runs_pytorch():
    for device_type in ("cpu", "cuda"):
        for supported in (False, True):
            assert decide("always", device_type, supported) == "pytorch"


def test_unknown_policy_is_refused():
    assert POLICIES == ("auto", "strict", "always")
    with pytest.raises(ValueError, match="unknown fallback policy"):
        decide("sometimes", "cuda", True)


def test_runtime_names_the_supported_architecture():
    assert fusekit.supports_compute_capability(9, 0)
    for major, minor in [(8, 0), (8, 9), (9, 1), (10, 0), (12, 0)]:
        assert not fusekit.supports_compute_capability(major, minor)
    assert not fusekit.cuda_device_supported(-1)
    assert fusekit.cuda_device_supported(fusekit.cuda_device_count()) is False
    assert fusekit.__version__ == fusekit.version() and fusekit.__version__[0].isdigit()


def test_environment_report_runs():
    from fusekit.__main__ import report
    text = report()
    assert text.startswith(f"fusekit {fusekit.__version__}")
    assert "kernels built for: sm_" in text and "GPU" in text
