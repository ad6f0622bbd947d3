#!/usr/bin/env python3
"""Host time of a call through fusekit.torch against the direct C++ call (fusekit._C), per op, on
tiny tensors (where the host, not the GPU, sets the pace). The budget: a call through
fusekit.torch costs at most 10 us of host time more than the direct C++ call.

For every op three extras are measured against the _C call of the same direction, whose outputs,
statistics and workspace are preallocated once (the C++ API as a C++ caller uses it):
  fwd             fusekit.torch's functional form under torch.no_grad() (eager path)
  fwd+grad        the same call recording the autograd graph (inputs require grad)
  bwd node        the body of fusekit's autograd node, run directly (grad_fn.apply(dy)):
                  gradient allocations, workspace and the C++ call. The autograd engine's own
                  round trip is PyTorch's cost for any op and is printed for scale.
Times are medians of --repeats runs (no synchronization inside a run; each run is short enough
that the GPU keeps up with the host, so host time is what is measured). PyTorch's eager
expression of the same op is printed for scale. Exit status 1 when an extra exceeds the budget.

    python3 python/benchmarks/overhead.py [--device cuda] [--ops norm,dropout] [--json out.json]
"""
import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import fusekit
import fusekit.torch as fk

BUDGET_US = 10.0
_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
_FK_DTYPES = {torch.float32: fusekit.DType.f32, torch.float16: fusekit.DType.f16,
              torch.bfloat16: fusekit.DType.bf16}


def host_us(fn, sync, repeats, target_s, max_calls):
    """Median host microseconds per call over `repeats` runs of n calls each, n chosen from the
    warm-up so that a run lasts about target_s (at most max_calls, at least 20)."""
    warm = 50
    start = time.perf_counter()
    for _ in range(warm):  # lazy initialization, allocator caches, first-call paths
        fn()
    sync()
    per_call = (time.perf_counter() - start) / warm
    n = max(20, min(max_calls, int(target_s / max(per_call, 1e-9))))
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - start) / n * 1e6)
        sync()
    return statistics.median(runs)


def workspace(nbytes, dev):
    return torch.empty(nbytes, dtype=torch.uint8, device=dev) if nbytes else None


def device_name(dev):
    return f"cuda:{dev.index or 0}" if dev.type == "cuda" else "cpu"


class Case:
    """One op: the direct C++ calls (preallocated), fusekit.torch's call and PyTorch's."""

    def __init__(self, name, c_fwd, c_bwd, fk_call, torch_call, inputs, grad_inputs):
        self.name, self.c_fwd, self.c_bwd = name, c_fwd, c_bwd
        self.fk_call, self.torch_call = fk_call, torch_call
        self.inputs, self.grad_inputs = inputs, grad_inputs


def norm_cases(dev, dtype, rows, cols):
    x = torch.randn(rows, cols, device=dev, dtype=dtype)
    w, b = torch.randn(cols, device=dev, dtype=dtype), torch.randn(cols, device=dev, dtype=dtype)
    dy = torch.randn_like(x)
    y, dx, dw, db = torch.empty_like(x), torch.empty_like(x), torch.empty_like(w), torch.empty_like(b)
    mean, rstd = torch.empty(rows, device=dev), torch.empty(rows, device=dev)
    ws = workspace(fusekit.norm_backward_workspace_size(rows, cols, _FK_DTYPES[dtype], device_name(dev)), dev)
    fusekit.layer_norm_forward(x, w, b, 1e-5, y, mean, rstd)
    grads = [t.clone().requires_grad_(True) for t in (x, w, b)]
    return [
        Case("layer_norm", lambda: fusekit.layer_norm_forward(x, w, b, 1e-5, y, mean, rstd),
             lambda: fusekit.layer_norm_backward(dy, x, w, mean, rstd, dx, dw, db, ws),
             lambda x, w, b: fk.layer_norm(x, (cols,), w, b),
             lambda x, w, b: F.layer_norm(x, (cols,), w, b), (x, w, b), grads + [dy]),
        Case("rms_norm", lambda: fusekit.rms_norm_forward(x, w, 1e-5, y, rstd),
             lambda: fusekit.rms_norm_backward(dy, x, w, rstd, dx, dw, ws),
             lambda x, w: fk.rms_norm(x, (cols,), w, 1e-5),
             lambda x, w: F.rms_norm(x, (cols,), w, 1e-5), (x, w), grads[:2] + [dy]),
    ]


