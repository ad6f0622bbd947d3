#!/usr/bin/env python3
"""Merges `fusekit bench --json` and scripts/torch_bench.py output into one markdown table:
fusekit's time and GB/s, its fraction of the copy ceiling measured in the same run, and the
speed-up over PyTorch eager and torch.compile measured in the same call."""
import json
import sys


def main():
    fk = json.load(open(sys.argv[1]))
    th = json.load(open(sys.argv[2])) if len(sys.argv) > 2 else {"rows": []}
    copy = fk["ceilings"]["copy_gbps"]
    torch_time = {(r["op"], r["direction"], r["shape"], r["impl"]): r["time_us"] for r in th["rows"]}
    print(f"Device: {fk['device']}. Ceilings in the same run: copy {copy:.0f} GB/s, "
          f"bf16 GEMM {fk['ceilings']['gemm_bf16_tflops']:.0f} TFLOP/s.\n")
    print("| op | dir | shape | fusekit us | GB/s | % of copy | torch eager us | torch.compile us | x eager | x compile |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    worst = 1e9
    for r in fk["rows"]:
        key = (r["op"], r["direction"], r["shape"])
        te = torch_time.get(key + ("torch",))
        tc = torch_time.get(key + ("compile",))
        frac = r["gbps"] / copy
        worst = min(worst, frac)
        fmt = lambda v: f"{v:.1f}" if v else "-"
        sp = lambda v: f"{v / r['time_us']:.2f}" if v else "-"
        print(f"| {r['op']} | {r['direction']} | {r['shape']} | {r['time_us']:.1f} | {r['gbps']:.0f} | "
              f"{100 * frac:.1f}% | {fmt(te)} | {fmt(tc)} | {sp(te)} | {sp(tc)} |")
    print(f"\nLowest fraction of copy bandwidth: {100 * worst:.1f}%")
    if th.get("torch_errors"):
        print(f"\nPyTorch's own bf16 error vs float64 (rel. L2): {json.dumps(th['torch_errors'])}")


if __name__ == "__main__":
    main()
