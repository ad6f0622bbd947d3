// Gated-activation CUDA kernels: one pass each way.
//
//   forward:  reads gate and up, writes y = act(gate) * up
//   backward: reads dy, gate and up, writes dgate = dy * up * act'(gate) and dup = dy * act(gate)
//
// Work layout (gated_act_config.h): a thread owns one unit of a row, N consecutive outputs (one
// 16-byte vector of y on the vector path, one element on the scalar path), in each of R rows, and
// issues every load of its R rows before any math. A unit's inputs are two raw values a and b: in
// two planes (two tensors, or the halves of one) a holds N gates and b N ups; interleaved, a and b
// are the 2N consecutive values (gate, up, gate, up, ...) of the unit's columns 2 col .. 2 col + 2N.
// The backward writes its gradients in the same form, each element after all of its unit's loads,
// so that a gradient may be written over its own input (in-place backward).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "core/activation.h"
#include "core/device_vector.cuh"
#include "gated_act/gated_act_config.h"
#include "gated_act/gated_act_params.h"

namespace fusekit::gated_act::kernels {

using detail::device::from_float;
using detail::device::pack16_from;
using detail::device::to_float;
using detail::device::unpack16_to;

// The float math for storage type T. Results that only reach 16-bit storage take the lighter
// gelu_erf fit (fractional error 4e-6, far below their rounding); f32 takes the float32-accurate one
// (core/activation.h).
template <typename T>
using Math = detail::ActivationMath<float, sizeof(T) == 2 ? detail::GeluErfMath::fit_16bit : detail::GeluErfMath::fit_f32>;

// One unit: N consecutive values of T as their raw storage (a 16-byte vector, or one element).
template <typename T, bool kVector>
struct Unit {
  static constexpr int N = kVector ? 16 / static_cast<int>(sizeof(T)) : 1;
  using Raw = std::conditional_t<kVector, uint4, T>;

  // The N values at element `offset` of `base` (16-byte aligned on the vector path).
  static __device__ __forceinline__ Raw load(const void* base, std::int64_t offset) {
    return *reinterpret_cast<const Raw*>(static_cast<const T*>(base) + offset);
  }
  static __device__ __forceinline__ void to_floats(const Raw raw, float* out) {
    if constexpr (kVector) unpack16_to<T>(raw, out);
    else out[0] = to_float(raw);
  }
  static __device__ __forceinline__ void store(void* base, std::int64_t offset, const float* values) {
    Raw* at = reinterpret_cast<Raw*>(static_cast<T*>(base) + offset);
    if constexpr (kVector) *at = pack16_from<T>(values);
    else *at = from_float<T>(values[0]);
  }
};

// A unit's a and b as N gates and N ups.
template <typename U, bool kInterleaved>
__device__ __forceinline__ void split(const typename U::Raw a, const typename U::Raw b, float (&gate)[U::N],
                                      float (&up)[U::N]) {
  constexpr int N = U::N;
  if constexpr (kInterleaved) {
    float pairs[2 * N];
    U::to_floats(a, pairs);
    U::to_floats(b, pairs + N);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      gate[i] = pairs[2 * i];
      up[i] = pairs[2 * i + 1];
    }
  } else {
    U::to_floats(a, gate);
    U::to_floats(b, up);
  }
}

// The unit's input column: planes hold N values per unit, the interleaved tensor 2N.
template <bool kInterleaved>
__device__ __forceinline__ std::int64_t input_col(std::int64_t col) {
  return kInterleaved ? 2 * col : col;
}

// ---- forward -------------------------------------------------------------------------------

