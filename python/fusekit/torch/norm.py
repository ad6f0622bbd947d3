"""LayerNorm and RMSNorm as PyTorch custom ops (torch.ops.fusekit.*) with autograd formulas and
fake implementations, the functional forms, and nn.Module drop-ins for torch.nn.LayerNorm /
torch.nn.RMSNorm.

Ops (all return fresh tensors; nothing is mutated):
  layer_norm_fwd(x, weight?, bias?, eps) -> (y, mean, rstd)
  layer_norm_bwd(dy, x, weight?, mean, rstd, params_f32, need_dx, need_dweight, need_dbias)
      -> (dx, dweight, dbias)            (a gradient not asked for comes back empty, shape (0,))
  rms_norm_fwd(x, weight?, eps) -> (y, rstd)
  rms_norm_bwd(dy, x, weight?, rstd, params_f32, need_dx, need_dweight) -> (dx, dweight)
  layer_norm_residual_fwd(x, residual, weight?, bias?, eps) -> (y, sum, mean, rstd)
  layer_norm_residual_bwd(dy, sum, dsum?, weight?, mean, rstd, params_f32, need_dx, need_dweight,
                          need_dbias) -> (dx, dweight, dbias)
  rms_norm_residual_fwd(x, residual, weight?, eps) -> (y, sum, rstd)
  rms_norm_residual_bwd(dy, sum, dsum?, weight?, rstd, params_f32, need_dx, need_dweight)
      -> (dx, dweight)
x is (..., N) and normalized over its last dimension; weight/bias are (N) in x's dtype or float32;
mean/rstd are float32 with x's leading shape. The residual ops normalize sum = x + residual
(rounded to x's dtype) and return it; their dx is the gradient of both x and residual.
"""
from __future__ import annotations

import numbers
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .. import _C
from . import _fallback
from ._common import (
    reject_dtensors,
    names_allocation_failure,
    CUSTOM_OP,
    FP32,
    KEEP,
    NAMESPACE,
    NO_GRAD,
    PROMOTE,
    RECORD,
    AutocastRule,
    autocast_active,
    eager_mode,
    empty_output,
    function_apply,
    invalid_argument,
    normalized_numel,
    or_empty,
    register_drop_in,
)

_ShapeLike = Union[int, Sequence[int], torch.Size]


def _stats_like(x: Tensor) -> Tensor:
    return torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)


