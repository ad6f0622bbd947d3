"""fusekit.torch.patch(model): a model's modules retargeted to fusekit in place, Hugging Face
transformers models included (GPT-2, Llama, Mistral, Qwen2, Qwen3, Gemma and the models that share
their modules).

What is patched, each part recognised by what it computes rather than by its class name where a
cheap check can tell:
  norms       torch.nn.LayerNorm / RMSNorm (fusekit's drop-ins), and any module class named
              *RMSNorm or *LayerNorm holding a weight (and a bias) and an eps (eps or
              variance_epsilon) whose output on a probe input is RMSNorm(x) * w (Llama, Mistral,
              Qwen2, Qwen3 and its QK-norm), RMSNorm(x) * (1 + w) (Gemma) or LayerNorm
  linear      Hugging Face's Conv1D (GPT-2: weight stored (in, out)) through fusekit's linear on the
              transposed view of its weight
  mlp         gated MLPs down(act(gate(x)) * up(x)) (gated_act_separate) and plain ones
              drop(proj(act(fc(x)))) (the activation fused into fc's linear), found by tracing the
              module's forward with torch.fx and probing its activation
  rope        the attention modules whose forward calls their modeling file's
              apply_rotary_pos_emb, when that function's output on a probe input is fusekit's
              (the forward runs with fusekit's apply_rotary_pos_emb in its place; the modeling
              file itself is not touched)
  attention   transformers' AttentionInterface: the model runs attention "fusekit" (causal and
              padding masks as for "sdpa", GQA, sliding windows through the mask, dropout)
  dropout     torch.nn.Dropout (fusekit's Dropout: the mask is regenerated in the backward)
  loss        the causal-LM loss (fusekit's cross_entropy on the logits, float32 from logits of any
              dtype) and torch.nn.CrossEntropyLoss modules
  lm_head     causal-LM models whose forward is the base model, lm_head (an nn.Linear, tied or
              not, bias or not) and the causal-LM loss: in training (model.train()) with labels
              given as keywords, the loss comes from the last hidden states and lm_head's
              parameters through fusekit's linear_cross_entropy, the (tokens, vocab) logits never
              materialized, and the output's `logits` is None; without labels, or in eval mode,
              the forward is the model's own (logits returned). Not where the logits are
              post-processed (Gemma2/3's final_logit_softcapping, any other step in the forward)
Parameters, buffers and state_dict keys stay as they are, so patching works before or after the
weights are loaded (on the meta device too) and state_dicts move freely between patched and
unpatched models. The probes run a module's forward (its hooks too) on small CPU tensors with
probe parameters in place of its own; nothing of the module's is read or written. Patched modules
get a subclass of their own class (isinstance holds): pickle a patched model's state_dict, not the
module objects.
"""
from __future__ import annotations

import dataclasses
import inspect
import operator
import types
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from . import _fallback
from ._common import DROP_INS
from .attention import scaled_dot_product_attention
from .bias_act_dropout import Dropout
from .cross_entropy import cross_entropy
from .gated_act import gated_act_separate
from .linear import linear as linear_op
from .linear_cross_entropy import linear_cross_entropy
from .norm import layer_norm, rms_norm
from .rope import apply_rotary_pos_emb

F = torch.nn.functional

#: The name fusekit's attention is registered under in transformers' AttentionInterface.
ATTENTION_NAME = "fusekit"


# ---- the report --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PatchEntry:
    name: str    #: the module's name in the model ("" for the model itself)
    target: str  #: what it was: the module's class, or a model-level function
    detail: str  #: what runs now, or why it was left as it is


