"""fusekit.torch.patch on Hugging Face transformers models built from tiny random configs (GPT-2,
Llama, Mistral with a sliding window, Qwen2, Qwen3 with its QK-norm, Gemma; nothing downloaded)
and on plain PyTorch models: logits, loss and gradients of the unpatched model (float32 on the CPU
backend; bfloat16 on CUDA within twice the unpatched model's own bfloat16 error against float32),
with and without padding; the fusekit ops that run; state_dicts unchanged; patching before the
weights are loaded (on the meta device) and after from_pretrained; the report; autocast,
torch.compile with zero graph breaks, and dropout with fresh masks."""
import copy
import inspect

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the fusekit.torch tests need it")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import fusekit.torch as fk  # noqa: E402
from torch_testing import DEVICES, compile_counting_graph_breaks, rel  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

F = torch.nn.functional
VOCAB, BATCH, SEQ = 128, 2, 16
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
# In training with labels the loss comes from the last hidden states (linear_cross_entropy_fwd).
LLAMA_OPS = {"rms_norm_fwd", "rope_fwd", "attention_fwd", "gated_act_separate_fwd",
             "linear_cross_entropy_fwd"}


def _gpt2(dropout):
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=dropout,
        embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0))


# family -> (a model from its tiny config with dropout p, the fusekit ops its forward runs)
FAMILIES = {
    "gpt2": (_gpt2, {"layer_norm_fwd", "linear_fwd", "attention_fwd", "bias_act_dropout_fwd",
                     "linear_cross_entropy_fwd"}),
    "llama": (lambda p: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, attention_dropout=p)),
              LLAMA_OPS),
    "mistral": (lambda p: transformers.MistralForCausalLM(transformers.MistralConfig(
        **COMMON, sliding_window=6, attention_dropout=p)), LLAMA_OPS),
    "qwen2": (lambda p: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON, attention_dropout=p)),
              LLAMA_OPS),
    "qwen3": (lambda p: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **COMMON, head_dim=16, attention_dropout=p)), LLAMA_OPS),
    "gemma": (lambda p: transformers.GemmaForCausalLM(transformers.GemmaConfig(
        **COMMON, head_dim=16, attention_dropout=p)), LLAMA_OPS),
}


class RecordingFusekitOps(TorchDispatchMode):
    """Runs every op unchanged (fusekit's functional forms then take their custom ops) and records
    the names of the fusekit ops it sees."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fusekit":
            self.ops.add(func._schema.name.split("::", 1)[1])
        return func(*args, **(kwargs or {}))


def make_model(family, seed, dropout=0.0, device="cpu", dtype=torch.float32):
    """A tiny model of `family` with every 1-D weight away from its initial value (norm weights
    of ones or zeros would hide a wrong formula)."""
    torch.manual_seed(seed)
    model = FAMILIES[family][0](dropout)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return model.to(device=device, dtype=dtype).train()


def batch(seed, device, padded):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(device)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long, device=device)
    labels = ids.clone()
    if padded:  # left padding in the second sequence
        mask[1, :5] = 0
        labels[1, :5] = -100
    return dict(input_ids=ids, attention_mask=mask if padded else None, labels=labels)


def without_labels(inputs):
    return {k: v for k, v in inputs.items() if k != "labels"}


def run(model, inputs):
    """(logits of a forward without labels, loss, {name: grad}); a patched model in training
    returns no logits with labels."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    with torch.no_grad():
        no_labels = model(**without_labels(inputs))
    assert no_labels.loss is None
    return no_labels.logits, out.loss.detach(), {n: p.grad for n, p in model.named_parameters()
                                                 if p.grad is not None}


def patched_copy(model):
    ours = copy.deepcopy(model)
    return ours, fk.patch(ours)


