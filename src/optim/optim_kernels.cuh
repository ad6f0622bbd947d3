// Optimizer CUDA kernels. One thread block serves one chunk (optim_plan.h) of one tensor; a
// launch's tensor table (addresses, sizes, the chunk each tensor starts at) travels in the
// kernel's parameters, and a block finds its tensor by a binary search over the chunk starts.
//
//  * norm_partial_kernel<T>: the sum of squares of a chunk (float32, fixed order: each thread's
//    strided elements, then a fixed tree over the block), written to partials[first + block].
//  * norm_final_kernel: one block adds every partial in float64 (fixed order), writes sqrt.
//  * adamw_kernel<G, C>: the AdamW update of a chunk with gradients of type G and, unless C is
//    NoCopy, the low-precision copy of type C; the clip scale comes from the norm in device memory.
//
// Chunks are multiples of 4 elements from the tensor's start, so where every pointer of a tensor
// is aligned to 4 elements the body goes 4 elements per access and only a tensor's last chunk has
// a scalar tail.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "core/device_vector.cuh"
#include "optim/optim_plan.h"

namespace fusekit::optim::kernels {

using detail::device::from_float;
using detail::device::to_float;

inline constexpr int kThreads = 256;
inline constexpr int kVector = 4;
static_assert(kChunkElements % (kThreads * kVector) == 0, "a chunk is whole block-wide vector steps");

// Tensors per launch: the tables below stay near 3 KB, within the 4 KB kernel parameter space
// every toolkit accepts.
inline constexpr int kNormTensorsPerLaunch = 112;
inline constexpr int kAdamWTensorsPerLaunch = 52;

struct NoCopy {};

template <int N>
struct NormTable {
  const void* data[N];
  std::int64_t numel[N];
  int first_chunk[N];  // chunk (block) index of the tensor's first chunk in this launch
  unsigned char vector_ok[N];
  int count;
};

template <int N>
struct AdamWTable {
  float* param[N];
  const void* grad[N];
  float* exp_avg[N];
  float* exp_avg_sq[N];
  void* copy[N];
  std::int64_t numel[N];
  int first_chunk[N];
  unsigned char vector_ok[N];
  int count;
};

// The update's float32 constants, formed on the host from the float64 config.
struct AdamWConstants {
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float decay;                  // 1 - lr * weight_decay
  float step_size;              // lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float eps;
  float max_grad_norm;          // used when the norm pointer is non-null
};

static_assert(sizeof(NormTable<kNormTensorsPerLaunch>) + 16 <= 4096, "kernel parameters within 4 KB");
static_assert(sizeof(AdamWTable<kAdamWTensorsPerLaunch>) + sizeof(AdamWConstants) + 8 <= 4096,
              "kernel parameters within 4 KB");

// The tensor of chunk `block`: the last t with first_chunk[t] <= block (first_chunk[0] == 0).
__device__ __forceinline__ int tensor_of_chunk(const int* first_chunk, int count, int block) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first_chunk[mid] <= block) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

template <typename T>
struct alignas(kVector * sizeof(T)) Vec {
  T v[kVector];
};

template <typename T>
__device__ __forceinline__ void load_vec(const T* ptr, float (&out)[kVector]) {
  const Vec<T> x = *reinterpret_cast<const Vec<T>*>(ptr);
#pragma unroll
  for (int j = 0; j < kVector; ++j) out[j] = to_float(x.v[j]);
}

template <typename T>
__device__ __forceinline__ void store_vec(T* ptr, const float (&in)[kVector]) {
  Vec<T> x;
#pragma unroll
  for (int j = 0; j < kVector; ++j) x.v[j] = from_float<T>(in[j]);
  *reinterpret_cast<Vec<T>*>(ptr) = x;
}

