"""FP8 RMSNorm (include/fusekit/fp8_norm.h) as PyTorch custom ops (torch.ops.fusekit.*) with an
autograd formula and fake implementations, the functional form, group quantization, and
FP8RMSNorm: torch.nn.RMSNorm's constructor and state_dict with FP8 in and out.

The op reads x quantized to FP8 in groups of `group_size` along its last dimension (one scale per
group: x ~ q * scale) and writes y = RMSNorm(x) * weight four ways: y in bfloat16, qy in FP8 with
one per-tensor scale y_scale (qy * y_scale ~ y), and qy transposed (N, M) for the weight-gradient
GEMM of the next layer. The backward takes dy for y (bfloat16) and gives dx (bfloat16, the
gradient for the dequantized input) and dweight.

Gradients in PyTorch: y is the differentiable output (qy, qy_t, y_scale carry no gradient). When
x is a float tensor (float32 / float16 / bfloat16) it is quantized here (fp8_quantize) and dx
flows back to it unchanged (straight-through, as FP8 training treats its casts). An FP8 x cannot
receive a useful gradient (PyTorch casts gradients to the input's dtype): dx is not computed for
it, and weight still gets its gradient.

Ops (all return fresh tensors; nothing is mutated):
  fp8_rms_norm_fwd(x, x_scales?, weight?, eps, group_size, fp8_dtype)
      -> (y, qy, qy_t, y_scale, rstd, xq, xs)
         xq/xs: the FP8 input and its scales when x was quantized here, else empty (shape (0,))
  fp8_rms_norm_bwd(dy, xq, xs, weight?, rstd, group_size, need_dx, need_dweight) -> (dx, dweight)
weight None means ones (no affine weight); dweight comes back empty then.
"""
from __future__ import annotations

import numbers
from typing import NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .. import _C
from . import _fallback
from ._common import (
    reject_dtensors,
    names_allocation_failure,
    CUSTOM_OP,
    NAMESPACE,
    RECORD,
    eager_mode,
    empty_output,
    function_apply,
    invalid_argument,
    or_empty,
)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_CODES = {torch.float8_e4m3fn: _C.DType.f8e4m3, torch.float8_e5m2: _C.DType.f8e5m2}


def _fp8_code(fp8_dtype: torch.dtype):
    """The fusekit.DType of qy's format; an unsupported format is a clear error."""
    code = _FP8_CODES.get(fp8_dtype)
    if code is None:
        raise invalid_argument("fp8_rms_norm", "fp8_dtype", "torch.float8_e4m3fn or torch.float8_e5m2",
                               str(fp8_dtype))
    return code
_F32_EPS = torch.finfo(torch.float32).eps
_FINFO_EPS = {torch.float32: torch.finfo(torch.float32).eps,
              torch.float16: torch.finfo(torch.float16).eps,
              torch.bfloat16: torch.finfo(torch.bfloat16).eps}


class Fp8RMSNormOutput(NamedTuple):
    """What fp8_rms_norm / FP8RMSNorm return."""
    y: Tensor        #: bfloat16, x's shape: RMSNorm of the (dequantized) input; differentiable
    qy: Tensor       #: FP8 (fp8_dtype), x's shape: y / y_scale, saturated
    qy_t: Tensor     #: FP8 (N, M), M the rows of x: qy transposed
    y_scale: Tensor  #: float32, shape (1,): the per-tensor scale, qy * y_scale ~ y


