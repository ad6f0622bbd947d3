// CUDA launchers for LayerNorm / RMSNorm: the launch comes from norm_config (choose_forward_launch,
// choose_backward_launch); this file answers its occupancy questions for the compiled kernels,
// maps its variants to them and launches them, dispatching on the element types.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_info.h"
#include "core/launch_tuning.h"
#include "norm/norm_config.h"
#include "norm/norm_element_kernels.h"
#include "norm/norm_kernels.cuh"
#include "norm/norm_params.h"
#include "norm/norm_tail_kernels.h"

namespace fusekit::norm {
namespace {

using namespace kernels;
using detail::blocks_per_sm;

bool aligned16(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; }

// Whether row strides and pointers allow the row kernels' 16-byte vectors (any N: a partial last
// vector takes the tail variants).
template <typename T>
bool vector_aligned(std::initializer_list<std::int64_t> row_strides, std::initializer_list<const void*> pointers) {
  constexpr int kVec = 16 / sizeof(T);
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

template <typename T, typename W, int ITERS, bool RESIDUAL>
ForwardKernel forward_kernel_rows(ForwardRows rows) {
  switch (rows) {
    case ForwardRows::full_layer_norm:
      return forward_registers_kernel<T, W, ITERS, ForwardRows::full_layer_norm, RESIDUAL>;
    case ForwardRows::full_rms_norm: return forward_registers_kernel<T, W, ITERS, ForwardRows::full_rms_norm, RESIDUAL>;
    default: return forward_registers_kernel<T, W, ITERS, ForwardRows::any, RESIDUAL>;
  }
}

template <typename T, typename W, bool RESIDUAL>
ForwardKernel forward_kernel_iters(const ForwardVariant& v) {
  switch (v.vectors_per_thread) {
    case 1: return forward_kernel_rows<T, W, 1, RESIDUAL>(v.rows);
    case 2: return forward_kernel_rows<T, W, 2, RESIDUAL>(v.rows);
    case 3: return forward_kernel_rows<T, W, 3, RESIDUAL>(v.rows);
    default: return forward_kernel_rows<T, W, 4, RESIDUAL>(v.rows);
  }
}

template <typename T, typename W>
ForwardKernel forward_kernel(const ForwardVariant& v) {
  if (v.tail) return forward_tail_kernel<T, W>(v);
  return v.residual ? forward_kernel_iters<T, W, true>(v) : forward_kernel_iters<T, W, false>(v);
}

template <typename T, typename W, std::size_t... I>
BackwardKernel find_backward_kernel(const BackwardVariant& v, std::index_sequence<I...>) {
  BackwardKernel kernel = nullptr;
  ((kBackwardVariants[I] == v ? (kernel = backward_streaming_kernel<T, W, kBackwardVariants[I].pack()>, 0) : 0), ...);
  return kernel;
}

// The compiled kernel of a variant (kBackwardVariants lists them).
template <typename T, typename W>
BackwardKernel backward_kernel(const char* op, const BackwardVariant& v) {
  constexpr std::size_t kCount = sizeof(kBackwardVariants) / sizeof(kBackwardVariants[0]);
  const BackwardKernel kernel =
      v.tail ? backward_tail_kernel<T, W>(v) : find_backward_kernel<T, W>(v, std::make_index_sequence<kCount>{});
  if (!kernel) throw Error(ErrorKind::unsupported, op, "a backward kernel variant that is not compiled");
  return kernel;
}

// Static shared memory of a kernel, cached.
template <typename Kernel>
std::size_t static_smem(const char* op, Kernel kernel) {
  static std::mutex mutex;
  static std::vector<std::pair<const void*, std::size_t>> cache;
  const void* key = reinterpret_cast<const void*>(kernel);
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& [k, v] : cache)
      if (k == key) return v;
  }
  cudaFuncAttributes attributes{};
  detail::check_cuda(cudaFuncGetAttributes(&attributes, kernel), op, "cudaFuncGetAttributes");
  std::lock_guard<std::mutex> lock(mutex);
  cache.push_back({key, attributes.sharedSizeBytes});
  return attributes.sharedSizeBytes;
}

// A launch configuration for clusters of `cluster` blocks along x. The configuration points at
// its attribute, so the two live together (not copyable).
struct ClusterLaunch {
  cudaLaunchAttribute attribute[1] = {};
  cudaLaunchConfig_t config = {};
  ClusterLaunch(int grid, int block_threads, std::size_t smem, int cluster, cudaStream_t stream) {
    attribute[0].id = cudaLaunchAttributeClusterDimension;
    attribute[0].val.clusterDim.x = static_cast<unsigned>(cluster);
    attribute[0].val.clusterDim.y = 1;
    attribute[0].val.clusterDim.z = 1;
    config.gridDim = dim3(static_cast<unsigned>(grid));
    config.blockDim = dim3(static_cast<unsigned>(block_threads));
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

// How many clusters of `cluster` blocks of a kernel can be resident at once (a cluster's blocks
// must share a GPC, so whole clusters can hold fewer blocks than the SMs times the blocks per
// SM); 0 when one does not fit. Cached like blocks_per_sm.
template <typename Kernel>
int max_active_clusters(const char* op, Kernel kernel, int block_threads, std::size_t smem, int cluster,
                        int device_index) {
  struct Key {
    const void* kernel;
    int block, device, cluster;
    std::size_t smem;
    bool operator==(const Key& o) const {
      return kernel == o.kernel && block == o.block && device == o.device && cluster == o.cluster && smem == o.smem;
    }
  };
  static std::mutex mutex;
  static std::vector<std::pair<Key, int>> cache;
  const Key key{reinterpret_cast<const void*>(kernel), block_threads, device_index, cluster, smem};
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& [k, v] : cache)
      if (k == key) return v;
  }
  const int per_sm = blocks_per_sm(op, kernel, block_threads, smem, device_index);  // sets the smem limit
  const int sms = detail::device_info(op, device_index).sm_count;
  const ClusterLaunch launch((sms * per_sm + cluster - 1) / cluster * cluster, block_threads, smem, cluster, nullptr);
  int clusters = 0;
  detail::check_cuda(cudaOccupancyMaxActiveClusters(&clusters, kernel, &launch.config), op,
                     "cudaOccupancyMaxActiveClusters");
  std::lock_guard<std::mutex> lock(mutex);
  cache.push_back({key, clusters});
  return clusters;
}

// The device's occupancy calculator for the kernels of (T, W), cached per kernel and shape.
// Asking about a kernel at a dynamic shared-memory size also lets it launch with that size.
template <typename T, typename W>
class DeviceOccupancy final : public KernelOccupancy {
 public:
  DeviceOccupancy(const char* op, int device_index) : op_(op), device_(device_index) {}
  int forward_blocks_per_sm(const ForwardVariant& v, int block_threads) const override {
    return blocks_per_sm(op_, forward_kernel<T, W>(v), block_threads, 0, device_);
  }
  int forward_generic_blocks_per_sm() const override {
    return blocks_per_sm(op_, forward_generic_kernel<T, W>, kGenericThreads, 0, device_);
  }
  int backward_blocks_per_sm(const BackwardVariant& v, int block_threads, std::size_t smem) const override {
    return blocks_per_sm(op_, backward_kernel<T, W>(op_, v), block_threads, smem, device_);
  }
  int backward_generic_blocks_per_sm() const override {
    return blocks_per_sm(op_, backward_generic_kernel<T, W>, kGenericThreads, 0, device_);
  }
  std::size_t backward_static_smem(const BackwardVariant& v) const override {
    return static_smem(op_, backward_kernel<T, W>(op_, v));
  }
  int backward_max_clusters(const BackwardVariant& v, int block_threads, std::size_t smem, int cluster) const override {
    return max_active_clusters(op_, backward_kernel<T, W>(op_, v), block_threads, smem, cluster, device_);
  }

