#!/usr/bin/env python3
"""Norm bandwidth over every row length: LayerNorm and RMSNorm, plain and with the residual add,
forward and backward, bf16, fusekit (through fusekit.torch) beside PyTorch eager and torch.compile
and a same-size copy, all timed in one process.

Two sweeps:
  large  every width of widths() (a log grid from 64 to 65536 of at least 200 values: rounded to
         integers, rounded to multiples of 8, and the widths real models use), rows chosen so that
         each problem moves at least 256 MB (the bandwidth regime);
  small  a subset of those widths at 8-16 M elements per tensor (the launch- and reduction-bound
         regime of a small model or a short sequence).
torch.compile is timed twice: `torch_compile_dynamic` (one compilation with dynamic shapes, at every
width) and `torch_compile` specialized to the width (what a training run with a fixed hidden size
gets; the row count stays dynamic so that one compilation serves both sweeps). A specialized
compilation costs seconds per width and function, so --specialized picks where it is timed: the
model widths (default), the anchors (model widths, powers of two and every 8th width), all or none.

Bytes counted as moved (each tensor once, the weights and per-row statistics left out, as
`fusekit bench norm` counts them): plain forward x, y (4 bytes an element); plain backward dy, x,
dx (6); residual forward x, residual, y, sum (8); residual backward dy, dsum, sum, dx (8).

    python3 scripts/norm_sweep.py --out norm_sweep.json            # on the GPU machine
    python3 scripts/perf_report.py --merge norm_sweep.json         # into bench/results, docs
    python3 scripts/norm_sweep.py --smoke --out /tmp/s.json        # a few tiny points on the CPU

The JSON ("kind": "norm_sweep") is what scripts/perf_report.py merges (bench/results/README.md).
"""
import argparse
import json
import math
import statistics
import sys
import time

LARGE_MIN_BYTES = 256 << 20
SMALL_ELEMENTS = 12 << 20  # per tensor, inside the 8-16 M range for every width
MIN_WIDTH, MAX_WIDTH = 64, 65536
# Hidden sizes of common models (GPT-2 family, Llama/Mistral/Qwen/Gemma family and their MLPs).
MODEL_WIDTHS = [768, 1024, 1280, 1536, 1600, 2048, 2304, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192,
                11008, 12288, 13824, 14336, 16384, 18432, 24576, 28672, 32768, 53248, 65536]
BYTES_PER_ELEMENT = {("plain", "fwd"): 4, ("plain", "bwd"): 6, ("residual", "fwd"): 8, ("residual", "bwd"): 8}
BARS = {"fwd": 90.0, "bwd": 85.0}  # % of copy bandwidth, large sweep, N >= 256
BAR_MIN_WIDTH = 256


def log_grid(count, lo=MIN_WIDTH, hi=MAX_WIDTH):
    """count points from lo to hi, equally spaced in log."""
    return [lo * (hi / lo) ** (i / (count - 1)) for i in range(count)]


def widths():
    """The large sweep's widths, sorted: 130 log-grid points rounded to integers (mostly not
    multiples of 8: the masked-tail path), 90 rounded to multiples of 8 (the aligned path off the
    tuning tables), the model widths and the powers of two."""
    points = {round(x) for x in log_grid(130)}
    points |= {max(8, 8 * round(x / 8)) for x in log_grid(90)}
    points |= set(MODEL_WIDTHS)
    points |= {1 << k for k in range(6, 17)}
    return sorted(n for n in points if MIN_WIDTH <= n <= MAX_WIDTH)


def anchor_widths():
    """Where the specialized torch.compile is timed by default: the model widths, the powers of
    two, and every 8th width of the grid (so odd widths are among them)."""
    grid = widths()
    return sorted(set(MODEL_WIDTHS) | {1 << k for k in range(6, 17)} | set(grid[::8]))


def small_widths():
    """The small sweep's widths: every 4th width of the grid and the model widths."""
    grid = widths()
    return sorted(set(grid[::4]) | set(MODEL_WIDTHS))


def large_rows(n):
    """Rows such that the cheapest direction (plain forward, 4 bytes an element) moves >= 256 MB."""
    return math.ceil(LARGE_MIN_BYTES / (BYTES_PER_ELEMENT[("plain", "fwd")] * n))


def small_rows(n):
    return max(1, round(SMALL_ELEMENTS / n))


def problems(sweeps=("large", "small")):
    """(sweep, n, rows) of every problem, in the order they are timed."""
    out = []
    if "large" in sweeps:
        out += [("large", n, large_rows(n)) for n in widths()]
    if "small" in sweeps:
        out += [("small", n, small_rows(n)) for n in small_widths()]
    return out


# ---- timing (torch imported only here: the grid above is tested without it) ---------------------

