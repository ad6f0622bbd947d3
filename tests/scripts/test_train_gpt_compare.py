#!/usr/bin/env python3
"""scripts/train_gpt_compare.py on synthetic runs: the relative loss bar, the step it names, the
speed ratio and the exit status. Runs under pytest or directly."""
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

CURVE = [11.0, 8.4, 7.5, 6.8, 6.0, 5.6, 5.4, 5.2]


def run(losses, ms):
    return {"batch": 16, "seq_len": 1024,
            "train": [{"step": i + 1, "loss": loss, "ms": ms} for i, loss in enumerate(losses)]}


class CompareTest(unittest.TestCase):
    def check(self, fusekit_run, torch_run):
        with tempfile.TemporaryDirectory() as d:
            paths = []
            for name, r in (("fusekit", fusekit_run), ("torch", torch_run)):
                path = os.path.join(d, name + ".json")
                with open(path, "w") as f:
                    json.dump(r, f)
                paths.append(path)
            out = io.StringIO()
            sys.argv = ["train_gpt_compare.py", *paths]
            with redirect_stdout(out):
                status = compare.main()
            return status, json.loads(out.getvalue())

    def test_differences_within_two_bf16_epsilons_pass(self):
        other = [x * (1 + 0.9 * 2.0**-7) for x in CURVE]
        status, out = self.check(run(other, 24.0), run(CURVE, 30.0))
        self.assertEqual(status, 0)
        self.assertTrue(out["pass"])
        self.assertAlmostEqual(out["max_rel_loss_diff"], 0.9 * 2.0**-7)
        self.assertAlmostEqual(out["speedup_vs_torch"], 1.25)
        self.assertEqual(out["steps"], len(CURVE))

    def test_one_step_past_the_bar_fails_and_is_named(self):
        other = list(CURVE)
        other[6] *= 1 + 1.5 * 2.0**-7  # step 7
        status, out = self.check(run(other, 30.0), run(CURVE, 30.0))
        self.assertEqual(status, 1)
        self.assertFalse(out["pass"])
        self.assertEqual(out["max_rel_at_step"], 7)


if __name__ == "__main__":
    unittest.main()