def dropout_cases(dev, dtype, rows, cols):
    x = torch.randn(rows, cols, device=dev, dtype=dtype)
    b = torch.randn(cols, device=dev, dtype=dtype)
    dy = torch.randn_like(x)
    y, dx, db = torch.empty_like(x), torch.empty_like(x), torch.empty_like(b)
    ws = workspace(fusekit.bias_act_dropout_backward_workspace_size(
        rows, cols, _FK_DTYPES[dtype], device_name(dev)), dev)
    p, seed = 0.1, 1234
    grads = [t.clone().requires_grad_(True) for t in (x, b)]
    return [Case(
        "bias_act_dropout",
        lambda: fusekit.bias_act_dropout_forward(x, b, "gelu_tanh", p, seed, 0, y),
        lambda: fusekit.bias_act_dropout_backward(dy, x, b, "gelu_tanh", p, seed, 0, dx, db, ws),
        lambda x, b: fk.bias_act_dropout(x, b, "gelu_tanh", p, seed=seed),
        lambda x, b: F.dropout(F.gelu(x + b, approximate="tanh"), p), (x, b), grads + [dy])]


def gated_act_cases(dev, dtype, rows, cols):
    gate_up = torch.randn(rows, 2 * cols, device=dev, dtype=dtype)
    gate, up = torch.randn(rows, cols, device=dev, dtype=dtype), torch.randn(rows, cols, device=dev, dtype=dtype)
    dy = torch.randn(rows, cols, device=dev, dtype=dtype)
    y, dgate_up = torch.empty_like(dy), torch.empty_like(gate_up)
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    return [
        Case("gated_act", lambda: fusekit.gated_act_forward(gate_up, "silu", y),
             lambda: fusekit.gated_act_backward(dy, gate_up, "silu", dgate_up),
             lambda t: fk.gated_act(t, "silu"),
             lambda t: F.silu(t[:, :cols]) * t[:, cols:], (gate_up,),
             [gate_up.clone().requires_grad_(True), dy]),
        Case("gated_act_separate", lambda: fusekit.gated_act_forward_separate(gate, up, "silu", y),
             lambda: fusekit.gated_act_backward_separate(dy, gate, up, "silu", dgate, dup),
             lambda g, u: fk.gated_act_separate(g, u, "silu"),
             lambda g, u: F.silu(g) * u, (gate, up),
             [gate.clone().requires_grad_(True), up.clone().requires_grad_(True), dy]),
    ]


def cross_entropy_cases(dev, dtype, rows, classes):
    x = torch.randn(rows, classes, device=dev, dtype=dtype)
    t = torch.randint(0, classes, (rows,), device=dev)
    loss, lse, dloss = torch.empty((), device=dev), torch.empty(rows, device=dev), torch.ones((), device=dev)
    dx = torch.empty_like(x)
    ws = workspace(fusekit.cross_entropy_workspace_size(rows, classes, "mean", device_name(dev)), dev)
    fusekit.cross_entropy_forward(x, t, "mean", loss, lse, ws)
    grads = [x.clone().requires_grad_(True)]
    return [Case(
        "cross_entropy",
        lambda: fusekit.cross_entropy_forward_backward(x, t, "mean", loss, dx, None, ws),
        lambda: fusekit.cross_entropy_backward(dloss, x, t, lse, "mean", dx, ws),
        lambda x: fk.cross_entropy(x, t),
        lambda x: F.cross_entropy(x, t), (x,), grads + [dloss])]


