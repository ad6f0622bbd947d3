// The chunk choice of linear_cross_entropy and the workspace layout it implies: H100- and
// H200-like devices, every benchmark shape and a sweep of odd ones.
#include <gtest/gtest.h>

#include <cstdint>

#include "core/device_info.h"
#include "linear_cross_entropy/linear_cross_entropy_config.h"
#include "linear_cross_entropy/linear_cross_entropy_params.h"

namespace fusekit::lxent {
namespace {

detail::DeviceInfo h100() {
  detail::DeviceInfo d;
  d.name = "H100-like";
  d.major = 9;
  d.sm_count = 132;
  d.l2_bytes = 50 << 20;
  d.max_smem_per_block_optin = 227 << 10;
  d.max_threads_per_sm = 2048;
  d.dram_bytes_per_sm_clock = 12.83;
  return d;
}

detail::DeviceInfo h200() {
  detail::DeviceInfo d = h100();
  d.name = "H200-like";
  d.dram_bytes_per_sm_clock = 18.42;
  return d;
}

Problem problem(std::int64_t t, std::int64_t v, std::int64_t h, int e) {
  Problem p;
  p.tokens = t;
  p.vocab = v;
  p.hidden = h;
  p.element_bytes = e;
  return p;
}

TEST(LinearCrossEntropyConfig, BenchmarkShapes) {
  for (const auto& d : {h100(), h200()}) {
    // 512 MiB of bf16 logits: 8192 rows of V = 32000.
    EXPECT_EQ(choose_chunk(problem(32768, 32000, 4096, 2), d), 8192);
    EXPECT_EQ(choose_chunk(problem(8192, 32000, 4096, 2), d), 8192);
    // V = 262144: the 512 MiB target would give 1024 rows; the dW accumulation needs 4096.
    EXPECT_EQ(choose_chunk(problem(32768, 262144, 8192, 2), d), 4096);
    // float32 at the largest vocabulary: 4096 rows are exactly the 4 GiB bound.
    EXPECT_EQ(choose_chunk(problem(32768, 262144, 2048, 4), d), 4096);
    // GPT-2's vocabulary: equal chunks, a multiple of 128.
    EXPECT_EQ(choose_chunk(problem(16384, 50257, 768, 2), d), 4096);
    // Few rows: one chunk of exactly T.
    EXPECT_EQ(choose_chunk(problem(300, 50257, 768, 2), d), 300);
    EXPECT_EQ(choose_chunk(problem(0, 50257, 768, 2), d), 0);
  }
}

TEST(LinearCrossEntropyConfig, EveryChunkIsBoundedAndCoversTheRows) {
  const auto d = h100();
  for (std::int64_t v : {1, 7, 1000, 32000, 50257, 128256, 151936, 262144})
    for (int e : {2, 4})
      for (std::int64_t t : {1, 127, 128, 4095, 4097, 8191, 8193, 20000, 32768, 100001}) {
        SCOPED_TRACE("T " + std::to_string(t) + " V " + std::to_string(v) + " e " + std::to_string(e));
        const std::int64_t c = choose_chunk(problem(t, v, 1024, e), d);
        ASSERT_GE(c, 1);
        ASSERT_LE(c, t);
        const std::int64_t chunks = (t + c - 1) / c;
        EXPECT_GE(chunks * c, t);
        if (chunks > 1) {
          EXPECT_EQ(c % kChunkRowMultiple, 0);
          EXPECT_GE(c, kMinChunkTokens / 2);  // equal chunks of at least half the cap
          // Equal chunks: the last one is not much shorter than the others.
          EXPECT_GT(t - (chunks - 1) * c, c - chunks * kChunkRowMultiple);
        }
        EXPECT_LE(c * chunk_row_stride(v) * e, kMaxChunkBytes);
        if (chunks > 1) {
          EXPECT_LE(c * chunk_row_stride(v) * e,
                    std::max(kTargetChunkBytes, kMinChunkTokens * chunk_row_stride(v) * e) +
                        kChunkRowMultiple * chunk_row_stride(v) * e);
        }
      }
}

TEST(LinearCrossEntropyConfig, WorkspaceLayoutFollowsTheHeaderFormula) {
  auto a = [](std::size_t n) { return (n + 255) / 256 * 256; };
  const std::int64_t T = 1000, V = 50257, H = 768, Tc = 256;
  const std::size_t base = (std::size_t(32) << 20) + 256;
  const std::size_t logits = a(std::size_t(Tc) * 50264 * 2);
  // bf16 dW: the float32 accumulator; a bias: its float32 row.
  Layout l = workspace_layout(T, V, H, Tc, DType::bf16, DType::bf16, true, LossReduction::mean);
  EXPECT_EQ(l.total, base + a(4 * T) + logits + a(4 * V * H) + a(4 * V));
  EXPECT_EQ(l.logits % 256, 0u);
  EXPECT_EQ(l.dweight_acc % 256, 0u);
  EXPECT_EQ(l.dbias_acc % 256, 0u);
  // float32 dW needs no accumulator; reduction none keeps no row losses.
  l = workspace_layout(T, V, H, Tc, DType::bf16, DType::f32, false, LossReduction::none);
  EXPECT_EQ(l.total, base + logits);
  EXPECT_EQ(chunk_row_stride(50257), 50264);
  EXPECT_EQ(chunk_row_stride(32000), 32000);
}

}  // namespace
}  // namespace fusekit::lxent