class PatchReport:
    """What patch() did: `patched` and `not_patched` (lists of PatchEntry). Prints grouped by
    (target, detail), with the modules of each group."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.patched: List[PatchEntry] = []
        self.not_patched: List[PatchEntry] = []

    def _add(self, where: List[PatchEntry], name: str, target: str, detail: str) -> None:
        where.append(PatchEntry(name, target, detail))

    def __str__(self) -> str:
        lines = [f"fusekit.torch.patch({self.model}): {len(self.patched)} patched, "
                 f"{len(self.not_patched)} not patched"]
        for title, entries in (("patched", self.patched), ("not patched", self.not_patched)):
            groups: Dict[Tuple[str, str], List[str]] = {}
            for e in entries:
                groups.setdefault((e.target, e.detail), []).append(e.name or "(model)")
            if groups:
                lines.append(f"  {title}:")
            for (target, detail), names in groups.items():
                more = f", ... ({len(names)} modules)" if len(names) > 3 else ""
                shown = ", ".join(names[:3]) + more
                lines.append(f"    {target}: {detail}  [{shown}]")
        return "\n".join(lines)

    __repr__ = __str__


# ---- patched classes ---------------------------------------------------------------------------
_SUBCLASSES: Dict[tuple, type] = {}


def _patched_class(cls: type, key: tuple, forward: Callable, attributes: dict) -> type:
    """A subclass of cls (one per key) whose forward is `forward`; attributes go on the class.
    `_fusekit_patch` marks it (patch() leaves marked modules alone)."""
    sub = _SUBCLASSES.get((cls,) + key)
    if sub is None:
        sub = type(f"Fusekit{cls.__name__}", (cls,),
                   dict(attributes, forward=forward, _fusekit_patch=key,
                        __module__=cls.__module__, __doc__=cls.__doc__))
        _SUBCLASSES[(cls,) + key] = sub
    return sub


def _retarget(module: torch.nn.Module, cls: type) -> None:
    module.__class__ = cls


# ---- norms -------------------------------------------------------------------------------------
def _eps_attribute(module: torch.nn.Module) -> Optional[str]:
    for attr in ("variance_epsilon", "eps"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return attr
    return None


def _probe(module: torch.nn.Module, params: Dict[str, Tensor], *args):
    """module's output for `args` with `params` in place of its own (CPU float32 probes: the
    module may live on the meta device or a GPU), or None where it fails."""
    try:
        with torch.no_grad():
            return torch.func.functional_call(module, params, args)
    except Exception:  # any failure means: not the function we look for
        return None


def _close(got, want: Tensor) -> bool:
    return isinstance(got, Tensor) and got.shape == want.shape and \
        torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)


def _rms(x: Tensor, eps: float) -> Tensor:
    x = x.double()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def _norm_kind(module: torch.nn.Module) -> Tuple[Optional[str], str]:
    """('rms_scale' | 'rms_offset' | 'layer_norm', eps attribute) for a norm module fusekit
    computes, (None, why not) otherwise. A probe input at two scales (eps matters at the small
    one)."""
    name = type(module).__name__
    is_rms = name.endswith("RMSNorm")
    weight = module._parameters.get("weight")
    bias = module._parameters.get("bias")
    expected = {"weight", "bias"} if not is_rms and bias is not None else {"weight"}
    if weight is None or weight.dim() != 1:
        return None, "no 1-D weight"
    if set(module._parameters) - {"bias"} != {"weight"} or (is_rms and bias is not None) or \
            list(module.buffers()) or list(module.children()):
        return None, "state other than the norm's weight" + ("" if is_rms else " and bias")
    eps_attr = _eps_attribute(module)
    if eps_attr is None:
        return None, "no eps or variance_epsilon attribute"
    eps, n = float(getattr(module, eps_attr)), weight.shape[0]
    gen = torch.Generator().manual_seed(1234)
    w = (torch.rand(n, generator=gen) + 0.5) * torch.randn(n, generator=gen).sign()
    b = torch.randn(n, generator=gen)
    params = {"weight": w} if "bias" not in expected else {"weight": w, "bias": b}
    outs = []
    for scale in (1.0, 1e-3):
        x = torch.randn(3, n, generator=gen) * scale
        outs.append((x, _probe(module, params, x)))
    candidates = {"layer_norm": lambda x: F.layer_norm(x.double(), (n,), w.double(), b.double()
                                                       if "bias" in expected else None, eps)} \
        if not is_rms else {"rms_scale": lambda x: _rms(x, eps) * w.double(),
                            "rms_offset": lambda x: _rms(x, eps) * (1.0 + w.double())}
    for kind, fn in candidates.items():
        if all(_close(y, fn(x)) for x, y in outs):
            return kind, eps_attr
    return None, "its output is none of fusekit's norms on a probe input"


def _rms_scale_forward(self, x: Tensor) -> Tensor:
    """weight * RMSNorm(x) as Llama's RMSNorm: the normalized x rounded to x's dtype, times the
    weight in their common dtype (one fused pass when the dtypes agree)."""
    w = self.weight
    eps = getattr(self, self._fusekit_eps)
    if w.dtype == x.dtype:
        return rms_norm(x, (x.shape[-1],), w, eps)
    return w * rms_norm(x, (x.shape[-1],), None, eps)


def _rms_offset_forward(self, x: Tensor) -> Tensor:
    """(1 + weight) * RMSNorm(x) in float32, rounded once to x's dtype (Gemma's RMSNorm)."""
    return rms_norm(x, (x.shape[-1],), 1.0 + self.weight.float(), getattr(self, self._fusekit_eps))


def _layer_norm_forward(self, x: Tensor) -> Tensor:
    return layer_norm(x, (x.shape[-1],), self.weight, getattr(self, "bias", None),
                      getattr(self, self._fusekit_eps))


_NORM_FORWARDS = {"rms_scale": (_rms_scale_forward, "fusekit rms_norm (x_hat * weight)"),
                  "rms_offset": (_rms_offset_forward, "fusekit rms_norm (x_hat * (1 + weight))"),
                  "layer_norm": (_layer_norm_forward, "fusekit layer_norm")}


# ---- Conv1D (weight stored (in, out)) -------------------------------------------------------
def _is_conv1d(module: torch.nn.Module) -> bool:
    """Hugging Face's Conv1D (or its patched subclass)."""
    return any(c.__name__ == "Conv1D" and c.__module__.startswith("transformers")
               for c in type(module).__mro__) and \
        isinstance(getattr(module, "weight", None), Tensor) and module.weight.dim() == 2


