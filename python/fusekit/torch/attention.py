"""Scaled dot-product attention as PyTorch custom ops (torch.ops.fusekit.*) with an autograd
formula and fake implementations, and two functional forms: `attention` in fusekit's
(batch, seq, heads, head_dim) layout (with variable lengths), and `scaled_dot_product_attention`
with the signature and (batch, heads, seq, head_dim) layout of
torch.nn.functional.scaled_dot_product_attention.

Ops (all return fresh tensors; nothing is mutated):
  attention_fwd(q, k, v, bias?, scale?, mask, window_left, window_right, dropout_p, seed, offset,
                cu_seqlens_q?, cu_seqlens_k?, max_seqlen_q, max_seqlen_k, deterministic)
      -> (out, lse)
  attention_bwd(dout, q, k, v, out, lse, bias?, scale?, mask, window_left, window_right,
                dropout_p, seed, offset, cu_seqlens_q?, cu_seqlens_k?, max_seqlen_q, max_seqlen_k,
                deterministic, need_dq, need_dk, need_dv, need_dbias) -> (dq, dk, dv, dbias)
      (a gradient not asked for comes back empty, shape (0,))
q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) with any strides the alignment rule of
include/fusekit/attention.h allows (so (B, H, S, D) tensors transposed to (B, S, H, D) views go in
without copies); with cu_seqlens_q/k (int32, B + 1) packed (T, H, D) tensors. out is
(B, Sq, Hq, Dv) contiguous, lse (B, Hq, Sq) float32 (varlen: (Tq, Hq, Dv) and (Hq, Tq)). bias is
4-D (B|1, Hq|1, Sq|1, Sk) with its key dim contiguous; dbias has the bias's shape, dq/dk/dv are
laid out as torch.empty_like(q/k/v) where that suits fusekit. `deterministic` is read by the backward only (bitwise
reproducible dq on the GPU). seed is a 0-d int64 CPU tensor (the 64 bits of the unsigned seed;
see _common.seed_tensor): a seed drawn inside a traced graph reaches the op without a graph break.
The dropout mask is a pure function of (seed, offset) and the element's position, so the backward
regenerates it: nothing but q, k, v, bias, out, lse and the seed is saved.

Dtypes: float16 / bfloat16 on CUDA (float32 accumulation); float32 / float64 run the float64 CPU
reference on CPU tensors (CUDA tensors of those dtypes get fusekit.UnsupportedError).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

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
    RECORD,
    U64_MASK,
    AutocastRule,
    argument_type_error,
    autocast_active,
    eager_mode,
    empty_output,
    draw_seed,
    function_apply,
    invalid_argument,
    or_empty,
    seed_tensor,
    seed_value,
)


def _mask_name(op: str, mask) -> str:
    """A fusekit.AttentionMask or its name -> the name (custom-op schemas carry it as a str)."""
    if isinstance(mask, _C.AttentionMask):
        return mask.name
    if isinstance(mask, str):
        return mask  # an unknown name is reported by the C++ op
    raise argument_type_error(op, "mask", "fusekit.AttentionMask or str", mask)


# ---- the alignment rule of fusekit/attention.h --------------------------------------------------
# E = 16 bytes / element size. Two stages: the functional forms fix what shapes and strides show
# (a head dim that is not a multiple of E, strides that are not multiples of E, a broadcast key
# dim), differentiably and traceably (torch.compile sees shapes and strides, not addresses); the
# implementation functions, on real tensors, copy what is still misaligned in memory (a view whose
# data pointer is off 16 bytes), which keeps shapes, so gradients need no translation.
def _elems16(t: Tensor) -> int:
    return max(16 // t.element_size(), 1)


def _strides_ok(t: Tensor) -> bool:
    """q/k/v/out/dout and gradients: head-dim stride 1, every other stride of a dim longer than 1
    a multiple of E."""
    e = _elems16(t)
    if t.dim() == 0 or t.stride(-1) != 1:
        return False
    return all(t.shape[d] <= 1 or t.stride(d) % e == 0 for d in range(t.dim() - 1))


def _bias_strides_ok(b: Tensor) -> bool:
    e = _elems16(b)
    if b.shape[-1] > 1 and b.stride(-1) != 1:
        return False
    return all(b.shape[d] <= 1 or b.stride(d) % e == 0 for d in range(3))


def _operand(t: Tensor) -> Tensor:
    """t itself where its strides suit fusekit, else a padded (head dim up to a multiple of E,
    with zeros: they change no dot product) or contiguous copy. Differentiable."""
    if t.dim() == 0 or not t.is_floating_point():
        return t  # fusekit reports the bad argument
    e = _elems16(t)
    d = t.shape[-1]
    if d % e != 0:
        return torch.nn.functional.pad(t, (0, e - d % e))
    return t if _strides_ok(t) else t.contiguous()


def _padded_rows(b: Tensor) -> Tensor:
    """A copy of the 4-D bias b whose rows are padded to 16 bytes in memory."""
    keys = b.shape[-1]
    return torch.nn.functional.pad(b, (0, (-keys) % _elems16(b)))[..., :keys]


def _bias_operand(bias: Tensor, seqlen_k: int) -> Tensor:
    """A 4-D additive bias (b, h, i, j) in the layout fusekit reads: key dim contiguous, other
    strides multiples of 16 bytes (a copy with padded rows where they are not, as xformers
    requires). Broadcast dims (size 1 or stride 0) stay broadcast when no gradient is needed.
    Differentiable."""
    if bias.dim() != 4 or not bias.is_floating_point():
        return bias  # fusekit reports it
    if not bias.requires_grad:
        # Stride-0 (expanded) dims read one slice: the same values without materializing them.
        # With a gradient they are kept: each element of an expanded leaf gets its own gradient.
        for d in range(3):
            if bias.shape[d] > 1 and bias.stride(d) == 0:
                bias = bias.narrow(d, 0, 1)
    if bias.shape[-1] == 1 and seqlen_k != 1:
        bias = bias.expand(*bias.shape[:-1], seqlen_k)
    return bias if _bias_strides_ok(bias) else _padded_rows(bias)


def _aligned(t: Optional[Tensor]) -> bool:
    return t is None or t.data_ptr() % 16 == 0


def _readable(t: Tensor) -> Tensor:
    """Implementation side (real tensors): q/k/v/out/dout as fusekit reads them."""
    if t.dim() == 0 or not t.is_floating_point() or t.shape[-1] % _elems16(t) != 0:
        return t  # fusekit reports it
    if not _aligned(t):  # contiguous() would return a contiguous but misaligned view as it is
        return t.clone(memory_format=torch.contiguous_format)
    return t if _strides_ok(t) else t.contiguous()


# ---- the eager fast path ------------------------------------------------------------------------
# Real tensors that already suit fusekit (the usual case: contiguous, or transposed views of
# contiguous memory) skip every fix-up above. One C++ call per direction checks that
# (_C._attention_forward_alloc returns None when a fix-up is needed, having done nothing),
# converts the arguments (cfg: one tuple), allocates lse (an opaque capsule) and the workspace
# through PyTorch's allocator, and runs the op.
# cfg = (scale, mask, window_left, window_right, dropout_p, seed, offset, max_seqlen_q,
#        max_seqlen_k, deterministic); deterministic None: resolved when the backward runs.
class _NotReady(Exception):
    """The operands need fix-ups: the caller takes the general path."""


def _ready(t: Tensor, dims: int) -> bool:
    """fusekit reads the q/k/v/dout-like real tensor `t` (`dims` dimensions) as it is."""
    e = _ELEMS16.get(t.dtype)
    if e is None or t.dim() != dims or t.shape[-1] % e or t.data_ptr() % 16:
        return False
    return t.is_contiguous() or _strides_ok(t)


_ELEMS16 = {torch.float16: 8, torch.bfloat16: 8, torch.float32: 4, torch.float64: 2}


def _grad_for(t: Tensor) -> Tensor:
    """dq/dk/dv for a q/k/v that suits fusekit: like it (contiguous where it is), see _grad_like."""
    return torch.empty_like(t) if t.is_contiguous() else _grad_like(t)


@names_allocation_failure("attention_forward")
def _forward_fast(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], cfg: tuple,
                  cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor]):
    """(out, lse), or None when the operands need fix-ups."""
    if v.shape[-1] == q.shape[-1] and q.is_contiguous():
        out = torch.empty_like(q)
    else:  # sizes as ints: new_empty parses them faster than a tuple
        out = q.new_empty(*q.shape[:-1], v.shape[-1] if v.dim() else 0)
    lse = _C._attention_forward_alloc(q, k, v, bias, out, cfg, cu_seqlens_q, cu_seqlens_k)
    return None if lse is None else (out, lse)


@names_allocation_failure("attention_backward")
def _backward_fast(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse,
                   bias: Optional[Tensor], cfg: tuple, cu_seqlens_q: Optional[Tensor],
                   cu_seqlens_k: Optional[Tensor], need_dq: bool, need_dk: bool, need_dv: bool,
                   need_dbias: bool):
    """_backward for what _forward_fast ran on."""
    dq = _grad_for(q) if need_dq else None
    dk = _grad_for(k) if need_dk else None
    dv = _grad_for(v) if need_dv else None
    dbias = _new_bias_grad(bias) if need_dbias and bias is not None else None
    if dq is None and dk is None and dv is None and dbias is None:
        return None, None, None, None
    if not _ready(dout, out.dim()):  # anything autograd made, e.g. the stride-0 grad of a sum
        dout = _readable(dout)
    deterministic = cfg[9]
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    _C._attention_backward_alloc(dout, q, k, v, out, lse, bias, dq, dk, dv, dbias, cfg,
                                 cu_seqlens_q, cu_seqlens_k, bool(deterministic))
    return dq, dk, dv, dbias


def _readable_bias(b: Optional[Tensor]) -> Optional[Tensor]:
    if b is None or b.dim() != 4 or not b.is_floating_point():
        return b
    return b if _bias_strides_ok(b) and _aligned(b) else _padded_rows(b)


def _grad_like(t: Tensor) -> Tensor:
    """dq/dk/dv: torch.empty_like(t) (t's memory order where t is dense, else contiguous), or
    contiguous where that order does not suit fusekit. Decided from strides: fake tensors agree."""
    g = torch.empty_like(t)
    return g if _strides_ok(g) else torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _new_bias_grad(bias: Tensor) -> Tensor:
    """dbias: the bias's shape and dtype, rows padded to 16 bytes in memory."""
    e = _elems16(bias)
    keys = bias.shape[-1]
    full = bias.new_empty((*bias.shape[:-1], keys + (-keys) % e))
    return full[..., :keys]


def _lse_shape(q: Tensor, varlen: bool) -> Tuple[int, ...]:
    if varlen:
        return (q.shape[1], q.shape[0]) if q.dim() == 3 else (0,)
    return (q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else (0,)


def _new_out(q: Tensor, v: Tensor) -> Tensor:
    if q.dim() < 1 or v.dim() < 1:
        return q.new_empty(0)  # fusekit reports the bad argument
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


# ---- implementations shared by the custom ops and the eager path -------------------------------
# workspace='auto': fusekit._C queries and allocates it through PyTorch's allocator.
@names_allocation_failure("attention_forward")
def _forward(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], scale: Optional[float],
             mask: str, window_left: int, window_right: int, dropout_p: float, seed: int,
             offset: int, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
             max_seqlen_q: int, max_seqlen_k: int) -> Tuple[Tensor, Tensor]:
    varlen = cu_seqlens_q is not None
    out = _new_out(q, v)
    lse = torch.empty(_lse_shape(q, varlen), dtype=torch.float32, device=q.device)
    q, k, v, bias = _readable(q), _readable(k), _readable(v), _readable_bias(bias)
    _C.attention_forward(q, k, v, bias, out, lse, scale=scale, mask=mask,
                         window_left=window_left, window_right=window_right,
                         dropout_p=dropout_p, seed=seed & U64_MASK, offset=offset,
                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                         max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, workspace="auto")
    return out, lse


@names_allocation_failure("attention_backward")
def _backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
              bias: Optional[Tensor], scale: Optional[float], mask: str, window_left: int,
              window_right: int, dropout_p: float, seed: int, offset: int,
              cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int,
              max_seqlen_k: int, deterministic: bool, need_dq: bool, need_dk: bool, need_dv: bool,
              need_dbias: bool):
    """(dq, dk, dv, dbias), None where not asked for."""
    need_dbias = need_dbias and bias is not None
    dq = _grad_like(q) if need_dq else None
    dk = _grad_like(k) if need_dk else None
    dv = _grad_like(v) if need_dv else None
    dbias = _new_bias_grad(bias) if need_dbias else None
    if dq is None and dk is None and dv is None and dbias is None:
        return None, None, None, None
    # dout may be anything autograd made, e.g. the stride-0 gradient of out.sum().
    dout, q, k, v, out = _readable(dout), _readable(q), _readable(k), _readable(v), _readable(out)
    bias = _readable_bias(bias)
    _C.attention_backward(dout, q, k, v, out, lse, bias, dq, dk, dv, dbias, scale=scale, mask=mask,
                          window_left=window_left, window_right=window_right,
                          dropout_p=dropout_p, seed=seed & U64_MASK, offset=offset,
                          cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                          deterministic=deterministic, workspace="auto")
    return dq, dk, dv, dbias


