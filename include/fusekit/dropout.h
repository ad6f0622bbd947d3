// Fused bias + activation + dropout, forward and backward, with the mask regenerated from a
// Philox seed instead of stored.
//
//   forward:  h = x + bias,  y = act(h) * keep / (1 - p)
//   backward: dx = dy * keep / (1 - p) * act'(h),  dbias = sum over rows of dx
//
// Shapes: x is (..., N): the leading dimensions are flattened into M rows, which must be
// expressible with a single row stride (any stride >= N; the last dimension contiguous). y, dy,
// dx and pre_activation have x's shape (each with its own row stride) and x's dtype.
// Dtypes: x, y, dy, dx, pre_activation: f32, f16 or bf16 (one dtype for all); math in float32.
// bias and dbias: (N) contiguous, each in x's dtype or f32. dbias is summed in float32 from the
// float32 dx (before dx is rounded to its dtype).
//
// The mask. Element (r, c) of the logical (M, N) tensor has the linear index i = r * N + c (the
// row stride of the memory layout plays no part). Its 16-bit random value is
//     u16(i) = half (i % 2) of word ((i % 8) / 2) of philox::random4(seed, offset, i / 8)
// (words .x, .y, .z, .w = 0..3; half 0 = the low 16 bits, 1 = the high 16 bits), i.e. taken from
// the output of cuRAND's curand4() after curand_init(seed, offset, 4 * (i / 8)): `offset` is the
// Philox subsequence and each group of eight consecutive elements uses one Philox4x32-10 call.
// The element is kept iff
//     u16(i) >= dropout_keep_threshold(p) = min(ceil(p * 65536), 65535)
// so it is kept with probability 1 - threshold / 65536, within 2^-16 of 1 - p (p is resolved to
// 1/65536: 16 random bits per element halve the Philox work against 32). Kept elements are
// scaled by 1 / (1 - p) (computed in float32); dropped elements are exactly 0, whatever the
// input. The mask is a pure function of (seed, offset, p, i): forward, backward, the CPU
// reference and any launch configuration or GPU agree on it bit for bit, and dropout_keeps()
// below reproduces it. Give every call whose mask must be independent its own (seed, offset)
// pair, e.g. one offset per layer and step; the backward must get the same config as its
// forward.
//
// p = 0 is the identity (no random numbers are drawn); p must lie in [0, 1): p = 1 is refused
// (it would drop everything and divide by zero).
//
// What backward needs: x, bias and the config (seed, offset, p, activation); no mask and no
// activation output is stored. A caller that would rather keep h = x + bias (one tensor in x's
// dtype) than recompute it passes `pre_activation` to the forward, and later passes h as `x` and
// no bias to the backward (dbias is still computed: it is the column sum of dx, which does not
// depend on the bias). h is then rounded to x's dtype before act' sees it.
//
// Backward computes dx and/or dbias (each optional). dbias is reduced over rows in parallel with
// a fixed summation order: the same inputs give bitwise the same dbias on every run. On a GPU the
// reduction needs scratch memory: ask bias_act_dropout_backward_workspace_size() and pass a u8
// view of at least that many bytes (16-byte aligned) on the tensors' device; none is needed on
// the CPU or when dbias is not requested.
//
// Outputs must not overlap inputs. Limits: N >= 1, M <= 2^31 - 1.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "fusekit/activation.h"
#include "fusekit/philox.h"
#include "fusekit/tensor.h"

namespace fusekit {

// Everything that defines the op besides its tensors. Pass the same value to the forward and to
// the backward.
struct BiasActDropoutConfig {
  Activation activation = Activation::none;
  float slope = 0.01f;   // leaky_relu's negative slope (ignored by the other activations)
  float p = 0.0f;        // drop probability, in [0, 1)
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;  // Philox subsequence
};

// y = dropout_p(act(x + bias)); optionally also h = x + bias into pre_activation.
void bias_act_dropout_forward(const TensorView& x, const OptionalTensor& bias,
                              const BiasActDropoutConfig& config, const TensorView& y,
                              const OptionalTensor& pre_activation = std::nullopt,
                              Stream stream = nullptr);

// Bytes of scratch memory the backward needs to compute dbias for an (rows, cols) problem of
// `dtype` on `device` (0 on the CPU). rows in 0..2^31 - 1, cols in 0..2^31 - 1 and an x dtype, or
// an invalid_argument Error.
std::size_t bias_act_dropout_backward_workspace_size(std::int64_t rows, std::int64_t cols,
                                                     DType dtype, Device device);

// dx = dy * keep / (1 - p) * act'(x + bias), dbias = sum over rows of dx. dx and dbias optional.
void bias_act_dropout_backward(const TensorView& dy, const TensorView& x,
                               const OptionalTensor& bias, const BiasActDropoutConfig& config,
                               const OptionalTensor& dx, const OptionalTensor& dbias,
                               const OptionalTensor& workspace = std::nullopt,
                               Stream stream = nullptr);

// ---- the mask, for callers that want to reproduce or inspect it ------------------------------

// min(ceil(p * 65536), 65535) for p in [0, 1) (p outside that range is the caller's error; the
// ops check it).
inline std::uint32_t dropout_keep_threshold(float p) {
  const double t = std::ceil(static_cast<double>(p) * 65536.0);
  return t <= 0.0 ? 0u : (t >= 65535.0 ? 65535u : static_cast<std::uint32_t>(t));
}

// The 16-bit random value of element `index`, given its group's words
// w = philox::random4(seed, offset, index / 8).
FUSEKIT_HOST_DEVICE std::uint32_t dropout_random16_of_group(const philox::Words4& w,
                                                            std::uint64_t index) {
  std::uint32_t word;
  switch ((index % 8) / 2) {
    case 0: word = w.x; break;
    case 1: word = w.y; break;
    case 2: word = w.z; break;
    default: word = w.w; break;
  }
  return index % 2 ? word >> 16 : word & 0xFFFFu;
}

// The 16-bit random value of element `index` (see the mapping above).
FUSEKIT_HOST_DEVICE std::uint32_t dropout_random16(std::uint64_t seed, std::uint64_t offset,
                                                   std::uint64_t index) {
  return dropout_random16_of_group(philox::random4(seed, offset, index / 8), index);
}

// Whether element `index` (= row * N + col) is kept under `threshold` = dropout_keep_threshold(p).
FUSEKIT_HOST_DEVICE bool dropout_keeps(std::uint64_t seed, std::uint64_t offset,
                                       std::uint64_t index, std::uint32_t threshold) {
  return dropout_random16(seed, offset, index) >= threshold;
}

}  // namespace fusekit
