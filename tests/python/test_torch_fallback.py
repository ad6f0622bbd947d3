"""fusekit.torch's fallback policies (fusekit.torch.set_fallback) on a real GPU: 'always' runs
PyTorch's implementation of each op, 'auto' does so with one warning on a GPU without fusekit
kernels, 'strict' raises there. A GPU without kernels is simulated by marking the device
unsupported in the policy's cache; everything else is real."""
import warnings

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the fusekit.torch tests need it")
import fusekit  # noqa: E402
import fusekit.torch as fk  # noqa: E402
from fusekit.torch import _fallback  # noqa: E402
from torch_testing import cuda_only  # noqa: E402

pytestmark = cuda_only


@pytest.fixture
def unsupported_gpu():
    """cuda:0 treated as a GPU without fusekit kernels for the test's duration."""
    fk.set_fallback("auto")
    saved = dict(_fallback._supported)
    _fallback._supported[torch.cuda.current_device()] = False
    _fallback.all_fusekit = None
    yield
    _fallback._supported.clear()
    _fallback._supported.update(saved)
    fk.set_fallback("auto")


def _calls(device, dtype=torch.bfloat16):
    """(name, fusekit call, PyTorch expression) per op; fresh random inputs."""
    g = torch.Generator(device=device).manual_seed(1234)
    x = torch.randn(64, 256, device=device, dtype=dtype, generator=g)
    w = torch.randn(256, device=device, dtype=dtype, generator=g)
    b = torch.randn(256, device=device, dtype=dtype, generator=g)
    lw = torch.randn(128, 256, device=device, dtype=dtype, generator=g) * 0.05
    t = torch.randint(0, 256, (64,), device=device, generator=g)
    q = torch.randn(2, 96, 4, 64, device=device, dtype=dtype, generator=g)
    k = torch.randn(2, 80, 2, 64, device=device, dtype=dtype, generator=g)
    v = torch.randn(2, 80, 2, 64, device=device, dtype=dtype, generator=g)
    F = torch.nn.functional

    def sdpa_ref(causal):
        kk, vv = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
        mask = None
        if causal:  # bottom-right: query i sees keys j <= i + (Sk - Sq)
            i = torch.arange(96, device=device)[:, None]
            j = torch.arange(80, device=device)[None, :]
            mask = j <= i + (80 - 96)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2),
                                             vv.transpose(1, 2), attn_mask=mask)
        out = out.transpose(1, 2)
        if causal:
            out = torch.where(mask.any(-1)[None, :, None, None], out, torch.zeros((), dtype=dtype,
                                                                                  device=device))
        return out

    def rope_ref():  # Hugging Face's rotate_half form, theta 10000, positions 0 .. S - 1
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, device=device).float() / 64))
        angle = torch.arange(96, device=device).float()[:, None] * inv_freq
        cos, sin = torch.cat((angle, angle), -1).cos()[:, None], torch.cat((angle, angle), -1).sin()[:, None]
        qf = q.float()
        rotated = torch.cat((-qf[..., 32:], qf[..., :32]), -1)
        return (qf * cos + rotated * sin).to(dtype)

    return [
        ("layer_norm", lambda: fk.layer_norm(x, (256,), w, b, 1e-5),
         lambda: F.layer_norm(x, (256,), w, b, 1e-5)),
        ("rms_norm", lambda: fk.rms_norm(x, (256,), w, 1e-6), lambda: F.rms_norm(x, (256,), w, 1e-6)),
        ("linear", lambda: fk.linear(x, lw, None, "gelu_tanh"),
         lambda: F.gelu(F.linear(x, lw), approximate="tanh")),
        ("gated_linear", lambda: fk.gated_linear(x, lw, None, "silu"),
         lambda: F.silu(F.linear(x, lw)[:, 0::2]) * F.linear(x, lw)[:, 1::2]),
        ("bias_act_dropout", lambda: fk.bias_act_dropout(x, b, "silu", 0.0),
         lambda: F.silu(x + b)),
        ("cross_entropy", lambda: fk.cross_entropy(x, t, label_smoothing=0.1),
         lambda: F.cross_entropy(x.float(), t, label_smoothing=0.1)),
        ("linear_cross_entropy", lambda: fk.linear_cross_entropy(x, lw, t % 128, label_smoothing=0.1),
         lambda: F.cross_entropy(F.linear(x, lw).float(), t % 128, label_smoothing=0.1)),
        ("gated_act", lambda: fk.gated_act(x, "silu"), lambda: F.silu(x[:, :128]) * x[:, 128:]),
        ("gated_act_separate", lambda: fk.gated_act_separate(x, x.flip(0), "gelu_tanh"),
         lambda: F.gelu(x, approximate="tanh") * x.flip(0)),
        ("attention", lambda: fk.attention(q, k, v), lambda: sdpa_ref(False)),
        ("attention causal", lambda: fk.attention(q, k, v, mask="causal_bottom_right"),
         lambda: sdpa_ref(True)),
        ("rope", lambda: fk.rope(q)[0], rope_ref),
    ]


def _close(a, b):
    return torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_always_runs_pytorch_implementations():
    fk.set_fallback("always")
    try:
        for name, call, ref in _calls("cuda"):
            got, want = call(), ref()
            assert torch.equal(got, want) or _close(got, want), name
    finally:
        fk.set_fallback("auto")


def test_auto_warns_once_per_op_and_matches_pytorch(unsupported_gpu):
    for name, call, ref in _calls("cuda"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = call()
            call()
        ours = [w for w in caught if "no fusekit kernels" in str(w.message)]
        assert len(ours) == (0 if name == "attention causal" else 1), (name, [str(w.message) for w in caught])
        assert _close(got, ref()), name


def test_strict_raises_naming_the_gpu(unsupported_gpu):
    fk.set_fallback("strict")
    _fallback._supported[torch.cuda.current_device()] = False
    for name, call, _ in _calls("cuda"):
        with pytest.raises(fusekit.UnsupportedError, match="compute capability"):
            call()


def test_supported_gpu_runs_fusekit_in_every_policy_but_always():
    assert fusekit.cuda_device_supported(torch.cuda.current_device())
    for policy in ("auto", "strict"):
        fk.set_fallback(policy)
        x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y = fk.rms_norm(x, (64,), None, 1e-6)
        assert _close(y, torch.nn.functional.rms_norm(x, (64,), None, 1e-6))
    fk.set_fallback("auto")


def test_unknown_policy_is_an_invalid_argument():
    with pytest.raises(fusekit.InvalidArgumentError, match="policy"):
        fk.set_fallback("sometimes")
