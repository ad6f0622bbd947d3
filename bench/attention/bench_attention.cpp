// Attention benchmarks, the FlashAttention benchmark's shapes: bf16, B * S = 16384 tokens, model
// width 2048 (H = 16, D = 128 and H = 32, D = 64), S in {1024, 4096, 16384}, causal (bottom-right
// = top-left here, Sq = Sk) and not; plus the bias-gradient case (B=8, S=2048, H=16,
// D=128, a dense bf16 (B, H, S, S) bias and its gradient) and dropout 0.1 at (B=4, S=4096).
// flops: forward 4 * B * H * S * S * D (two matrix products), halved when causal; backward 2.5 x
// the forward (five matrix products against two). bytes: q, k, v, out read or written once
// (forward), plus dout, dq, dk, dv (backward); lse and the workspace are not counted.
// `fusekit bench --shapes S=4096,D=128` (comma-separated pieces that must all occur in the shape
// string, e.g. "causal") narrows the rows; --diagnostics adds the deterministic
// backward ("bwd-det").
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "bench/attention/bench_attention.h"
#include "bench/harness/bench.h"
#include "fusekit/attention.h"

namespace fusekit::bench {

namespace {

struct Set {
  DeviceBuffer q, k, v, out, dout, dq, dk, dv, lse;
};

// Every comma-separated piece of the filter occurs in `shape` (no filter: everything runs).
bool selected(const char* filter, const std::string& shape) {
  if (filter == nullptr) return true;
  std::stringstream pieces(filter);
  std::string piece;
  while (std::getline(pieces, piece, ','))
    if (!piece.empty() && shape.find(piece) == std::string::npos) return false;
  return true;
}

}  // namespace

namespace {

struct Case {
  std::int64_t B, S, H, D;
  bool causal = false;
  bool bias = false;  // a dense (B, H, S, S) bf16 bias, and its gradient in the backward
  float dropout = 0.0f;
};

std::string case_name(const Case& c) {
  std::string name = fmt::format("(B={}, S={}, H={}, D={})", c.B, c.S, c.H, c.D);
  if (c.causal) name += " causal";
  if (c.bias) name += " bias+dbias";
  if (c.dropout > 0.0f) name += fmt::format(" dropout={}", c.dropout);
  return name;
}

void run_case(Report& report, const Case& c) {
  const Device gpu = Device::cuda(0);
  const DType bf16 = DType::bf16;
  const std::int64_t B = c.B, S = c.S, H = c.H, D = c.D;
  const std::string shape = case_name(c);
  const std::size_t act_bytes = static_cast<std::size_t>(B * S * H * D) * 2;
  const std::size_t lse_bytes = static_cast<std::size_t>(B * H * S) * 4;
  const std::size_t bias_bytes = c.bias ? static_cast<std::size_t>(B * H * S * S) * 2 : 0;
  const int rotations = rotations_for(4 * act_bytes + bias_bytes);
  std::vector<Set> sets(rotations);
  for (int r = 0; r < rotations; ++r) {
    Set& s = sets[r];
    s = {DeviceBuffer(act_bytes), DeviceBuffer(act_bytes), DeviceBuffer(act_bytes), DeviceBuffer(act_bytes),
         DeviceBuffer(act_bytes), DeviceBuffer(act_bytes), DeviceBuffer(act_bytes), DeviceBuffer(act_bytes),
         DeviceBuffer(lse_bytes)};
    s.q.fill_random_bf16(500 + r);
    s.k.fill_random_bf16(600 + r);
    s.v.fill_random_bf16(700 + r);
    s.dout.fill_random_bf16(800 + r);
  }
  // One bias and one dbias shared by the rotations: at (8, 16, 2048, 2048) each is 1 GiB, far
  // past L2 on its own.
  DeviceBuffer bias_buf(c.bias ? bias_bytes : 16), dbias_buf(c.bias ? bias_bytes : 16);
  if (c.bias) bias_buf.fill_random_bf16(900);
  AttentionConfig cfg;
  cfg.mask = c.causal ? AttentionMask::causal_bottom_right : AttentionMask::none;
  cfg.dropout_p = c.dropout;
  cfg.seed = 1234;
  const AttentionShape ashape{B, S, S, H, H, D, D, bf16, c.bias};
  const std::size_t ws_bytes = std::max(attention_backward_workspace_size(ashape, cfg, false, gpu),
                                        attention_backward_workspace_size(ashape, cfg, true, gpu));
  DeviceBuffer ws(std::max<std::size_t>(ws_bytes, 16));
  const TensorView workspace(ws.get(), DType::u8, gpu, {static_cast<std::int64_t>(ws_bytes)});
  auto t4 = [&](const DeviceBuffer& b) { return TensorView(b.get(), bf16, gpu, {B, S, H, D}); };
  auto lse = [&](const DeviceBuffer& b) { return TensorView(b.get(), DType::f32, gpu, {B, H, S}); };
  OptionalTensor bias, dbias;
  if (c.bias) {
    bias = TensorView(bias_buf.get(), bf16, gpu, {B, H, S, S});
    dbias = TensorView(dbias_buf.get(), bf16, gpu, {B, H, S, S});
  }
  auto forward = [&](int r) {
    Set& s = sets[r];
    attention_forward(t4(s.q), t4(s.k), t4(s.v), bias, cfg, t4(s.out), lse(s.lse));
  };
  auto backward = [&](int r, bool deterministic) {
    Set& s = sets[r];
    attention_backward(t4(s.dout), t4(s.q), t4(s.k), t4(s.v), t4(s.out), lse(s.lse), bias, cfg, t4(s.dq),
                       t4(s.dk), t4(s.dv), dbias, std::nullopt, deterministic, workspace);
  };
  for (int r = 0; r < rotations; ++r) forward(r);  // saved out and lse for the backward
  const double fwd_flops = 4.0 * B * H * S * S * D * (c.causal ? 0.5 : 1.0);
  const Timing tf = time_kernel(forward, rotations);
  report.add({"attention", "fwd", shape, "fusekit", tf.median_us, 4.0 * act_bytes + bias_bytes, fwd_flops});
  const Timing tb = time_kernel([&](int r) { backward(r, false); }, rotations);
  report.add({"attention", "bwd", shape, "fusekit", tb.median_us, 8.0 * act_bytes + 2.0 * bias_bytes,
              2.5 * fwd_flops});
  if (options().diagnostics) {
    const Timing td = time_kernel([&](int r) { backward(r, true); }, rotations);
    report.add({"attention", "bwd-det", shape, "fusekit", td.median_us, 8.0 * act_bytes + 2.0 * bias_bytes,
                2.5 * fwd_flops});
  }
}

}  // namespace

void bench_attention(Report& report) {
  constexpr std::int64_t kTokens = 16384, kWidth = 2048;
  const char* filter = options().shapes.empty() ? nullptr : options().shapes.c_str();
  std::vector<Case> cases;
  for (const std::int64_t D : {128, 64})
    for (const std::int64_t S : {1024, 4096, 16384})
      for (const bool causal : {false, true}) cases.push_back({kTokens / S, S, kWidth / D, D, causal});
  // The bias-gradient case (the efficient backend's own benchmark shape) and dropout.
  cases.push_back({8, 2048, 16, 128, false, true, 0.0f});
  cases.push_back({4, 4096, 16, 128, false, false, 0.1f});
  for (const Case& c : cases)
    if (selected(filter, case_name(c))) run_case(report, c);
}

}  // namespace fusekit::bench
