#!/usr/bin/env python3
"""Trains a small pre-norm transformer block twice on the same random data from the same
initialization: once in plain PyTorch, once patched for fusekit (fusekit.torch.patch: its norms and
its MLP's linear + GELU). Prints both losses per step; exits non-zero unless the loss falls and the
two runs agree within the dtype's tolerance over the first steps.

    python3 examples/train_block.py                      # CUDA, bfloat16 parameters
    python3 examples/train_block.py --dtype fp32 --steps 50
    python3 examples/train_block.py --device cpu --dtype fp32   # fusekit's CPU backend
"""
import argparse
import copy
import sys

import torch
import torch.nn as nn

import fusekit.torch as fk


class Block(nn.Module):
    """x + Attention(LayerNorm(x)), then + MLP(RMSNorm(x)), and a final LayerNorm."""

    def __init__(self, dim, heads):
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp_norm = nn.RMSNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.out_norm = nn.LayerNorm(dim)

    def forward(self, x):
        h = self.attn_norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.mlp_norm(x))
        return self.out_norm(x)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["fp32", "bf16"],
                    help="parameter/activation dtype (default: bf16 on CUDA, fp32 on the CPU)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--compare-steps", type=int, default=10,
                    help="steps over which the two runs must agree (training is chaotic later)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    dtype_name = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    # Relative loss difference allowed: ~100 float32 ulps, one bfloat16 ulp (2^-8).
    tolerance = {"fp32": 1e-5, "bf16": 4e-3}[dtype_name]
    device = torch.device(args.device)

    torch.manual_seed(args.seed)
    batch, seq, dim, heads = 8, 64, 256, 4
    reference = Block(dim, heads).to(device, dtype)
    fused = copy.deepcopy(reference)
    swapped = len(fk.patch(fused).patched)
    # The task: regress a fixed random linear map of the (normalized) input sequence.
    data = [torch.randn(batch, seq, dim, device=device, dtype=dtype) for _ in range(args.steps)]
    target_map = torch.randn(dim, dim, device=device, dtype=dtype) / dim ** 0.5

    def train(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        losses = []
        for x in data:
            opt.zero_grad(set_to_none=True)
            loss = (model(x).float() - torch.tanh(x @ target_map).float()).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    print(f"device {device}, dtype {dtype_name}, {swapped} modules patched for fusekit's, "
          f"{args.steps} steps, batch {batch}x{seq}x{dim}")
    torch_losses = train(reference)
    fusekit_losses = train(fused)
    print(f"{'step':>4} {'PyTorch':>10} {'fusekit':>10} {'rel diff':>9}")
    worst = 0.0
    for i, (a, b) in enumerate(zip(torch_losses, fusekit_losses)):
        diff = abs(a - b) / max(abs(a), 1e-12)
        if i < args.compare_steps:
            worst = max(worst, diff)
        if i < args.compare_steps or i % 5 == 4 or i == args.steps - 1:
            print(f"{i:4d} {a:10.5f} {b:10.5f} {diff:9.2e}")
    first, last = fusekit_losses[0], min(fusekit_losses[-5:])
    falls = last < 0.7 * first
    agrees = worst <= tolerance
    print(f"fusekit loss {first:.4f} -> {last:.4f} ({'falls' if falls else 'does NOT fall'}); "
          f"largest relative difference over the first {args.compare_steps} steps {worst:.2e} "
          f"({'within' if agrees else 'OVER'} {tolerance:g} for {dtype_name})")
    return 0 if falls and agrees else 1


if __name__ == "__main__":
    sys.exit(main())
