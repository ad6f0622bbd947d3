"""The PyTorch reference of train_gpt: the same GPT-2 model, initialization, data order, optimizer
and schedule in plain PyTorch, for loss and speed comparisons with the C++ program.

The initial weights come from a train_gpt checkpoint (`train_gpt --save-init init.bin`), so both
programs start from the same numbers; the data order is the C++ loader's (SplitMix64 permutation
per epoch, reimplemented below), read from the same corpus with the same byte tokenizer and split.
Precision: float32 master weights, bfloat16 autocast on the GPU (as the C++ program's bf16
activations); float32 on the CPU. --fp32 turns autocast off on the GPU too: the float32 run is the
yardstick that both bf16 programs are measured against (scripts/train_gpt_compare.py). Dropout
uses PyTorch's RNG, so the per-step losses agree with the C++ program's only at --dropout 0.

    python apps/train_gpt/reference.py --checkpoint init.bin --steps 50 --compile --losses-json torch.json
"""

import argparse
import json
import math
import os
import struct
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

MASK64 = (1 << 64) - 1
HEADER = struct.Struct("<8sII6qqQQqf28x")  # apps/train_gpt/README.md, "Checkpoint format"
DATA_STREAM = 0x64617461


# ---- the C++ loader's data order (apps/train_gpt/rng.h, data.cpp) ----------------------------

class SplitMix64:
    def __init__(self, seed):
        self.state = seed & MASK64

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)


def mix_seed(seed, stream, index):
    a = SplitMix64(seed ^ ((stream * 0xD1B54A32D192ED03) & MASK64))
    return SplitMix64((a.next() + index) & MASK64).next()


def permutation(n, seed):
    order = list(range(n))
    rng = SplitMix64(seed)
    for i in range(n - 1, 0, -1):
        j = rng.next() % (i + 1)
        order[i], order[j] = order[j], order[i]
    return order


class BatchLoader:
    """Windows of seq_len + 1 tokens starting at multiples of seq_len, shuffled per epoch."""

    def __init__(self, tokens, batch, seq_len, seed, position=0):
        self.tokens, self.batch, self.seq_len, self.seed = tokens, batch, seq_len, seed
        self.windows = (len(tokens) - 1) // seq_len
        self.position = position
        self.epoch, self.order = -1, None

    def next(self):
        inputs, targets = [], []
        for _ in range(self.batch):
            epoch, within = divmod(self.position, self.windows)
            if epoch != self.epoch:
                self.order = permutation(self.windows, mix_seed(self.seed, DATA_STREAM, epoch))
                self.epoch = epoch
            start = self.order[within] * self.seq_len
            window = self.tokens[start:start + self.seq_len + 1]
            inputs.append(window[:-1])
            targets.append(window[1:])
            self.position += 1
        return torch.stack(inputs), torch.stack(targets)


def load_tokens(path, val_fraction=0.1):
    data = open(path, "rb").read()
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
    n_val = int(len(data) * val_fraction)
    return tokens[:len(data) - n_val], tokens[len(data) - n_val:]


# ---- the model ---------------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        # c_attn's output columns are (3, H, D): q, k, v, each head's D features together.
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, n_embd, dropout):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=1e-5)
        self.attn = Attention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd, eps=1e-5)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, seq_len, padded_vocab, dropout):
        super().__init__()
        self.wte = nn.Embedding(padded_vocab, n_embd)
        self.wpe = nn.Embedding(seq_len, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, eps=1e-5)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # the tied output layer
        # The softmax runs over every padded row, as the C++ program's linear_cross_entropy does.
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))

    def parameters_in_checkpoint_order(self):
        """The order of apps/train_gpt/params.cpp's table."""
        out = [self.wte.weight, self.wpe.weight]
        for b in self.h:
            out += [b.ln_1.weight, b.ln_1.bias, b.attn.c_attn.weight, b.attn.c_attn.bias,
                    b.attn.c_proj.weight, b.attn.c_proj.bias, b.ln_2.weight, b.ln_2.bias,
                    b.mlp.c_fc.weight, b.mlp.c_fc.bias, b.mlp.c_proj.weight, b.mlp.c_proj.bias]
        return out + [self.ln_f.weight, self.ln_f.bias]