def make_timer(device):
    import torch
    if device == "cuda":
        flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)

        def timed(fn, reps=30):
            """Median microseconds of `reps` calls, each after an L2 flush and between its own CUDA
            events. The calls are queued behind a GPU sleep longer than their host time, so that the
            GPU runs them back to back: what is timed is the GPU's time, not the host's enqueue
            (autograd's Python and C++ overhead, which a training step hides the same way)."""
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            flush.zero_()
            fn()
            host_ms = (time.perf_counter() - t0) * 1e3
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
            torch.cuda._sleep(int(2e6 * (1.0 + 1.5 * reps * host_ms)))  # ~2e6 cycles a millisecond
            for start, end in zip(starts, ends):
                flush.zero_()
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3
        return timed

    def timed_cpu(fn):
        fn()
        samples = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(samples)
    del torch
    return timed_cpu


def eager_functions():
    import torch.nn.functional as F

    def layer_norm(x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)

    def rms_norm(x, w, b):
        return F.rms_norm(x, (x.shape[-1],), w, 1e-5)

    def layer_norm_residual(x, r, w, b):
        s = x + r
        return F.layer_norm(s, (s.shape[-1],), w, b, 1e-5), s

    def rms_norm_residual(x, r, w, b):
        s = x + r
        return F.rms_norm(s, (s.shape[-1],), w, 1e-5), s
    return {("layer_norm", "plain"): layer_norm, ("rms_norm", "plain"): rms_norm,
            ("layer_norm", "residual"): layer_norm_residual, ("rms_norm", "residual"): rms_norm_residual}


def fusekit_functions():
    import fusekit.torch as fk
    return {("layer_norm", "plain"): lambda x, w, b: fk.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
            ("rms_norm", "plain"): lambda x, w, b: fk.rms_norm(x, (x.shape[-1],), w, 1e-5),
            ("layer_norm", "residual"): lambda x, r, w, b: fk.layer_norm_residual(x, r, w, b, 1e-5),
            ("rms_norm", "residual"): lambda x, r, w, b: fk.rms_norm_residual(x, r, w, 1e-5)}


def measure(problem_list, device, specialized_widths, log=print, checkpoint=lambda points: None):
    import torch
    import torch._dynamo
    import torch._functorch.config
    torch._functorch.config.donated_buffer = False  # the backward is timed repeatedly on one graph
    torch._dynamo.config.cache_size_limit = 1024   # one specialized graph per width
    timed = make_timer(device)
    eager = eager_functions()
    fused = fusekit_functions()
    dynamic = {k: torch.compile(f, dynamic=True) for k, f in eager.items()}
    specialized = {}  # (op, variant, n) -> the compiled function, rows dynamic
    dtype = torch.bfloat16
    points = []
    for sweep, n, rows in problem_list:
        gen = torch.Generator(device=device).manual_seed(n)

        def rand(*shape, scale=1.0, shift=0.0):
            return (torch.randn(*shape, device=device, generator=gen) * scale + shift).to(dtype)
        x, r = rand(rows, n, scale=2.0, shift=0.3), rand(rows, n)
        w, b = rand(n, scale=0.5, shift=1.0), rand(n)
        dy, ds = rand(rows, n), rand(rows, n)
        copy_src = torch.empty(0, dtype=torch.uint8, device=device)
        for (op, variant), f in eager.items():
            impls = {"fusekit": fused[(op, variant)], "torch_eager": f, "torch_compile_dynamic": dynamic[(op, variant)]}
            inputs = (x, w, b) if variant == "plain" else (x, r, w, b)
            if n in specialized_widths:
                if (op, variant, n) not in specialized:
                    specialized[(op, variant, n)] = torch.compile(f)
                impls["torch_compile"] = specialized[(op, variant, n)]
            # (rms_norm leaves b unused: allow_unused below)
            params = [t.detach().requires_grad_(True) for t in inputs]
            for t in inputs + tuple(params):  # the row count stays symbolic, the width static
                if t.dim() == 2:
                    torch._dynamo.mark_dynamic(t, 0)
            grads = (dy,) if variant == "plain" else (dy, ds)
            for direction in ("fwd", "bwd"):
                nbytes = BYTES_PER_ELEMENT[(variant, direction)] * rows * n
                if copy_src.numel() != nbytes // 2:
                    copy_src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
                    copy_dst = torch.empty_like(copy_src)
                times = {"copy": timed(lambda: copy_dst.copy_(copy_src))}
                for impl, fn in impls.items():
                    if direction == "fwd":
                        with torch.no_grad():
                            times[impl] = timed(lambda: fn(*inputs))
                    else:
                        out = fn(*params)
                        outs = (out,) if variant == "plain" else out
                        times[impl] = timed(lambda: torch.autograd.grad(outs, params, grads, retain_graph=True,
                                                                         allow_unused=True))
                        del out, outs
                point = dict(sweep=sweep, op=op, variant=variant, direction=direction, n=n, rows=rows,
                             bytes=nbytes, time_us={k: round(v, 3) for k, v in times.items()})
                points.append(point)
                pct = 100 * times["copy"] / times["fusekit"]
                log(f"{sweep:5} {op:10} {variant:8} {direction} N={n:<6} rows={rows:<8} fusekit "
                    f"{pct:5.1f}% of copy, vs eager {times['torch_eager'] / times['fusekit']:.2f}x, vs compile "
                    f"{min(v for k, v in times.items() if k.startswith('torch_compile')) / times['fusekit']:.2f}x",
                    flush=True)
        del x, r, w, b, dy, ds
        checkpoint(points)
        if device == "cuda":
            torch.cuda.empty_cache()
    return points


