"""Linear + bias + activation as PyTorch custom ops (torch.ops.fusekit.*) with an autograd formula
and fake implementations, the functional form, and fusekit.torch.Linear: torch.nn.Linear with a
fused activation (same parameters and state_dict keys). The gated linear (a gated MLP's gate and up
projections and its gated activation in one op) likewise, with fusekit.torch.GatedLinear.

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

Gated linear ops (y = act(gate) * up with [gate, up] = x W^T + b):
  gated_linear_fwd(x, weight, bias?, activation, layout, save_pre_activation) -> (y, pre_activation)
      (pre_activation = x W^T + b, (..., 2F), empty (shape (0,)) unless save_pre_activation)
  gated_linear_bwd(dy, x, weight, pre_activation, activation, layout, need_dx, need_dweight,
                   need_dbias) -> (dx, dweight, dbias)    (as linear_bwd's)
weight is (2F, K) and bias (2F), their rows in `layout`'s order ('interleaved': gate row j at 2j,
up row j at 2j + 1, what fusekit's fused GEMM epilogue reads; 'halves': the F gate rows, then the F
up rows, as a fused gate_up_proj stores them); y and dy are (..., F). Activations: silu (SwiGLU),
gelu_tanh, gelu_erf (GeGLU), relu (ReGLU).
"""
from __future__ import annotations

import math
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
from .gated_act import _layout_name, _pytorch_gated, _split


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


# ---- gated linear: implementations shared by the custom ops and the eager path ----------------
@names_allocation_failure("gated_linear_forward")
def _gated_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, layout: str,
                   save_pre: bool) -> Tuple[Tensor, Optional[Tensor]]:
    return _C._gated_linear_forward_alloc(x, weight, bias, activation, layout, save_pre)


@names_allocation_failure("gated_linear_backward")
def _gated_backward(dy: Tensor, x: Tensor, weight: Tensor, pre: Tensor, activation: str, layout: str,
                    need_dx: bool, need_dweight: bool, need_dbias: bool):
    """(dx, dweight, dbias), None where not asked for."""
    if not (need_dx or need_dweight or need_dbias):
        return None, None, None
    return _C._gated_linear_backward_alloc(dy, x, weight, pre, activation, layout, need_dx, need_dweight,
                                           need_dbias)


# ---- gated linear: custom ops ----------------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::gated_linear_fwd", mutates_args=())
def gated_linear_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, layout: str,
                     save_pre_activation: bool) -> Tuple[Tensor, Tensor]:
    y, pre = _gated_forward(x, weight, bias, activation, layout, save_pre_activation)
    return y, or_empty(pre, x.dtype, x.device)


