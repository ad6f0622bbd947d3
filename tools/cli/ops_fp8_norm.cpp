// CLI entry for FP8 RMSNorm: `fusekit check` runs representative problems on the GPU against
// the CPU reference (quantized outputs compared code by code, the backward with the test suite's
// tolerance rule); without a GPU it checks the CPU reference against an independent float64
// RMSNorm and finite differences. bench runs bench/fp8_norm.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "bench/fp8_norm/bench_fp8_norm.h"
#include "fusekit/fp8_norm.h"
#include "tests/fp8_norm/fp8_norm_testing.h"
#include "tests/harness/harness.h"
#include "tools/cli/ops.h"

namespace fusekit::cli {
namespace {

using namespace testing::fp8;
constexpr const char* kOp = "fp8_rms_norm";

CheckLine tolerance_line(const char* backend, const std::string& what, const std::vector<double>& got,
                         const std::vector<double>& ref, DType dtype, double scale_floor = 0.0) {
  testing::ErrorStats s = testing::compare(got, ref);
  double ref_norm = 0.0;
  for (double r : ref) ref_norm += r * r;
  ref_norm = std::sqrt(ref_norm);
  if (scale_floor > 0.0 && ref_norm < 1e-3 * scale_floor) s.rel_l2 *= ref_norm / (1e-3 * scale_floor);
  const double tol = testing::tolerance(dtype, ref);
  return {kOp, backend, what, s.rel_l2, tol, s.non_finite == 0 && s.rel_l2 <= tol};
}

std::vector<CheckLine> check_cpu() {
  std::vector<CheckLine> out;
  auto rng = testing::make_rng(60);
  Case c;
  c.rows = 6;
  c.cols = 64;
  c.weight_dtype = DType::f32;
  c.eps = 1e-3f;
  Problem p(c, Device::cpu());
  fill_inputs(p, rng, FillOptions{false});
  p.forward();
  const DequantCheck d = check_dequantized(p.qy.values(), p.y_scale.values()[0], rms_norm_f64(p), c.q_dtype);
  // error: worst |qy s - y64| in units of its bound (half an fp8 ulp, plus float32 slack).
  out.push_back({kOp, "cpu", "qy*s vs float64 rms_norm", d.worst_ratio, 1.0, d.violations == 0});
  p.backward();
  const FiniteDifferences fd = finite_differences(p, 1);
  std::vector<double> dx_at;
  const auto dx = p.dx.values();
  for (auto i : fd.x_index) dx_at.push_back(dx[i]);
  out.push_back(tolerance_line("cpu", "dx vs finite differences", dx_at, fd.dx, DType::bf16));
  out.push_back(tolerance_line("cpu", "dweight vs finite differences", p.dweight.values(), fd.dw, DType::f32));
  return out;
}

std::vector<CheckLine> check_gpu(Device device) {
  std::vector<CheckLine> out;
  Case cases[3];
  cases[0].rows = 1024;  // the benchmark configuration (vector kernels)
  cases[0].cols = 4096;
  cases[1].rows = 333;   // e5m2 in, e4m3 out, f32 scales and weight, groups of 32
  cases[1].cols = 1056;
  cases[1].group = 32;
  cases[1].x_dtype = DType::f8e5m2;
  cases[1].scale_dtype = DType::f32;
  cases[1].weight_dtype = DType::f32;
  cases[2].rows = 200;   // groups of 8: the generic kernels; e5m2 out
  cases[2].cols = 520;
  cases[2].group = 8;
  cases[2].q_dtype = DType::f8e5m2;
  std::uint64_t salt = 61;
  for (const Case& c : cases) {
    const std::string tag = fmt::format("({}, {}) G{} {}", c.rows, c.cols, c.group,
                                        c.x_dtype == DType::f8e4m3 ? "e4m3" : "e5m2");
    auto rng = testing::make_rng(salt++);
    Problem cpu(c, Device::cpu()), gpu(c, device);
    fill_inputs(cpu, rng);
    copy_inputs(cpu, gpu);
    const ForwardComparison f = compare_forward(cpu, gpu);
    const double fraction = f.qy.count ? double(f.qy.mismatches) / double(f.qy.count) : 0.0;
    out.push_back({kOp, "cuda", "qy/qy_t 1-ulp fraction " + tag, fraction, 1e-5,
                   f.qy.ok(1) && f.qy_t.ok(1) && f.transpose_ok && fraction <= 1e-5 &&
                       f.qy_diff_in_exact_rows == 0});
    out.push_back({kOp, "cuda", "rstd worst ulps " + tag, double(f.rstd.worst_ulps), 4.0, f.rstd.ok(4)});
    out.push_back({kOp, "cuda", "y_scale worst ulps " + tag, double(f.scale.worst_ulps), 4.0,
                   f.scale.ok(4) && (f.rstd.mismatches > 0 || f.scale.mismatches == 0)});
    out.push_back({kOp, "cuda", "qy*s vs float64 " + tag, f.dequant.worst_ratio, 1.0, f.dequant.violations == 0});
    gpu.rstd.set_values(cpu.rstd.values());
    cpu.backward();
    gpu.backward();
    out.push_back(tolerance_line("cuda", "dx " + tag, gpu.dx.values(), cpu.dx.values(), DType::bf16, dx_term_norm(cpu)));
    const auto dw_ref = cpu.dweight.values();
    const testing::ErrorStats s = testing::compare(gpu.dweight.values(), dw_ref);
    const double tol = 2.0 * std::max({testing::rounding_error(c.weight_dtype, dw_ref),
                                       f32_column_sum_error(dweight_terms(cpu), c.rows, c.cols, dw_ref),
                                       testing::accumulation_floor(c.weight_dtype)});
    out.push_back({kOp, "cuda", "dweight " + tag, s.rel_l2, tol, s.non_finite == 0 && s.rel_l2 <= tol});
  }
  return out;
}

}  // namespace

void add_fp8_norm_ops(std::vector<OpEntry>& ops) {
  ops.push_back({kOp,
                 "FP8 RMSNorm: group-scaled fp8 in, per-tensor-scaled fp8 out + transpose, rstd; backward dx/dweight",
                 "x,qy f8e4m3/f8e5m2; scales, weight bf16/f32; dy, dx bf16",
                 {"cpu", "cuda"},
                 [](Device d) { return d.is_cuda() ? check_gpu(d) : check_cpu(); },
                 [](bench::Report& r, const std::string&) { bench::bench_fp8_norm(r); }});
}

}  // namespace fusekit::cli
