// The launch choices of cross-entropy (cross_entropy_config.h), on the CPU: what the benchmark
// shapes get on H100- and H200-like devices, and properties over a grid of shapes.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "core/overrides.h"
#include "cross_entropy/cross_entropy_config.h"
#include "tests/harness/devices.h"

namespace fusekit {
namespace {

using namespace cross_entropy;

Problem problem(std::int64_t rows, std::int64_t cols, int element_bytes, Pass pass) {
  Problem p;
  p.rows = rows;
  p.cols = cols;
  p.element_bytes = element_bytes;
  p.pass = pass;
  return p;
}

constexpr Pass kPasses[] = {Pass::forward, Pass::backward, Pass::forward_backward};

TEST(CrossEntropyConfig, BenchmarkShapes) {
  for (const detail::DeviceInfo& d : {testing::h100_device(), testing::h200_device()}) {
    for (std::int64_t rows : {8192, 16384}) {
      // The fused call: rows of 32 to 108 KB take the staged kernel whole; rows of 128 KB too,
      // streaming 20 KB each; longer rows split into clusters of <= 64 KB slices, up to 8 blocks.
      // The forward and the backward keep one block per row.
      struct Expected {
        std::int64_t cols;
        bool staged;
        int cluster, chunks;
      };
      for (const Expected& e : {Expected{32000, true, 1, 1}, Expected{50257, true, 1, 1},
                                Expected{65536, true, 1, 1}, Expected{100000, false, 4, 1},
                                Expected{128256, false, 4, 1}, Expected{151936, false, 8, 1},
                                Expected{262144, false, 8, 1}}) {
        SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(e.cols));
        const Problem fused_problem = problem(rows, e.cols, 2, Pass::forward_backward);
        const Launch fused = choose_launch(fused_problem, d);
        EXPECT_EQ(fused.staged, e.staged);
        const std::int64_t row_vector_bytes = (e.cols * 2 + 15) / 16 * 16;
        const std::int64_t held = std::min(row_vector_bytes, kStagedRowBytes);
        EXPECT_EQ(fused.smem_bytes, e.staged ? static_cast<std::size_t>(held) : 0u);
        EXPECT_EQ(fused.cluster, e.cluster);
        EXPECT_EQ(fused.threads, kMaxThreads);
        EXPECT_EQ(fused.blocks, rows * e.cluster);
        EXPECT_FALSE(fused_slice_resident(fused_problem, fused));
        const Launch forward = choose_launch(problem(rows, e.cols, 2, Pass::forward), d);
        EXPECT_FALSE(forward.staged);
        EXPECT_EQ(forward.cluster, 1);
        EXPECT_EQ(forward.threads, kMaxThreads);
        EXPECT_EQ(forward.blocks, rows);
        const Launch backward = choose_launch(problem(rows, e.cols, 2, Pass::backward), d);
        EXPECT_EQ(backward.chunks, e.chunks);
        EXPECT_EQ(backward.blocks, rows);
      }
    }
  }
}

TEST(CrossEntropyConfig, SmallBatchesSpreadRowsOverMoreBlocks) {
  const detail::DeviceInfo d = testing::h100_device();
  // 16 rows of 128256 bf16: the forward splits each row over 8 blocks (clusters), the backward
  // over more chunks than that (independent blocks).
  EXPECT_EQ(choose_launch(problem(16, 128256, 2, Pass::forward), d).cluster, 8);
  EXPECT_GT(choose_launch(problem(16, 128256, 2, Pass::backward), d).chunks, 8);
  // Short rows stay whole (slices under 8 KB are not split further) and take narrow blocks.
  const Launch small = choose_launch(problem(4, 1000, 2, Pass::forward_backward), d);
  EXPECT_EQ(small.cluster, 1);
  EXPECT_EQ(small.threads, kMinThreads);
  // The staged kernel (one block per row) waits for two rows per SM, and rows of 32 KB.
  EXPECT_FALSE(choose_launch(problem(2 * 132 - 1, 32000, 2, Pass::forward_backward), d).staged);
  EXPECT_TRUE(choose_launch(problem(2 * 132, 32000, 2, Pass::forward_backward), d).staged);
  EXPECT_FALSE(choose_launch(problem(8192, 16383, 2, Pass::forward_backward), d).staged);
  EXPECT_TRUE(choose_launch(problem(8192, 16384, 2, Pass::forward_backward), d).staged);
  // Rows held in registers: one-sweep slices of the row kernel (a 32 KB row in a small batch).
  const Problem held = problem(64, 16384, 2, Pass::forward_backward);
  EXPECT_TRUE(fused_slice_resident(held, choose_launch(held, d)));
}

TEST(CrossEntropyConfig, OverridesReplaceTheTable) {
  const detail::DeviceInfo d = testing::h200_device();
  LaunchOverrides o;
  o.threads = 64;
  o.cluster = 4;
  o.chunks = 3;
  const Launch fused = choose_launch(problem(100, 32000, 2, Pass::forward_backward), d, o);
  EXPECT_EQ(fused.threads, 64);
  EXPECT_EQ(fused.cluster, 4);
  EXPECT_EQ(fused.blocks, 400);
  EXPECT_EQ(choose_launch(problem(100, 32000, 2, Pass::backward), d, o).chunks, 3);
  // A forced cluster leaves the staged kernel; staged forced on takes every row whatever the
  // batch (rows past its shared memory streamed), forced off none.
  EXPECT_FALSE(choose_launch(problem(8192, 32000, 2, Pass::forward_backward), d, o).staged);
  LaunchOverrides on;
  on.staged = 1;
  EXPECT_TRUE(choose_launch(problem(3, 32000, 2, Pass::forward_backward), d, on).staged);
  EXPECT_TRUE(choose_launch(problem(8192, 100, 2, Pass::forward), d, on).staged);
  const Launch streamed = choose_launch(problem(8192, 262144, 2, Pass::forward_backward), d, on);
  EXPECT_TRUE(streamed.staged);
  EXPECT_EQ(streamed.smem_bytes, static_cast<std::size_t>(kStagedRowBytes));
  LaunchOverrides off;
  off.staged = -1;
  EXPECT_FALSE(choose_launch(problem(8192, 32000, 2, Pass::forward), d, off).staged);
  // Through the override keys.
  detail::set_override("cross_entropy.cluster", "2");
  detail::set_override("cross_entropy.threads", "128");
  detail::set_override("cross_entropy.backward.chunks", "5");
  detail::set_override("cross_entropy.staged", "off");
  const LaunchOverrides keys = read_launch_overrides();
  EXPECT_EQ(keys.cluster, 2);
  EXPECT_EQ(keys.threads, 128);
  EXPECT_EQ(keys.chunks, 5);
  EXPECT_EQ(keys.staged, -1);
  detail::set_override("cross_entropy.cluster", "3");
  EXPECT_THROW(read_launch_overrides(), Error);
  detail::clear_overrides();
  const LaunchOverrides none = read_launch_overrides();
  EXPECT_EQ(none.cluster + none.threads + none.chunks + none.staged, 0);
}

TEST(CrossEntropyConfig, EveryLaunchCoversTheProblem) {
  const std::int64_t rows_set[] = {1, 2, 7, 100, 8192, 16384, 300000, INT_MAX};
  const std::int64_t cols_set[] = {1, 7, 8, 1000, 1001, 4096, 32000, 50257, 128256, 151936, 262144};
  int checked = 0;
  for (int sms : {1, 78, 114, 132})
    for (std::int64_t rows : rows_set)
      for (std::int64_t cols : cols_set)
        for (int bytes : {2, 4})
          for (Pass pass : kPasses) {
            detail::DeviceInfo d = testing::h100_device();
            d.sm_count = sms;
            const Problem p = problem(rows, cols, bytes, pass);
            SCOPED_TRACE("(" + std::to_string(rows) + ", " + std::to_string(cols) + ") x" + std::to_string(bytes) +
                         " pass " + std::to_string(static_cast<int>(pass)) + " sms " + std::to_string(sms));
            const Launch l = choose_launch(p, d);
            ASSERT_TRUE(l.threads == 64 || l.threads == 128 || l.threads == 256);
            ASSERT_GE(l.threads, kMinThreads);
            ASSERT_LE(l.threads, kMaxThreads);
            if (pass == Pass::backward) {
              ASSERT_EQ(l.cluster, 1);
              ASSERT_GE(l.chunks, 1);
              ASSERT_LE(l.chunks, kMaxChunks);
              ASSERT_LE(l.chunks, 65535);  // grid.y
              ASSERT_EQ(l.blocks, rows);
            } else {
              ASSERT_EQ(l.chunks, 1);
              ASSERT_TRUE(l.cluster == 1 || l.cluster == 2 || l.cluster == 4 || l.cluster == 8);
              ASSERT_EQ(l.blocks, rows * l.cluster);
              ASSERT_LE(l.blocks, INT_MAX);  // grid.x
              if (l.staged) {
                ASSERT_EQ(l.cluster, 1);
                // The row's vectors up to kStagedRowBytes; the streamed rest of the two resident
                // blocks' rows per SM within L2's budget.
                const std::int64_t row_vector_bytes = (cols * bytes + 15) / 16 * 16;
                ASSERT_EQ(std::int64_t(l.smem_bytes), std::min(row_vector_bytes, kStagedRowBytes));
                ASSERT_LE(2 * sms * (row_vector_bytes - std::int64_t(l.smem_bytes)), kStagedStreamedL2Bytes);
              } else {
                ASSERT_EQ(l.smem_bytes, 0u);
              }
            }
            // The fused row kernel's slices stay within what L2 serves back, up to rows of
            // kMaxCluster slices (unless grid.x cannot hold that many blocks); longer rows take
            // the largest cluster. Slices of one sweep are held in registers.
            if (pass == Pass::forward_backward && !l.staged && rows <= INT_MAX / kMaxCluster) {
              if (cols * bytes <= kMaxCluster * kFusedSliceBytes) ASSERT_LE(slice_bytes(p, l), kFusedSliceBytes);
              else ASSERT_EQ(l.cluster, kMaxCluster);
              ASSERT_EQ(fused_slice_resident(p, l), (slice_bytes(p, l) + 15) / 16 <= l.threads * kVectorsPerThread);
            }
            if (pass != Pass::forward_backward || l.staged) ASSERT_FALSE(fused_slice_resident(p, l));
            if (l.staged) {
              ASSERT_EQ(pass, Pass::forward_backward);
              ASSERT_GE(cols * bytes, kStagedMinRowBytes);
            }
            ++checked;
          }
  EXPECT_EQ(checked, 4 * 8 * 11 * 2 * 3);
}

}  // namespace
}  // namespace fusekit
