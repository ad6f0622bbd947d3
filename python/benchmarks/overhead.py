#!/usr/bin/env python3
"""Host time per call of fusekit's LayerNorm through fusekit.torch against the direct C++ call,
on a tiny tensor (where the host, not the GPU, sets the pace). The issue's bar: a call through
fusekit.torch costs at most 10 us of host time more than the direct C++ call.

Rows (median of --repeats runs of --iterations calls each, fewer where a run would exceed
--run-seconds; no synchronization inside a run):
  C++ loop           fusekit::layer_norm_forward in a C++ loop, arguments converted once
  _C call            fusekit._C.layer_norm_forward from Python, outputs preallocated
  fusekit.torch ...  fusekit.torch.layer_norm (eager fast path unless noted), outputs allocated
  ... custom op      the same through torch.ops.fusekit (the path torch.compile records)
  PyTorch ...        torch.nn.functional.layer_norm, for scale
The extra cost of fusekit.torch is measured against the "_C call" rows: for the forward, the whole
fusekit.torch.layer_norm call (with and without autograd recording); for the backward, the body of
fusekit's autograd node (allocations, workspace, C++ call) -- the autograd engine's own round trip
is PyTorch's cost for any op and is printed for scale.

    python3 python/benchmarks/overhead.py [--device cuda] [--json out.json]
"""
import argparse
import json
import statistics
import sys
import time

import torch

import fusekit
import fusekit.torch as fk
from fusekit.torch import norm as fk_norm

BUDGET_US = 10.0


