// CUDA launchers for LayerNorm / RMSNorm: choose a kernel configuration from the row length and
// alignment, size the persistent backward grid, and dispatch on the element types.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "core/cuda_check.h"
#include "core/device_info.h"
#include "norm/norm_kernels.cuh"
#include "norm/norm_params.h"

namespace fusekit::norm {
namespace {

using namespace kernels;

// A register-path configuration: TPR threads per row, ITERS 16-byte vectors per thread.
struct RowConfig {
  int threads_per_row = 0;  // 0: use the generic kernel
  int iters = 0;
};

// The smallest row group that covers the row with at most 4 vectors per thread: short rows get a
// warp each (no block barrier), long rows a whole block. Beyond 2048 vectors (16384 bf16 values)
// the backward's ~3 registers per element no longer fit and it falls back to the generic kernel.
RowConfig choose_config(std::int64_t vectors, bool backward) {
  if (vectors <= 32) return {32, 1};
  if (vectors <= 64) return {32, 2};
  if (vectors <= 128) return {32, 4};
  if (vectors <= 256) return {64, 4};
  if (vectors <= 512) return {128, 4};
  if (vectors <= 1024) return {256, 4};
  if (vectors <= 2048) return {512, 4};
  if (vectors <= 4096 && !backward) return {1024, 4};
  return {};
}

bool aligned16(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; }

template <typename T>
bool vector_path_ok(std::int64_t cols, std::initializer_list<std::int64_t> row_strides,
                    std::initializer_list<const void*> pointers) {
  constexpr int kVec = 16 / sizeof(T);
  if (cols % kVec != 0) return false;
  for (std::int64_t s : row_strides)
    if (s % kVec != 0) return false;
  for (const void* ptr : pointers)
    if (ptr && !aligned16(ptr)) return false;
  return true;
}

// Calls f(T{}, W{}) with the storage types of (dtype, weight dtype).
template <typename F>
void dispatch_types(DType dtype, DType weight_dtype, F&& f) {
  switch (dtype) {
    case DType::f32: f(float{}, float{}); return;
    case DType::f16:
      if (weight_dtype == DType::f32) f(__half{}, float{});
      else f(__half{}, __half{});
      return;
    case DType::bf16:
      if (weight_dtype == DType::f32) f(__nv_bfloat16{}, float{});
      else f(__nv_bfloat16{}, __nv_bfloat16{});
      return;
    default: return;  // rejected by argument checks
  }
}

// Calls f(std::integral_constant<TPR>, std::integral_constant<ITERS>) for a chosen config.
template <typename F>
void dispatch_config(RowConfig c, F&& f) {
#define FUSEKIT_CONFIG(TPR_, ITERS_)                                                          \
  if (c.threads_per_row == TPR_ && c.iters == ITERS_)                                         \
    return f(std::integral_constant<int, TPR_>{}, std::integral_constant<int, ITERS_>{});
  FUSEKIT_CONFIG(32, 1)
  FUSEKIT_CONFIG(32, 2)
  FUSEKIT_CONFIG(32, 4)
  FUSEKIT_CONFIG(64, 4)
  FUSEKIT_CONFIG(128, 4)
  FUSEKIT_CONFIG(256, 4)
  FUSEKIT_CONFIG(512, 4)
  FUSEKIT_CONFIG(1024, 4)
#undef FUSEKIT_CONFIG
}

// Same table without the 1024-thread entry (never chosen for backward, and never instantiated:
// at 1024 threads the backward's registers would spill).
template <typename F>
void dispatch_backward_config(RowConfig c, F&& f) {
  dispatch_config(c, [&](auto tpr, auto iters) {
    if constexpr (tpr.value <= 512) f(tpr, iters);
  });
}

// Backward blocks per SM: enough resident warps to keep memory busy, few enough that the
// per-block partial rows (2 * cols floats each) stay a small fraction of the traffic.
// FUSEKIT_NORM_BWD_BLOCKS_PER_SM overrides the cap (a tuning knob for benchmarks).
int backward_blocks_per_sm_cap(int block_threads) {
  static const int override_cap = [] {
    const char* env = std::getenv("FUSEKIT_NORM_BWD_BLOCKS_PER_SM");
    return env ? std::atoi(env) : 0;
  }();
  if (override_cap > 0) return override_cap;
  return std::max(1, 1024 / block_threads);
}

template <typename Kernel>
int occupancy_blocks(const char* op, Kernel kernel, int block_threads) {
  int blocks = 0;
  detail::check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, block_threads, 0),
                     op, "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  return std::max(1, blocks);
}

// The persistent backward grid for a given kernel: the same answer for the workspace query and
// the launch, so the workspace always has one partial row per block.
template <typename Kernel>
int backward_grid(const char* op, Kernel kernel, int block_threads, int rows_per_block,
                  std::int64_t rows, int device_index) {
  const int sms = detail::device_info(op, device_index).sm_count;
  const int per_sm = std::min(occupancy_blocks(op, kernel, block_threads),
                              backward_blocks_per_sm_cap(block_threads));
  const std::int64_t needed = (rows + rows_per_block - 1) / rows_per_block;
  return static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(needed, std::int64_t(sms) * per_sm)));
}