def linear_cross_entropy_cases(dev, dtype, rows, vocab, hidden):
    """The _C call: the loss with dh and dW (float32) in one call, preallocated. fusekit.torch's
    backward node only scales those by the incoming gradient: its _C-side counterpart is the same
    two scalings issued directly (dh * g; dW * g rounded into the weight's dtype)."""
    h = torch.randn(rows, hidden, device=dev, dtype=dtype)
    w = torch.randn(vocab, hidden, device=dev, dtype=dtype) / math.sqrt(hidden)
    t = torch.randint(0, vocab, (rows,), device=dev)
    loss, dloss = torch.empty((), device=dev), torch.ones((), device=dev)
    dh, dw32, dw = torch.empty_like(h), torch.empty(vocab, hidden, device=dev), torch.empty_like(w)
    ws = workspace(fusekit.linear_cross_entropy_workspace_size(rows, vocab, hidden, _FK_DTYPES[dtype],
                                                               fusekit.DType.f32, False, "mean",
                                                               device_name(dev)), dev)
    grads = [x.clone().requires_grad_(True) for x in (h, w)]
    return [Case(
        "linear_cross_entropy",
        lambda: fusekit.linear_cross_entropy(h, w, None, t, "mean", loss, dh, dw32, None, ws),
        lambda: (torch.mul(dh, dloss), torch.mul(dw32, dloss, out=dw)),
        lambda h, w: fk.linear_cross_entropy(h, w, t),
        lambda h, w: F.cross_entropy(F.linear(h, w).float(), t), (h, w), grads + [dloss])]