def summarize(points):
    """Per (op, variant, direction): the bars' verdicts over the points (what perf_report prints).
    % of copy is the same-size copy's time over fusekit's."""
    groups = {}
    for p in points:
        groups.setdefault((p["op"], p["variant"], p["direction"]), []).append(p)
    out = []
    for (op, variant, direction), ps in sorted(groups.items()):
        t = lambda p, k: p["time_us"].get(k)
        pct = lambda p: 100 * t(p, "copy") / t(p, "fusekit")
        barred = [p for p in ps if p["sweep"] == "large" and p["n"] >= BAR_MIN_WIDTH]
        below = [p for p in barred if pct(p) < BARS[direction]]
        slower = [p for p in ps if any(t(p, k) is not None and t(p, k) < t(p, "fusekit")
                                       for k in ("torch_eager", "torch_compile", "torch_compile_dynamic"))]
        worst = min(barred, key=pct) if barred else None
        out.append(dict(op=op, variant=variant, direction=direction, points=len(ps), barred=len(barred),
                        bar=BARS[direction], below_bar=len(below),
                        min_pct=round(pct(worst), 1) if worst else None, worst_n=worst["n"] if worst else None,
                        median_pct=round(statistics.median(pct(p) for p in barred), 1) if barred else None,
                        slower_than_pytorch=len(slower),
                        slower_widths=sorted({(p["sweep"], p["n"]) for p in slower})[:12]))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON to write")
    ap.add_argument("--sweeps", nargs="+", default=["large", "small"], choices=["large", "small"])
    ap.add_argument("--part", default="1/1", help="K/P: the K-th of P interleaved parts of the problems "
                                                  "(to spread the sweep over several GPU calls)")
    ap.add_argument("--specialized", default="models", choices=["models", "anchors", "all", "none"],
                    help="where the torch.compile specialized to the width is timed (seconds of compilation each)")
    ap.add_argument("--widths", nargs="+", type=int, metavar="N",
                    help="only these row lengths of the sweeps (a quick look at a few widths)")
    ap.add_argument("--smoke", action="store_true", help="four tiny problems on the CPU (checks the script)")
    args = ap.parse_args(argv)

    import torch
    if args.smoke:
        device, todo = "cpu", [("large", 64, 8), ("large", 100, 4), ("small", 72, 3), ("small", 1000, 2)]
    else:
        if not torch.cuda.is_available():
            print("norm_sweep: no CUDA device (use --smoke for a CPU check of the script)", file=sys.stderr)
            return 1
        device, todo = "cuda", problems(args.sweeps)
    k, p = (int(v) for v in args.part.split("/"))
    if not 1 <= k <= p:
        ap.error(f"--part: expected K/P with 1 <= K <= P, got {args.part}")
    if args.widths:
        unknown = sorted(set(args.widths) - {n for _, n, _ in todo})
        if unknown:
            ap.error(f"--widths: {unknown} not in the sweeps' widths (scripts/norm_sweep.py widths())")
        todo = [t for t in todo if t[1] in set(args.widths)]
    todo = todo[k - 1::p]
    specialized = {"models": set(MODEL_WIDTHS), "anchors": set(anchor_widths()), "none": set(),
                   "all": {n for _, n, _ in todo}}[args.specialized]
    def write(points):  # after every problem: a call stopped at its time limit keeps what it measured
        doc = {"kind": "norm_sweep", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "torch": torch.__version__, "part": args.part, "dtype": "bf16", "points": points,
               "summary": summarize(points)}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        return doc
    points = measure(todo, device, {n for _, n, _ in todo} if args.smoke else specialized, checkpoint=write)
    doc = write(points)
    for s in doc["summary"]:
        print(f"{s['op']:10} {s['variant']:8} {s['direction']}: {s['points']} points, bar {s['bar']}% "
              f"below at {s['below_bar']} of {s['barred']} (min {s['min_pct']}% at N={s['worst_n']}, median "
              f"{s['median_pct']}%), slower than PyTorch at {s['slower_than_pytorch']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
