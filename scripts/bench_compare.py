#!/usr/bin/env python3
"""Compares two builds' benchmark runs row by row.

    bench_compare.py --base a1.json a2.json --new b1.json b2.json [--tolerance 0.02] [--json out.json]

Each file is the JSON of `fusekit bench --json`, the runs of each build taken in turns in one GPU
call. A row is keyed by (op, direction, shape, impl); its time is the median over that build's runs.
Prints one line per fusekit row (base us, new us, new/base) and exits 1 when a row of the new build
is slower than the base by more than the tolerance. Where the bench also timed the plain cuBLAS
GEMMs of the row in the same process (linear: impl cublas_plain), the verdict compares the rows'
fraction of that ceiling instead (column vs_gemm): GEMM-bound rows move with the GPU's clocks from
one process to the next, and the ceiling timed beside them moves alike.
"""
import argparse
import json
import statistics
import sys


def load(paths):
    """(median time per row key, median of time / same-process cublas_plain time per row key)."""
    times, to_gemm = {}, {}
    for path in paths:
        with open(path) as f:
            rows = json.load(f)["rows"]
        plain = {(r["op"], r["direction"], r["shape"]): r["time_us"] for r in rows if r["impl"] == "cublas_plain"}
        for row in rows:
            key = (row["op"], row["direction"], row["shape"], row["impl"])
            times.setdefault(key, []).append(row["time_us"])
            ceiling = plain.get(key[:3])
            if ceiling:
                to_gemm.setdefault(key, []).append(row["time_us"] / ceiling)
    med = lambda d: {k: statistics.median(v) for k, v in d.items()}
    return med(times), med(to_gemm)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", nargs="+", required=True)
    ap.add_argument("--new", nargs="+", required=True)
    ap.add_argument("--tolerance", type=float, default=0.02)
    ap.add_argument("--json")
    args = ap.parse_args()
    (base, base_gemm), (new, new_gemm) = load(args.base), load(args.new)
    rows, slower = [], 0
    print(f"{'op':<14} {'dir':<4} {'shape':<44} {'base us':>10} {'new us':>10} {'new/base':>9} {'vs_gemm':>8}")
    for key in sorted(base):
        op, direction, shape, impl = key
        if impl != "fusekit":
            continue
        if key not in new:
            print(f"{op:<14} {direction:<4} {shape:<44} {base[key]:>10.1f} {'missing':>10}")
            slower += 1
            continue
        ratio = new[key] / base[key]
        vs_gemm = new_gemm[key] / base_gemm[key] if key in base_gemm and key in new_gemm else None
        verdict = vs_gemm if vs_gemm is not None else ratio
        flag = "  SLOWER" if verdict > 1 + args.tolerance else ""
        slower += bool(flag)
        gemm_text = f"{vs_gemm:>8.3f}" if vs_gemm is not None else f"{'':>8}"
        print(f"{op:<14} {direction:<4} {shape:<44} {base[key]:>10.1f} {new[key]:>10.1f} {ratio:>9.3f} {gemm_text}{flag}")
        rows.append({"op": op, "direction": direction, "shape": shape, "base_us": base[key],
                     "new_us": new[key], "ratio": ratio, "ratio_vs_gemm": vs_gemm})
    ratios = [r["ratio"] for r in rows]
    verdicts = [r["ratio_vs_gemm"] if r["ratio_vs_gemm"] is not None else r["ratio"] for r in rows]
    if ratios:
        print(f"{len(ratios)} rows: new/base min {min(ratios):.3f}, median {statistics.median(ratios):.3f}, "
              f"max {max(ratios):.3f}; judged (vs_gemm where timed) max {max(verdicts):.3f}; "
              f"{slower} over {1 + args.tolerance:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tolerance": args.tolerance, "base_runs": args.base, "new_runs": args.new, "rows": rows}, f, indent=1)
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
