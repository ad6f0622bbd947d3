"""Rotary position embeddings as PyTorch custom ops (torch.ops.fusekit.*) with an autograd formula
and fake implementations, and two functional forms: `rope` in fusekit's (batch, seq, heads,
head_dim) layout (or packed (tokens, heads, head_dim)), and `apply_rotary_pos_emb` with the
signature and (batch, heads, seq, head_dim) layout of Hugging Face's function of that name.

Ops (all return fresh tensors; nothing is mutated):
  rope_fwd(q, k?, position_ids?, inv_freq?, cos?, sin?, style, rotary_dim, theta, linear_scaling,
           attention_scaling) -> (q_out, k_out)
  rope_bwd(dq_out, dk_out?, position_ids?, inv_freq?, cos?, sin?, style, rotary_dim, theta,
           linear_scaling, attention_scaling) -> (dq, dk)
  (k_out / dk come back empty, shape (0,), when k / dk_out is None)
q and k are rotated in one kernel launch. Outputs are laid out as torch.empty_like of their input
(a (B, H, S, D) tensor's transposed view keeps its layout); an input whose head dim is not
contiguous is copied first. The op is linear: the backward needs only the positions, tables and
config, and rotates the gradients by the negated angles. The tables (inv_freq, cos, sin) are
constants: they get no gradient, and a table that requires grad is refused. See
include/fusekit/rope.h for the definition (float32 angles fl32(p) * inv_freq[i]).
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
    NAMESPACE,
    NO_GRAD,
    PROMOTE,
    RECORD,
    AutocastRule,
    argument_type_error,
    autocast_active,
    eager_mode,
    empty_output,
    function_apply,
    invalid_argument,
    or_empty,
)

_STYLES = ("rotate_half", "interleaved")


def _style_name(style) -> str:
    """A fusekit.RopeStyle or its name -> the name (custom-op schemas carry it as a str)."""
    if isinstance(style, _C.RopeStyle):
        return style.name
    if not isinstance(style, str):
        raise argument_type_error("rope", "style", "fusekit.RopeStyle or str", style)
    if style not in _STYLES:  # checked here: PyTorch's implementation would take any other name
        raise invalid_argument("rope", "style", "fusekit.RopeStyle or one of 'rotate_half', 'interleaved'",
                               repr(style))
    return style


def _readable(t: Tensor) -> Tensor:
    """t, or a copy of it where its head dim is not contiguous (what the op reads)."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _new_like(t: Tensor) -> Tensor:
    """An output for the (readable) input t: its strides where t is dense, else contiguous."""
    return torch.empty_like(t)


# ---- implementations shared by the custom ops and the eager path -------------------------------
@names_allocation_failure("rope")
def _run(backward: bool, lead: Tensor, lead_k: Optional[Tensor], position_ids: Optional[Tensor],
         inv_freq: Optional[Tensor], cos: Optional[Tensor], sin: Optional[Tensor], style: str,
         rotary_dim: int, theta: float, linear_scaling: float,
         attention_scaling: float) -> Tuple[Tensor, Optional[Tensor]]:
    lead = _readable(lead)
    out = _new_like(lead)
    out_k = None
    if lead_k is not None:
        lead_k = _readable(lead_k)
        out_k = _new_like(lead_k)
    op = _C.rope_backward if backward else _C.rope_forward
    op(lead, lead_k, position_ids, out, out_k, style=style, rotary_dim=rotary_dim, theta=theta,
       linear_scaling=linear_scaling, attention_scaling=attention_scaling, inv_freq=inv_freq,
       cos=cos, sin=sin)
    return out, out_k


