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
``UnsupportedError`` and ``CudaError`` (also ``RuntimeError``s). Every argument is named in its
error, scalars included, as PyTorch's argument parser does: a value of the wrong Python type
(``None``, a ``str``, a float where an int goes, a bool where a number goes, an int where a bool
goes) raises ``ArgumentTypeError``, a ``TypeError`` and an ``InvalidArgumentError``:
``fusekit.layer_norm_forward: argument 'eps' must be float, not NoneType`` (``expected`` holds the
type taken, ``got`` the type given). A value of the right type that the C++ parameter cannot hold
(an int past int64 or int32, a negative seed, a float beyond float32's range, an unknown option
name) raises ``InvalidArgumentError``: ``argument 'seed': expected an int in [0, 2^64), got -1``.
NumPy scalars (``np.float32``, ``np.int64``, ``np.bool_``, ...) are accepted as the Python numbers
they hold, and an int where a float goes.
"""
from . import _C

# Every public name of the extension (exceptions, DType, runtime queries, and each op family's
# functions as python/src/bind_<family>.cpp defines them) is fusekit.<name>.
__all__ = sorted(name for name in vars(_C) if not name.startswith("_"))
globals().update({name: getattr(_C, name) for name in __all__})

__version__ = _C.version()