def _conv1d_forward(self, x: Tensor) -> Tensor:
    return linear_op(x, self.weight.t(), self.bias)


def _linear_with_activation(module: torch.nn.Module, x: Tensor, activation: str) -> Tensor:
    """act(module(x)) for an nn.Linear or a Conv1D, the activation fused into the GEMM."""
    weight = module.weight.t() if _is_conv1d(module) else module.weight
    return linear_op(x, weight, module.bias, activation)


# ---- MLPs --------------------------------------------------------------------------------------
_ACTIVATIONS = ("silu", "gelu_tanh", "gelu_erf", "relu", "squared_relu")
_GATED_ACTIVATIONS = ("silu", "gelu_tanh", "gelu_erf", "relu")


def _activation_of(module: torch.nn.Module) -> Optional[str]:
    """fusekit's name for the elementwise function `module` computes (probed on [-6, 6]), or
    None."""
    if list(module.parameters()) or list(module.buffers()) or list(module.children()):
        return None
    x = torch.linspace(-6.0, 6.0, 1201)
    y = _probe(module, {}, x)
    for name in _ACTIVATIONS:
        if _close(y, _fallback.activation(x.double(), name)):
            return name
    return None


def _is_linear(module: torch.nn.Module) -> bool:
    return type(module) is torch.nn.Linear or _is_conv1d(module)


class _ChildrenAsLeaves(torch.fx.Tracer):
    """Traces a module's own forward, each submodule one call."""

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return True


def _trace(module: torch.nn.Module):
    """The module's forward as (placeholders, calls, output), or None where torch.fx cannot trace
    it. calls: (op, target, args) per node, args naming nodes by index."""
    try:
        graph = _ChildrenAsLeaves().trace(module)
    except Exception:  # control flow, unsupported Python: not an MLP patch() knows
        return None
    index, calls, placeholders, output = {}, [], 0, None
    for node in graph.nodes:
        if node.op == "placeholder":
            index[node] = ("in", placeholders)
            placeholders += 1
        elif node.op == "output":
            output = node.args[0]
        else:
            if node.kwargs:
                return None
            index[node] = ("node", len(calls))
            calls.append((node.op, node.target, tuple(index.get(a, a) for a in node.args)))
    return placeholders, calls, index.get(output)


