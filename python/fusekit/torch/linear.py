"""Linear + bias + activation as PyTorch custom ops (torch.ops.fusekit.*) with an autograd formula
and fake implementations, the functional form, and fusekit.torch.Linear: torch.nn.Linear with a
fused activation (same parameters and state_dict keys).

Ops (all return fresh tensors; nothing is mutated):
  linear_fwd(x, weight, bias?, activation, save_pre_activation) -> (y, pre_activation)
      (pre_activation = x W^T + b, empty (shape (0,)) unless save_pre_activation)
  linear_bwd(dout, x, weight, pre_activation?, activation, need_dx, need_dweight, need_dbias)
      -> (dx, dweight, dbias)    (a gradient not asked for comes back empty, shape (0,))
x is (..., K), weight (N, K), bias (N), all one dtype (float32, float16 or bfloat16; float64 on the
CPU). Activations: none, relu, gelu_erf, gelu_tanh, squared_relu, silu (include/fusekit/linear.h).

A weight stored as (K, N) (Hugging Face's Conv1D) goes in as its transposed view weight.t(): fusekit's
linear reads it in place (a column-major weight, include/fusekit/linear.h), and dweight comes back in
the same layout, so that the (K, N) parameter's gradient is a plain transpose.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _C
from . import _fallback
from ._common import (
    reject_dtensors,
    names_allocation_failure,
    CUSTOM_OP,
    LOWER,
    NAMESPACE,
    NO_GRAD,
    RECORD,
    AutocastRule,
    activation_name,
    autocast_active,
    eager_mode,
    empty_output,
    function_apply,
    or_empty,
)


def _transposed(weight: Tensor) -> bool:
    """weight (N, K) is the transposed view of a (K, N) row-major matrix (N contiguous)."""
    return weight.dim() == 2 and weight.shape[0] > 1 and weight.stride(0) == 1 and \
        weight.stride(1) >= weight.shape[0]


def _new_dweight(weight: Tensor) -> Tensor:
    """dweight as fusekit._C allocates it: a transposed weight's layout, else contiguous (N, K)."""
    if _transposed(weight):
        return weight.new_empty((weight.shape[1], weight.shape[0])).t()
    return torch.empty_like(weight, memory_format=torch.contiguous_format)


# ---- implementations shared by the custom ops and the eager path -------------------------------
# fusekit._C allocates the outputs, gradients and workspace through PyTorch's allocator and makes
# arguments of any layout contiguous, in the same call.
@names_allocation_failure("linear_forward")
def _forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str,
             save_pre: bool) -> Tuple[Tensor, Optional[Tensor]]:
    return _C._linear_forward_alloc(x, weight, bias, activation, save_pre)


@names_allocation_failure("linear_backward")
def _backward(dout: Tensor, x: Tensor, weight: Tensor, pre: Optional[Tensor], activation: str,
              need_dx: bool, need_dweight: bool, need_dbias: bool):
    """(dx, dweight, dbias), None where not asked for."""
    if not (need_dx or need_dweight or need_dbias):
        return None, None, None
    return _C._linear_backward_alloc(dout, x, weight, pre, activation, need_dx, need_dweight,
                                     need_dbias)


# ---- custom ops --------------------------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::linear_fwd", mutates_args=())
def linear_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str,
               save_pre_activation: bool) -> Tuple[Tensor, Tensor]:
    y, pre = _forward(x, weight, bias, activation, save_pre_activation)
    return y, or_empty(pre, x.dtype, x.device)


@linear_fwd.register_fake
def _(x, weight, bias, activation, save_pre_activation):
    out_shape = x.shape[:-1] + (weight.shape[0],)
    y = x.new_empty(out_shape)
    pre = x.new_empty(out_shape) if save_pre_activation else empty_output(x.dtype, x.device)
    return y, pre


@torch.library.custom_op(f"{NAMESPACE}::linear_bwd", mutates_args=())
def linear_bwd(dout: Tensor, x: Tensor, weight: Tensor, pre_activation: Optional[Tensor],
               activation: str, need_dx: bool, need_dweight: bool,
               need_dbias: bool) -> Tuple[Tensor, Tensor, Tensor]:
    dx, dweight, dbias = _backward(dout, x, weight, pre_activation, activation, need_dx,
                                   need_dweight, need_dbias)
    return (or_empty(dx, x.dtype, x.device), or_empty(dweight, x.dtype, x.device),
            or_empty(dbias, x.dtype, x.device))


