#!/usr/bin/env python3
"""scripts/train_gpt_ddp_check.py on synthetic loss curves: the absolute bar before the
reference's first loss spike, the relative bar from it on, and the exit status. Runs under pytest
or directly."""
import io
import json
import os
import sys
import tempfile
import unittest
from contextlib import redirect_stdout

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))
import train_gpt_ddp_check as ddp  # noqa: E402

# A loss curve that falls, spikes 3x at step 6 and recovers.
CURVE = [11.0, 8.4, 7.5, 6.8, 6.0, 18.0, 5.4, 5.2]


def run(losses, gpus=1):
    return {"gpus": gpus, "batch": 16, "seq_len": 1024,
            "train": [{"step": i + 1, "loss": loss, "ms": 30.0} for i, loss in enumerate(losses)]}


class DdpCheckTest(unittest.TestCase):
    def check(self, *runs, args=()):
        with tempfile.TemporaryDirectory() as d:
            paths = []
            for name, r in runs:
                path = os.path.join(d, name + ".json")
                with open(path, "w") as f:
                    json.dump(r, f)
                paths.append(f"{name}={path}")
            out = io.StringIO()
            sys.argv = ["train_gpt_ddp_check.py", *args, *paths]
            with redirect_stdout(out):
                status = ddp.main()
            return status, json.loads(out.getvalue())

    def test_first_spike(self):
        self.assertEqual(ddp.first_spike(run(CURVE)), 6)
        self.assertIsNone(ddp.first_spike(run(CURVE[:5])))

    def test_small_differences_pass(self):
        other = [x + 1e-4 for x in CURVE]
        status, out = self.check(("gpus1", run(CURVE)), ("gpus2", run(other, 2)))
        self.assertEqual(status, 0)
        self.assertTrue(out["pass"])
        self.assertEqual(out["summary"]["gpus2_vs_gpus1"]["spike_step"], 6)

    def test_a_difference_before_the_spike_fails(self):
        other = list(CURVE)
        other[2] += 5e-3  # step 3, before the spike: over the 2e-3 default
        status, out = self.check(("gpus1", run(CURVE)), ("gpus2", run(other, 2)))
        self.assertEqual(status, 1)
        self.assertAlmostEqual(out["summary"]["gpus2_vs_gpus1"]["max_abs_loss_diff_before_spike"], 5e-3)

    def test_after_the_spike_the_bar_is_relative(self):
        other = list(CURVE)
        other[5] += 0.1  # at the spike: 0.1 / 18 = 0.56% of the loss, under 2%
        other[7] += 0.01  # after it: 0.2%
        status, out = self.check(("gpus1", run(CURVE)), ("gpus2", run(other, 2)))
        self.assertEqual(status, 0, out["summary"])
        other[6] += 0.5  # 9% of 5.4
        status, out = self.check(("gpus1", run(CURVE)), ("gpus2", run(other, 2)))
        self.assertEqual(status, 1)
        self.assertAlmostEqual(out["summary"]["gpus2_vs_gpus1"]["max_rel_loss_diff_from_spike"], 0.5 / 5.4)

    def test_resumed_runs_are_judged_against_the_uninterrupted_run(self):
        resumed = run(CURVE)
        resumed["train"] = resumed["train"][3:]
        resumed["train"][0]["loss"] += 0.01  # step 4, before the spike of gpus2's curve
        status, out = self.check(("gpus1", run(CURVE)), ("gpus2", run(CURVE, 2)), ("resumed_on_gpus1", resumed))
        self.assertEqual(status, 1)
        self.assertFalse(out["summary"]["resumed_on_gpus1_vs_gpus2"]["pass"])
        self.assertEqual(out["comparisons"]["resumed_on_gpus1_vs_gpus2"]["steps"], [4, 8])


if __name__ == "__main__":
    unittest.main()