def host_us(fn, iterations, repeats, sync, target_s):
    """Median host microseconds per call over `repeats` runs. Each run has `iterations` calls, or
    fewer where that would take longer than target_s (calibrated on the warm-up), so that the slow
    rows (autograd round trips) do not stretch the whole script."""
    warmup = min(iterations, 200)
    start = time.perf_counter()
    for _ in range(warmup):  # also lazy initialization and allocator caches
        fn()
    sync()
    per_call = (time.perf_counter() - start) / max(warmup, 1)
    iterations = max(min(iterations, int(target_s / max(per_call, 1e-9))), 100)
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iterations):
            fn()
        runs.append((time.perf_counter() - start) / iterations * 1e6)
        sync()
    return statistics.median(runs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=["f32", "f16", "bf16"])
    ap.add_argument("--shape", default="4,256", help="x shape, e.g. 4,256")
    ap.add_argument("--iterations", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--run-seconds", type=float, default=0.15,
                    help="at most about this long per run (fewer iterations for slow rows)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()

    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    dev = torch.device(args.device)
    shape = tuple(int(s) for s in args.shape.split(","))
    n = shape[-1]
    x_rows = 1
    for s in shape[:-1]:
        x_rows *= s
    torch.manual_seed(0)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    x = torch.randn(shape, device=dev, dtype=dtype)
    w = torch.randn(n, device=dev, dtype=dtype)
    b = torch.randn(n, device=dev, dtype=dtype)
    y = torch.empty_like(x)
    mean = torch.empty(shape[:-1], device=dev)
    rstd = torch.empty(shape[:-1], device=dev)
    dy = torch.randn_like(x)
    dx, dw, db = torch.empty_like(x), torch.empty_like(w), torch.empty_like(b)
    ws_bytes = fusekit.norm_backward_workspace_size(x_rows, n, {torch.float32: fusekit.DType.f32,
                                                               torch.float16: fusekit.DType.f16,
                                                               torch.bfloat16: fusekit.DType.bf16}[dtype],
                                                    f"cuda:{dev.index or 0}" if dev.type == "cuda" else "cpu")
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=dev) if ws_bytes else None
    fusekit.layer_norm_forward(x, w, b, 1e-5, y, mean, rstd)
    xg = x.clone().requires_grad_(True)
    wg = w.clone().requires_grad_(True)
    bg = b.clone().requires_grad_(True)
    it, rep = args.iterations, args.repeats
    t = lambda fn: host_us(fn, it, rep, sync, args.run_seconds)  # noqa: E731

    results = {}

    def row(name, us):
        results[name] = us
        print(f"  {name:<44} {us:8.2f} us", flush=True)

    print(f"fusekit host overhead: {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU backend'}), "
          f"x {tuple(shape)} {args.dtype}, torch {torch.__version__}, fast DLPack exchange: {fk.FAST_EXCHANGE}")
    row("C++ loop (forward)", fusekit._C._layer_norm_forward_host_us(x, w, b, 1e-5, y, mean, rstd, it))
    row("_C call (forward)", t(lambda: fusekit.layer_norm_forward(x, w, b, 1e-5, y, mean, rstd)))
    with torch.no_grad():
        row("fusekit.torch forward, no grad", t(lambda: fk.layer_norm(x, (n,), w, b)))
        row("PyTorch forward, no grad", t(lambda: torch.nn.functional.layer_norm(x, (n,), w, b)))
    row("fusekit.torch forward, recording grad", t(lambda: fk.layer_norm(xg, (n,), wg, bg)))
    row("PyTorch forward, recording grad", t(lambda: torch.nn.functional.layer_norm(xg, (n,), wg, bg)))

    row("_C call (backward)", t(lambda: fusekit.layer_norm_backward(dy, x, w, mean, rstd, dx, dw, db, ws)))
    # What the autograd engine runs for fusekit's node: allocations, workspace query, C++ call.
    row("fusekit.torch backward node body", t(lambda: fk_norm._norm_backward(
        "layer_norm", dy, x, w, mean, rstd, False, True, True, True)))
    y_fk = fk.layer_norm(xg, (n,), wg, bg)
    row("fusekit.torch backward (autograd.grad)", t(lambda: torch.autograd.grad(y_fk, (xg, wg, bg), dy, retain_graph=True)))
    y_pt = torch.nn.functional.layer_norm(xg, (n,), wg, bg)
    row("PyTorch backward (autograd.grad)", t(lambda: torch.autograd.grad(y_pt, (xg, wg, bg), dy, retain_graph=True)))

    fk.set_eager_fast_path(False)
    try:
        with torch.no_grad():
            row("fusekit.torch forward, no grad, custom op", t(lambda: fk.layer_norm(x, (n,), w, b)))
        row("fusekit.torch forward, grad, custom op", t(lambda: fk.layer_norm(xg, (n,), wg, bg)))
        y_op = fk.layer_norm(xg, (n,), wg, bg)
        row("fusekit.torch backward, custom op", t(lambda: torch.autograd.grad(y_op, (xg, wg, bg), dy, retain_graph=True)))
    finally:
        fk.set_eager_fast_path(True)

    verdicts = []
    for name, base in (("fusekit.torch forward, no grad", "_C call (forward)"),
                       ("fusekit.torch forward, recording grad", "_C call (forward)"),
                       ("fusekit.torch backward node body", "_C call (backward)")):
        extra = results[name] - results[base]
        ok = extra <= BUDGET_US
        verdicts.append(ok)
        print(f"  extra over {base:<20}: {extra:6.2f} us  {name}  [{'ok' if ok else 'OVER'} <= {BUDGET_US:g} us]")
    print(f"  binding cost (_C call - C++ loop, forward): {results['_C call (forward)'] - results['C++ loop (forward)']:.2f} us")
    print(f"  for scale, PyTorch's own autograd costs: recording {results['PyTorch forward, recording grad'] - results['PyTorch forward, no grad']:.2f} us "
          f"per forward; an autograd.grad round trip {results['PyTorch backward (autograd.grad)']:.2f} us")
    if dev.type == "cpu":
        print("  (CPU backend: the times include the CPU reference's own work; the budget is meant for CUDA)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "shape": list(shape), "dtype": args.dtype, "torch": torch.__version__,
                       "fast_exchange": fk.FAST_EXCHANGE, "host_us": results, "budget_us": BUDGET_US,
                       "within_budget": all(verdicts)}, f, indent=1)
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
