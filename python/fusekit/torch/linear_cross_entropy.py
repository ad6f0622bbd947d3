"""The output layer's loss without its logits, as PyTorch custom ops (torch.ops.fusekit.*) with an
autograd formula and fake implementations, the functional form linear_cross_entropy and the module
LinearCrossEntropyLoss: the loss of torch.nn.functional.cross_entropy(F.linear(hidden, weight, bias),
target), plus a z-loss, computed in chunks of rows so that the (T, V) logits never exist
(include/fusekit/linear_cross_entropy.h).

Ops (all return fresh tensors; nothing is mutated):
  linear_cross_entropy_fwd(hidden, weight, bias?, targets, ignore_index, label_smoothing, z_loss,
                           reduction, need_dhidden, need_dweight, need_dbias)
      -> (loss, dhidden, dweight, dbias)
  linear_cross_entropy_bwd(dloss, hidden, weight, bias?, targets, ignore_index, label_smoothing,
                           z_loss, reduction, need_dhidden, need_dweight, need_dbias)
      -> (dhidden, dweight, dbias)
hidden is (..., H) and weight (V, H), bias (V), all one dtype (float32, float16 or bfloat16; float64
on the CPU); targets holds hidden's leading elements (int64 or int32). loss is float32: targets'
shape for reduction 'none', 0-d otherwise. A gradient not asked for comes back empty (shape (0,)).

The forward computes the gradients of the loss itself (dloss = 1) in the same call as the loss,
where asked: dhidden in hidden's dtype, dweight and dbias in float32 (fusekit accumulates them in
float32 anyway; the scaled gradient is rounded once to the parameter's dtype). The autograd formula
scales them by the incoming gradient, a scalar for mean and sum (dhidden is then rounded a second
time unless the factor is a power of two). For reduction 'none' the incoming gradient holds one
weight per row, which cannot be applied to dweight = sum over rows of dlogits^T hidden once the
rows are summed: the forward computes the loss alone and linear_cross_entropy_bwd recomputes the
logits in chunks of rows (PyTorch's GEMM, fusekit's cross-entropy kernels, the row weights applied
in float32 before dlogits is rounded), as an unfused layer would, without its (T, V) logits.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _C
from . import _fallback
from ._common import (
    reject_dtensors,
    NAMESPACE,
    NO_GRAD,
    RECORD,
    eager_mode,
    empty_output,
    function_apply,
    names_allocation_failure,
    or_empty,
)
from .cross_entropy import _rows, reduction_name

F = torch.nn.functional

#: Bytes of logits (in hidden's dtype) per chunk of rows when linear_cross_entropy_bwd recomputes
#: them: about what the fused op keeps per chunk.
RECOMPUTE_CHUNK_BYTES = 512 << 20


# ---- implementations shared by the custom ops and the eager path -------------------------------
def _weight_rows(weight: Tensor) -> Tensor:
    """weight as fusekit takes it: a contiguous last dimension, any row stride."""
    return weight if weight.stride(-1) == 1 else weight.contiguous()


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the forward's dweight and dbias: float32, float64 for float64 inputs (CPU)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _loss_like(hidden: Tensor, targets: Tensor, reduction: str) -> Tensor:
    return hidden.new_empty(targets.shape if reduction == "none" else (), dtype=torch.float32)


# workspace='auto': fusekit._C queries and allocates it through PyTorch's allocator.
@names_allocation_failure("linear_cross_entropy")
def _forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
             ignore_index: int, label_smoothing: float, z_loss: float, reduction: str,
             need_dhidden: bool, need_dweight: bool, need_dbias: bool):
    """(loss, dhidden, dweight, dbias) of the loss itself (dloss = 1; for 'none', of the sum of the
    row losses); each gradient None unless asked for, dweight and dbias in float32 (float64 for
    float64 inputs)."""
    h = _rows(hidden)
    w = _weight_rows(weight)
    b = bias.contiguous() if bias is not None else None
    targets = targets.contiguous()
    loss = _loss_like(h, targets, reduction)
    dh = torch.empty_like(h, memory_format=torch.contiguous_format) if need_dhidden else None
    acc = _accumulator_dtype(h.dtype)
    dw = w.new_empty(w.shape, dtype=acc) if need_dweight else None
    db = w.new_empty(w.shape[0], dtype=acc) if need_dbias and b is not None else None
    _C.linear_cross_entropy(h, w, b, targets, reduction, loss, dh, dw, db, "auto", ignore_index,
                            label_smoothing, z_loss)
    return loss, dh, dw, db


def _chunk_rows(tokens: int, vocab: int, element_size: int) -> int:
    """Rows per chunk of the recomputation: RECOMPUTE_CHUNK_BYTES of logits, the rows then split
    into equal chunks."""
    rows = max(1, RECOMPUTE_CHUNK_BYTES // max(1, vocab * element_size))
    chunks = max(1, -(-tokens // rows))
    return max(1, -(-tokens // chunks))


def _product(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """a @ b accumulated and returned in `dtype` (float32 or float64): 16-bit inputs go to PyTorch's
    GEMM as they are where it writes float32 from them (CUDA), else are widened first."""
    if a.dtype == dtype:
        return torch.mm(a, b)
    if a.is_cuda and dtype == torch.float32:
        return torch.mm(a, b, out_dtype=dtype)
    return torch.mm(a.to(dtype), b.to(dtype))


def _dlogits_float64(logits: Tensor, targets: Tensor, row_weights: Tensor, ignore_index: int,
                     label_smoothing: float, z_loss: float) -> Tensor:
    """The cross-entropy gradient of fusekit/cross_entropy.h, each row times its weight, in float64
    PyTorch operations (fusekit's cross-entropy takes no float64 logits; the CPU backend's
    linear_cross_entropy does)."""
    s, z, vocab = float(label_smoothing), float(z_loss), logits.shape[1]
    lse = torch.logsumexp(logits, 1, keepdim=True)
    grad = torch.exp(logits - lse) * (1 + 2 * z * lse) - s / vocab
    counted = targets != ignore_index
    grad.scatter_add_(1, torch.where(counted, targets, 0)[:, None],
                      torch.full((logits.shape[0], 1), s - 1, dtype=grad.dtype, device=grad.device))
    return grad * (row_weights.to(grad.dtype) * counted)[:, None]


@names_allocation_failure("linear_cross_entropy_backward")
def _backward(dloss: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
              ignore_index: int, label_smoothing: float, z_loss: float, reduction: str,
              need_dhidden: bool, need_dweight: bool, need_dbias: bool):
    """(dhidden, dweight, dbias) of the loss given its gradient dloss, in the inputs' dtypes (None
    where not asked for), recomputing the logits chunk by chunk: the reduction becomes one weight
    per row (dloss per row for 'none', dloss for 'sum', dloss / N for 'mean', N counted on the
    device), which fusekit's cross-entropy backward applies in float32 before dlogits is rounded."""
    need_dbias = need_dbias and bias is not None
    if not (need_dhidden or need_dweight or need_dbias):
        return None, None, None
    h = _rows(hidden)
    w = _weight_rows(weight)
    vocab, width = w.shape
    h2 = h.reshape(-1, width)
    t = targets.contiguous().reshape(-1)
    tokens = h2.shape[0]
    g = dloss.to(torch.float32)
    if reduction == "none":
        row_weights = g.contiguous().reshape(-1)
    else:
        if reduction == "mean":
            g = g / (t != ignore_index).sum().clamp_min(1)
        row_weights = g.reshape(1).expand(tokens).contiguous()
    dh = torch.empty_like(h2, memory_format=torch.contiguous_format) if need_dhidden else None
    step = _chunk_rows(tokens, vocab, h2.element_size())
    single = tokens <= step
    acc = _accumulator_dtype(h2.dtype)
    dw = dw_acc = db_acc = None
    if need_dweight and not single:
        dw_acc = torch.zeros(w.shape, dtype=acc, device=w.device)
    if need_dbias:
        db_acc = torch.zeros(vocab, dtype=acc, device=w.device)
    for start in range(0, tokens, step):
        end = min(tokens, start + step)
        hc, tc = h2[start:end], t[start:end]
        logits = F.linear(hc, w, bias)
        if logits.dtype == torch.float64:
            logits = _dlogits_float64(logits, tc, row_weights[start:end], ignore_index,
                                      label_smoothing, z_loss)
        else:
            lse = logits.new_empty(end - start, dtype=torch.float32)
            row_loss = torch.empty_like(lse)
            _C.cross_entropy_forward(logits, tc, "none", row_loss, lse, "auto", ignore_index,
                                     label_smoothing, z_loss)
            # In place: the chunk's gradient overwrites its logits.
            _C.cross_entropy_backward(row_weights[start:end], logits, tc, lse, "none", logits,
                                      "auto", ignore_index, label_smoothing, z_loss)
        if dh is not None:
            torch.mm(logits, w, out=dh[start:end])
        if need_dweight:
            if single:  # one product, rounded once as PyTorch's unfused layer rounds it
                dw = torch.mm(logits.t(), hc)
            else:
                dw_acc += _product(logits.t(), hc, acc)
        if db_acc is not None:
            db_acc += logits.sum(0, dtype=acc)
    if dw_acc is not None:
        dw = dw_acc.to(weight.dtype)
    elif need_dweight and dw is None:  # no rows
        dw = torch.zeros(w.shape, dtype=weight.dtype, device=w.device)
    db = db_acc.to(bias.dtype) if db_acc is not None else None
    return (dh.reshape(hidden.shape) if dh is not None else None), dw, db