def read_checkpoint(path):
    with open(path, "rb") as f:
        raw = f.read()
    (magic, version, header_bytes, n_layer, n_head, n_embd, seq_len, vocab, padded_vocab, step, seed,
     data_position, count, last_loss) = HEADER.unpack_from(raw, 0)
    if magic != b"FKGPTCKP" or version != 1 or header_bytes != 128:
        raise SystemExit(f"{path}: not a version-1 train_gpt checkpoint")
    values = torch.frombuffer(bytearray(raw[128:128 + 4 * count]), dtype=torch.float32)
    config = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, seq_len=seq_len, vocab=vocab,
                  padded_vocab=padded_vocab)
    return config, dict(step=step, seed=seed, data_position=data_position), values


def learning_rate(args, step):
    """apps/train_gpt/optimizer.cpp's schedule: linear warm-up, then a cosine to lr * min_lr_ratio."""
    if args.warmup > 0 and step <= args.warmup:
        return args.lr * step / args.warmup
    progress = min(max((step - args.warmup) / max(args.steps - args.warmup, 1), 0.0), 1.0)
    min_lr = args.lr * args.min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (args.lr - min_lr)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="train_gpt --save-init output (initial weights)")
    p.add_argument("--data", default=os.path.join(here, "..", "..", "data", "tinyshakespeare.txt"))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=None, help="default: 1e-3 for width <= 256, else 6e-4 (as train_gpt)")
    p.add_argument("--warmup", type=int, default=None, help="default: steps // 10")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta2", type=float, default=0.99, help="default: as train_gpt (optimizer.h)")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--fp32", action="store_true", help="float32 throughout (no bf16 autocast)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="for MFU on the GPU")
    p.add_argument("--losses-json", default="")
    args = p.parse_args()

    config, state, values = read_checkpoint(args.checkpoint)
    if args.lr is None:
        args.lr = 1e-3 if config["n_embd"] <= 256 else 6e-4
    if args.warmup is None:
        args.warmup = args.steps // 10
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # the C++ program never uses TF32
    torch.backends.cudnn.allow_tf32 = False

    model = GPT(config["n_layer"], config["n_head"], config["n_embd"], config["seq_len"],
                config["padded_vocab"], args.dropout)
    with torch.no_grad():
        at = 0
        for t in model.parameters_in_checkpoint_order():
            n = t.numel()
            t.copy_(values[at:at + n].view_as(t))
            at += n
        assert at == values.numel(), "checkpoint parameter count differs from the model's"
    model.to(device).train()
    decay = [t for t in model.parameters_in_checkpoint_order() if t.dim() == 2]
    no_decay = [t for t in model.parameters_in_checkpoint_order() if t.dim() != 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, args.beta2), eps=1e-8,
                                  fused=device.type == "cuda")
    step_fn = torch.compile(model) if args.compile else model

    train_tokens, _ = load_tokens(args.data)
    loader = BatchLoader(train_tokens, args.batch, config["seq_len"], state["seed"], state["data_position"])
    C, L, T, V = config["n_embd"], config["n_layer"], config["seq_len"], config["padded_vocab"]
    flops_per_token = 6.0 * (L * 12.0 * C * C + V * C) + 12.0 * L * T * C  # as train_gpt counts
    precision = "float32" if args.fp32 or device.type != "cuda" else "bf16 autocast"
    print(f"reference: {device} {'torch.compile' if args.compile else 'eager'}, {precision}, {config}, "
          f"batch {args.batch}")
    records = []
    for step in range(state["step"] + 1, args.steps + 1):
        start = time.perf_counter()
        inputs, targets = (t.to(device, non_blocking=True) for t in loader.next())
        lr = learning_rate(args, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                            enabled=device.type == "cuda" and not args.fp32):
            loss = step_fn(inputs, targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip) if args.grad_clip > 0 else \
            torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tok_s = args.batch * T / seconds
        line = (f"step {step:5d}/{args.steps} | loss {loss.item():.4f} | lr {lr:.2e} | norm {norm.item():.4f} | "
                f"{seconds * 1e3:8.1f} ms | {tok_s:9.0f} tok/s")
        if device.type == "cuda":
            line += f" | MFU {100.0 * flops_per_token * tok_s / (args.peak_tflops * 1e12):5.1f}%"
            line += f" | mem {torch.cuda.memory_allocated() / 2**20:.0f} MiB"
        print(line, flush=True)
        records.append({"step": step, "loss": loss.item(), "ms": seconds * 1e3})
    if args.losses_json:
        with open(args.losses_json, "w") as f:
            json.dump({"program": "reference.py", "device": device.type, "compile": args.compile,
                       "precision": precision, "batch": args.batch, "seq_len": T, "train": records}, f, indent=2)


if __name__ == "__main__":
    main()
