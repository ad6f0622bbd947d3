// CUDA launchers for FP8 RMSNorm: pick the vector or generic kernels from the group size and
// alignment, size the persistent grids (the same answer for the workspace queries and the
// launches), and dispatch on the element types.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/choice_override.h"
#include "core/cuda_check.h"
#include "core/dependent_launch.h"
#include "core/device_info.h"
#include "core/launch_tuning.h"
#include "core/partial_rows.cuh"
#include "fp8_norm/fp8_norm_kernels.cuh"
#include "fp8_norm/fp8_norm_params.h"
#include "fp8_norm/fp8_norm_paths.h"

namespace fusekit::fp8_norm {

// ---- design overrides (tests and benchmarks) ------------------------------------------------

namespace {
using StatsChoice = detail::ChoiceOverride<StatsDesign>;
using TuningChoice = detail::ChoiceOverride<BackwardTuning>;
}  // namespace

const char* stats_design_name(StatsDesign design) {
  switch (design) {
    case StatsDesign::automatic: return "automatic";
    case StatsDesign::registers: return "registers";
    case StatsDesign::bulk: return "bulk";
    case StatsDesign::generic: return "generic";
  }
  return "unknown";
}
void set_stats_design_override(StatsDesign design) { StatsChoice::force(design); }
StatsDesign last_stats_design() { return StatsChoice::last(); }

const char* backward_tuning_name(BackwardTuning tuning) {
  switch (tuning) {
    case BackwardTuning::automatic: return "automatic";
    case BackwardTuning::rich_bandwidth: return "rich_bandwidth";
    case BackwardTuning::lean_bandwidth: return "lean_bandwidth";
  }
  return "unknown";
}
void set_backward_tuning_override(BackwardTuning tuning) { TuningChoice::force(tuning); }
BackwardTuning last_backward_tuning() { return TuningChoice::last(); }

namespace {

// The override, else FUSEKIT_FP8_STATS, else automatic.
StatsDesign requested_stats_design() {
  return StatsChoice::requested("FUSEKIT_FP8_STATS",
                                {{"registers", StatsDesign::registers}, {"bulk", StatsDesign::bulk}});
}

using namespace kernels;

// Upper bounds on resident blocks per SM that the grids (and hence the workspaces) are sized by.
constexpr int kStatsBlocksPerSm = 8;
constexpr int kBwdBlocksPerSm = 2;

bool aligned16(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; }

int log2_ceil(std::int64_t v) {
  int l = 0;
  while ((std::int64_t(1) << l) < v) ++l;
  return l;
}

std::size_t round_up_256(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

template <typename F>
void dispatch_fp8(DType dtype, F&& f) {
  if (dtype == DType::f8e4m3) f(E4M3{});
  else f(E5M2{});
}

template <typename F>
void dispatch_real(DType dtype, F&& f) {
  if (dtype == DType::bf16) f(__nv_bfloat16{});
  else f(float{});
}

// Resident blocks per SM of `kernel` at `threads` and `smem` bytes of dynamic shared memory, after
// letting it have them (detail::blocks_per_sm caches the answer and opts the kernel in past the
// default 48 KB, static shared memory counted).
template <typename Kernel>
int occupancy(const char* op, int device_index, Kernel kernel, int threads, std::size_t smem = 0) {
  return detail::blocks_per_sm(op, kernel, threads, smem, device_index);
}

using detail::launch_dependent;

int persistent_grid(std::int64_t work_items, std::int64_t cap) {
  return static_cast<int>(std::max<std::int64_t>(1, std::min(work_items, cap)));
}

// A persistent grid of at most `cap` blocks that gives every block the same number of work
// items, give or take one: no block starts a last round that most others do not have.
int balanced_grid(std::int64_t work_items, std::int64_t cap) {
  const std::int64_t rounds = std::max<std::int64_t>(1, (work_items + cap - 1) / std::max<std::int64_t>(1, cap));
  return persistent_grid((work_items + rounds - 1) / rounds, cap);
}

// ---- forward ---------------------------------------------------------------------------------

bool forward_vector_ok(const ForwardParams& p) {
  const std::int64_t tiles = ((p.rows + kTile - 1) / kTile) * ((p.cols + kTile - 1) / kTile);
  return tiles < (std::int64_t(1) << 31) && p.group_size >= 16 && p.x_row_stride % 16 == 0 && aligned16(p.x) && aligned16(p.weight) &&
         p.qy_row_stride % 16 == 0 && aligned16(p.qy) &&
         (p.y == nullptr || (p.y_row_stride % 8 == 0 && aligned16(p.y)));
}

// Launches the statistics kernel; returns its grid (the number of per-block maxima).
template <class XF, typename SC, typename W>
int launch_stats(const ForwardParams& p, bool vector, int sms, int device_index, float* block_amax,
                 cudaStream_t stream) {
  const char* op = "fp8_rms_norm_forward";
  auto check_capacity = [&](int grid) {
    const std::size_t need = static_cast<std::size_t>(grid) * sizeof(float);
    if (need > p.workspace_bytes)
      throw Error(ErrorKind::invalid_argument, op, "workspace", "at least " + std::to_string(need) + " bytes",
                  std::to_string(p.workspace_bytes) + " bytes");
  };
  int grid = 0;
  // The bulk-copy kernel: whole rounds (2048 columns: kStatsBulkRoundBytes of fp8), weights
  // staged in shared memory, 16-byte aligned rows and rounds of scales.
  const int round_scale_bytes = vector ? stats_bulk_round_scale_bytes<SC>(p.log2_group) : 0;
  const bool bulk_fits = vector && p.cols % kStatsBulkRoundBytes == 0 && p.cols <= kStatsSmemWeightCols &&
                         round_scale_bytes >= 16 && round_scale_bytes % 16 == 0 && aligned16(p.scales) &&
                         (p.scale_row_stride * std::int64_t(sizeof(SC))) % 16 == 0;
  if (bulk_fits && requested_stats_design() != StatsDesign::registers) {
    // Chunks of FUSEKIT_FP8_STATS_ROUNDS rounds (1, 2 or 4), FUSEKIT_FP8_STATS_STAGES chunk
    // slots per warp (2..8), fewer where two blocks would not fit on an SM. Default: rows of 4
    // or more rounds in 1-round chunks and 3 slots, shorter rows in 2-round chunks where the row
    // divides and 2 slots. Measured with the warp-wide copier (H200, session 37, forward us at
    // (16384, 4096) / (8192, 8192) / (32768, 2048), two runs): 2-round chunks in 2 / 3 slots
    // 83.9-84.0 / 86.6-86.9 / 84.0-84.6 and 83.8-83.9 / 86.6-86.8 / 85.4-85.5; 1-round chunks in
    // 2 / 3 / 4 slots 84.1-84.4 / 85.6-85.8 / 84.5-84.8, 85.0-85.3 / 85.1-85.2 / 85.2-85.8 and
    // 84.9-85.2 / 87.0-87.4 / 86.5-86.7; the register kernel 86.5-86.7 / 88.3-88.4 / 87.4-87.7.
    // (N = 2048 has one round per row, so its chunks are 1 round whatever is asked.) More blocks
    // per SM (registers cut for 3 or 4) measured slower: performance-notes.md, FP8 "Session 36".
    const int row_rounds = static_cast<int>(p.cols / kStatsBulkRoundBytes);
    const bool long_rows = row_rounds >= 4;
    StatsBulkShape shape{detail::env_knob("FUSEKIT_FP8_STATS_ROUNDS", 1, 4, long_rows ? 1 : 2), 0, 0, 0};
    while (shape.rounds > 1 && row_rounds % shape.rounds != 0) shape.rounds /= 2;
    shape.stages = detail::env_knob("FUSEKIT_FP8_STATS_STAGES", 2, kStatsBulkMaxStages, long_rows ? 3 : 2);
    const std::size_t optin = detail::device_info(op, device_index).max_smem_per_block_optin;
    // Two blocks per SM (16 warps): ~4 KB of static shared memory and reserve per block.
    while (shape.stages > 2 && 2 * (stats_bulk_smem_bytes<SC>(p.cols, p.log2_group, shape) + 4096) > optin)
      --shape.stages;
    while (shape.rounds > 1 && 2 * (stats_bulk_smem_bytes<SC>(p.cols, p.log2_group, shape) + 4096) > optin)
      shape.rounds /= 2;
    const std::size_t smem = stats_bulk_smem_bytes<SC>(p.cols, p.log2_group, shape);
    auto kernel = stats_bulk_kernel<XF, SC, W>;
    const int per_sm = std::min(kStatsBlocksPerSm, occupancy(op, device_index, kernel, kStatsThreads, smem));
    grid = persistent_grid((p.rows + kStatsBulkWarps - 1) / kStatsBulkWarps, std::int64_t(sms) * per_sm);
    check_capacity(grid);
    const std::int64_t row_step = std::int64_t(grid) * kStatsBulkWarps;
    shape.x_row_jump = row_step * p.x_row_stride - p.cols;
    shape.scale_row_jump = (row_step * p.scale_row_stride - (p.cols >> p.log2_group)) * std::int64_t(sizeof(SC));
    kernel<<<grid, kStatsThreads, smem, stream>>>(p, shape, block_amax);
    StatsChoice::record(StatsDesign::bulk);
  } else if (vector) {
    StatsChoice::record(StatsDesign::registers);
    const int log2_tpr = std::min(5, log2_ceil(p.cols / 16));
    const int rows_per_block = kStatsThreads >> log2_tpr;
    auto run = [&](auto kernel, std::size_t smem) {
      const int per_sm = std::min(kStatsBlocksPerSm, occupancy(op, device_index, kernel, kStatsThreads, smem));
      grid = persistent_grid((p.rows + rows_per_block - 1) / rows_per_block, std::int64_t(sms) * per_sm);
      check_capacity(grid);
      kernel<<<grid, kStatsThreads, smem, stream>>>(p, log2_tpr, block_amax);
    };
    const bool whole_rounds = (p.cols / 16) % ((std::int64_t(1) << log2_tpr) * kStatsUnroll) == 0;
    const std::size_t weight_bytes = static_cast<std::size_t>(p.cols) * sizeof(float);
    if (p.cols > kStatsSmemWeightCols)
      run(stats_vector_kernel<XF, SC, W, false, false>, 0);
    else if (whole_rounds)
      run(stats_vector_kernel<XF, SC, W, true, true>, weight_bytes);
    else
      run(stats_vector_kernel<XF, SC, W, true, false>, weight_bytes);
  } else {
    StatsChoice::record(StatsDesign::generic);
    auto kernel = stats_generic_kernel<XF, SC, W>;
    const int per_sm = std::min(kStatsBlocksPerSm, occupancy(op, device_index, kernel, kStatsThreads));
    grid = persistent_grid((p.rows + kGenericStatsRowsPerBlock - 1) / kGenericStatsRowsPerBlock,
                           std::int64_t(sms) * per_sm);
    check_capacity(grid);
    kernel<<<grid, kStatsThreads, 0, stream>>>(p, block_amax);
  }
  detail::check_launch(op, "fp8 rms norm statistics kernel");
  return grid;
}

template <class XF, class QF, typename SC, typename W>
void launch_quantize(const ForwardParams& p, bool vector, int sms, int device_index, const float* block_amax,
                     int block_count, cudaStream_t stream) {
  const char* op = "fp8_rms_norm_forward";
  if (vector) {
    const bool t_vector = aligned16(p.qy_t) && p.qy_t_row_stride % 16 == 0;
    const bool whole_tiles = p.rows % kTile == 0 && p.cols % kTile == 0 && t_vector && p.y == nullptr;
    auto kernel = whole_tiles ? quantize_vector_kernel<XF, QF, SC, W, true>
                              : quantize_vector_kernel<XF, QF, SC, W, false>;
    const std::size_t smem = kQuantSmemBytes;
    const std::int64_t tiles = ((p.rows + kTile - 1) / kTile) * ((p.cols + kTile - 1) / kTile);
    // Persistent, as many blocks as fit at once, and sized so that every block gets the same
    // number of tiles give or take one (no block starts a last round that others do not).
    const std::int64_t capacity = std::int64_t(sms) * occupancy(op, device_index, kernel, kQuantThreads, smem);
    const std::int64_t per_block = std::max<std::int64_t>(1, (tiles + capacity - 1) / capacity);
    const int grid = persistent_grid((tiles + per_block - 1) / per_block, capacity);
    launch_dependent(kernel, dim3(grid), dim3(kQuantThreads), smem, stream, p, block_amax, block_count, t_vector);
  } else {
    auto kernel = quantize_generic_kernel<XF, QF, SC, W>;
    const std::int64_t tiles =
        ((p.rows + kGenericTile - 1) / kGenericTile) * ((p.cols + kGenericTile - 1) / kGenericTile);
    const int grid = persistent_grid(tiles, std::int64_t(sms) * occupancy(op, device_index, kernel, kQuantThreads));
    kernel<<<grid, kQuantThreads, 0, stream>>>(p, block_amax, block_count);
  }
  detail::check_launch(op, "fp8 rms norm quantize/transpose kernel");
}

// ---- backward --------------------------------------------------------------------------------

// Devices with fewer DRAM bytes per SM clock than this take the lean-bandwidth tuning.
constexpr double kLeanBandwidthBytesPerSmClock = 15.0;

// The override, else FUSEKIT_FP8_BWD_TUNING, else by the device's bandwidth per SM clock.
BackwardTuning backward_tuning(int device_index) {
  const BackwardTuning requested = TuningChoice::requested(
      "FUSEKIT_FP8_BWD_TUNING", {{"lean", BackwardTuning::lean_bandwidth}, {"rich", BackwardTuning::rich_bandwidth}});
  if (requested != BackwardTuning::automatic) return requested;
  const double bytes = detail::device_info("fp8_rms_norm_backward", device_index).dram_bytes_per_sm_clock;
  return bytes > 0.0 && bytes < kLeanBandwidthBytesPerSmClock ? BackwardTuning::lean_bandwidth
                                                              : BackwardTuning::rich_bandwidth;
}

struct BackwardConfig {
  bool vector = false;
  int octs = 2;      // 8-column runs per thread and row (vector path): 2, 4 or 8
  int log2_tpr = 0;  // threads per row group (vector path)
  int rows_per_block = 1;
  bool stream_hints = false;  // the staged kernel's L2 evict-first copies and streaming dx stores
};

// The vector backward's shape. Rich bandwidth (H200), session 9 on: 4 octs per thread in groups
// of 32 to 256 threads, 8 octs for the longest rows. Lean bandwidth (H100 SXM), session 40, us at
// (32768, 2048) / (16384, 4096) / (8192, 8192), three alternating runs each on one H100 against
// one H200 in the same session:
//   - rows of 129-256 octs (N 1032-2048) in 128-thread groups of 2 octs, not 64-thread groups of
//     4: H100 133.1-133.6 -> 127.2-127.6; H200 91.2-91.4 -> 103.6-103.9 (so the H200 keeps 4);
//   - the N = 4096 staged kernel with stream hints: H100 135.1-136.4 -> 132.5-133.3; H200
//     94.1-94.3 -> 105.8-105.9. The same hints at N = 8192 (H100 131.2-131.6 -> 134.1-134.6)
//     and on the 2-oct N = 2048 kernel (127.3-127.6 -> 129.6-129.8) lost, so they stay off there.
// Tried on the H100 and not taken: N = 4096 in one 256-thread group of 2 octs (144.5-144.8),
// every block slot filled instead of balanced grids (+-0.5), one dweight partial row per row
// group instead of a combine in shared memory (137.0-137.5).
BackwardConfig choose_backward(const BackwardParams& p, BackwardTuning tuning) {
  BackwardConfig c;
  const bool aligned = p.group_size >= 16 && p.x_row_stride % 16 == 0 && aligned16(p.x) &&
                       p.dy_row_stride % 8 == 0 && aligned16(p.dy) && aligned16(p.weight) &&
                       (p.dx == nullptr || (p.dx_row_stride % 8 == 0 && aligned16(p.dx)));
  const std::int64_t nocts = p.cols / 8;
  if (!aligned) return c;
  // Row groups of 32 to 256 threads with 4 octs each (32 columns: the per-row work, row sum and
  // addresses, is shared by that many elements), or 256 threads with 8 octs: up to 2048 octs
  // (N = 16384). Longer rows take the generic kernel.
  const bool lean = tuning == BackwardTuning::lean_bandwidth;
  if (lean && nocts > 128 && nocts <= 256) c.octs = 2;
  else if (nocts <= 1024) c.octs = 4;
  else if (nocts <= 2048) c.octs = 8;
  else return c;
  c.log2_tpr = std::max(5, log2_ceil((nocts + c.octs - 1) / c.octs));
  c.vector = true;
  c.rows_per_block = kBwdThreads >> c.log2_tpr;
  c.stream_hints = lean && c.octs == 4 && c.log2_tpr == 7;  // applies where the scales are staged
  return c;
}

template <class XF, typename SC, typename W>
int launch_backward_main(const BackwardParams& p, const BackwardConfig& c, int sms, int device_index,
                         float* partial, std::size_t partial_capacity_bytes, cudaStream_t stream) {
  const char* op = "fp8_rms_norm_backward";
  auto check_capacity = [&](int grid) {
    const std::size_t need = static_cast<std::size_t>(grid) * p.cols * sizeof(float);
    if (partial && need > partial_capacity_bytes)
      throw Error(ErrorKind::invalid_argument, op, "workspace",
                  "at least " + std::to_string(need) + " bytes", std::to_string(partial_capacity_bytes) + " bytes");
  };
  int grid = 0;
  if (c.vector) {
    auto run = [&](auto kernel, std::size_t smem) {
      const int per_sm = std::min(kBwdBlocksPerSm, occupancy(op, device_index, kernel, kBwdThreads, smem));
      grid = balanced_grid((p.rows + c.rows_per_block - 1) / c.rows_per_block, std::int64_t(sms) * per_sm);
      check_capacity(grid);
      kernel<<<grid, kBwdThreads, smem, stream>>>(p, partial);
    };
    const int tpr = 1 << c.log2_tpr;
    // Rows of exactly octs * tpr octs (N = 1024, 2048, 4096, 8192) take the variant without
    // per-oct bounds tests (20% fewer instructions per row). With 8 octs per thread that variant
    // would spill.
    const bool all_octs = p.cols == std::int64_t(8) * c.octs * tpr;
    // Those rows' scales can come through the copy pipeline when they are 16-byte chunks: groups
    // of 16 and 16-byte aligned scale rows.
    const bool staged_scales = all_octs && p.log2_group == 4 && aligned16(p.scales) &&
                               (p.scale_row_stride * std::int64_t(sizeof(SC))) % 16 == 0;
    // K octs per thread in groups of 2^LOG2 threads: the staged-scales, all-octs or bounds-tested
    // kernel (and, lean tuning, the staged one with L2 hints: K = 4 in 128-thread groups only).
    auto run_octs = [&](auto octs, auto log2_tpr) {
      constexpr int K = decltype(octs)::value, kLog2 = decltype(log2_tpr)::value;
      if constexpr (K == 4 && kLog2 == 7) {
        if (staged_scales && c.stream_hints) {
          run(backward_vector_kernel<XF, SC, W, K, kLog2, true, true, true>,
              backward_smem_bytes<K>(tpr) + backward_scale_stage_bytes<K, SC>());
          return;
        }
      }
      if (staged_scales)
        run(backward_vector_kernel<XF, SC, W, K, kLog2, true, true>,
            backward_smem_bytes<K>(tpr) + backward_scale_stage_bytes<K, SC>());
      else if (all_octs) run(backward_vector_kernel<XF, SC, W, K, kLog2, true>, backward_smem_bytes<K>(tpr));
      else run(backward_vector_kernel<XF, SC, W, K, kLog2, false>, backward_smem_bytes<K>(tpr));
    };
    using std::integral_constant;
    using K2 = integral_constant<int, 2>;
    using K4 = integral_constant<int, 4>;
    if (c.octs == 2) run_octs(K2{}, integral_constant<int, 7>{});  // lean tuning (choose_backward)
    else if (c.octs == 8) run(backward_vector_kernel<XF, SC, W, 8, 8, false>, backward_smem_bytes<8>(tpr));
    else if (c.log2_tpr == 5) run_octs(K4{}, integral_constant<int, 5>{});
    else if (c.log2_tpr == 6) run_octs(K4{}, integral_constant<int, 6>{});
    else if (c.log2_tpr == 7) run_octs(K4{}, integral_constant<int, 7>{});
    else run_octs(K4{}, integral_constant<int, 8>{});
  } else {
    auto kernel = backward_generic_kernel<XF, SC, W>;
    const int per_sm = std::min(kBwdBlocksPerSm, occupancy(op, device_index, kernel, kGenericBwdThreads));
    grid = persistent_grid(p.rows, std::int64_t(sms) * per_sm);
    check_capacity(grid);
    kernel<<<grid, kGenericBwdThreads, 0, stream>>>(p, partial);
  }
  detail::check_launch(op, "fp8 rms norm backward kernel");
  return grid;
}

}  // namespace

std::size_t forward_workspace_cuda(std::int64_t rows, std::int64_t cols, int device_index) {
  if (rows <= 0 || cols <= 0) return 0;
  const int sms = detail::device_info("fp8_rms_norm_forward_workspace_size", device_index).sm_count;
  return round_up_256(static_cast<std::size_t>(sms) * kStatsBlocksPerSm * sizeof(float));
}

std::size_t backward_workspace_cuda(std::int64_t rows, std::int64_t cols, int device_index) {
  if (rows <= 0 || cols <= 0) return 0;
  const int sms = detail::device_info("fp8_rms_norm_backward_workspace_size", device_index).sm_count;
  return round_up_256(static_cast<std::size_t>(sms) * kBwdBlocksPerSm * cols * sizeof(float));
}

void forward_cuda(const ForwardParams& params, int device_index, Stream stream) {
  const char* op = "fp8_rms_norm_forward";
  detail::DeviceGuard guard(op, device_index);
  const auto s = static_cast<cudaStream_t>(stream);
  const detail::DeviceInfo& device = detail::device_info(op, device_index);
  ForwardParams p = params;
  // The rows of x that the statistics pass reads last (and the quantize pass, walking the rows
  // backwards, reads first) are kept in L2 with an evict-last priority: 40% of L2 (24 MB on the
  // H200), the best of 16-40 MB measured there (session 28: forward (16384, 4096) 87.8 -> 86.8
  // us, (8192, 8192) 89.6 -> 88.5, (32768, 2048) even at 87.7; two runs each, the same binary).
  const std::int64_t keep_rows =
      static_cast<std::int64_t>(0.4 * device.l2_bytes) / std::max<std::int64_t>(1, p.x_row_stride);
  p.l2_keep_from_row = std::max<std::int64_t>(0, p.rows - keep_rows);
  const int sms = device.sm_count;
  const bool vector = forward_vector_ok(p);
  StatsChoice::record(StatsDesign::automatic);
  float* block_amax = static_cast<float*>(p.workspace);
  int block_count = 0;
  dispatch_fp8(p.x_dtype, [&](auto xf) {
    dispatch_real(p.scale_dtype, [&](auto sc) {
      dispatch_real(p.weight_dtype, [&](auto w) {
        using XF = decltype(xf);
        using SC = decltype(sc);
        using W = decltype(w);
        if (p.rows > 0) block_count = launch_stats<XF, SC, W>(p, vector, sms, device_index, block_amax, s);
        // Launched even for M = 0: it writes the scale of the empty tensor.
        dispatch_fp8(p.q_dtype, [&](auto qf) {
          launch_quantize<XF, decltype(qf), SC, W>(p, vector, sms, device_index, block_amax, block_count, s);
        });
      });
    });
  });
}

void backward_cuda(const BackwardParams& p, int device_index, Stream stream) {
  const char* op = "fp8_rms_norm_backward";
  detail::DeviceGuard guard(op, device_index);
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.rows == 0) {
    // The weight gradient of an empty batch is zero (all-zero bits are 0.0 in bf16 and f32).
    if (p.dweight)
      FUSEKIT_CUDA_CHECK(op, cudaMemsetAsync(p.dweight, 0, p.cols * dtype_size(p.weight_dtype), s));
    return;
  }
  if (!p.dx && !p.dweight) return;
  const int sms = detail::device_info(op, device_index).sm_count;
  const BackwardTuning tuning = backward_tuning(device_index);
  const BackwardConfig config = choose_backward(p, tuning);
  TuningChoice::record(config.vector ? tuning : BackwardTuning::automatic);
  float* partial = p.dweight ? static_cast<float*>(p.workspace) : nullptr;
  dispatch_fp8(p.x_dtype, [&](auto xf) {
    dispatch_real(p.scale_dtype, [&](auto sc) {
      dispatch_real(p.weight_dtype, [&](auto w) {
        using W = decltype(w);
        const int grid = launch_backward_main<decltype(xf), decltype(sc), W>(p, config, sms, device_index,
                                                                            partial, p.workspace_bytes, s);
        if (partial)
          detail::device::launch_sum_partial_rows(static_cast<const float*>(partial), grid, p.cols,
                                                  static_cast<W*>(p.dweight), s, op,
                                                  "fp8 rms norm dweight reduction kernel");
      });
    });
  });
}

}  // namespace fusekit::fp8_norm
