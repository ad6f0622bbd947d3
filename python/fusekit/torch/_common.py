"""What every fusekit.torch op family shares: the custom-op namespace, dtype mapping, the stream
handed to the C++ call, workspace allocation, and the registry of nn.Module drop-ins."""
from __future__ import annotations

import math
import os
from typing import Dict, Optional, Sequence, Type

import torch

from .. import _C

#: torch.library namespace of every fusekit op: torch.ops.fusekit.<name>.
NAMESPACE = "fusekit"

TORCH_TO_FUSEKIT_DTYPE = {
    torch.float32: _C.DType.f32,
    torch.float16: _C.DType.f16,
    torch.bfloat16: _C.DType.bf16,
    torch.float64: _C.DType.f64,
    torch.uint8: _C.DType.u8,
    torch.int32: _C.DType.i32,
    torch.int64: _C.DType.i64,
}
if hasattr(torch, "float8_e4m3fn"):
    TORCH_TO_FUSEKIT_DTYPE[torch.float8_e4m3fn] = _C.DType.f8e4m3
    TORCH_TO_FUSEKIT_DTYPE[torch.float8_e5m2] = _C.DType.f8e5m2

# PyTorch >= 2.10 publishes the DLPack C exchange table on torch.Tensor: fusekit._C then reads
# tensors without Python-level work and asks PyTorch itself for the current CUDA stream
# (stream=None). Older versions go through __dlpack__() and get the stream passed explicitly.
# FUSEKIT_DLPACK_EXCHANGE=0 turns the table off (fusekit._C reads the same variable).
FAST_EXCHANGE = (hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
                 and os.environ.get("FUSEKIT_DLPACK_EXCHANGE", "1") != "0")