# ---- custom ops --------------------------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::attention_fwd", mutates_args=())
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], scale: Optional[float],
                  mask: str, window_left: int, window_right: int, dropout_p: float, seed: Tensor,
                  offset: int, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                  max_seqlen_q: int, max_seqlen_k: int,
                  deterministic: bool) -> Tuple[Tensor, Tensor]:
    return _forward(q, k, v, bias, scale, mask, window_left, window_right, dropout_p,
                    seed_value(seed), offset, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k)


@attention_fwd.register_fake
def _(q, k, v, bias, scale, mask, window_left, window_right, dropout_p, seed, offset,
      cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic):
    lse = q.new_empty(_lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)
    return _new_out(q, v), lse


@torch.library.custom_op(f"{NAMESPACE}::attention_bwd", mutates_args=())
def attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  bias: Optional[Tensor], scale: Optional[float], mask: str, window_left: int,
                  window_right: int, dropout_p: float, seed: Tensor, offset: int,
                  cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                  max_seqlen_q: int, max_seqlen_k: int, deterministic: bool, need_dq: bool,
                  need_dk: bool, need_dv: bool,
                  need_dbias: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv, dbias = _backward(dout, q, k, v, out, lse, bias, scale, mask, window_left,
                                  window_right, dropout_p, seed_value(seed), offset, cu_seqlens_q,
                                  cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic,
                                  need_dq, need_dk, need_dv, need_dbias)
    bias_dtype = bias.dtype if bias is not None else q.dtype
    return (or_empty(dq, q.dtype, q.device), or_empty(dk, q.dtype, q.device),
            or_empty(dv, q.dtype, q.device), or_empty(dbias, bias_dtype, q.device))


