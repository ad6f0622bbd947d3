"""Softmax cross-entropy as PyTorch custom ops (torch.ops.fusekit.*) with autograd formulas and fake
implementations, the functional drop-in for torch.nn.functional.cross_entropy, and the module
drop-in for torch.nn.CrossEntropyLoss.

Ops (all return fresh tensors; nothing is mutated):
  cross_entropy_fwd(logits, targets, ignore_index, label_smoothing, z_loss, reduction)
      -> (loss, lse)
  cross_entropy_bwd(dloss, logits, targets, lse, ignore_index, label_smoothing, z_loss, reduction)
      -> dlogits
  cross_entropy_fwd_bwd(logits, targets, ignore_index, label_smoothing, z_loss, reduction)
      -> (loss, dlogits)
logits is (..., V) in float32, float16 or bfloat16, targets the class indices (int64 or int32) with
logits' leading shape; loss is float32, targets' shape for reduction 'none', 0-d otherwise; lse is
float32 with targets' shape. cross_entropy() runs cross_entropy_fwd, whose autograd formula is
cross_entropy_bwd from the saved logits and lse: the incoming gradient enters the float32 math
before dlogits is rounded once. cross_entropy_fwd_bwd computes the gradient of the loss itself
(dloss = 1) in the same kernel as the loss, for callers that know their upstream gradient is 1;
its autograd formula scales that saved gradient by the incoming one (a second rounding unless the
factor is a power of two).
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
    NAMESPACE,
    NO_GRAD,
    RECORD,
    argument_type_error,
    eager_mode,
    function_apply,
    invalid_argument,
    register_drop_in,
)

F = torch.nn.functional


# ---- implementations shared by the custom ops and the eager path -------------------------------
def _rows(logits: Tensor) -> Tensor:
    """logits as fusekit takes them: rows of a contiguous last dimension with one row stride."""
    if logits.stride(-1) == 1 and (logits.dim() <= 2 or logits.is_contiguous()):
        return logits
    return logits.contiguous()


def _loss_like(logits: Tensor, targets: Tensor, reduction: str) -> Tensor:
    shape = targets.shape if reduction == "none" else ()
    return logits.new_empty(shape, dtype=torch.float32)


# workspace='auto': fusekit._C queries and allocates it through PyTorch's allocator.
@names_allocation_failure("cross_entropy_forward")
def _forward(logits: Tensor, targets: Tensor, ignore_index: int, label_smoothing: float,
             z_loss: float, reduction: str, want_lse: bool) -> Tuple[Tensor, Optional[Tensor]]:
    targets = targets.contiguous()
    loss = _loss_like(logits, targets, reduction)
    lse = logits.new_empty(targets.shape, dtype=torch.float32) if want_lse else None
    _C.cross_entropy_forward(_rows(logits), targets, reduction, loss, lse, "auto", ignore_index,
                             label_smoothing, z_loss)
    return loss, lse


@names_allocation_failure("cross_entropy_backward")
def _backward(dloss: Tensor, logits: Tensor, targets: Tensor, lse: Tensor, ignore_index: int,
              label_smoothing: float, z_loss: float, reduction: str) -> Tensor:
    dlogits = torch.empty_like(logits, memory_format=torch.contiguous_format)
    _C.cross_entropy_backward(dloss.float().contiguous(), _rows(logits), targets.contiguous(),
                              lse.contiguous(), reduction, dlogits, "auto", ignore_index,
                              label_smoothing, z_loss)
    return dlogits


@names_allocation_failure("cross_entropy_forward_backward")
def _forward_backward(logits: Tensor, targets: Tensor, ignore_index: int, label_smoothing: float,
                      z_loss: float, reduction: str) -> Tuple[Tensor, Tensor]:
    targets = targets.contiguous()
    loss = _loss_like(logits, targets, reduction)
    dlogits = torch.empty_like(logits, memory_format=torch.contiguous_format)
    _C.cross_entropy_forward_backward(_rows(logits), targets, reduction, loss, dlogits, None, "auto",
                                      ignore_index, label_smoothing, z_loss)
    return loss, dlogits


def _scale(dlogits: Tensor, dloss: Tensor, reduction: str) -> Tensor:
    """dloss as a factor of dlogits: per row for 'none' (broadcast over the classes)."""
    g = dloss.unsqueeze(-1) if reduction == "none" else dloss
    return g.to(dlogits.dtype)


# ---- custom ops --------------------------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::cross_entropy_fwd", mutates_args=())
def cross_entropy_fwd(logits: Tensor, targets: Tensor, ignore_index: int, label_smoothing: float,
                      z_loss: float, reduction: str) -> Tuple[Tensor, Tensor]:
    return _forward(logits, targets, ignore_index, label_smoothing, z_loss, reduction, True)


@cross_entropy_fwd.register_fake
def _(logits, targets, ignore_index, label_smoothing, z_loss, reduction):
    return _loss_like(logits, targets, reduction), logits.new_empty(targets.shape, dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::cross_entropy_bwd", mutates_args=())
def cross_entropy_bwd(dloss: Tensor, logits: Tensor, targets: Tensor, lse: Tensor, ignore_index: int,
                      label_smoothing: float, z_loss: float, reduction: str) -> Tensor:
    return _backward(dloss, logits, targets, lse, ignore_index, label_smoothing, z_loss, reduction)


@cross_entropy_bwd.register_fake
def _(dloss, logits, targets, lse, ignore_index, label_smoothing, z_loss, reduction):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.custom_op(f"{NAMESPACE}::cross_entropy_fwd_bwd", mutates_args=())
def cross_entropy_fwd_bwd(logits: Tensor, targets: Tensor, ignore_index: int, label_smoothing: float,
                          z_loss: float, reduction: str) -> Tuple[Tensor, Tensor]:
    return _forward_backward(logits, targets, ignore_index, label_smoothing, z_loss, reduction)


@cross_entropy_fwd_bwd.register_fake
def _(logits, targets, ignore_index, label_smoothing, z_loss, reduction):
    return (_loss_like(logits, targets, reduction),
            torch.empty_like(logits, memory_format=torch.contiguous_format))


def _fwd_setup(ctx, inputs, output):
    logits, targets, ignore_index, label_smoothing, z_loss, reduction = inputs
    _loss, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(logits, targets, lse)
    ctx.config = (ignore_index, label_smoothing, z_loss, reduction)


def _fwd_backward(ctx, dloss, _dlse):
    logits, targets, lse = ctx.saved_tensors
    if dloss is None or not ctx.needs_input_grad[0]:
        return None, None, None, None, None, None
    return cross_entropy_bwd(dloss, logits, targets, lse, *ctx.config), None, None, None, None, None


cross_entropy_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


def _fused_setup(ctx, inputs, output):
    _loss, dlogits = output
    ctx.mark_non_differentiable(dlogits)
    ctx.save_for_backward(dlogits)
    ctx.reduction = inputs[5]


def _fused_backward(ctx, dloss, _ddlogits):
    (dlogits,) = ctx.saved_tensors
    if dloss is None or not ctx.needs_input_grad[0]:
        return None, None, None, None, None, None
    return dlogits * _scale(dlogits, dloss, ctx.reduction), None, None, None, None, None


cross_entropy_fwd_bwd.register_autograd(_fused_backward, setup_context=_fused_setup)


class _CrossEntropyFunction(torch.autograd.Function):
    """The eager path with gradients: the loss and lse in the forward, dlogits from the saved
    logits and lse in the backward with the incoming gradient applied in float32 before the one
    rounding to the logits' dtype (scaling a saved dloss = 1 gradient instead would round twice:
    up to about twice PyTorch's error for an upstream gradient such as 1 / accumulation steps)."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index, label_smoothing, z_loss, reduction):
        loss, lse = _forward(logits, targets, ignore_index, label_smoothing, z_loss, reduction, True)
        ctx.save_for_backward(logits, targets, lse)
        ctx.config = (ignore_index, label_smoothing, z_loss, reduction)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        logits, targets, lse = ctx.saved_tensors
        return _backward(dloss, logits, targets, lse, *ctx.config), None, None, None, None, None