def _scaled(grad: Tensor, dloss: Tensor, dtype: torch.dtype) -> Tensor:
    """grad * dloss (a 0-d gradient) computed in float32 (float64 for float64 gradients), rounded
    once to `dtype`."""
    wide = _accumulator_dtype(grad.dtype)
    g = dloss.to(wide)
    if grad.dtype == wide and dtype == wide:
        return grad * g
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    return torch.mul(grad.to(wide), g, out=out)


def _precomputed(reduction: str, need_dhidden: bool, need_dweight: bool, need_dbias: bool,
                 has_bias: bool) -> Tuple[bool, bool, bool]:
    """Which gradients the forward computes: the ones needed, except for reduction 'none' (their
    row weights are only known in the backward)."""
    if reduction == "none":
        return False, False, False
    return need_dhidden, need_dweight, need_dbias and has_bias


def _gradients(dloss, saved, needs, config, dtypes, recompute):
    """The autograd formula shared by both routes: the precomputed gradients scaled by dloss, or
    the recomputation where a needed gradient was not precomputed. needs: (dhidden, dweight,
    dbias) wanted (dbias only where there is a bias); `recompute` is the custom op or the
    implementation function."""
    hidden, weight, bias, targets, dh, dw, db = saved
    need_dh, need_dw, need_db = needs
    if dloss is None or not (need_dh or need_dw or need_db):
        return None, None, None
    if (need_dh and dh is None) or (need_dw and dw is None) or (need_db and db is None):
        return recompute(dloss, hidden, weight, bias, targets, *config, need_dh, need_dw, need_db)
    weight_dtype, bias_dtype = dtypes
    return (_scaled(dh, dloss, dh.dtype) if need_dh else None,
            _scaled(dw, dloss, weight_dtype) if need_dw else None,
            _scaled(db, dloss, bias_dtype) if need_db else None)