def _opt_contiguous(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()


def _params_f32(x: Tensor, params: Optional[Tensor]) -> bool:
    """Whether weight/bias (and so their gradients) are float32 while x is not."""
    return params is not None and params.dtype == torch.float32 and x.dtype != torch.float32


# ---- implementations of the custom ops (real tensors) ------------------------------------------
# x, dy: contiguous. mean/rstd: preallocated float32 outputs or None. workspace='auto': fusekit._C
# queries and allocates it through PyTorch's allocator.
@names_allocation_failure("layer_norm_forward")
def _layer_norm_forward(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                        mean: Optional[Tensor], rstd: Optional[Tensor]) -> Tensor:
    y = torch.empty_like(x)
    _C.layer_norm_forward(x, _opt_contiguous(weight), _opt_contiguous(bias), eps, y, mean, rstd)
    return y


@names_allocation_failure("rms_norm_forward")
def _rms_norm_forward(x: Tensor, weight: Optional[Tensor], eps: float,
                      rstd: Optional[Tensor]) -> Tensor:
    y = torch.empty_like(x)
    _C.rms_norm_forward(x, _opt_contiguous(weight), eps, y, rstd)
    return y


@names_allocation_failure("norm_backward")
def _norm_backward(kind: str, dy: Tensor, x: Tensor, weight: Optional[Tensor],
                   mean: Optional[Tensor], rstd: Tensor, params_f32: bool, need_dx: bool,
                   need_dweight: bool, need_dbias: bool):
    """(dx, dweight, dbias), None where not asked for."""
    pdtype = torch.float32 if params_f32 else x.dtype
    cols = x.shape[-1] if x.dim() else 1
    dx = torch.empty_like(x) if need_dx else None
    dweight = torch.empty(cols, dtype=pdtype, device=x.device) if need_dweight else None
    dbias = torch.empty(cols, dtype=pdtype, device=x.device) if need_dbias else None
    weight = _opt_contiguous(weight)
    if kind == "layer_norm":
        _C.layer_norm_backward(dy, x, weight, mean, rstd, dx, dweight, dbias, "auto")
    else:
        _C.rms_norm_backward(dy, x, weight, rstd, dx, dweight, "auto")
    return dx, dweight, dbias


# ---- LayerNorm custom ops ----------------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                   eps: float) -> Tuple[Tensor, Tensor, Tensor]:
    x = x.contiguous()
    mean, rstd = _stats_like(x), _stats_like(x)
    return _layer_norm_forward(x, weight, bias, eps, mean, rstd), mean, rstd


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    return y, _stats_like(x), _stats_like(x)


@torch.library.custom_op(f"{NAMESPACE}::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor,
                   params_f32: bool, need_dx: bool, need_dweight: bool,
                   need_dbias: bool) -> Tuple[Tensor, Tensor, Tensor]:
    x = x.contiguous()
    dx, dweight, dbias = _norm_backward("layer_norm", dy.contiguous(), x, weight, mean, rstd,
                                        params_f32, need_dx, need_dweight, need_dbias)
    pdtype = torch.float32 if params_f32 else x.dtype
    return (or_empty(dx, x.dtype, x.device), or_empty(dweight, pdtype, x.device),
            or_empty(dbias, pdtype, x.device))


@layer_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, params_f32, need_dx, need_dweight, need_dbias):
    pdtype = torch.float32 if params_f32 else x.dtype
    cols = x.shape[-1]
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if need_dx else \
        empty_output(x.dtype, x.device)
    dweight = x.new_empty(cols if need_dweight else 0, dtype=pdtype)
    dbias = x.new_empty(cols if need_dbias else 0, dtype=pdtype)
    return dx, dweight, dbias


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias, _eps = inputs
    _y, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.params_f32 = _params_f32(x, weight if weight is not None else bias)
    ctx.has_weight, ctx.has_bias = weight is not None, bias is not None


def _layer_norm_backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    need_dx, need_dweight, need_dbias = ctx.needs_input_grad[:3]
    need_dweight = need_dweight and ctx.has_weight
    need_dbias = need_dbias and ctx.has_bias
    if dy is None or not (need_dx or need_dweight or need_dbias):
        return None, None, None, None
    dx, dweight, dbias = layer_norm_bwd(dy, x, weight, mean, rstd, ctx.params_f32, need_dx,
                                        need_dweight, need_dbias)
    return (dx if need_dx else None, dweight if need_dweight else None,
            dbias if need_dbias else None, None)


layer_norm_fwd.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)

#: Under torch.autocast as F.layer_norm: float32 on CUDA (x, weight and bias), as they come on the
#: CPU. A weight or bias neither float32 nor x's dtype is cast to x's dtype.
LAYER_NORM_AUTOCAST = AutocastRule((0,), cuda=FP32, cpu=KEEP, params=(1, 2))
LAYER_NORM_AUTOCAST.register(layer_norm_fwd)


