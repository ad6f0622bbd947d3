// Launch choices of the FP8 RMSNorm CUDA kernels: which kernel, which compile-time variant, its
// shared memory and its persistent grid, as pure functions of the call (the params structs), the
// device (detail::DeviceInfo) and the forced choices, with no CUDA calls, so that they are tested
// on the CPU (tests/fp8_norm/test_fp8_norm_config.cpp). The occupancy of the chosen kernel is an
// input of the grid functions: the launcher queries it for the config's kernel and shared memory.
// Also the kernels' block sizes and shared-memory layouts, which both sides need.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/device_info.h"
#include "fp8_norm/fp8_norm_params.h"
#include "fp8_norm/fp8_norm_paths.h"

namespace fusekit::fp8_norm {

// ---- kernel shapes ---------------------------------------------------------------------------

// Statistics (forward 1).
inline constexpr int kStatsThreads = 256;
inline constexpr int kStatsUnroll = 4;  // 16-byte vectors in flight per thread
// Rows up to this long stage their weights in shared memory (64 KB of floats).
inline constexpr std::int64_t kStatsSmemWeightCols = 16384;
// Bulk-copy statistics: one warp per row, rounds of 32 * kStatsUnroll vectors (2 KB of fp8).
inline constexpr int kStatsBulkWarps = kStatsThreads / 32;
inline constexpr int kStatsBulkRoundVectors = 32 * kStatsUnroll;
inline constexpr int kStatsBulkRoundBytes = kStatsBulkRoundVectors * 16;
inline constexpr int kStatsBulkMaxSlots = 8;
// Generic statistics: one warp per row.
inline constexpr int kGenericStatsRowsPerBlock = kStatsThreads / 32;

// Quantize + transpose (forward 2).
inline constexpr int kQuantThreads = 256;
inline constexpr int kTile = 128;  // rows and columns of a vector-path tile
inline constexpr int kGenericTile = 64;
// x tiles in shared memory: the current one and three ahead.
inline constexpr int kQuantStages = 4;
inline constexpr int kQuantSmemBytes = kQuantStages * kTile * kTile;

// Backward. A thread of the vector kernel owns runs of 8 columns of a row (8 fp8 bytes of x, 16
// bytes of dy and dx: every warp-wide access is contiguous).
inline constexpr int kBwdThreads = 256;
inline constexpr int kGenericBwdThreads = 256;
inline constexpr int kRunCols = 8;

// Upper bounds on resident blocks per SM that the grids (and hence the workspaces) are sized by.
inline constexpr int kStatsBlocksPerSm = 8;
inline constexpr int kBwdBlocksPerSm = 2;

// The bulk statistics kernel's ring: each warp owns `slots` slots of one chunk (`rounds` rounds of
// x, then their scales). A kernel argument.
struct StatsRing {
  int rounds;  // rounds per chunk (per copy)
  int slots;   // chunk slots per warp, 2 .. kStatsBulkMaxSlots
  // Bytes from the end of a row of x (of its scales) to the start of the warp's next row: set by
  // the launcher once the grid is known, so that the copier does not recompute them every chunk.
  std::int64_t x_row_jump = 0, scale_row_jump = 0;
};

// Bytes of one round's scales: one scale per 2^log2_group columns (log2_group >= 4).
constexpr int stats_bulk_round_scale_bytes(int log2_group, int scale_bytes) {
  return (kStatsBulkRoundVectors >> (log2_group - 4)) * scale_bytes;
}
// Dynamic shared memory of the bulk statistics kernel: the staged weights (4 N bytes), then a
// ring per warp.
constexpr std::size_t stats_bulk_smem_bytes(std::int64_t cols, int log2_group, int scale_bytes, StatsRing ring) {
  const std::size_t slot = static_cast<std::size_t>(ring.rounds) *
                           (kStatsBulkRoundBytes + stats_bulk_round_scale_bytes(log2_group, scale_bytes));
  return static_cast<std::size_t>(cols) * sizeof(float) + std::size_t(kStatsBulkWarps) * ring.slots * slot;
}

// Rows of x and dy the vector backward stages in shared memory (the current one and the rest
// ahead), by runs per thread: deep enough to keep HBM busy at two blocks per SM while a block's
// shared memory stays within half an SM.
constexpr int backward_stages(int runs) { return runs <= 2 ? 4 : (runs == 4 ? 3 : 2); }
// Dynamic shared memory of the vector backward: the staged float weights (32 bytes per run slot
// of a row) and the staged rows (8 bytes of x and 16 of dy per thread and run).
constexpr std::size_t backward_smem_bytes(int runs, int row_threads) {
  return std::size_t(row_threads) * runs * 32 + std::size_t(backward_stages(runs)) * runs * kBwdThreads * 24;
}
// With staged scales, each stage also holds every warp's scales of its row: 16 per run slot.
constexpr std::size_t backward_scale_stage_bytes(int runs, int scale_bytes) {
  return std::size_t(backward_stages(runs)) * (kBwdThreads / 32) * runs * 16 * scale_bytes;
}

// ---- compile-time variants -------------------------------------------------------------------

// The register statistics kernel.
enum class StatsVariant : int {
  global_weights,               // N > kStatsSmemWeightCols: weights read through the read-only cache
  staged_weights,               // weights staged in shared memory; bounds tests on the last round
  staged_weights_whole_rounds,  // and the row is whole rounds of the row group: no bounds tests
};

// The vector quantize kernel.
enum class QuantizeTiles : int {
  any,    // tiles at the tensor's edges take a path with bounds tests
  whole,  // M and N multiples of the tile, 16-byte qy_t stores, no y output: only the full-tile path
};

// The vector backward kernel.
enum class BackwardVariant : int {
  bounds_checked,           // runs past the row's end are tested and skipped
  exact_rows,               // the row is exactly runs * row threads runs: no per-run tests
  staged_scales,            // exact rows whose scales come through the copy pipeline (groups of
                            // 16, 16-byte aligned scale rows)
  staged_scales_streaming,  // and x and dy copied evict-first, dx stored streaming
};

// ---- choices ---------------------------------------------------------------------------------

// Choices forced by tests or override keys (0 / automatic: the table's).
struct ForcedChoices {
  StatsDesign stats = StatsDesign::automatic;
  int stats_chunk_rounds = 0;  // 1..4
  int stats_ring_slots = 0;    // 2..kStatsBulkMaxSlots
  BackwardTuning backward = BackwardTuning::automatic;
};

// The choices forced now: a test's (set_stats_design_override, set_backward_tuning_override),
// else the override keys' (core/overrides.h): "fp8_norm.stats", "fp8_norm.stats.chunk_rounds",
// "fp8_norm.stats.ring_slots", "fp8_norm.backward.tuning". The launcher's only non-pure input.
ForcedChoices forced_choices();

struct StatsConfig {
  StatsDesign design = StatsDesign::generic;           // registers, bulk or generic
  StatsVariant variant = StatsVariant::global_weights;  // registers
  int log2_row_threads = 0;                             // registers: threads per row, 1..32
  int rows_per_block = kGenericStatsRowsPerBlock;
  StatsRing ring{1, 2};  // bulk
  std::size_t smem_bytes = 0;
};

struct QuantizeConfig {
  bool vector = false;
  QuantizeTiles tiles = QuantizeTiles::any;
  bool qy_t_vector_stores = false;  // 16-byte stores along qy_t's rows where a tile is whole
  std::size_t smem_bytes = 0;
};

struct ForwardConfig {
  // Rows at or past this one are read by the statistics pass with an L2 evict-last priority (the
  // quantize pass, walking the rows backwards, reads them first).
  std::int64_t l2_keep_from_row = 0;
  StatsConfig stats;
  QuantizeConfig quantize;
};

struct BackwardConfig {
  bool vector = false;
  BackwardTuning tuning = BackwardTuning::automatic;  // the vector kernel's tuning (automatic: generic)
  int runs_per_thread = 0;
  int log2_row_threads = 0;  // threads per row group, 32..256
  int rows_per_block = 1;
  BackwardVariant variant = BackwardVariant::bounds_checked;
  std::size_t smem_bytes = 0;
};

// The vector paths need 16-element vectors inside one scale group and 16-byte aligned rows.
bool forward_vector_ok(const ForwardParams& p);

ForwardConfig choose_forward(const ForwardParams& p, const detail::DeviceInfo& device, const ForcedChoices& forced);
BackwardTuning choose_backward_tuning(const detail::DeviceInfo& device, BackwardTuning forced);
BackwardConfig choose_backward(const BackwardParams& p, const detail::DeviceInfo& device, const ForcedChoices& forced);

// Persistent grids from the chosen kernel's resident blocks per SM (the occupancy calculator's
// answer for the config's kernel, block size and shared memory).
int stats_grid(const StatsConfig& c, std::int64_t rows, int sm_count, int blocks_per_sm);
int quantize_grid(const QuantizeConfig& c, std::int64_t rows, std::int64_t cols, int sm_count, int blocks_per_sm);
int backward_grid(const BackwardConfig& c, std::int64_t rows, int sm_count, int blocks_per_sm);

// Workspace bytes: one float per statistics block, one partial dweight row per backward block.
std::size_t forward_workspace_bytes(std::int64_t rows, std::int64_t cols, int sm_count);
std::size_t backward_workspace_bytes(std::int64_t rows, std::int64_t cols, int sm_count);

}  // namespace fusekit::fp8_norm