def assert_state_dicts_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padded"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_matches_the_unpatched_model_float32_cpu(family, padded, seed):
    model = make_model(family, seed)
    ours, report = patched_copy(model)
    assert_state_dicts_equal(model, ours)
    inputs = batch(seed, "cpu", padded)
    logits, loss, grads = run(model, inputs)
    logits2, loss2, grads2 = run(ours, inputs)
    keep = inputs["attention_mask"].bool() if padded else torch.ones(BATCH, SEQ, dtype=torch.bool)
    assert rel(logits2[keep], logits[keep]) <= 1e-5
    torch.testing.assert_close(loss2, loss, rtol=1e-5, atol=1e-6)
    assert set(grads2) == set(grads)
    for name in grads:
        assert rel(grads2[name], grads[name]) <= 1e-4, name
    assert_state_dicts_equal(model, ours)  # nothing written into the parameters
    assert ours.loss_function is fk.causal_lm_loss
    with RecordingFusekitOps() as recorded:
        ours(**inputs).loss.backward()
    assert FAMILIES[family][1] <= recorded.ops, recorded.ops


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bfloat16_cuda_within_twice_pytorchs_error(family, seed):
    """On the GPU (bfloat16 models: fusekit's attention runs 16-bit types there): the patched
    model's logits, loss and gradients against the float32 unpatched model err at most twice as
    much as the unpatched bfloat16 model (plus a floor for tiny errors)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ref32 = make_model(family, seed, device="cuda")
    base = copy.deepcopy(ref32).to(torch.bfloat16)
    ours, _ = patched_copy(base)
    inputs = batch(seed, "cuda", padded=True)
    keep = inputs["attention_mask"].bool()
    results = [run(m, inputs) for m in (ref32, base, ours)]
    (l32, loss32, g32), (lb, lossb, gb), (lo, losso, go) = results
    floor = 1e-2
    assert rel(lo[keep], l32[keep]) <= 2 * max(rel(lb[keep], l32[keep]), floor)
    assert abs(losso.item() - loss32.item()) <= 2 * max(abs(lossb.item() - loss32.item()), floor)
    for name in g32:
        assert rel(go[name], g32[name]) <= 2 * max(rel(gb[name], g32[name]), 5e-2), name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_report_and_patching_twice(family, seed):
    model = make_model(family, seed)
    ours, report = patched_copy(model)
    text = str(report)
    assert text.startswith(f"fusekit.torch.patch({type(model).__name__}): {len(report.patched)} patched")
    names = {e.name for e in report.patched}
    norm = "transformer.h.0.ln_1" if family == "gpt2" else "model.layers.0.input_layernorm"
    mlp = "transformer.h.0.mlp" if family == "gpt2" else "model.layers.0.mlp"
    assert norm in names and mlp in names and "" in names  # the model: attention and the loss
    assert norm in text and "AttentionInterface 'fusekit'" in text and "not patched:" in text
    if family != "gpt2":
        assert "model.layers.0.self_attn" in names  # rope
    if family == "qwen3":
        assert "model.layers.0.self_attn.q_norm" in names
    if family == "gemma":
        assert "(1 + weight)" in text
    fused = [e for e in report.patched if e.target == "lm_head + loss"]
    assert len(fused) == 1 and fused[0].name == "" and "linear_cross_entropy" in fused[0].detail
    assert "logits are None" in fused[0].detail and "lm_head + loss" in text
    assert type(ours).__name__ == type(model).__name__  # config.architectures as before
    # HF Trainer keeps the dataset columns that forward's signature names
    assert inspect.signature(ours.forward) == inspect.signature(model.forward)
    again = fk.patch(ours)
    assert not again.patched
    inputs = batch(seed, "cpu", padded=False)
    torch.testing.assert_close(run(ours, inputs)[1], run(model, inputs)[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma"])
def test_patched_before_the_weights_are_loaded(family, seed):
    """Patched on the meta device (no data: the probes use their own inputs), then materialized
    and loaded: the unpatched model's results."""
    model = make_model(family, seed)
    torch.manual_seed(seed)
    with torch.device("meta"):
        empty = FAMILIES[family][0](0.0)
    report = fk.patch(empty)
    assert report.patched and not [e for e in report.not_patched if e.name]
    empty = empty.to_empty(device="cpu").train()
    empty.load_state_dict(model.state_dict())
    with torch.no_grad():  # non-persistent buffers (rotary inv_freq) are not in the state_dict
        for name, buf in model.named_buffers():
            empty.get_buffer(name).copy_(buf)
    inputs = batch(seed, "cpu", padded=True)
    torch.testing.assert_close(run(empty, inputs)[1], run(model, inputs)[1], rtol=1e-5, atol=1e-6)


