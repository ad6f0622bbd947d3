// CUDA launchers for FP8 RMSNorm: take the launch choices from fp8_norm_config.h, query the
// chosen kernel's occupancy for its grid, and dispatch on the element types.
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
#include "fp8_norm/fp8_norm_config.h"
#include "fp8_norm/fp8_norm_kernels.cuh"
#include "fp8_norm/fp8_norm_params.h"
#include "fp8_norm/fp8_norm_paths.h"

namespace fusekit::fp8_norm {

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
    case BackwardTuning::four_runs_cached: return "four_runs_cached";
    case BackwardTuning::two_runs_streaming: return "two_runs_streaming";
  }
  return "unknown";
}
void set_backward_tuning_override(BackwardTuning tuning) { TuningChoice::force(tuning); }
BackwardTuning last_backward_tuning() { return TuningChoice::last(); }

namespace {

using namespace kernels;
using detail::launch_dependent;

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

// ---- forward ---------------------------------------------------------------------------------

// Launches the statistics kernel; returns its grid (the number of per-block maxima).
template <class XF, typename SC, typename W>
int launch_stats(const ForwardParams& p, const StatsConfig& c, int sms, int device_index, float* block_amax,
                 cudaStream_t stream) {
  const char* op = "fp8_rms_norm_forward";
  int grid = 0;
  auto run = [&](auto kernel, auto&&... args) {
    grid = stats_grid(c, p.rows, sms, occupancy(op, device_index, kernel, kStatsThreads, c.smem_bytes));
    const std::size_t need = static_cast<std::size_t>(grid) * sizeof(float);
    if (need > p.workspace_bytes)
      throw Error(ErrorKind::invalid_argument, op, "workspace", "at least " + std::to_string(need) + " bytes",
                  std::to_string(p.workspace_bytes) + " bytes");
    kernel<<<grid, kStatsThreads, c.smem_bytes, stream>>>(p, args(grid)..., block_amax);
  };
  StatsChoice::record(c.design);
  switch (c.design) {
    case StatsDesign::bulk:
      run(stats_bulk_kernel<XF, SC, W>, [&](int g) {
        StatsRing ring = c.ring;
        const std::int64_t row_step = std::int64_t(g) * kStatsBulkWarps;
        ring.x_row_jump = row_step * p.x_row_stride - p.cols;
        ring.scale_row_jump = (row_step * p.scale_row_stride - (p.cols >> p.log2_group)) * std::int64_t(sizeof(SC));
        return ring;
      });
      break;
    case StatsDesign::registers: {
      auto log2_row_threads = [&](int) { return c.log2_row_threads; };
      switch (c.variant) {
        case StatsVariant::global_weights:
          run(stats_vector_kernel<XF, SC, W, StatsVariant::global_weights>, log2_row_threads);
          break;
        case StatsVariant::staged_weights:
          run(stats_vector_kernel<XF, SC, W, StatsVariant::staged_weights>, log2_row_threads);
          break;
        case StatsVariant::staged_weights_whole_rounds:
          run(stats_vector_kernel<XF, SC, W, StatsVariant::staged_weights_whole_rounds>, log2_row_threads);
          break;
      }
      break;
    }
    default: run(stats_generic_kernel<XF, SC, W>); break;
  }
  detail::check_launch(op, "fp8 rms norm statistics kernel");
  return grid;
}

template <class XF, class QF, typename SC, typename W>
void launch_quantize(const ForwardParams& p, const QuantizeConfig& c, int sms, int device_index,
                     const float* block_amax, int block_count, cudaStream_t stream) {
  const char* op = "fp8_rms_norm_forward";
  if (c.vector) {
    auto kernel = c.tiles == QuantizeTiles::whole ? quantize_vector_kernel<XF, QF, SC, W, QuantizeTiles::whole>
                                                  : quantize_vector_kernel<XF, QF, SC, W, QuantizeTiles::any>;
    const int grid =
        quantize_grid(c, p.rows, p.cols, sms, occupancy(op, device_index, kernel, kQuantThreads, c.smem_bytes));
    launch_dependent(kernel, dim3(grid), dim3(kQuantThreads), c.smem_bytes, stream, p, block_amax, block_count,
                     c.qy_t_vector_stores);
  } else {
    auto kernel = quantize_generic_kernel<XF, QF, SC, W>;
    const int grid = quantize_grid(c, p.rows, p.cols, sms, occupancy(op, device_index, kernel, kQuantThreads));
    kernel<<<grid, kQuantThreads, 0, stream>>>(p, block_amax, block_count);
  }
  detail::check_launch(op, "fp8 rms norm quantize/transpose kernel");
}

// ---- backward --------------------------------------------------------------------------------

template <class XF, typename SC, typename W>
int launch_backward_main(const BackwardParams& p, const BackwardConfig& c, int sms, int device_index,
                         float* partial, std::size_t partial_capacity_bytes, cudaStream_t stream) {
  const char* op = "fp8_rms_norm_backward";
  int grid = 0;
  auto run = [&](auto kernel, int threads) {
    grid = backward_grid(c, p.rows, sms, occupancy(op, device_index, kernel, threads, c.smem_bytes));
    const std::size_t need = static_cast<std::size_t>(grid) * p.cols * sizeof(float);
    if (partial && need > partial_capacity_bytes)
      throw Error(ErrorKind::invalid_argument, op, "workspace",
                  "at least " + std::to_string(need) + " bytes", std::to_string(partial_capacity_bytes) + " bytes");
    kernel<<<grid, threads, c.smem_bytes, stream>>>(p, partial);
  };
  // The kernels of RUNS runs per thread in groups of 2^LOG2 threads, by variant (the streaming
  // one exists for 4 runs in 128-thread groups only: elsewhere the config never asks for it).
  auto run_variant = [&](auto runs, auto log2_row_threads) {
    constexpr int kRuns = decltype(runs)::value, kLog2 = decltype(log2_row_threads)::value;
    switch (c.variant) {
      case BackwardVariant::staged_scales_streaming:
        if constexpr (kRuns == 4 && kLog2 == 7)
          run(backward_vector_kernel<XF, SC, W, kRuns, kLog2, BackwardVariant::staged_scales_streaming>, kBwdThreads);
        else
          run(backward_vector_kernel<XF, SC, W, kRuns, kLog2, BackwardVariant::staged_scales>, kBwdThreads);
        break;
      case BackwardVariant::staged_scales:
        run(backward_vector_kernel<XF, SC, W, kRuns, kLog2, BackwardVariant::staged_scales>, kBwdThreads);
        break;
      case BackwardVariant::exact_rows:
        run(backward_vector_kernel<XF, SC, W, kRuns, kLog2, BackwardVariant::exact_rows>, kBwdThreads);
        break;
      case BackwardVariant::bounds_checked:
        run(backward_vector_kernel<XF, SC, W, kRuns, kLog2, BackwardVariant::bounds_checked>, kBwdThreads);
        break;
    }
  };
  using std::integral_constant;
  using Runs2 = integral_constant<int, 2>;
  using Runs4 = integral_constant<int, 4>;
  if (!c.vector) run(backward_generic_kernel<XF, SC, W>, kGenericBwdThreads);
  else if (c.runs_per_thread == 2) run_variant(Runs2{}, integral_constant<int, 7>{});
  else if (c.runs_per_thread == 8)
    run(backward_vector_kernel<XF, SC, W, 8, 8, BackwardVariant::bounds_checked>, kBwdThreads);
  else if (c.log2_row_threads == 5) run_variant(Runs4{}, integral_constant<int, 5>{});
  else if (c.log2_row_threads == 6) run_variant(Runs4{}, integral_constant<int, 6>{});
  else if (c.log2_row_threads == 7) run_variant(Runs4{}, integral_constant<int, 7>{});
  else run_variant(Runs4{}, integral_constant<int, 8>{});
  detail::check_launch(op, "fp8 rms norm backward kernel");
  return grid;
}

}  // namespace