def _save(ctx, hidden, weight, bias, targets, config, have, dh, dw, db):
    """What both routes keep for the backward: the precomputed gradients, and the inputs only where
    a needed gradient was not precomputed (otherwise hidden may be freed after the forward)."""
    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
             ctx.needs_input_grad[2] and bias is not None)
    recompute = any(n and not p for n, p in zip(needs, have))
    kept = (hidden, weight, bias, targets) if recompute else (None, None, None, None)
    ctx.save_for_backward(*kept, dh if have[0] else None, dw if have[1] else None,
                          db if have[2] else None)
    ctx.state = (needs, config, (weight.dtype, bias.dtype if bias is not None else None))


# ---- custom ops --------------------------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::linear_cross_entropy_fwd", mutates_args=())
def linear_cross_entropy_fwd(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
                             ignore_index: int, label_smoothing: float, z_loss: float, reduction: str,
                             need_dhidden: bool, need_dweight: bool,
                             need_dbias: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    loss, dh, dw, db = _forward(hidden, weight, bias, targets, ignore_index, label_smoothing, z_loss,
                                reduction, need_dhidden, need_dweight, need_dbias)
    acc = _accumulator_dtype(hidden.dtype)
    return (loss, or_empty(dh, hidden.dtype, hidden.device), or_empty(dw, acc, hidden.device),
            or_empty(db, acc, hidden.device))


@linear_cross_entropy_fwd.register_fake
def _(hidden, weight, bias, targets, ignore_index, label_smoothing, z_loss, reduction, need_dhidden,
      need_dweight, need_dbias):
    dh = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_dhidden else \
        empty_output(hidden.dtype, hidden.device)
    acc = _accumulator_dtype(hidden.dtype)
    dw = weight.new_empty(weight.shape, dtype=acc) if need_dweight else empty_output(acc, hidden.device)
    db = weight.new_empty(weight.shape[0], dtype=acc) if need_dbias and bias is not None \
        else empty_output(acc, hidden.device)
    return _loss_like(hidden, targets, reduction), dh, dw, db


@torch.library.custom_op(f"{NAMESPACE}::linear_cross_entropy_bwd", mutates_args=())
def linear_cross_entropy_bwd(dloss: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                             targets: Tensor, ignore_index: int, label_smoothing: float, z_loss: float,
                             reduction: str, need_dhidden: bool, need_dweight: bool,
                             need_dbias: bool) -> Tuple[Tensor, Tensor, Tensor]:
    dh, dw, db = _backward(dloss, hidden, weight, bias, targets, ignore_index, label_smoothing, z_loss,
                           reduction, need_dhidden, need_dweight, need_dbias)
    return (or_empty(dh, hidden.dtype, hidden.device), or_empty(dw, weight.dtype, hidden.device),
            or_empty(db, weight.dtype if bias is None else bias.dtype, hidden.device))


@linear_cross_entropy_bwd.register_fake
def _(dloss, hidden, weight, bias, targets, ignore_index, label_smoothing, z_loss, reduction,
      need_dhidden, need_dweight, need_dbias):
    dh = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_dhidden else \
        empty_output(hidden.dtype, hidden.device)
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_dweight else \
        empty_output(weight.dtype, hidden.device)
    db = torch.empty_like(bias) if need_dbias and bias is not None else \
        empty_output(weight.dtype if bias is None else bias.dtype, hidden.device)
    return dh, dw, db


def _recompute_op(dloss, hidden, weight, bias, targets, ignore_index, label_smoothing, z_loss,
                  reduction, need_dh, need_dw, need_db):
    dh, dw, db = linear_cross_entropy_bwd(dloss, hidden, weight, bias, targets, ignore_index,
                                          label_smoothing, z_loss, reduction, need_dh, need_dw, need_db)
    return dh if need_dh else None, dw if need_dw else None, db if need_db else None


def _setup(ctx, inputs, output):
    (hidden, weight, bias, targets, ignore_index, label_smoothing, z_loss, reduction, need_dh, need_dw,
     need_db) = inputs
    _loss, dh, dw, db = output
    ctx.mark_non_differentiable(dh, dw, db)
    have = _precomputed(reduction, need_dh, need_dw, need_db, bias is not None)
    _save(ctx, hidden, weight, bias, targets, (ignore_index, label_smoothing, z_loss, reduction),
          have, dh, dw, db)


def _autograd_backward(ctx, dloss, _ddh, _ddw, _ddb):
    needs, config, dtypes = ctx.state
    dh, dw, db = _gradients(dloss, ctx.saved_tensors, needs, config, dtypes, _recompute_op)
    return dh, dw, db, None, None, None, None, None, None, None, None


linear_cross_entropy_fwd.register_autograd(_autograd_backward, setup_context=_setup)


class _LinearCrossEntropyFunction(torch.autograd.Function):
    """The eager path with gradients: the same implementation functions as the custom ops."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index, label_smoothing, z_loss, reduction):
        needs = ctx.needs_input_grad
        have = _precomputed(reduction, needs[0], needs[1], needs[2], bias is not None)
        loss, dh, dw, db = _forward(hidden, weight, bias, targets, ignore_index, label_smoothing,
                                    z_loss, reduction, *have)
        _save(ctx, hidden, weight, bias, targets, (ignore_index, label_smoothing, z_loss, reduction),
              have, dh, dw, db)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        needs, config, dtypes = ctx.state
        dh, dw, db = _gradients(dloss, ctx.saved_tensors, needs, config, dtypes, _backward)
        return dh, dw, db, None, None, None, None, None


_apply = function_apply(_LinearCrossEntropyFunction)


def _records_grad(t: Optional[Tensor]) -> bool:
    return t is not None and t.requires_grad and torch.is_grad_enabled()


# ---- functional form and module ----------------------------------------------------------------
def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None,
                         ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                         reduction="mean") -> Tensor:
    """torch.nn.functional.cross_entropy(F.linear(hidden, weight, bias).float(), target, ...) without
    the logits, plus PaLM's z-loss (z_loss * lse^2 added to each row's loss; 0: off).

    hidden: (..., H); weight: (V, H) (an nn.Linear's or a tied embedding's); bias: (V) or None;
    all one dtype: bfloat16, float16 or float32. target: class indices (int64 or int32), one per
    row of hidden (its shape is the loss's for reduction 'none'). ignore_index rows count neither
    in the loss nor in the mean; a batch whose rows are all ignored has mean loss 0 (PyTorch: NaN).
    The loss is float32; the gradients of hidden, weight and bias come in their dtypes. For
    reductions mean and sum they are computed with the loss, in the same call (the backward only
    scales them); 'none' recomputes the logits chunk by chunk in the backward. On a GPU a target
    outside [0, V) that is not ignore_index makes the loss NaN instead of raising (the CPU raises).
    """
    reduction = reduction_name(reduction, "linear_cross_entropy")
    if not _fallback.all_fusekit and _fallback.use_pytorch("linear_cross_entropy", hidden):
        return _fallback.linear_cross_entropy(hidden, weight, bias, target, int(ignore_index),
                                              float(label_smoothing), float(z_loss), reduction)
    args = (int(ignore_index), float(label_smoothing), float(z_loss), reduction)
    mode = eager_mode(hidden, weight, bias)
    if mode == RECORD:
        return _apply(hidden, weight, bias, target, *args)
    if mode == NO_GRAD:
        return _forward(hidden, weight, bias, target, *args, False, False, False)[0]
    reject_dtensors("linear_cross_entropy", hidden=hidden, weight=weight, target=target, bias=bias)
    have = _precomputed(reduction, _records_grad(hidden), _records_grad(weight), _records_grad(bias),
                        bias is not None)
    return linear_cross_entropy_fwd(hidden, weight, bias, target, *args, *have)[0]


class LinearCrossEntropyLoss(torch.nn.Module):
    """The loss of an output layer, its logits never materialized:
    forward(hidden, weight, target, bias=None) = linear_cross_entropy(hidden, weight, target, bias,
    ...) with the options given here (ignore_index, label_smoothing, z_loss, reduction). The module
    holds no parameters: pass the output layer's (lm_head.weight, a tied embedding's weight)."""

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                 reduction: str = "mean") -> None:
        super().__init__()
        self.ignore_index = int(ignore_index)
        self.label_smoothing = float(label_smoothing)
        self.z_loss = float(z_loss)
        self.reduction = reduction_name(reduction, "LinearCrossEntropyLoss")

    def forward(self, hidden: Tensor, weight: Tensor, target: Tensor,
                bias: Optional[Tensor] = None) -> Tensor:
        return linear_cross_entropy(hidden, weight, target, bias, self.ignore_index,
                                    self.label_smoothing, self.z_loss, self.reduction)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, "
                f"z_loss={self.z_loss}, reduction={self.reduction}")