def linear_cases(dev, dtype, rows, k, n):
    x = torch.randn(rows, k, device=dev, dtype=dtype)
    w = torch.randn(n, k, device=dev, dtype=dtype) / math.sqrt(k)
    b = torch.randn(n, device=dev, dtype=dtype)
    dout = torch.randn(rows, n, device=dev, dtype=dtype)
    y, pre = torch.empty_like(dout), torch.empty_like(dout)
    dx, dw, db = torch.empty_like(x), torch.empty_like(w), torch.empty_like(b)
    act = "gelu_tanh"
    ws_f = workspace(fusekit.linear_forward_workspace_size(rows, n, k, _FK_DTYPES[dtype], act, device_name(dev)), dev)
    ws_b = workspace(fusekit.linear_backward_workspace_size(rows, n, k, _FK_DTYPES[dtype], act, device_name(dev)), dev)
    fusekit.linear_forward(x, w, b, act, y, pre, ws_f)
    grads = [t.clone().requires_grad_(True) for t in (x, w, b)]
    return [Case(
        "linear", lambda: fusekit.linear_forward(x, w, b, act, y, pre, ws_f),
        lambda: fusekit.linear_backward(dout, x, w, pre, act, dx, dw, db, ws_b),
        lambda x, w, b: fk.linear(x, w, b, act),
        lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh"), (x, w, b), grads + [dout])]


def gated_linear_cases(dev, dtype, rows, k, f):
    x = torch.randn(rows, k, device=dev, dtype=dtype)
    w = torch.randn(2 * f, k, device=dev, dtype=dtype) / math.sqrt(k)
    dy = torch.randn(rows, f, device=dev, dtype=dtype)
    y, pre = torch.empty_like(dy), torch.empty(rows, 2 * f, device=dev, dtype=dtype)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    act, fk_dtype = "silu", _FK_DTYPES[dtype]
    ws_f = workspace(fusekit.gated_linear_forward_workspace_size(rows, f, k, fk_dtype, act, True,
                                                                 device_name(dev)), dev)
    ws_b = workspace(fusekit.gated_linear_backward_workspace_size(rows, f, k, fk_dtype, act, device_name(dev)), dev)
    fusekit.gated_linear_forward(x, w, None, act, y, pre, ws_f)
    grads = [t.clone().requires_grad_(True) for t in (x, w)]

    def pytorch(x, w):
        h = F.linear(x, w)
        return F.silu(h[:, 0::2]) * h[:, 1::2]

    return [Case(
        "gated_linear", lambda: fusekit.gated_linear_forward(x, w, None, act, y, pre, ws_f),
        lambda: fusekit.gated_linear_backward(dy, x, w, pre, act, dx, dw, None, ws_b),
        lambda x, w: fk.gated_linear(x, w, None, act), pytorch, (x, w), grads + [dy])]


def attention_cases(dev, dtype, batch, seq, heads, dim):
    if dev.type == "cuda" and dtype == torch.float32:
        dtype = torch.bfloat16  # the kernels take f16 / bf16
    shape = (batch, seq, heads, dim)
    q, k, v = (torch.randn(shape, device=dev, dtype=dtype) for _ in range(3))
    dout = torch.randn(shape, device=dev, dtype=dtype)
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seq, device=dev)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    sizes = (batch, seq, seq, heads, heads, dim, dim, _FK_DTYPES[dtype], device_name(dev))
    ws_f = workspace(fusekit.attention_forward_workspace_size(*sizes), dev)
    ws_b = workspace(fusekit.attention_backward_workspace_size(*sizes), dev)
    fusekit.attention_forward(q, k, v, None, out, lse, mask="causal_top_left", workspace=ws_f)
    grads = [t.clone().requires_grad_(True) for t in (q, k, v)]
    # PyTorch's SDPA in its (B, H, S, D) layout, on transposed views as fusekit's drop-in does.
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(  # noqa: E731
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
    return [Case(
        "attention",
        lambda: fusekit.attention_forward(q, k, v, None, out, lse, mask="causal_top_left", workspace=ws_f),
        lambda: fusekit.attention_backward(dout, q, k, v, out, lse, None, dq, dk, dv,
                                           mask="causal_top_left", workspace=ws_b),
        lambda q, k, v: fk.attention(q, k, v, mask="causal_top_left"),
        sdpa, (q, k, v), grads + [dout])]


def fp8_norm_cases(dev, rows, cols):
    if not hasattr(fk, "fp8_rms_norm"):
        return []
    g = fusekit.FP8_NORM_DEFAULT_GROUP_SIZE
    e4m3 = torch.float8_e4m3fn
    xq = (torch.randn(rows, cols, device=dev) * 50).to(e4m3)
    sx = (torch.rand(rows, cols // g, device=dev) * 0.01 + 0.001).to(torch.bfloat16)
    w = (torch.randn(cols, device=dev) * 0.5 + 1).to(torch.bfloat16)
    dy = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16)
    qy, qy_t = torch.empty_like(xq), torch.empty(cols, rows, device=dev, dtype=e4m3)
    ys, rstd = torch.empty((), device=dev), torch.empty(rows, device=dev)
    y, dx, dw = torch.empty_like(dy), torch.empty_like(dy), torch.empty_like(w)
    ws_f = workspace(fusekit.fp8_rms_norm_forward_workspace_size(rows, cols, device_name(dev)), dev)
    ws_b = workspace(fusekit.fp8_rms_norm_backward_workspace_size(rows, cols, device_name(dev)), dev)
    fusekit.fp8_rms_norm_forward(xq, sx, w, 1e-5, qy, qy_t, ys, rstd, y, ws_f)
    wg = w.clone().requires_grad_(True)
    xd = (xq.float().view(rows, -1, g) * sx.float().unsqueeze(-1)).view(rows, cols).to(torch.bfloat16)
    return [Case(
        "fp8_rms_norm", lambda: fusekit.fp8_rms_norm_forward(xq, sx, w, 1e-5, qy, qy_t, ys, rstd, y, ws_f),
        lambda: fusekit.fp8_rms_norm_backward(dy, xq, sx, w, rstd, dx, dw, ws_b),
        lambda w: fk.fp8_rms_norm(xq, (cols,), w, 1e-5, x_scales=sx).y,
        lambda w: F.rms_norm(xd, (cols,), w, 1e-5), (w,), [wg, dy])]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    ap.add_argument("--ops", default="norm,dropout,gated_act,linear,gated_linear,attention,fp8_norm,"
                                     "cross_entropy,linear_cross_entropy",
                    help="comma-separated families: norm, dropout, gated_act, linear, gated_linear, attention, "
                         "fp8_norm, cross_entropy, linear_cross_entropy")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--run-seconds", type=float, default=0.02,
                    help="about this long per run (short: the GPU must keep up with the host)")
    ap.add_argument("--max-calls", type=int, default=2000)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()

    dev = torch.device(args.device)
    dtype = _DTYPES[args.dtype]
    torch.manual_seed(0)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t = lambda fn: host_us(fn, sync, args.repeats, args.run_seconds, args.max_calls)  # noqa: E731
    ops = set(args.ops.split(","))
    cases = []
    if "norm" in ops:
        cases += norm_cases(dev, dtype, 4, 256)
    if "dropout" in ops:
        cases += dropout_cases(dev, dtype, 4, 256)
    if "gated_act" in ops:
        cases += gated_act_cases(dev, dtype, 4, 256)
    if "linear" in ops:
        cases += linear_cases(dev, dtype, 4, 256, 256)
    if "gated_linear" in ops:
        cases += gated_linear_cases(dev, dtype, 4, 256, 128)
    if "attention" in ops:
        cases += attention_cases(dev, dtype, 1, 64 if dev.type == "cuda" else 2, 2, 64)
    if "fp8_norm" in ops:
        cases += fp8_norm_cases(dev, 32, 256) if dev.type == "cuda" else fp8_norm_cases(dev, 2, 32)
    if "cross_entropy" in ops:
        cases += cross_entropy_cases(dev, dtype, 4, 256)
    if "linear_cross_entropy" in ops:
        cases += linear_cross_entropy_cases(dev, dtype, 4, 256, 256)

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU backend"
    print(f"fusekit host overhead per call: {dev} ({name}), {args.dtype}, torch {torch.__version__}, "
          f"budget {BUDGET_US:g} us over the _C call")
    header = (f"  {'op':<17} {'direction':<9} {'_C call':>8} {'fusekit.torch':>13} {'extra':>7} "
              f"{'budget':>6}  {'result':<6} {'PyTorch eager':>13}")
    print(header)
    print("  " + "-" * (len(header) - 2))
    rows, ok_all = [], True
    for case in cases:
        c_fwd, c_bwd = t(case.c_fwd), t(case.c_bwd)
        with torch.no_grad():
            fk_fwd = t(lambda: case.fk_call(*case.inputs))
            pt_fwd = t(lambda: case.torch_call(*case.inputs))
        *leaves, dy = case.grad_inputs
        fk_grad = t(lambda: case.fk_call(*leaves))
        pt_grad = t(lambda: case.torch_call(*leaves))
        out = case.fk_call(*leaves)
        node = out.grad_fn
        fk_bwd = t(lambda: node.apply(dy))
        pt_out = case.torch_call(*leaves)
        pt_bwd = t(lambda: torch.autograd.grad(pt_out, leaves, dy, retain_graph=True))
        fk_round = t(lambda: torch.autograd.grad(out, leaves, dy, retain_graph=True))
        for direction, base, got, pt in (("fwd", c_fwd, fk_fwd, pt_fwd),
                                         ("fwd+grad", c_fwd, fk_grad, pt_grad),
                                         ("bwd node", c_bwd, fk_bwd, None)):
            extra = got - base
            ok = extra <= BUDGET_US
            ok_all &= ok
            pt_text = f"{pt:10.2f} us" if pt is not None else f"{'':>13}"
            print(f"  {case.name:<17} {direction:<9} {base:8.2f} {got:13.2f} {extra:7.2f} "
                  f"{BUDGET_US:6.1f}  {'ok' if ok else 'OVER':<6} {pt_text}", flush=True)
            rows.append(dict(op=case.name, direction=direction, c_call_us=base, fusekit_torch_us=got,
                             extra_us=extra, budget_us=BUDGET_US, ok=ok, pytorch_eager_us=pt))
        print(f"  {'':<17} {'(autograd.grad round trip: fusekit ' + format(fk_round, '.1f') + ' us, PyTorch ' + format(pt_bwd, '.1f') + ' us)'}")
        rows.append(dict(op=case.name, direction="autograd.grad round trip", fusekit_torch_us=fk_round,
                         pytorch_eager_us=pt_bwd))
    print(f"  {'all within budget' if ok_all else 'OVER BUDGET'}")
    if dev.type == "cpu":
        print("  (CPU backend: the budget is meant for CUDA; times include the CPU reference's work)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "device_name": name, "dtype": args.dtype,
                       "torch": torch.__version__, "budget_us": BUDGET_US, "within_budget": ok_all,
                       "rows": rows}, f, indent=1)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