def _backward(dq_out: Optional[Tensor], dk_out: Optional[Tensor], config: tuple
              ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """(dq, dk) for whichever gradients came (None where none did): k takes q's place in the
    call when only it has a gradient (the rotation is per head row)."""
    if dq_out is None and dk_out is None:
        return None, None
    if dq_out is None:
        dk, _ = _run(True, dk_out, None, *config)
        return None, dk
    return _run(True, dq_out, dk_out, *config)


# ---- custom ops --------------------------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::rope_fwd", mutates_args=())
def rope_fwd(q: Tensor, k: Optional[Tensor], position_ids: Optional[Tensor],
             inv_freq: Optional[Tensor], cos: Optional[Tensor], sin: Optional[Tensor], style: str,
             rotary_dim: int, theta: float, linear_scaling: float,
             attention_scaling: float) -> Tuple[Tensor, Tensor]:
    q_out, k_out = _run(False, q, k, position_ids, inv_freq, cos, sin, style, rotary_dim, theta,
                        linear_scaling, attention_scaling)
    return q_out, or_empty(k_out, q.dtype, q.device)


@rope_fwd.register_fake
def _(q, k, position_ids, inv_freq, cos, sin, style, rotary_dim, theta, linear_scaling,
      attention_scaling):
    k_out = _new_like(_readable(k)) if k is not None else empty_output(q.dtype, q.device)
    return _new_like(_readable(q)), k_out


@torch.library.custom_op(f"{NAMESPACE}::rope_bwd", mutates_args=())
def rope_bwd(dq_out: Tensor, dk_out: Optional[Tensor], position_ids: Optional[Tensor],
             inv_freq: Optional[Tensor], cos: Optional[Tensor], sin: Optional[Tensor], style: str,
             rotary_dim: int, theta: float, linear_scaling: float,
             attention_scaling: float) -> Tuple[Tensor, Tensor]:
    dq, dk = _run(True, dq_out, dk_out, position_ids, inv_freq, cos, sin, style, rotary_dim,
                  theta, linear_scaling, attention_scaling)
    return dq, or_empty(dk, dq_out.dtype, dq_out.device)


@rope_bwd.register_fake
def _(dq_out, dk_out, position_ids, inv_freq, cos, sin, style, rotary_dim, theta, linear_scaling,
      attention_scaling):
    dk = _new_like(_readable(dk_out)) if dk_out is not None else \
        empty_output(dq_out.dtype, dq_out.device)
    return _new_like(_readable(dq_out)), dk


def _setup(ctx, inputs, output):
    q, k, position_ids, inv_freq, cos, sin, *scalars = inputs
    ctx.save_for_backward(position_ids, inv_freq, cos, sin)
    ctx.scalars = tuple(scalars)
    ctx.has_k = k is not None


def _autograd_backward(ctx, dq_out, dk_out):
    position_ids, inv_freq, cos, sin = ctx.saved_tensors
    config = (position_ids, inv_freq, cos, sin) + ctx.scalars
    need_dq, need_dk = ctx.needs_input_grad[:2]
    dq_out = dq_out if need_dq else None
    dk_out = dk_out if need_dk and ctx.has_k else None
    if dq_out is None and dk_out is None:
        dq = dk = None
    elif dq_out is None:
        dk, _ = rope_bwd(dk_out, None, *config)
        dq = None
    else:
        dq, dk = rope_bwd(dq_out, dk_out, *config)
        dk = dk if dk_out is not None else None
    return (dq, dk) + (None,) * 9


rope_fwd.register_autograd(_autograd_backward, setup_context=_setup)

#: Under torch.autocast q and k go in their common dtype (as q * cos + rotate_half(q) * sin would
#: promote them); the float32 tables are the op's own precision and stay as they are.
AUTOCAST = AutocastRule((0, 1), cuda=PROMOTE, cpu=PROMOTE)
AUTOCAST.register(rope_fwd)


class _RopeFunction(torch.autograd.Function):
    """The eager path with gradients: the same implementation functions as the custom ops."""

    @staticmethod
    def forward(ctx, q, k, position_ids, inv_freq, cos, sin, *scalars):
        q_out, k_out = _run(False, q, k, position_ids, inv_freq, cos, sin, *scalars)
        ctx.save_for_backward(position_ids, inv_freq, cos, sin)
        ctx.scalars = scalars
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        position_ids, inv_freq, cos, sin = ctx.saved_tensors
        need_dq, need_dk = ctx.needs_input_grad[:2]
        dq, dk = _backward(dq_out if need_dq else None, dk_out if need_dk else None,
                           (position_ids, inv_freq, cos, sin) + ctx.scalars)
        return (dq, dk) + (None,) * (4 + len(ctx.scalars))


_apply = function_apply(_RopeFunction)


# ---- functional forms --------------------------------------------------------------------------
def rope(q: Tensor, k: Optional[Tensor] = None, position_ids: Optional[Tensor] = None, *,
         style="rotate_half", rotary_dim: int = 0, theta: float = 10000.0,
         linear_scaling: float = 1.0, attention_scaling: float = 1.0,
         inv_freq: Optional[Tensor] = None, cos: Optional[Tensor] = None,
         sin: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """(rope(q), rope(k)) in one kernel launch, differentiable in q and k; k may be None (then
    the second result is None).

    q: (B, S, Hq, D) with any strides (a (B, H, S, D) tensor through .transpose(1, 2)) or packed
    (T, Hq, D); k likewise with its own head count (GQA). position_ids: None (the sequence
    index), int32/int64 (B, S) or (1, S), or (T) for packed tensors (positions restarting per
    sequence). style: 'rotate_half' (GPT-NeoX, Llama: pairs i, i + r/2) or 'interleaved' (GPT-J:
    pairs 2i, 2i + 1), or a fusekit.RopeStyle. rotary_dim: 0 (all of D) or an even r <= D; the
    other dims pass through. Angles fl32(p) * inv_freq[i] in float32 with inv_freq from theta and
    linear_scaling, or the float32 table inv_freq (r/2); or float32 tables cos and sin (P, r/2)
    read at row p. attention_scaling multiplies cos and sin (YaRN's mscale).
    """
    style = _style_name(style)
    if torch.is_grad_enabled():
        for name, table in (("inv_freq", inv_freq), ("cos", cos), ("sin", sin)):
            if table is not None and table.requires_grad:
                raise invalid_argument("rope", name, "a table that does not require grad (the tables "
                                       "get no gradient: detach it)", "a tensor that requires grad")
    args = (q, k, position_ids, inv_freq, cos, sin, style, int(rotary_dim), float(theta),
            float(linear_scaling), float(attention_scaling))
    if not _fallback.all_fusekit and _fallback.use_pytorch("rope", q):
        return _fallback.rope(*args)
    mode = eager_mode(q, k)
    if mode != CUSTOM_OP and autocast_active():
        q, k = AUTOCAST.eager(q, k)
        args = (q, k) + args[2:]
    if mode == RECORD:
        return _apply(*args)
    if mode == NO_GRAD:
        return _run(False, *args)
    reject_dtensors("rope", q=q, k=k, position_ids=position_ids, inv_freq=inv_freq, cos=cos, sin=sin)
    q_out, k_out = rope_fwd(*args)
    return q_out, (k_out if k is not None else None)


def apply_rotary_pos_emb(q: Tensor, k: Optional[Tensor], cos: Tensor, sin: Tensor,
                         position_ids: Optional[Tensor] = None,
                         unsqueeze_dim: int = 1) -> Tuple[Tensor, Optional[Tensor]]:
    """Hugging Face's apply_rotary_pos_emb (the rotate_half form of Llama, Mistral, Qwen, ...):
    q * cos + rotate_half(q) * sin for q and k, in one kernel launch.

    q (B, Hq, S, D) and k (B, Hk, S, D) with unsqueeze_dim=1 ((B, S, H, D) with unsqueeze_dim=2);
    cos and sin (B, S, r), (1, S, r) or (S, r) as the model's rotary embedding returns them, in
    any float dtype, with equal halves (cat(freqs, freqs)): their first halves are the tables. r
    may be less than D: the other dims pass through (partial rotary). position_ids is ignored, as
    in Hugging Face (cos and sin are already per token). The results have q's and k's layouts.
    """
    if unsqueeze_dim not in (1, 2):
        raise invalid_argument("apply_rotary_pos_emb", "unsqueeze_dim",
                               "1 ((B, H, S, D) tensors) or 2 ((B, S, H, D) tensors)", str(unsqueeze_dim))
    if q.dim() != 4:
        raise invalid_argument("apply_rotary_pos_emb", "q", "4 dimensions", f"shape {tuple(q.shape)}")
    if cos.dim() not in (2, 3) or cos.shape != sin.shape:
        raise invalid_argument("apply_rotary_pos_emb", "cos",
                               "shape (B, S, r), (1, S, r) or (S, r), the shape of 'sin'",
                               f"shapes {tuple(cos.shape)} and {tuple(sin.shape)}")
    swap = unsqueeze_dim == 1
    qv = q.transpose(1, 2) if swap else q
    kv = k.transpose(1, 2) if (k is not None and swap) else k
    half = cos.shape[-1] // 2
    cos_t, sin_t = cos[..., :half].float(), sin[..., :half].float()
    position_ids = None
    if cos.dim() == 3:
        # One table row per (batch, position) of cos: token (b, s) reads row b * S + s.
        rows, seqlen = cos.shape[0], cos.shape[1]
        cos_t, sin_t = cos_t.reshape(rows * seqlen, half), sin_t.reshape(rows * seqlen, half)
        position_ids = torch.arange(rows * seqlen, device=q.device).view(rows, seqlen)
    q_out, k_out = rope(qv, kv, position_ids, rotary_dim=cos.shape[-1], cos=cos_t, sin=sin_t)
    if swap:
        q_out = q_out.transpose(1, 2)
        k_out = k_out.transpose(1, 2) if k_out is not None else None
    return q_out, k_out
