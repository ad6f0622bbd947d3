// The launch choice of the gated activations (gated_act_config.h), on the CPU: what the benchmark
// shapes get on H100- and H200-like devices, and properties of every launch over a grid of problems.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "gated_act/gated_act_config.h"

namespace fusekit {
namespace {

using namespace gated_act;

detail::DeviceInfo device(int sm_count, double dram_bytes_per_sm_clock = 0.0) {
  detail::DeviceInfo d;
  d.sm_count = sm_count;
  d.max_threads_per_sm = 2048;
  d.dram_bytes_per_sm_clock = dram_bytes_per_sm_clock;
  return d;
}
const detail::DeviceInfo kH100 = device(132, 12.83);
const detail::DeviceInfo kH200 = device(132, 18.42);

Problem problem(std::int64_t rows, std::int64_t cols, int element_bytes = 2, bool backward = false,
                bool vector_ok = true) {
  Problem p;
  p.rows = rows;
  p.cols = cols;
  p.element_bytes = element_bytes;
  p.backward = backward;
  p.vector_ok = vector_ok;
  return p;
}

TEST(GatedActConfig, BenchmarkShapes) {
  struct Expected {
    std::int64_t cols;
    int tile_threads;
    std::int64_t col_tiles;
  };
  // bf16 rows of 16384 tokens: units of 8 outputs; tiles chosen for an exact or near fit.
  const Expected shapes[] = {
      {5632, 64, 11},    // 704 units: 64-thread tiles fit exactly (256 would leave 8% idle)
      {8192, 256, 4},    // 1024 units
      {11008, 128, 11},  // 1376 units = 43 warps: 128-thread tiles leave 2% idle
      {14336, 256, 7},   // 1792 units
  };
  for (const detail::DeviceInfo& d : {kH100, kH200})
    for (const Expected& e : shapes) {
      SCOPED_TRACE("F = " + std::to_string(e.cols));
      Launch f = choose_launch(problem(16384, e.cols), d);
      EXPECT_TRUE(f.vector);
      EXPECT_EQ(f.unit_elems, 8);
      EXPECT_EQ(f.units_per_row, e.cols / 8);
      EXPECT_EQ(f.tile_threads, e.tile_threads);
      EXPECT_EQ(f.row_threads, kBlockThreads / e.tile_threads);
      EXPECT_EQ(f.col_tiles, e.col_tiles);
      EXPECT_EQ(f.rows_per_thread, 4);
      EXPECT_EQ(f.row_blocks, 16384 / (f.row_threads * 4));
      const Launch b = choose_launch(problem(16384, e.cols, 2, true), d);
      EXPECT_EQ(b.tile_threads, e.tile_threads);
      EXPECT_EQ(b.rows_per_thread, 2);
      EXPECT_EQ(b.row_blocks, 16384 / (b.row_threads * 2));
    }
  // f32: units of 4 outputs.
  const Launch f32 = choose_launch(problem(16384, 8192, 4), kH200);
  EXPECT_EQ(f32.unit_elems, 4);
  EXPECT_EQ(f32.units_per_row, 2048);
  EXPECT_EQ(f32.tile_threads, 256);
}

TEST(GatedActConfig, SmallProblemsTakeFewerRowsPerThread) {
  // 64 rows of 4096: 2 tiles x 16 row groups at 4 rows per thread, far under two waves of 132 SMs.
  EXPECT_EQ(choose_launch(problem(64, 4096), kH200).rows_per_thread, 1);
  EXPECT_EQ(choose_launch(problem(64, 4096, 2, true), kH200).rows_per_thread, 1);
  // 2048 rows of 5632: 11 tiles x 128 row groups = 1408 blocks at 4 rows, under 2 x 132 x 8; 2816 at 2.
  EXPECT_EQ(choose_launch(problem(2048, 5632), kH100).rows_per_thread, 2);
  // Fewer SMs need fewer blocks.
  EXPECT_EQ(choose_launch(problem(2048, 5632), device(16)).rows_per_thread, 4);
}

TEST(GatedActConfig, ScalarPathAndForcedRows) {
  // F not a whole number of vectors, or views the vector path cannot take: one element per unit.
  for (const Problem& p : {problem(16384, 5631), problem(16384, 5632, 2, false, false), problem(100, 3, 4, true)}) {
    const Launch l = choose_launch(p, kH100);
    EXPECT_FALSE(l.vector);
    EXPECT_EQ(l.unit_elems, 1);
    EXPECT_EQ(l.units_per_row, p.cols);
    EXPECT_EQ(l.rows_per_thread, kScalarRowsPerThread);
  }
  ForcedChoices forced;
  forced.forward_rows_per_thread = 1;
  forced.backward_rows_per_thread = 4;
  EXPECT_EQ(choose_launch(problem(16384, 8192), kH100, forced).rows_per_thread, 1);
  EXPECT_EQ(choose_launch(problem(16384, 8192, 2, true), kH100, forced).rows_per_thread, 4);
  EXPECT_EQ(choose_launch(problem(16384, 8191), kH100, forced).rows_per_thread, kScalarRowsPerThread);
  // Nothing forced without the override keys.
  const ForcedChoices none = forced_choices();
  EXPECT_EQ(none.forward_rows_per_thread, 0);
  EXPECT_EQ(none.backward_rows_per_thread, 0);
}

// Every launch: block shape, tiles that cover the row with at most one partial tile, a grid within
// CUDA's limits, and, walked as the kernels walk it, every row exactly once.
TEST(GatedActConfig, EveryLaunchCoversTheProblem) {
  const std::int64_t rows_set[] = {1, 2, 7, 67, 1000, 16384, 300000, 2200000};
  const std::int64_t cols_set[] = {1, 3, 8, 13, 64, 100, 256, 1000, 1024, 4096, 5632, 8192, 11008, 14336, 70000};
  int checked = 0;
  for (int sms : {1, 78, 114, 132})
    for (std::int64_t rows : rows_set)
      for (std::int64_t cols : cols_set)
        for (int bytes : {2, 4})
          for (bool backward : {false, true})
            for (bool vector_ok : {false, true}) {
              const Problem p = problem(rows, cols, bytes, backward, vector_ok);
              const Launch l = choose_launch(p, device(sms));
              SCOPED_TRACE("(" + std::to_string(rows) + ", " + std::to_string(cols) + ") bytes " +
                           std::to_string(bytes) + (backward ? " bwd" : " fwd") + " sms " + std::to_string(sms));
              ASSERT_EQ(l.vector, vector_ok && cols % (16 / bytes) == 0);
              ASSERT_EQ(l.unit_elems * l.units_per_row, cols);
              ASSERT_EQ(l.tile_threads % 32, 0);
              ASSERT_EQ(l.tile_threads * l.row_threads, kBlockThreads);
              ASSERT_GE(l.col_tiles * l.tile_threads, l.units_per_row);
              ASSERT_LT((l.col_tiles - 1) * l.tile_threads, l.units_per_row);
              ASSERT_LE(l.col_tiles, std::int64_t(INT32_MAX));
              if (l.vector) {
                bool compiled = false;
                for (int r : kVectorRowsPerThread) compiled = compiled || r == l.rows_per_thread;
                ASSERT_TRUE(compiled) << l.rows_per_thread;
              } else {
                ASSERT_EQ(l.rows_per_thread, kScalarRowsPerThread);
              }
              ASSERT_GE(l.row_blocks, 1);
              ASSERT_LE(l.row_blocks, kMaxRowBlocks);
              // Rows as a thread (block row by, thread row ty) visits them: first = by * block_rows + ty,
              // then first + k * row_threads for k < rows_per_thread, the grid moving on by
              // row_blocks * block_rows rows per pass.
              if (rows <= 300000) {
                const std::int64_t block_rows = std::int64_t(l.row_threads) * l.rows_per_thread;
                std::vector<int> visits(rows, 0);
                for (int by = 0; by < l.row_blocks; ++by)
                  for (int ty = 0; ty < l.row_threads; ++ty)
                    for (std::int64_t first = by * block_rows + ty; first < rows; first += l.row_blocks * block_rows)
                      for (int k = 0; k < l.rows_per_thread; ++k) {
                        const std::int64_t r = first + std::int64_t(k) * l.row_threads;
                        if (r < rows) ++visits[r];
                      }
                for (std::int64_t r = 0; r < rows; ++r) ASSERT_EQ(visits[r], 1) << "row " << r;
              }
              ++checked;
            }
  EXPECT_EQ(checked, 4 * 8 * 15 * 2 * 2 * 2);
}

// The tile width: the widest whose idle threads are at most 1/16 of the launched ones, else the
// fewest idle threads.
TEST(GatedActConfig, TileWidthFitsTheRow) {
  for (std::int64_t units = 1; units <= 5000; ++units) {
    const Launch l = choose_launch(problem(1000, units * 8), kH100);
    const std::int64_t idle = l.col_tiles * l.tile_threads - units;
    bool any_fits = false;
    std::int64_t least_idle = INT64_MAX;
    for (int w : {256, 128, 64, 32}) {
      const std::int64_t launched = (units + w - 1) / w * w;
      any_fits = any_fits || (launched - units) * 16 <= launched;
      least_idle = std::min(least_idle, launched - units);
    }
    if (any_fits) {
      ASSERT_LE(idle * 16, l.col_tiles * l.tile_threads) << units;
      for (int w : {256, 128, 64, 32}) {
        if (w <= l.tile_threads) break;
        const std::int64_t launched = (units + w - 1) / w * w;
        ASSERT_GT((launched - units) * 16, launched) << "a wider tile fits " << units;
      }
    } else {
      ASSERT_EQ(idle, least_idle) << units;
    }
  }
}

}  // namespace
}  // namespace fusekit
