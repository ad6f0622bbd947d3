// CUDA launchers for FP8 RMSNorm: pick the vector or generic kernels from the group size and
// alignment, size the persistent grids (the same answer for the workspace queries and the
// launches), and dispatch on the element types.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/cuda_check.h"
#include "core/device_info.h"
#include "fp8_norm/fp8_norm_kernels.cuh"
#include "fp8_norm/fp8_norm_params.h"

namespace fusekit::fp8_norm {
namespace {

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

template <typename Kernel>
int occupancy(const char* op, Kernel kernel, int threads) {
  int blocks = 0;
  detail::check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0), op,
                     "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  return std::max(1, blocks);
}

int persistent_grid(std::int64_t work_items, std::int64_t cap) {
  return static_cast<int>(std::max<std::int64_t>(1, std::min(work_items, cap)));
}

// ---- forward ---------------------------------------------------------------------------------

bool forward_vector_ok(const ForwardParams& p) {
  return p.group_size >= 16 && p.x_row_stride % 16 == 0 && aligned16(p.x) && aligned16(p.weight) &&
         p.qy_row_stride % 16 == 0 && aligned16(p.qy) &&
         (p.y == nullptr || (p.y_row_stride % 8 == 0 && aligned16(p.y)));
}

// Launches the statistics kernel; returns its grid (the number of per-block maxima).
template <class XF, typename SC, typename W>
int launch_stats(const ForwardParams& p, bool vector, int sms, float* block_amax, cudaStream_t stream) {
  const char* op = "fp8_rms_norm_forward";
  auto check_capacity = [&](int grid) {
    const std::size_t need = static_cast<std::size_t>(grid) * sizeof(float);
    if (need > p.workspace_bytes)
      throw Error(ErrorKind::invalid_argument, op, "workspace", "at least " + std::to_string(need) + " bytes",
                  std::to_string(p.workspace_bytes) + " bytes");
  };
  int grid = 0;
  if (vector) {
    const int log2_tpr = std::min(5, log2_ceil(p.cols / 16));
    const int rows_per_block = kStatsThreads >> log2_tpr;
    auto kernel = stats_vector_kernel<XF, SC, W>;
    const int per_sm = std::min(kStatsBlocksPerSm, occupancy(op, kernel, kStatsThreads));
    grid = persistent_grid((p.rows + rows_per_block - 1) / rows_per_block, std::int64_t(sms) * per_sm);
    check_capacity(grid);
    kernel<<<grid, kStatsThreads, 0, stream>>>(p, log2_tpr, block_amax);
  } else {
    auto kernel = stats_generic_kernel<XF, SC, W>;
    const int per_sm = std::min(kStatsBlocksPerSm, occupancy(op, kernel, kStatsThreads));
    grid = persistent_grid((p.rows + kGenericStatsRowsPerBlock - 1) / kGenericStatsRowsPerBlock,
                           std::int64_t(sms) * per_sm);
    check_capacity(grid);
    kernel<<<grid, kStatsThreads, 0, stream>>>(p, block_amax);
  }
  detail::check_launch(op, "fp8 rms norm statistics kernel");
  return grid;
}

template <class XF, class QF, typename SC, typename W>
void launch_quantize(const ForwardParams& p, bool vector, int sms, const float* block_amax,
                     int block_count, cudaStream_t stream) {
  const char* op = "fp8_rms_norm_forward";
  if (vector) {
    auto kernel = quantize_vector_kernel<XF, QF, SC, W>;
    const std::int64_t tiles = ((p.rows + kTile - 1) / kTile) * ((p.cols + kTile - 1) / kTile);
    // One block per tile (the hardware balances them; the stats maxima each block re-reads
    // are a few KB from L2), capped only to keep the grid small for enormous tensors.
    const int grid = persistent_grid(tiles, std::int64_t(sms) * occupancy(op, kernel, kQuantThreads) * 64);
    const bool t_vector = aligned16(p.qy_t) && p.qy_t_row_stride % 16 == 0;
    kernel<<<grid, kQuantThreads, 0, stream>>>(p, block_amax, block_count, t_vector);
  } else {
    auto kernel = quantize_generic_kernel<XF, QF, SC, W>;
    const std::int64_t tiles =
        ((p.rows + kGenericTile - 1) / kGenericTile) * ((p.cols + kGenericTile - 1) / kGenericTile);
    const int grid = persistent_grid(tiles, std::int64_t(sms) * occupancy(op, kernel, kQuantThreads));
    kernel<<<grid, kQuantThreads, 0, stream>>>(p, block_amax, block_count);
  }
  detail::check_launch(op, "fp8 rms norm quantize/transpose kernel");
}

// ---- backward --------------------------------------------------------------------------------

struct BackwardConfig {
  bool vector = false;
  int iters = 1;     // 16-element vectors per thread and row
  int log2_tpr = 0;  // threads per row group (vector path)
  int rows_per_block = 1;
  int threads = kGenericBwdThreads;
};

BackwardConfig choose_backward(const BackwardParams& p) {
  BackwardConfig c;
  const bool aligned = p.group_size >= 16 && p.x_row_stride % 16 == 0 && aligned16(p.x) &&
                       p.dy_row_stride % 8 == 0 && aligned16(p.dy) && aligned16(p.weight) &&
                       (p.dx == nullptr || (p.dx_row_stride % 8 == 0 && aligned16(p.dx)));
  const std::int64_t nvec = p.cols / 16;
  if (!aligned) return c;
  // Two vectors per thread (twice the bytes in flight per thread; at 512 threads and one block
  // per SM that is what keeps HBM busy) once the row has 64 of them; up to 1024 vectors
  // (N = 16384). Longer rows take the generic kernel. A group of at most 256 threads holds at
  // most 512 vector slots, which is what kCombineFloats is sized for.
  c.iters = nvec >= 64 ? 2 : 1;
  c.log2_tpr = std::max(5, log2_ceil((nvec + c.iters - 1) / c.iters));
  if (c.log2_tpr > 9) return BackwardConfig{};
  c.vector = true;
  c.rows_per_block = kBwdThreads >> c.log2_tpr;
  c.threads = kBwdThreads;
  return c;
}

template <class XF, typename SC, typename W>
int launch_backward_main(const BackwardParams& p, const BackwardConfig& c, int sms, float* partial,
                         std::size_t partial_capacity_bytes, cudaStream_t stream) {
  const char* op = "fp8_rms_norm_backward";
  auto check_capacity = [&](int grid) {
    const std::size_t need = static_cast<std::size_t>(grid) * p.cols * sizeof(float);
    if (partial && need > partial_capacity_bytes)
      throw Error(ErrorKind::invalid_argument, op, "workspace",
                  "at least " + std::to_string(need) + " bytes", std::to_string(partial_capacity_bytes) + " bytes");
  };
  int grid = 0;
  if (c.vector) {
    auto run = [&](auto kernel) {
      const int per_sm = std::min(kBwdBlocksPerSm, occupancy(op, kernel, kBwdThreads));
      grid = persistent_grid((p.rows + c.rows_per_block - 1) / c.rows_per_block, std::int64_t(sms) * per_sm);
      check_capacity(grid);
      kernel<<<grid, kBwdThreads, 0, stream>>>(p, c.log2_tpr, partial);
    };
    if (c.iters == 1) run(backward_vector_kernel<XF, SC, W, 1>);
    else run(backward_vector_kernel<XF, SC, W, 2>);
  } else {
    auto kernel = backward_generic_kernel<XF, SC, W>;
    const int per_sm = std::min(kBwdBlocksPerSm, occupancy(op, kernel, kGenericBwdThreads));
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

void forward_cuda(const ForwardParams& p, int device_index, Stream stream) {
  const char* op = "fp8_rms_norm_forward";
  detail::DeviceGuard guard(op, device_index);
  const auto s = static_cast<cudaStream_t>(stream);
  const int sms = detail::device_info(op, device_index).sm_count;
  const bool vector = forward_vector_ok(p);
  float* block_amax = static_cast<float*>(p.workspace);
  int block_count = 0;
  dispatch_fp8(p.x_dtype, [&](auto xf) {
    dispatch_real(p.scale_dtype, [&](auto sc) {
      dispatch_real(p.weight_dtype, [&](auto w) {
        using XF = decltype(xf);
        using SC = decltype(sc);
        using W = decltype(w);
        if (p.rows > 0) block_count = launch_stats<XF, SC, W>(p, vector, sms, block_amax, s);
        // Launched even for M = 0: it writes the scale of the empty tensor.
        dispatch_fp8(p.q_dtype, [&](auto qf) {
          launch_quantize<XF, decltype(qf), SC, W>(p, vector, sms, block_amax, block_count, s);
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
  const BackwardConfig config = choose_backward(p);
  float* partial = p.dweight ? static_cast<float*>(p.workspace) : nullptr;
  dispatch_fp8(p.x_dtype, [&](auto xf) {
    dispatch_real(p.scale_dtype, [&](auto sc) {
      dispatch_real(p.weight_dtype, [&](auto w) {
        using W = decltype(w);
        const int grid = launch_backward_main<decltype(xf), decltype(sc), W>(p, config, sms, partial,
                                                                            p.workspace_bytes, s);
        if (partial) {
          const dim3 reduce_grid(static_cast<unsigned>((p.cols + 31) / 32));
          reduce_dweight_kernel<W><<<reduce_grid, dim3(32, 32), 0, s>>>(partial, grid, p.cols,
                                                                        static_cast<W*>(p.dweight));
          detail::check_launch(op, "fp8 rms norm dweight reduction kernel");
        }
      });
    });
  });
}

}  // namespace fusekit::fp8_norm
