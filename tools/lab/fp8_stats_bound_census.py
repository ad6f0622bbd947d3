#!/usr/bin/env python3
"""How often the FP8 statistics pass would need exact max |q w| products under a bound-based scheme.

Session 39 design sketch (docs/performance-notes.md, "Left for the next session"): per 16-element
vector, max|q| * max|w over the vector's columns| * |scale| bounds max|q w scale| from above, and a
vector needs its exact products only where that bound times rstd (or an upper bound of rstd) can
reach the running max of |y|. This replays the benchmark's data (bench/fp8_norm/bench_fp8_norm_fill.cu:
x = e4m3(150 N(0, 1)), scales bf16(0.001 + 0.01 |N(0, 1)|), weight bf16(N(1, 0.5))) on the CPU.
Needs numpy and ml_dtypes (the build-python venv of `make test` has both). Not a CTest: the
*_sim.py files are, and this one asserts nothing (it prints a census).
"""
import argparse

import ml_dtypes
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    rows, cols = a.rows, a.cols
    x = np.clip(150 * rng.standard_normal((rows, cols)), -448, 448).astype(np.float32)
    x = x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = (0.001 + 0.01 * np.abs(rng.standard_normal((rows, cols // 16)))).astype(ml_dtypes.bfloat16).astype(np.float32)
    w = (1.0 + 0.5 * rng.standard_normal(cols)).astype(ml_dtypes.bfloat16).astype(np.float32)
    xd = x * np.repeat(s, 16, axis=1)
    rstd = 1 / np.sqrt((xd.astype(np.float64) ** 2).mean(1) + 1e-5)
    qv = np.abs(x).reshape(rows, cols // 16, 16)
    wv = np.abs(w).reshape(cols // 16, 16)
    exact = (qv * wv).max(2) * s
    bound = qv.max(2) * wv.max(1) * s
    amax = (exact * rstd[:, None]).max()
    print(f"amax {amax:.4f}; bound / exact per vector, median {np.median(bound / exact):.3f}")
    for frac in (1.0, 0.9, 0.75, 0.5):
        hit = bound * rstd[:, None] >= frac * amax
        print(f"running max at {frac:.2f} amax: vectors needing exact products {100 * hit.mean():.3f}%, "
              f"rows with any {100 * hit.any(1).mean():.2f}%")
    # Before the row's end only an upper bound of rstd is known: from the first half's sum of squares.
    rstd_up = 1 / np.sqrt((xd[:, : cols // 2].astype(np.float64) ** 2).sum(1) / cols + 1e-5)
    for frac in (1.0, 0.9):
        hit = bound[:, cols // 32:] * rstd_up[:, None] >= frac * amax
        print(f"second half with rstd bounded from the first half, running max at {frac:.2f} amax: "
              f"{100 * hit.mean():.3f}% of its vectors")


if __name__ == "__main__":
    main()
