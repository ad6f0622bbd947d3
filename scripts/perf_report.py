#!/usr/bin/env python3
"""Benchmark records -> docs/performance.md and docs/plots/*.png.

The records are bench/results/<device>-<date>.json (schema: bench/results/README.md). This script
  1. optionally merges fresh runs into them: `--merge out/fusekit_bench.json out/torch_bench.json`
     (what `fusekit bench --json` and scripts/torch_bench.py write on the GPU machine); each run's
     rows replace the rows of the same kind in the file of its device and date;
  2. regenerates docs/performance.md: for each device and op family, one table of the newest
     fusekit row of every shape beside PyTorch eager, torch.compile and the SDPA backends where
     they apply, with % of the copy ceiling (memory-bound ops) or of the bf16 GEMM ceiling
     (matrix ops);
  3. draws one PNG per device and family into docs/plots/ (matplotlib; without it the tables are
     still written and the script says so).

    python3 scripts/perf_report.py                                  # tables + plots from records
    python3 scripts/perf_report.py --merge fk.json torch.json       # add a run, then regenerate
    python3 scripts/perf_report.py --merge fk.json --commit abc1234 --date 2026-12-01 --no-plots
"""
import argparse
import datetime
import glob
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = 1

FAMILY_OF_OP = {"layer_norm": "norm", "rms_norm": "norm", "norm": "norm",
                "bias_act_dropout": "bias_act_dropout", "gated_act": "gated_act", "fp8_rms_norm": "fp8_norm",
                "linear": "linear", "attention": "attention", "cross_entropy": "cross_entropy", "rope": "rope",
                "embedding": "embedding", "layer_norm_residual": "norm", "rms_norm_residual": "norm",
                "global_norm": "optim", "adamw_step": "optim", "linear_cross_entropy": "linear_cross_entropy",
                "gated_linear": "gated_linear"}
FAMILIES = ["norm", "bias_act_dropout", "gated_act", "fp8_norm", "linear", "gated_linear", "attention", "rope",
            "cross_entropy",
            "linear_cross_entropy", "embedding", "optim"]
FAMILY_TITLE = {"norm": "LayerNorm / RMSNorm (bf16)", "bias_act_dropout": "Bias + activation + dropout (bf16)",
                "gated_act": "Gated activations: SwiGLU, GeGLU (bf16)",
                "fp8_norm": "FP8 RMSNorm (e4m3 in and out)", "linear": "Linear + bias + activation (bf16)",
                "gated_linear": "Gated linear: gate and up projections with SwiGLU in one GEMM (bf16)",
                "attention": "Attention (bf16)", "cross_entropy": "Cross-entropy (bf16 logits)",
                "rope": "Rotary embeddings of q and k (bf16)",
                "embedding": "Token + position embeddings (bf16 tables, f32 gradients)",
                "linear_cross_entropy": "Linear cross-entropy: loss, dh, dW without the logits (bf16)",
                "optim": "Global gradient norm and AdamW over GPT-2 124M's tensors"}
MATRIX_FAMILIES = {"linear", "gated_linear", "attention", "linear_cross_entropy"}
# Families whose table has a section of torch_bench.py's rows timed with fusekit's PyTorch op.
SAME_TIMER_FAMILIES = {"linear", "gated_linear", "linear_cross_entropy"}
# Implementation names as the records store them; older runs' names on the left.
IMPL_ALIASES = {"torch": "torch_eager", "compile": "torch_compile", "fusekit_py": "fusekit_torch"}
IMPL_LABEL = {"fusekit": "fusekit", "torch_eager": "torch eager", "torch_compile": "torch.compile",
              "flash": "SDPA flash", "efficient": "SDPA efficient", "cudnn": "SDPA cuDNN",
              "fusekit_torch": "fusekit (torch op)", "torch_mm": "torch.mm", "cublas_plain": "cuBLAS plain",
              "copy": "same-size copy", "liger": "Liger-Kernel", "cublaslt_tuned": "cuBLASLt tuned"}


# ---- records ---------------------------------------------------------------------------------

def read_json(path):
    with open(path) as f:
        return json.load(f)


def device_key(name):
    """'NVIDIA H200 (sm_90, ...)' -> 'h200'; 'NVIDIA H100 80GB HBM3' -> 'h100'."""
    m = re.search(r"\b([A-Z]+\d{2,4}[A-Za-z]*)\b", name.replace("NVIDIA", ""))
    return m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def dtype_of(op):
    return "e4m3" if op == "fp8_rms_norm" else "bf16"