class _LayerNormFunction(torch.autograd.Function):
    """The eager path with gradients: the C++ calls of the custom ops, written for host time
    (python/benchmarks/overhead.py). fusekit._C allocates mean and rstd (one allocation) through
    PyTorch's allocator and hands them back as opaque capsules (no Python tensors to create), and
    takes the backward's workspace the same way ('auto'). Gradients are allocated like the
    parameters."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        x = x.contiguous()
        if weight is not None:
            weight = weight.contiguous()
        if bias is not None:
            bias = bias.contiguous()
        y = torch.empty_like(x)
        ctx.save_for_backward(x, weight)
        # (mean, rstd): intermediates, not inputs or outputs: a plain attribute suffices.
        ctx.stats = _C._layer_norm_forward_alloc(x, weight, bias, eps, y)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_dx, need_dweight, need_dbias = ctx.needs_input_grad[:3]
        dx = torch.empty_like(x) if need_dx else None
        dweight = torch.empty_like(weight) if need_dweight else None
        dbias = None
        if need_dbias:  # weight and bias share one dtype (fusekit checks it in the forward)
            dbias = torch.empty_like(weight) if weight is not None else \
                x.new_empty(x.shape[-1], dtype=ctx.bias_dtype)
        mean, rstd = ctx.stats
        _C.layer_norm_backward(dy.contiguous(), x, weight, mean, rstd, dx, dweight, dbias, "auto")
        return dx, dweight, dbias, None


# ---- RMSNorm custom ops ------------------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: Tensor, weight: Optional[Tensor], eps: float) -> Tuple[Tensor, Tensor]:
    x = x.contiguous()
    rstd = _stats_like(x)
    return _rms_norm_forward(x, weight, eps, rstd), rstd


@rms_norm_fwd.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format), _stats_like(x)


@torch.library.custom_op(f"{NAMESPACE}::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor, params_f32: bool,
                 need_dx: bool, need_dweight: bool) -> Tuple[Tensor, Tensor]:
    x = x.contiguous()
    dx, dweight, _ = _norm_backward("rms_norm", dy.contiguous(), x, weight, None, rstd,
                                    params_f32, need_dx, need_dweight, False)
    pdtype = torch.float32 if params_f32 else x.dtype
    return or_empty(dx, x.dtype, x.device), or_empty(dweight, pdtype, x.device)


@rms_norm_bwd.register_fake
def _(dy, x, weight, rstd, params_f32, need_dx, need_dweight):
    pdtype = torch.float32 if params_f32 else x.dtype
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if need_dx else \
        empty_output(x.dtype, x.device)
    return dx, x.new_empty(x.shape[-1] if need_dweight else 0, dtype=pdtype)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _eps = inputs
    _y, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)
    ctx.params_f32 = _params_f32(x, weight)
    ctx.has_weight = weight is not None


def _rms_norm_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    need_dx, need_dweight = ctx.needs_input_grad[:2]
    need_dweight = need_dweight and ctx.has_weight
    if dy is None or not (need_dx or need_dweight):
        return None, None, None
    dx, dweight = rms_norm_bwd(dy, x, weight, rstd, ctx.params_f32, need_dx, need_dweight)
    return dx if need_dx else None, dweight if need_dweight else None, None


rms_norm_fwd.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)

#: Under torch.autocast as F.rms_norm (which autocast does not cast): x as it comes, the weight
#: as float32 or x's dtype.
RMS_NORM_AUTOCAST = AutocastRule((0,), cuda=KEEP, cpu=KEEP, params=(1,))
RMS_NORM_AUTOCAST.register(rms_norm_fwd)


class _RMSNormFunction(torch.autograd.Function):
    """The eager path with gradients (see _LayerNormFunction)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x = x.contiguous()
        if weight is not None:
            weight = weight.contiguous()
        y = torch.empty_like(x)
        ctx.save_for_backward(x, weight)
        ctx.rstd = _C._rms_norm_forward_alloc(x, weight, eps, y)  # an intermediate (a capsule)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_dx, need_dweight = ctx.needs_input_grad[:2]
        dx = torch.empty_like(x) if need_dx else None
        dweight = torch.empty_like(weight) if need_dweight else None
        _C.rms_norm_backward(dy.contiguous(), x, weight, ctx.rstd, dx, dweight, "auto")
        return dx, dweight, None


_layer_norm_apply = function_apply(_LayerNormFunction)
_rms_norm_apply = function_apply(_RMSNormFunction)