@attention_bwd.register_fake
def _(dout, q, k, v, out, lse, bias, scale, mask, window_left, window_right, dropout_p, seed,
      offset, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic, need_dq,
      need_dk, need_dv, need_dbias):
    bias_dtype = bias.dtype if bias is not None else q.dtype
    return (_grad_like(q) if need_dq else empty_output(q.dtype, q.device),
            _grad_like(k) if need_dk else empty_output(q.dtype, q.device),
            _grad_like(v) if need_dv else empty_output(q.dtype, q.device),
            _new_bias_grad(bias) if need_dbias and bias is not None else
            empty_output(bias_dtype, q.device))


def _setup(ctx, inputs, output):
    q, k, v, bias = inputs[:4]
    cu_seqlens_q, cu_seqlens_k = inputs[11], inputs[12]
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, bias, out, lse, cu_seqlens_q, cu_seqlens_k, inputs[9])
    # scale, mask, window_left, window_right, dropout_p / offset / max lengths, deterministic
    ctx.config = inputs[4:9]
    ctx.offset = inputs[10]
    ctx.rest = inputs[13:16]


def _autograd_backward(ctx, dout, _dlse):
    q, k, v, bias, out, lse, cu_q, cu_k, seed = ctx.saved_tensors
    need_dq, need_dk, need_dv, need_dbias = ctx.needs_input_grad[:4]
    need_dbias = need_dbias and bias is not None
    nones = (None,) * 12
    if dout is None or not (need_dq or need_dk or need_dv or need_dbias):
        return (None,) * 4 + nones
    dq, dk, dv, dbias = attention_bwd(dout, q, k, v, out, lse, bias, *ctx.config, seed,
                                      ctx.offset, cu_q, cu_k,
                                      *ctx.rest, need_dq, need_dk, need_dv, need_dbias)
    return (dq if need_dq else None, dk if need_dk else None, dv if need_dv else None,
            dbias if need_dbias else None) + nones