template <typename T, typename W>
int register_backward_grid(const char* op, RowConfig c, std::int64_t rows, int device_index) {
  int grid = 0;
  dispatch_backward_config(c, [&](auto tpr, auto iters) {
    constexpr int kVec = 16 / sizeof(T);
    auto kernel = backward_registers_kernel<T, W, kVec, iters.value, tpr.value>;
    constexpr int kBlock = block_threads(tpr.value);
    grid = backward_grid(op, kernel, kBlock, kBlock / tpr.value, rows, device_index);
  });
  return grid;
}

template <typename T, typename W>
int generic_backward_grid(const char* op, std::int64_t rows, int device_index) {
  return backward_grid(op, backward_generic_kernel<T, W>, kGenericThreads, 1, rows, device_index);
}

std::size_t partial_bytes(int slots, std::int64_t cols) {
  const std::size_t bytes = 2 * static_cast<std::size_t>(slots) * cols * sizeof(float);
  return (bytes + 255) / 256 * 256;
}

template <typename T, typename W>
void launch_forward(const ForwardParams& p, int device_index, cudaStream_t stream) {
  const char* op = "norm_forward";
  constexpr int kVec = 16 / sizeof(T);
  const int sms = detail::device_info(op, device_index).sm_count;
  const RowConfig c = vector_path_ok<T>(p.cols, {p.x_row_stride, p.y_row_stride},
                                        {p.x, p.y, p.weight, p.bias})
                          ? choose_config(p.cols / kVec, false)
                          : RowConfig{};
  if (c.threads_per_row > 0) {
    dispatch_config(c, [&](auto tpr, auto iters) {
      constexpr int kBlock = block_threads(tpr.value), kRows = kBlock / tpr.value;
      const std::int64_t needed = (p.rows + kRows - 1) / kRows;
      const int grid = static_cast<int>(std::min<std::int64_t>(needed, std::int64_t(sms) * 64));
      forward_registers_kernel<T, W, kVec, iters.value, tpr.value><<<grid, kBlock, 0, stream>>>(p);
    });
  } else {
    const int grid = static_cast<int>(std::min<std::int64_t>(p.rows, std::int64_t(sms) * 16));
    forward_generic_kernel<T, W><<<grid, kGenericThreads, 0, stream>>>(p);
  }
  detail::check_launch(op, "norm forward kernel");
}

