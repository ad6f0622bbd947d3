// CLI entry for the rotary-embedding family: `fusekit check` compares representative problems
// against the CPU reference with the test suite's tolerance rule; on the CPU it checks the
// reference's backward against central differences of the forward (the op is linear, so they
// agree to rounding). bench runs bench/rope.
#include <fmt/format.h>

#include <optional>
#include <vector>

#include "bench/rope/bench_rope.h"
#include "fusekit/rope.h"
#include "tests/harness/harness.h"
#include "tools/cli/ops.h"

namespace fusekit::cli {
namespace {

using testing::Buffer;
constexpr const char* kOp = "rope";

CheckLine line(const std::string& what, const std::vector<double>& got, const std::vector<double>& ref, DType dtype) {
  return compared_line(kOp, Device::cuda(0), what, got, ref, dtype);
}

// dq of the reference against central differences of sum(q_out * dy), partial rotary, given
// positions.
std::vector<CheckLine> check_cpu() {
  auto rng = testing::make_rng(60);
  const Device cpu = Device::cpu();
  std::vector<CheckLine> out;
  for (RopeStyle style : {RopeStyle::rotate_half, RopeStyle::interleaved}) {
    const std::int64_t B = 2, S = 3, H = 2, D = 12;
    RopeConfig config;
    config.style = style;
    config.rotary_dim = 8;
    config.attention_scaling = 1.5f;
    Buffer q(DType::f32, cpu, {B, S, H, D}), q_out(DType::f32, cpu, {B, S, H, D}), dy(DType::f32, cpu, {B, S, H, D}),
        dq(DType::f32, cpu, {B, S, H, D}), ids(DType::i64, cpu, {B, S});
    q.fill_normal(rng);
    dy.fill_normal(rng);
    ids.set_values({3, 700, 12, 40000, 5, 0});
    rope_backward(dy.view(), std::nullopt, ids.view(), config, dq.view(), std::nullopt);
    const std::vector<double> fd = finite_difference_gradient(
        q, q_out, dy, 1e-2, [&] { rope_forward(q.view(), std::nullopt, ids.view(), config, q_out.view(), std::nullopt); });
    const testing::ErrorStats s = testing::compare(dq.values(), fd);
    out.push_back({kOp, "cpu", fmt::format("dq vs finite differences {}", rope_style_name(style)), s.rel_l2, 1e-3,
                   s.rel_l2 <= 1e-3});
  }
  return out;
}

struct Spec {
  DType dtype;
  RopeStyle style;
  std::int64_t D, r;
  bool ids;
};

std::vector<CheckLine> check_gpu(Device device) {
  std::vector<CheckLine> out;
  auto rng = testing::make_rng(61);
  const Spec specs[] = {{DType::bf16, RopeStyle::rotate_half, 128, 0, false},
                        {DType::bf16, RopeStyle::interleaved, 128, 0, true},
                        {DType::f16, RopeStyle::rotate_half, 96, 24, true},
                        {DType::f32, RopeStyle::rotate_half, 64, 0, true},
                        {DType::f32, RopeStyle::interleaved, 80, 32, false}};
  for (const Spec& sp : specs) {
    const std::int64_t B = 2, S = 300, Hq = 8, Hk = 2;
    RopeConfig config;
    config.style = sp.style;
    config.rotary_dim = sp.r;
    config.theta = 500000.0f;
    struct Tensors {
      Buffer q, k, q_out, k_out, ids;
    };
    auto make = [&](Device d) {
      return Tensors{Buffer(sp.dtype, d, {B, S, Hq, sp.D}), Buffer(sp.dtype, d, {B, S, Hk, sp.D}),
                     Buffer(sp.dtype, d, {B, S, Hq, sp.D}), Buffer(sp.dtype, d, {B, S, Hk, sp.D}),
                     Buffer(DType::i64, d, {B, S})};
    };
    Tensors cpu = make(Device::cpu()), gpu = make(device);
    cpu.q.fill_normal(rng);
    cpu.k.fill_normal(rng);
    std::vector<double> ids(B * S);
    for (auto& v : ids) v = static_cast<double>(rng() % 131072);
    cpu.ids.set_values(ids);
    gpu.q.set_values(cpu.q.values());
    gpu.k.set_values(cpu.k.values());
    gpu.ids.set_values(ids);
    const std::string tag = fmt::format("{} {} D={} r={}{}", dtype_name(sp.dtype), rope_style_name(sp.style), sp.D,
                                        sp.r ? sp.r : sp.D, sp.ids ? " ids" : "");
    for (bool backward : {false, true}) {
      for (Tensors* t : {&cpu, &gpu}) {
        const OptionalTensor pos = sp.ids ? OptionalTensor(t->ids.view()) : std::nullopt;
        if (backward)
          rope_backward(t->q.view(), t->k.view(), pos, config, t->q_out.view(), t->k_out.view());
        else
          rope_forward(t->q.view(), t->k.view(), pos, config, t->q_out.view(), t->k_out.view());
      }
      out.push_back(line((backward ? "dq " : "q_out ") + tag, gpu.q_out.values(), cpu.q_out.values(), sp.dtype));
      out.push_back(line((backward ? "dk " : "k_out ") + tag, gpu.k_out.values(), cpu.k_out.values(), sp.dtype));
    }
  }
  return out;
}

}  // namespace

void add_rope_ops(std::vector<OpEntry>& ops) {
  ops.push_back({kOp,
                 "rotary position embeddings of q and k in one pass, fwd/bwd: rotate_half or interleaved, partial "
                 "rotary, theta / inv_freq / cos-sin tables, positions implicit or given (packed), any layout, "
                 "in place",
                 "f32, f16, bf16", {"cpu", "cuda"}, [](Device d) { return d.is_cuda() ? check_gpu(d) : check_cpu(); },
                 [](bench::Report& r, const std::string&) { bench::bench_rope(r); }});
}

}  // namespace fusekit::cli
