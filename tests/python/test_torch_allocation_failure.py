"""An allocation PyTorch's caching allocator cannot serve, inside a fusekit.torch op: the error
names the op and the size asked for, and the process stays usable (the same call succeeds once the
memory is there). Both allocation routes are covered: outputs allocated on the Python side
(bias_act_dropout) and outputs/scratch fusekit._C allocates through the DLPack exchange table's
allocator (linear). CUDA only: the CPU allocator does not take a memory limit."""
import contextlib

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the fusekit.torch tests need it")
import fusekit  # noqa: E402
import fusekit.torch as fk  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MiB = 1 << 20


@contextlib.contextmanager
def memory_cap(extra_bytes: int):
    """Caps this process's CUDA caching allocator at what it holds now plus extra_bytes."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + extra_bytes) / total)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def test_python_side_allocation_names_the_op_and_size():
    x = torch.randn(64 * MiB // 2, device="cuda", dtype=torch.bfloat16)  # 64 MiB
    with memory_cap(8 * MiB), pytest.raises(fk.OutOfMemoryError) as info:
        fk.bias_act_dropout(x, None, "gelu_tanh", 0.0)
    message = str(info.value)
    assert message.startswith("fusekit.bias_act_dropout_forward: could not allocate"), message
    assert "64.00 MiB asked for" in message, message
    assert info.value.op == "bias_act_dropout_forward"
    assert isinstance(info.value, torch.OutOfMemoryError)  # code catching PyTorch's still works
    y = fk.bias_act_dropout(x, None, "gelu_tanh", 0.0)  # usable again
    torch.testing.assert_close(y, torch.nn.functional.gelu(x.float(), approximate="tanh").to(x.dtype),
                               rtol=1.6e-2, atol=1e-2)


def test_framework_allocation_in_the_extension_names_the_op_and_bytes():
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    with memory_cap(4 * MiB), pytest.raises(fusekit.Error) as info:
        fk.linear(x, w)
    message = str(info.value)
    # Which allocation fails first (the output or cuBLASLt's workspace) is the extension's business;
    # the message names the op, the bytes and the device either way.
    assert "fusekit.linear_forward: could not allocate" in message, message
    assert " bytes on cuda:0 through the framework's allocator" in message, message
    y = fk.linear(x, w)
    torch.testing.assert_close(y.float(), x.float() @ w.float().t(), rtol=2e-2, atol=2.0)