// The block's sum of `v` in a fixed order (warp trees, then warp 0 over the warp sums); the
// result is valid in thread 0.
template <typename A>
__device__ __forceinline__ A block_sum(A v, A* shared) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x / 32) ? shared[lane] : A(0);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  return v;
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads) norm_partial_kernel(const NormTable<N> table, float* partials) {
  __shared__ float warp_sums[kThreads / 32];
  const int block = static_cast<int>(blockIdx.x);
  const int t = tensor_of_chunk(table.first_chunk, table.count, block);
  const std::int64_t begin = static_cast<std::int64_t>(block - table.first_chunk[t]) * kChunkElements;
  const std::int64_t remaining = table.numel[t] - begin;
  const int n = static_cast<int>(remaining < kChunkElements ? remaining : kChunkElements);
  const T* x = static_cast<const T*>(table.data[t]) + begin;
  float sum = 0.0f;
  int scalar_from = 0;
  if (table.vector_ok[t]) {
    const int vector_end = n / kVector * kVector;
    for (int i = threadIdx.x * kVector; i < vector_end; i += kThreads * kVector) {
      float v[kVector];
      load_vec(x + i, v);
#pragma unroll
      for (int j = 0; j < kVector; ++j) sum = fmaf(v[j], v[j], sum);
    }
    scalar_from = vector_end;
  }
  for (int i = scalar_from + threadIdx.x; i < n; i += kThreads) {
    const float v = to_float(x[i]);
    sum = fmaf(v, v, sum);
  }
  sum = block_sum(sum, warp_sums);
  if (threadIdx.x == 0) partials[block] = sum;
}

__global__ void __launch_bounds__(kThreads) norm_final_kernel(const float* partials, std::int64_t count, float* norm) {
  __shared__ double warp_sums[kThreads / 32];
  double sum = 0.0;
  for (std::int64_t i = threadIdx.x; i < count; i += kThreads) sum += static_cast<double>(partials[i]);
  sum = block_sum(sum, warp_sums);
  if (threadIdx.x == 0) *norm = static_cast<float>(sqrt(sum));
}

// One element's update, in float32 in the order PyTorch's AdamW takes (decay, then the step).
__device__ __forceinline__ void adamw_update(float& p, float& m, float& v, float g, const AdamWConstants& c) {
  m = c.beta1 * m + c.one_minus_beta1 * g;
  v = c.beta2 * v + c.one_minus_beta2 * (g * g);
  p = p * c.decay;
  p = p - c.step_size * (m / (sqrtf(v) / c.bias_correction2_sqrt + c.eps));
}

template <typename G, typename C, int N>
__global__ void __launch_bounds__(kThreads) adamw_kernel(const AdamWTable<N> table, const AdamWConstants c,
                                                         const float* grad_norm) {
  constexpr bool kCopy = !std::is_same_v<C, NoCopy>;
  const int block = static_cast<int>(blockIdx.x);
  const int t = tensor_of_chunk(table.first_chunk, table.count, block);
  const std::int64_t begin = static_cast<std::int64_t>(block - table.first_chunk[t]) * kChunkElements;
  const std::int64_t remaining = table.numel[t] - begin;
  const int n = static_cast<int>(remaining < kChunkElements ? remaining : kChunkElements);
  float scale = 1.0f;
  if (grad_norm != nullptr) {
    // clip_grad_norm_'s min(1, max / (norm + 1e-6)); NaN fails the comparison and stays NaN.
    const float coef = c.max_grad_norm / (*grad_norm + 1e-6f);
    scale = coef >= 1.0f ? 1.0f : coef;
  }
  float* param = table.param[t] + begin;
  const G* grad = static_cast<const G*>(table.grad[t]) + begin;
  float* exp_avg = table.exp_avg[t] + begin;
  float* exp_avg_sq = table.exp_avg_sq[t] + begin;
  [[maybe_unused]] C* copy = nullptr;
  if constexpr (kCopy) copy = static_cast<C*>(table.copy[t]) + begin;

  int scalar_from = 0;
  if (table.vector_ok[t]) {
    const int vector_end = n / kVector * kVector;
    for (int i = threadIdx.x * kVector; i < vector_end; i += kThreads * kVector) {
      float p[kVector], g[kVector], m[kVector], v[kVector];
      load_vec(param + i, p);
      load_vec(grad + i, g);
      load_vec(exp_avg + i, m);
      load_vec(exp_avg_sq + i, v);
#pragma unroll
      for (int j = 0; j < kVector; ++j) adamw_update(p[j], m[j], v[j], g[j] * scale, c);
      store_vec(param + i, p);
      store_vec(exp_avg + i, m);
      store_vec(exp_avg_sq + i, v);
      if constexpr (kCopy) store_vec(copy + i, p);
    }
    scalar_from = vector_end;
  }
  for (int i = scalar_from + threadIdx.x; i < n; i += kThreads) {
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    adamw_update(p, m, v, to_float(grad[i]) * scale, c);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if constexpr (kCopy) copy[i] = from_float<C>(p);
  }
}

}  // namespace fusekit::optim::kernels