template <typename T, typename W>
void launch_backward(const BackwardParams& p, int device_index, cudaStream_t stream) {
  const char* op = "norm_backward";
  constexpr int kVec = 16 / sizeof(T);
  const bool partials = p.dweight != nullptr || p.dbias != nullptr;
  const RowConfig c = vector_path_ok<T>(p.cols, {p.dy_row_stride, p.input_row_stride, p.dx_row_stride},
                                        {p.dy, p.input, p.dx, p.weight, p.bias})
                          ? choose_config(p.cols / kVec, true)
                          : RowConfig{};
  int grid = 0;
  if (c.threads_per_row > 0) grid = register_backward_grid<T, W>(op, c, p.rows, device_index);
  else grid = generic_backward_grid<T, W>(op, p.rows, device_index);

  float* partial_dw = nullptr;
  float* partial_db = nullptr;
  if (partials) {
    if (p.workspace_bytes < partial_bytes(grid, p.cols)) {
      throw Error(ErrorKind::invalid_argument, op, "workspace",
                  "at least " + std::to_string(partial_bytes(grid, p.cols)) + " bytes",
                  std::to_string(p.workspace_bytes) + " bytes");
    }
    partial_dw = static_cast<float*>(p.workspace);
    partial_db = partial_dw + std::int64_t(grid) * p.cols;
  }
  if (c.threads_per_row > 0) {
    dispatch_backward_config(c, [&](auto tpr, auto iters) {
      constexpr int kBlock = block_threads(tpr.value);
      backward_registers_kernel<T, W, kVec, iters.value, tpr.value>
          <<<grid, kBlock, 0, stream>>>(p, partial_dw, partial_db);
    });
  } else {
    backward_generic_kernel<T, W><<<grid, kGenericThreads, 0, stream>>>(p, partial_dw, partial_db);
  }
  detail::check_launch(op, "norm backward kernel");
  if (partials) {
    const dim3 reduce_grid(static_cast<unsigned>((p.cols + 31) / 32), 2);
    reduce_partials_kernel<W><<<reduce_grid, dim3(32, 32), 0, stream>>>(
        partial_dw, partial_db, grid, p.cols, static_cast<W*>(p.dweight), static_cast<W*>(p.dbias));
    detail::check_launch(op, "norm partial-sum reduction kernel");
  }
}

}  // namespace

void forward_cuda(const ForwardParams& p, int device_index, Stream stream) {
  if (p.rows == 0) return;
  detail::DeviceGuard guard("norm_forward", device_index);
  dispatch_types(p.dtype, p.weight_dtype, [&](auto t, auto w) {
    launch_forward<decltype(t), decltype(w)>(p, device_index, static_cast<cudaStream_t>(stream));
  });
}

void backward_cuda(const BackwardParams& p, int device_index, Stream stream) {
  detail::DeviceGuard guard("norm_backward", device_index);
  auto s = static_cast<cudaStream_t>(stream);
  if (p.rows == 0) {
    // Gradients of an empty batch are zero (all-zero bits are 0.0 in every float type).
    const std::size_t bytes = p.cols * dtype_size(p.weight_dtype);
    if (p.dweight) FUSEKIT_CUDA_CHECK("norm_backward", cudaMemsetAsync(p.dweight, 0, bytes, s));
    if (p.dbias) FUSEKIT_CUDA_CHECK("norm_backward", cudaMemsetAsync(p.dbias, 0, bytes, s));
    return;
  }
  dispatch_types(p.dtype, p.weight_dtype, [&](auto t, auto w) {
    launch_backward<decltype(t), decltype(w)>(p, device_index, s);
  });
}

std::size_t backward_workspace_cuda(std::int64_t rows, std::int64_t cols, DType dtype,
                                    int device_index) {
  if (rows <= 0 || cols <= 0) return 0;
  const char* op = "norm_backward_workspace_size";
  detail::DeviceGuard guard(op, device_index);
  // Either path may run (alignment decides) with either weight dtype (register use, hence
  // occupancy, differs), so size for the largest grid any of them would launch.
  int slots = 0;
  for (DType weight_dtype : {dtype, DType::f32}) {
    dispatch_types(dtype, weight_dtype, [&](auto t, auto w) {
      using T = decltype(t);
      using W = decltype(w);
      const RowConfig c = choose_config(cols / (16 / sizeof(T)), true);
      slots = std::max(slots, generic_backward_grid<T, W>(op, rows, device_index));
      if (c.threads_per_row > 0)
        slots = std::max(slots, register_backward_grid<T, W>(op, c, rows, device_index));
    });
  }
  const std::size_t bytes = partial_bytes(slots, cols);
  return bytes;
}

}  // namespace fusekit::norm