def test_patched_after_from_pretrained(tmp_path, seed):
    model = make_model("qwen3", seed)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).train()
    report = fk.patch(loaded)
    assert any(e.name == "model.layers.1.self_attn.k_norm" for e in report.patched)
    inputs = batch(seed, "cpu", padded=True)
    torch.testing.assert_close(run(loaded, inputs)[1], run(model, inputs)[1], rtol=1e-5, atol=1e-6)
    loaded.save_pretrained(tmp_path / "again")  # the state_dict saves as before
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert_state_dicts_equal(model, reloaded)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_under_autocast(family, seed):
    """float32 parameters under CPU bfloat16 autocast (HF Trainer's bf16=True): no dtype errors,
    the unpatched model's loss within bfloat16 tolerance, float32 gradients."""
    model = make_model(family, seed)
    ours, _ = patched_copy(model)
    inputs = batch(seed, "cpu", padded=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss, grads = run(model, inputs)
        _, loss2, grads2 = run(ours, inputs)
    assert loss2.dtype == torch.float32
    assert abs(loss2.item() - loss.item()) <= 2e-2 * abs(loss.item())
    for name in grads:
        assert grads2[name].dtype == torch.float32 and torch.isfinite(grads2[name]).all()
        assert rel(grads2[name], grads[name]) <= 0.1, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3"])
def test_torch_compile_without_graph_breaks(family, device, seed):
    """A patched model's training step under torch.compile: one graph, zero graph breaks, the
    fusekit ops in it; with dropout (GPT-2's and attention's) fresh masks every step."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = make_model(family, seed, dropout=0.1, device=device, dtype=dtype)
    fk.patch(model)
    inputs = batch(seed, device, padded=False)

    def step(input_ids, labels):
        return model(input_ids=input_ids, labels=labels).loss

    compiled, graphs, graph_breaks = compile_counting_graph_breaks(step, device)
    torch.manual_seed(seed)
    first = compiled(inputs["input_ids"], inputs["labels"])
    first.backward()
    second = compiled(inputs["input_ids"], inputs["labels"])
    assert graph_breaks() == 0 and len(graphs) == 1
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    for op in FAMILIES[family][1]:
        assert any(f"fusekit.{op}" in t for t in targets), (op, targets)
    assert first.item() != second.item()  # a fresh dropout mask
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_dropout_masks_follow_torch_manual_seed(seed):
    model = make_model("gpt2", seed, dropout=0.2)
    fk.patch(model)
    inputs = batch(seed, "cpu", padded=False)
    torch.manual_seed(seed)
    a = model(**inputs).loss
    b = model(**inputs).loss
    torch.manual_seed(seed)
    c = model(**inputs).loss
    assert a.item() != b.item() and a.item() == c.item()
    model.eval()
    torch.testing.assert_close(model(**inputs).loss, model(**inputs).loss, rtol=0, atol=0)


def test_options_turn_parts_off(seed):
    model = make_model("llama", seed)
    ours = copy.deepcopy(model)
    report = fk.patch(ours, attention=False, rope=False, loss=False)
    details = " ".join(e.detail for e in report.patched)
    assert "rms_norm" in details and "gated_act_separate" in details
    assert "AttentionInterface" not in details and "apply_rotary_pos_emb" not in details
    assert ours.config._attn_implementation != "fusekit"
    assert ours.loss_function is not fk.causal_lm_loss


class ScaledRMSNorm(torch.nn.Module):
    """Named like an RMSNorm but computing x_hat * weight * 2: not a norm fusekit computes."""

    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.eps = 1e-6

    def forward(self, x):
        return 2 * self.weight * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)


class MyRMSNorm(torch.nn.Module):
    """A user's RMSNorm: patched by behaviour, whatever its class."""

    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n))
        self.variance_epsilon = 1e-5

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True)
                                                + self.variance_epsilon)).to(x.dtype)