std::size_t forward_workspace_cuda(std::int64_t rows, std::int64_t cols, int device_index) {
  if (rows <= 0 || cols <= 0) return 0;
  return forward_workspace_bytes(rows, cols,
                                 detail::device_info("fp8_rms_norm_forward_workspace_size", device_index).sm_count);
}

std::size_t backward_workspace_cuda(std::int64_t rows, std::int64_t cols, int device_index) {
  if (rows <= 0 || cols <= 0) return 0;
  return backward_workspace_bytes(rows, cols,
                                  detail::device_info("fp8_rms_norm_backward_workspace_size", device_index).sm_count);
}

void forward_cuda(const ForwardParams& params, int device_index, Stream stream) {
  const char* op = "fp8_rms_norm_forward";
  detail::DeviceGuard guard(op, device_index);
  const auto s = static_cast<cudaStream_t>(stream);
  const detail::DeviceInfo& device = detail::device_info(op, device_index);
  const ForwardConfig config = choose_forward(params, device, forced_choices());
  ForwardParams p = params;
  p.l2_keep_from_row = config.l2_keep_from_row;
  const int sms = device.sm_count;
  StatsChoice::record(StatsDesign::automatic);
  float* block_amax = static_cast<float*>(p.workspace);
  int block_count = 0;
  dispatch_fp8(p.x_dtype, [&](auto xf) {
    dispatch_real(p.scale_dtype, [&](auto sc) {
      dispatch_real(p.weight_dtype, [&](auto w) {
        using XF = decltype(xf);
        using SC = decltype(sc);
        using W = decltype(w);
        if (p.rows > 0) block_count = launch_stats<XF, SC, W>(p, config.stats, sms, device_index, block_amax, s);
        // Launched even for M = 0: it writes the scale of the empty tensor.
        dispatch_fp8(p.q_dtype, [&](auto qf) {
          launch_quantize<XF, decltype(qf), SC, W>(p, config.quantize, sms, device_index, block_amax, block_count, s);
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
  const detail::DeviceInfo& device = detail::device_info(op, device_index);
  const BackwardConfig config = choose_backward(p, device, forced_choices());
  TuningChoice::record(config.tuning);
  const int sms = device.sm_count;
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
