"""Fused bias + activation + dropout as PyTorch custom ops (torch.ops.fusekit.*) with an autograd
formula and fake implementations, and the functional form.

Ops (all return fresh tensors; nothing is mutated):
  bias_act_dropout_fwd(x, bias?, activation, p, seed, offset, slope) -> y
  bias_act_dropout_bwd(dy, x, bias?, activation, p, seed, offset, slope, need_dx, need_dbias)
      -> (dx, dbias)             (a gradient not asked for comes back empty, shape (0,))
x is (..., N); bias is (N) in x's dtype or float32; dbias has bias's dtype. seed is a 0-d int64
CPU tensor (the 64 bits of the unsigned seed; see _common.seed_tensor), so that a seed drawn
inside a traced graph reaches the op without a graph break. The dropout mask is a pure function
of (seed, offset, p) and the element's index (include/fusekit/dropout.h), so the backward
regenerates it instead of storing it: only x, bias and the seed are saved.
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
    KEEP,
    NAMESPACE,
    RECORD,
    U64_MASK,
    AutocastRule,
    activation_name,
    autocast_active,
    draw_seed,
    eager_mode,
    empty_output,
    function_apply,
    invalid_argument,
    or_empty,
    seed_tensor,
    seed_value,
)


# ---- implementations shared by the custom ops and the eager path -------------------------------
@names_allocation_failure("bias_act_dropout_forward")
def _forward(x: Tensor, bias: Optional[Tensor], activation: str, p: float, seed: int, offset: int,
             slope: float) -> Tensor:
    x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    y = torch.empty_like(x)
    _C.bias_act_dropout_forward(x, bias, activation, p, seed & U64_MASK, offset & U64_MASK, y,
                                None, slope)
    return y


@names_allocation_failure("bias_act_dropout_backward")
def _backward(dy: Tensor, x: Tensor, bias: Optional[Tensor], activation: str, p: float, seed: int,
              offset: int, slope: float, need_dx: bool,
              need_dbias: bool) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    x, dy = x.contiguous(), dy.contiguous()
    dx = torch.empty_like(x) if need_dx else None
    dbias = None
    if bias is not None:
        bias = bias.contiguous()
        if need_dbias:
            dbias = torch.empty_like(bias)
    if dx is None and dbias is None:
        return None, None
    # workspace='auto': fusekit._C queries and allocates it through PyTorch's allocator.
    _C.bias_act_dropout_backward(dy, x, bias, activation, p, seed & U64_MASK, offset & U64_MASK,
                                 dx, dbias, "auto", slope)
    return dx, dbias


# ---- custom ops --------------------------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::bias_act_dropout_fwd", mutates_args=())
def bias_act_dropout_fwd(x: Tensor, bias: Optional[Tensor], activation: str, p: float, seed: Tensor,
                         offset: int, slope: float) -> Tensor:
    return _forward(x, bias, activation, p, seed_value(seed), offset, slope)


@bias_act_dropout_fwd.register_fake
def _(x, bias, activation, p, seed, offset, slope):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op(f"{NAMESPACE}::bias_act_dropout_bwd", mutates_args=())
def bias_act_dropout_bwd(dy: Tensor, x: Tensor, bias: Optional[Tensor], activation: str, p: float,
                         seed: Tensor, offset: int, slope: float, need_dx: bool,
                         need_dbias: bool) -> Tuple[Tensor, Tensor]:
    dx, dbias = _backward(dy, x, bias, activation, p, seed_value(seed), offset, slope, need_dx,
                          need_dbias)
    bias_dtype = bias.dtype if bias is not None else x.dtype
    return or_empty(dx, x.dtype, x.device), or_empty(dbias, bias_dtype, x.device)


@bias_act_dropout_bwd.register_fake
def _(dy, x, bias, activation, p, seed, offset, slope, need_dx, need_dbias):
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if need_dx else \
        empty_output(x.dtype, x.device)
    bias_dtype = bias.dtype if bias is not None else x.dtype
    dbias = x.new_empty(x.shape[-1] if need_dbias and bias is not None else 0, dtype=bias_dtype)
    return dx, dbias


def _setup(ctx, inputs, output):
    x, bias, activation, p, seed, offset, slope = inputs
    ctx.save_for_backward(x, bias, seed)
    ctx.config = (activation, p, offset, slope)


def _autograd_backward(ctx, dy):
    x, bias, seed = ctx.saved_tensors
    need_dx, need_dbias = ctx.needs_input_grad[:2]
    need_dbias = need_dbias and bias is not None
    if dy is None or not (need_dx or need_dbias):
        return None, None, None, None, None, None, None
    activation, p, offset, slope = ctx.config
    dx, dbias = bias_act_dropout_bwd(dy, x, bias, activation, p, seed, offset, slope, need_dx,
                                     need_dbias)
    return (dx if need_dx else None, dbias if need_dbias else None,
            None, None, None, None, None)


bias_act_dropout_fwd.register_autograd(_autograd_backward, setup_context=_setup)

#: Under torch.autocast x keeps its dtype (the op computes in float32 and rounds once to it) and
#: bias goes in as float32 or x's dtype, as the op takes it (PyTorch's x + bias would promote a
#: bfloat16 x to float32 with a float32 bias; the fused op keeps x's dtype, as a linear's bias).
AUTOCAST = AutocastRule((0,), cuda=KEEP, cpu=KEEP, params=(1,))
AUTOCAST.register(bias_act_dropout_fwd)


class _BiasActDropoutFunction(torch.autograd.Function):
    """The eager path with gradients: the same implementation functions as the custom ops."""

    @staticmethod
    def forward(ctx, x, bias, activation, p, seed, offset, slope):
        y = _forward(x, bias, activation, p, seed, offset, slope)
        ctx.save_for_backward(x, bias)
        ctx.config = (activation, p, seed, offset, slope)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        need_dx, need_dbias = ctx.needs_input_grad[:2]
        dx, dbias = _backward(dy, x, bias, *ctx.config, need_dx,
                              need_dbias and bias is not None)
        return dx, dbias, None, None, None, None, None


_apply = function_apply(_BiasActDropoutFunction)


# ---- functional form ---------------------------------------------------------------------------
def bias_act_dropout(x: Tensor, bias: Optional[Tensor], activation="none", p: float = 0.0,
                     seed: Optional[int] = None, offset: int = 0, training: bool = True,
                     slope: float = 0.01) -> Tensor:
    """dropout_p(act(x + bias)) in one pass, differentiable in x and bias.

    activation: fusekit.Activation or its name ('none', 'relu', 'gelu_erf', 'gelu_tanh',
    'squared_relu', 'leaky_relu' with negative slope `slope`, 'silu'). p: drop probability in
    [0, 1); training=False (or p = 0) turns dropout off. The mask is a function of (seed, offset)
    (seed any 64-bit value, offset in [0, 2^63) through the custom op): give each call that needs
    an independent mask its own pair, and the backward regenerates it. seed=None draws a fresh
    seed from PyTorch's CPU generator (torch.manual_seed makes runs reproducible); under
    torch.compile the draw is an op of the graph: a fresh mask every run, no graph break.
    """
    name = activation_name("bias_act_dropout", activation)
    p = float(p) if training else 0.0
    if not _fallback.all_fusekit and _fallback.use_pytorch("bias_act_dropout", x):
        h = _fallback.activation(x if bias is None else x + bias, name, float(slope))
        return torch.nn.functional.dropout(h, p, training=p > 0.0)
    offset, slope = int(offset), float(slope)
    mode = eager_mode(x, bias)
    if mode == CUSTOM_OP:
        reject_dtensors("bias_act_dropout", x=x, bias=bias)
        return bias_act_dropout_fwd(x, bias, name, p, seed_tensor(seed, p > 0.0), offset, slope)
    # A fresh seed from PyTorch's CPU generator, so that torch.manual_seed reproduces runs.
    seed = (draw_seed() if p > 0.0 else 0) if seed is None else seed_value(seed)
    if autocast_active():
        x, bias = AUTOCAST.eager(x, bias)
    if mode == RECORD:
        return _apply(x, bias, name, p, seed, offset, slope)
    return _forward(x, bias, name, p, seed, offset, slope)


# ---- modules -----------------------------------------------------------------------------------
class Dropout(torch.nn.Dropout):
    """torch.nn.Dropout with fusekit's kernel: same constructor (p, inplace), no parameters or
    state; active in training mode only. Each call draws a fresh seed from PyTorch's CPU generator
    (torch.manual_seed makes runs reproducible); the mask is regenerated in the backward, never
    stored. inplace=True is accepted for compatibility, but the result is always a new tensor.
    Not a registered drop-in: its masks differ from PyTorch's (same distribution); patch() swaps
    it in for torch.nn.Dropout unless asked not to (dropout=False)."""

    def forward(self, x: Tensor) -> Tensor:
        return bias_act_dropout(x, None, "none", self.p, training=self.training)


class BiasActDropout(torch.nn.Module):
    """y = dropout_p(act(x + bias)) in one pass, with a learnable bias of num_features (x's last
    dimension) initialized to zeros, or none (bias=False). activation: a fusekit.Activation or its
    name ('none', 'relu', 'gelu_erf', 'gelu_tanh', 'squared_relu', 'leaky_relu', 'silu'); slope:
    leaky_relu's negative slope. Dropout applies in training mode only, with a fresh seed per call
    as in Dropout. state_dict: 'bias' (as the bias of a torch.nn.Linear it would follow)."""

    def __init__(self, num_features: int, activation="gelu_tanh", p: float = 0.1,
                 bias: bool = True, slope: float = 0.01, device=None, dtype=None) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise invalid_argument("BiasActDropout", "p", "a drop probability in [0, 1)", str(p))
        self.num_features = int(num_features)
        self.activation = activation_name("bias_act_dropout", activation)
        self.p = float(p)
        self.slope = float(slope)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(num_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        return bias_act_dropout(x, self.bias, self.activation, self.p, training=self.training,
                                slope=self.slope)

    def extra_repr(self) -> str:
        return (f"{self.num_features}, activation={self.activation}, p={self.p}, "
                f"bias={self.bias is not None}" + (f", slope={self.slope}"
                                                   if self.activation == "leaky_relu" else ""))
