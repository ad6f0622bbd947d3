#!/usr/bin/env python3
"""PyTorch equivalents of fusekit's ops, timed on the same shapes (bf16, random data), eager and
torch.compile, with triton.testing.do_bench (median, L2 flushed between runs). Also records
PyTorch's own error against float64 so the report can set fusekit's error beside it.
Writes JSON rows shaped like `fusekit bench --json`."""
import argparse
import json

import torch
import torch._functorch.config
import torch.nn.functional as F
import triton.testing

# Backward is timed repeatedly on one graph (retain_graph), which donated buffers forbid.
torch._functorch.config.donated_buffer = False

NORM_SHAPES = [(16384, 1024), (16384, 4096), (8192, 8192), (4096, 16384), (32768, 2048),
               (16384, 5120), (8192, 12288)]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3  # us


def norm_rows(rows):
    dev = "cuda"
    for op in ("layer_norm", "rms_norm"):
        for (m, n) in NORM_SHAPES:
            x = (torch.randn(m, n, device=dev) * 2 + 0.3).to(torch.bfloat16).requires_grad_(True)
            w = (torch.randn(n, device=dev) * 0.5 + 1).to(torch.bfloat16).requires_grad_(True)
            b = torch.randn(n, device=dev).to(torch.bfloat16).requires_grad_(True)
            dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)

            if op == "layer_norm":
                def f(x, w, b):
                    return F.layer_norm(x, (n,), w, b, 1e-5)
                params = (x, w, b)
            else:
                def f(x, w, b):
                    return F.rms_norm(x, (n,), w, 1e-5)
                params = (x, w)
            compiled = torch.compile(f)
            shape = f"({m}, {n})"
            elems = m * n
            for impl, fn in (("torch", f), ("compile", compiled)):
                with torch.no_grad():
                    t = bench(lambda: fn(x, w, b))
                rows.append(dict(op=op, direction="fwd", shape=shape, impl=impl, time_us=t,
                                 bytes=4.0 * elems, gbps=4.0 * elems / t / 1e3))
                y = fn(x, w, b)
                t = bench(lambda: torch.autograd.grad(y, params, dy, retain_graph=True))
                rows.append(dict(op=op, direction="bwd", shape=shape, impl=impl, time_us=t,
                                 bytes=6.0 * elems, gbps=6.0 * elems / t / 1e3))
                print(rows[-2], rows[-1], flush=True)
            del x, w, b, dy, y
    # PyTorch's own error in bf16 against float64, on one shape (relative L2).
    m, n = 4096, 4096
    x = (torch.randn(m, n, device=dev) * 2 + 0.3).to(torch.bfloat16)
    w = (torch.randn(n, device=dev) * 0.5 + 1).to(torch.bfloat16)
    b = torch.randn(n, device=dev).to(torch.bfloat16)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    errors = {}
    for op in ("layer_norm", "rms_norm"):
        outs = {}
        for dt in (torch.bfloat16, torch.float64):
            xx = x.to(dt).requires_grad_(True)
            ww = w.to(dt).requires_grad_(True)
            bb = b.to(dt).requires_grad_(True)
            y = F.layer_norm(xx, (n,), ww, bb, 1e-5) if op == "layer_norm" else F.rms_norm(xx, (n,), ww, 1e-5)
            gx, gw = torch.autograd.grad(y, (xx, ww), dy.to(dt))
            outs[dt] = (y, gx, gw)
        rel = lambda a, r: ((a.double() - r).norm() / r.norm()).item()
        errors[op] = {k: rel(outs[torch.bfloat16][i], outs[torch.float64][i]) for i, k in enumerate(("y", "dx", "dweight"))}
    return errors


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("ops", nargs="*", default=["norm"])
    args = ap.parse_args()
    torch.manual_seed(0)
    # Ceilings measured by PyTorch in the same process, for the record.
    a = torch.empty(1 << 29, dtype=torch.int16, device="cuda")
    bb = torch.empty_like(a)
    copy_us = bench(lambda: bb.copy_(a))
    rows, errors = [], {}
    if "norm" in args.ops:
        errors.update(norm_rows(rows))
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   copy_gbps=2 * a.numel() * 2 / copy_us / 1e3, rows=rows, torch_errors=errors),
              open(args.out, "w"), indent=1)
    print("torch errors vs float64:", errors)


if __name__ == "__main__":
    main()
