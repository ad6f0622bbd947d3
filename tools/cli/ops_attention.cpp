// CLI entry for the attention family. `fusekit check attention`: on a GPU, the CUDA kernels
// against the float64 CPU reference on three representative problems (GQA with a bias reduced
// over the batch and dropout; variable lengths with an empty sequence and a window; MQA at head
// dim 256), every output in both backward modes, with the GPU test suite's rule (twice the larger
// of the rounding and the FlashAttention-style baselines, see tests/attention/attention_testing.h);
// without a GPU, the reference's gradients against central differences of L = sum(out * dout).
// `fusekit bench attention` runs bench/attention.
#include <cmath>
#include <cstdio>
#include <fmt/format.h>
#include <optional>

#include "bench/attention/bench_attention.h"
#include "fusekit/attention.h"
#include "tests/attention/attention_testing.h"
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
    std::vector<double> fd(static_cast<std::size_t>(x.numel()));
    constexpr double step = 1e-5;
    for (std::size_t i = 0; i < fd.size(); ++i)
      fd[i] = testing::central_difference(x, static_cast<std::int64_t>(i), step, loss);
    const testing::ErrorStats s = testing::compare(bufs.second->values(), fd);
    // The backward recomputes P from the float32 lse: ~1e-7 relative error is expected.
    constexpr double tol = 2e-6;
    lines.push_back({kOp, "cpu", fmt::format("{} vs finite differences (f64)", name), s.rel_l2, tol,
                     s.non_finite == 0 && s.rel_l2 <= tol});
  }
  return lines;
}

CheckLine line(const testing::attn::Comparison& c, const std::string& what) {
  return {kOp, "cuda", what, c.stats.rel_l2, c.tolerance, c.pass};
}

std::vector<CheckLine> check_gpu() {
  using testing::attn::Spec;
  std::vector<Spec> specs;
  {
    Spec s;  // GQA 4:1, bias (1, H, S, S) reduced over the batch, dropout, bottom-right causal
    s.dtype = DType::bf16, s.B = 2, s.Sq = 200, s.Sk = 230, s.Hq = 8, s.Hkv = 2, s.D = 128, s.Dv = 128;
    s.cfg.mask = AttentionMask::causal_bottom_right;
    s.cfg.dropout_p = 0.1f, s.cfg.seed = 1234, s.cfg.offset = 7;
    s.bias = true, s.bias_dtype = DType::f32, s.bias_full[0] = false;
    specs.push_back(s);
  }
  {
    Spec s;  // variable lengths (one empty), sliding window, full padded bias written directly
    s.dtype = DType::f16, s.Hq = 4, s.Hkv = 4, s.D = 64, s.Dv = 64;
    s.seqlens_q = {130, 0, 77}, s.seqlens_k = {100, 33, 250};
    s.cfg.window_left = 64, s.cfg.window_right = 0;
    s.bias = true, s.bias_dtype = DType::bf16;
    specs.push_back(s);
  }
  {
    Spec s;  // MQA at head dim 256, D != Dv
    s.dtype = DType::bf16, s.B = 1, s.Sq = 96, s.Sk = 96, s.Hq = 4, s.Hkv = 1, s.D = 256, s.Dv = 192;
    s.cfg.mask = AttentionMask::causal_top_left;
    specs.push_back(s);
  }
  std::vector<CheckLine> out;
  auto rng = testing::make_rng(51);
  for (const Spec& s : specs) {
    const std::string lengths = s.varlen() ? std::string("varlen") : fmt::format("{}x{}", s.Sq, s.Sk);
    const std::string tag = fmt::format("{} {} H{}/{} D{}/{}{}", dtype_name(s.dtype), lengths, s.Hq, s.Hkv, s.D, s.Dv,
                                        s.bias ? " bias" : "");
    testing::attn::Pair p(s);
    p.fill(rng);
    p.forward();
    out.push_back(line(testing::attn::compare_to_reference(p.gpu.out->values(), p.cpu.out->values(), s.dtype,
                                                           testing::attn::typical_forward(p.cpu, s.dtype), "out"),
                       "out " + tag));
    out.push_back(line(testing::attn::compare_lse(p.gpu, p.cpu, "lse"), "lse " + tag));
    p.share_saved_tensors();
    p.cpu.backward(true, true, true, s.bias, true);
    const DType db_dtype = testing::attn::dbias_bar_dtype(s);
    const auto t = testing::attn::typical_backward(p.cpu, s.dtype, db_dtype);
    for (bool deterministic : {true, false}) {
      p.gpu.poison_gradients();
      p.gpu.backward(true, true, true, s.bias, deterministic);
      const std::string mode = deterministic ? " det" : "";
      using testing::attn::compare_to_reference;
      out.push_back(line(compare_to_reference(p.gpu.dq->values(), p.cpu.dq->values(), s.dtype, t.dq, "dq", t.dq_terms),
                         "dq " + tag + mode));
      out.push_back(line(compare_to_reference(p.gpu.dk->values(), p.cpu.dk->values(), s.dtype, t.dk, "dk", t.dk_terms),
                         "dk " + tag + mode));
      out.push_back(
          line(compare_to_reference(p.gpu.dv->values(), p.cpu.dv->values(), s.dtype, t.dv, "dv"), "dv " + tag + mode));
      if (s.bias)
        out.push_back(line(compare_to_reference(p.gpu.dbias->values(), p.cpu.dbias->values(), db_dtype, t.dbias,
                                                "dbias", t.dbias_terms),
                           "dbias " + tag + mode));
    }
  }
  return out;
}

}  // namespace

void add_attention_ops(std::vector<OpEntry>& ops) {
  ops.push_back({kOp,
                 "softmax(q k^T * scale + bias) v fwd/bwd, flash-style (S x S never stored): causal/window masks, "
                 "bias + dbias, Philox dropout, varlen, GQA; deterministic or atomic dq",
                 "f16, bf16 (CUDA); f64, f32, f16, bf16 (CPU)", {"cpu", "cuda"},
                 [](Device d) { return d.is_cuda() ? check_gpu() : check_cpu_reference(); },
                 [](bench::Report& r, const std::string&) { bench::bench_attention(r); }});
}

}  // namespace fusekit::cli