def fp8_quantize(x: Tensor, group_size: int = _C.FP8_NORM_DEFAULT_GROUP_SIZE,
                 fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                 scale_dtype: torch.dtype = torch.float32) -> Tuple[Tensor, Tensor]:
    """Group quantization along the last dimension, the input format of fp8_rms_norm: returns
    (q, scales) with scales (..., N / group_size) = the group's max |x| / the format's largest
    finite value (at least the smallest normal float32), q = x / scale rounded to fp8_dtype and
    saturated, so that x ~ q * scale. Not differentiable (a cast)."""
    n = x.shape[-1] if x.dim() else 0
    if group_size <= 0 or n % group_size != 0:
        raise invalid_argument("fp8_quantize", "x", f"a last dimension that is a multiple of "
                               f"group_size {group_size}", f"shape {tuple(x.shape)}")
    fmax = torch.finfo(fp8_dtype).max
    groups = x.detach().float().reshape(*x.shape[:-1], n // group_size, group_size)
    scales = (groups.abs().amax(-1) / fmax).clamp_min(torch.finfo(torch.float32).tiny)
    scales = scales.to(scale_dtype)
    q = (groups / scales.float().unsqueeze(-1)).clamp(-fmax, fmax).to(fp8_dtype)
    return q.reshape(x.shape), scales


def _input(x: Tensor, x_scales: Optional[Tensor], group_size: int, fp8_dtype: torch.dtype):
    """(xq, xs, quantized here)."""
    if x.dtype in FP8_DTYPES:
        if x_scales is None:
            raise invalid_argument("fp8_rms_norm", "x_scales", "the group scales of the FP8 input x",
                                   "None")
        return x, x_scales, False
    if x_scales is not None:
        raise invalid_argument("fp8_rms_norm", "x_scales", "None for a float x (it is quantized "
                               "here)", f"scales with x of dtype {x.dtype}")
    q, s = fp8_quantize(x, group_size, fp8_dtype)
    return q, s, True


def _ones_weight(xq: Tensor) -> Tensor:
    """The weight of a norm without an affine weight."""
    return torch.ones(xq.shape[-1] if xq.dim() else 0, dtype=torch.bfloat16, device=xq.device)


# ---- implementations (real tensors) -------------------------------------------------------------
# fusekit._C allocates every output, gradient and the workspace through PyTorch's allocator in the
# same call: one Python-level allocation per output would cost more host time than the op.
@names_allocation_failure("fp8_rms_norm_forward")
def _forward(xq: Tensor, xs: Tensor, weight: Optional[Tensor], eps: float, group_size: int,
             fp8_dtype: torch.dtype, rstd_tensor: bool = False):
    """(y, qy, qy_t, y_scale, rstd) with rstd a tensor when rstd_tensor, else an opaque capsule."""
    # fusekit._C makes a weight of any layout contiguous.
    return _C._fp8_rms_norm_forward_alloc(xq, xs, weight if weight is not None else
                                          _ones_weight(xq), eps, group_size, _fp8_code(fp8_dtype),
                                          rstd_tensor)


@names_allocation_failure("fp8_rms_norm_backward")
def _backward(dy: Tensor, xq: Tensor, xs: Tensor, weight: Optional[Tensor], rstd, group_size: int,
              need_dx: bool, need_dweight: bool):
    """(dx, dweight), None where not asked for (dweight always None without a weight)."""
    need_dweight = need_dweight and weight is not None
    if not (need_dx or need_dweight):
        return None, None
    return _C._fp8_rms_norm_backward_alloc(dy, xq, xs, weight if weight is not None else
                                           _ones_weight(xq), rstd, group_size, need_dx,
                                           need_dweight)


# ---- custom ops --------------------------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::fp8_rms_norm_fwd", mutates_args=())
def fp8_rms_norm_fwd(x: Tensor, x_scales: Optional[Tensor], weight: Optional[Tensor], eps: float,
                     group_size: int, fp8_dtype: torch.dtype
                     ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    xq, xs, quantized = _input(x, x_scales, group_size, fp8_dtype)
    # rstd must be a tensor here: the op returns it.
    y, qy, qy_t, y_scale, rstd = _forward(xq, xs, weight, eps, group_size, fp8_dtype, True)
    if not quantized:
        xq, xs = empty_output(fp8_dtype, x.device), empty_output(torch.float32, x.device)
    return y, qy, qy_t, y_scale, rstd, xq, xs


@fp8_rms_norm_fwd.register_fake
def _(x, x_scales, weight, eps, group_size, fp8_dtype):
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    cols = x.shape[-1] if x.dim() else 0
    y = torch.empty_like(x, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
    qy = torch.empty_like(x, dtype=fp8_dtype, memory_format=torch.contiguous_format)
    qy_t = x.new_empty((cols, rows), dtype=fp8_dtype)
    y_scale = x.new_empty((1,), dtype=torch.float32)
    rstd = x.new_empty((rows,), dtype=torch.float32)
    if x.dtype in FP8_DTYPES:
        xq, xs = x.new_empty((0,), dtype=fp8_dtype), x.new_empty((0,), dtype=torch.float32)
    else:
        xq = torch.empty_like(x, dtype=fp8_dtype, memory_format=torch.contiguous_format)
        xs = x.new_empty((*x.shape[:-1], cols // group_size), dtype=torch.float32)
    return y, qy, qy_t, y_scale, rstd, xq, xs


@torch.library.custom_op(f"{NAMESPACE}::fp8_rms_norm_bwd", mutates_args=())
def fp8_rms_norm_bwd(dy: Tensor, xq: Tensor, xs: Tensor, weight: Optional[Tensor], rstd: Tensor,
                     group_size: int, need_dx: bool, need_dweight: bool) -> Tuple[Tensor, Tensor]:
    dx, dweight = _backward(dy, xq, xs, weight, rstd, group_size, need_dx, need_dweight)
    wdtype = weight.dtype if weight is not None else torch.bfloat16
    return or_empty(dx, torch.bfloat16, xq.device), or_empty(dweight, wdtype, xq.device)


@fp8_rms_norm_bwd.register_fake
def _(dy, xq, xs, weight, rstd, group_size, need_dx, need_dweight):
    dx = torch.empty_like(xq, dtype=torch.bfloat16, memory_format=torch.contiguous_format) \
        if need_dx else xq.new_empty((0,), dtype=torch.bfloat16)
    if need_dweight and weight is not None:
        dweight = torch.empty_like(weight, memory_format=torch.contiguous_format)
    else:
        dweight = xq.new_empty((0,), dtype=weight.dtype if weight is not None else torch.bfloat16)
    return dx, dweight


def _setup(ctx, inputs, output):
    x, x_scales, weight, _eps, group_size, _fp8_dtype = inputs
    _y, qy, qy_t, y_scale, rstd, xq, xs = output
    ctx.mark_non_differentiable(qy, qy_t, y_scale, rstd, xq, xs)
    ctx.x_is_fp8 = x.dtype in FP8_DTYPES
    if ctx.x_is_fp8:
        xq, xs = x, x_scales
    ctx.save_for_backward(xq, xs, weight, rstd)
    ctx.group_size = group_size


def _autograd_backward(ctx, dy, *_unused):
    xq, xs, weight, rstd = ctx.saved_tensors
    need_dx = ctx.needs_input_grad[0] and not ctx.x_is_fp8
    need_dweight = ctx.needs_input_grad[2] and weight is not None
    if dy is None or not (need_dx or need_dweight):
        return None, None, None, None, None, None
    dx, dweight = fp8_rms_norm_bwd(dy, xq, xs, weight, rstd, ctx.group_size, need_dx,
                                   need_dweight)
    return (dx if need_dx else None), None, (dweight if need_dweight else None), None, None, None


fp8_rms_norm_fwd.register_autograd(_autograd_backward, setup_context=_setup)


class _Fp8RMSNormFunction(torch.autograd.Function):
    """The eager path with gradients. Inputs x and weight; extra = (x_scales, eps,
    group_size, fp8_dtype). Returns (y, (qy, qy_t, y_scale)): the inner tuple passes through
    autograd untouched, so the FP8 outputs carry no gradient without the cost of marking them.
    Written for host time (python/benchmarks/overhead.py): one C++ call allocates and computes,
    and the state for the backward is one attribute."""

    @staticmethod
    def forward(ctx, x, weight, extra):
        x_scales, eps, group_size, fp8_dtype = extra
        if x_scales is not None and x.dtype in FP8_DTYPES:  # FP8 input: saved as it came
            y, qy, qy_t, y_scale, rstd = _forward(x, x_scales, weight, eps, group_size, fp8_dtype)
            ctx.save_for_backward(weight, x)
            ctx.state = (None, x_scales, rstd, group_size)
        else:  # quantized here: the FP8 copy is an intermediate, a plain attribute suffices
            xq, xs, _ = _input(x, x_scales, group_size, fp8_dtype)
            y, qy, qy_t, y_scale, rstd = _forward(xq, xs, weight, eps, group_size, fp8_dtype)
            ctx.save_for_backward(weight)
            ctx.state = (xq, xs, rstd, group_size)
        return y, (qy, qy_t, y_scale)

    @staticmethod
    def backward(ctx, dy, *_unused):
        xq, xs, rstd, group_size = ctx.state
        saved = ctx.saved_tensors
        need_dx = xq is not None and ctx.needs_input_grad[0]  # an FP8 x gets no gradient
        if xq is None:
            xq = saved[1]
        dx, dweight = _backward(dy, xq, xs, saved[0], rstd, group_size, need_dx,
                                ctx.needs_input_grad[1])
        return dx, dweight, None


_apply = function_apply(_Fp8RMSNormFunction)


# ---- functional form and module ----------------------------------------------------------------
_ShapeLike = Union[int, Sequence[int], torch.Size]


def fp8_rms_norm(x: Tensor, normalized_shape: _ShapeLike, weight: Optional[Tensor] = None,
                 eps: Optional[float] = None, *, x_scales: Optional[Tensor] = None,
                 group_size: int = _C.FP8_NORM_DEFAULT_GROUP_SIZE,
                 fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> Fp8RMSNormOutput:
    """RMSNorm with FP8 in and out (see the module docstring): torch.nn.functional.rms_norm's
    arguments plus x_scales (the group scales of an FP8 x; None when x is a float tensor, which is
    then quantized here with fp8_quantize into fp8_dtype), group_size and fp8_dtype (the format
    of qy: torch.float8_e4m3fn or torch.float8_e5m2). normalized_shape is x's last dimension N
    (a multiple of group_size, at most fusekit.FP8_NORM_MAX_COLS). weight: (N) bfloat16 or
    float32, or None for ones. eps=None: torch.finfo(x.dtype).eps for a float x, float32's for an
    FP8 x. Returns Fp8RMSNormOutput(y, qy, qy_t, y_scale)."""
    if type(normalized_shape) is int:
        shape = (normalized_shape,)
    elif type(normalized_shape) is tuple:
        shape = normalized_shape
    else:
        shape = (normalized_shape,) if isinstance(normalized_shape, numbers.Integral) \
            else tuple(normalized_shape)
    if len(shape) != 1 or x.dim() < 1 or x.shape[-1] != shape[0]:
        raise invalid_argument("fp8_rms_norm", "normalized_shape",
                               "x's last dimension alone (FP8 RMSNorm normalizes one dimension)",
                               f"{shape} for x of shape {tuple(x.shape)}")
    eps = _FINFO_EPS.get(x.dtype, _F32_EPS) if eps is None else float(eps)
    group_size = int(group_size)
    if not _fallback.all_fusekit and _fallback.use_pytorch("fp8_rms_norm", x):
        return _fp8_rms_norm_pytorch(x, x_scales, weight, eps, group_size, fp8_dtype)
    mode = eager_mode(x, weight)
    if mode == CUSTOM_OP:
        reject_dtensors("fp8_rms_norm", x=x, weight=weight, x_scales=x_scales)
        y, qy, qy_t, y_scale, _, _, _ = fp8_rms_norm_fwd(x, x_scales, weight, eps, group_size,
                                                          fp8_dtype)
        return Fp8RMSNormOutput(y, qy, qy_t, y_scale)
    if mode == RECORD:
        y, (qy, qy_t, y_scale) = _apply(x, weight, (x_scales, eps, group_size, fp8_dtype))
        return Fp8RMSNormOutput(y, qy, qy_t, y_scale)
    if x.dtype in FP8_DTYPES and x_scales is not None:
        y, qy, qy_t, y_scale, _ = _forward(x, x_scales, weight, eps, group_size, fp8_dtype)
    else:
        xq, xs, _ = _input(x, x_scales, group_size, fp8_dtype)
        y, qy, qy_t, y_scale, _ = _forward(xq, xs, weight, eps, group_size, fp8_dtype)
    return Fp8RMSNormOutput(y, qy, qy_t, y_scale)


def _fp8_rms_norm_pytorch(x, x_scales, weight, eps, group_size, fp8_dtype) -> Fp8RMSNormOutput:
    """The same computation in PyTorch operations (GPUs without fusekit kernels)."""
    if x.dtype in FP8_DTYPES:
        if x_scales is None:
            raise invalid_argument("fp8_rms_norm", "x_scales", "the group scales of the FP8 input x",
                                   "None")
        n = x.shape[-1]
        xf = (x.float().reshape(*x.shape[:-1], n // group_size, group_size)
              * x_scales.float().unsqueeze(-1)).reshape(x.shape)
    else:
        xq, xs, _ = _input(x, x_scales, group_size, fp8_dtype)
        return _fp8_rms_norm_pytorch(xq, xs, weight, eps, group_size, fp8_dtype)
    y = torch.nn.functional.rms_norm(xf, (xf.shape[-1],), None if weight is None else weight.float(),
                                     eps).to(torch.bfloat16)
    fmax = torch.finfo(fp8_dtype).max
    y_scale = (y.float().abs().amax() / fmax).clamp_min(torch.finfo(torch.float32).tiny).reshape(1)
    qy = (y.float() / y_scale).clamp(-fmax, fmax).to(fp8_dtype)
    qy_t = qy.reshape(-1, qy.shape[-1]).t().contiguous()
    return Fp8RMSNormOutput(y, qy, qy_t, y_scale)


class FP8RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm's constructor (normalized_shape, eps, elementwise_affine, device, dtype),
    parameters and state_dict keys, with FP8 in and out: forward(x, x_scales=None) returns
    Fp8RMSNormOutput(y, qy, qy_t, y_scale) (see fp8_rms_norm). Keyword-only extras: group_size
    and fp8_dtype. weight may be bfloat16 or float32 (the default dtype float32 is fine).
    normalized_shape is one dimension. Not a registered drop-in: it returns a tuple and quantizes
    its input."""

    def __init__(self, normalized_shape: _ShapeLike, eps: Optional[float] = None,
                 elementwise_affine: bool = True, device=None, dtype=None, *,
                 group_size: int = _C.FP8_NORM_DEFAULT_GROUP_SIZE,
                 fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)
        if len(self.normalized_shape) != 1:
            raise invalid_argument("FP8RMSNorm", "normalized_shape", "one dimension",
                                   str(tuple(self.normalized_shape)))
        if fp8_dtype not in FP8_DTYPES:
            raise invalid_argument("FP8RMSNorm", "fp8_dtype",
                                   "torch.float8_e4m3fn or torch.float8_e5m2", str(fp8_dtype))
        self.group_size = int(group_size)
        self.fp8_dtype = fp8_dtype

    def forward(self, x: Tensor, x_scales: Optional[Tensor] = None) -> Fp8RMSNormOutput:
        return fp8_rms_norm(x, self.normalized_shape, self.weight, self.eps, x_scales=x_scales,
                            group_size=self.group_size, fp8_dtype=self.fp8_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}, fp8_dtype={self.fp8_dtype}"
