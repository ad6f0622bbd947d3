// CLI entry for the cross-entropy family: `fusekit check` compares representative problems (each
// dtype, every reduction, ignored rows, label smoothing and z-loss, in place) against the CPU
// reference with the test suite's tolerance rule; on the CPU it checks the reference's gradient
// against central differences. bench runs bench/cross_entropy.
#include <fmt/format.h>

#include <cmath>
#include <optional>
#include <random>

#include "bench/cross_entropy/bench_cross_entropy.h"
#include "fusekit/cross_entropy.h"
#include "tests/harness/harness.h"
#include "tools/cli/ops.h"

namespace fusekit::cli {
namespace {

using testing::Buffer;
constexpr const char* kOp = "cross_entropy";

CheckLine line(Device device, const std::string& what, const std::vector<double>& got,
               const std::vector<double>& ref, DType dtype) {
  return compared_line(kOp, device, what, got, ref, dtype);
}

std::vector<double> random_targets(std::int64_t rows, std::int64_t cols, std::int64_t ignore_index,
                                   std::mt19937_64& rng) {
  std::vector<double> t(rows);
  for (auto& v : t) v = rng() % 8 == 0 ? static_cast<double>(ignore_index) : static_cast<double>(rng() % cols);
  return t;
}

// The CPU reference's gradient of sum(dloss * loss) (reduction none) against central differences.
std::vector<CheckLine> check_cpu() {
  auto rng = testing::make_rng(60);
  const Device cpu = Device::cpu();
  const std::int64_t rows = 4, cols = 9;
  const CrossEntropyConfig config{-100, 0.1f, 0.01f, LossReduction::none};
  Buffer x(DType::f32, cpu, {rows, cols}), t(DType::i64, cpu, {rows}), loss(DType::f32, cpu, {rows}),
      lse(DType::f32, cpu, {rows}), dloss(DType::f32, cpu, {rows}), dx(DType::f32, cpu, {rows, cols});
  x.fill_normal(rng);
  dloss.fill_normal(rng);
  t.set_values(random_targets(rows, cols, config.ignore_index, rng));
  cross_entropy_forward(x.view(), t.view(), config, loss.view(), lse.view());
  cross_entropy_backward(dloss.view(), x.view(), t.view(), lse.view(), config, dx.view());
  const std::vector<double> fd = finite_difference_gradient(
      x, loss, dloss, 1e-2, [&] { cross_entropy_forward(x.view(), t.view(), config, loss.view()); });
  const testing::ErrorStats s = testing::compare(dx.values(), fd);
  return {{kOp, "cpu", "dlogits vs finite differences", s.rel_l2, 1e-3, s.rel_l2 <= 1e-3}};
}

std::vector<CheckLine> check_gpu(Device device) {
  std::vector<CheckLine> out;
  auto rng = testing::make_rng(61);
  for (DType dt : {DType::bf16, DType::f32}) {
    for (std::int64_t cols : {32000, 50257, 1001}) {
      for (LossReduction reduction : {LossReduction::none, LossReduction::mean, LossReduction::sum}) {
        const std::int64_t rows = 96;
        const CrossEntropyConfig config{-100, 0.1f, 1e-4f, reduction};
        const std::int64_t values = reduction == LossReduction::none ? rows : 1;
        const std::vector<double> targets = random_targets(rows, cols, config.ignore_index, rng);
        Buffer x_cpu(dt, Device::cpu(), {rows, cols});
        x_cpu.fill_normal(rng, 0.0, 2.0);
        const std::vector<double> x = x_cpu.values();
        struct Outputs {
          std::vector<double> loss, lse, dlogits;
        };
        auto run = [&](Device d) {
          Buffer logits(dt, d, {rows, cols}), t(DType::i64, d, {rows}), loss(DType::f32, d, {values}),
              lse(DType::f32, d, {rows});
          logits.set_values(x);
          t.set_values(targets);
          loss.poison();
          lse.poison();
          const std::size_t ws_bytes = cross_entropy_workspace_size(rows, cols, reduction, d);
          std::optional<Buffer> ws;
          if (ws_bytes > 0) ws.emplace(DType::u8, d, std::vector<std::int64_t>{static_cast<std::int64_t>(ws_bytes)});
          // In place: dlogits overwrites the logits.
          cross_entropy_forward_backward(logits.view(), t.view(), config, loss.view(), logits.view(), lse.view(),
                                         ws ? OptionalTensor(ws->view()) : std::nullopt);
          return Outputs{loss.values(), lse.values(), logits.values()};
        };
        const Outputs ref = run(Device::cpu()), got = run(device);
        const std::string tag = fmt::format("{} {} ({}, {})", loss_reduction_name(reduction), dtype_name(dt), rows, cols);
        out.push_back(line(device, "loss " + tag, got.loss, ref.loss, DType::f32));
        out.push_back(line(device, "lse " + tag, got.lse, ref.lse, DType::f32));
        out.push_back(line(device, "dlogits " + tag, got.dlogits, ref.dlogits, dt));
      }
    }
  }
  return out;
}

}  // namespace

void add_cross_entropy_ops(std::vector<OpEntry>& ops) {
  ops.push_back({kOp,
                 "softmax cross-entropy over vocabularies up to 262144: loss (none/mean/sum, ignore_index, label "
                 "smoothing, z-loss), backward from lse, fused loss + dlogits in place; deterministic",
                 "logits f32, f16, bf16; targets i32, i64", {"cpu", "cuda"},
                 [](Device d) { return d.is_cuda() ? check_gpu(d) : check_cpu(); },
                 [](bench::Report& r, const std::string&) { bench::bench_cross_entropy(r); }});
}

}  // namespace fusekit::cli
