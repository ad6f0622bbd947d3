#!/usr/bin/env python3
"""fusekit quickstart (PyTorch): fusekit's ops as modules and functions, under autograd, checked
against PyTorch's own. Runs on a CUDA GPU in bfloat16 where there is one, otherwise on the CPU in
float32 (fusekit's CPU backend computes in float64).

    pip install .                       # builds fusekit._C (needs the CUDA toolkit)
    python3 examples/quickstart.py
"""
import torch
import torch.nn.functional as F

import fusekit.torch as fk

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32  # GPU attention takes f16 / bf16
torch.manual_seed(0)
batch, seq, heads, head_dim = 2, 128, 4, 64
dim = heads * head_dim

# Drop-in modules: the constructors, parameters and state_dict keys of torch.nn's.
norm = fk.LayerNorm(dim, device=device, dtype=dtype)
mlp_in = fk.Linear(dim, 4 * dim, activation="gelu_tanh", device=device, dtype=dtype)  # fused bias + GELU
dropout = fk.Dropout(p=0.1)  # the mask is regenerated from a seed in the backward, never stored

x = torch.randn(batch, seq, dim, device=device, dtype=dtype, requires_grad=True)
h = dropout(mlp_in(norm(x)))  # (batch, seq, 4 * dim)

# Attention: torch.nn.functional's signature, plus fusekit's extras (here a sliding window).
q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
           for _ in range(3))
o = fk.scaled_dot_product_attention(q, k, v, is_causal=True, window=(64, 0))  # 64 keys back

(h.float().square().mean() + o.float().square().mean()).backward()  # autograd through every op
print(f"{device} {dtype}: h {tuple(h.shape)}, o {tuple(o.shape)}, |dx| {x.grad.norm():.3f}, "
      f"|dq| {q.grad.norm():.3f}")

# The same results as PyTorch's, to rounding in the dtype (largest difference / largest value).
def relative_difference(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


with torch.no_grad():
    ln_diff = relative_difference(norm(x), F.layer_norm(x, (dim,), norm.weight, norm.bias))
    sdpa_diff = relative_difference(fk.scaled_dot_product_attention(q, k, v, is_causal=True),
                                    F.scaled_dot_product_attention(q, k, v, is_causal=True))
print(f"difference from PyTorch: layer_norm {ln_diff:.1e}, attention {sdpa_diff:.1e}")

# An existing model: patch retargets its norms (and MLPs, attention, ...) to fusekit, in place.
model = torch.nn.Sequential(torch.nn.LayerNorm(dim), torch.nn.Linear(dim, dim),
                            torch.nn.RMSNorm(dim)).to(device, dtype)
report = fk.patch(model)  # prints what was patched, and what was not and why
print(f"patched {len(report.patched)} modules; output {tuple(model(x).shape)}")

tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4  # a few bf16 roundings; float32
assert ln_diff < tolerance and sdpa_diff < tolerance, "fusekit differs from PyTorch"
