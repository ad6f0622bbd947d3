#!/usr/bin/env python3
"""PyTorch equivalents of fusekit's ops, timed on the same shapes (bf16, random data), eager and
torch.compile, with triton.testing.do_bench (median, L2 flushed between runs); linear's GEMMs
with the implementations taking turns (bench_interleaved), fusekit's PyTorch binding among them
when it is importable. Also records PyTorch's own error against float64, so that fusekit's
error can be set beside it.
Writes JSON rows shaped like `fusekit bench --json` (impl torch_eager, torch_compile, torch_mm,
fusekit_torch, liger, flash, efficient, cudnn; linear_cross_entropy's rows also carry peak_bytes),
which scripts/perf_report.py --merge adds to the records."""
import argparse
import json

import torch
import torch._functorch.config
import torch.nn.functional as F
import triton.testing

# Backward is timed repeatedly on one graph (retain_graph), which donated buffers forbid.
torch._functorch.config.donated_buffer = False

NORM_SHAPES = [(16384, 1024), (16384, 4096), (8192, 8192), (4096, 16384), (32768, 2048),
               (16384, 5120), (8192, 12288)]
DROPOUT_SHAPES = [(16384, 4096), (8192, 16384), (32768, 1024), (16384, 5120)]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3  # us


def bench_interleaved(fns, rounds=25):
    """Median time (us) of each function, the functions taking turns call by call, L2 flushed
    before each call as do_bench does. GEMM-bound work runs at the GPU's power limit, where the
    clock drifts over seconds: timed one after the other, two equal GEMMs differed by up to 10%
    (bench: linear fwd (8191, 4096, 12296), torch.mm, H200); taking turns puts the drift on all
    of them alike."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for fn in fns:  # warm-up (compilation, autotuning, allocator)
        fn()
        fn()
    torch.cuda.synchronize()
    starts = [[torch.cuda.Event(enable_timing=True) for _ in range(rounds)] for _ in fns]
    ends = [[torch.cuda.Event(enable_timing=True) for _ in range(rounds)] for _ in fns]
    for r in range(rounds):
        for i, fn in enumerate(fns):
            flush.zero_()
            starts[i][r].record()
            fn()
            ends[i][r].record()
    torch.cuda.synchronize()
    out = []
    for i in range(len(fns)):
        times = sorted(s.elapsed_time(e) for s, e in zip(starts[i], ends[i]))
        out.append(times[len(times) // 2] * 1e3)
    return out


def norm_rows(rows):
    dev = "cuda"
    for op in ("layer_norm", "rms_norm"):
        for (m, n) in NORM_SHAPES:
            x = (torch.randn(m, n, device=dev) * 2 + 0.3).to(torch.bfloat16).requires_grad_(True)
            w = (torch.randn(n, device=dev) * 0.5 + 1).to(torch.bfloat16).requires_grad_(True)
            b = torch.randn(n, device=dev).to(torch.bfloat16).requires_grad_(True)
            dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)

            if op == "layer_norm":
                def f(x, w, b):
                    return F.layer_norm(x, (n,), w, b, 1e-5)
                params = (x, w, b)
            else:
                def f(x, w, b):
                    return F.rms_norm(x, (n,), w, 1e-5)
                params = (x, w)
            compiled = torch.compile(f)
            shape = f"({m}, {n})"
            elems = m * n
            impls = [("torch_eager", f), ("torch_compile", compiled)]
            lf = liger_functional()
            if lf is not None and op == "layer_norm":
                impls.append(("liger", lambda x, w, b: lf.liger_layer_norm(x, w, b, 1e-5)))
            elif lf is not None:
                impls.append(("liger", lambda x, w, b: lf.liger_rms_norm(x, w, 1e-5, in_place=False)))
            for impl, fn in impls:
                with torch.no_grad():
                    t = bench(lambda: fn(x, w, b))
                rows.append(dict(op=op, direction="fwd", shape=shape, impl=impl, time_us=t,
                                 bytes=4.0 * elems, gbps=4.0 * elems / t / 1e3))
                y = fn(x, w, b)
                t = bench(lambda: torch.autograd.grad(y, params, dy, retain_graph=True))
                rows.append(dict(op=op, direction="bwd", shape=shape, impl=impl, time_us=t,
                                 bytes=6.0 * elems, gbps=6.0 * elems / t / 1e3))
                print(rows[-2], rows[-1], flush=True)
            del x, w, b, dy, y
    # PyTorch's own error in bf16 against float64, on one shape (relative L2).
    m, n = 4096, 4096
    x = (torch.randn(m, n, device=dev) * 2 + 0.3).to(torch.bfloat16)
    w = (torch.randn(n, device=dev) * 0.5 + 1).to(torch.bfloat16)
    b = torch.randn(n, device=dev).to(torch.bfloat16)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    errors = {}
    for op in ("layer_norm", "rms_norm"):
        outs = {}
        for dt in (torch.bfloat16, torch.float64):
            xx = x.to(dt).requires_grad_(True)
            ww = w.to(dt).requires_grad_(True)
            bb = b.to(dt).requires_grad_(True)
            y = F.layer_norm(xx, (n,), ww, bb, 1e-5) if op == "layer_norm" else F.rms_norm(xx, (n,), ww, 1e-5)
            gx, gw = torch.autograd.grad(y, (xx, ww), dy.to(dt))
            outs[dt] = (y, gx, gw)
        rel = lambda a, r: ((a.double() - r).norm() / r.norm()).item()
        errors[op] = {k: rel(outs[torch.bfloat16][i], outs[torch.float64][i]) for i, k in enumerate(("y", "dx", "dweight"))}
    return errors


def dropout_rows(rows):
    """y = dropout(act(x + b), 0.1), bf16, as `fusekit bench bias_act_dropout` times it (same shapes,
    same shape strings, same byte counts: x, b, y forward; dy, x, b, dx, db backward). The forward
    runs with autograd on, as in training, so PyTorch writes what its backward keeps (the mask)."""
    dev = "cuda"
    acts = {"gelu_tanh": lambda h: F.gelu(h, approximate="tanh"), "relu": F.relu}
    for (m, n) in DROPOUT_SHAPES:
        x = torch.randn(m, n, device=dev).to(torch.bfloat16).requires_grad_(True)
        b = (torch.randn(n, device=dev) * 0.5).to(torch.bfloat16).requires_grad_(True)
        dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        elems = m * n
        fwd_bytes, bwd_bytes = 4.0 * elems + 2.0 * n, 6.0 * elems + 4.0 * n
        for name, act in acts.items():
            def f(x, b, act=act):
                return F.dropout(act(x + b), 0.1, training=True)
            compiled = torch.compile(f)
            shape = f"({m}, {n}) {name}"
            for impl, fn in (("torch_eager", f), ("torch_compile", compiled)):
                t = bench(lambda: fn(x, b))
                rows.append(dict(op="bias_act_dropout", direction="fwd", shape=shape, impl=impl,
                                 time_us=t, bytes=fwd_bytes, gbps=fwd_bytes / t / 1e3))
                y = fn(x, b)
                t = bench(lambda: torch.autograd.grad(y, (x, b), dy, retain_graph=True))
                rows.append(dict(op="bias_act_dropout", direction="bwd", shape=shape, impl=impl,
                                 time_us=t, bytes=bwd_bytes, gbps=bwd_bytes / t / 1e3))
                print(rows[-2], rows[-1], flush=True)
                del y
        del x, b, dy


# ---- cross-entropy (fusekit op "cross_entropy") ------------------------------------------------
# (tokens, vocabulary): the shapes and shape strings of bench/cross_entropy.
CROSS_ENTROPY_SHAPES = [(t, v) for t in (8192, 16384) for v in (32000, 50257, 128256, 151936, 262144)]


def cross_entropy_rows(rows):
    """loss = cross_entropy(logits, targets), mean, bf16 logits, int64 targets, as `fusekit bench
    cross_entropy` counts it: fwd (the loss alone: logits read, targets read, 4 bytes a row for
    lse) and fwd+bwd (a training step's loss and dlogits: logits read once, dlogits written once).
    fusekit.torch's drop-in is timed beside PyTorch's where it is importable."""
    fk = fusekit_torch()
    for (t, v) in CROSS_ENTROPY_SHAPES:
        x = torch.randn(t, v, device="cuda", dtype=torch.bfloat16).mul_(2)
        targets = torch.randint(0, v, (t,), device="cuda")
        elems = t * v
        fwd_bytes, step_bytes = 2.0 * elems + 12.0 * t, 4.0 * elems + 12.0 * t
        shape = f"({t}, {v})"

        def f(logits):
            return F.cross_entropy(logits, targets)

        impls = [("torch_eager", f), ("torch_compile", torch.compile(f))]
        if fk is not None:
            impls.append(("fusekit_torch", lambda logits: fk.cross_entropy(logits, targets)))
        lf = liger_functional()
        if lf is not None:  # writes dlogits into the logits it is given; the time does not depend on them
            impls.append(("liger", lambda logits: lf.liger_cross_entropy(logits, targets)))
        xg = x.detach().requires_grad_(True)
        for impl, fn in impls:
            with torch.no_grad():
                tf = bench(lambda: fn(x))
            rows.append(dict(op="cross_entropy", direction="fwd", shape=shape, impl=impl, time_us=tf,
                             bytes=fwd_bytes, gbps=fwd_bytes / tf / 1e3))

            def step():
                xg.grad = None
                fn(xg).backward()
            ts = bench(step)
            rows.append(dict(op="cross_entropy", direction="fwd+bwd", shape=shape, impl=impl, time_us=ts,
                             bytes=step_bytes, gbps=step_bytes / ts / 1e3))
            print(rows[-2], rows[-1], flush=True)
        del x, xg, targets
        torch.cuda.empty_cache()
# ---- linear cross-entropy (fusekit op "linear_cross_entropy") ---------------------------------
# (tokens, vocabulary, hidden); shape strings as bench/linear_cross_entropy prints them.
LINEAR_CROSS_ENTROPY_SHAPES = [(t, v, h) for t in (8192, 16384) for v in (32000, 128256) for h in (2048, 4096)]


def peak_bytes(fn):
    """The most memory fn() allocates beyond what is allocated before it (CUDA caching allocator),
    or None when it runs out of memory."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    try:
        fn()
    except torch.OutOfMemoryError:
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def linear_cross_entropy_rows(rows):
    """A training step's loss = cross_entropy(h W^T, targets) and its backward (dh, dW), bf16 h and
    W, int64 targets, reduction mean, no bias: PyTorch's F.cross_entropy(F.linear(h, W).float(), t)
    eager and under torch.compile, Liger-Kernel's LigerFusedLinearCrossEntropyLoss, fusekit's
    fk.linear_cross_entropy, and the three plain GEMMs of the same shape (logits = h W^T,
    dh = dlogits W, dW = dlogits^T h, torch.matmul in bf16: impl torch_mm), all taking turns
    (bench_interleaved). flops: 3 x 2 T V H. Each row also records its peak memory (peak_bytes:
    the most the step allocates beyond its inputs, .grad tensors included); an implementation that
    runs out of memory is left out."""
    fk = fusekit_torch()
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss()
    except Exception as e:  # not installed, or an incompatible Triton / PyTorch
        print(f"liger-kernel's LigerFusedLinearCrossEntropyLoss not importable: {e}", flush=True)
        liger = None
    for (t, v, hd) in LINEAR_CROSS_ENTROPY_SHAPES:
        h = torch.randn(t, hd, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
        w = (torch.randn(v, hd, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_(True)
        targets = torch.randint(0, v, (t,), device="cuda")
        flops = 3 * 2.0 * t * v * hd
        shape = f"({t}, {v}, {hd})"

        def f(h, w):
            return F.cross_entropy(F.linear(h, w).float(), targets)

        impls = [("torch_eager", f), ("torch_compile", torch.compile(f))]
        if liger is not None:
            impls.append(("liger", lambda h, w: liger(w, h, targets)))
        if fk is not None:
            impls.append(("fusekit_torch", lambda h, w: fk.linear_cross_entropy(h, w, targets)))

        def step(fn):
            h.grad = w.grad = None
            fn(h, w).backward()

        def plain():
            logits = torch.matmul(h.detach(), w.detach().t())
            return torch.matmul(logits, w.detach()), torch.matmul(logits.t(), h.detach())

        timed, peaks = [], []
        for impl, fn in impls + [("torch_mm", None)]:
            call = plain if fn is None else (lambda fn=fn: step(fn))
            # Measured on a second call: a first call's compilation and autotuning allocate
            # memory of their own.
            first = peak_bytes(call)
            peak = peak_bytes(call) if first is not None else None
            h.grad = w.grad = None
            if peak is None:
                print(f"linear_cross_entropy {shape} {impl}: out of memory", flush=True)
                torch.cuda.empty_cache()
                continue
            timed.append((impl, call))
            peaks.append(peak)
        times = bench_interleaved([fn for _, fn in timed], rounds=10)
        for (impl, _), tu, peak in zip(timed, times, peaks):
            rows.append(dict(op="linear_cross_entropy", direction="fwd+bwd", shape=shape, impl=impl,
                             time_us=tu, flops=flops, tflops=flops / tu / 1e6, peak_bytes=peak))
        print(*rows[-len(timed):], sep="\n", flush=True)
        del h, w, targets, impls, timed
        torch._dynamo.reset()  # one compiled graph per shape; do not pile them up
        torch.cuda.empty_cache()
    # PyTorch's own error in bf16 against float64 (relative L2), one moderate shape.
    t, v, hd = 2048, 32000, 1024
    h = torch.randn(t, hd, device="cuda").to(torch.bfloat16)
    w = (torch.randn(v, hd, device="cuda") * 0.02).to(torch.bfloat16)
    targets = torch.randint(0, v, (t,), device="cuda")
    outs = {}
    for dt in (torch.bfloat16, torch.float64):
        hh, ww = h.to(dt).requires_grad_(True), w.to(dt).requires_grad_(True)
        logits = F.linear(hh, ww)
        loss = F.cross_entropy(logits if dt == torch.float64 else logits.float(), targets)
        outs[dt] = (loss,) + torch.autograd.grad(loss, (hh, ww))
    rel = lambda a, r: ((a.double() - r).norm() / r.norm()).item()
    return {"linear_cross_entropy": {key: rel(outs[torch.bfloat16][i], outs[torch.float64][i])
                                     for i, key in enumerate(("loss", "dh", "dW"))}}

# ---- gated activations (fusekit op "gated_act") ----------------------------------------------------
# (M, F), the same shapes and shape strings as bench/gated_act.
GATED_SHAPES = [(16384, 5632), (16384, 8192), (16384, 11008), (16384, 14336), (2048, 5632), (4096, 2816),
                (16384, 1024)]


def gated_act_rows(rows):
    """act(gate) * up, bf16, as `fusekit bench gated_act` times it (same shapes, shape strings and
    byte counts: gate, up, y forward; dy, gate, up, dgate, dup backward): gate and up from one
    (M, 2F) tensor (halves by chunk, interleaved by strided slices) or two tensors."""
    dev = "cuda"
    acts = {"silu": F.silu, "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"), "gelu_erf": F.gelu}
    cases = [("silu", "halves"), ("silu", "interleaved"), ("silu", "separate"), ("gelu_tanh", "halves"),
             ("gelu_erf", "halves")]
    for (m, f) in GATED_SHAPES:
        gate_up = torch.randn(m, 2 * f, device=dev).to(torch.bfloat16).requires_grad_(True)
        gate = torch.randn(m, f, device=dev).to(torch.bfloat16).requires_grad_(True)
        up = torch.randn(m, f, device=dev).to(torch.bfloat16).requires_grad_(True)
        dy = torch.randn(m, f, device=dev, dtype=torch.bfloat16)
        elems = m * f
        fwd_bytes, bwd_bytes = 6.0 * elems, 10.0 * elems
        for name, form in cases:
            act = acts[name]
            if form == "separate":
                def f_(g, u, act=act):
                    return act(g) * u
                inputs = (gate, up)
            else:
                def f_(t, act=act, form=form):
                    g, u = t.chunk(2, dim=-1) if form == "halves" else (t[:, 0::2], t[:, 1::2])
                    return act(g) * u
                inputs = (gate_up,)
            compiled = torch.compile(f_)
            shape = f"({m}, {f}) {name} {form}"
            impls = [("torch_eager", f_), ("torch_compile", compiled)]
            lf = liger_functional()
            # Liger's SwiGLU and GeGLU (tanh) take gate and up as two contiguous tensors.
            liger_op = {"silu": "liger_swiglu", "gelu_tanh": "liger_geglu"}.get(name)
            if lf is not None and liger_op is not None and form == "separate":
                impls.append(("liger", getattr(lf, liger_op)))
            for impl, fn in impls:
                t = bench(lambda: fn(*inputs))
                rows.append(dict(op="gated_act", direction="fwd", shape=shape, impl=impl,
                                 time_us=t, bytes=fwd_bytes, gbps=fwd_bytes / t / 1e3))
                y = fn(*inputs)
                t = bench(lambda: torch.autograd.grad(y, inputs, dy, retain_graph=True))
                rows.append(dict(op="gated_act", direction="bwd", shape=shape, impl=impl,
                                 time_us=t, bytes=bwd_bytes, gbps=bwd_bytes / t / 1e3))
                print(rows[-2], rows[-1], flush=True)
                del y
        del gate_up, gate, up, dy


# ---- linear + bias + activation (fusekit op "linear") -------------------------------------------
# (M, K, N): x (M, K), W (N, K), y (M, N); the same shapes and shape strings as bench/linear.
LINEAR_SHAPES = [(8192, 4096, 16384), (16384, 8192, 8192), (8192, 16384, 4096), (8191, 4096, 12296)]
LINEAR_ACTIVATIONS = {
    "none": lambda z: z,
    "relu": F.relu,
    "gelu_erf": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "squared_relu": lambda z: torch.square(F.relu(z)),
    "silu": F.silu,
}


def liger_functional():
    """Liger-Kernel's functional ops (liger_kernel.transformers.functional, pure Python on Triton)
    when the package is importable (device_run.sh installs the carried wheel), else None: its
    norms, SwiGLU / GeGLU, RoPE, cross-entropy and fused linear cross-entropy are timed beside
    PyTorch's (impl "liger")."""
    try:
        import liger_kernel.transformers.functional as lf
    except Exception as e:  # not installed, or an incompatible Triton / PyTorch
        print(f"liger-kernel not importable: {e}", flush=True)
        return None
    return lf


def fusekit_torch():
    """fusekit's PyTorch binding when the package is importable (device_run.sh's python stage
    builds it): linear is then timed here too, taking turns with PyTorch's implementations
    (bench_interleaved), so that the power-limited clock treats them alike."""
    try:
        import fusekit.torch as fk
        return fk
    except ImportError:
        return None


def linear_rows(rows):
    dev = "cuda"
    fk = fusekit_torch()
    for (m, k, n) in LINEAR_SHAPES:
        x = torch.randn(m, k, device=dev).to(torch.bfloat16).requires_grad_(True)
        w = (torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16).requires_grad_(True)
        b = (torch.randn(n, device=dev) * 0.5).to(torch.bfloat16).requires_grad_(True)
        dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        flops = 2.0 * m * n * k
        for name, act in LINEAR_ACTIVATIONS.items():
            def f(x, w, b, act=act):
                return act(F.linear(x, w, b))
            compiled = torch.compile(f)
            shape = f"({m}, {k}, {n}) {name}"
            impls = [("torch_eager", f), ("torch_compile", compiled)]
            if fk is not None:
                impls.append(("fusekit_torch", lambda x, w, b, name=name: fk.linear(x, w, b, activation=name)))
            # Forward: every implementation and the plain GEMM (torch.mm) taking turns.
            fwd = [lambda fn=fn: fn(x, w, b) for _, fn in impls]
            fwd.append(lambda: torch.mm(x, w.t()))
            with torch.no_grad():
                times = bench_interleaved(fwd)
            for (impl, _), t in zip(impls + [("torch_mm", None)], times):
                rows.append(dict(op="linear", direction="fwd", shape=shape, impl=impl, time_us=t,
                                 flops=flops, tflops=flops / t / 1e6))
            # Backward: the same, against the two plain GEMMs dx = dy W and dW = dy^T x.
            ys = [fn(x, w, b) for _, fn in impls]
            bwd = [lambda y=y: torch.autograd.grad(y, (x, w, b), dy, retain_graph=True) for y in ys]
            bwd.append(lambda: (torch.mm(dy, w), torch.mm(dy.t(), x)))
            times = bench_interleaved(bwd)
            for (impl, _), t in zip(impls + [("torch_mm", None)], times):
                rows.append(dict(op="linear", direction="bwd", shape=shape, impl=impl, time_us=t,
                                 flops=2 * flops, tflops=2 * flops / t / 1e6))
            print(*rows[-2 * len(fwd):], sep="\n", flush=True)
            del ys
            torch._dynamo.reset()  # one compiled graph per activation; do not pile them up
        del x, w, b, dy
    # PyTorch's own error in bf16 against float64 (relative L2), one moderate shape.
    m, k, n = 2048, 1024, 4096
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    w = (torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16)
    b = (torch.randn(n, device=dev) * 0.5).to(torch.bfloat16)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    errors = {}
    rel = lambda a, r: ((a.double() - r).norm() / r.norm()).item()
    for name, act in LINEAR_ACTIVATIONS.items():
        outs = {}
        for dt in (torch.bfloat16, torch.float64):
            xx, ww, bb = (t.to(dt).requires_grad_(True) for t in (x, w, b))
            y = act(F.linear(xx, ww, bb))
            outs[dt] = (y,) + torch.autograd.grad(y, (xx, ww, bb), dy.to(dt))
        errors[f"linear {name}"] = {key: rel(outs[torch.bfloat16][i], outs[torch.float64][i])
                                    for i, key in enumerate(("y", "dx", "dW", "dbias"))}
    return errors


# ---- gated linear (fusekit op "gated_linear") ---------------------------------------------------
# (M, K, F): x (M, K), gate and up weights (F, K) each; shape strings as bench/linear prints them.
GATED_LINEAR_SHAPES = [(8192, 4096, 14336), (8192, 2048, 8192), (8191, 3584, 18944)]


def gated_linear_rows(rows):
    """A gated MLP's gate and up projections and SwiGLU, y = silu(x Wg^T) * (x Wu^T), and its
    backward (dx, dWg, dWu), bf16, no bias: PyTorch eager and compiled on one fused (2F, K) weight
    split by chunk, Liger-Kernel's SwiGLU (liger_swiglu) after two F.linear calls as its
    LigerSwiGLUMLP does, fusekit's fk.gated_linear on the interleaved weight, and the plain GEMMs
    of the same total shape (torch_mm: x W^T forward; dpre W and dpre^T x backward), all taking
    turns. Each row records its peak memory over the step (peak_bytes)."""
    fk = fusekit_torch()
    lf = liger_functional()
    dev = "cuda"
    for (m, k, f) in GATED_LINEAR_SHAPES:
        x = torch.randn(m, k, device=dev).to(torch.bfloat16).requires_grad_(True)
        w = (torch.randn(2 * f, k, device=dev) / k ** 0.5).to(torch.bfloat16).requires_grad_(True)
        wg, wu = (t.detach().clone().requires_grad_(True) for t in w.chunk(2, dim=0))
        w_interleaved = torch.stack((wg.detach(), wu.detach()), dim=1).reshape(2 * f, k).requires_grad_(True)
        dy = torch.randn(m, f, device=dev, dtype=torch.bfloat16)
        dpre = torch.randn(m, 2 * f, device=dev, dtype=torch.bfloat16)
        flops = 2.0 * m * 2 * f * k
        shape = f"({m}, {k}, {f}) silu"

        def eager(x, w):
            g, u = F.linear(x, w).chunk(2, dim=-1)
            return F.silu(g) * u

        impls = [("torch_eager", lambda: eager(x, w), (x, w)), ("torch_compile", None, (x, w))]
        compiled = torch.compile(eager)
        impls[1] = ("torch_compile", lambda: compiled(x, w), (x, w))
        if lf is not None:
            impls.append(("liger", lambda: lf.liger_swiglu(F.linear(x, wg), F.linear(x, wu)), (x, wg, wu)))
        if fk is not None and hasattr(fk, "gated_linear"):
            impls.append(("fusekit_torch", lambda: fk.gated_linear(x, w_interleaved, activation="silu",
                                                                  layout="interleaved"), (x, w_interleaved)))
        fwd = [fn for _, fn, _ in impls] + [lambda: torch.mm(x, w.t())]
        with torch.no_grad():
            times = bench_interleaved(fwd)
        for (impl, _, _), t in zip(impls + [("torch_mm", None, None)], times):
            rows.append(dict(op="gated_linear", direction="fwd", shape=shape, impl=impl, time_us=t,
                             flops=flops, tflops=flops / t / 1e6))
        ys = [(fn(), params) for _, fn, params in impls]
        bwd = [lambda y=y, params=params: torch.autograd.grad(y, params, dy, retain_graph=True) for y, params in ys]
        bwd.append(lambda: (torch.mm(dpre, w), torch.mm(dpre.t(), x)))
        times = bench_interleaved(bwd)
        for (impl, _, _), t in zip(impls + [("torch_mm", None, None)], times):
            rows.append(dict(op="gated_linear", direction="bwd", shape=shape, impl=impl, time_us=t,
                             flops=2 * flops, tflops=2 * flops / t / 1e6))
        del ys
        # Peak memory of a whole step (forward, backward, gradients) per implementation.
        for impl, fn, params in impls:
            def step(fn=fn, params=params):
                torch.autograd.grad(fn(), params, dy)
            peak_bytes(step)
            peak = peak_bytes(step)
            for r in rows[-2 * (len(impls) + 1):]:
                if r["impl"] == impl:
                    r["peak_bytes"] = peak
        print(*rows[-2 * (len(impls) + 1):], sep="\n", flush=True)
        del x, w, wg, wu, w_interleaved, dy, dpre, impls
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    # PyTorch's own error in bf16 against float64 (relative L2), one moderate shape.
    m, k, f = 2048, 1024, 2048
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    w = (torch.randn(2 * f, k, device=dev) / k ** 0.5).to(torch.bfloat16)
    dy = torch.randn(m, f, device=dev, dtype=torch.bfloat16)
    outs = {}
    for dt in (torch.bfloat16, torch.float64):
        xx, ww = x.to(dt).requires_grad_(True), w.to(dt).requires_grad_(True)
        g, u = F.linear(xx, ww).chunk(2, dim=-1)
        y = F.silu(g) * u
        outs[dt] = (y,) + torch.autograd.grad(y, (xx, ww), dy.to(dt))
    rel = lambda a, r: ((a.double() - r).norm() / r.norm()).item()
    return {"gated_linear silu": {key: rel(outs[torch.bfloat16][i], outs[torch.float64][i])
                                  for i, key in enumerate(("y", "dx", "dW"))}}


# ---- FP8 RMSNorm (fusekit op "fp8_rms_norm") ---------------------------------------------------
# The same shapes and shape strings as bench/fp8_norm; e4m3 in and out, groups of 16 with bf16
# scales, bf16 weight. Byte counts as fusekit counts them (4.25 / 5.125 bytes per element), so
# GB/s compares times directly.
FP8_NORM_SHAPES = [(16384, 4096), (8192, 8192), (32768, 2048)]
FP8_GROUP = 16
FP8_AMAX_FLOOR = 2.0 ** -100  # fusekit's kFp8NormAmaxFloor


def fp8_norm_rows(rows):
    """The best PyTorch expression of fusekit's fp8_rms_norm: dequantize (fp8 values times their
    group scales, broadcast over each group of 16 -- the same as multiplying by
    scale.repeat_interleave(16, dim=1) without materializing it), RMSNorm with a bf16
    intermediate as the reference FP8 training code does, the global amax, the scale, the cast to
    float8_e4m3fn and qy.t().contiguous(). Backward: rms_norm's backward from the dequantized bf16
    x that autograd saved. Eager and torch.compile."""
    dev = "cuda"
    e4m3 = torch.float8_e4m3fn
    fmax = torch.finfo(e4m3).max
    eps = 1e-5

    def dequant(xq, sx):
        m, n = xq.shape
        return (xq.float().view(m, n // FP8_GROUP, FP8_GROUP) * sx.float().unsqueeze(-1)).view(m, n)

    def fwd(xq, sx, w):
        y = F.rms_norm(dequant(xq, sx).to(torch.bfloat16), (xq.shape[-1],), w, eps)
        s = torch.clamp(y.abs().amax().float(), min=FP8_AMAX_FLOOR) / fmax
        qy = (y.float() / s).clamp(-fmax, fmax).to(e4m3)
        return qy, qy.t().contiguous(), s

    def norm(x, w):
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    def inputs(m, n):
        xq = (torch.randn(m, n, device=dev) * 150).clamp(-fmax, fmax).to(e4m3)
        sx = (torch.randn(m, n // FP8_GROUP, device=dev).abs() * 0.01 + 0.001).to(torch.bfloat16)
        w = (torch.randn(n, device=dev) * 0.5 + 1).to(torch.bfloat16)
        dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        return xq, sx, w, dy

    compiled_fwd, compiled_norm = torch.compile(fwd), torch.compile(norm)
    for (m, n) in FP8_NORM_SHAPES:
        xq, sx, w, dy = inputs(m, n)
        elems = m * n
        fwd_bytes, bwd_bytes = 4.25 * elems, 5.125 * elems
        shape = f"({m}, {n})"
        for impl, f, g in (("torch_eager", fwd, norm), ("torch_compile", compiled_fwd, compiled_norm)):
            with torch.no_grad():
                t = bench(lambda: f(xq, sx, w))
            rows.append(dict(op="fp8_rms_norm", direction="fwd", shape=shape, impl=impl, time_us=t,
                             bytes=fwd_bytes, gbps=fwd_bytes / t / 1e3))
            x = dequant(xq, sx).to(torch.bfloat16).requires_grad_(True)
            wg = w.clone().requires_grad_(True)
            y = g(x, wg)
            t = bench(lambda: torch.autograd.grad(y, (x, wg), dy, retain_graph=True))
            rows.append(dict(op="fp8_rms_norm", direction="bwd", shape=shape, impl=impl, time_us=t,
                             bytes=bwd_bytes, gbps=bwd_bytes / t / 1e3))
            print(rows[-2], rows[-1], flush=True)
            del x, wg, y
        del xq, sx, w, dy

    # PyTorch's own errors against float64 on one shape (relative L2): the dequantized output of
    # the bf16 expression against the float64 RMSNorm, and the bf16 backward's dx and dweight.
    xq, sx, w, dy = inputs(4096, 4096)
    xd = dequant(xq, sx).double()
    y64 = F.rms_norm(xd, (4096,), w.double(), eps)
    with torch.no_grad():
        qy, _, s = fwd(xq, sx, w)
    rel = lambda a, r: ((a.double() - r).norm() / r.norm()).item()
    grads = {}
    for dt in (torch.bfloat16, torch.float64):
        xx = xd.to(dt).requires_grad_(True)
        ww = w.to(dt).requires_grad_(True)
        grads[dt] = torch.autograd.grad(F.rms_norm(xx, (4096,), ww, eps), (xx, ww), dy.to(dt))
    return {"fp8_rms_norm": {"qy*s": rel(qy.double() * s.double(), y64),
                             "dx": rel(grads[torch.bfloat16][0], grads[torch.float64][0]),
                             "dweight": rel(grads[torch.bfloat16][1], grads[torch.float64][1])}}


# ---- attention (fusekit op "attention") --------------------------------------------------------
# The grid: model width 2048 (head dim 64 or 128), 16384 tokens per batch, sequence
# lengths 1024, 4096 and 16384, causal and not; PyTorch's scaled_dot_product_attention with each
# backend forced in turn. Shape strings as bench/attention prints them.
ATTENTION_SEQLENS = (1024, 4096, 16384)
ATTENTION_HEAD_DIMS = (64, 128)


def attention_shape(b, s, h, d, causal):
    return f"(B={b}, S={s}, H={h}, D={d})" + (" causal" if causal else "")


def attention_rows(rows):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}
    for d in ATTENTION_HEAD_DIMS:
        h = 2048 // d
        for s in ATTENTION_SEQLENS:
            b = 16384 // s
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
                       for _ in range(3))
            dout = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
            for causal in (False, True):
                flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
                shape = attention_shape(b, s, h, d, causal)
                for impl, backend in backends.items():
                    try:
                        with sdpa_kernel(backend):
                            with torch.no_grad():
                                t = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                            rows.append(dict(op="attention", direction="fwd", shape=shape, impl=impl,
                                             time_us=t, flops=flops, tflops=flops / t / 1e6))
                            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                            t = bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
                            rows.append(dict(op="attention", direction="bwd", shape=shape, impl=impl,
                                             time_us=t, flops=2.5 * flops, tflops=2.5 * flops / t / 1e6))
                            del out
                        print(rows[-2], rows[-1], flush=True)
                    except RuntimeError as e:  # a backend that refuses the shape
                        print(f"attention {shape} {impl}: {str(e).splitlines()[0]}", flush=True)
            del q, k, v, dout
    # The bias-gradient case: B=8, H=16, S=2048, D=128 with a (B, H, S, S) bias that
    # requires grad (only the efficient backend computes its gradient).
    b, h, s, d = 8, 16, 2048, 128
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16).requires_grad_(True) for _ in range(3))
    bias = torch.randn(b, h, s, s, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    dout = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    flops = 4.0 * b * h * s * s * d
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        t = bench(lambda: torch.autograd.grad(out, (q, k, v, bias), dout, retain_graph=True))
    rows.append(dict(op="attention", direction="bwd", shape=f"(B={b}, S={s}, H={h}, D={d}) bias+dbias",
                     impl="efficient", time_us=t, flops=2.5 * flops, tflops=2.5 * flops / t / 1e6))
    print(rows[-1], flush=True)
    del q, k, v, bias, dout, out
    # Dropout 0.1 on the probabilities (training mode): flash and efficient both support it.
    b, h, s, d = 4, 16, 4096, 128
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16).requires_grad_(True) for _ in range(3))
    dout = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    flops = 4.0 * b * h * s * s * d
    for impl in ("flash", "efficient"):
        with sdpa_kernel(backends[impl]):
            with torch.no_grad():
                t = bench(lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1))
            shape = f"(B={b}, S={s}, H={h}, D={d}) dropout=0.1"
            rows.append(dict(op="attention", direction="fwd", shape=shape, impl=impl,
                             time_us=t, flops=flops, tflops=flops / t / 1e6))
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
            t = bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
            rows.append(dict(op="attention", direction="bwd", shape=shape, impl=impl,
                             time_us=t, flops=2.5 * flops, tflops=2.5 * flops / t / 1e6))
            del out
        print(rows[-2], rows[-1], flush=True)
    return {}


# ---- rotary embeddings (fusekit op "rope") -------------------------------------------------------
# bench/rope's shapes and shape strings: bf16 q (B, S, Hq, D) and k (B, S, Hk, D), B * S = 16384,
# Hq = 32, Hk = 8; cos / sin precomputed per token in bf16 as Hugging Face's rotary embedding
# returns them (outside the timed call: a model computes them once for all its layers). Bytes: q
# and k read, q_out and k_out written.
ROPE_CASES = [(128, 128, "rotate_half"), (64, 64, "rotate_half"), (128, 32, "rotate_half"),
              (128, 128, "interleaved")]


def rope_shape(d, r, style):
    name = f"(B=4, S=4096, Hq=32, Hk=8, D={d})"
    if r != d:
        name += f" r={r}"
    if style == "interleaved":
        name += " interleaved"
    return name


def rope_expression(x, cos, sin, r, style):
    """Hugging Face's expressions: q * cos + rotate_half(q) * sin on the first r dims (GPT-NeoX's
    partial rotary), or GPT-J's rotate_every_two with interleaved cos / sin."""
    rot, rest = x[..., :r], x[..., r:]
    if style == "rotate_half":
        x1, x2 = rot[..., : r // 2], rot[..., r // 2:]
        rot = rot * cos + torch.cat((-x2, x1), -1) * sin
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rot = rot * cos + torch.stack((-x2, x1), -1).flatten(-2) * sin
    return torch.cat((rot, rest), -1) if rest.shape[-1] else rot


def rope_rows(rows):
    dev = "cuda"
    b, s, hq, hk = 4, 4096, 32, 8
    positions = torch.arange(s, device=dev).float()
    for d, r, style in ROPE_CASES:
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, r, 2, device=dev).float() / r))
        freqs = positions[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), -1) if style == "rotate_half" else freqs.repeat_interleave(2, -1)
        cos = emb.cos().to(torch.bfloat16)[None, :, None, :].expand(b, s, 1, r)
        sin = emb.sin().to(torch.bfloat16)[None, :, None, :].expand(b, s, 1, r)
        q = torch.randn(b, s, hq, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, s, hk, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dq, dk = torch.randn_like(q), torch.randn_like(k)
        moved = 2.0 * (q.numel() + k.numel()) * 2

        def f(q, k, r=r, style=style):
            return rope_expression(q, cos, sin, r, style), rope_expression(k, cos, sin, r, style)
        compiled = torch.compile(f)
        shape = rope_shape(d, r, style)
        impls = [("torch_eager", f), ("torch_compile", compiled)]
        lf = liger_functional()
        if lf is not None and style == "rotate_half" and r == d:
            # Liger takes (B, H, S, D) views and (1, S, D) tables: the same memory as here.
            cos3, sin3 = cos[:, :, 0, :], sin[:, :, 0, :]

            def liger_rope(q, k):
                qo, ko = lf.liger_rope(q.transpose(1, 2), k.transpose(1, 2), cos3, sin3)
                return qo.transpose(1, 2), ko.transpose(1, 2)
            impls.append(("liger", liger_rope))
        for impl, fn in impls:
            t = bench(lambda: fn(q, k))
            rows.append(dict(op="rope", direction="fwd", shape=shape, impl=impl, time_us=t, bytes=moved,
                             gbps=moved / t / 1e3))
            qo, ko = fn(q, k)
            t = bench(lambda: torch.autograd.grad((qo, ko), (q, k), (dq, dk), retain_graph=True))
            rows.append(dict(op="rope", direction="bwd", shape=shape, impl=impl, time_us=t, bytes=moved,
                             gbps=moved / t / 1e3))
            print(rows[-2], rows[-1], flush=True)
            del qo, ko
        del q, k, dq, dk
    # PyTorch's own error in bf16 against float64 (the same bf16 cos / sin), on one shape.
    d = r = 128
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, r, 2, device=dev).float() / r))
    emb = torch.arange(1024, device=dev).float()[:, None] * inv_freq
    emb = torch.cat((emb, emb), -1)
    cos, sin = emb.cos().to(torch.bfloat16)[None, :, None, :], emb.sin().to(torch.bfloat16)[None, :, None, :]
    q = torch.randn(4, 1024, 32, d, device=dev, dtype=torch.bfloat16)
    got = rope_expression(q, cos, sin, r, "rotate_half")
    ref = rope_expression(q.double(), cos.double(), sin.double(), r, "rotate_half")
    return {"rope": {"q_out": ((got.double() - ref).norm() / ref.norm()).item()}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("ops", nargs="*", default=["norm"])
    args = ap.parse_args()
    torch.manual_seed(0)
    # Ceilings measured by PyTorch in the same process, for the record.
    a = torch.empty(1 << 29, dtype=torch.int16, device="cuda")
    bb = torch.empty_like(a)
    copy_us = bench(lambda: bb.copy_(a))
    rows, errors = [], {}
    if "norm" in args.ops:
        errors.update(norm_rows(rows))
    if "linear" in args.ops:
        errors.update(linear_rows(rows))
    if "dropout" in args.ops or "bias_act_dropout" in args.ops:
        dropout_rows(rows)
    if "gated_act" in args.ops:
        gated_act_rows(rows)
    if "gated_linear" in args.ops:
        errors.update(gated_linear_rows(rows))
    if "fp8_norm" in args.ops or "fp8_rms_norm" in args.ops:
        errors.update(fp8_norm_rows(rows))
    if "attention" in args.ops:
        errors.update(attention_rows(rows))
    if "cross_entropy" in args.ops:
        cross_entropy_rows(rows)
    if "linear_cross_entropy" in args.ops:
        errors.update(linear_cross_entropy_rows(rows))
    if "rope" in args.ops:
        errors.update(rope_rows(rows))
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   copy_gbps=2 * a.numel() * 2 / copy_us / 1e3, rows=rows, torch_errors=errors),
              open(args.out, "w"), indent=1)
    print("torch errors vs float64:", errors)


if __name__ == "__main__":
    main()
