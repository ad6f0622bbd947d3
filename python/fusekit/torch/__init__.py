"""fusekit for PyTorch (2.10 or later): custom ops (torch.ops.fusekit.*) that work under autograd,
torch.compile (no graph breaks) and CUDA graph capture, their functional forms, and nn.Module
drop-ins.

    import fusekit.torch as fk
    norm = fk.LayerNorm(1024, device="cuda", dtype=torch.bfloat16)   # as torch.nn.LayerNorm
    print(fk.patch(model))   # or retarget a model's norms, MLPs, rope, attention, loss in place

Ops (functional form / module): layer_norm, rms_norm / LayerNorm, RMSNorm (drop-ins);
layer_norm_residual, rms_norm_residual (x + residual normalized in one pass, returning (y, sum));
bias_act_dropout / BiasActDropout, Dropout (as torch.nn.Dropout); gated_act, gated_act_separate /
GatedMLP (SwiGLU, GeGLU, ReGLU: HF LlamaMLP's act_fn(gate_proj(x)) * up_proj(x) and its module);
linear / Linear (torch.nn.Linear plus a fused activation); gated_linear / GatedLinear (a gated MLP's
gate and up projections and its gated activation in one GEMM); attention (fusekit's layout, variable
lengths) and scaled_dot_product_attention (torch.nn.functional's signature plus fusekit's extras);
fp8_rms_norm / FP8RMSNorm (torch.nn.RMSNorm's constructor, FP8 in and out), fp8_quantize;
cross_entropy / CrossEntropyLoss (drop-ins, plus a z-loss; the gradient computed with the loss);
linear_cross_entropy / LinearCrossEntropyLoss (the output layer's F.linear + cross_entropy without
the logits, its gradients computed with the loss).
rope (rotary embeddings of q and k in one launch) and apply_rotary_pos_emb (Hugging Face's
signature).

patch(model) retargets a model in place, Hugging Face transformers models included (GPT-2, Llama,
Mistral, Qwen2, Qwen3, Gemma), and returns a report of what it patched (see patch.py). Every op
works under torch.autocast with PyTorch's casting semantics (see _common.AutocastRule).

On a GPU fusekit has no kernels for (anything but Hopper), each op runs PyTorch's implementation
of the same function with one warning; set_fallback('strict') makes that an UnsupportedError and
set_fallback('always') runs PyTorch's implementations everywhere (see _fallback.py).

Distributed training: the ops compute on local tensors, so DistributedDataParallel and FSDP2
(fully_shard, whose modules see unsharded local parameters in forward) work unchanged
(scripts/torch_dist_check.py checks the losses); DTensor inputs (tensor parallelism) raise
DTensorInputError naming the op and argument.

Adding an op family: write fusekit/torch/<family>.py (custom ops with register_fake and
register_autograd, functional forms, drop-ins decorated with @register_drop_in) and import its
public names below (one line).
"""
from ._common import DROP_INS, DTensorInputError, OutOfMemoryError, register_drop_in  # noqa: F401
from ._fallback import get_fallback, set_fallback  # noqa: F401

# One line per op family.
from .norm import (LayerNorm, RMSNorm, layer_norm, layer_norm_residual, rms_norm,  # noqa: F401
                   rms_norm_residual)
from .bias_act_dropout import BiasActDropout, Dropout, bias_act_dropout  # noqa: F401
from .cross_entropy import CrossEntropyLoss, cross_entropy  # noqa: F401
from .linear_cross_entropy import LinearCrossEntropyLoss, linear_cross_entropy  # noqa: F401
from .gated_act import GatedMLP, gated_act, gated_act_separate  # noqa: F401
from .linear import GatedLinear, Linear, gated_linear, linear  # noqa: F401
from .attention import attention, scaled_dot_product_attention  # noqa: F401
from .fp8_norm import FP8RMSNorm, Fp8RMSNormOutput, fp8_quantize, fp8_rms_norm  # noqa: F401
from .rope import apply_rotary_pos_emb, rope  # noqa: F401
# After the families: patch() retargets modules to them.
from .patch import (  # noqa: F401
    PatchEntry, PatchReport, causal_lm_loss, fused_causal_lm_loss, patch)
