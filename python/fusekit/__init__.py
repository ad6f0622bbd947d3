"""fusekit: fused forward/backward CUDA kernels for transformer training.

Two layers:

* ``fusekit`` itself (the extension ``fusekit._C``): the C++ API one to one, same function and
  argument names. Ops take arrays from any framework that speaks DLPack or the buffer protocol
  (NumPy, PyTorch, CuPy, JAX) without copies; the caller allocates outputs and workspace, as in
  C++. CPU arrays run the float64 CPU reference backend, CUDA arrays the kernels. ``stream=None``
  uses the current stream of the framework owning the CUDA arrays when it publishes one through
  the DLPack C exchange API (PyTorch >= 2.10), otherwise the legacy default stream; pass
  ``stream=`` an int holding a ``cudaStream_t`` to choose (CuPy: ``cupy.cuda.get_current_stream().ptr``).
* ``fusekit.torch``: PyTorch custom ops (autograd, torch.compile, CUDA graphs) and nn.Module
  drop-ins. Imported on demand so that PyTorch stays optional.

Errors are ``fusekit.Error`` subclasses carrying the C++ message and its parts (``op``,
``argument``, ``expected``, ``got``): ``InvalidArgumentError`` (also a ``ValueError``),
``UnsupportedError`` and ``CudaError`` (also ``RuntimeError``s).
"""
from . import _C

# Every public name of the extension (exceptions, DType, runtime queries, and each op family's
# functions as python/src/bind_<family>.cpp defines them) is fusekit.<name>.
__all__ = sorted(name for name in vars(_C) if not name.startswith("_"))
globals().update({name: getattr(_C, name) for name in __all__})

__version__ = _C.version()
