#!/usr/bin/env python3
"""scripts/perf_report.py on a fixture: merging fresh runs into a device/date record and the
tables generated from it (CPU only; the plots are not drawn). Runs under pytest or directly."""
import json
import os
import shutil
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))
import norm_sweep  # noqa: E402
import perf_report  # noqa: E402

FIXTURES = os.path.join(HERE, "fixtures")


class PerfReportTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.results = os.path.join(self.dir, "results")
        os.makedirs(self.results)

    def tearDown(self):
        shutil.rmtree(self.dir)

    def run_report(self, *merge, date="2026-12-01"):
        out = os.path.join(self.dir, "performance.md")
        args = ["--results", self.results, "--out", out, "--no-plots", "--plots", os.path.join(self.dir, "plots"),
                "--commit", "abc1234", "--date", date]
        if merge:
            args += ["--merge"] + [os.path.join(FIXTURES, m) for m in merge]
        self.assertEqual(perf_report.main(args), 0)
        with open(out) as f:
            return f.read()

    def test_merge_writes_one_record_per_device_and_date(self):
        self.run_report("fusekit_bench.json", "torch_bench.json")
        self.assertEqual(os.listdir(self.results), ["h100-2026-12-01.json"])
        rec = perf_report.read_json(os.path.join(self.results, "h100-2026-12-01.json"))
        self.assertEqual((rec["device"], rec["date"], rec["commits"]), ("h100", "2026-12-01", ["abc1234"]))
        self.assertEqual([r["source"] for r in rec["runs"]], ["fusekit bench", "torch_bench"])
        row = next(r for r in rec["rows"] if r["op"] == "rms_norm" and r["impl"] == "fusekit")
        self.assertEqual((row["family"], row["dtype"], row["ceiling"]), ("norm", "bf16", "copy"))
        self.assertAlmostEqual(row["gbps"], 2684.4, places=1)
        self.assertAlmostEqual(row["percent_of_ceiling"], 89.48, places=2)
        lin = next(r for r in rec["rows"] if r["op"] == "linear" and r["impl"] == "fusekit")
        self.assertEqual(lin["ceiling"], "gemm")
        self.assertAlmostEqual(lin["percent_of_ceiling"], 68.72, places=2)

    def test_a_new_run_replaces_rows_of_the_same_kind(self):
        self.run_report("fusekit_bench.json", "torch_bench.json")
        self.run_report("fusekit_bench.json")
        rec = perf_report.read_json(os.path.join(self.results, "h100-2026-12-01.json"))
        self.assertEqual(len(rec["rows"]), 11)
        self.assertEqual([r["source"] for r in rec["runs"]], ["torch_bench", "fusekit bench"])
        self.assertTrue(all(0 <= r["run"] < len(rec["runs"]) for r in rec["rows"]))

    def test_older_torch_bench_impl_names_are_mapped(self):
        raw = perf_report.read_json(os.path.join(FIXTURES, "torch_bench.json"))
        for r in raw["rows"]:
            r["impl"] = {"torch_eager": "torch", "torch_compile": "compile"}.get(r["impl"], r["impl"])
        _, rows = perf_report.normalize_run(raw, None)
        self.assertEqual({r["impl"] for r in rows}, {"torch_eager", "torch_compile", "flash", "cudnn", "liger"})

    def test_tables(self):
        text = self.run_report("fusekit_bench.json", "torch_bench.json")
        self.assertTrue(text.startswith("# fusekit performance"))
        self.assertIn("### LayerNorm / RMSNorm (bf16), H100", text)
        self.assertIn("Measured 2026-12-01 (commit abc1234); ceilings in the same run: copy 3000 GB/s, "
                      "bf16 GEMM 800 TFLOP/s.", text)
        self.assertIn("| rms_norm | fwd | (16384, 4096) | 100.0 | 2684 | 89.5% | 94.2% | 200.0 | 150.0 | 125.0 | 2.00 | 1.50 | 1.25 |", text)
        self.assertIn("| fwd | (8192, 4096, 16384) silu | 2000.0 | 550 | 68.7% | 1900.0 | 1.053 | 2200.0 | - | 1.10 | - |", text)
        self.assertIn("| (B=4, S=4096, H=16, D=128) | fwd | 1000.0 | 550 | 68.7% | 1500.0 | - | 900.0 | 1.50 | - | 0.90 |", text)
        self.assertNotIn("](plots/", text)  # no plots drawn, none linked

    def test_linear_cross_entropy_tables(self):
        text = self.run_report("fusekit_bench_linear_cross_entropy.json", "torch_bench_linear_cross_entropy.json")
        self.assertIn("### Linear cross-entropy: loss, dh, dW without the logits (bf16), H100", text)
        self.assertIn("| fwd+bwd | (8192, 32000, 4096) | 9000.0 | 716 | 89.5% | 8500.0 | 1.059 | 18000.0 | 13500.0 | "
                      "2.00 | 1.50 |", text)
        self.assertIn("| fwd+bwd | (8192, 32000, 4096) | 9500.0 | 9000.0 | 1.056 | 18000.0 | 13500.0 | 12000.0 | "
                      "1.89 | 1.42 | 1.26 | 600 | 4200 | 2100 | 700 |", text)
        rec = perf_report.read_json(os.path.join(self.results, "h100-2026-12-01.json"))
        liger = next(r for r in rec["rows"] if r["impl"] == "liger")
        self.assertEqual(liger["peak_bytes"], 700 * 2 ** 20)

    def test_a_family_timed_only_through_pytorch_still_gets_its_table(self):
        text = self.run_report("torch_bench_linear_cross_entropy.json")
        self.assertIn("### Linear cross-entropy: loss, dh, dW without the logits (bf16), H100", text)
        self.assertIn("| fwd+bwd | (8192, 32000, 4096) | 9500.0 | 9000.0 | 1.056 |", text)
        self.assertNotIn("cuBLAS plain us", text)

    def merge_later_run(self, run):
        """Merges a fusekit_bench run as commit def5678 of 2026-12-02."""
        path = os.path.join(self.dir, "later.json")
        with open(path, "w") as f:
            json.dump(run, f)
        perf_report.merge_files(self.results, [path], "def5678", "2026-12-02")

    def test_newest_date_wins(self):
        self.run_report("fusekit_bench.json", "torch_bench.json", date="2026-12-01")
        faster = perf_report.read_json(os.path.join(FIXTURES, "fusekit_bench.json"))
        faster["rows"][0]["time_us"] = 90.0
        self.merge_later_run(faster)
        text = self.run_report(date="2026-12-02")
        self.assertIn("| rms_norm | fwd | (16384, 4096) | 90.0 |", text)
        self.assertIn("Measured 2026-12-02 (commit def5678)", text)

    def test_a_shape_measured_only_earlier_keeps_its_row(self):
        self.run_report("fusekit_bench.json", "torch_bench.json", date="2026-12-01")
        later = perf_report.read_json(os.path.join(FIXTURES, "fusekit_bench.json"))
        first = dict(later["rows"][0], shape="(16384, 4095)", time_us=120.0)
        later["rows"] = [first]
        self.merge_later_run(later)
        text = self.run_report(date="2026-12-02")
        self.assertIn("| rms_norm | fwd | (16384, 4096) |", text)
        self.assertIn("| rms_norm | fwd | (16384, 4095) | 120.0 |", text)
        self.assertIn("Measured 2026-12-01, 2026-12-02 (commit abc1234, def5678)", text)

    def test_norm_sweep_parts_add_up_and_the_table_gives_the_verdicts(self):
        text = self.run_report("norm_sweep_part1.json", "norm_sweep_part2.json")
        rec = perf_report.read_json(os.path.join(self.results, "h100-2026-12-01.json"))
        (entry,) = rec["norm_sweep"]
        self.assertEqual(entry["commit"], "abc1234")
        self.assertEqual(len(entry["points"]), 5)  # part 2's (bwd, 256) replaced part 1's
        bwd = next(p for p in entry["points"] if p["direction"] == "bwd")
        self.assertEqual(bwd["time_us"]["fusekit"], 150.0)
        self.assertIn("### Norm bandwidth over every row length, H100", text)
        # fwd: N=256 at 95%, N=1000 at 86.4% (below 90), N=64 under the bar's minimum width; the
        # small point (20 us) is slower than eager (15 us).
        self.assertIn("| layer_norm | plain | fwd | 4 | 90% | 1 of 2 | 86.4 (1000) | 90.7 | 1 |", text)
        self.assertIn("| layer_norm | plain | bwd | 1 | 85% | 0 of 1 | 93.3 (256) | 93.3 | 0 |", text)

    def test_e2e_runs_are_kept_and_tabled(self):
        text = self.run_report("e2e_bench.json")
        rec = perf_report.read_json(os.path.join(self.results, "h100-2026-12-01.json"))
        self.assertEqual([e["commit"] for e in rec["e2e"]], ["abc1234"])
        self.assertIn("### Training HuggingFace models end to end (PyTorch), H100", text)
        self.assertIn("| fusekit (patch) | 40.0 | 409600 | 1.250 | 18.00 | 5.00e-04 |", text)
        self.assertIn("| PyTorch eager | 80.0 | 204800 | - | 30.50 | - |", text)
        self.assertIn("| Liger-Kernel | NotImplementedError: Liger-Kernel patches no GPT-2 | | | | |", text)


    def test_torch_dist_runs_are_kept_and_tabled(self):
        text = self.run_report("torch_dist.json")
        rec = perf_report.read_json(os.path.join(self.results, "h100-2026-12-01.json"))
        self.assertEqual([(e["commit"], e["pass"], e["gpus"]) for e in rec["torch_dist"]], [("abc1234", False, 2)])
        self.assertEqual(rec["torch_dist"][0]["models"][0]["runs"]["ddp_w2"]["tokens_per_s_per_gpu"], 78019.0)
        self.assertIn("### fusekit.torch.patch under DDP and FSDP2, H100", text)
        self.assertIn("| 2026-12-01 | abc1234 | gpt2 (batch 16 x 1024) | 1 process | 1 | no | 81920 | 30.50 | "
                      "reference | - |", text)
        self.assertIn("| 2026-12-01 | abc1234 | gpt2 (batch 16 x 1024) | DDP | 2 | no | 78019 | 17.50 | "
                      "1.2e-03 (bar 2e-03) | yes |", text)
        self.assertIn("| FSDP2 (fully_shard) | 2 | no | RuntimeError: rank 1 failed | | | NO |", text)


class NormSweepGridTest(unittest.TestCase):
    def test_the_grid_meets_the_sweep_rules(self):
        widths = norm_sweep.widths()
        self.assertGreaterEqual(len(widths), 200)
        self.assertEqual((widths[0], widths[-1]), (64, 65536))
        self.assertGreaterEqual(sum(1 for n in widths if n % 8), 20)
        self.assertGreaterEqual(sum(1 for n in widths if n & (n - 1)), 150)  # not powers of two
        self.assertTrue(set(norm_sweep.MODEL_WIDTHS) <= set(widths))
        for n in widths:  # every problem of the large sweep moves at least 256 MB in each direction
            self.assertGreaterEqual(4 * n * norm_sweep.large_rows(n), 256 << 20, n)
        for n in norm_sweep.small_widths():
            self.assertTrue(8 << 20 <= n * norm_sweep.small_rows(n) <= 16 << 20, n)
        self.assertTrue(set(norm_sweep.anchor_widths()) <= set(widths))
        kinds = {s for s, _, _ in norm_sweep.problems()}
        self.assertEqual(kinds, {"large", "small"})


if __name__ == "__main__":
    unittest.main()