_apply = function_apply(_CrossEntropyFunction)


# ---- functional form (the signature of torch.nn.functional.cross_entropy) --------------------
_REDUCTIONS = ("none", "mean", "sum")


def reduction_name(reduction, op: str = "cross_entropy") -> str:
    """A reduction name or fusekit.LossReduction -> the name (custom-op schemas carry it as a str),
    checked before any path runs (PyTorch's implementation would word its error differently);
    `op` names the function in the error."""
    if isinstance(reduction, _C.LossReduction):
        return reduction.name
    if not isinstance(reduction, str):
        raise argument_type_error(op, "reduction", "fusekit.LossReduction or str", reduction)
    if reduction not in _REDUCTIONS:
        raise invalid_argument(op, "reduction",
                               "fusekit.LossReduction or one of 'none', 'mean', 'sum'", repr(reduction))
    return reduction


def cross_entropy(input: Tensor, target: Tensor, weight: Optional[Tensor] = None,
                  size_average=None, ignore_index: int = -100, reduce=None,
                  reduction: str = "mean", label_smoothing: float = 0.0,
                  z_loss: float = 0.0) -> Tensor:
    """torch.nn.functional.cross_entropy through fusekit, plus PaLM's z-loss: z_loss * lse^2 added
    to each row's loss (0: off).

    input: (N, C), (C) or (N, C, d1, ...) logits in float32, float16 or bfloat16 (the class
    dimension of the last form is moved last, a copy); target: class indices (int64 or int32) of
    input's shape without C. ignore_index rows count neither in the loss nor in the mean; a batch
    whose rows are all ignored has mean loss 0 (PyTorch: NaN). The loss is float32 whatever the
    logits' dtype. Class weights (weight) and probability targets run PyTorch's implementation
    (z_loss must then be 0). On a GPU a target outside [0, C) that is not ignore_index makes the
    loss NaN instead of raising (fusekit does not synchronize to check; the CPU raises).
    """
    if size_average is not None or reduce is not None:
        reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
    reduction = reduction_name(reduction)
    if weight is not None or target.is_floating_point():
        if z_loss:
            raise invalid_argument("cross_entropy", "z_loss",
                                   "0 with class weights or probability targets", str(z_loss))
        return F.cross_entropy(input, target, weight, ignore_index=ignore_index,
                               reduction=reduction, label_smoothing=label_smoothing)
    if not _fallback.all_fusekit and _fallback.use_pytorch("cross_entropy", input):
        return _fallback.cross_entropy(input, target, int(ignore_index), float(label_smoothing),
                                       float(z_loss), reduction)
    logits, targets = input, target
    if input.dim() == 1:
        logits, targets = input.unsqueeze(0), target.reshape(1)
    elif input.dim() > 2:
        logits = input.movedim(1, -1)
    args = (int(ignore_index), float(label_smoothing), float(z_loss), reduction)
    mode = eager_mode(logits)
    if mode == RECORD:
        loss = _apply(logits, targets, *args)
    elif mode == NO_GRAD:
        loss, _ = _forward(logits, targets, *args, False)
    else:
        reject_dtensors("cross_entropy", input=input, target=target)
        loss, _ = cross_entropy_fwd(logits, targets, *args)
    if input.dim() == 1 and reduction == "none":
        loss = loss.reshape(())
    return loss


# ---- module drop-in ----------------------------------------------------------------------------
@register_drop_in(torch.nn.CrossEntropyLoss)
class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """torch.nn.CrossEntropyLoss with fusekit's kernels: same constructor (weight, size_average,
    ignore_index, reduce, reduction, label_smoothing) and state, plus z_loss (PaLM's z * lse^2 per
    row, default 0). The loss is float32; see cross_entropy."""

    def __init__(self, weight: Optional[Tensor] = None, size_average=None, ignore_index: int = -100,
                 reduce=None, reduction: str = "mean", label_smoothing: float = 0.0,
                 z_loss: float = 0.0) -> None:
        super().__init__(weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        self.z_loss = float(z_loss)

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        # getattr: a torch.nn.CrossEntropyLoss retargeted by patch() has no z_loss.
        return cross_entropy(input, target, self.weight, ignore_index=self.ignore_index,
                             reduction=self.reduction, label_smoothing=self.label_smoothing,
                             z_loss=getattr(self, "z_loss", 0.0))

    def extra_repr(self) -> str:
        z = getattr(self, "z_loss", 0.0)
        return f"z_loss={z}" if z else ""