attention_fwd.register_autograd(_autograd_backward, setup_context=_setup)

#: Under torch.autocast q, k, v and the bias go in the autocast dtype, as with PyTorch's
#: scaled_dot_product_attention (its attn_mask included).
AUTOCAST = AutocastRule((0, 1, 2, 3), cuda=LOWER, cpu=LOWER)
AUTOCAST.register(attention_fwd)


class _AttentionFunction(torch.autograd.Function):
    """The eager path with gradients. Every argument of apply() costs host time, so besides the
    differentiable tensors there is one: extra = (cu_seqlens_q, cu_seqlens_k, cfg, fast). fast:
    try _forward_fast (raising _NotReady, before anything is recorded, when the operands need
    fix-ups); else the operands were fixed up already and the custom ops' implementation functions
    run (cfg then has the typed values). cu_seqlens are int tensors that never need gradients:
    kept as attributes."""

    @staticmethod
    def forward(ctx, q, k, v, bias, extra):
        cu_q, cu_k, cfg, fast = extra
        if fast:
            result = _forward_fast(q, k, v, bias, cfg, cu_q, cu_k)
            if result is None:
                raise _NotReady()
            out, lse = result
        else:
            out, lse = _forward(q, k, v, bias, *cfg[:7], cu_q, cu_k, cfg[7], cfg[8])
        ctx.save_for_backward(q, k, v, bias, out)
        ctx.lse = lse  # an intermediate, not an input or output: a plain attribute suffices
        ctx.extra = extra
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, bias, out = ctx.saved_tensors
        need_dq, need_dk, need_dv, need_dbias = ctx.needs_input_grad[:4]
        cu_q, cu_k, cfg, fast = ctx.extra
        if fast:
            dq, dk, dv, dbias = _backward_fast(dout, q, k, v, out, ctx.lse, bias, cfg, cu_q, cu_k,
                                               need_dq, need_dk, need_dv, need_dbias)
        else:
            dq, dk, dv, dbias = _backward(dout, q, k, v, out, ctx.lse, bias, *cfg[:7], cu_q, cu_k,
                                          *cfg[7:], need_dq, need_dk, need_dv, need_dbias)
        return dq, dk, dv, dbias, None


