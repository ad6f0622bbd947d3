"""Summarizes scripts/train_gpt_ddp_check.sh's runs (train_gpt --losses-json files, given as
NAME=PATH): the per-step losses of the N-GPU runs against the 1-GPU run (gpus1), of the run that
saved the checkpoint (resume_from_gpus2) and the resumed runs (resumed_on_gpusN) against the
uninterrupted 2-GPU run (gpus2), and tokens/s in all and per GPU
(the median step time after the first WARMUP steps), the scaling runs' per GPU against gpus1's.
Prints JSON; exits 1 when a loss difference exceeds --tolerance."""

import argparse
import json
import statistics
import sys

WARMUP = 5  # first steps excluded from timings (autotuning, allocator warm-up)


def losses(run):
    return {r["step"]: r["loss"] for r in run["train"]}


def compare(run, reference, tolerance):
    a, b = losses(run), losses(reference)
    steps = sorted(set(a) & set(b))
    rows = [{"step": s, "loss": a[s], "reference": b[s], "diff": a[s] - b[s]} for s in steps]
    worst = max(rows, key=lambda r: abs(r["diff"]))
    return {
        "steps": [steps[0], steps[-1]],
        "max_abs_loss_diff": abs(worst["diff"]),
        "at_step": worst["step"],
        "first_step_diff": rows[0]["diff"],
        "pass": abs(worst["diff"]) <= tolerance,
        "per_step": rows,
    }


def throughput(run):
    steps = run["train"]
    timed = [r for r in steps if r["step"] >= steps[0]["step"] + WARMUP] or steps
    ms = statistics.median(r["ms"] for r in timed)
    total = run["batch"] * run["seq_len"] / ms * 1e3
    return {"gpus": run["gpus"], "batch": run["batch"], "median_step_ms": ms, "tokens_per_s": total,
            "tokens_per_s_per_gpu": total / run["gpus"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tolerance", type=float, default=2e-3)
    parser.add_argument("runs", nargs="+", help="NAME=PATH of a train_gpt --losses-json file")
    args = parser.parse_args()
    runs = {}
    for item in args.runs:
        name, path = item.split("=", 1)
        with open(path) as f:
            runs[name] = json.load(f)

    comparisons = {}
    for name in sorted(runs):
        if name.startswith("gpus") and name != "gpus1" and "gpus1" in runs:
            comparisons[f"{name}_vs_gpus1"] = compare(runs[name], runs["gpus1"], args.tolerance)
        if name.startswith(("resumed_on_", "resume_from_")) and "gpus2" in runs:
            comparisons[f"{name}_vs_gpus2"] = compare(runs[name], runs["gpus2"], args.tolerance)
    speed = {name: throughput(run) for name, run in runs.items()}
    if "gpus1" in speed:
        single = speed["gpus1"]["tokens_per_s_per_gpu"]
        for name, s in speed.items():
            s["per_gpu_vs_gpus1"] = s["tokens_per_s_per_gpu"] / single
    ok = all(c["pass"] for c in comparisons.values())
    # Tokens/s per GPU at the 1-GPU run's sequences per GPU, as a fraction of the 1-GPU run's.
    scaling = {name[len("scaling_"):]: s["per_gpu_vs_gpus1"] for name, s in speed.items()
               if name.startswith("scaling_") and "per_gpu_vs_gpus1" in s}
    out = {
        "tolerance": args.tolerance,
        "pass": ok,
        "per_gpu_throughput_vs_1_gpu": scaling,
        "summary": {name: {"max_abs_loss_diff": c["max_abs_loss_diff"], "at_step": c["at_step"],
                           "first_step_diff": c["first_step_diff"], "pass": c["pass"]}
                    for name, c in comparisons.items()},
        "throughput": speed,
        "comparisons": comparisons,
    }
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
