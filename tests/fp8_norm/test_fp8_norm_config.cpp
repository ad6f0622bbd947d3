// FP8 RMSNorm launch choices (src/fp8_norm/fp8_norm_config.h) on the CPU: what the benchmark
// shapes get on an H100-like and an H200-like device, the forced choices, and properties of every
// config over a grid of shapes (shared memory fits, row groups divide the block, tails covered,
// grids within their caps and balanced).
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "core/overrides.h"
#include "fp8_norm/fp8_norm_config.h"
#include "tests/harness/devices.h"

namespace fusekit::fp8_norm {
namespace {

detail::DeviceInfo h100_like() { return testing::h100_device(); }
detail::DeviceInfo h200_like() { return testing::h200_device(); }


// Any 256-byte aligned address: the configs only test alignment.
const void* aligned_ptr(std::uintptr_t offset = 0) { return reinterpret_cast<const void*>(0x100000 + offset); }
void* aligned_out(std::uintptr_t offset = 0) { return reinterpret_cast<void*>(0x100000 + offset); }

int log2_of(int v) {
  int l = 0;
  while ((1 << l) < v) ++l;
  return l;
}

// Contiguous tensors, bf16 scales in groups of `group`, no y output.
ForwardParams forward_problem(std::int64_t rows, std::int64_t cols, int group = 16, DType scales = DType::bf16) {
  ForwardParams p;
  p.rows = rows;
  p.cols = cols;
  p.group_size = group;
  p.log2_group = log2_of(group);
  p.scale_dtype = scales;
  p.x = aligned_ptr();
  p.x_row_stride = cols;
  p.scales = aligned_ptr();
  p.scale_row_stride = cols / group;
  p.weight = aligned_ptr();
  p.qy = aligned_out();
  p.qy_row_stride = cols;
  p.qy_t = aligned_out();
  p.qy_t_row_stride = rows;
  return p;
}

BackwardParams backward_problem(std::int64_t rows, std::int64_t cols, int group = 16, DType scales = DType::bf16) {
  BackwardParams p;
  p.rows = rows;
  p.cols = cols;
  p.group_size = group;
  p.log2_group = log2_of(group);
  p.scale_dtype = scales;
  p.dy = aligned_ptr();
  p.dy_row_stride = cols;
  p.x = aligned_ptr();
  p.x_row_stride = cols;
  p.scales = aligned_ptr();
  p.scale_row_stride = cols / group;
  p.weight = aligned_ptr();
  p.dx = aligned_out();
  p.dx_row_stride = cols;
  return p;
}

TEST(Fp8NormConfig, BackwardTuningFollowsDramBytesPerSmClock) {
  EXPECT_EQ(choose_backward_tuning(h100_like(), BackwardTuning::automatic), BackwardTuning::two_runs_streaming);
  EXPECT_EQ(choose_backward_tuning(h200_like(), BackwardTuning::automatic), BackwardTuning::four_runs_cached);
  detail::DeviceInfo unknown = h100_like();
  unknown.dram_bytes_per_sm_clock = 0.0;  // the driver reported no clocks
  EXPECT_EQ(choose_backward_tuning(unknown, BackwardTuning::automatic), BackwardTuning::four_runs_cached);
  for (BackwardTuning forced : {BackwardTuning::four_runs_cached, BackwardTuning::two_runs_streaming}) {
    EXPECT_EQ(choose_backward_tuning(h100_like(), forced), forced);
    EXPECT_EQ(choose_backward_tuning(h200_like(), forced), forced);
  }
}

struct BackwardExpect {
  std::int64_t rows, cols;
  int runs, row_threads;
  BackwardVariant variant;
};

void expect_backward(const detail::DeviceInfo& device, const BackwardExpect& e, BackwardTuning tuning) {
  SCOPED_TRACE(device.name + " (" + std::to_string(e.rows) + ", " + std::to_string(e.cols) + ")");
  const BackwardConfig c = choose_backward(backward_problem(e.rows, e.cols), device, {});
  ASSERT_TRUE(c.vector);
  EXPECT_EQ(c.tuning, tuning);
  EXPECT_EQ(c.runs_per_thread, e.runs);
  EXPECT_EQ(1 << c.log2_row_threads, e.row_threads);
  EXPECT_EQ(c.rows_per_block, kBwdThreads / e.row_threads);
  EXPECT_EQ(c.variant, e.variant);
  const bool staged =
      e.variant == BackwardVariant::staged_scales || e.variant == BackwardVariant::staged_scales_streaming;
  EXPECT_EQ(c.smem_bytes,
            backward_smem_bytes(e.runs, e.row_threads) + (staged ? backward_scale_stage_bytes(e.runs, 2) : 0));
}

TEST(Fp8NormConfig, BackwardShapesOfTheBenchmarkRowsOnH100AndH200) {
  const BackwardExpect h100[] = {
      {32768, 2048, 2, 128, BackwardVariant::staged_scales},
      {16384, 4096, 4, 128, BackwardVariant::staged_scales_streaming},
      {8192, 8192, 4, 256, BackwardVariant::staged_scales},
      {4096, 1024, 4, 32, BackwardVariant::staged_scales},
      {4096, 1536, 2, 128, BackwardVariant::bounds_checked},
      {1024, 16384, 8, 256, BackwardVariant::bounds_checked},
  };
  const BackwardExpect h200[] = {
      {32768, 2048, 4, 64, BackwardVariant::staged_scales},
      {16384, 4096, 4, 128, BackwardVariant::staged_scales},
      {8192, 8192, 4, 256, BackwardVariant::staged_scales},
      {4096, 1024, 4, 32, BackwardVariant::staged_scales},
      {4096, 1536, 4, 64, BackwardVariant::bounds_checked},
      {1024, 16384, 8, 256, BackwardVariant::bounds_checked},
  };
  for (const BackwardExpect& e : h100) expect_backward(h100_like(), e, BackwardTuning::two_runs_streaming);
  for (const BackwardExpect& e : h200) expect_backward(h200_like(), e, BackwardTuning::four_runs_cached);
}

TEST(Fp8NormConfig, BackwardVariantsFollowTheLayout) {
  const detail::DeviceInfo device = h100_like();
  // Groups of 32: exact rows but scales not staged (two runs per scale only at groups of 16).
  EXPECT_EQ(choose_backward(backward_problem(64, 4096, 32), device, {}).variant, BackwardVariant::exact_rows);
  // Scale rows that are not 16-byte multiples.
  BackwardParams padded = backward_problem(64, 4096);
  padded.scale_row_stride += 1;
  EXPECT_EQ(choose_backward(padded, device, {}).variant, BackwardVariant::exact_rows);
  // f32 scales stage too, with twice the bytes.
  const BackwardConfig f32 = choose_backward(backward_problem(64, 4096, 16, DType::f32), device, {});
  EXPECT_EQ(f32.variant, BackwardVariant::staged_scales_streaming);
  EXPECT_EQ(f32.smem_bytes, backward_smem_bytes(4, 128) + backward_scale_stage_bytes(4, 4));
  // The generic kernel: groups under 16, misaligned rows, rows over 16384 columns.
  EXPECT_FALSE(choose_backward(backward_problem(64, 4096, 8), device, {}).vector);
  BackwardParams odd = backward_problem(64, 4096);
  odd.dy = aligned_ptr(8);
  EXPECT_FALSE(choose_backward(odd, device, {}).vector);
  EXPECT_FALSE(choose_backward(backward_problem(64, 16384 + 16), device, {}).vector);
  EXPECT_EQ(choose_backward(backward_problem(64, 16384 + 16), device, {}).tuning, BackwardTuning::automatic);
  // A forced tuning applies on either device.
  ForcedChoices forced;
  forced.backward = BackwardTuning::four_runs_cached;
  EXPECT_EQ(choose_backward(backward_problem(64, 2048), device, forced).runs_per_thread, 4);
  forced.backward = BackwardTuning::two_runs_streaming;
  EXPECT_EQ(choose_backward(backward_problem(64, 2048), h200_like(), forced).runs_per_thread, 2);
}

TEST(Fp8NormConfig, StatisticsPathsAndRingsOfTheBenchmarkRows) {
  for (const detail::DeviceInfo& device : {h100_like(), h200_like()}) {
    SCOPED_TRACE(device.name);
    struct Expect {
      std::int64_t rows, cols;
      int rounds, slots;
    };
    // Rows of 4 or more rounds in 1-round chunks and 3 slots, shorter ones in 2-round chunks where
    // the row divides, and 2 slots; fewer slots where two blocks would not fit on an SM.
    for (const Expect& e : {Expect{32768, 2048, 1, 2}, Expect{16384, 4096, 2, 2}, Expect{8192, 8192, 1, 3},
                            Expect{1024, 6144, 1, 2}, Expect{1024, 16384, 1, 2}}) {
      const ForwardConfig c = choose_forward(forward_problem(e.rows, e.cols), device, {});
      EXPECT_EQ(c.stats.design, StatsDesign::bulk) << e.cols;
      EXPECT_EQ(c.stats.ring.rounds, e.rounds) << e.cols;
      EXPECT_EQ(c.stats.ring.slots, e.slots) << e.cols;
      EXPECT_EQ(c.stats.rows_per_block, kStatsBulkWarps);
      EXPECT_EQ(c.stats.smem_bytes, stats_bulk_smem_bytes(e.cols, 4, 2, c.stats.ring));
      EXPECT_EQ(c.quantize.tiles, QuantizeTiles::whole);
      EXPECT_EQ(c.quantize.smem_bytes, std::size_t(kQuantSmemBytes));
      // 40% of L2 kept for the quantize pass.
      EXPECT_EQ(c.l2_keep_from_row, std::max<std::int64_t>(0, e.rows - (std::int64_t(0.4 * device.l2_bytes) / e.cols)));
    }
  }
}

TEST(Fp8NormConfig, StatisticsFallbacksAndForcedChoices) {
  const detail::DeviceInfo device = h200_like();
  auto stats = [&](const ForwardParams& p, ForcedChoices forced = {}) {
    return choose_forward(p, device, forced).stats;
  };
  // Not whole rounds of 2048 columns: the register kernel, row groups of up to 32 threads.
  StatsConfig c = stats(forward_problem(256, 1024));
  EXPECT_EQ(c.design, StatsDesign::registers);
  EXPECT_EQ(c.log2_row_threads, 5);
  EXPECT_EQ(c.variant, StatsVariant::staged_weights);  // 64 vectors: half a round of 32 x 4
  EXPECT_EQ(c.smem_bytes, 1024 * sizeof(float));
  c = stats(forward_problem(256, 64));
  EXPECT_EQ(c.log2_row_threads, 2);
  EXPECT_EQ(c.rows_per_block, kStatsThreads / 4);
  c = stats(forward_problem(32, 16384 + 2048));
  EXPECT_EQ(c.design, StatsDesign::registers);
  EXPECT_EQ(c.variant, StatsVariant::global_weights);
  EXPECT_EQ(c.smem_bytes, 0u);
  // Under 16 bytes of scales per round (bf16 groups of 512), scale rows not 16-byte multiples.
  EXPECT_EQ(stats(forward_problem(256, 4096, 512)).design, StatsDesign::registers);
  ForwardParams padded = forward_problem(256, 4096);
  padded.scale_row_stride += 1;
  EXPECT_EQ(stats(padded).design, StatsDesign::registers);
  // Groups under 16: the generic kernels.
  const ForwardConfig generic = choose_forward(forward_problem(256, 2048, 8), device, {});
  EXPECT_EQ(generic.stats.design, StatsDesign::generic);
  EXPECT_FALSE(generic.quantize.vector);
  // Forced: registers where bulk would run; bulk falls back where it cannot serve.
  ForcedChoices forced;
  forced.stats = StatsDesign::registers;
  c = stats(forward_problem(256, 2048), forced);
  EXPECT_EQ(c.design, StatsDesign::registers);
  EXPECT_EQ(c.variant, StatsVariant::staged_weights_whole_rounds);
  forced.stats = StatsDesign::bulk;
  EXPECT_EQ(stats(forward_problem(256, 1024), forced).design, StatsDesign::registers);
  // Forced ring shapes; chunks shrink to divide the row.
  forced.stats_chunk_rounds = 1;
  forced.stats_ring_slots = 4;
  c = stats(forward_problem(256, 4096), forced);
  EXPECT_EQ(c.ring.rounds, 1);
  EXPECT_EQ(c.ring.slots, 4);
  forced.stats_chunk_rounds = 4;
  c = stats(forward_problem(256, 6144), forced);
  EXPECT_EQ(c.ring.rounds, 1);  // 3 rounds per row: 4 -> 2 -> 1
  EXPECT_EQ(c.ring.slots, 4);
  // A ring that would not let two blocks share an SM loses slots, then rounds.
  forced.stats_ring_slots = 8;
  c = stats(forward_problem(256, 16384), forced);
  EXPECT_LE(2 * (c.smem_bytes + 4096), device.max_smem_per_block_optin);
  EXPECT_EQ(c.ring.slots, 2);
  EXPECT_EQ(c.ring.rounds, 1);
}

TEST(Fp8NormConfig, QuantizeTiles) {
  const detail::DeviceInfo device = h100_like();
  EXPECT_EQ(choose_forward(forward_problem(256, 2048), device, {}).quantize.tiles, QuantizeTiles::whole);
  EXPECT_EQ(choose_forward(forward_problem(250, 2048), device, {}).quantize.tiles, QuantizeTiles::any);
  ForwardParams with_y = forward_problem(256, 2048);
  with_y.y = aligned_out();
  with_y.y_row_stride = 2048;
  EXPECT_EQ(choose_forward(with_y, device, {}).quantize.tiles, QuantizeTiles::any);
  ForwardParams odd_t = forward_problem(256, 2048);
  odd_t.qy_t_row_stride = 260;
  const QuantizeConfig q = choose_forward(odd_t, device, {}).quantize;
  EXPECT_EQ(q.tiles, QuantizeTiles::any);
  EXPECT_FALSE(q.qy_t_vector_stores);
}

TEST(Fp8NormConfig, GridsAndWorkspaces) {
  const detail::DeviceInfo device = h100_like();
  const ForwardConfig f = choose_forward(forward_problem(16384, 4096), device, {});
  EXPECT_EQ(stats_grid(f.stats, 16384, 132, 2), 264);                // 2048 row groups, 264 slots
  EXPECT_EQ(stats_grid(f.stats, 16384, 132, 20), 132 * kStatsBlocksPerSm);  // capped per SM
  EXPECT_EQ(stats_grid(f.stats, 100, 132, 2), 13);
  EXPECT_EQ(quantize_grid(f.quantize, 16384, 4096, 132, 3), 373);  // 4096 tiles, 11 per block
  EXPECT_EQ(quantize_grid(f.quantize, 0, 4096, 132, 3), 1);
  const BackwardConfig b = choose_backward(backward_problem(32768, 2048), h200_like(), {});
  EXPECT_EQ(backward_grid(b, 32768, 132, 2), 256);  // 8192 row groups in 32 rounds
  EXPECT_EQ(backward_grid(b, 32768, 132, 5), 256);  // at most 2 blocks per SM
  EXPECT_EQ(forward_workspace_bytes(16384, 4096, 132), 4352u);
  EXPECT_EQ(backward_workspace_bytes(16384, 4096, 132), std::size_t(132) * 2 * 4096 * 4);
  EXPECT_EQ(forward_workspace_bytes(0, 4096, 132), 0u);
}

// The override keys reach the config, and bad values are errors.
TEST(Fp8NormConfig, OverrideKeysForceChoices) {
  detail::clear_overrides();
  ForcedChoices f = forced_choices();
  EXPECT_EQ(f.stats, StatsDesign::automatic);
  EXPECT_EQ(f.stats_chunk_rounds, 0);
  EXPECT_EQ(f.stats_ring_slots, 0);
  EXPECT_EQ(f.backward, BackwardTuning::automatic);
  detail::set_overrides(
      "fp8_norm.stats=registers,fp8_norm.stats.chunk_rounds=1,fp8_norm.stats.ring_slots=5,"
      "fp8_norm.backward.tuning=two_runs_streaming");
  f = forced_choices();
  EXPECT_EQ(f.stats, StatsDesign::registers);
  EXPECT_EQ(f.stats_chunk_rounds, 1);
  EXPECT_EQ(f.stats_ring_slots, 5);
  EXPECT_EQ(f.backward, BackwardTuning::two_runs_streaming);
  EXPECT_EQ(choose_backward(backward_problem(64, 2048), h200_like(), f).runs_per_thread, 2);
  detail::set_override("fp8_norm.stats", "bulk");
  f = forced_choices();
  const StatsConfig s = choose_forward(forward_problem(256, 4096), h200_like(), f).stats;
  EXPECT_EQ(s.design, StatsDesign::bulk);
  EXPECT_EQ(s.ring.rounds, 1);
  EXPECT_EQ(s.ring.slots, 5);
  detail::set_override("fp8_norm.stats.ring_slots", "9");
  EXPECT_THROW(forced_choices(), Error);
  detail::set_override("fp8_norm.backward.tuning", "rich");
  detail::set_override("fp8_norm.stats.ring_slots", "");
  EXPECT_THROW(forced_choices(), Error);
  detail::clear_overrides();
}

// Every config over a grid of shapes, layouts and both devices.
TEST(Fp8NormConfig, EveryConfigFitsAndCoversItsRows) {
  std::vector<std::int64_t> cols_list;
  for (std::int64_t c = 16; c <= 20480; c += 16) cols_list.push_back(c);
  for (const detail::DeviceInfo& device : {h100_like(), h200_like()}) {
    for (std::int64_t cols : cols_list) {
      for (int group : {16, 32, 128}) {
        if (cols % group) continue;
        for (DType scales : {DType::bf16, DType::f32}) {
          SCOPED_TRACE(device.name + " N " + std::to_string(cols) + " G " + std::to_string(group));
          const ForwardConfig f = choose_forward(forward_problem(1000, cols, group, scales), device, {});
          EXPECT_LE(f.stats.smem_bytes, device.max_smem_per_block_optin);
          EXPECT_NE(f.stats.design, StatsDesign::generic);
          if (f.stats.design == StatsDesign::bulk) {
            EXPECT_EQ(cols % (std::int64_t(kStatsBulkRoundBytes) * f.stats.ring.rounds), 0);
            EXPECT_GE(f.stats.ring.slots, 2);
            EXPECT_LE(f.stats.ring.slots, kStatsBulkMaxSlots);
            EXPECT_LE(2 * (f.stats.smem_bytes + 4096), device.max_smem_per_block_optin);
          } else {
            EXPECT_EQ(f.stats.rows_per_block << f.stats.log2_row_threads, kStatsThreads);
          }
          const BackwardConfig b = choose_backward(backward_problem(1000, cols, group, scales), device, {});
          if (cols > 16384) {
            EXPECT_FALSE(b.vector);
            continue;
          }
          ASSERT_TRUE(b.vector);
          const int row_threads = 1 << b.log2_row_threads;
          EXPECT_GE(row_threads, 32);
          EXPECT_LE(row_threads, kBwdThreads);
          EXPECT_EQ(b.rows_per_block * row_threads, kBwdThreads);
          // The row's runs are covered, and an exact variant has no idle run slot.
          EXPECT_GE(std::int64_t(b.runs_per_thread) * row_threads * kRunCols, cols);
          if (b.variant != BackwardVariant::bounds_checked) {
            EXPECT_EQ(std::int64_t(b.runs_per_thread) * row_threads * kRunCols, cols);
          }
          if (b.variant == BackwardVariant::staged_scales_streaming) {
            EXPECT_EQ(b.runs_per_thread, 4);
            EXPECT_EQ(row_threads, 128);
          }
          EXPECT_LE(b.smem_bytes, device.max_smem_per_block_optin);
          for (std::int64_t rows : {std::int64_t(1), std::int64_t(1000), std::int64_t(100003)}) {
            const std::int64_t groups = (rows + b.rows_per_block - 1) / b.rows_per_block;
            const int grid = backward_grid(b, rows, device.sm_count, 2);
            EXPECT_GE(grid, 1);
            EXPECT_LE(grid, device.sm_count * 2);
            // Balanced: every block walks the same number of row groups, give or take one, and
            // no more rounds than the full grid would take.
            const std::int64_t cap = device.sm_count * 2;
            EXPECT_EQ((groups + grid - 1) / grid, std::max<std::int64_t>(1, (groups + cap - 1) / cap));
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace fusekit::fp8_norm
