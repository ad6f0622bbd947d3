"""What every fusekit.torch op family shares: the custom-op namespace, the choice between the
custom op and the eager path, and the registry of nn.Module drop-ins."""
from __future__ import annotations

import functools
import math
import re
import sys
from typing import Dict, Optional, Sequence, Type

import torch

from .. import _C

# fusekit._C reads PyTorch tensors through the DLPack C exchange table (PyTorch >= 2.10): no
# Python-level work per tensor, outputs and scratch memory allocated from C++ through PyTorch's
# allocator, and PyTorch's current CUDA stream (stream=None). The host-overhead budget rests on it
# (python/benchmarks/overhead.py).
if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
    raise ImportError(f"fusekit.torch needs PyTorch 2.10 or later (the DLPack C exchange table); "
                      f"this is PyTorch {torch.__version__}. fusekit's own functions (fusekit.*) "
                      "take its tensors through __dlpack__().")

#: torch.library namespace of every fusekit op: torch.ops.fusekit.<name>.
NAMESPACE = "fusekit"

# ---- custom op or eager path -------------------------------------------------------------------
# Every op is a registered custom op (torch.ops.fusekit.*), which is what torch.compile/dynamo,
# torch.export/make_fx and other dispatch modes, FakeTensor and other subclasses, and torch.func
# transforms see. A call through torch.ops costs tens of microseconds of host time (dispatcher ->
# Python autograd kernel -> dispatcher -> Python backend kernel), more than the 10 us budget over
# the direct C++ call (python/benchmarks/overhead.py), so plain eager calls on real tensors skip
# the dispatcher: a torch.autograd.Function when gradients are recorded, the C++ call directly
# otherwise. Both routes run the same implementation functions.
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_dispatch_stack_len = torch._C._len_torch_dispatch_stack
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled

#: The modes eager_mode() returns.
CUSTOM_OP, RECORD, NO_GRAD = 0, 1, 2


def eager_mode(x: torch.Tensor, a: Optional[torch.Tensor] = None,
               b: Optional[torch.Tensor] = None, c: Optional[torch.Tensor] = None) -> int:
    """How a call on x (and the optional tensors a, b, c) runs: CUSTOM_OP (tracing, dispatch
    modes, transforms, subclasses), RECORD (eager, an input requires grad under grad mode: the
    autograd.Function) or NO_GRAD (eager, nothing to record: the C++ call directly). One function
    for the decision, as it is paid on every call."""
    if _is_compiling() or type(x) not in _PLAIN_TENSOR_TYPES or _dispatch_stack_len() \
            or _functorch_active():
        return CUSTOM_OP
    if _grad_enabled() and (x.requires_grad or (a is not None and a.requires_grad)
                            or (b is not None and b.requires_grad)
                            or (c is not None and c.requires_grad)):
        return RECORD
    return NO_GRAD


# ---- torch.autocast ----------------------------------------------------------------------------
# Under torch.autocast an op casts its floating inputs as PyTorch's counterpart does, on both
# routes: the custom op through an Autocast kernel (what tracing and dispatch modes see), the eager
# path through the same AutocastRule before its C++ call. Policies:
LOWER = "lower"      #: to the autocast dtype, as F.linear and scaled_dot_product_attention
FP32 = "fp32"        #: to float32, as F.layer_norm on CUDA
PROMOTE = "promote"  #: to their common dtype, as elementwise PyTorch ops (x + residual)
KEEP = "keep"        #: as they come, as ops PyTorch's autocast lists do not name (rms_norm)

#: Whether torch.autocast is on for any device: one C call (no Python frame), paid by every eager
#: call.
autocast_active = torch._C._is_any_autocast_enabled
_AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU) | \
    torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA)
_autocast_library = torch.library.Library(NAMESPACE, "FRAGMENT")