_apply = function_apply(_AttentionFunction)


# ---- functional forms --------------------------------------------------------------------------
def _draw_seed(dropout_p: float, seed: Optional[int]) -> int:
    """The eager paths' seed: seed itself, or a fresh one from PyTorch's CPU generator, so that
    torch.manual_seed reproduces runs."""
    if seed is not None:
        return seed_value(seed)
    return draw_seed() if dropout_p > 0 else 0


def attention(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor] = None, *,
              scale: Optional[float] = None, mask="none", window: Sequence[int] = (-1, -1),
              dropout_p: float = 0.0, seed: Optional[int] = None, offset: int = 0,
              cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
              max_seqlen_q: int = 0, max_seqlen_k: int = 0,
              deterministic: Optional[bool] = None) -> Tensor:
    """softmax(q k^T * scale + bias) v in fusekit's layout, differentiable in q, k, v and bias.

    q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) -> out (B, Sq, Hq, Dv), or packed
    (T, H, D) tensors with cu_seqlens_q/k (int32, B + 1) and max_seqlen_q/k (variable lengths).
    Any strides work without a copy as long as the head dim is contiguous and the other strides
    are multiples of 16 bytes (q/k/v slices of a packed QKV tensor, transposed (B, H, S, D)
    tensors); other tensors are copied, and a head dim that is not a multiple of 16 bytes is
    zero-padded. Hq must be a multiple of Hkv (query head h reads key/value head h // (Hq / Hkv)).

    bias: None or an additive float tensor (B|1, Hq|1, Sq|1, Sk|1), size-1 dims broadcast (with
    variable lengths B sequences and dims padded to max_seqlen_q/k); it may hold -inf (a mask).
    Its gradient is computed when it requires grad. mask: 'none', 'causal_top_left',
    'causal_bottom_right' or a fusekit.AttentionMask; window (left, right): key j is visible from
    query i iff i + d - left <= j <= i + d + right (-1: unbounded; d = 0 for causal_top_left, else
    Sk - Sq). Rows that see no key give 0. scale: None is 1 / sqrt(D).

    dropout_p in [0, 1): the mask is a pure function of (seed, offset) and the element's position
    (include/fusekit/attention.h; fusekit.attention_dropout_keep_mask reproduces it), regenerated
    by the backward. seed=None draws a fresh seed from PyTorch's CPU generator when dropout_p > 0
    (torch.manual_seed makes runs reproducible); under torch.compile the draw is an op of the graph
    (a fresh mask every run, no graph break). seed: any 64-bit value; offset in [0, 2^32); give
    each call that needs an independent mask its own pair.
    deterministic: bitwise reproducible gradients on the GPU (dq without atomics); None follows
    torch.are_deterministic_algorithms_enabled().

    Dtypes: float16 / bfloat16 on CUDA; float32 / float64 on the CPU (the float64 reference).
    """
    op = "attention"
    if not _fallback.all_fusekit and _fallback.use_pytorch(op, q):
        return _fallback.attention(q, k, v, bias, scale, mask if type(mask) is str else
                                   _mask_name(op, mask), window, float(dropout_p), cu_seqlens_q,
                                   cu_seqlens_k)
    mode = eager_mode(q, k, v, bias)
    if mode != CUSTOM_OP and autocast_active():
        q, k, v, bias = AUTOCAST.eager(q, k, v, bias)
    if mode != CUSTOM_OP:
        seed = _draw_seed(float(dropout_p), seed)
        cfg = (scale, mask, window[0], window[1], dropout_p, seed, offset,
               max_seqlen_q, max_seqlen_k, deterministic)
        if mode == RECORD:
            try:
                return _apply(q, k, v, bias, (cu_seqlens_q, cu_seqlens_k, cfg, True))
            except _NotReady:
                pass
        else:
            result = _forward_fast(q, k, v, bias, cfg, cu_seqlens_q, cu_seqlens_k)
            if result is not None:
                return result[0]
    # The general path: fix-ups that tracing sees, then the custom op or the same eager paths.
    if type(mask) is not str:
        mask = _mask_name(op, mask)
    window_left, window_right = int(window[0]), int(window[1])
    dropout_p = float(dropout_p)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    dv_orig = v.shape[-1] if v.dim() else 0
    if scale is None and q.dim() and q.is_floating_point() and q.shape[-1] % _elems16(q) != 0:
        scale = 1.0 / math.sqrt(q.shape[-1])  # of the unpadded head dim
    scale = None if scale is None else float(scale)
    q, k, v = _operand(q), _operand(k), _operand(v)
    if bias is not None:
        keys = int(max_seqlen_k) if cu_seqlens_k is not None else \
            (k.shape[1] if k.dim() >= 2 else 0)
        bias = _bias_operand(bias, keys)
    # The fix-ups above keep the eager mode (they keep requires_grad), except that they may hand
    # over tensors tracing would see: decide again.
    mode = eager_mode(q, k, v, bias)
    seed = seed_tensor(seed, dropout_p > 0) if mode == CUSTOM_OP else _draw_seed(dropout_p, seed)
    args = (q, k, v, bias, scale, mask, window_left, window_right, dropout_p, seed, int(offset),
            cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), bool(deterministic))
    if mode == CUSTOM_OP:
        reject_dtensors(op, q=q, k=k, v=v, bias=bias, cu_seqlens_q=cu_seqlens_q,
                        cu_seqlens_k=cu_seqlens_k)
        out, _ = attention_fwd(*args)
    elif mode == RECORD:
        out = _apply(q, k, v, bias, (cu_seqlens_q, cu_seqlens_k, args[4:11] + args[13:], False))
    else:
        out, _ = _forward(*args[:15])
    return out if out.dim() == 0 or out.shape[-1] == dv_orig else out[..., :dv_orig]


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False, *, window: Sequence[int] = (-1, -1),
                                 bias_requires_grad: Optional[bool] = None,
                                 seed: Optional[int] = None, offset: int = 0,
                                 deterministic: Optional[bool] = None) -> Tensor:
    """torch.nn.functional.scaled_dot_product_attention through fusekit.

    query (N, Hq, L, E), key (N, Hkv, S, E), value (N, Hkv, S, Ev) -> (N, Hq, L, Ev); 3-D inputs
    (N, L, E) are one head, more leading dims are flattened into N. The tensors are handed to
    fusekit as (N, L, H, E) views (transpose(1, 2)): no copies for contiguous (N, H, L, E) tensors
    or for views of (N, L, H, E) memory. The result is a transposed view of (N, L, Hq, Ev)
    contiguous memory, as with PyTorch's flash and cuDNN backends.

    attn_mask: an additive float bias broadcastable to (N, Hq, L, S), or a bool mask (True = take
    part, converted to 0 / -inf). The gradient of a float attn_mask that requires grad is returned
    (bias_requires_grad=False skips it: the mask is then treated as a constant; None or True
    follow attn_mask.requires_grad). is_causal: the
    top-left causal mask, as in PyTorch; with attn_mask as well (PyTorch refuses that) both apply.
    enable_gqa: Hq may be a multiple of Hkv (key/value head h // (Hq / Hkv), as PyTorch).
    Rows that see no key give 0 (PyTorch gives NaN).

    Beyond PyTorch: window=(left, right) for sliding windows (see fusekit.torch.attention), and the
    dropout mask is reproducible: a function of (seed, offset), not of PyTorch's generator state.
    dropout_p applies whenever it is > 0 (pass 0 in eval mode, as with PyTorch). seed=None draws a
    seed from PyTorch's CPU generator when dropout_p > 0 (torch.manual_seed reproduces runs; under
    torch.compile an op of the graph, no graph break). deterministic: None follows
    torch.are_deterministic_algorithms_enabled().

    float16 / bfloat16 on CUDA; float32 / float64 on the CPU.
    """
    op = "scaled_dot_product_attention"
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() < 3:
            raise invalid_argument(op, name, "at least 3 dimensions (N, ..., L, E)",
                                   f"shape {tuple(t.shape)}")
    lead = query.shape[:-2]
    if query.dim() == 3:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    elif query.dim() > 4:
        query = query.reshape(-1, *query.shape[-3:])
        key = key.reshape(-1, *key.shape[-3:])
        value = value.reshape(-1, *value.shape[-3:])
    n, hq, seq_q = query.shape[0], query.shape[1], query.shape[2]
    hkv, seq_k = key.shape[1], key.shape[2]
    if hkv != hq and not enable_gqa:
        raise invalid_argument(op, "key", f"{hq} heads as 'query' (or enable_gqa=True for "
                               "grouped-query attention)", f"{hkv} heads")
    bias = None
    if attn_mask is not None:
        bias = attn_mask
        if bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=query.dtype, device=bias.device).masked_fill(
                bias.logical_not(), float("-inf"))
        elif bias_requires_grad is False:
            bias = bias.detach()
        # attn_mask's dims align from the right with (*lead, L, S); fusekit's are (N, H, L, S).
        target = len(lead) + 2
        if bias.dim() < target:
            bias = bias[(None,) * (target - bias.dim())]
        if len(lead) == 1:
            bias = bias.unsqueeze(1)
        elif len(lead) > 2:
            bias = bias.expand(*lead, seq_q, seq_k).reshape(n, hq, seq_q, seq_k)
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), bias,
                    scale=scale, mask="causal_top_left" if is_causal else "none", window=window,
                    dropout_p=dropout_p, seed=seed, offset=offset, deterministic=deterministic)
    out = out.transpose(1, 2)  # (N, Hq, L, Ev)
    return out.reshape(*lead, seq_q, out.shape[-1]) if len(lead) != 2 else out
