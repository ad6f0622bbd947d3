"""What fusekit.torch does with tensors on a GPU it has no kernels for (fusekit's kernels are
built for Hopper, compute capability 9.0).

Policies (set_fallback):
  'auto'   (default) fusekit's kernels where it has them; on another GPU, PyTorch's own
           implementation of the same computation, with one warning per op and device;
  'strict' fusekit's kernels or an UnsupportedError naming the GPU (no silent change of kernels);
  'always' PyTorch's implementation everywhere (comparisons, debugging).
CPU tensors run fusekit's float64 reference except under 'always'. The PyTorch implementations
compute the same function; their dropout masks come from PyTorch's generator, not from fusekit's
(seed, offset) Philox mapping.
"""
from __future__ import annotations

import warnings
from typing import Dict, Optional, Tuple

import torch

from .. import _C
from .._policy import POLICIES, decide

_policy = "auto"
_supported: Dict[int, bool] = {}
_warned = set()

#: True while every call may take fusekit's kernels without a per-call look at its device:
#: policy 'auto' and every visible GPU supported. None until the first call checks.
all_fusekit: Optional[bool] = None


def set_fallback(policy: str) -> None:
    """Chooses what happens on GPUs without fusekit kernels: 'auto', 'strict' or 'always'."""
    global _policy, all_fusekit
    if policy not in POLICIES:
        raise _C.InvalidArgumentError(
            f"fusekit.set_fallback: argument 'policy': expected one of {', '.join(POLICIES)}, "
            f"got {policy!r}")
    _policy = policy
    all_fusekit = None
    _warned.clear()


def get_fallback() -> str:
    return _policy


# The device queries are fusekit._C calls that torch.compile cannot trace; their results are fixed
# for the process, so dynamo runs them once and keeps the answer (a call under torch.compile before
# any eager call would otherwise break the graph).
@torch.compiler.assume_constant_result
def _device_supported(index: int) -> bool:
    s = _supported.get(index)
    if s is None:
        s = _supported[index] = bool(_C.cuda_device_supported(index))
    return s


# Under torch.compile Dynamo runs it when tracing and keeps its result as a constant (it cannot
# trace fusekit._C's functions): a compiled call may be the process's first fusekit call.
@torch.compiler.assume_constant_result
def _check_all() -> bool:
    global all_fusekit
    all_fusekit = _policy == "auto" and all(
        _device_supported(i) for i in range(_C.cuda_device_count()))
    return all_fusekit