template <typename T, bool kVector, bool kInterleaved, Activation A, int R>
__global__ void __launch_bounds__(kBlockThreads) forward_kernel(const ForwardParams p, const int units_per_row) {
  using U = Unit<T, kVector>;
  constexpr int N = U::N;
  const int unit = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (unit >= units_per_row) return;
  const std::int64_t col = std::int64_t(unit) * N;
  const std::int64_t in_col = input_col<kInterleaved>(col);
  const std::int64_t block_rows = std::int64_t(blockDim.y) * R;
  for (std::int64_t first = std::int64_t(blockIdx.y) * block_rows + threadIdx.y; first < p.rows;
       first += std::int64_t(gridDim.y) * block_rows) {
    typename U::Raw a[R], b[R];
#pragma unroll
    for (int k = 0; k < R; ++k) {
      const std::int64_t r = first + std::int64_t(k) * blockDim.y;
      if (r >= p.rows) break;
      const std::int64_t at = r * p.in.gate_row_stride + in_col;
      a[k] = U::load(p.in.gate, at);
      if constexpr (kInterleaved) b[k] = U::load(p.in.gate, at + N);
      else b[k] = U::load(p.in.up, r * p.in.up_row_stride + col);
    }
#pragma unroll
    for (int k = 0; k < R; ++k) {
      const std::int64_t r = first + std::int64_t(k) * blockDim.y;
      if (r >= p.rows) break;
      float gate[N], up[N], y[N];
      split<U, kInterleaved>(a[k], b[k], gate, up);
#pragma unroll
      for (int i = 0; i < N; ++i) y[i] = Math<T>::forward(A, gate[i], 0.0f) * up[i];
      U::store(p.y, r * p.y_row_stride + col, y);
    }
  }
}

// ---- backward ------------------------------------------------------------------------------

template <typename T, bool kVector, bool kInterleaved, Activation A, int R>
__global__ void __launch_bounds__(kBlockThreads) backward_kernel(const BackwardParams p, const int units_per_row) {
  using U = Unit<T, kVector>;
  constexpr int N = U::N;
  const int unit = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (unit >= units_per_row) return;
  const std::int64_t col = std::int64_t(unit) * N;
  const std::int64_t in_col = input_col<kInterleaved>(col);
  // Planes without dgate need no up (dup = dy * act(gate)); interleaved, b holds gates too.
  const bool want_dgate = p.grad.gate != nullptr, want_dup = p.grad.up != nullptr;
  const bool load_b = kInterleaved || want_dgate;
  const std::int64_t block_rows = std::int64_t(blockDim.y) * R;
  for (std::int64_t first = std::int64_t(blockIdx.y) * block_rows + threadIdx.y; first < p.rows;
       first += std::int64_t(gridDim.y) * block_rows) {
    typename U::Raw d[R], a[R], b[R];
#pragma unroll
    for (int k = 0; k < R; ++k) {
      const std::int64_t r = first + std::int64_t(k) * blockDim.y;
      if (r >= p.rows) break;
      const std::int64_t at = r * p.in.gate_row_stride + in_col;
      d[k] = U::load(p.dy, r * p.dy_row_stride + col);
      a[k] = U::load(p.in.gate, at);
      if (load_b) {
        if constexpr (kInterleaved) b[k] = U::load(p.in.gate, at + N);
        else b[k] = U::load(p.in.up, r * p.in.up_row_stride + col);
      } else {
        b[k] = a[k];  // not read: dgate is not computed
      }
    }
#pragma unroll
    for (int k = 0; k < R; ++k) {
      const std::int64_t r = first + std::int64_t(k) * blockDim.y;
      if (r >= p.rows) break;
      float gate[N], up[N], dy[N], dgate[N], dup[N];
      split<U, kInterleaved>(a[k], b[k], gate, up);
      U::to_floats(d[k], dy);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        float act, deriv;
        Math<T>::forward_and_derivative(A, gate[i], 0.0f, &act, &deriv);
        dgate[i] = dy[i] * up[i] * deriv;
        dup[i] = dy[i] * act;
      }
      if constexpr (kInterleaved) {
        float pairs[2 * N];
#pragma unroll
        for (int i = 0; i < N; ++i) {
          pairs[2 * i] = dgate[i];
          pairs[2 * i + 1] = dup[i];
        }
        const std::int64_t at = r * p.grad.gate_row_stride + in_col;
        U::store(p.grad.gate, at, pairs);
        U::store(p.grad.gate, at + N, pairs + N);
      } else {
        if (want_dgate) U::store(p.grad.gate, r * p.grad.gate_row_stride + col, dgate);
        if (want_dup) U::store(p.grad.up, r * p.grad.up_row_stride + col, dup);
      }
    }
  }
}

}  // namespace fusekit::gated_act::kernels
