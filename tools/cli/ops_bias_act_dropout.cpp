// CLI entry for the bias + activation + dropout family: `fusekit check` compares representative
// problems against the CPU reference with the test suite's tolerance rule (and the mask bit for
// bit); on the CPU it checks the reference's dx against central differences. bench runs
// bench/bias_act_dropout.
#include <cmath>
#include <fmt/format.h>
#include <optional>

#include "bench/bias_act_dropout/bench_bias_act_dropout.h"
#include "fusekit/bias_act_dropout.h"
#include "tests/harness/harness.h"
#include "tools/cli/ops.h"

namespace fusekit::cli {
namespace {

using testing::Buffer;
constexpr const char* kOp = "bias_act_dropout";

CheckLine line(Device device, const std::string& what, const std::vector<double>& got,
               const std::vector<double>& ref, DType dtype) {
  return compared_line(kOp, device, what, got, ref, dtype);
}

// The CPU reference's dx against central differences of sum(y * dy), under a fixed mask.
std::vector<CheckLine> check_cpu() {
  auto rng = testing::make_rng(40);
  const Device cpu = Device::cpu();
  const std::int64_t rows = 4, cols = 24;
  const BiasActDropoutConfig config{Activation::gelu_tanh, 0.0f, 0.25f, 12345, 6};
  Buffer x(DType::f32, cpu, {rows, cols}), b(DType::f32, cpu, {cols}), y(DType::f32, cpu, {rows, cols}),
      dy(DType::f32, cpu, {rows, cols}), dx(DType::f32, cpu, {rows, cols});
  x.fill_normal(rng, 0.0, 1.5);
  b.fill_normal(rng, 0.0, 0.5);
  dy.fill_normal(rng);
  bias_act_dropout_backward(dy.view(), x.view(), b.view(), config, dx.view(), std::nullopt);
  const std::vector<double> fd = finite_difference_gradient(
      x, y, dy, 1e-2, [&] { bias_act_dropout_forward(x.view(), b.view(), config, y.view()); });
  const testing::ErrorStats s = testing::compare(dx.values(), fd);
  return {{kOp, "cpu", "dx vs finite differences", s.rel_l2, 1e-3, s.rel_l2 <= 1e-3}};
}

std::vector<CheckLine> check_gpu(Device device) {
  std::vector<CheckLine> out;
  auto rng = testing::make_rng(41);
  for (DType dt : {DType::bf16, DType::f32}) {
    for (std::int64_t cols : {1024, 4096, 1000}) {
      for (Activation act : {Activation::gelu_tanh, Activation::relu}) {
        const std::int64_t rows = 512;
        const BiasActDropoutConfig config{act, 0.0f, 0.1f, rng(), rng() % 1000};
        std::vector<Buffer> cpu, gpu;
        for (Device d : {Device::cpu(), device}) {
          auto& v = d.is_cuda() ? gpu : cpu;
          v.emplace_back(dt, d, std::vector<std::int64_t>{rows, cols});  // 0 x
          v.emplace_back(dt, d, std::vector<std::int64_t>{cols});        // 1 bias
          v.emplace_back(dt, d, std::vector<std::int64_t>{rows, cols});  // 2 y
          v.emplace_back(dt, d, std::vector<std::int64_t>{rows, cols});  // 3 dy
          v.emplace_back(dt, d, std::vector<std::int64_t>{rows, cols});  // 4 dx
          v.emplace_back(dt, d, std::vector<std::int64_t>{cols});        // 5 dbias
          const std::size_t ws = bias_act_dropout_backward_workspace_size(rows, cols, dt, d);
          v.emplace_back(DType::u8, d, std::vector<std::int64_t>{std::max<std::int64_t>(1, ws)});  // 6
        }
        cpu[0].fill_normal(rng, 0.0, 1.5);
        cpu[1].fill_normal(rng, 0.0, 0.5);
        cpu[3].fill_normal(rng);
        for (int i : {0, 1, 3}) gpu[i].set_values(cpu[i].values());
        for (auto* v : {&cpu, &gpu}) {
          auto& b = *v;
          const OptionalTensor ws = v == &gpu ? OptionalTensor(b[6].view()) : std::nullopt;
          bias_act_dropout_forward(b[0].view(), b[1].view(), config, b[2].view());
          bias_act_dropout_backward(b[3].view(), b[0].view(), b[1].view(), config, b[4].view(), b[5].view(), ws);
        }
        const std::string tag = fmt::format("{} {} ({}, {})", activation_name(act), dtype_name(dt), rows, cols);
        const auto y_gpu = gpu[2].values(), y_cpu = cpu[2].values();
        out.push_back(line(device, "y " + tag, y_gpu, y_cpu, dt));
        out.push_back(line(device, "dx " + tag, gpu[4].values(), cpu[4].values(), dt));
        out.push_back(line(device, "dbias " + tag, gpu[5].values(), cpu[5].values(), dt));
        // The mask itself: every element dropout_keeps() drops is exactly 0 on the GPU, and every
        // kept one whose value is clearly non-zero is non-zero (relu's zeros, or activations that
        // underflow, say nothing about the mask).
        const std::uint32_t t = dropout_keep_threshold(config.p);
        std::int64_t mismatches = 0;
        for (std::int64_t i = 0; i < rows * cols; ++i) {
          if (!dropout_keeps(config.seed, config.offset, i, t)) mismatches += y_gpu[i] != 0.0;
          else if (std::abs(y_cpu[i]) > 1e-3) mismatches += y_gpu[i] == 0.0;
        }
        out.push_back({kOp, "cuda", "mask mismatches " + tag, static_cast<double>(mismatches), 0.0, mismatches == 0});
      }
    }
  }
  return out;
}

}  // namespace

void add_bias_act_dropout_ops(std::vector<OpEntry>& ops) {
  ops.push_back({kOp,
                 "y = dropout(act(x + b)) fwd/bwd in one pass each; Philox mask regenerated, never stored; "
                 "dbias reduced deterministically",
                 "f32, f16, bf16 (bias: same or f32)", {"cpu", "cuda"},
                 [](Device d) { return d.is_cuda() ? check_gpu(d) : check_cpu(); },
                 [](bench::Report& r, const std::string&) { bench::bench_dropout(r); }});
}

}  // namespace fusekit::cli
