"""Gated activations (the GLU variants of gated MLPs: SwiGLU, GeGLU, ReGLU) as PyTorch custom ops
(torch.ops.fusekit.*) with an autograd formula and fake implementations, their functional forms,
and GatedMLP, the gate / up / down MLP of Llama-style models.

Ops (all return fresh tensors; nothing is mutated):
  gated_act_fwd(gate_up, activation, layout) -> y
  gated_act_bwd(dy, gate_up, activation, layout) -> dgate_up
  gated_act_separate_fwd(gate, up, activation) -> y
  gated_act_separate_bwd(dy, gate, up, activation, need_dgate, need_dup) -> (dgate, dup)
      (a gradient not asked for comes back empty, shape (0,))
y = act(gate) * up. gate_up is (..., 2F), a fused gate-up projection's output, in layout 'halves'
([gate | up] along the last dimension) or 'interleaved' (gate j at column 2j, up j at 2j + 1);
gate, up, y and dy are (..., F). activation: 'silu' (SwiGLU), 'gelu_tanh' or 'gelu_erf' (GeGLU),
'relu' (ReGLU). The backward needs the forward's inputs only.

HF's LlamaMLP computes down_proj(act_fn(gate_proj(x)) * up_proj(x)): gated_act_separate(gate_proj(x),
up_proj(x), "silu") replaces act_fn(...) * up_proj(x), and gated_act(gate_up) does the same for a
fused gate-up projection. GatedMLP is that MLP with the same submodules and state_dict keys.
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
    activation_name,
    autocast_active,
    argument_type_error,
    eager_mode,
    empty_output,
    function_apply,
    invalid_argument,
    or_empty,
)

#: The activations the gated ops take (others are refused, as by the C++ API).
GATE_ACTIVATIONS = ("silu", "gelu_tanh", "gelu_erf", "relu")
LAYOUTS = ("halves", "interleaved")


def _layout_name(op: str, layout) -> str:
    if type(layout) is str:
        return layout
    if isinstance(layout, _C.GatedLayout):
        return layout.name
    raise argument_type_error(op, "layout", "fusekit.GatedLayout or str", layout)


# ---- implementations shared by the custom ops and the eager path -------------------------------
# fusekit._C allocates the outputs through PyTorch's allocator, and makes contiguous only the
# inputs whose layout the ops do not take (the halves of a gate_up.chunk(2, -1) go as they are).
@names_allocation_failure("gated_act_forward")
def _forward(gate_up: Tensor, activation: str, layout: str) -> Tensor:
    return _C._gated_act_forward_alloc(gate_up, activation, layout)


@names_allocation_failure("gated_act_backward")
def _backward(dy: Tensor, gate_up: Tensor, activation: str, layout: str) -> Tensor:
    return _C._gated_act_backward_alloc(dy, gate_up, activation, layout)


@names_allocation_failure("gated_act_forward_separate")
def _forward_separate(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    return _C._gated_act_forward_separate_alloc(gate, up, activation)


@names_allocation_failure("gated_act_backward_separate")
def _backward_separate(dy: Tensor, gate: Tensor, up: Tensor, activation: str, need_dgate: bool,
                       need_dup: bool) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    if not (need_dgate or need_dup):
        return None, None
    return _C._gated_act_backward_separate_alloc(dy, gate, up, activation, need_dgate, need_dup)


# ---- custom ops: one (..., 2F) tensor ------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::gated_act_fwd", mutates_args=())
def gated_act_fwd(gate_up: Tensor, activation: str, layout: str) -> Tensor:
    return _forward(gate_up, activation, layout)


@gated_act_fwd.register_fake
def _(gate_up, activation, layout):
    return gate_up.new_empty(tuple(gate_up.shape[:-1]) + (gate_up.shape[-1] // 2,))


@torch.library.custom_op(f"{NAMESPACE}::gated_act_bwd", mutates_args=())
def gated_act_bwd(dy: Tensor, gate_up: Tensor, activation: str, layout: str) -> Tensor:
    return _backward(dy, gate_up, activation, layout)


@gated_act_bwd.register_fake
def _(dy, gate_up, activation, layout):
    return torch.empty_like(gate_up, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    gate_up, activation, layout = inputs
    ctx.save_for_backward(gate_up)
    ctx.config = (activation, layout)


def _autograd_backward(ctx, dy):
    (gate_up,) = ctx.saved_tensors
    if dy is None or not ctx.needs_input_grad[0]:
        return None, None, None
    return gated_act_bwd(dy, gate_up, *ctx.config), None, None


gated_act_fwd.register_autograd(_autograd_backward, setup_context=_setup)


# ---- custom ops: two (..., F) tensors -------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::gated_act_separate_fwd", mutates_args=())
def gated_act_separate_fwd(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    return _forward_separate(gate, up, activation)


@gated_act_separate_fwd.register_fake
def _(gate, up, activation):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op(f"{NAMESPACE}::gated_act_separate_bwd", mutates_args=())
def gated_act_separate_bwd(dy: Tensor, gate: Tensor, up: Tensor, activation: str, need_dgate: bool,
                           need_dup: bool) -> Tuple[Tensor, Tensor]:
    dgate, dup = _backward_separate(dy, gate, up, activation, need_dgate, need_dup)
    return or_empty(dgate, gate.dtype, gate.device), or_empty(dup, gate.dtype, gate.device)


@gated_act_separate_bwd.register_fake
def _(dy, gate, up, activation, need_dgate, need_dup):
    def grad(wanted):
        return torch.empty_like(gate, memory_format=torch.contiguous_format) if wanted else \
            empty_output(gate.dtype, gate.device)
    return grad(need_dgate), grad(need_dup)


def _setup_separate(ctx, inputs, output):
    gate, up, activation = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation = activation


def _autograd_backward_separate(ctx, dy):
    gate, up = ctx.saved_tensors
    need_dgate, need_dup = ctx.needs_input_grad[:2]
    if dy is None or not (need_dgate or need_dup):
        return None, None, None
    dgate, dup = gated_act_separate_bwd(dy, gate, up, ctx.activation, need_dgate, need_dup)
    return (dgate if need_dgate else None), (dup if need_dup else None), None


gated_act_separate_fwd.register_autograd(_autograd_backward_separate, setup_context=_setup_separate)

#: Under torch.autocast gate and up go in their common dtype, as PyTorch's act(gate) * up (the
#: one-tensor gated_act has nothing to cast: autocast leaves the activations of PyTorch alone).
SEPARATE_AUTOCAST = AutocastRule((0, 1), cuda=PROMOTE, cpu=PROMOTE)
SEPARATE_AUTOCAST.register(gated_act_separate_fwd)


# ---- the eager path with gradients: the same implementation functions as the custom ops ----------
class _GatedActFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, activation, layout):
        y = _forward(gate_up, activation, layout)
        ctx.save_for_backward(gate_up)
        ctx.config = (activation, layout)
        return y

    @staticmethod
    def backward(ctx, dy):
        (gate_up,) = ctx.saved_tensors
        return _backward(dy, gate_up, *ctx.config), None, None


class _GatedActSeparateFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation):
        y = _forward_separate(gate, up, activation)
        ctx.save_for_backward(gate, up)
        ctx.activation = activation
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        need_dgate, need_dup = ctx.needs_input_grad[:2]
        dgate, dup = _backward_separate(dy, gate, up, ctx.activation, need_dgate, need_dup)
        return dgate, dup, None


_apply = function_apply(_GatedActFunction)
_apply_separate = function_apply(_GatedActSeparateFunction)


# ---- PyTorch's implementation (GPUs without fusekit kernels, set_fallback("always")) -------------
def _pytorch_gated(op: str, gate: Tensor, up: Tensor, name: str) -> Tensor:
    if name not in GATE_ACTIVATIONS:
        raise invalid_argument(op, "activation", "silu (SwiGLU), gelu_tanh or gelu_erf (GeGLU), or relu "
                               "(ReGLU)", name)
    return _fallback.activation(gate, name) * up


def _split(gate_up: Tensor, layout: str, op: str = "gated_act_forward") -> Tuple[Tensor, Tensor]:
    if layout == "halves":
        return gate_up.chunk(2, dim=-1)
    if layout == "interleaved":
        return gate_up[..., 0::2], gate_up[..., 1::2]
    raise invalid_argument(op, "layout", "fusekit.GatedLayout or one of 'halves', 'interleaved'", repr(layout))


# ---- functional forms ------------------------------------------------------------------------------
def gated_act(gate_up: Tensor, activation="silu", layout="halves") -> Tensor:
    """act(gate) * up from one (..., 2F) tensor gate_up, differentiable in gate_up; returns (..., F).

    layout: 'halves' (gate_up = [gate | up] along the last dimension, as torch.cat((gate, up), -1)
    or a fused gate-up projection's output splits with .chunk(2, -1)) or 'interleaved' (gate j at
    column 2j, up j at 2j + 1). activation: 'silu' (SwiGLU), 'gelu_tanh' or 'gelu_erf' (GeGLU),
    'relu' (ReGLU), or a fusekit.Activation.
    """
    name = activation_name("gated_act_forward", activation)
    layout = _layout_name("gated_act_forward", layout)
    if not _fallback.all_fusekit and _fallback.use_pytorch("gated_act_forward", gate_up):
        return _pytorch_gated("gated_act_forward", *_split(gate_up, layout), name)
    mode = eager_mode(gate_up)
    if mode == RECORD:
        return _apply(gate_up, name, layout)
    if mode == NO_GRAD:
        return _forward(gate_up, name, layout)
    reject_dtensors("gated_act", gate_up=gate_up)
    return gated_act_fwd(gate_up, name, layout)


def gated_act_separate(gate: Tensor, up: Tensor, activation="silu") -> Tensor:
    """act(gate) * up from two (..., F) tensors, differentiable in both: HF's
    act_fn(gate_proj(x)) * up_proj(x) as gated_act_separate(gate_proj(x), up_proj(x), "silu").
    activation: as gated_act's."""
    name = activation_name("gated_act_forward_separate", activation)
    if not _fallback.all_fusekit and _fallback.use_pytorch("gated_act_forward_separate", gate):
        return _pytorch_gated("gated_act_forward_separate", gate, up, name)
    mode = eager_mode(gate, up)
    if mode != CUSTOM_OP and autocast_active():
        gate, up = SEPARATE_AUTOCAST.eager(gate, up)
    if mode == RECORD:
        return _apply_separate(gate, up, name)
    if mode == NO_GRAD:
        return _forward_separate(gate, up, name)
    reject_dtensors("gated_act_separate", gate=gate, up=up)
    return gated_act_separate_fwd(gate, up, name)