def normalize_run(raw, commit):
    """A `fusekit bench --json` or torch_bench.py document -> (run, rows) in the record schema."""
    if "ceilings" in raw:  # fusekit bench
        ceilings = {"copy_gbps": raw["ceilings"].get("copy_gbps"),
                    "gemm_bf16_tflops": raw["ceilings"].get("gemm_bf16_tflops")}
        run = {"source": "fusekit bench", "commit": commit, "ceilings": ceilings}
    else:  # scripts/torch_bench.py: PyTorch's own copy measurement, no GEMM ceiling
        ceilings = {"copy_gbps": raw.get("copy_gbps"), "gemm_bf16_tflops": None}
        run = {"source": "torch_bench", "commit": commit, "ceilings": ceilings, "torch": raw.get("torch")}
    rows = []
    for r in raw["rows"]:
        impl = IMPL_ALIASES.get(r["impl"], r["impl"])
        row = {"family": FAMILY_OF_OP.get(r["op"], r["op"]), "op": r["op"], "direction": r["direction"],
               "shape": r["shape"], "dtype": dtype_of(r["op"]), "impl": impl,
               "time_us": round(r["time_us"], 3)}
        t = r["time_us"]
        if r.get("flops"):
            row["flops"] = r["flops"]
            row["tflops"] = round(r["flops"] / t / 1e6, 2)
            gemm = ceilings["gemm_bf16_tflops"]
            row["ceiling"] = "gemm"
            row["percent_of_ceiling"] = round(100 * row["tflops"] / gemm, 2) if gemm else None
        else:
            row["bytes"] = r.get("bytes", 0)
            row["gbps"] = round(r["bytes"] / t / 1e3, 1) if r.get("bytes") else None
            copy = ceilings["copy_gbps"]
            row["ceiling"] = "copy"
            row["percent_of_ceiling"] = round(100 * row["gbps"] / copy, 2) if copy and row["gbps"] else None
        if r.get("peak_bytes") is not None:
            row["peak_bytes"] = r["peak_bytes"]
        rows.append(row)
    return run, rows


def row_key(r):
    return (r["family"], r["op"], r["direction"], r["shape"], r["dtype"], r["impl"])


def empty_record(device, device_name, date):
    return {"schema": SCHEMA, "device": device, "device_name": device_name, "date": date,
            "commits": [], "runs": [], "rows": []}


def merge_run(record, run, rows):
    """Adds a run to a record: its rows replace the record's rows of the same key; runs no row
    refers to any more are dropped."""
    new_keys = {row_key(r) for r in rows}
    kept = [r for r in record["rows"] if row_key(r) not in new_keys]
    runs = record["runs"] + [run]
    index = len(runs) - 1
    kept += [dict(r, run=index) for r in rows]
    used = sorted({r["run"] for r in kept})
    renumber = {old: new for new, old in enumerate(used)}
    record["runs"] = [runs[i] for i in used]
    record["rows"] = [dict(r, run=renumber[r["run"]]) for r in kept]
    commits = []
    for r in record["runs"]:
        if r.get("commit") and r["commit"] not in commits:
            commits.append(r["commit"])
    record["commits"] = commits
    return record


def write_record(path, record):
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


def merge_norm_sweep(record, raw, commit):
    """A scripts/norm_sweep.py document -> the record's `norm_sweep` entry of that commit: parts of
    one sweep (--part) measured in several GPU calls add up; a point measured again replaces the
    older one."""
    entries = record.setdefault("norm_sweep", [])
    entry = next((e for e in entries if e["commit"] == commit), None)
    if entry is None:
        entry = {"commit": commit, "torch": raw.get("torch"), "dtype": raw.get("dtype", "bf16"), "points": []}
        entries.append(entry)
    key = lambda p: (p["sweep"], p["op"], p["variant"], p["direction"], p["n"])
    fresh = {key(p) for p in raw["points"]}
    entry["points"] = sorted([p for p in entry["points"] if key(p) not in fresh] + raw["points"], key=key)
    return record


# JSON kinds recorded whole: kind -> (record key, producing script (stored with the entry, or
# None), fields kept, what the merge message counts).
ENTRY_KINDS = {
    "e2e": ("e2e", None, ("torch", "transformers", "steps", "warmup", "agreement_steps", "models"),
            lambda raw: f"{len(raw['models'])} models"),
    "sanitize": ("sanitizers", "scripts/sanitize_gpu.sh", ("gpus", "sanitizers", "note"),
                 lambda raw: f"{len(raw['sanitizers'])} family x tool rows"),
    "train_gpt_ddp": ("train_gpt_ddp", "scripts/train_gpt_ddp_check.sh",
                      ("gpus", "tolerance", "after_spike_relative_tolerance", "pass", "per_gpu_throughput_vs_1_gpu",
                       "summary", "throughput", "note"),
                      lambda raw: "data-parallel check"),
    "torch_dist": ("torch_dist", "scripts/torch_dist_check.py",
                   ("torch", "transformers", "gpus", "backend", "dtype", "steps", "warmup", "tolerance",
                    "compile_backend", "pass", "models"),
                   lambda raw: f"DDP / FSDP2 check, {len(raw['models'])} models"),
}


def merge_files(results_dir, paths, commit, date):
    written = []
    for path in paths:
        raw = read_json(path)
        device_name = raw.get("device", "unknown")
        device = device_key(device_name)
        out = os.path.join(results_dir, f"{device}-{date}.json")
        record = read_json(out) if os.path.exists(out) else empty_record(device, device_name, date)
        kind = ENTRY_KINDS.get(raw.get("kind"))
        if kind:  # a run recorded whole, one entry per run with its commit
            key, script, fields, what = kind
            entry = {k: raw[k] for k in fields if k in raw}
            if key == "sanitizers":
                entry["rows"] = entry.pop("sanitizers")
            record.setdefault(key, []).append(dict(entry, commit=commit, **({"script": script} if script else {})))
            write_record(out, record)
            print(f"merged {path} ({what(raw)}) into {os.path.relpath(out, ROOT)}")
            written.append(out)
            continue
        if raw.get("kind") == "norm_sweep":
            write_record(out, merge_norm_sweep(record, raw, commit))
            print(f"merged {path} ({len(raw['points'])} sweep points) into {os.path.relpath(out, ROOT)}")
            written.append(out)
            continue
        if "ceilings" in raw:  # fusekit's device string names SM count and L2; prefer it
            record["device_name"] = device_name
        run, rows = normalize_run(raw, commit)
        write_record(out, merge_run(record, run, rows))
        print(f"merged {path} ({len(rows)} rows) into {os.path.relpath(out, ROOT)}")
        written.append(out)
    return written


