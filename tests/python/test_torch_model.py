"""A transformer block built from fusekit.torch's modules only (LayerNorm, RMSNorm, Linear with a
fused activation, BiasActDropout, attention): torch.compile(fullgraph=True) of the whole block
(one graph, every fusekit op in it, outputs and gradients as in eager mode), one CUDA-graph-
captured training step (forward, backward and optimizer step) replayed against eager steps, and
the same block against its plain PyTorch twin with the same weights."""
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the fusekit.torch tests need it")
import fusekit.torch as fk  # noqa: E402
from torch_testing import (DEVICES, assert_one_graph_calling,  # noqa: E402
                           compile_recording_graphs, cuda_only, rel)

F = torch.nn.functional
HEADS = 4


class FusedBlock(torch.nn.Module):
    def __init__(self, dim, device, dtype):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.norm1 = fk.LayerNorm(dim, **kw)
        self.qkv = fk.Linear(dim, 3 * dim, activation="none", **kw)
        self.proj = fk.Linear(dim, dim, activation="none", **kw)
        self.norm2 = fk.RMSNorm(dim, eps=1e-6, **kw)
        self.up = fk.Linear(dim, 4 * dim, bias=False, activation="none", **kw)
        self.act = fk.BiasActDropout(4 * dim, "gelu_tanh", p=0.0, **kw)
        self.down = fk.Linear(4 * dim, dim, activation="relu", **kw)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, d // HEADS).unbind(2)
        a = fk.attention(q, k, v, mask="causal_top_left").reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.down(self.act(self.up(self.norm2(x))))


def plain_forward(m, x):
    """The same block in plain PyTorch, on m's parameters."""
    b, s, d = x.shape
    h = F.layer_norm(x, (d,), m.norm1.weight, m.norm1.bias, m.norm1.eps)
    q, k, v = F.linear(h, m.qkv.weight, m.qkv.bias).view(b, s, 3, HEADS, d // HEADS).unbind(2)
    a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True).transpose(1, 2).reshape(b, s, d)
    x = x + F.linear(a, m.proj.weight, m.proj.bias)
    h = F.gelu(F.linear(F.rms_norm(x, (d,), m.norm2.weight, 1e-6), m.up.weight) + m.act.bias,
               approximate="tanh")
    return x + F.relu(F.linear(h, m.down.weight, m.down.bias))


def dtype_for(device):
    # fusekit's attention kernels take f16/bf16 on the GPU; the CPU reference float32 and float64.
    return torch.bfloat16 if device == "cuda" else torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_block_matches_plain_pytorch(device, seed):
    torch.manual_seed(seed)
    dtype = dtype_for(device)
    m = FusedBlock(64, device, dtype)
    for p in m.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(2, 16, 64, device=device, dtype=dtype)
    y = m(x)
    y.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    y_ref = plain_forward(m, x)
    y_ref.float().square().mean().backward()
    # The same math in the same dtype: bf16 roundings differ in places, hence a dtype tolerance.
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel(y, y_ref) <= tol
    for n, p in m.named_parameters():
        assert rel(grads[n], p.grad) <= 5 * tol, n


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_block_is_one_graph(device, seed):
    torch.manual_seed(seed)
    torch._dynamo.reset()
    dtype = dtype_for(device)
    m = FusedBlock(64, device, dtype)
    compiled, graphs = compile_recording_graphs(m, device)
    x = torch.randn(2, 16, 64, device=device, dtype=dtype, requires_grad=True)
    y = compiled(x)
    y.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    gx = x.grad.clone()
    m.zero_grad()
    x.grad = None
    y_eager = m(x)
    y_eager.float().square().mean().backward()
    assert_one_graph_calling(graphs, *(f"fusekit.{op}" for op in (
        "layer_norm_fwd", "rms_norm_fwd", "linear_fwd", "bias_act_dropout_fwd", "attention_fwd")))
    # Inductor may fuse the PyTorch glue (residual adds, views) differently: bf16 roundings.
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel(y, y_eager) <= tol
    assert rel(gx, x.grad) <= 5 * tol
    for n, p in m.named_parameters():
        assert rel(grads[n], p.grad) <= 5 * tol, n


@cuda_only
def test_cuda_graph_captured_training_step(seed):
    """forward + backward + AdamW step captured in one CUDA graph; each replay on fresh data
    equals an eager step of a twin model (same weights, same optimizer state)."""
    torch.manual_seed(seed)
    model = FusedBlock(128, "cuda", torch.bfloat16)
    eager = FusedBlock(128, "cuda", torch.bfloat16)
    eager.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-3, capturable=True)
    static_x = torch.randn(4, 32, 128, device="cuda", dtype=torch.bfloat16)

    def step(m, o, x):
        o.zero_grad(set_to_none=False)
        loss = m(x).float().square().mean()
        loss.backward()
        o.step()
        return loss

    # Warm-up outside capture (lazy initialization, optimizer state), on a side stream as CUDA
    # graphs require; the eager twin takes the same steps on the same data.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(model, opt, static_x)
            step(eager, opt_eager, static_x.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(model, opt, static_x)
    for _ in range(3):
        static_x.copy_(torch.randn_like(static_x))
        graph.replay()
        loss = step(eager, opt_eager, static_x.clone())
        torch.cuda.synchronize()
        # Stale or missing work would be off by O(1); the GEMMs may pick other algorithms under
        # capture, so not bitwise.
        assert rel(static_loss, loss) <= 1e-2
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            assert rel(p, q) <= 1e-2, n