@gated_linear_fwd.register_fake
def _(x, weight, bias, activation, layout, save_pre_activation):
    lead = x.shape[:-1]
    y = x.new_empty(lead + (weight.shape[0] // 2,))
    pre = x.new_empty(lead + (weight.shape[0],)) if save_pre_activation else empty_output(x.dtype, x.device)
    return y, pre


@torch.library.custom_op(f"{NAMESPACE}::gated_linear_bwd", mutates_args=())
def gated_linear_bwd(dy: Tensor, x: Tensor, weight: Tensor, pre_activation: Tensor, activation: str,
                     layout: str, need_dx: bool, need_dweight: bool,
                     need_dbias: bool) -> Tuple[Tensor, Tensor, Tensor]:
    dx, dweight, dbias = _gated_backward(dy, x, weight, pre_activation, activation, layout, need_dx,
                                         need_dweight, need_dbias)
    return (or_empty(dx, x.dtype, x.device), or_empty(dweight, x.dtype, x.device),
            or_empty(dbias, x.dtype, x.device))


@gated_linear_bwd.register_fake
def _(dy, x, weight, pre_activation, activation, layout, need_dx, need_dweight, need_dbias):
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if need_dx else \
        empty_output(x.dtype, x.device)
    dweight = _new_dweight(weight) if need_dweight else empty_output(x.dtype, x.device)
    dbias = x.new_empty(weight.shape[0] if need_dbias else 0)
    return dx, dweight, dbias


def _gated_setup(ctx, inputs, output):
    x, weight, bias, activation, layout, save_pre = inputs
    _y, pre = output
    ctx.mark_non_differentiable(pre)
    # bias is kept for a call that saved no pre-activation: its backward computes it again.
    ctx.save_for_backward(x, weight, bias, pre if save_pre else None)
    ctx.config = (activation, layout)


def _gated_autograd_backward(ctx, dy, _dpre):
    x, weight, bias, pre = ctx.saved_tensors
    need_dx, need_dweight, need_dbias = ctx.needs_input_grad[:3]
    if dy is None or not (need_dx or need_dweight or need_dbias):
        return None, None, None, None, None, None
    if pre is None:
        pre = gated_linear_fwd(x, weight, bias, *ctx.config, True)[1]
    dx, dweight, dbias = gated_linear_bwd(dy, x, weight, pre, *ctx.config, need_dx, need_dweight, need_dbias)
    return (dx if need_dx else None, dweight if need_dweight else None,
            dbias if need_dbias else None, None, None, None)


gated_linear_fwd.register_autograd(_gated_autograd_backward, setup_context=_gated_setup)

#: Under torch.autocast x, weight and bias go in the autocast dtype, as with the F.linear it replaces.
GATED_AUTOCAST = AutocastRule((0, 1, 2), cuda=LOWER, cpu=LOWER)
GATED_AUTOCAST.register(gated_linear_fwd)


class _GatedLinearFunction(torch.autograd.Function):
    """The eager path with gradients: the same implementation functions as the custom ops."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation, layout):
        y, pre = _gated_forward(x, weight, bias, activation, layout, True)
        ctx.save_for_backward(x, weight, pre)
        ctx.state = (activation, layout, bias is not None)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, pre = ctx.saved_tensors
        activation, layout, has_bias = ctx.state
        need_dx, need_dweight, need_dbias = ctx.needs_input_grad[:3]
        dx, dweight, dbias = _gated_backward(dy, x, weight, pre, activation, layout, need_dx, need_dweight,
                                             need_dbias and has_bias)
        return dx, dweight, dbias, None, None


_apply_gated = function_apply(_GatedLinearFunction)


# ---- gated linear: functional form and module -------------------------------------------------------
def gated_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation="silu",
                 layout="interleaved") -> Tensor:
    """act(gate) * up with [gate, up] = torch.nn.functional.linear(x, weight, bias) split by `layout`,
    in one fused op: x (..., K), weight (2F, K), bias (2F) or None; returns (..., F).

    layout: 'interleaved' (gate row j of weight at 2j, up row j at 2j + 1: the layout of fusekit's
    fused GEMM epilogue) or 'halves' (the F gate rows, then the F up rows, as a fused gate_up_proj
    stores them: torch.cat((gate_proj.weight, up_proj.weight))), a str or a fusekit.GatedLayout.
    activation: 'silu' (SwiGLU), 'gelu_tanh' or 'gelu_erf' (GeGLU), 'relu' (ReGLU), or a
    fusekit.Activation. The pre-activation x W^T + b is kept for the backward when it needs it.
    """
    name = activation_name("gated_linear_forward", activation)
    layout = _layout_name("gated_linear_forward", layout)
    if not _fallback.all_fusekit and _fallback.use_pytorch("gated_linear", x):
        gate, up = _split(torch.nn.functional.linear(x, weight, bias), layout, "gated_linear_forward")
        return _pytorch_gated("gated_linear_forward", gate, up, name)
    mode = eager_mode(x, weight, bias)
    if mode != CUSTOM_OP and autocast_active():
        x, weight, bias = GATED_AUTOCAST.eager(x, weight, bias)
    if mode == RECORD:
        return _apply_gated(x, weight, bias, name, layout)
    if mode == NO_GRAD:
        return _gated_forward(x, weight, bias, name, layout, False)[0]
    reject_dtensors("gated_linear", x=x, weight=weight, bias=bias)
    y, _ = gated_linear_fwd(x, weight, bias, name, layout, _records_grad(x, weight, bias))
    return y


class GatedLinear(torch.nn.Module):
    """A gated MLP's gate and up projections with the gated activation fused:
    y = act(gate) * up with [gate, up] = x W^T + b, as one (2 * out_features, in_features) weight
    whose rows `layout` orders (see gated_linear) and an optional (2 * out_features) bias. The
    parameters start as torch.nn.Linear(in_features, 2 * out_features) starts them. activation:
    'silu' (SwiGLU), 'gelu_tanh' or 'gelu_erf' (GeGLU), 'relu' (ReGLU)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation="silu",
                 layout="interleaved", device=None, dtype=None) -> None:
        super().__init__()
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.activation = activation_name("GatedLinear", activation)
        self.layout = _layout_name("GatedLinear", layout)
        factory = dict(device=device, dtype=dtype)
        self.weight = torch.nn.Parameter(torch.empty(2 * self.out_features, self.in_features, **factory))
        self.bias = torch.nn.Parameter(torch.empty(2 * self.out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # torch.nn.Linear's distribution: uniform in +-1/sqrt(fan_in) for the weight and the bias.
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
        torch.nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        return gated_linear(x, self.weight, self.bias, self.activation, self.layout)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, activation={self.activation}, layout={self.layout}")