def exportable(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A tensor __dlpack__() agrees to export: without the exchange table, PyTorch refuses tensors
    that require grad (inside autograd.Function.forward they still do)."""
    return t if FAST_EXCHANGE or t is None or not t.requires_grad else t.detach()


# ---- eager fast path ---------------------------------------------------------------------------
# A call through torch.ops goes dispatcher -> Python autograd kernel -> dispatcher -> Python
# backend kernel, tens of microseconds of host time. In plain eager mode (real tensors, nothing
# tracing) the functional forms and modules skip the dispatcher: torch.autograd.Function when
# gradients are recorded, the C++ call directly otherwise. Whenever anything may be tracing or
# transforming (torch.compile/dynamo, torch.export/make_fx and other dispatch modes, FakeTensor and
# other subclasses, torch.func transforms) they call the registered custom op instead, so the graph
# sees torch.ops.fusekit.*. Both paths compute the same thing with the same C++ entry points.
# FUSEKIT_TORCH_EAGER=op (or set_eager_fast_path(False)) always takes the custom op.
# python/benchmarks/overhead.py measures what each path costs over the bare C++ call.
_eager_fast_path = os.environ.get("FUSEKIT_TORCH_EAGER", "fast") != "op"
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_dispatch_stack_len = torch._C._len_torch_dispatch_stack
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled

#: The modes eager_mode() returns.
CUSTOM_OP, RECORD, NO_GRAD = 0, 1, 2

#: The `workspace` argument of the C++ calls on real tensors: 'auto' lets fusekit._C take the
#: scratch memory from PyTorch's caching allocator itself (query and allocation in C++, on the
#: current stream, freed when the call returns), which the DLPack exchange table allows.
#: Without the table, callers ask the *_workspace_size query and allocate (workspace()).
AUTO_WORKSPACE = "auto" if FAST_EXCHANGE else None


def set_eager_fast_path(enabled: bool) -> None:
    """Whether eager calls bypass the torch.ops dispatcher (default True)."""
    global _eager_fast_path
    _eager_fast_path = bool(enabled)


def eager_fast_path(x: torch.Tensor) -> bool:
    """True when a call on `x` may skip the custom op (see above)."""
    return (_eager_fast_path and not _is_compiling()
            and type(x) in _PLAIN_TENSOR_TYPES
            and _dispatch_stack_len() == 0
            and not _functorch_active())


def eager_mode(x: torch.Tensor, a: Optional[torch.Tensor] = None,
               b: Optional[torch.Tensor] = None, c: Optional[torch.Tensor] = None) -> int:
    """How a call on x (and the optional tensors a, b, c) runs: CUSTOM_OP (tracing, transforms,
    subclasses, or the fast path turned off), RECORD (eager, an input requires grad under grad
    mode: the autograd.Function) or NO_GRAD (eager, nothing to record: the C++ call directly).
    One function for the decision, as it is paid on every call."""
    if not _eager_fast_path or _is_compiling() or type(x) not in _PLAIN_TENSOR_TYPES \
            or _dispatch_stack_len() or _functorch_active():
        return CUSTOM_OP
    if _grad_enabled() and (x.requires_grad or (a is not None and a.requires_grad)
                            or (b is not None and b.requires_grad)
                            or (c is not None and c.requires_grad)):
        return RECORD
    return NO_GRAD


def function_apply(function_class):
    """`function_class.apply` without the Python-level preamble of torch.autograd.Function.apply
    (argument binding for setup_context and functorch dead-wrapper unwrapping: neither applies on
    the eager fast path, which excludes functorch transforms). Falls back to .apply when this
    PyTorch lays the class out differently."""
    base_apply = getattr(torch._C, "_FunctionBase", None)
    base_apply = base_apply.__dict__.get("apply") if base_apply is not None else None
    if base_apply is None or not hasattr(base_apply, "__get__") or \
            "setup_context" in function_class.__dict__:
        return function_class.apply
    return base_apply.__get__(None, function_class)


def stream_for(t: torch.Tensor) -> Optional[int]:
    """The `stream` argument of a fusekit._C call on tensors like `t`: PyTorch's current stream
    of t's device."""
    if FAST_EXCHANGE or t.device.type != "cuda":
        return None
    return torch.cuda.current_stream(t.device).cuda_stream


def device_string(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return device.type


def workspace(nbytes: int, device: torch.device) -> Optional[torch.Tensor]:
    """Scratch memory from PyTorch's allocator (stream-ordered, CUDA-graph safe; 16-byte aligned
    as fusekit requires)."""
    if nbytes <= 0:
        return None
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def normalized_numel(normalized_shape: Sequence[int]) -> int:
    return math.prod(normalized_shape)


def invalid_argument(op: str, argument: str, expected: str, got: str) -> _C.InvalidArgumentError:
    """An InvalidArgumentError worded like the C++ ones, for checks made on the Python side."""
    e = _C.InvalidArgumentError(f"fusekit.{op}: argument '{argument}': expected {expected}, got {got}")
    e.op, e.argument, e.expected, e.got, e.kind = op, argument, expected, got, "invalid_argument"
    return e


def activation_name(op: str, activation) -> str:
    """A fusekit.Activation or its name -> the name (custom-op schemas carry it as a str); `op`
    names the function in the error for anything else."""
    if type(activation) is str:
        return activation
    if isinstance(activation, _C.Activation):
        return activation.name
    if isinstance(activation, str):
        return activation
    raise invalid_argument(op, "activation", "fusekit.Activation or an activation name",
                           type(activation).__name__)


#: Philox seeds and offsets go to fusekit._C as `value & U64_MASK`: unsigned 64-bit integers.
U64_MASK = (1 << 64) - 1


def empty_output(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What a custom op returns in place of an output not asked for: an empty tensor, shape (0,)."""
    return torch.empty(0, dtype=dtype, device=device)


def or_empty(t: Optional[torch.Tensor], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """t, or empty_output(dtype, device) when t is None."""
    return t if t is not None else empty_output(dtype, device)


# ---- nn.Module drop-ins ----------------------------------------------------------------------
# Each family registers its drop-ins here: PyTorch class -> fusekit class. The fusekit class
# subclasses the PyTorch one (same constructor, parameters and state_dict keys) and overrides
# forward only, so swap_modules() can retarget existing modules in place.
DROP_INS: Dict[Type[torch.nn.Module], Type[torch.nn.Module]] = {}


def register_drop_in(torch_class: Type[torch.nn.Module]):
    def decorate(fusekit_class):
        if not issubclass(fusekit_class, torch_class):
            raise TypeError(f"{fusekit_class.__name__} must subclass {torch_class.__name__}")
        DROP_INS[torch_class] = fusekit_class
        return fusekit_class

    return decorate


def swap_modules(model: torch.nn.Module) -> int:
    """Turns every module of `model` whose exact class has a fusekit drop-in into that drop-in,
    in place (parameters, buffers and hooks are kept). Returns how many were swapped."""
    swapped = 0
    for module in model.modules():
        target = DROP_INS.get(type(module))
        if target is not None:
            module.__class__ = target
            swapped += 1
    return swapped