def _castable(t, device_type: str) -> bool:
    """What autocast casts: floating tensors on its device, float64 excepted (as PyTorch)."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and \
        t.device.type == device_type and t.dtype is not torch.float64


class AutocastRule:
    """How an op's floating arguments are cast under torch.autocast.

    inputs: the argument positions the policy applies to (per device type: cuda, cpu); params:
    positions of per-feature parameters (a norm's weight and bias, a bias added to x), kept when
    float32 or the first input's dtype after the cast (the ops take both) and cast to that dtype
    otherwise. Non-floating and float64 tensors, None and non-tensor arguments pass unchanged."""

    def __init__(self, inputs: Sequence[int], cuda: str, cpu: str, params: Sequence[int] = ()):
        self.inputs, self.params = tuple(inputs), tuple(params)
        self.policy = {"cuda": cuda, "cpu": cpu}

    def cast(self, device_type: str, args: Sequence) -> list:
        """args (the op's arguments or a leading part of them) as autocast on `device_type`
        hands them to the op."""
        args = list(args)
        policy = self.policy.get(device_type, KEEP)
        inputs = [i for i in self.inputs if i < len(args) and _castable(args[i], device_type)]
        target = None
        if policy == LOWER:
            target = torch.get_autocast_dtype(device_type)
        elif policy == FP32:
            target = torch.float32
        elif policy == PROMOTE and inputs:
            target = functools.reduce(torch.promote_types, (args[i].dtype for i in inputs))
        if target is not None:
            for i in inputs:
                if args[i].dtype != target:
                    args[i] = args[i].to(target)
        if inputs and self.params:
            like = args[inputs[0]].dtype
            for i in self.params:
                t = args[i] if i < len(args) else None
                if _castable(t, device_type) and t.dtype != like and t.dtype != torch.float32:
                    args[i] = t.to(like)
        return args

    def eager(self, *tensors):
        """The eager path's cast of the op's leading arguments (the first one's device decides);
        callers check autocast_active() first, so that nothing is paid outside autocast."""
        device_type = tensors[0].device.type
        if not torch.is_autocast_enabled(device_type):
            return tensors
        return self.cast(device_type, tensors)

    def register(self, op) -> None:
        """Registers the rule as `op`'s AutocastCUDA and AutocastCPU kernels (`op` a custom op of
        the fusekit namespace): cast, then run the op with autocast excluded, as
        torch.library.register_autocast does for a fixed dtype."""
        overload = op._opoverload
        name = op._qualname.split("::", 1)[1]
        for key, device_type in (("AutocastCUDA", "cuda"), ("AutocastCPU", "cpu")):
            def kernel(_keyset, *args, _device_type=device_type):
                args = self.cast(_device_type, args)
                with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
                    return overload(*args)

            _autocast_library.impl(name, kernel, key, with_keyset=True)


def function_apply(function_class):
    """`function_class.apply` without the Python-level preamble of torch.autograd.Function.apply
    (argument binding for setup_context and functorch dead-wrapper unwrapping: neither applies on
    the eager path, which excludes functorch transforms). Falls back to .apply when this PyTorch
    lays the class out differently."""
    base_apply = getattr(torch._C, "_FunctionBase", None)
    base_apply = base_apply.__dict__.get("apply") if base_apply is not None else None
    if base_apply is None or not hasattr(base_apply, "__get__") or \
            "setup_context" in function_class.__dict__:
        return function_class.apply
    return base_apply.__get__(None, function_class)


def normalized_numel(normalized_shape: Sequence[int]) -> int:
    return math.prod(normalized_shape)


def invalid_argument(op: str, argument: str, expected: str, got: str) -> _C.InvalidArgumentError:
    """An InvalidArgumentError worded like the C++ ones, for checks made on the Python side."""
    e = _C.InvalidArgumentError(f"fusekit.{op}: argument '{argument}': expected {expected}, got {got}")
    e.op, e.argument, e.expected, e.got, e.kind = op, argument, expected, got, "invalid_argument"
    return e


class OutOfMemoryError(torch.OutOfMemoryError):
    """PyTorch's allocator could not serve an output or scratch tensor a fusekit op allocates on
    the Python side. A torch.OutOfMemoryError (code that catches PyTorch's keeps working) whose
    message names the op and the size PyTorch was asked for; `op` holds the op's name. The
    failed allocation leaves nothing behind: the process stays usable (free memory, then retry)."""

    op: str = ""


def names_allocation_failure(op: str):
    """Decorates an op's implementation so that an allocation PyTorch cannot serve raises
    OutOfMemoryError naming `op` (fusekit._C's own allocations already name theirs)."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except OutOfMemoryError:
                raise
            except torch.OutOfMemoryError as e:
                detail = str(e)
                asked = re.search(r"Tried to allocate ([0-9.]+ [KMGTP]?i?B)", detail)
                err = OutOfMemoryError(
                    f"fusekit.{op}: could not allocate its outputs through PyTorch's allocator"
                    + (f" ({asked.group(1)} asked for)" if asked else "") + f": {detail}")
                err.op = op
                raise err from e

        return wrapper

    return decorate


class DTensorInputError(_C.InvalidArgumentError):
    """A fusekit.torch op got a DTensor (torch.distributed.tensor, as tensor parallelism hands
    modules): fusekit's ops compute on local tensors and register no sharding rules. `op` and
    `argument` name the call and the argument. FSDP2 (fully_shard) is unaffected: the modules it
    wraps see local, unsharded parameters in their forward."""


def _dtensor_class():
    """torch.distributed.tensor.DTensor where that module has been imported (no DTensor can exist
    before), else None: fusekit.torch does not import torch.distributed itself."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def reject_dtensors(op: str, **tensors) -> None:
    """Raises DTensorInputError for the first of `tensors` (argument name -> tensor or None) that
    is a DTensor. The functional forms call it on their custom-op route, which every tensor
    subclass takes, so plain tensors on the eager path pay nothing; a DTensor beside a plain first
    argument reaches fusekit._C, whose check names the argument (no data pointer)."""
    dtensor = _dtensor_class()
    if dtensor is None:
        return
    for argument, t in tensors.items():
        if isinstance(t, dtensor):
            placements = ", ".join(str(p) for p in t.placements)
            e = DTensorInputError(
                f"fusekit.{op}: argument '{argument}': DTensor inputs are not supported (tensor "
                f"parallelism): got a DTensor with placements ({placements}) on a mesh of shape "
                f"{tuple(t.device_mesh.shape)}; pass local tensors (DTensor.to_local())")
            e.op, e.argument, e.expected, e.got, e.kind = \
                op, argument, "a local tensor", "a DTensor", "invalid_argument"
            raise e


def argument_type_error(op: str, argument: str, expected: str, value) -> _C.ArgumentTypeError:
    """An ArgumentTypeError worded like fusekit._C's: `argument` must be `expected`, not the type of
    `value`."""
    got = type(value).__name__ if type(value).__module__ == "builtins" else \
        f"{type(value).__module__}.{type(value).__qualname__}"
    e = _C.ArgumentTypeError(f"fusekit.{op}: argument '{argument}' must be {expected}, not {got}")
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
    raise argument_type_error(op, "activation", "fusekit.Activation or str", activation)


#: Philox seeds and offsets go to fusekit._C as `value & U64_MASK`: unsigned 64-bit integers.
U64_MASK = (1 << 64) - 1


def draw_seed() -> int:
    """A fresh dropout seed from PyTorch's CPU generator (torch.manual_seed reproduces it)."""
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64).item())


def seed_tensor(seed: Optional[int], draw: bool) -> torch.Tensor:
    """A dropout seed as the custom ops take it: a 0-d int64 CPU tensor (the 64 bits of the
    unsigned seed). seed=None: a fresh one from PyTorch's CPU generator when `draw`, drawn by an op
    that whatever traces the call records (under torch.compile an op of the graph: a new seed every
    run, no .item() and so no graph break), else 0. The ops read it on the host, which costs no
    device synchronization."""
    if seed is None:
        if draw:
            return torch.randint(0, 2**63 - 1, (), dtype=torch.int64)
        return torch.zeros((), dtype=torch.int64)
    value = int(seed) & U64_MASK
    return torch.tensor(value - (1 << 64) if value >> 63 else value, dtype=torch.int64)


def seed_value(seed) -> int:
    """The unsigned 64-bit seed of an int or of a seed_tensor."""
    return int(seed) & U64_MASK


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
# forward only, so patch() can retarget existing modules in place.
DROP_INS: Dict[Type[torch.nn.Module], Type[torch.nn.Module]] = {}


def register_drop_in(torch_class: Type[torch.nn.Module]):
    def decorate(fusekit_class):
        if not issubclass(fusekit_class, torch_class):
            raise TypeError(f"{fusekit_class.__name__} must subclass {torch_class.__name__}")
        DROP_INS[torch_class] = fusekit_class
        return fusekit_class

    return decorate