def load_records(results_dir):
    records = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        rec = read_json(path)
        if rec.get("schema") == SCHEMA:
            records.append(rec)
    return records


# ---- selection -------------------------------------------------------------------------------

def current_rows(records, device, family):
    """The newest row of each key for one device and family, and of those the fusekit rows (what
    the table shows: a shape measured only on an older date keeps its row, the provenance line
    names every date). Each row is paired with its record."""
    newest = {}
    for rec in sorted((r for r in records if r["device"] == device), key=lambda r: r["date"]):
        for r in rec["rows"]:
            if r["family"] == family:
                newest[row_key(r)] = (r, rec)
    main = [(r, rec) for r, rec in newest.values() if r["impl"] == "fusekit"]
    # Oldest date first, each date's rows in the order its benchmark printed them.
    order = {}
    for rec in sorted((r for r in records if r["device"] == device), key=lambda r: r["date"]):
        for i, r in enumerate(rec["rows"]):
            order[(rec["date"], row_key(r))] = i
    main.sort(key=lambda p: (p[1]["date"], order.get((p[1]["date"], row_key(p[0])), 0)))
    return newest, main


def lookup(newest, r, impl, shape=None, op=None):
    key = (r["family"], op or r["op"], r["direction"], shape or r["shape"], r["dtype"], impl)
    hit = newest.get(key)
    return hit[0] if hit else None


def us(row):
    return f"{row['time_us']:.1f}" if row else "-"


def speedup(other, mine):
    return f"{other['time_us'] / mine['time_us']:.2f}" if other else "-"


def ceilings_of(row, rec):
    return rec["runs"][row["run"]]["ceilings"]


def provenance(main):
    dates = sorted({rec["date"] for _, rec in main})
    commits = []
    for r, rec in main:
        c = rec["runs"][r["run"]].get("commit")
        if c and c not in commits:
            commits.append(c)
    copy = sorted({round(ceilings_of(r, rec)["copy_gbps"]) for r, rec in main if ceilings_of(r, rec).get("copy_gbps")})
    gemm = sorted({round(ceilings_of(r, rec)["gemm_bf16_tflops"]) for r, rec in main
                   if ceilings_of(r, rec).get("gemm_bf16_tflops")})
    text = f"Measured {', '.join(dates)}"
    if commits:
        text += f" (commit {', '.join(commits)})"
    text += "; ceilings in the same run: copy " + "/".join(map(str, copy)) + " GB/s"
    if gemm:
        text += ", bf16 GEMM " + "/".join(map(str, gemm)) + " TFLOP/s"
    return text + "."


# ---- tables ----------------------------------------------------------------------------------

