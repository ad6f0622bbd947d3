// CLI entry for the linear_cross_entropy family: `fusekit check` runs bf16 problems (several
// chunks, ignored rows, label smoothing, z-loss, a bias, every reduction) on the GPU against the
// float64 CPU reference, with the tests' bar: twice the error of the unfused layer rounded the same
// way (linear_forward, cross_entropy_forward_backward and linear_backward on the CPU, storing
// logits, dlogits and the gradients in bf16), floored at the dtype's tolerance. On the CPU it checks
// the reference's dh against central differences. bench runs bench/linear_cross_entropy.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <random>

#include "bench/linear_cross_entropy/bench_linear_cross_entropy.h"
#include "fusekit/cross_entropy.h"
#include "fusekit/linear.h"
#include "fusekit/linear_cross_entropy.h"
#include "tests/harness/harness.h"
#include "tools/cli/ops.h"

namespace fusekit::cli {
namespace {

using testing::Buffer;
constexpr const char* kOp = "linear_cross_entropy";

struct Outputs {
  std::vector<double> loss, dh, dw, db;
};

std::vector<double> random_targets(std::int64_t rows, std::int64_t vocab, std::int64_t ignore_index,
                                   std::mt19937_64& rng) {
  std::vector<double> t(rows);
  for (auto& v : t) v = rng() % 8 == 0 ? static_cast<double>(ignore_index) : static_cast<double>(rng() % vocab);
  return t;
}

// linear_cross_entropy on `device` with every tensor in `dtype` (dW and db too).
Outputs run_op(Device device, DType dtype, std::int64_t T, std::int64_t V, std::int64_t H,
               const CrossEntropyConfig& config, const std::vector<double>& h, const std::vector<double>& w,
               const std::vector<double>& b, const std::vector<double>& targets) {
  const std::int64_t values = config.reduction == LossReduction::none ? T : 1;
  Buffer hb(dtype, device, {T, H}), wb(dtype, device, {V, H}), bb(dtype, device, {V}), tb(DType::i64, device, {T}),
      loss(DType::f32, device, {values}), dh(dtype, device, {T, H}), dw(dtype, device, {V, H}), db(dtype, device, {V});
  hb.set_values(h);
  wb.set_values(w);
  bb.set_values(b);
  tb.set_values(targets);
  loss.poison();
  dh.poison();
  dw.poison();
  db.poison();
  const std::size_t ws_bytes = linear_cross_entropy_workspace_size(T, V, H, dtype, dtype, true, config, device);
  std::optional<Buffer> ws;
  if (ws_bytes > 0) ws.emplace(DType::u8, device, std::vector<std::int64_t>{static_cast<std::int64_t>(ws_bytes)});
  linear_cross_entropy(hb.view(), wb.view(), bb.view(), tb.view(), config, loss.view(), dh.view(), dw.view(),
                       db.view(), ws ? OptionalTensor(ws->view()) : std::nullopt);
  return {loss.values(), dh.values(), dw.values(), db.values()};
}

// The unfused layer on the CPU in `dtype`: each stored tensor rounded once.
Outputs run_unfused_cpu(DType dtype, std::int64_t T, std::int64_t V, std::int64_t H, const CrossEntropyConfig& config,
                        const std::vector<double>& h, const std::vector<double>& w, const std::vector<double>& b,
                        const std::vector<double>& targets) {
  const Device cpu = Device::cpu();
  const std::int64_t values = config.reduction == LossReduction::none ? T : 1;
  Buffer hb(dtype, cpu, {T, H}), wb(dtype, cpu, {V, H}), bb(dtype, cpu, {V}), tb(DType::i64, cpu, {T}),
      logits(dtype, cpu, {T, V}), loss(DType::f32, cpu, {values}), dh(dtype, cpu, {T, H}), dw(dtype, cpu, {V, H}),
      db(dtype, cpu, {V});
  hb.set_values(h);
  wb.set_values(w);
  bb.set_values(b);
  tb.set_values(targets);
  linear_forward(hb.view(), wb.view(), bb.view(), Activation::none, logits.view(), std::nullopt, std::nullopt);
  cross_entropy_forward_backward(logits.view(), tb.view(), config, loss.view(), logits.view());
  linear_backward(logits.view(), hb.view(), wb.view(), std::nullopt, Activation::none, dh.view(), dw.view(),
                  db.view(), std::nullopt);
  return {loss.values(), dh.values(), dw.values(), db.values()};
}

CheckLine pipeline_line(Device device, const std::string& what, const std::vector<double>& got,
                        const std::vector<double>& ref, const std::vector<double>& unfused, DType dtype) {
  const testing::ErrorStats s = testing::compare(got, ref);
  const double tol = std::max(testing::tolerance(dtype, ref), 2.0 * testing::compare(unfused, ref).rel_l2);
  return {kOp, device.is_cuda() ? "cuda" : "cpu", what, s.rel_l2, tol, s.non_finite == 0 && s.rel_l2 <= tol};
}

// The CPU reference's dh against central differences of the summed row losses.
std::vector<CheckLine> check_cpu() {
  auto rng = testing::make_rng(70);
  const Device cpu = Device::cpu();
  const std::int64_t T = 4, V = 9, H = 3;
  const CrossEntropyConfig config{-100, 0.1f, 0.01f, LossReduction::none};
  Buffer h(DType::f64, cpu, {T, H}), w(DType::f64, cpu, {V, H}), t(DType::i64, cpu, {T}),
      loss(DType::f32, cpu, {T}), ones(DType::f32, cpu, {T}), dh(DType::f64, cpu, {T, H});
  h.fill_normal(rng);
  w.fill_normal(rng);
  ones.set_values(std::vector<double>(T, 1.0));
  t.set_values(random_targets(T, V, config.ignore_index, rng));
  linear_cross_entropy(h.view(), w.view(), std::nullopt, t.view(), config, loss.view(), dh.view());
  const std::vector<double> fd = finite_difference_gradient(
      h, loss, ones, 1e-2, [&] { linear_cross_entropy(h.view(), w.view(), std::nullopt, t.view(), config, loss.view()); });
  const testing::ErrorStats s = testing::compare(dh.values(), fd);
  return {{kOp, "cpu", "dh vs finite differences", s.rel_l2, 1e-3, s.rel_l2 <= 1e-3}};
}

std::vector<CheckLine> check_gpu(Device device) {
  std::vector<CheckLine> out;
  auto rng = testing::make_rng(71);
  const DType dt = DType::bf16;
  for (std::int64_t V : {1001, 32000}) {
    for (LossReduction reduction : {LossReduction::none, LossReduction::mean, LossReduction::sum}) {
      const std::int64_t T = 96, H = 128;
      const CrossEntropyConfig config{-100, 0.1f, 1e-4f, reduction};
      const std::vector<double> targets = random_targets(T, V, config.ignore_index, rng);
      Buffer h(dt, Device::cpu(), {T, H}), w(dt, Device::cpu(), {V, H}), b(dt, Device::cpu(), {V});
      h.fill_normal(rng);
      w.fill_normal(rng, 0.0, 1.5 / std::sqrt(double(H)));
      b.fill_normal(rng, 0.0, 0.5);
      const auto hv = h.values(), wv = w.values(), bv = b.values();
      const Outputs ref = run_op(Device::cpu(), DType::f64, T, V, H, config, hv, wv, bv, targets);
      const Outputs unfused = run_unfused_cpu(dt, T, V, H, config, hv, wv, bv, targets);
      const Outputs got = run_op(device, dt, T, V, H, config, hv, wv, bv, targets);
      const std::string tag = fmt::format("{} {} ({}, {}, {})", loss_reduction_name(reduction), dtype_name(dt), T, V, H);
      out.push_back(pipeline_line(device, "loss " + tag, got.loss, ref.loss, unfused.loss, DType::f32));
      out.push_back(pipeline_line(device, "dh " + tag, got.dh, ref.dh, unfused.dh, dt));
      out.push_back(pipeline_line(device, "dweight " + tag, got.dw, ref.dw, unfused.dw, dt));
      out.push_back(pipeline_line(device, "dbias " + tag, got.db, ref.db, unfused.db, dt));
    }
  }
  return out;
}

}  // namespace

void add_linear_cross_entropy_ops(std::vector<OpEntry>& ops) {
  ops.push_back({kOp,
                 "cross-entropy of softmax(h W^T + b) without the (T, V) logits: loss and dh, dW, db in one call, "
                 "tokens in chunks (workspace: one chunk of logits); deterministic",
                 "h, W f32, f16, bf16; dW, db f32 or h's dtype; targets i32, i64", {"cpu", "cuda"},
                 [](Device d) { return d.is_cuda() ? check_gpu(d) : check_cpu(); },
                 [](bench::Report& r, const std::string&) { bench::bench_linear_cross_entropy(r); }});
}

}  // namespace fusekit::cli
