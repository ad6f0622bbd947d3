#!/usr/bin/env python3
"""Compares two builds' benchmark runs row by row.

    bench_compare.py --base a1.json a2.json --new b1.json b2.json [--tolerance 0.02] [--json out.json]

Each file is the JSON of `fusekit bench --json`, the runs of each build taken in turns in one GPU
call. A row is keyed by (op, direction, shape, impl); its time is the median over that build's runs.
Prints one line per fusekit row (base us, new us, new/base) and exits 1 when a row of the new build
is slower than the base by more than the tolerance.
"""
import argparse
import json
import statistics
import sys


def load(paths):
    times = {}
    for path in paths:
        with open(path) as f:
            for row in json.load(f)["rows"]:
                key = (row["op"], row["direction"], row["shape"], row["impl"])
                times.setdefault(key, []).append(row["time_us"])
    return {k: statistics.median(v) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", nargs="+", required=True)
    ap.add_argument("--new", nargs="+", required=True)
    ap.add_argument("--tolerance", type=float, default=0.02)
    ap.add_argument("--json")
    args = ap.parse_args()
    base, new = load(args.base), load(args.new)
    rows, slower = [], 0
    print(f"{'op':<14} {'dir':<4} {'shape':<44} {'base us':>10} {'new us':>10} {'new/base':>9}")
    for key in sorted(base):
        op, direction, shape, impl = key
        if impl != "fusekit":
            continue
        if key not in new:
            print(f"{op:<14} {direction:<4} {shape:<44} {base[key]:>10.1f} {'missing':>10}")
            slower += 1
            continue
        ratio = new[key] / base[key]
        flag = "  SLOWER" if ratio > 1 + args.tolerance else ""
        slower += bool(flag)
        print(f"{op:<14} {direction:<4} {shape:<44} {base[key]:>10.1f} {new[key]:>10.1f} {ratio:>9.3f}{flag}")
        rows.append({"op": op, "direction": direction, "shape": shape, "base_us": base[key],
                     "new_us": new[key], "ratio": ratio})
    ratios = [r["ratio"] for r in rows]
    if ratios:
        print(f"{len(ratios)} rows: new/base min {min(ratios):.3f}, median {statistics.median(ratios):.3f}, "
              f"max {max(ratios):.3f}; {slower} over {1 + args.tolerance:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tolerance": args.tolerance, "base_runs": args.base, "new_runs": args.new, "rows": rows}, f, indent=1)
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
