// CLI entry for the attention family. Only the float64 CPU reference exists so far: `fusekit
// check` checks its gradients (dq, dk, dv, dbias) against central differences of
// L = sum(out * dout) on one small case with every feature on (GQA, bottom-right causal mask,
// window, broadcast bias, dropout), whatever device is present; `fusekit bench attention` says
// that there is no CUDA kernel to time yet.
#include <cmath>
#include <cstdio>
#include <fmt/format.h>
#include <optional>

#include "fusekit/attention.h"
#include "tests/harness/harness.h"
#include "tools/cli/ops.h"

namespace fusekit::cli {
namespace {

using testing::Buffer;
constexpr const char* kOp = "attention";

std::vector<CheckLine> check_cpu_reference() {
  auto rng = testing::make_rng(50);
  const Device cpu = Device::cpu();
  const DType dt = DType::f64;
  const std::int64_t B = 2, Sq = 5, Sk = 7, Hq = 4, Hkv = 2, D = 4, Dv = 6, Skp = 8;  // Skp: 16-byte rows
  AttentionConfig cfg;
  cfg.mask = AttentionMask::causal_bottom_right;
  cfg.window_left = 3;
  cfg.dropout_p = 0.2f;
  cfg.seed = 2024;
  cfg.offset = 11;
  Buffer q(dt, cpu, {B, Sq, Hq, D}), k(dt, cpu, {B, Sk, Hkv, D}), v(dt, cpu, {B, Sk, Hkv, Dv}),
      out(dt, cpu, {B, Sq, Hq, Dv}), dout(dt, cpu, {B, Sq, Hq, Dv}), dq(dt, cpu, {B, Sq, Hq, D}),
      dk(dt, cpu, {B, Sk, Hkv, D}), dv(dt, cpu, {B, Sk, Hkv, Dv}), lse(DType::f32, cpu, {B, Hq, Sq}),
      bias(dt, cpu, {1, Hq, Sq, Sk}, {Hq * Sq * Skp, Sq * Skp, Skp, 1}),
      dbias(dt, cpu, {1, Hq, Sq, Sk}, {Hq * Sq * Skp, Sq * Skp, Skp, 1});
  for (Buffer* b : {&q, &k, &v, &dout, &bias}) b->fill_normal(rng);
  auto loss = [&] {
    attention_forward(q.view(), k.view(), v.view(), bias.view(), cfg, out.view(), lse.view());
    const auto o = out.values(), g = dout.values();
    double l = 0;
    for (std::size_t i = 0; i < o.size(); ++i) l += o[i] * g[i];
    return l;
  };
  loss();
  attention_backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(), bias.view(), cfg,
                     dq.view(), dk.view(), dv.view(), dbias.view(), std::nullopt, true);
  std::vector<CheckLine> lines;
  const std::pair<const char*, std::pair<Buffer*, Buffer*>> grads[] = {
      {"dq", {&q, &dq}}, {"dk", {&k, &dk}}, {"dv", {&v, &dv}}, {"dbias", {&bias, &dbias}}};
  for (const auto& [name, bufs] : grads) {
    Buffer& x = *bufs.first;
    auto values = x.values();
    std::vector<double> fd(values.size());
    constexpr double step = 1e-5;
    for (std::size_t i = 0; i < values.size(); ++i) {
      const double keep = values[i];
      values[i] = keep + step;
      x.set_values(values);
      const double up = loss();
      values[i] = keep - step;
      x.set_values(values);
      const double down = loss();
      values[i] = keep;
      x.set_values(values);
      fd[i] = (up - down) / (2 * step);
    }
    const testing::ErrorStats s = testing::compare(bufs.second->values(), fd);
    // The backward recomputes P from the float32 lse: ~1e-7 relative error is expected.
    constexpr double tol = 2e-6;
    lines.push_back({kOp, "cpu", fmt::format("{} vs finite differences (f64)", name), s.rel_l2, tol,
                     s.non_finite == 0 && s.rel_l2 <= tol});
  }
  return lines;
}

}  // namespace

void add_attention_ops(std::vector<OpEntry>& ops) {
  ops.push_back({kOp,
                 "softmax(q k^T * scale + bias) v fwd/bwd: causal/window masks, bias + dbias, Philox dropout, "
                 "varlen, GQA. CPU float64 reference only; CUDA kernels not written yet",
                 "f64, f32, f16, bf16 (CPU)", {"cpu"},
                 // No CUDA kernel to compare: whatever the device, the CPU reference is what is checked.
                 [](Device) { return check_cpu_reference(); },
                 [](bench::Report&, const std::string&) {
                   std::fprintf(stderr,
                                "fusekit bench attention: no CUDA attention kernel exists yet; nothing is "
                                "timed (the CPU reference is not a benchmark)\n");
                 }});
}

}  // namespace fusekit::cli
