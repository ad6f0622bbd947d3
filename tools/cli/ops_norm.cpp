// CLI entries for the normalization family: `fusekit check` compares a few representative
// problems against the CPU reference with the test suite's tolerance rule; bench runs bench/norm.
#include <cmath>
#include <fmt/format.h>
#include <optional>

#include "bench/norm/bench_norm.h"
#include "fusekit/norm.h"
#include "tests/harness/harness.h"
#include "tools/cli/ops.h"

namespace fusekit::cli {
namespace {

using testing::Buffer;

CheckLine line(const std::string& op, Device device, const std::string& what,
               const std::vector<double>& got, const std::vector<double>& ref, DType dtype) {
  return compared_line(op, device, what, got, ref, dtype);
}

// Norm on `device` vs the CPU reference (bf16 and f32, LayerNorm and RMSNorm, plain or the
// residual variant). On the CPU the reference's dx is checked against central differences of
// sum(y * dy) instead (for the residual variant with respect to x and to the residual: the one dx
// is the gradient of both).
std::vector<CheckLine> check_norm(Device device, bool rms, bool residual) {
  const std::string op = std::string(rms ? "rms_norm" : "layer_norm") + (residual ? "_residual" : "");
  std::vector<CheckLine> out;
  auto rng = testing::make_rng((rms ? 31 : 30) + (residual ? 2 : 0));
  if (!device.is_cuda()) {
    const std::int64_t rows = 4, cols = 24;
    Buffer x(DType::f32, device, {rows, cols}), y(DType::f32, device, {rows, cols}),
        dy(DType::f32, device, {rows, cols}), dx(DType::f32, device, {rows, cols}),
        mean(DType::f32, device, {rows}), rstd(DType::f32, device, {rows}),
        res(DType::f32, device, {rows, cols}), sum(DType::f32, device, {rows, cols});
    x.fill_normal(rng, 0.2, 1.5);
    res.fill_normal(rng, 0.0, 0.5);
    dy.fill_normal(rng);
    auto fwd = [&] {
      if (residual && rms) rms_norm_residual_forward(x.view(), res.view(), std::nullopt, 1e-3f, y.view(), sum.view(), rstd.view());
      else if (residual) layer_norm_residual_forward(x.view(), res.view(), std::nullopt, std::nullopt, 1e-3f, y.view(), sum.view(), mean.view(), rstd.view());
      else if (rms) rms_norm_forward(x.view(), std::nullopt, 1e-3f, y.view(), rstd.view());
      else layer_norm_forward(x.view(), std::nullopt, std::nullopt, 1e-3f, y.view(), mean.view(), rstd.view());
    };
    fwd();
    if (residual && rms) rms_norm_residual_backward(dy.view(), sum.view(), std::nullopt, std::nullopt, rstd.view(), dx.view(), std::nullopt, std::nullopt);
    else if (residual) layer_norm_residual_backward(dy.view(), sum.view(), std::nullopt, std::nullopt, mean.view(), rstd.view(), dx.view(), std::nullopt, std::nullopt, std::nullopt);
    else if (rms) rms_norm_backward(dy.view(), x.view(), std::nullopt, rstd.view(), dx.view(), std::nullopt, std::nullopt);
    else layer_norm_backward(dy.view(), x.view(), std::nullopt, mean.view(), rstd.view(), dx.view(), std::nullopt, std::nullopt, std::nullopt);
    for (Buffer* param : residual ? std::vector<Buffer*>{&x, &res} : std::vector<Buffer*>{&x}) {
      const std::vector<double> fd = finite_difference_gradient(*param, y, dy, 1e-2, fwd);
      const testing::ErrorStats s = testing::compare(dx.values(), fd);
      const std::string what = param == &x ? "dx vs finite differences" : "dx vs finite differences in residual";
      out.push_back({op, "cpu", what, s.rel_l2, 1e-3, s.rel_l2 <= 1e-3});
    }
    return out;
  }
  for (DType dt : {DType::bf16, DType::f32}) {
    for (std::int64_t cols : {1024, 4096, 1000}) {
      const std::int64_t rows = 512;
      std::vector<Buffer> cpu, gpu;
      for (Device d : {Device::cpu(), device}) {
        auto& v = d.is_cuda() ? gpu : cpu;
        v.emplace_back(dt, d, std::vector<std::int64_t>{rows, cols});  // 0 x
        v.emplace_back(dt, d, std::vector<std::int64_t>{rows, cols});  // 1 y
        v.emplace_back(dt, d, std::vector<std::int64_t>{rows, cols});  // 2 dy
        v.emplace_back(dt, d, std::vector<std::int64_t>{rows, cols});  // 3 dx
        v.emplace_back(dt, d, std::vector<std::int64_t>{cols});        // 4 w
        v.emplace_back(dt, d, std::vector<std::int64_t>{cols});        // 5 b
        v.emplace_back(dt, d, std::vector<std::int64_t>{cols});        // 6 dw
        v.emplace_back(DType::f32, d, std::vector<std::int64_t>{rows});  // 7 mean
        v.emplace_back(DType::f32, d, std::vector<std::int64_t>{rows});  // 8 rstd
        const std::size_t ws = norm_backward_workspace_size(rows, cols, dt, d);
        v.emplace_back(DType::u8, d, std::vector<std::int64_t>{std::max<std::int64_t>(1, ws)});  // 9
        v.emplace_back(dt, d, std::vector<std::int64_t>{rows, cols});  // 10 residual
        v.emplace_back(dt, d, std::vector<std::int64_t>{rows, cols});  // 11 sum
        v.emplace_back(dt, d, std::vector<std::int64_t>{rows, cols});  // 12 dsum
      }
      cpu[0].fill_normal(rng, 0.3, 2.0);
      cpu[2].fill_normal(rng);
      cpu[4].fill_normal(rng, 1.0, 0.5);
      cpu[5].fill_normal(rng);
      cpu[10].fill_normal(rng, 0.0, 0.5);
      cpu[12].fill_normal(rng);
      for (int i : {0, 2, 4, 5, 10, 12}) gpu[i].set_values(cpu[i].values());
      for (auto* v : {&cpu, &gpu}) {
        auto& b = *v;
        const bool on_gpu = v == &gpu;
        const OptionalTensor ws = on_gpu ? OptionalTensor(b[9].view()) : std::nullopt;
        if (residual && rms) {
          rms_norm_residual_forward(b[0].view(), b[10].view(), b[4].view(), 1e-5f, b[1].view(), b[11].view(), b[8].view());
          rms_norm_residual_backward(b[2].view(), b[11].view(), b[12].view(), b[4].view(), b[8].view(), b[3].view(), b[6].view(), ws);
        } else if (residual) {
          layer_norm_residual_forward(b[0].view(), b[10].view(), b[4].view(), b[5].view(), 1e-5f, b[1].view(), b[11].view(), b[7].view(), b[8].view());
          layer_norm_residual_backward(b[2].view(), b[11].view(), b[12].view(), b[4].view(), b[7].view(), b[8].view(), b[3].view(), b[6].view(), std::nullopt, ws);
        } else if (rms) {
          rms_norm_forward(b[0].view(), b[4].view(), 1e-5f, b[1].view(), b[8].view());
          rms_norm_backward(b[2].view(), b[0].view(), b[4].view(), b[8].view(), b[3].view(), b[6].view(), ws);
        } else {
          layer_norm_forward(b[0].view(), b[4].view(), b[5].view(), 1e-5f, b[1].view(), b[7].view(), b[8].view());
          layer_norm_backward(b[2].view(), b[0].view(), b[4].view(), b[7].view(), b[8].view(), b[3].view(), b[6].view(), std::nullopt, ws);
        }
      }
      const std::string tag = fmt::format("{} ({}, {})", dtype_name(dt), rows, cols);
      out.push_back(line(op, device, "y " + tag, gpu[1].values(), cpu[1].values(), dt));
      if (residual) out.push_back(line(op, device, "sum " + tag, gpu[11].values(), cpu[11].values(), dt));
      out.push_back(line(op, device, "dx " + tag, gpu[3].values(), cpu[3].values(), dt));
      out.push_back(line(op, device, "dweight " + tag, gpu[6].values(), cpu[6].values(), dt));
    }
  }
  return out;
}

}  // namespace

void add_norm_ops(std::vector<OpEntry>& ops) {
  ops.insert(ops.end(), {
      {"layer_norm", "LayerNorm forward/backward (from x or from y), dweight/dbias reduced deterministically",
       "f32, f16, bf16 (weight: same or f32)", {"cpu", "cuda"},
       [](Device d) { return check_norm(d, false, false); },
       [](bench::Report& r, const std::string&) { bench::bench_norm(r, "layer_norm"); }},
      {"rms_norm", "RMSNorm forward/backward (from x or from y), dweight reduced deterministically",
       "f32, f16, bf16 (weight: same or f32)", {"cpu", "cuda"},
       [](Device d) { return check_norm(d, true, false); },
       [](bench::Report& r, const std::string&) { bench::bench_norm(r, "rms_norm"); }},
      {"layer_norm_residual",
       "LayerNorm of x + residual (the sum written), backward with the skip path's gradient added to dx",
       "f32, f16, bf16 (weight: same or f32)", {"cpu", "cuda"},
       [](Device d) { return check_norm(d, false, true); },
       [](bench::Report& r, const std::string&) { bench::bench_norm(r, "layer_norm_residual"); }},
      {"rms_norm_residual",
       "RMSNorm of x + residual (the sum written), backward with the skip path's gradient added to dx",
       "f32, f16, bf16 (weight: same or f32)", {"cpu", "cuda"},
       [](Device d) { return check_norm(d, true, true); },
       [](bench::Report& r, const std::string&) { bench::bench_norm(r, "rms_norm_residual"); }},
  });
}

}  // namespace fusekit::cli