# ---- modules ---------------------------------------------------------------------------------------
#: HF's hidden_act names of the gated activations -> fusekit's (GatedMLP takes either).
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu_erf", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_new": "gelu_tanh", "relu": "relu"}


def _gate_activation(activation) -> str:
    if isinstance(activation, str) and activation in HF_ACTIVATIONS:
        return HF_ACTIVATIONS[activation]
    name = activation_name("GatedMLP", activation)
    if name not in GATE_ACTIVATIONS:
        raise invalid_argument("GatedMLP", "activation", "one of " + ", ".join(
            sorted(set(GATE_ACTIVATIONS) | set(HF_ACTIVATIONS))), repr(activation))
    return name


class GatedMLP(torch.nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)) with the gated activation fused: the MLP of
    Llama-style models, with HF's LlamaMLP submodules and state_dict keys (gate_proj.weight,
    up_proj.weight, down_proj.weight, and their biases with bias=True), so that a LlamaMLP's
    state_dict loads into it. activation: a fusekit name ('silu', 'gelu_tanh', 'gelu_erf',
    'relu') or HF's hidden_act ('silu', 'swish', 'gelu', 'gelu_pytorch_tanh', 'gelu_new', 'relu')."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation="silu", bias: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.hidden_size = int(hidden_size)
        self.intermediate_size = int(intermediate_size)
        self.activation = _gate_activation(activation)
        factory = dict(device=device, dtype=dtype)
        self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, bias=bias, **factory)
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, bias=bias, **factory)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, bias=bias, **factory)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(gated_act_separate(self.gate_proj(x), self.up_proj(x), self.activation))

    def extra_repr(self) -> str:
        return f"activation={self.activation}"
