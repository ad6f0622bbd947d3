"""fusekit.torch under data-parallel training (scripts/torch_dist_check.py in smoke mode: tiny
GPT-2 in float32 on the CPU backend, gloo, 2 processes): DistributedDataParallel and FSDP2's
fully_shard give the 1-process run's losses on the same global batch; and DTensor inputs (tensor
parallelism) are a clear error naming the op and the argument."""
import os
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the fusekit.torch tests need it")
pytest.importorskip("transformers", reason="transformers is not installed")
if not torch.distributed.is_available():
    pytest.skip("this PyTorch has no torch.distributed", allow_module_level=True)
import fusekit  # noqa: E402
import fusekit.torch as fk  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import torch_dist_check as tdc  # noqa: E402
from torch_testing import custom_op_route  # noqa: E402


def _check(compile_setting):
    args = tdc.parse_args(["--smoke", "--models", "gpt2", "--world-sizes", "2", "--compile", compile_setting,
                           "--steps", "2", "--out", os.devnull])
    name = "gpt2"
    spec = tdc.model_specs(True)[name]
    args.global_batch = {name: tdc.global_batch(spec[2], args.world_sizes)}
    return tdc.check_model(name, spec, args, "cpu", print)


def test_ddp_and_fsdp2_match_the_single_process_losses():
    runs, ok = _check("off")
    assert set(runs) == {"single", "ddp_w2", "fsdp2_w2"}
    for key in ("ddp_w2", "fsdp2_w2"):
        r = runs[key]
        assert "error" not in r, r.get("error")
        assert r["pass"] and r["max_abs_loss_diff"] <= 1e-4 and len(r["losses"]) == 2, \
            (key, r["losses"], runs["single"]["losses"])
        assert r["tokens_per_s_per_gpu"] > 0 and len(r["peak_memory_gib_per_rank"]) == 2
    assert ok


@pytest.mark.skipif((os.cpu_count() or 1) < 8,
                    reason="torch.compile in three processes takes over a minute on fewer than 8 cores (78 s on "
                           "2); the GPU machine's suite runs it, and its torch_dist stage the compiled GPU runs")
def test_ddp_and_fsdp2_under_torch_compile_match():
    runs, ok = _check("on")
    assert {"single_compile", "ddp_w2_compile", "fsdp2_w2_compile"} == set(runs)
    assert ok, {k: r.get("error", r.get("max_abs_loss_diff")) for k, r in runs.items()}


def test_a_loss_difference_past_the_tolerance_fails():
    ref = {"losses": [5.0, 4.9, 4.8]}
    assert tdc.compare({"losses": [5.0, 4.9, 4.8]}, ref, 1e-4)["pass"]
    assert not tdc.compare({"losses": [5.0, 4.9, 4.8005]}, ref, 1e-4)["pass"]
    assert not tdc.compare({"losses": [5.0, 4.9, float("nan")]}, ref, 1e-4)["pass"]
    assert not tdc.compare({"error": "RuntimeError: x"}, ref, 1e-4)["pass"]


@pytest.fixture
def mesh(tmp_path):
    """A 1-D CPU device mesh over a gloo group of this process alone (the smallest one a DTensor
    needs)."""
    dist = torch.distributed
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensor_inputs_are_a_clear_error(mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    x = distribute_tensor(torch.randn(4, 8), mesh, [Shard(0)])
    w = distribute_tensor(torch.randn(6, 8), mesh, [Replicate()])
    with pytest.raises(fk.DTensorInputError, match=r"^fusekit\.linear: argument 'x': DTensor inputs are not "
                       r"supported \(tensor parallelism\): got a DTensor with placements \(S\(0\)\).*"
                       r"DTensor\.to_local\(\)") as info:
        fk.linear(x, w)
    assert isinstance(info.value, fusekit.InvalidArgumentError) and isinstance(info.value, ValueError)
    assert (info.value.op, info.value.argument) == ("linear", "x")
    # On the custom-op route (tracing, dispatch modes) every argument is checked.
    with custom_op_route(), pytest.raises(fk.DTensorInputError, match=r"fusekit\.rms_norm: argument 'weight'"):
        fk.rms_norm(x.to_local(), (8,), distribute_tensor(torch.ones(8), mesh, [Replicate()]))
    with pytest.raises(fk.DTensorInputError, match=r"fusekit\.layer_norm: argument 'x'"):
        fk.layer_norm(x, (8,))
    with pytest.raises(fk.DTensorInputError, match=r"fusekit\.cross_entropy: argument 'input'"):
        fk.cross_entropy(x, torch.zeros(4, dtype=torch.long))
    with pytest.raises(fk.DTensorInputError, match=r"fusekit\.gated_act_separate: argument 'gate'"):
        fk.gated_act_separate(x, x)
    with pytest.raises(fk.DTensorInputError, match=r"fusekit\.gated_linear: argument 'x'"):
        fk.gated_linear(x, w)
    # A DTensor beside a plain first argument reaches fusekit._C, whose check names it too.
    with pytest.raises(fusekit.InvalidArgumentError, match=r"fusekit\.linear_forward: argument 'weight': expected "
                       r"a local tensor \(DTensor inputs are not supported.*got a DTensor"):
        fk.linear(x.to_local(), w)
    # The local tensors work.
    y = fk.linear(x.to_local(), w.to_local())
    torch.testing.assert_close(y, x.to_local() @ w.to_local().T, rtol=1e-5, atol=1e-5)