# ---- residual custom ops -----------------------------------------------------------------------
def _residual_inputs(op: str, x: Tensor, residual: Tensor) -> Tuple[Tensor, Tensor]:
    if residual.shape != x.shape:  # fusekit checks it too; a clear message before any broadcast
        raise invalid_argument(op, "residual", f"shape {tuple(x.shape)} (as 'x')",
                               f"shape {tuple(residual.shape)}")
    return x.contiguous(), residual.contiguous()


@torch.library.custom_op(f"{NAMESPACE}::layer_norm_residual_fwd", mutates_args=())
def layer_norm_residual_fwd(x: Tensor, residual: Tensor, weight: Optional[Tensor],
                            bias: Optional[Tensor], eps: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    x, residual = _residual_inputs("layer_norm_residual", x, residual)
    y, total = torch.empty_like(x), torch.empty_like(x)
    mean, rstd = _stats_like(x), _stats_like(x)
    _C.layer_norm_residual_forward(x, residual, _opt_contiguous(weight), _opt_contiguous(bias), eps,
                                   y, total, mean, rstd)
    return y, total, mean, rstd


@layer_norm_residual_fwd.register_fake
def _(x, residual, weight, bias, eps):
    like = torch.empty_like(x, memory_format=torch.contiguous_format)
    return like, torch.empty_like(like), _stats_like(x), _stats_like(x)


@torch.library.custom_op(f"{NAMESPACE}::rms_norm_residual_fwd", mutates_args=())
def rms_norm_residual_fwd(x: Tensor, residual: Tensor, weight: Optional[Tensor],
                          eps: float) -> Tuple[Tensor, Tensor, Tensor]:
    x, residual = _residual_inputs("rms_norm_residual", x, residual)
    y, total = torch.empty_like(x), torch.empty_like(x)
    rstd = _stats_like(x)
    _C.rms_norm_residual_forward(x, residual, _opt_contiguous(weight), eps, y, total, rstd)
    return y, total, rstd


@rms_norm_residual_fwd.register_fake
def _(x, residual, weight, eps):
    like = torch.empty_like(x, memory_format=torch.contiguous_format)
    return like, torch.empty_like(like), _stats_like(x)


def _residual_backward(kind: str, dy: Tensor, total: Tensor, dsum: Optional[Tensor],
                       weight: Optional[Tensor], mean: Optional[Tensor], rstd: Tensor,
                       params_f32: bool, need_dx: bool, need_dweight: bool, need_dbias: bool):
    """(dx, dweight, dbias) of a residual norm, empty (shape (0,)) where not asked for."""
    pdtype = torch.float32 if params_f32 else total.dtype
    cols = total.shape[-1]
    dx = torch.empty_like(total) if need_dx else None
    dweight = total.new_empty(cols, dtype=pdtype) if need_dweight else None
    dbias = total.new_empty(cols, dtype=pdtype) if need_dbias else None
    dy, dsum, weight = dy.contiguous(), _opt_contiguous(dsum), _opt_contiguous(weight)
    if kind == "layer_norm":
        _C.layer_norm_residual_backward(dy, total, dsum, weight, mean, rstd, dx, dweight, dbias, "auto")
    else:
        _C.rms_norm_residual_backward(dy, total, dsum, weight, rstd, dx, dweight, "auto")
    return (or_empty(dx, total.dtype, total.device), or_empty(dweight, pdtype, total.device),
            or_empty(dbias, pdtype, total.device))


def _residual_backward_fake(total, params_f32, need_dx, need_dweight, need_dbias):
    pdtype = torch.float32 if params_f32 else total.dtype
    cols = total.shape[-1]
    dx = torch.empty_like(total, memory_format=torch.contiguous_format) if need_dx else \
        empty_output(total.dtype, total.device)
    return (dx, total.new_empty(cols if need_dweight else 0, dtype=pdtype),
            total.new_empty(cols if need_dbias else 0, dtype=pdtype))


@torch.library.custom_op(f"{NAMESPACE}::layer_norm_residual_bwd", mutates_args=())
def layer_norm_residual_bwd(dy: Tensor, total: Tensor, dsum: Optional[Tensor], weight: Optional[Tensor],
                            mean: Tensor, rstd: Tensor, params_f32: bool, need_dx: bool,
                            need_dweight: bool, need_dbias: bool) -> Tuple[Tensor, Tensor, Tensor]:
    return _residual_backward("layer_norm", dy, total.contiguous(), dsum, weight, mean, rstd, params_f32,
                              need_dx, need_dweight, need_dbias)


@layer_norm_residual_bwd.register_fake
def _(dy, total, dsum, weight, mean, rstd, params_f32, need_dx, need_dweight, need_dbias):
    return _residual_backward_fake(total, params_f32, need_dx, need_dweight, need_dbias)


@torch.library.custom_op(f"{NAMESPACE}::rms_norm_residual_bwd", mutates_args=())
def rms_norm_residual_bwd(dy: Tensor, total: Tensor, dsum: Optional[Tensor], weight: Optional[Tensor],
                          rstd: Tensor, params_f32: bool, need_dx: bool,
                          need_dweight: bool) -> Tuple[Tensor, Tensor]:
    dx, dweight, _ = _residual_backward("rms_norm", dy, total.contiguous(), dsum, weight, None, rstd,
                                        params_f32, need_dx, need_dweight, False)
    return dx, dweight


@rms_norm_residual_bwd.register_fake
def _(dy, total, dsum, weight, rstd, params_f32, need_dx, need_dweight):
    dx, dweight, _ = _residual_backward_fake(total, params_f32, need_dx, need_dweight, False)
    return dx, dweight


def _layer_norm_residual_setup(ctx, inputs, output):
    x, _residual, weight, bias, _eps = inputs
    _y, total, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(total, weight, mean, rstd)
    ctx.params_f32 = _params_f32(x, weight if weight is not None else bias)
    ctx.has_weight, ctx.has_bias = weight is not None, bias is not None


def _layer_norm_residual_backward(ctx, dy, dsum, _dmean, _drstd):
    """One dx serves x and residual (d sum / d x = d sum / d residual = 1)."""
    total, weight, mean, rstd = ctx.saved_tensors
    need_x, need_residual, need_dweight, need_dbias = ctx.needs_input_grad[:4]
    need_dx = need_x or need_residual
    if dy is None:  # only the sum reached the loss: y's path contributes nothing
        dx = dsum if need_dx else None
        return (dx if need_x else None, dx if need_residual else None, None, None, None)
    need_dweight = need_dweight and ctx.has_weight
    need_dbias = need_dbias and ctx.has_bias
    if not (need_dx or need_dweight or need_dbias):
        return None, None, None, None, None
    dx, dweight, dbias = layer_norm_residual_bwd(dy, total, dsum, weight, mean, rstd, ctx.params_f32,
                                                 need_dx, need_dweight, need_dbias)
    return (dx if need_x else None, dx if need_residual else None,
            dweight if need_dweight else None, dbias if need_dbias else None, None)


layer_norm_residual_fwd.register_autograd(_layer_norm_residual_backward,
                                          setup_context=_layer_norm_residual_setup)

#: Under torch.autocast as F.layer_norm(x + residual): the sum in x's and residual's common dtype
#: (a bfloat16 branch output added to a float32 residual stream is float32), float32 on CUDA.
LAYER_NORM_RESIDUAL_AUTOCAST = AutocastRule((0, 1), cuda=FP32, cpu=PROMOTE, params=(2, 3))
LAYER_NORM_RESIDUAL_AUTOCAST.register(layer_norm_residual_fwd)


def _rms_norm_residual_setup(ctx, inputs, output):
    x, _residual, weight, _eps = inputs
    _y, total, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(total, weight, rstd)
    ctx.params_f32 = _params_f32(x, weight)
    ctx.has_weight = weight is not None


def _rms_norm_residual_backward(ctx, dy, dsum, _drstd):
    total, weight, rstd = ctx.saved_tensors
    need_x, need_residual, need_dweight = ctx.needs_input_grad[:3]
    need_dx = need_x or need_residual
    if dy is None:
        dx = dsum if need_dx else None
        return (dx if need_x else None, dx if need_residual else None, None, None)
    need_dweight = need_dweight and ctx.has_weight
    if not (need_dx or need_dweight):
        return None, None, None, None
    dx, dweight = rms_norm_residual_bwd(dy, total, dsum, weight, rstd, ctx.params_f32, need_dx,
                                        need_dweight)
    return (dx if need_x else None, dx if need_residual else None,
            dweight if need_dweight else None, None)


rms_norm_residual_fwd.register_autograd(_rms_norm_residual_backward,
                                        setup_context=_rms_norm_residual_setup)

#: Under torch.autocast as F.rms_norm(x + residual): the sum in the common dtype.
RMS_NORM_RESIDUAL_AUTOCAST = AutocastRule((0, 1), cuda=PROMOTE, cpu=PROMOTE, params=(2,))
RMS_NORM_RESIDUAL_AUTOCAST.register(rms_norm_residual_fwd)


def layer_norm_residual(x: Tensor, residual: Tensor, weight: Optional[Tensor] = None,
                        bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tuple[Tensor, Tensor]:
    """(y, sum): sum = x + residual (in x's dtype) and y = layer_norm(sum) over the last dimension
    in one pass, as a pre-norm transformer block's "h = h + f(h); y = norm(h)". Gradients reach x,
    residual, weight and bias from both y and sum."""
    if not _fallback.all_fusekit and _fallback.use_pytorch("layer_norm_residual", x):
        total = x + residual
        return torch.nn.functional.layer_norm(total, (total.shape[-1],), weight, bias, eps), total
    reject_dtensors("layer_norm_residual", x=x, residual=residual, weight=weight, bias=bias)
    y, total, _, _ = layer_norm_residual_fwd(x, residual, weight, bias, float(eps))
    return y, total


def rms_norm_residual(x: Tensor, residual: Tensor, weight: Optional[Tensor] = None,
                      eps: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """(y, sum): sum = x + residual (in x's dtype) and y = rms_norm(sum) over the last dimension in
    one pass; eps=None means torch.finfo(x.dtype).eps, as in torch.nn.functional.rms_norm."""
    if eps is None:
        eps = _FINFO_EPS.get(x.dtype, 0.0)
    if not _fallback.all_fusekit and _fallback.use_pytorch("rms_norm_residual", x):
        total = x + residual
        return torch.nn.functional.rms_norm(total, (total.shape[-1],), weight, eps), total
    reject_dtensors("rms_norm_residual", x=x, residual=residual, weight=weight)
    y, total, _ = rms_norm_residual_fwd(x, residual, weight, float(eps))
    return y, total


# ---- functional forms (signatures of torch.nn.functional.layer_norm / rms_norm) ----------------
def _as_shape(normalized_shape: _ShapeLike) -> Tuple[int, ...]:
    if type(normalized_shape) is tuple:
        return normalized_shape
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(normalized_shape)


def _flatten_normalized(op: str, x: Tensor, shape: Tuple[int, ...],
                        params: List[Optional[Tensor]]):
    """(..., *shape) -> (..., N) and parameters -> (N): fusekit normalizes one last dimension."""
    k = len(shape)
    if k == 1 and x.dim() >= 1 and x.shape[-1] == shape[0]:
        return x, params
    if x.dim() < k or tuple(x.shape[x.dim() - k:]) != shape:
        raise invalid_argument(op, "x", f"a tensor whose last dimensions are {shape} "
                               "(normalized_shape)", f"shape {tuple(x.shape)}")
    n = normalized_numel(shape)
    return (x.reshape(*x.shape[:x.dim() - k], n),
            [None if p is None else p.reshape(n) for p in params])


def _flat(op: str, x: Tensor, normalized_shape: _ShapeLike, params: List[Optional[Tensor]]):
    """(x, params) with x's normalized dims flattened into its last and params into (N)."""
    return _flatten_normalized(op, x, _as_shape(normalized_shape), params)


def _one_dim(normalized_shape, x: Tensor) -> bool:
    """normalized_shape names x's last dimension alone (the common case, checked cheaply)."""
    if type(normalized_shape) is int:
        n = normalized_shape
    elif type(normalized_shape) in (tuple, torch.Size, list) and len(normalized_shape) == 1:
        n = normalized_shape[0]
    else:
        return False
    return x.dim() >= 1 and x.shape[-1] == n


def layer_norm(x: Tensor, normalized_shape: _ShapeLike, weight: Optional[Tensor] = None,
               bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    """torch.nn.functional.layer_norm through fusekit (x: float32, float16 or bfloat16; weight
    and bias in x's dtype or float32)."""
    if not _fallback.all_fusekit and _fallback.use_pytorch("layer_norm", x):
        return torch.nn.functional.layer_norm(x, _as_shape(normalized_shape), weight, bias, eps)
    if _one_dim(normalized_shape, x):
        x2, w, b = x, weight, bias
    else:
        x2, (w, b) = _flat("layer_norm", x, normalized_shape, [weight, bias])
    eps = float(eps)
    mode = eager_mode(x2, w, b)
    if mode != CUSTOM_OP and autocast_active():
        x2, w, b = LAYER_NORM_AUTOCAST.eager(x2, w, b)
    if mode == RECORD:
        y = _layer_norm_apply(x2, w, b, eps)
    elif mode == NO_GRAD:
        y = _layer_norm_forward(x2.contiguous(), w, b, eps, None, None)
    else:
        reject_dtensors("layer_norm", x=x, weight=weight, bias=bias)
        y, _, _ = layer_norm_fwd(x2, w, b, eps)
    return y if x2 is x else y.view(x.shape)


_FINFO_EPS = {dt: torch.finfo(dt).eps for dt in (torch.float32, torch.float16, torch.bfloat16,
                                                 torch.float64)}


def rms_norm(x: Tensor, normalized_shape: _ShapeLike, weight: Optional[Tensor] = None,
             eps: Optional[float] = None) -> Tensor:
    """torch.nn.functional.rms_norm through fusekit; eps=None means torch.finfo(x.dtype).eps, as
    in PyTorch."""
    if not _fallback.all_fusekit and _fallback.use_pytorch("rms_norm", x):
        return torch.nn.functional.rms_norm(x, _as_shape(normalized_shape), weight, eps)
    if _one_dim(normalized_shape, x):
        x2, w = x, weight
    else:
        x2, (w,) = _flat("rms_norm", x, normalized_shape, [weight])
    if eps is None:  # fusekit rejects non-float x itself
        eps = _FINFO_EPS.get(x.dtype, 0.0)
    eps = float(eps)
    mode = eager_mode(x2, w)
    if mode != CUSTOM_OP and autocast_active():
        x2, w = RMS_NORM_AUTOCAST.eager(x2, w)
    if mode == RECORD:
        y = _rms_norm_apply(x2, w, eps)
    elif mode == NO_GRAD:
        y = _rms_norm_forward(x2.contiguous(), w, eps, None)
    else:
        reject_dtensors("rms_norm", x=x, weight=weight)
        y, _ = rms_norm_fwd(x2, w, eps)
    return y if x2 is x else y.view(x.shape)


# ---- nn.Module drop-ins ------------------------------------------------------------------------
@register_drop_in(torch.nn.LayerNorm)
class LayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm with fusekit's kernels: same constructor (normalized_shape, eps,
    elementwise_affine, bias, device, dtype), parameters and state_dict keys."""

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


@register_drop_in(torch.nn.RMSNorm)
class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm with fusekit's kernels: same constructor (normalized_shape, eps,
    elementwise_affine, device, dtype), parameters and state_dict keys."""

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)
