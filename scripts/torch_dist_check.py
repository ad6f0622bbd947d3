#!/usr/bin/env python3
"""fusekit.torch.patch under data-parallel training: a HuggingFace model patched with
fusekit.torch.patch(model) trains the same steps on the same global batch in one process and in
W processes (DistributedDataParallel, and FSDP2's fully_shard on each decoder block then the
root), with and without torch.compile; the per-step losses of the W-process runs must equal the
1-process run's within a tolerance (bf16 on the GPU: 2e-3; float32 on the CPU: 1e-4).

Each rank trains on its rows of the global batch (rows split evenly, so that the ranks together
see the 1-process run's tokens), at dropout 0 from the same random init (e2e_bench.py's configs
and batches), AdamW and gradient clipping at 1.0 as e2e_bench.py; the losses reported are the
mean over the ranks. A W-process run is compared with the 1-process run of the same compile
setting. Per run: tokens/s per GPU (median step time after warm-up: CUDA events on the GPU,
perf_counter on the CPU), peak memory per rank.

    python3 scripts/torch_dist_check.py --out torch_dist.json               # GPU machine, 2 or more GPUs
    python3 scripts/torch_dist_check.py --world-sizes 2 4 --modes fsdp2 --compile off --out d.json
    python3 scripts/torch_dist_check.py --smoke --out /tmp/d.json           # tiny configs, CPU, gloo
    python3 scripts/perf_report.py --merge torch_dist.json                  # into bench/results, docs

Backend: NCCL on CUDA (NVLink multicast off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1),
gloo on the CPU (--smoke). Exit status 1 when a run fails or misses the tolerance. The JSON
("kind": "torch_dist") is what scripts/perf_report.py merges (bench/results/README.md).
"""
import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_bench import batches, build_model, model_specs  # noqa: E402

MODES = ["ddp", "fsdp2"]
MAX_GRAD_NORM = 1.0


def decoder_blocks(model):
    """The model's decoder blocks (the ModuleList fully_shard wraps one by one)."""
    base = getattr(model, "transformer", None) or getattr(model, "model", None)
    blocks = getattr(base, "h", None) or getattr(base, "layers", None)
    if blocks is None:
        raise NotImplementedError(f"no decoder blocks found in {type(model).__name__}")
    return list(blocks)


def clip_gradients(params, max_norm):
    """clip_grad_norm_ that also takes FSDP2's sharded (DTensor) gradients: the total norm over
    all shards, the same scale on every rank."""
    import torch
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)


def _device(rank, world, device_type):
    import torch
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return torch.device("cpu")


