#!/usr/bin/env python3
"""scripts/train_gpt_compare.py on synthetic runs: the twice-PyTorch bar against the float32 run,
the steps it names, the speed ratio and the exit status. Runs under pytest or directly."""
import io
import json
import os
import sys
import tempfile
import unittest
from contextlib import redirect_stdout

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))
import train_gpt_compare as compare  # noqa: E402

FP32 = [11.0, 8.4, 7.5, 6.8, 6.0, 5.6, 5.4, 5.2]
TORCH = [x * (1 + 1e-3 * (i % 3)) for i, x in enumerate(FP32)]  # 0.2% at most (steps 3 and 6)


def run(losses, ms):
    return {"batch": 16, "seq_len": 1024,
            "train": [{"step": i + 1, "loss": loss, "ms": ms} for i, loss in enumerate(losses)]}


class CompareTest(unittest.TestCase):
    def check(self, fusekit_losses, fusekit_ms=30.0):
        with tempfile.TemporaryDirectory() as d:
            paths = []
            for name, r in (("fusekit", run(fusekit_losses, fusekit_ms)), ("torch", run(TORCH, 30.0)),
                            ("fp32", run(FP32, 90.0))):
                path = os.path.join(d, name + ".json")
                with open(path, "w") as f:
                    json.dump(r, f)
                paths.append(path)
            out = io.StringIO()
            with redirect_stdout(out):
                status = compare.main(paths)
            return status, json.loads(out.getvalue())

    def test_within_twice_pytorchs_error_passes(self):
        fusekit = [x * (1 - 3.9e-3 * (i == 4)) for i, x in enumerate(FP32)]  # 0.39% at step 5
        status, out = self.check(fusekit, fusekit_ms=24.0)
        self.assertEqual(status, 0)
        self.assertTrue(out["pass"])
        self.assertAlmostEqual(out["max_rel_err_vs_fp32"]["fusekit"], 3.9e-3)
        self.assertAlmostEqual(out["max_rel_err_vs_fp32"]["torch"], 2e-3)
        self.assertEqual(out["max_rel_err_at_step"], {"fusekit": 5, "torch": 3})
        self.assertAlmostEqual(out["speedup_vs_torch"], 1.25)

    def test_past_twice_pytorchs_error_fails(self):
        fusekit = [x * (1 + 4.1e-3 * (i == 6)) for i, x in enumerate(FP32)]  # 0.41% at step 7
        status, out = self.check(fusekit)
        self.assertEqual(status, 1)
        self.assertFalse(out["pass"])
        self.assertEqual(out["max_rel_err_at_step"]["fusekit"], 7)

    def test_needs_three_runs(self):
        with redirect_stdout(io.StringIO()):
            self.assertEqual(compare.main(["a.json", "b.json"]), 2)


if __name__ == "__main__":
    unittest.main()
