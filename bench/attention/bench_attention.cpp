// Attention benchmarks, the FlashAttention benchmark's shapes: bf16, B * S = 16384 tokens, model
// width 2048 (H = 16, D = 128 and H = 32, D = 64), S in {1024, 4096}, causal (bottom-right = top-
// left here, Sq = Sk) and not, no bias, no dropout.
// flops: forward 4 * B * H * S * S * D (two matrix products), halved when causal; backward 2.5 x
// the forward (five matrix products against two). bytes: q, k, v, out read or written once
// (forward), plus dout, dq, dk, dv (backward); lse and the workspace are not counted.
// FUSEKIT_BENCH_SHAPES="S=4096,D=128" (comma-separated pieces that must all occur in the shape
// string, e.g. "causal") narrows the rows; FUSEKIT_BENCH_DIAGNOSTICS adds the deterministic
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

void bench_attention(Report& report) {
  const Device gpu = Device::cuda(0);
  const DType bf16 = DType::bf16;
  constexpr std::int64_t kTokens = 16384, kWidth = 2048;
  const char* filter = std::getenv("FUSEKIT_BENCH_SHAPES");
  for (const std::int64_t D : {128, 64}) {
    const std::int64_t H = kWidth / D;
    for (const std::int64_t S : {1024, 4096}) {
      const std::int64_t B = kTokens / S;
      for (const bool causal : {false, true}) {
        const std::string shape = fmt::format("(B={}, S={}, H={}, D={}){}", B, S, H, D, causal ? " causal" : "");
        if (!selected(filter, shape)) continue;
        const std::size_t act_bytes = static_cast<std::size_t>(kTokens * kWidth) * 2;
        const std::size_t lse_bytes = static_cast<std::size_t>(B * H * S) * 4;
        const int rotations = rotations_for(4 * act_bytes);
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
        AttentionConfig cfg;
        cfg.mask = causal ? AttentionMask::causal_bottom_right : AttentionMask::none;
        const AttentionShape ashape{B, S, S, H, H, D, D, bf16, false};
        const std::size_t ws_bytes = std::max(attention_backward_workspace_size(ashape, cfg, false, gpu),
                                              attention_backward_workspace_size(ashape, cfg, true, gpu));
        DeviceBuffer ws(ws_bytes);
        const TensorView workspace(ws.get(), DType::u8, gpu, {static_cast<std::int64_t>(ws_bytes)});
        auto t4 = [&](const DeviceBuffer& b) { return TensorView(b.get(), bf16, gpu, {B, S, H, D}); };
        auto lse = [&](const DeviceBuffer& b) { return TensorView(b.get(), DType::f32, gpu, {B, H, S}); };
        auto forward = [&](int r) {
          Set& s = sets[r];
          attention_forward(t4(s.q), t4(s.k), t4(s.v), std::nullopt, cfg, t4(s.out), lse(s.lse));
        };
        auto backward = [&](int r, bool deterministic) {
          Set& s = sets[r];
          attention_backward(t4(s.dout), t4(s.q), t4(s.k), t4(s.v), t4(s.out), lse(s.lse), std::nullopt, cfg,
                             t4(s.dq), t4(s.dk), t4(s.dv), std::nullopt, std::nullopt, deterministic, workspace);
        };
        for (int r = 0; r < rotations; ++r) forward(r);  // saved out and lse for the backward
        const double fwd_flops = 4.0 * B * H * S * S * D * (causal ? 0.5 : 1.0);
        const Timing tf = time_kernel(forward, rotations);
        report.add({"attention", "fwd", shape, "fusekit", tf.median_us, 4.0 * act_bytes, fwd_flops});
        const Timing tb = time_kernel([&](int r) { backward(r, false); }, rotations);
        report.add({"attention", "bwd", shape, "fusekit", tb.median_us, 8.0 * act_bytes, 2.5 * fwd_flops});
        if (std::getenv("FUSEKIT_BENCH_DIAGNOSTICS")) {
          const Timing td = time_kernel([&](int r) { backward(r, true); }, rotations);
          report.add({"attention", "bwd-det", shape, "fusekit", td.median_us, 8.0 * act_bytes, 2.5 * fwd_flops});
        }
      }
    }
  }
}

}  // namespace fusekit::bench