def _worker(rank, world, jobs, out_path):
    """One rank: the jobs (runs) one after the other in one process group; rank 0 writes their
    results (or errors) to out_path."""
    import datetime
    import torch.distributed as dist
    device = _device(rank, world, jobs[0]["device"])
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            init_method=f"file://{jobs[0]['rendezvous']}",
                            timeout=datetime.timedelta(minutes=10))
    results = []
    try:
        for job in jobs:
            try:
                results.append(_train(rank, world, job, device, True))
            except Exception as e:  # noqa: BLE001 - recorded; every rank fails alike (same model, same code)
                results.append({"error": f"{type(e).__name__}: {e}"})
            if device.type == "cuda":
                import torch
                torch.cuda.empty_cache()
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _train(rank, world, job, device, distributed):
    import torch
    import torch.distributed as dist
    import fusekit.torch as fk
    family, kwargs, _, seq = job["spec"]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = build_model(family, kwargs, False, device, dtype, job["seed"])
    fk.patch(model)
    if job["mode"] == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[rank] if device.type == "cuda" else None)
    elif job["mode"] == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in decoder_blocks(model):
            fully_shard(block)
        fully_shard(model)
    if job["compile"]:
        model = torch.compile(model, backend=job["compile_backend"])
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1)
    rows = job["global_batch"] // world
    data = batches(job["steps"], job["global_batch"], seq, kwargs["vocab_size"], "cpu", job["seed"] + 1)
    cuda = device.type == "cuda"
    losses, times = [], []
    for i, tokens in enumerate(data):
        tokens = tokens[rank * rows:(rank + 1) * rows].to(device)
        if i == job["warmup"] and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss  # the model shifts the labels itself
        loss.backward()
        clip_gradients(params, MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = (time.perf_counter() - t0) * 1e3
        loss = loss.detach().float()
        if distributed:  # the mean over the ranks (gloo has no ReduceOp.AVG)
            dist.all_reduce(loss, op=dist.ReduceOp.SUM)
            loss = loss / world
        losses.append(loss.item())
        if i >= job["warmup"]:
            times.append(ms)
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    peaks = [peak]
    if distributed:
        peaks = [None] * world
        dist.all_gather_object(peaks, peak)
    median = statistics.median(times)
    return {"losses": losses, "median_step_ms": round(median, 3),
            "tokens_per_s_per_gpu": round(rows * seq / median * 1e3, 1),
            "peak_memory_gib_per_rank": [round(p / 2**30, 3) for p in peaks]}


def global_batch(batch, world_sizes):
    """The model's batch rounded up so that every world size splits it evenly."""
    return math.lcm(batch, *world_sizes)


def make_job(mode, compile_on, name, spec, args, device):
    return {"mode": mode, "compile": compile_on, "compile_backend": args.compile_backend, "spec": spec,
            "device": device, "steps": args.steps, "warmup": args.warmup, "seed": args.seed,
            "global_batch": args.global_batch[name]}


def run_reference(job):
    """The 1-process run, in this process on the first device, without a process group."""
    import torch
    device = torch.device("cuda", 0) if job["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    try:
        return _train(0, 1, job, device, False)
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run_distributed(world, jobs):
    """The jobs in `world` spawned processes (one process group); their results, rank 0's."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        # The ranks meet through a file in a fresh directory: no port to find free and then lose.
        jobs = [dict(job, rendezvous=os.path.join(tmp, "rendezvous")) for job in jobs]
        out_path = os.path.join(tmp, "rank0.json")
        mp.spawn(_worker, args=(world, jobs, out_path), nprocs=world, join=True)
        with open(out_path) as f:
            return json.load(f)


def compare(result, ref, tolerance):
    """result with its largest per-step loss difference from the reference run and the verdict."""
    if "error" in result:
        return dict(result, **{"pass": False})
    diffs = [abs(a - b) for a, b in zip(result["losses"], ref["losses"])]
    diff = max(diffs) if all(math.isfinite(d) for d in diffs) else math.nan  # max() skips a NaN
    passed = len(result["losses"]) == len(ref["losses"]) and math.isfinite(diff) and diff <= tolerance
    return dict(result, max_abs_loss_diff=float(f"{diff:.3g}"), tolerance=tolerance, **{"pass": passed})


def check_model(name, spec, args, device, log):
    """The runs of one model: {run name: result}, and whether all passed."""
    runs = {}
    compile_settings = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    refs = {}
    for compile_on in compile_settings:
        key = "single" + ("_compile" if compile_on else "")
        try:
            refs[compile_on] = run_reference(make_job("single", compile_on, name, spec, args, device))
            runs[key] = dict(refs[compile_on], mode="single", world_size=1, compile=compile_on)
            log(f"{key:18} {runs[key]['tokens_per_s_per_gpu']:11.0f} tokens/s/GPU  "
                f"losses {[round(x, 5) for x in runs[key]['losses'][:3]]}")
        except Exception as e:  # noqa: BLE001 - recorded; nothing to compare against
            runs[key] = {"mode": "single", "world_size": 1, "compile": compile_on,
                         "error": f"{type(e).__name__}: {e}", "pass": False}
            log(f"{key:18} FAILED: {type(e).__name__}: {e}")
    for world in args.world_sizes:
        plan = [(mode, c) for c in compile_settings if c in refs for mode in args.modes]
        if not plan:
            continue
        try:
            results = run_distributed(world, [make_job(m, c, name, spec, args, device) for m, c in plan])
        except Exception as e:  # noqa: BLE001 - a rank died: every run of this world size failed
            results = [{"error": f"{type(e).__name__}: {e}"}] * len(plan)
        for (mode, compile_on), result in zip(plan, results):
            key = f"{mode}_w{world}" + ("_compile" if compile_on else "")
            runs[key] = dict(compare(result, refs[compile_on], args.tolerance), mode=mode, world_size=world,
                             compile=compile_on)
            r = runs[key]
            if "error" in r:
                log(f"{key:18} FAILED: {r['error']}")
            else:
                log(f"{key:18} {r['tokens_per_s_per_gpu']:11.0f} tokens/s/GPU  max |loss diff| "
                    f"{r['max_abs_loss_diff']:.2e} {'pass' if r['pass'] else 'FAIL'}  "
                    f"peak {r['peak_memory_gib_per_rank']} GiB")
    ok = all(r.get("pass", True) and "error" not in r for r in runs.values())
    return runs, ok


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama-1.25b"])
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    ap.add_argument("--world-sizes", nargs="+", type=int, default=None,
                    help="process counts (default: 2, and 4 where 4 GPUs exist; 2 with --smoke)")
    ap.add_argument("--compile", choices=["both", "on", "off"], default="both")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend (default inductor; aot_eager with --smoke: no C++ build)")
    ap.add_argument("--steps", type=int, default=20, help="training steps per run (losses compared)")
    ap.add_argument("--warmup", type=int, default=5, help="steps before timing (compilation included)")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="max |loss difference| (default 2e-3 for bf16 on the GPU, 1e-4 with --smoke)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--smoke", action="store_true", help="tiny configs in float32 on the CPU with gloo, 3 steps")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    if args.tolerance is None:
        args.tolerance = 1e-4 if args.smoke else 2e-3
    if args.compile_backend is None:
        args.compile_backend = "aot_eager" if args.smoke else "inductor"
    if args.warmup >= args.steps:
        ap.error("--warmup must be less than --steps")
    return args


def main(argv=None):
    args = parse_args(argv)
    # NVLink multicast stays off on the GPU machines; set before any process group starts.
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    import torch
    import transformers
    device = "cpu" if args.smoke else "cuda"
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    if device == "cuda" and gpus < 2:
        print(f"torch_dist_check: {gpus} CUDA device(s); the check needs 2 or more (--smoke: CPU with gloo)",
              file=sys.stderr)
        return 1
    if args.world_sizes is None:
        args.world_sizes = [2] if device == "cpu" else [w for w in (2, 4) if w <= gpus]
    if device == "cuda" and max(args.world_sizes) > gpus:
        print(f"torch_dist_check: world size {max(args.world_sizes)} > {gpus} GPUs", file=sys.stderr)
        return 1
    specs = model_specs(args.smoke)
    args.global_batch = {name: global_batch(specs[name][2], args.world_sizes) for name in args.models}
    doc = {"kind": "torch_dist", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "gpus": gpus, "torch": torch.__version__, "transformers": transformers.__version__,
           "backend": "nccl" if device == "cuda" else "gloo", "steps": args.steps, "warmup": args.warmup,
           "tolerance": args.tolerance, "compile_backend": args.compile_backend,
           "dtype": "float32" if args.smoke else "bfloat16", "models": []}
    ok = True
    for name in args.models:
        spec = specs[name]
        print(f"== {name}: global batch {args.global_batch[name]} x {spec[3]}, world sizes {args.world_sizes}",
              flush=True)
        runs, model_ok = check_model(name, spec, args, device, lambda s: print(s, flush=True))
        ok = ok and model_ok
        doc["models"].append({"model": name, "global_batch": args.global_batch[name], "seq": spec[3],
                              "config": spec[1], "runs": runs, "pass": model_ok})
    doc["pass"] = ok
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"torch_dist_check: {'pass' if ok else 'FAIL'} ({args.out})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