def _looks_like_mlp(module: torch.nn.Module) -> bool:
    """Two linear layers or more and an activation among the module's children."""
    children = list(module.children())
    return sum(_is_linear(c) for c in children) >= 2 and any(_activation_of(c) for c in children)


def _mlp_match(module: torch.nn.Module) -> Optional[tuple]:
    """('gated', gate, up, down, activation) for down(act(gate(x)) * up(x)) or
    ('plain', fc, proj, dropout | None, activation) for [drop](proj(act(fc(x)))), with submodule
    names, or None (call it on modules that _looks_like_mlp)."""
    children = dict(module.named_children())
    traced = _trace(module)
    if traced is None or traced[0] != 1:
        return None
    _, calls, out = traced
    mods = [(t if op == "call_module" else None) for op, t, _ in calls]
    x = ("in", 0)

    def call(i, target_pred, arg):
        op, target, args = calls[i]
        return op == "call_module" and target_pred(children.get(target)) and args == (arg,)

    if len(calls) == 5:  # gate(x), act(.), up(x), mul, down(.)
        g, a, u, m, d = range(5)
        mul_op, mul_target, mul_args = calls[m]
        act = _activation_of(children.get(mods[a])) if mods[a] in children else None
        if (call(g, _is_linear, x) and mods[a] in children and call(a, lambda c: True, ("node", g))
                and call(u, _is_linear, x) and mul_op == "call_function"
                and mul_target in (operator.mul, torch.mul)
                and set(mul_args) == {("node", a), ("node", u)}
                and call(d, _is_linear, ("node", m)) and out == ("node", d)
                and act in _GATED_ACTIVATIONS):
            return ("gated", mods[g], mods[u], mods[d], act)
    if len(calls) in (3, 4):  # fc(x), act(.), proj(.)[, dropout(.)]
        act = _activation_of(children.get(mods[1])) if mods[1] in children else None
        drop = None
        if len(calls) == 4:
            if not call(3, lambda c: type(c) in (torch.nn.Dropout, Dropout), ("node", 2)):
                return None
            drop = mods[3]
        if (call(0, _is_linear, x) and call(1, lambda c: True, ("node", 0))
                and call(2, _is_linear, ("node", 1)) and out == ("node", len(calls) - 1)
                and act is not None):
            return ("plain", mods[0], mods[2], drop, act)
    return None


def _gated_mlp_forward(self, x: Tensor) -> Tensor:
    gate, up, down, act = self._fusekit_mlp
    h = gated_act_separate(getattr(self, gate)(x), getattr(self, up)(x), act)
    return getattr(self, down)(h)


def _plain_mlp_forward(self, x: Tensor) -> Tensor:
    fc, proj, drop, act = self._fusekit_mlp
    h = getattr(self, proj)(_linear_with_activation(getattr(self, fc), x, act))
    return getattr(self, drop)(h) if drop is not None else h