 private:
  const char* op_;
  int device_;
};

template <typename T, typename W>
void launch_forward(const ForwardParams& p, int device_index, cudaStream_t stream) {
  const char* op = "norm_forward";
  ForwardProblem problem;
  problem.rows = p.rows;
  problem.cols = p.cols;
  problem.element_bytes = sizeof(T);
  problem.kind = p.kind;
  problem.has_weight = p.weight != nullptr;
  problem.has_bias = p.bias != nullptr;
  problem.residual = p.residual != nullptr;
  problem.aligned = vector_aligned<T>({p.x_row_stride, p.y_row_stride, p.residual_row_stride, p.sum_row_stride},
                                      {p.x, p.y, p.weight, p.bias, p.residual, p.sum});
  const ForwardLaunch launch = choose_forward_launch(problem, detail::device_info(op, device_index),
                                                     DeviceOccupancy<T, W>(op, device_index), read_launch_overrides());
  if (launch.generic && launch.elements.elements_per_thread > 0) {
    launch_forward_elements<T, W>(p, launch.elements, launch.grid, stream);
  } else if (launch.generic) {
    forward_generic_kernel<T, W><<<launch.grid, kGenericThreads, 0, stream>>>(p);
  } else {
    const ForwardKernel kernel = forward_kernel<T, W>(launch.variant);
    kernel<<<launch.grid, launch.block_threads, 0, stream>>>(p, launch.geometry);
  }
  detail::check_launch(op, "norm forward kernel");
}

template <typename T, typename W>
void launch_backward(const BackwardParams& p, int device_index, cudaStream_t stream) {
  const char* op = "norm_backward";
  BackwardProblem problem;
  problem.rows = p.rows;
  problem.cols = p.cols;
  problem.element_bytes = sizeof(T);
  problem.from_output = p.from_output;
  problem.bias_grad = p.dbias != nullptr;
  problem.partials = p.dweight != nullptr || p.dbias != nullptr;
  problem.dsum = p.dsum != nullptr;
  problem.aligned = vector_aligned<T>({p.dy_row_stride, p.input_row_stride, p.dx_row_stride, p.dsum_row_stride},
                                      {p.dy, p.input, p.dx, p.weight, p.bias, p.dsum});
  const BackwardLaunch launch = choose_backward_launch(
      problem, detail::device_info(op, device_index), DeviceOccupancy<T, W>(op, device_index), read_launch_overrides());

  float* partial_dw = nullptr;
  float* partial_db = nullptr;
  if (problem.partials) {
    if (p.workspace_bytes < partial_bytes(launch.partial_rows, p.cols)) {
      throw Error(ErrorKind::invalid_argument, op, "workspace",
                  "at least " + std::to_string(partial_bytes(launch.partial_rows, p.cols)) + " bytes",
                  std::to_string(p.workspace_bytes) + " bytes");
    }
    partial_dw = static_cast<float*>(p.workspace);
    partial_db = partial_dw + std::int64_t(launch.partial_rows) * partial_pitch(p.cols);
  }
  if (launch.generic && launch.elements.elements_per_thread > 0) {
    launch_backward_elements<T, W>(p, launch.elements, launch.grid, partial_dw, partial_db, stream);
  } else if (launch.generic) {
    backward_generic_kernel<T, W><<<launch.grid, kGenericThreads, 0, stream>>>(p, partial_dw, partial_db);
  } else if (launch.cluster > 1) {
    const ClusterLaunch cluster(launch.grid, launch.block_threads, launch.smem_bytes, launch.cluster, stream);
    detail::check_cuda(cudaLaunchKernelEx(&cluster.config, backward_kernel<T, W>(op, launch.variant), p,
                                          launch.geometry, partial_dw, partial_db),
                       op, "norm backward kernel (clusters)");
  } else {
    const BackwardKernel kernel = backward_kernel<T, W>(op, launch.variant);
    kernel<<<launch.grid, launch.block_threads, launch.smem_bytes, stream>>>(p, launch.geometry, partial_dw,
                                                                             partial_db);
  }
  detail::check_launch(op, "norm backward kernel");
  if (problem.partials) {
    // Programmatic dependent launch: the reduction's launch latency overlaps the main kernel's
    // tail; cudaGridDependencySynchronize() in it waits for the partial sums.
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(static_cast<unsigned>(launch.reduce_blocks), p.dbias ? 2 : 1);
    config.blockDim = dim3(32, 32);
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
    auto* kernel = launch.reduce_columns_per_thread == 4 ? reduce_partials_kernel<W, 4> : reduce_partials_kernel<W, 1>;
    detail::check_cuda(cudaLaunchKernelEx(&config, kernel, static_cast<const float*>(partial_dw),
                                          static_cast<const float*>(partial_db), launch.partial_rows, p.cols,
                                          partial_pitch(p.cols),
                                          static_cast<W*>(p.dweight), static_cast<W*>(p.dbias)),
                       op, "norm partial-sum reduction kernel");
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
  const LaunchOverrides overrides = read_launch_overrides();
  int partial_rows = 0;
  for (DType weight_dtype : {dtype, DType::f32}) {
    dispatch_types(dtype, weight_dtype, [&](auto t, auto w) {
      using T = decltype(t);
      using W = decltype(w);
      const int needed = backward_workspace_rows(rows, cols, sizeof(T), detail::device_info(op, device_index),
                                                 DeviceOccupancy<T, W>(op, device_index), overrides);
      partial_rows = std::max(partial_rows, needed);
    });
  }
  return partial_bytes(partial_rows, cols);
}

}  // namespace fusekit::norm