@linear_bwd.register_fake
def _(dout, x, weight, pre_activation, activation, need_dx, need_dweight, need_dbias):
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if need_dx else \
        empty_output(x.dtype, x.device)
    dweight = _new_dweight(weight) if need_dweight else empty_output(x.dtype, x.device)
    dbias = x.new_empty(weight.shape[0] if need_dbias else 0)
    return dx, dweight, dbias


def _setup(ctx, inputs, output):
    x, weight, bias, activation, save_pre = inputs
    _y, pre = output
    ctx.mark_non_differentiable(pre)
    ctx.save_for_backward(x, weight, pre if save_pre else None)
    ctx.activation = activation
    ctx.has_bias = bias is not None


def _autograd_backward(ctx, dout, _dpre):
    x, weight, pre = ctx.saved_tensors
    need_dx, need_dweight, need_dbias = ctx.needs_input_grad[:3]
    need_dbias = need_dbias and ctx.has_bias
    if dout is None or not (need_dx or need_dweight or need_dbias):
        return None, None, None, None, None
    dx, dweight, dbias = linear_bwd(dout, x, weight, pre, ctx.activation, need_dx, need_dweight,
                                    need_dbias)
    return (dx if need_dx else None, dweight if need_dweight else None,
            dbias if need_dbias else None, None, None)


linear_fwd.register_autograd(_autograd_backward, setup_context=_setup)

#: Under torch.autocast x, weight and bias go in the autocast dtype, as with F.linear.
AUTOCAST = AutocastRule((0, 1, 2), cuda=LOWER, cpu=LOWER)
AUTOCAST.register(linear_fwd)


class _LinearFunction(torch.autograd.Function):
    """The eager path with gradients: the same implementation functions as the custom ops."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation):
        save_pre = activation != "none"
        y, pre = _forward(x, weight, bias, activation, save_pre)
        ctx.save_for_backward(x, weight, pre)
        ctx.state = (activation, bias is not None)  # one attribute: host time counts here
        return y

    @staticmethod
    def backward(ctx, dout):
        x, weight, pre = ctx.saved_tensors
        activation, has_bias = ctx.state
        need_dx, need_dweight, need_dbias = ctx.needs_input_grad[:3]
        dx, dweight, dbias = _backward(dout, x, weight, pre, activation, need_dx, need_dweight,
                                       need_dbias and has_bias)
        return dx, dweight, dbias, None


_apply = function_apply(_LinearFunction)


def _records_grad(*tensors: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ---- functional form and module ----------------------------------------------------------------
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation="none") -> Tensor:
    """act(torch.nn.functional.linear(x, weight, bias)) through fusekit's fused kernels."""
    name = activation_name("linear", activation)
    if not _fallback.all_fusekit and _fallback.use_pytorch("linear", x):
        return _fallback.activation(torch.nn.functional.linear(x, weight, bias), name)
    mode = eager_mode(x, weight, bias)
    if mode != CUSTOM_OP and autocast_active():
        x, weight, bias = AUTOCAST.eager(x, weight, bias)
    if mode == RECORD:
        return _apply(x, weight, bias, name)
    if mode == NO_GRAD:
        return _forward(x, weight, bias, name, False)[0]
    reject_dtensors("linear", x=x, weight=weight, bias=bias)
    # The pre-activation is only kept when a backward may need it.
    save_pre = name != "none" and _records_grad(x, weight, bias)
    y, _ = linear_fwd(x, weight, bias, name, save_pre)
    return y


class Linear(torch.nn.Linear):
    """torch.nn.Linear followed by a fused activation: y = act(x W^T + b). Same parameters and
    state_dict keys as torch.nn.Linear (load one's state_dict into the other); activation='none'
    computes exactly what torch.nn.Linear does. Not a registered drop-in: its default activation
    changes what the module computes."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 activation="gelu_tanh", device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.activation = activation_name("linear", activation)

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation}"