# ---- rope --------------------------------------------------------------------------------------
def _unwrapped(fn: Callable) -> Callable:
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _with_innermost(fn: Callable, innermost: Callable) -> Callable:
    """A copy of fn's chain of functools.wraps wrappers around `innermost` in place of the function
    they wrap (each wrapper's closure cell holding the wrapped function gets the copy below it)."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        return innermost
    new_inner = _with_innermost(inner, innermost)
    cells = []
    for cell in fn.__closure__ or ():
        try:
            held = cell.cell_contents
        except ValueError:
            held = None
        cells.append(types.CellType(new_inner) if held is inner else cell)
    new = _function_copy(fn, fn.__globals__, tuple(cells))
    new.__wrapped__ = new_inner
    return new


def _function_copy(fn: Callable, fn_globals: dict, closure) -> Callable:
    new = types.FunctionType(fn.__code__, fn_globals, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    new.__annotations__ = getattr(fn, "__annotations__", {})
    return new


def _rebound(fn: Callable, name: str, value) -> Callable:
    """A copy of fn whose global `name` is `value` (the rest of its globals as they are now),
    through the functools.wraps wrappers around it."""
    inner = _unwrapped(fn)
    inner_globals = dict(inner.__globals__)
    inner_globals[name] = value
    copy = _function_copy(inner, inner_globals, inner.__closure__)
    copy.__dict__.pop("__wrapped__", None)
    return _with_innermost(fn, copy)


def _rope_adapter(hf_function: Callable) -> Optional[Callable]:
    """fusekit's apply_rotary_pos_emb with hf_function's signature, or None for an unknown one."""
    try:
        params = list(inspect.signature(hf_function).parameters)
    except (TypeError, ValueError):
        return None
    if params == ["q", "k", "cos", "sin", "unsqueeze_dim"]:
        def adapter(q, k, cos, sin, unsqueeze_dim=1):
            return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        return adapter
    if params == ["q", "k", "cos", "sin", "position_ids", "unsqueeze_dim"]:
        return apply_rotary_pos_emb
    return None


_ROPE_PROBES: Dict[int, Tuple[Optional[Callable], str]] = {}


def _rope_for(hf_function: Callable) -> Tuple[Optional[Callable], str]:
    """(fusekit's replacement, '') for a Hugging Face apply_rotary_pos_emb that computes what
    fusekit's does on a probe input (rotate_half, cos and sin of equal halves), else (None, why)."""
    key = id(hf_function)
    if key not in _ROPE_PROBES:
        adapter = _rope_adapter(hf_function)
        result: Tuple[Optional[Callable], str] = (None, "apply_rotary_pos_emb has a signature "
                                                  "fusekit does not know")
        if adapter is not None:
            gen = torch.Generator().manual_seed(7)
            q, k = torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
            angles = torch.rand(2, 5, 4, generator=gen) * 6
            cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
            try:
                with torch.no_grad():
                    want, got = hf_function(q, k, cos, sin), adapter(q, k, cos, sin)
                same = all(_close(g, w.double()) for g, w in zip(got, want))
            except Exception:
                same = False
            result = (adapter, "") if same else \
                (None, "its apply_rotary_pos_emb differs from fusekit's on a probe input")
        _ROPE_PROBES[key] = result
    return _ROPE_PROBES[key]


def _rope_forward(module: torch.nn.Module) -> Tuple[Optional[Callable], str]:
    """The module's forward calling fusekit's apply_rotary_pos_emb, or (None, why not); (None, '')
    when the forward calls no apply_rotary_pos_emb."""
    forward = type(module).forward
    inner = _unwrapped(forward)
    code = getattr(inner, "__code__", None)
    if code is None or "apply_rotary_pos_emb" not in code.co_names:
        return None, ""
    hf_function = inner.__globals__.get("apply_rotary_pos_emb")
    if hf_function is None:
        return None, "apply_rotary_pos_emb is not a global of its forward"
    adapter, why = _rope_for(hf_function)
    if adapter is None:
        return None, why
    return _rebound(forward, "apply_rotary_pos_emb", adapter), ""


# ---- attention (transformers' AttentionInterface) ---------------------------------------------
def _hf_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                  is_causal=None, **kwargs):
    """transformers' attention-function contract: (B, H, S, D) q, k, v, the model's mask (a bool or
    additive 4-D mask, or None for a plain causal one, as sdpa gets it), returns
    ((B, S, H, Dv), None). GQA in the kernel, no repeated key/value heads."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or \
            kwargs.get("position_bias") is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    # As transformers' sdpa: causal (top-left) only without a mask and for more than one query.
    causal = bool(is_causal) and attention_mask is None and query.shape[2] > 1
    out = scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                       dropout_p=dropout, is_causal=causal, scale=scaling,
                                       enable_gqa=True)
    return out.transpose(1, 2), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(ATTENTION_NAME, _hf_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def _patch_attention(model: torch.nn.Module, report: PatchReport) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        return
    target = f"attention ({getattr(config, '_attn_implementation', None)})"
    for attr in ("attn_logit_softcapping", "sliding_window_pattern_softcap"):
        if getattr(config, attr, None) is not None:
            report._add(report.not_patched, "", target, f"{attr} is set: fusekit's attention "
                        "has no logit soft-capping")
            return
    if getattr(config, "_attn_implementation", None) == ATTENTION_NAME:
        report._add(report.not_patched, "", target, "already fusekit")
        return
    try:
        _register_attention()
        model.set_attn_implementation(ATTENTION_NAME)
    except Exception as e:  # the model's own refusal, worded by transformers
        report._add(report.not_patched, "", target, f"transformers refused: {e}")
        return
    if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
        report._add(report.not_patched, "", target, "the model does not take an attention "
                    "implementation through AttentionInterface")
        return
    report._add(report.patched, "", target, f"fusekit attention (AttentionInterface "
                f"'{ATTENTION_NAME}')")


# ---- loss --------------------------------------------------------------------------------------
def causal_lm_loss(logits: Tensor, labels: Tensor, vocab_size: int,
                   num_items_in_batch: Optional[Tensor] = None, ignore_index: int = -100,
                   shift_labels: Optional[Tensor] = None, **kwargs) -> Tensor:
    """transformers' ForCausalLMLoss through fusekit's cross_entropy: the same loss (labels
    shifted left, the mean over counted tokens, or the sum over num_items_in_batch), computed in
    float32 from logits of any dtype without a float32 copy of them."""
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    logits = logits.reshape(-1, vocab_size)
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    if num_items_in_batch is None:
        return cross_entropy(logits, shift_labels, ignore_index=ignore_index)
    loss = cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _patch_loss(model: torch.nn.Module, report: PatchReport) -> bool:
    """Sets the model's loss_function to causal_lm_loss where it is ForCausalLMLoss; whether the
    model's loss is the causal-LM loss (then the fused path may replace lm_head + loss)."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return False
    if not hasattr(type(model), "loss_function"):
        return False
    try:
        current = model.loss_function
    except Exception:
        return False
    if current is causal_lm_loss:
        report._add(report.not_patched, "", "loss_function", "already fusekit")
    elif current is ForCausalLMLoss:
        model.loss_function = causal_lm_loss
        report._add(report.patched, "", "loss_function (ForCausalLMLoss)",
                    "fusekit cross_entropy on the logits")
    else:
        current_name = getattr(current, "__name__", str(current))
        report._add(report.not_patched, "", f"loss_function ({current_name})",
                    "only the causal-LM loss is patched")
        return False
    return True