def memory_table(newest, main):
    out = ["| op | dir | shape | fusekit us | GB/s | % of copy | same-size copy % | torch eager us | "
           "torch.compile us | Liger us | x eager | x compile | x Liger |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    copies = {}
    for (fam, op, d, shape, dt, impl), (r, rec) in newest.items():
        if impl == "copy":
            copies[shape] = (r, rec)
    for r, rec in main:
        te, tc = lookup(newest, r, "torch_eager"), lookup(newest, r, "torch_compile")
        lg = lookup(newest, r, "liger")
        same = copies.get(r["shape"]) or copies.get(r["shape"].split(")")[0] + ")")
        copy_pct = "-"
        if same and same[0].get("gbps"):
            copy_pct = f"{100 * same[0]['gbps'] / ceilings_of(*same)['copy_gbps']:.1f}%"
        pct = f"{r['percent_of_ceiling']:.1f}%" if r.get("percent_of_ceiling") is not None else "-"
        gbps = f"{r['gbps']:.0f}" if r.get("gbps") else "-"
        out.append(f"| {r['op']} | {r['direction']} | {r['shape']} | {us(r)} | {gbps} | {pct} | {copy_pct} | "
                   f"{us(te)} | {us(tc)} | {us(lg)} | {speedup(te, r)} | {speedup(tc, r)} | {speedup(lg, r)} |")
    return out


def gemm_table(newest, main, tuned=False, liger=False):
    """fusekit's matrix rows (fusekit bench) beside the plain cuBLAS GEMMs of the same shape and
    PyTorch; `tuned`: also the same GEMMs through cuBLASLt with their algorithm timed (impl
    cublaslt_tuned, fusekit bench); `liger`: also Liger-Kernel's rows (torch_bench.py)."""
    head = "| dir | shape | fusekit us | TFLOP/s | % of GEMM | cuBLAS plain us | fusekit / plain |"
    rule = "|---|---|---:|---:|---:|---:|---:|"
    if tuned:
        head += " cuBLASLt tuned us | fusekit / tuned |"
        rule += "---:|---:|"
    head += " torch eager us | torch.compile us |" + (" Liger us |" if liger else "") + " x eager | x compile |"
    rule += "---:|---:|" + ("---:|" if liger else "") + "---:|---:|"
    if liger:
        head += " x Liger |"
        rule += "---:|"
    out = [head, rule]
    for r, rec in main:
        plain = lookup(newest, r, "cublas_plain")
        te, tc = lookup(newest, r, "torch_eager"), lookup(newest, r, "torch_compile")
        rel = f"{r['time_us'] / plain['time_us']:.3f}" if plain else "-"
        pct = f"{r['percent_of_ceiling']:.1f}%" if r.get("percent_of_ceiling") is not None else "-"
        line = f"| {r['direction']} | {r['shape']} | {us(r)} | {r['tflops']:.0f} | {pct} | {us(plain)} | {rel} |"
        if tuned:
            lt = lookup(newest, r, "cublaslt_tuned")
            line += f" {us(lt)} | {r['time_us'] / lt['time_us']:.3f} |" if lt else " - | - |"
        lg = lookup(newest, r, "liger") if liger else None
        line += f" {us(te)} | {us(tc)} |" + (f" {us(lg)} |" if liger else "")
        line += f" {speedup(te, r)} | {speedup(tc, r)} |" + (f" {speedup(lg, r)} |" if liger else "")
        out.append(line)
    return out


def same_timer_rows(newest):
    """fusekit through its PyTorch op (impl fusekit_torch), timed by torch_bench.py in turns with
    PyTorch and torch.mm (matrix ops run at the power limit, where the clock drifts between
    separate timings)."""
    return [(r, rec) for (_, _, _, _, _, impl), (r, rec) in newest.items() if impl == "fusekit_torch"]


def linear_table(newest, main):
    out = gemm_table(newest, main)
    same = same_timer_rows(newest)
    if same:
        out += ["", "Same timer (scripts/torch_bench.py, implementations taking turns, L2 flushed; fusekit "
                "through its PyTorch op):", "",
                "| dir | shape | fusekit us | torch.mm us | fusekit / mm | torch eager us | torch.compile us | x eager | x compile |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r, rec in same:
            mm = lookup(newest, r, "torch_mm")
            te, tc = lookup(newest, r, "torch_eager"), lookup(newest, r, "torch_compile")
            rel = f"{r['time_us'] / mm['time_us']:.3f}" if mm else "-"
            out.append(f"| {r['direction']} | {r['shape']} | {us(r)} | {us(mm)} | {rel} | {us(te)} | {us(tc)} | "
                       f"{speedup(te, r)} | {speedup(tc, r)} |")
    return out


def mib(row):
    return f"{row['peak_bytes'] / 2**20:.0f}" if row and row.get("peak_bytes") is not None else "-"


def same_timer_memory_table(newest, main, mm_note, **gemm_columns):
    """fusekit bench's rows (against the plain cuBLAS GEMMs), then torch_bench.py's: fusekit's
    PyTorch op, PyTorch eager and compiled, Liger-Kernel and the plain GEMMs through torch
    (mm_note says which), taking turns, with each one's peak memory over the step."""
    out = gemm_table(newest, main, **gemm_columns) if main else []
    same = same_timer_rows(newest)
    if same:
        out += ["", "Same timer (scripts/torch_bench.py, implementations taking turns, L2 flushed; fusekit "
                f"through its PyTorch op; torch.mm: {mm_note}; "
                "peak: the most memory the training step allocates beyond its inputs, gradients included):", "",
                "| dir | shape | fusekit us | torch.mm us | fusekit / mm | torch eager us | torch.compile us | "
                "Liger us | x eager | x compile | x Liger | fusekit peak MiB | eager peak MiB | "
                "compile peak MiB | Liger peak MiB |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r, rec in same:
            mm = lookup(newest, r, "torch_mm")
            te, tc, lg = (lookup(newest, r, i) for i in ("torch_eager", "torch_compile", "liger"))
            rel = f"{r['time_us'] / mm['time_us']:.3f}" if mm else "-"
            out.append(f"| {r['direction']} | {r['shape']} | {us(r)} | {us(mm)} | {rel} | {us(te)} | {us(tc)} | "
                       f"{us(lg)} | {speedup(te, r)} | {speedup(tc, r)} | {speedup(lg, r)} | {mib(r)} | {mib(te)} | "
                       f"{mib(tc)} | {mib(lg)} |")
    return out


def linear_cross_entropy_table(newest, main):
    return same_timer_memory_table(newest, main, "the three plain GEMMs logits, dh, dW through torch.matmul")


def gated_linear_table(newest, main):
    return same_timer_memory_table(newest, main, "the plain GEMMs of the same total shape: x W^T forward, "
                                   "dpre W and dpre^T x backward", tuned=True, liger=True)


def attention_table(newest, main):
    out = ["| shape | dir | fusekit us | TFLOP/s | % of GEMM | flash us | efficient us | cuDNN us | "
           "x flash | x efficient | x cuDNN |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r, rec in main:
        fl, ef, cu = (lookup(newest, r, i) for i in ("flash", "efficient", "cudnn"))
        pct = f"{r['percent_of_ceiling']:.1f}%" if r.get("percent_of_ceiling") is not None else "-"
        out.append(f"| {r['shape']} | {r['direction']} | {us(r)} | {r['tflops']:.0f} | {pct} | {us(fl)} | {us(ef)} | "
                   f"{us(cu)} | {speedup(fl, r)} | {speedup(ef, r)} | {speedup(cu, r)} |")
    return out


TABLES = {"norm": memory_table, "bias_act_dropout": memory_table, "gated_act": memory_table,
          "fp8_norm": memory_table, "linear": linear_table, "gated_linear": gated_linear_table, "attention": attention_table,
          "cross_entropy": memory_table, "rope": memory_table,
          "embedding": memory_table, "linear_cross_entropy": linear_cross_entropy_table, "optim": memory_table}

HEADER = """# fusekit performance

Generated by `scripts/perf_report.py` from the records in `bench/results/` (one JSON file per
device and date; schema in `bench/results/README.md`). Do not edit by hand: run the benchmarks on
the GPU machine and merge them (see "Regenerating" at the end).

fusekit's times come from `fusekit bench` (CUDA events, median of 100 back-to-back calls, inputs
rotated so that the working set exceeds L2); PyTorch's from `scripts/torch_bench.py`
(`triton.testing.do_bench`, median, L2 flushed). Memory-bound ops count each input and output
once and report GB/s against the device-to-device copy ceiling measured in the same run; matrix
ops report TFLOP/s against cuBLAS's bf16 8192^3 GEMM in the same run. "x eager" is PyTorch's
time over fusekit's (above 1: fusekit is faster).
"""

FOOTER = """## Regenerating

On the GPU machine (`bash scripts/device_run.sh` runs both and keeps the JSON in `$OUT`):

    build/fusekit bench --json out/fusekit_bench.json          # optionally: ops, --shapes, --override k=v
    python3 scripts/torch_bench.py --out out/torch_bench.json norm dropout linear fp8_norm attention rope cross_entropy linear_cross_entropy

Then, in the repository:

    python3 scripts/perf_report.py --merge out/fusekit_bench.json out/torch_bench.json --commit <hash>

which adds the runs to `bench/results/<device>-<date>.json` and rewrites this file and
`docs/plots/`. Design notes and what was tried: `docs/performance-notes.md`.
"""


def newest_norm_sweep(recs):
    """(date, entry) of the newest norm_sweep entry among one device's records, or None."""
    found = [(r["date"], i, e) for r in recs for i, e in enumerate(r.get("norm_sweep", []))]
    if not found:
        return None
    date, _, entry = max(found, key=lambda x: (x[0], x[1]))
    return date, entry


def norm_sweep_table(date, entry):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import norm_sweep  # the bars and the verdicts live beside the sweep
    # What the entry holds (a sweep stopped at its time limit holds a prefix of the problems).
    sweeps = []
    for name, what in (("large", "each problem moving at least 256 MB"),
                       ("small", f"{norm_sweep.SMALL_ELEMENTS >> 20} M elements a tensor")):
        widths = {p["n"] for p in entry["points"] if p["sweep"] == name}
        if widths:
            sweeps.append(f"the {name} sweep at {len(widths)} row lengths from {min(widths)} to {max(widths)}, {what}")
    missing = [name for name in ("large", "small") if not any(p["sweep"] == name for p in entry["points"])]
    lines = [f"`scripts/norm_sweep.py`, measured {date} (commit {entry['commit']}, PyTorch {entry.get('torch')}): "
             + "; ".join(sweeps) + (f" (the {' and '.join(missing)} sweep not in this record)" if missing else "")
             + ". % of copy: a same-size copy's time over "
             f"fusekit's, at each point. The bars apply to the large sweep at N >= {norm_sweep.BAR_MIN_WIDTH}; "
             "\"slower than PyTorch\" counts the points of both sweeps where eager or either torch.compile beat "
             "fusekit.", "",
             "| op | variant | direction | points | bar | below the bar | min % of copy (N) | median % | "
             "slower than PyTorch |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for v in norm_sweep.summarize(entry["points"]):
        worst = f"{v['min_pct']:.1f} ({v['worst_n']})" if v["min_pct"] is not None else "-"
        median = f"{v['median_pct']:.1f}" if v["median_pct"] is not None else "-"
        lines.append(f"| {v['op']} | {v['variant']} | {v['direction']} | {v['points']} | {v['bar']:.0f}% | "
                     f"{v['below_bar']} of {v['barred']} | {worst} | {median} | {v['slower_than_pytorch']} |")
    return lines


E2E_LABEL = {"eager": "PyTorch eager", "compile": "torch.compile", "fusekit": "fusekit (patch)",
             "fusekit_compile": "fusekit + torch.compile", "liger": "Liger-Kernel"}


def e2e_table(date, entry):
    lines = [f"`scripts/e2e_bench.py`, measured {date} (commit {entry['commit']}, PyTorch {entry.get('torch')}, "
             f"transformers {entry.get('transformers')}): median of {entry.get('steps')} steps after "
             f"{entry.get('warmup')} of warm-up, bf16 weights, AdamW, random init; the loss difference is the "
             f"largest over {entry.get('agreement_steps')} steps at dropout 0 against eager.", ""]
    for m in entry["models"]:
        lines += [f"**{m['model']}**, batch {m['batch']} x {m['seq']}:", "",
                  "| mode | ms/step | tokens/s | vs torch.compile | peak memory (GiB) | loss difference vs eager |",
                  "|---|---:|---:|---:|---:|---:|"]
        for mode, r in m["modes"].items():
            label = E2E_LABEL.get(mode, mode)
            if "median_step_ms" not in r:
                lines.append(f"| {label} | {r.get('skipped') or r.get('error')} | | | | |")
                continue
            speed = f"{r['speedup_vs_compile']:.3f}" if "speedup_vs_compile" in r else "-"
            diff = f"{r['max_loss_diff_vs_eager']:.2e}" if "max_loss_diff_vs_eager" in r else "-"
            lines.append(f"| {label} | {r['median_step_ms']:.1f} | {r['tokens_per_s']:.0f} | {speed} | "
                         f"{r['peak_memory_gib']:.2f} | {diff} |")
        lines.append("")
    return lines


SANITIZER_TOOLS = ["memcheck", "racecheck", "initcheck", "synccheck"]


def sanitizer_table(recs):
    """The newest result of each (family, tool) over the device's records, with its date and commit."""
    newest = {}
    for rec in sorted(recs, key=lambda r: r["date"]):
        for entry in rec.get("sanitizers", []):
            for row in entry["rows"]:
                newest[(row["family"], row["tool"])] = (rec["date"], entry["commit"], row)
    if not newest:
        return []
    tools = [t for t in SANITIZER_TOOLS if any(k[1] == t for k in newest)]
    lines = ["`scripts/sanitize_gpu.sh`: every GPU test family under each compute-sanitizer tool; the newest "
             "run of each, as errors (date, commit). Hazards that racecheck reports inside cuBLASLt's own "
             "kernels (nvjet_*) are counted apart.", "",
             "| family | " + " | ".join(tools) + " |", "|---|" + "---|" * len(tools)]
    for family in sorted({k[0] for k in newest}):
        cells = []
        for tool in tools:
            if (family, tool) not in newest:
                cells.append("not run")
                continue
            date, commit, row = newest[(family, tool)]
            ended = sum(1 for code in row.get("exit_codes", []) if code)
            verdict = ("clean" if row["clean"] else
                       "NOT CLEAN: " + ("no summary" if row["errors"] is None else
                                        f"{row['errors']} errors" if row["errors"] else
                                        f"0 errors, {ended} of {row['shards']} shards ended with an error"))
            cells.append(f"{verdict} ({date}, {commit})")
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    return lines


def ddp_table(recs):
    runs = [(r["date"], e) for r in recs for e in r.get("train_gpt_ddp", [])]
    if not runs:
        return []
    lines = ["`scripts/train_gpt_ddp_check.sh`: `train_gpt --gpus N` against one GPU at the same global batch, "
             "and checkpoints resumed on another GPU count; the largest loss difference before the first loss "
             "spike (absolute) and from it on (relative to the loss); tokens/s per GPU at N x the batch as a "
             "fraction of one GPU's.", "",
             "| date | commit | comparison | spike at step | before it | from it on | pass |",
             "|---|---|---|---:|---:|---:|---|"]
    for date, e in sorted(runs, key=lambda x: x[0]):
        for name, c in e["summary"].items():
            lines.append(f"| {date} | {e['commit']} | {name} | {c.get('spike_step') or '-'} | "
                         f"{c['max_abs_loss_diff_before_spike']:.1e} | {c['max_rel_loss_diff_from_spike']:.2%} | "
                         f"{'yes' if c['pass'] else 'NO'} |")
        scaling = ", ".join(f"{k}: {v:.2f}" for k, v in e.get("per_gpu_throughput_vs_1_gpu", {}).items())
        if scaling:
            lines.append(f"| {date} | {e['commit']} | tokens/s per GPU vs 1 GPU | | {scaling} | | |")
    return lines


TORCH_DIST_MODE = {"single": "1 process", "ddp": "DDP", "fsdp2": "FSDP2 (fully_shard)"}


def torch_dist_table(recs):
    runs = [(r["date"], e) for r in recs for e in r.get("torch_dist", [])]
    if not runs:
        return []
    lines = ["`scripts/torch_dist_check.py`: a HuggingFace model patched with `fusekit.torch.patch` trained on "
             "the same global batch in one process and in N (each rank its rows), dropout 0, AdamW; the largest "
             "per-step loss difference from the 1-process run of the same compile setting; tokens/s per GPU from "
             "the median step after warm-up; peak memory, the largest over the ranks.", "",
             "| date | commit | model | run | GPUs | torch.compile | tokens/s per GPU | peak memory (GiB) | "
             "loss difference | pass |", "|---|---|---|---|---:|---|---:|---:|---:|---|"]
    for date, e in sorted(runs, key=lambda x: x[0]):
        for m in e["models"]:
            for r in m["runs"].values():
                head = (f"| {date} | {e['commit']} | {m['model']} (batch {m['global_batch']} x {m['seq']}) | "
                        f"{TORCH_DIST_MODE.get(r.get('mode'), r.get('mode'))} | {r.get('world_size', '-')} | "
                        f"{'yes' if r.get('compile') else 'no'} |")
                if "error" in r:
                    lines.append(f"{head} {r['error'][:120]} | | | NO |")
                    continue
                diff = f"{r['max_abs_loss_diff']:.1e} (bar {r['tolerance']:.0e})" if "max_abs_loss_diff" in r \
                    else "reference"
                verdict = "-" if "pass" not in r else ("yes" if r["pass"] else "NO")
                lines.append(f"{head} {r['tokens_per_s_per_gpu']:.0f} | {max(r['peak_memory_gib_per_rank']):.2f} | "
                             f"{diff} | {verdict} |")
    return lines


def render(records, plot_dir=None):
    devices = sorted({r["device"] for r in records})
    lines = [HEADER]
    contents = []
    body = []
    for device in devices:
        recs = [r for r in records if r["device"] == device]
        name = max(recs, key=lambda r: r["date"])["device_name"]
        body += [f"## {device.upper()}", "", f"Device: {name}.", ""]
        for family in FAMILIES:
            newest, main = current_rows(records, device, family)
            # A family timed only through its PyTorch op on this device still gets its table.
            shown = main or (same_timer_rows(newest) if family in SAME_TIMER_FAMILIES else [])
            if not shown:
                continue
            title = f"{FAMILY_TITLE[family]}, {device.upper()}"
            contents.append(f"- [{title}](#{re.sub(r'[^a-z0-9 _-]', '', title.lower()).replace(' ', '-')})")
            body += [f"### {title}", "", provenance(shown), ""]
            body += TABLES[family](newest, main)
            if plot_dir and os.path.exists(os.path.join(plot_dir, f"{device}-{family}.png")):
                body += ["", f"![{title}](plots/{device}-{family}.png)"]
            body.append("")
        sweep = newest_norm_sweep(recs)
        if sweep:
            date, entry = sweep
            title = f"Norm bandwidth over every row length, {device.upper()}"
            contents.append(f"- [{title}](#{re.sub(r'[^a-z0-9 _-]', '', title.lower()).replace(' ', '-')})")
            body += [f"### {title}", ""] + norm_sweep_table(date, entry)
            if plot_dir and os.path.exists(os.path.join(plot_dir, f"{device}-norm-sweep.png")):
                body += ["", f"![{title}](plots/{device}-norm-sweep.png)"]
            body.append("")
        e2e = [(r["date"], e) for r in recs for e in r.get("e2e", [])]
        if e2e:
            date, entry = max(enumerate(e2e), key=lambda x: (x[1][0], x[0]))[1]
            title = f"Training HuggingFace models end to end (PyTorch), {device.upper()}"
            contents.append(f"- [{title}](#{re.sub(r'[^a-z0-9 _-]', '', title.lower()).replace(' ', '-')})")
            body += [f"### {title}", ""] + e2e_table(date, entry) + [""]
        runs = [(r["date"], t) for r in recs for t in r.get("train_gpt", [])]
        if runs:
            title = f"Training GPT-2 124M end to end (apps/train_gpt against PyTorch), {device.upper()}"
            contents.append(f"- [{title}](#{re.sub(r'[^a-z0-9 _-]', '', title.lower()).replace(' ', '-')})")
            body += [f"### {title}", "", "`scripts/train_gpt_compare.sh`: the C++ trainer and "
                     "`apps/train_gpt/reference.py` (same weights, data order and step), one after the "
                     "other in one GPU call. Loss error: the largest relative departure of the loss "
                     "from the reference's float32 run over the steps, fusekit's and PyTorch's own in bf16 "
                     "(the bar: fusekit's at most twice PyTorch's).", "",
                     "| date | commit | reference | fusekit ms/step | reference ms/step | fusekit tokens/s | "
                     "reference tokens/s | speed-up | largest loss difference (step) | loss error vs float32, "
                     "fusekit / PyTorch |",
                     "|---|---|---|---:|---:|---:|---:|---:|---|---|"]
            for date, t in sorted(runs, key=lambda x: x[0]):
                worst = max(t["per_step"], key=lambda s: abs(s["diff"]))
                ref = "torch.compile" if t.get("torch_compile") else "eager"
                err = t.get("max_rel_err_vs_fp32")
                err = f"{err['fusekit']:.2%} / {err['torch']:.2%}" if err else "-"
                body.append(f"| {date} | {t['commit']} | {ref} | {t['median_step_ms']['fusekit']:.1f} | "
                            f"{t['median_step_ms']['torch']:.1f} | {t['tokens_per_s']['fusekit']:.0f} | "
                            f"{t['tokens_per_s']['torch']:.0f} | {t['speedup_vs_torch']:.3f} | "
                            f"{abs(worst['diff']):.4f} ({worst['step']}) | {err} |")
            body.append("")
        for title, table in ((f"Data-parallel training (apps/train_gpt --gpus N), {device.upper()}", ddp_table(recs)),
                             (f"fusekit.torch.patch under DDP and FSDP2, {device.upper()}", torch_dist_table(recs)),
                             (f"compute-sanitizer over the GPU tests, {device.upper()}", sanitizer_table(recs))):
            if table:
                contents.append(f"- [{title}](#{re.sub(r'[^a-z0-9 _-]', '', title.lower()).replace(' ', '-')})")
                body += [f"### {title}", ""] + table + [""]
    lines += contents + [""] + body + [FOOTER]
    return "\n".join(lines)


# ---- plots -----------------------------------------------------------------------------------

def plot_bars(records, plot_dir):
    """One horizontal bar chart per device and family: % of the ceiling (copy or GEMM, fusekit's
    run's) for fusekit and its comparisons. Returns the files written, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    os.makedirs(plot_dir, exist_ok=True)
    written = []
    for device in sorted({r["device"] for r in records}):
        for family in FAMILIES:
            newest, main = current_rows(records, device, family)
            if not main:
                continue
            impls = ["fusekit"] + (["flash", "efficient", "cudnn"] if family == "attention"
                                   else ["torch_eager", "torch_compile"])
            if family in ("linear", "gated_linear"):
                impls.append("cublas_plain")
            labels, series = [], {i: [] for i in impls}
            for r, rec in main:
                labels.append(f"{r['op'] if family == 'norm' else ''} {r['direction']} {r['shape']}".strip())
                ceil = ceilings_of(r, rec)
                for impl in impls:
                    other = r if impl == "fusekit" else lookup(newest, r, impl)
                    if other is None:
                        series[impl].append(0)
                    elif family in MATRIX_FAMILIES:
                        series[impl].append(100 * other["flops"] / other["time_us"] / 1e6 / ceil["gemm_bf16_tflops"])
                    else:
                        series[impl].append(100 * r["bytes"] / other["time_us"] / 1e3 / ceil["copy_gbps"])
            impls = [i for i in impls if any(series[i])]
            n = len(labels)
            height = 0.8 / len(impls)
            fig, ax = plt.subplots(figsize=(9, 0.9 + 0.28 * n * max(1, len(impls) / 2)))
            for k, impl in enumerate(impls):
                ax.barh([i + k * height for i in range(n)], series[impl], height=height, label=IMPL_LABEL.get(impl, impl))
            ax.set_yticks([i + 0.4 - height / 2 for i in range(n)])
            ax.set_yticklabels(labels, fontsize=7)
            ax.invert_yaxis()
            ax.set_xlabel("% of bf16 GEMM ceiling (TFLOP/s)" if family in MATRIX_FAMILIES else "% of copy bandwidth (same bytes)")
            ax.set_title(f"{FAMILY_TITLE[family]}, {device.upper()}")
            ax.legend(fontsize=7, loc="lower right")
            ax.grid(axis="x", alpha=0.3)
            fig.tight_layout()
            path = os.path.join(plot_dir, f"{device}-{family}.png")
            fig.savefig(path, dpi=90, bbox_inches="tight")
            plt.close(fig)
            written.append(path)
    for device in sorted({r["device"] for r in records}):
        sweep = newest_norm_sweep([r for r in records if r["device"] == device])
        if sweep:
            written.append(plot_norm_sweep(plt, device, sweep[1], plot_dir))
    return written


def plot_norm_sweep(plt, device, entry, plot_dir):
    """% of copy bandwidth against N (log), one panel per (op, direction) of the large sweep and
    row class (N a multiple of 8, the 16-byte vector kernels; or not, in a contiguous tensor):
    fusekit plain and residual, eager and torch.compile (plain), the bar."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import norm_sweep
    fig, axes = plt.subplots(2, 4, figsize=(16, 7), sharex=True, sharey=True)
    styles = [("fusekit", "plain", "fusekit", "-"), ("fusekit", "residual", "fusekit + residual", "-"),
              ("torch_eager", "plain", "torch eager", ":"), ("torch_compile_dynamic", "plain", "torch.compile (dynamic)", ":"),
              ("torch_compile", "plain", "torch.compile (per width)", "")]
    classes = [("N % 8 = 0", lambda n: n % 8 == 0), ("N % 8 != 0", lambda n: n % 8 != 0)]
    for row, op in enumerate(("layer_norm", "rms_norm")):
        for d, direction in enumerate(("fwd", "bwd")):
            for k, (class_name, in_class) in enumerate(classes):
                col = 2 * d + k
                ax = axes[row][col]
                for impl, variant, label, line in styles:
                    ps = sorted((p for p in entry["points"] if p["sweep"] == "large" and p["op"] == op and
                                 p["variant"] == variant and p["direction"] == direction and in_class(p["n"]) and
                                 p["time_us"].get(impl)), key=lambda p: p["n"])
                    if ps:
                        ax.plot([p["n"] for p in ps], [100 * p["time_us"]["copy"] / p["time_us"][impl] for p in ps],
                                line or "o", markersize=3, linewidth=1, label=label)
                ax.axhline(norm_sweep.BARS[direction], color="gray", linewidth=0.8, linestyle="--")
                ax.set_xscale("log", base=2)
                ax.set_title(f"{op} {direction}, {class_name}", fontsize=9)
                ax.grid(alpha=0.3)
                if col == 0:
                    ax.set_ylabel("% of copy bandwidth")
                if row == 1:
                    ax.set_xlabel("N (row length)")
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Norms over every row length (>= 256 MB a problem, bf16), {device.upper()}")
    fig.tight_layout()
    path = os.path.join(plot_dir, f"{device}-norm-sweep.png")
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path


# ---- main ------------------------------------------------------------------------------------

def git_commit():
    try:
        return subprocess.check_output(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(ROOT, "bench", "results"), help="records folder")
    ap.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                    help="fresh `fusekit bench --json` / torch_bench.py output to add to the records first")
    ap.add_argument("--commit", help="commit the merged runs measured (default: git HEAD)")
    ap.add_argument("--date", help="date of the merged runs, YYYY-MM-DD (default: today, UTC)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "performance.md"), help="markdown to write ('-': stdout)")
    ap.add_argument("--plots", default=os.path.join(ROOT, "docs", "plots"), help="folder for the PNG plots")
    ap.add_argument("--no-plots", action="store_true", help="tables only")
    args = ap.parse_args(argv)

    if args.merge:
        date = args.date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        merge_files(args.results, args.merge, args.commit or git_commit(), date)
    records = load_records(args.results)
    if not records:
        print(f"perf_report: no records in {args.results}", file=sys.stderr)
        return 1
    plots = None
    if not args.no_plots:
        plots = plot_bars(records, args.plots)
        if plots is None:
            print("perf_report: matplotlib is not installed; writing the tables without plots "
                  "(python3 -m pip install matplotlib)", file=sys.stderr)
    text = render(records, plot_dir=args.plots)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {os.path.relpath(args.out, ROOT)}" + (f" and {len(plots)} plots" if plots else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
