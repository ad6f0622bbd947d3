"""Compares two per-step loss files (train_gpt --losses-json, reference.py --losses-json): the
losses step by step and the median step time after the first WARMUP steps. Prints JSON; exits 1
when a step's loss differs from the reference's by more than RELATIVE_TOLERANCE of it.

The bound is two bf16 epsilons (2^-7) of the loss: the two programs round their bf16 activations,
weight copies and gradients at different places, and the difference grows over the steps, but a
step that departs by more than that has computed something else."""

import json
import statistics
import sys

WARMUP = 5  # first steps excluded from timings (autotuning, torch.compile, allocator warm-up)
RELATIVE_TOLERANCE = 2.0**-7


def main():
    fusekit_run = json.load(open(sys.argv[1]))
    torch_run = json.load(open(sys.argv[2]))
    a = {r["step"]: r for r in fusekit_run["train"]}
    b = {r["step"]: r for r in torch_run["train"]}
    steps = sorted(set(a) & set(b))
    rows = [{"step": s, "fusekit": a[s]["loss"], "torch": b[s]["loss"],
             "diff": a[s]["loss"] - b[s]["loss"]} for s in steps]
    worst = max(rows, key=lambda r: abs(r["diff"]) / abs(r["torch"]))
    max_rel = abs(worst["diff"]) / abs(worst["torch"])
    timed = [s for s in steps if s > steps[0] + WARMUP - 1] or steps
    ms_a = statistics.median(a[s]["ms"] for s in timed)
    ms_b = statistics.median(b[s]["ms"] for s in timed)
    tokens = fusekit_run["batch"] * fusekit_run["seq_len"]
    out = {
        "steps": len(steps),
        "max_abs_loss_diff": max(abs(r["diff"]) for r in rows),
        "max_rel_loss_diff": max_rel,
        "max_rel_at_step": worst["step"],
        "relative_tolerance": RELATIVE_TOLERANCE,
        "pass": max_rel <= RELATIVE_TOLERANCE,
        "first_step_loss_diff": rows[0]["diff"],
        "last_step_loss": {"fusekit": rows[-1]["fusekit"], "torch": rows[-1]["torch"]},
        "median_step_ms": {"fusekit": ms_a, "torch": ms_b},
        "tokens_per_s": {"fusekit": tokens / ms_a * 1e3, "torch": tokens / ms_b * 1e3},
        "speedup_vs_torch": ms_b / ms_a,
        "torch_compile": torch_run.get("compile"),
        "per_step": rows,
    }
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0 if out["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