def _describe(device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return f"GPU {index} ({torch.cuda.get_device_name(index)}, compute capability {major}.{minor})"


def use_pytorch(op: str, x: torch.Tensor) -> bool:
    """Whether `op` on x runs PyTorch's implementation; raises UnsupportedError under 'strict' on
    a GPU without fusekit kernels. One global check per call while every GPU is supported."""
    if all_fusekit or (all_fusekit is None and _check_all()):
        return False
    device = x.device
    supported = device.type == "cuda" and _device_supported(
        device.index if device.index is not None else torch.cuda.current_device())
    choice = decide(_policy, device.type, supported)
    if choice == "fusekit":
        return False
    if choice == "error":
        e = _C.UnsupportedError(
            f"fusekit.{op}: {_describe(device)} is not supported: fusekit's kernels run on compute "
            f"capability 9.0 (Hopper: H100, H200) and were built for sm_{_C.built_cuda_architectures()}; "
            "fusekit.torch.set_fallback('auto') runs PyTorch's implementation on such GPUs instead")
        e.op, e.argument, e.expected, e.got, e.kind = op, "", "", "", "unsupported"
        raise e
    key: Tuple[str, str] = (op, str(device))
    if _policy == "auto" and key not in _warned:
        _warned.add(key)
        warnings.warn(f"fusekit.{op}: no fusekit kernels for {_describe(device)}; running "
                      "PyTorch's implementation (fusekit.torch.set_fallback('strict') makes this "
                      "an error)", RuntimeWarning, stacklevel=3)
    return True


# ---- PyTorch's implementations of fusekit's functions -------------------------------------------
def activation(h: torch.Tensor, name: str, slope: float = 0.01) -> torch.Tensor:
    F = torch.nn.functional
    if name == "none":
        return h
    if name == "relu":
        return F.relu(h)
    if name == "gelu_erf":
        return F.gelu(h)
    if name == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if name == "squared_relu":
        return torch.square(F.relu(h))
    if name == "leaky_relu":
        return F.leaky_relu(h, slope)
    if name == "silu":
        return F.silu(h)
    raise _C.InvalidArgumentError(f"fusekit.activation: argument 'activation': expected an "
                                  f"activation name, got {name!r}")


def attention(q, k, v, bias, scale, mask, window, dropout_p, cu_seqlens_q, cu_seqlens_k):
    """fusekit.torch.attention's function in (B, S, H, D) layout (or packed with cu_seqlens),
    through torch.nn.functional.scaled_dot_product_attention with an explicit mask."""
    if cu_seqlens_q is not None:
        outs = []
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for b in range(len(cq) - 1):
            sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            bb = None if bias is None else \
                bias[b if bias.shape[0] > 1 else 0, :, :sq if bias.shape[2] > 1 else 1,
                     :sk if bias.shape[3] > 1 else 1][None]
            o = attention(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]],
                          v[None, ck[b]:ck[b + 1]], bb, scale, mask, window, dropout_p, None, None)
            outs.append(o[0])
        return torch.cat(outs, 0)
    sq, sk = q.shape[1], k.shape[1]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if kt.shape[1] != qt.shape[1]:
        group = qt.shape[1] // kt.shape[1]
        kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    d = 0 if mask == "causal_top_left" else sk - sq
    left, right = int(window[0]), int(window[1])
    if mask != "none":
        right = 0 if right < 0 else min(right, 0)
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if left >= 0:
        visible &= j >= i + d - left
    if right >= 0:
        visible &= j <= i + d + right
    additive = torch.zeros(sq, sk, dtype=torch.float32, device=q.device).masked_fill(
        ~visible, float("-inf"))
    if bias is not None:
        additive = additive + bias.float()
    additive = additive.to(q.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=additive, dropout_p=dropout_p, scale=scale)
    # Rows that see no key give 0, as fusekit's kernels do (SDPA gives NaN).
    seen = torch.isfinite(additive.float()).any(-1, keepdim=True)
    out = torch.where(seen, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out.transpose(1, 2)


def cross_entropy(input, target, ignore_index, label_smoothing, z_loss, reduction):
    """fusekit.torch.cross_entropy's function: PyTorch's row losses in float32 plus z * lse^2 for
    the rows not ignored, reduced as fusekit does (the mean of an all-ignored batch is 0)."""
    F = torch.nn.functional
    logits = input.float()
    loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="none",
                           label_smoothing=label_smoothing)
    counted = target != ignore_index
    if z_loss:
        lse = torch.logsumexp(logits, dim=1 if logits.dim() > 1 else 0)
        loss = loss + z_loss * lse.square() * counted
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / counted.sum().clamp_min(1)
    raise _C.InvalidArgumentError(f"fusekit.cross_entropy: argument 'reduction': expected one of "
                                  f"'none', 'mean', 'sum', got {reduction!r}")
def linear_cross_entropy(hidden, weight, bias, target, ignore_index, label_smoothing, z_loss, reduction):
    """fusekit.torch.linear_cross_entropy's function: the logits F.linear(hidden, weight, bias) in
    hidden's dtype (materialized), then cross_entropy above over their rows."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    loss = cross_entropy(logits.reshape(-1, weight.shape[0]), target.reshape(-1), ignore_index,
                         label_smoothing, z_loss, reduction)
    return loss.reshape(target.shape) if reduction == "none" else loss


def rope(q, k, position_ids, inv_freq, cos, sin, style, rotary_dim, theta, linear_scaling,
         attention_scaling):
    """fusekit.torch.rope's function (include/fusekit/rope.h) in PyTorch operations: the float32
    angles fl32(p) * inv_freq[i] (or the cos / sin tables' rows), the rotation in float32."""
    d = q.shape[-1]
    r = rotary_dim or d
    half = r // 2
    if position_ids is None:
        position_ids = torch.arange(q.shape[-3], device=q.device)
        if q.dim() == 4:
            position_ids = position_ids[None, :]
    if cos is not None:
        c, s = cos[position_ids], sin[position_ids]
    else:
        if inv_freq is None:
            theta32 = torch.tensor(theta, dtype=torch.float32).item()
            scaling32 = torch.tensor(linear_scaling, dtype=torch.float32).item()
            i = torch.arange(half, dtype=torch.float64, device=q.device)
            inv_freq = (theta32 ** (-2.0 * i / r) / scaling32).float()
        angle = position_ids.to(torch.float32)[..., None] * inv_freq
        c, s = torch.cos(angle), torch.sin(angle)
    c = (c * attention_scaling).unsqueeze(-2)  # shared by the heads
    s = (s * attention_scaling).unsqueeze(-2)

    def apply(x):
        xf = x.float()
        rot = xf[..., :r]
        if style == "rotate_half":
            x1, x2 = rot[..., :half], rot[..., half:]
            out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), -1).flatten(-2)
        return torch.cat((out, xf[..., r:]), -1).to(x.dtype)

    return apply(q), (apply(k) if k is not None else None)
