"""python -m fusekit: what this installation is and what it can run here."""
import platform
import sys

from . import _C
from ._policy import decide

_FAMILIES = ("layer_norm / rms_norm", "bias_act_dropout", "gated_act", "linear", "fp8_rms_norm",
             "attention", "cross_entropy")


def report() -> str:
    lines = [f"fusekit {_C.version()} (Python {platform.python_version()}, {sys.platform})",
             f"kernels built for: sm_{_C.built_cuda_architectures()}",
             "CPU backend: float64 references of every op"]
    try:
        import torch
        lines.append(f"PyTorch: {torch.__version__}" +
                     ("" if hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
                      else " (fusekit.torch needs 2.10 or later)"))
    except ImportError:
        lines.append("PyTorch: not installed (fusekit.torch unavailable; fusekit.* takes NumPy, "
                     "CuPy, JAX arrays)")
    count = _C.cuda_device_count()
    if count == 0:
        lines.append("GPUs: none visible (the CPU backend serves every op)")
    for index in range(count):
        supported = _C.cuda_device_supported(index)
        route = "fusekit kernels" if decide("auto", "cuda", supported) == "fusekit" else \
            "PyTorch's implementations in fusekit.torch (fusekit.* raises UnsupportedError)"
        lines.append(f"GPU {index}: {_C.describe_cuda_device(index)}: {route}")
        for family in _FAMILIES:
            lines.append(f"  {family:<22} {'kernels' if supported else 'no kernels'}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