class FusedGateUpMLP(torch.nn.Module):
    """An MLP whose forward is not one of the forms patch() knows (a fused gate-up projection)."""

    def __init__(self, n):
        super().__init__()
        self.gate_up = torch.nn.Linear(n, 4 * n)
        self.down = torch.nn.Linear(2 * n, n)
        self.act = torch.nn.SiLU()

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(self.act(gate) * up)


def test_plain_pytorch_model(seed):
    """torch.nn drop-ins (LayerNorm, RMSNorm, CrossEntropyLoss, Dropout), a user's RMSNorm found
    by behaviour, a Linear-GELU-Linear MLP fused; a look-alike norm and an MLP of another form
    left alone, with the reasons."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.LayerNorm(32), MyRMSNorm(32),
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(approximate="tanh"),
                            torch.nn.Linear(64, 32)),
        torch.nn.RMSNorm(32, eps=1e-6), ScaledRMSNorm(32), torch.nn.Dropout(0.0), FusedGateUpMLP(32))
    loss_fn = torch.nn.Sequential(torch.nn.CrossEntropyLoss())
    x = torch.randn(6, 32)
    target = torch.randint(0, 32, (6,))
    before = model(x)
    ours = copy.deepcopy(model)
    report = fk.patch(ours)
    loss_report = fk.patch(loss_fn)
    patched = {e.name: e.detail for e in report.patched}
    assert patched["0"] == "fusekit.torch.LayerNorm" and patched["3"] == "fusekit.torch.RMSNorm"
    assert "rms_norm" in patched["1"] and "gelu_tanh" in patched["2"]
    assert patched["5"] == "fusekit.torch.Dropout"
    assert [e.name for e in report.not_patched] == ["4", "6"]
    assert "probe" in report.not_patched[0].detail and "mlp:" in report.not_patched[1].detail
    assert type(ours[0]) is fk.LayerNorm and isinstance(ours[1], MyRMSNorm)
    assert type(loss_fn[0]) is fk.CrossEntropyLoss and len(loss_report.patched) == 1
    torch.testing.assert_close(ours(x), before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_fn[0](before, target), F.cross_entropy(before, target),
                               rtol=1e-5, atol=1e-6)
    assert_state_dicts_equal(model, ours)


def test_softcapping_models_keep_their_attention(seed):
    torch.manual_seed(seed)
    config = transformers.Gemma2Config(**COMMON, head_dim=16, attn_logit_softcapping=50.0)
    model = transformers.Gemma2ForCausalLM(config)
    before = model.config._attn_implementation
    report = fk.patch(model)
    assert model.config._attn_implementation == before
    assert any("softcapping" in e.detail for e in report.not_patched)


def assert_same_training_step(model, ours, inputs):
    """The patched model's loss and every parameter's gradient (tied ones once) equal the
    unpatched model's; returns the patched model's output."""
    model.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    want = model(**inputs)
    got = ours(**inputs)
    want.loss.backward()
    got.loss.backward()
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for n, p in model.named_parameters()}
    grads2 = {n: p.grad for n, p in ours.named_parameters()}
    assert set(grads2) == set(grads)
    for name in grads:
        assert grads2[name] is not None, name
        assert rel(grads2[name], grads[name]) <= 1e-4, name
    return got


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_loss_with_num_items_in_batch(family, seed):
    """sum / num_items_in_batch (gradient accumulation in HF's Trainer) as ForCausalLMLoss, with
    ignore_index-padded labels; lm_head's weight (tied to the embedding in GPT-2 and Gemma) gets
    the unpatched gradient."""
    model = make_model(family, seed)
    ours, _ = patched_copy(model)
    inputs = dict(batch(seed, "cpu", padded=True), num_items_in_batch=torch.tensor(40))
    out = assert_same_training_step(model, ours, inputs)
    assert out.logits is None
    if model.config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.get_input_embeddings().weight


def test_fused_loss_with_an_lm_head_bias_and_shift_labels(seed):
    model = make_model("llama", seed)
    with torch.no_grad():
        model.lm_head = torch.nn.Linear(64, VOCAB, bias=True)
        model.lm_head.bias.normal_()
    ours, report = patched_copy(model)
    assert any(e.target == "lm_head + loss" for e in report.patched)
    inputs = batch(seed, "cpu", padded=True)
    assert_same_training_step(model, ours, inputs)
    labels = inputs["labels"]
    shifted = dict(inputs, shift_labels=torch.cat((labels[:, 1:], labels[:, :1]), 1))
    assert_same_training_step(model, ours, shifted)


def test_fused_loss_only_in_training_with_labels(seed):
    """Without labels, in eval mode, or with fused_loss=False: the logits as before; the loss as
    the unpatched model's in each case. return_dict=False leaves the None logits out of the
    tuple."""
    model = make_model("qwen2", seed)
    ours, _ = patched_copy(model)
    inputs = batch(seed, "cpu", padded=True)
    want = model(**inputs)
    logits = ours(**without_labels(inputs)).logits
    assert rel(logits, want.logits.detach()) <= 1e-5
    model.eval()
    ours.eval()
    evaluated = ours(**inputs)
    torch.testing.assert_close(evaluated.loss, model(**inputs).loss, rtol=1e-5, atol=1e-6)
    assert evaluated.logits is not None and rel(evaluated.logits, want.logits.detach()) <= 1e-5
    ours.train()
    as_tuple = ours(**inputs, return_dict=False)
    torch.testing.assert_close(as_tuple[0], want.loss, rtol=1e-5, atol=1e-6)
    assert not any(isinstance(t, torch.Tensor) and t.shape[-1] == VOCAB for t in as_tuple[1:])
    model.train()
    unfused = copy.deepcopy(model)
    report = fk.patch(unfused, fused_loss=False)
    assert not any(e.target == "lm_head + loss" for e in report.patched + report.not_patched)
    assert unfused.loss_function is fk.causal_lm_loss and type(unfused) is type(model)
    out = assert_same_training_step(model, unfused, inputs)
    assert out.logits is not None


@pytest.mark.parametrize("softcap", [30.0, None])
def test_final_logit_softcapping_is_not_fused(softcap, seed):
    """Gemma2's loss is of its soft-capped logits: not fused (the reason in the report), the loss
    as before; without the soft-capping its forward is the plain causal-LM one, fused."""
    torch.manual_seed(seed)
    config = transformers.Gemma2Config(**COMMON, head_dim=16, final_logit_softcapping=softcap)
    model = transformers.Gemma2ForCausalLM(config).train()
    ours, report = patched_copy(model)
    entries = [e for e in report.patched + report.not_patched if e.target == "lm_head + loss"]
    assert len(entries) == 1
    if softcap is None:
        assert entries[0] in report.patched
    else:
        assert entries[0] in report.not_patched and "final_logit_softcapping" in entries[0].detail
    out = assert_same_training_step(model, ours, batch(seed, "cpu", padded=True))
    assert (out.logits is None) == (softcap is None)
