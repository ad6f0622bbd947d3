// The fusekit command-line tool: list ops, check them against their CPU references, benchmark.
// Exit status: 0 success; 1 a check failed or an op raised an error; 2 a usage error (unknown op,
// subcommand or flag, a missing GPU for `bench`).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <vector>

#include "core/overrides.h"
#include "fusekit/error.h"
#include "fusekit/runtime.h"
#include "tools/cli/ops.h"

using fusekit::cli::registry;

namespace {

constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;

// Whether `name` is a registered op; otherwise prints the known ones and returns false.
bool known_op(const char* command, const std::string& name) {
  std::string names;
  for (const auto& op : registry()) {
    if (op.name == name) return true;
    names += (names.empty() ? "" : ", ") + op.name;
  }
  fmt::print(stderr, "fusekit {}: unknown op '{}'; the ops are: {}\n", command, name, names);
  return false;
}

int cmd_ops() {
  fmt::print("{:<20} {:<12} {:<38} {}\n", "op", "backends", "dtypes", "summary");
  for (const auto& op : registry()) {
    std::string backends;
    for (const auto& b : op.backends) backends += (backends.empty() ? "" : ",") + b;
    fmt::print("{:<20} {:<12} {:<38} {}\n", op.name, backends, op.dtypes, op.summary);
  }
  return 0;
}

int cmd_check(const std::string& only) {
  if (!only.empty() && !known_op("check", only)) return kExitUsage;
  const bool gpu = fusekit::cuda_device_count() > 0;
  const fusekit::Device device = gpu ? fusekit::Device::cuda(0) : fusekit::Device::cpu();
  if (gpu) {
    fmt::print("backend: cuda ({})\n", fusekit::describe_cuda_device(0));
    fusekit::require_supported_gpu("check", 0);
  } else {
    fmt::print("backend: cpu (no CUDA device; GPU kernels not checked)\n");
  }
  int passed = 0, failed = 0;
  fmt::print("{:<20} {:<6} {:<34} {:>12} {:>12}  {}\n", "op", "device", "output", "rel_l2", "tolerance", "result");
  for (const auto& op : registry()) {
    if (!only.empty() && op.name != only) continue;
    for (const auto& l : op.check(device)) {
      fmt::print("{:<20} {:<6} {:<34} {:>12.3e} {:>12.3e}  {}\n", l.op, l.backend, l.what, l.error,
                 l.tolerance, l.pass ? "PASS" : "FAIL");
      (l.pass ? passed : failed)++;
    }
  }
  fmt::print("{} passed, {} failed\n", passed, failed);
  return failed == 0 && passed > 0 ? 0 : kExitFailed;
}

int cmd_overrides() {
  fmt::print("{:<36} {:<28} {}\n", "key", "values", "forces");
  for (const auto& k : fusekit::detail::override_keys()) fmt::print("{:<36} {:<28} {}\n", k.name, k.values, k.what);
  return 0;
}

int cmd_bench(const std::vector<std::string>& only, const std::string& json_path,
              const fusekit::bench::Options& options, const std::vector<std::string>& overrides) {
  fusekit::bench::set_options(options);
  for (const std::string& kv : overrides) {
    const std::size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      fmt::print(stderr, "fusekit bench: --override expects key=value, got '{}' (see `fusekit overrides`)\n", kv);
      return kExitUsage;
    }
    fusekit::detail::set_override(kv.substr(0, eq), kv.substr(eq + 1));
  }
  if (fusekit::cuda_device_count() == 0) {
    fmt::print(stderr, "fusekit bench: no CUDA device on this machine; benchmarks need a GPU (H100/H200)\n");
    return kExitUsage;
  }
  for (const std::string& name : only)
    if (!known_op("bench", name)) return kExitUsage;
  fusekit::require_supported_gpu("bench", 0);
  fusekit::bench::Report report(fusekit::bench::measure_copy_ceiling());
  for (const auto& op : registry()) {
    if (!only.empty() && std::find(only.begin(), only.end(), op.name) == only.end()) continue;
    op.bench(report, op.name);
  }
  report.set_gemm_ceiling(fusekit::bench::measure_gemm_ceiling());
  report.print();
  if (!json_path.empty()) std::ofstream(json_path) << report.json() << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fusekit: fused transformer-training kernels"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("fusekit ") + fusekit::version());
  app.footer("Exit status: 0 success, 1 a check failed or an op raised an error, 2 a usage error.");
  auto* ops = app.add_subcommand("ops", "list ops and backends");
  std::string check_op, json_path;
  std::vector<std::string> bench_op;
  auto* check = app.add_subcommand("check", "run every op against its CPU reference on the backend present");
  check->add_option("op", check_op, "only this op");
  auto* bench = app.add_subcommand("bench", "benchmark ops on the GPU (table, optional JSON)");
  bench->add_option("op", bench_op, "only these ops (one or more names)");
  bench->add_option("--json", json_path, "write results as JSON to this file (scripts/perf_report.py reads it)");
  fusekit::bench::Options bench_options;
  std::vector<std::string> bench_overrides;
  bench->add_option("--shapes", bench_options.shapes,
                    "only these shapes: RxC[,RxC] (norm, dropout, fp8), MxKxN (linear), name pieces (attention)");
  bench->add_option("--activations", bench_options.activations, "linear: only these activations (silu,gelu_tanh)");
  bench->add_flag("--diagnostics", bench_options.diagnostics, "add diagnostic rows (partial kernels, bwd-det)");
  bench->add_option("--row-pad", bench_options.row_pad, "row stride cols + P elements (multiple of 16)");
  bench->add_option("--batch", bench_options.batch, "calls per timed event pair (1..256)");
  bench->add_option("--gap-us", bench_options.gap_us, "keep the GPU idle N us before each timed run");
  bench->add_flag("--l2-flush", bench_options.l2_flush, "read 256 MB before each timed run (L2 holds clean lines)");
  bench->add_option("--override", bench_overrides, "force a launch choice: key=value (repeatable; see `fusekit overrides`)")
      ->allow_extra_args(false)  // one key=value per --override; further words are op names
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  auto* overrides = app.add_subcommand("overrides", "list the launch-choice override keys");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints the help, the version or the error
    return code == 0 ? 0 : kExitUsage;
  }
  try {
    if (*ops) return cmd_ops();
    if (*check) return cmd_check(check_op);
    if (*overrides) return cmd_overrides();
    if (*bench) return cmd_bench(bench_op, json_path, bench_options, bench_overrides);
  } catch (const fusekit::Error& e) {
    fmt::print(stderr, "{}\n", e.what());
    return kExitFailed;
  } catch (const std::exception& e) {
    fmt::print(stderr, "fusekit: {}\n", e.what());
    return kExitFailed;
  }
  return 0;
}