# ---- lm_head + loss (fused linear cross-entropy) ----------------------------------------------
#: What a transformers 5.x causal-LM forward may name besides its base model and output class when
#: all it does after the base model is logits = lm_head(last hidden state), loss_function(logits).
_CAUSAL_LM_NAMES = {"last_hidden_state", "slice_logits_to_keep", "lm_head", "loss_function",
                    "config", "vocab_size", "cache", "hidden_states", "attentions",
                    "cross_attentions"}
#: Names of a final logit soft-capping branch (Gemma2/3), harmless where the config's value is None.
_SOFTCAP_NAMES = {"final_logit_softcapping", "torch", "tanh"}


def fused_causal_lm_loss(hidden: Tensor, lm_head: torch.nn.Module, labels: Tensor,
                         num_items_in_batch: Optional[Tensor] = None, ignore_index: int = -100,
                         shift_labels: Optional[Tensor] = None) -> Tensor:
    """transformers' ForCausalLMLoss of lm_head(hidden) without the logits, through fusekit's
    linear_cross_entropy: labels shifted left (or shift_labels as given), the mean over counted
    tokens, or the sum over num_items_in_batch; float32 (a batch with every label ignored has mean
    loss 0 where ForCausalLMLoss gives NaN). Under torch.autocast the hidden states
    and lm_head's parameters go in the autocast dtype, as lm_head's F.linear would take them."""
    weight, bias = lm_head.weight, lm_head.bias
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden.device)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    if num_items_in_batch is None:
        return linear_cross_entropy(hidden, weight, targets, bias, ignore_index=ignore_index)
    loss = linear_cross_entropy(hidden, weight, targets, bias, ignore_index=ignore_index,
                                reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _fused_loss_forward(original: Callable) -> Callable:
    """The innermost causal-LM forward: in training with labels (as keywords; input_ids alone
    positional), the base model's last hidden state goes to fused_causal_lm_loss and the output's
    logits are None; otherwise `original` runs as it is (the logits returned)."""
    def forward(self, *args, **kwargs):
        labels = kwargs.get("labels")
        logits_to_keep = kwargs.get("logits_to_keep", 0)
        if labels is None or not self.training or len(args) > 1 or \
                not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            return original(self, *args, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("labels", "logits_to_keep")}
        outputs = getattr(self, self.base_model_prefix)(*args, **kwargs)
        loss = fused_causal_lm_loss(
            outputs.last_hidden_state, self.lm_head, labels,
            num_items_in_batch=kwargs.get("num_items_in_batch"),
            ignore_index=kwargs.get("ignore_index", -100), shift_labels=kwargs.get("shift_labels"))
        output_class, fields = self._fusekit_causal_lm_output
        return output_class(loss=loss, logits=None,
                            **{f: getattr(outputs, f, None) for f in fields})
    forward.__name__, forward.__qualname__ = original.__name__, original.__qualname__
    forward.__doc__ = original.__doc__
    # The original's parameters for inspect.signature (HF Trainer keeps the dataset columns
    # that forward's signature names).
    forward.__signature__ = inspect.signature(original)
    return forward


def _fusable_causal_lm(model: torch.nn.Module) -> Tuple[Optional[tuple], str]:
    """((output class, its fields besides loss and logits), '') where the model's forward is
    transformers' causal-LM forward (base model, lm_head an nn.Linear, loss_function, no
    post-processing of the logits), else (None, why not)."""
    forward = _unwrapped(type(model).forward)
    code = getattr(forward, "__code__", None)
    prefix = getattr(model, "base_model_prefix", None)
    if code is None or not prefix or not isinstance(getattr(model, prefix, None), torch.nn.Module):
        return None, "no base model attribute (base_model_prefix) its forward could call"
    if type(getattr(model, "lm_head", None)) is not torch.nn.Linear:
        return None, "lm_head is not a torch.nn.Linear"
    try:
        import typing
        output_class = typing.get_type_hints(forward).get("return")
    except Exception:
        output_class = None
    if not (isinstance(output_class, type) and dataclasses.is_dataclass(output_class)):
        return None, "its forward's return type is not a transformers ModelOutput"
    fields = tuple(f.name for f in dataclasses.fields(output_class))
    if not {"loss", "logits"} <= set(fields):
        return None, f"{output_class.__name__} has no loss and logits fields"
    names = set(code.co_names) - _CAUSAL_LM_NAMES - {prefix, output_class.__name__}
    if "final_logit_softcapping" in names:
        cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
        if cap is not None:
            return None, (f"final_logit_softcapping={cap}: the loss is of the soft-capped logits, "
                          "which a fused linear cross-entropy does not compute")
        names -= _SOFTCAP_NAMES
    if names:
        return None, ("its forward does more than lm_head and loss_function after the base model "
                      f"(it names {', '.join(sorted(names))})")
    return (output_class, tuple(f for f in fields if f not in ("loss", "logits"))), ""


def _patch_fused_loss(model: torch.nn.Module, report: PatchReport) -> None:
    target = "lm_head + loss"
    if getattr(type(model), "_fusekit_patch", None) == ("fused_loss",):
        report._add(report.not_patched, "", target, "already fusekit")
        return
    output, why = _fusable_causal_lm(model)
    if output is None:
        report._add(report.not_patched, "", target, why)
        return
    cls = type(model)
    forward = _with_innermost(cls.forward, _fused_loss_forward(_unwrapped(cls.forward)))
    sub = _patched_class(cls, ("fused_loss",), forward, {"_fusekit_causal_lm_output": output})
    # The class keeps its name: save_pretrained writes it into config.architectures.
    sub.__name__, sub.__qualname__ = cls.__name__, cls.__qualname__
    _retarget(model, sub)
    report._add(report.patched, "", target,
                "fusekit linear_cross_entropy from the last hidden states in training with labels "
                "(no logits: the output's logits are None)")


# ---- patch -------------------------------------------------------------------------------------
def patch(model: torch.nn.Module, *, norms: bool = True, linear: bool = True, mlp: bool = True,
          rope: bool = True, attention: bool = True, dropout: bool = True,
          loss: bool = True, fused_loss: bool = True) -> PatchReport:
    """Retargets `model`'s modules to fusekit in place (see the module docstring for what each
    part covers; each keyword turns one part off; fused_loss=False keeps the logits in training,
    the loss then fusekit's cross_entropy on them) and returns a PatchReport of what was patched
    and what was not, and why. Parameters, buffers, hooks and state_dict keys are unchanged;
    patching twice changes nothing more."""
    report = PatchReport(type(model).__name__)
    conv1d_detail = "fusekit linear on weight.t(), read in place"
    for name, module in list(model.named_modules()):
        cls = type(module)
        label = cls.__name__
        if getattr(cls, "_fusekit_patch", None) is not None or cls in DROP_INS.values() or \
                cls is Dropout:
            continue
        drop_in = DROP_INS.get(cls)
        if drop_in is not None:
            wanted = loss if issubclass(cls, torch.nn.modules.loss._Loss) else norms
            if wanted:
                _retarget(module, drop_in)
                report._add(report.patched, name, label, f"fusekit.torch.{drop_in.__name__}")
            continue
        if cls is torch.nn.Dropout:
            if dropout:
                _retarget(module, Dropout)
                report._add(report.patched, name, label, "fusekit.torch.Dropout")
            continue
        if norms and (label.endswith("RMSNorm") or label.endswith("LayerNorm")):
            kind, eps_attr_or_why = _norm_kind(module)
            if kind is None:
                report._add(report.not_patched, name, label, eps_attr_or_why)
            else:
                forward, detail = _NORM_FORWARDS[kind]
                _retarget(module, _patched_class(cls, (kind, eps_attr_or_why), forward,
                                                 {"_fusekit_eps": eps_attr_or_why}))
                report._add(report.patched, name, label, detail)
            continue
        if _is_conv1d(module):
            if linear:
                _retarget(module, _patched_class(cls, ("conv1d",), _conv1d_forward, {}))
                report._add(report.patched, name, label, conv1d_detail)
            continue
        if mlp and _looks_like_mlp(module):
            match = _mlp_match(module)
            if match is None:
                report._add(report.not_patched, name, label, "mlp: its forward is none of "
                            "down(act(gate(x)) * up(x)) and proj(act(fc(x))) (with an activation "
                            "fusekit has)")
            else:
                kind, parts = match[0], match[1:]
                forward = _gated_mlp_forward if kind == "gated" else _plain_mlp_forward
                _retarget(module, _patched_class(cls, ("mlp",) + match, forward,
                                                 {"_fusekit_mlp": parts}))
                what = "gated_act_separate" if kind == "gated" else \
                    "linear with the activation fused"
                report._add(report.patched, name, label, f"fusekit {what} ({parts[-1]})")
                continue
        if rope:
            forward, why = _rope_forward(module)
            if forward is not None:
                _retarget(module, _patched_class(cls, ("rope",), forward, {}))
                report._add(report.patched, name, label, "fusekit apply_rotary_pos_emb")
            elif why:
                report._add(report.not_patched, name, label, f"rope: {why}")
    if attention:
        _patch_attention(model, report)
    if loss and _patch_loss(model, report) and fused_loss:
        _patch_fused_loss(model, report)
    if report.patched and hasattr(model, "config"):
        report._add(report.not_patched, "", "residual add + norm",
                    "not fused: that needs the decoder layers' forward")
    return report
