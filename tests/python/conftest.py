"""pytest fixtures of the Python tests (helpers live in fk_testing.py)."""
import os
import time

import numpy as np
import pytest

_SEED = int(os.environ.get("FUSEKIT_TEST_SEED", time.time_ns() % (2**32)))


def pytest_report_header(config):
    return f"fusekit random seed {_SEED} (set FUSEKIT_TEST_SEED to replay)"


@pytest.fixture
def rng(request):
    """Fresh random data every run; a distinct stream per test, all derived from the run's seed."""
    salt = sum(ord(c) for c in request.node.nodeid)
    return np.random.default_rng([_SEED, salt])


@pytest.fixture
def seed(rng):
    """An integer seed for frameworks with their own generators (torch.manual_seed)."""
    return int(rng.integers(0, 2**31 - 1))


@pytest.fixture(params=["eager", "custom_op"])
def path(request):
    """Both routes of fusekit.torch: the eager path, and the registered custom op, which is what
    anything tracing sees (forced with a dispatch mode that forwards every call unchanged). For
    the PyTorch tests, which import torch first."""
    if request.param == "eager":
        yield request.param
        return
    from torch_testing import custom_op_route
    with custom_op_route():
        yield request.param
