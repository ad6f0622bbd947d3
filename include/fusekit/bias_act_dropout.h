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
// The mask (which elements are kept, from seed, offset and p) is defined in fusekit/dropout.h.
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

#include <cstddef>
#include <cstdint>

#include "fusekit/activation.h"
#include "fusekit/dropout.h"  // the mask: dropout_keeps(), dropout_keep_threshold()
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
// `dtype` on `device` (0 on the CPU).
std::size_t bias_act_dropout_backward_workspace_size(std::int64_t rows, std::int64_t cols,
                                                     DType dtype, Device device);

// dx = dy * keep / (1 - p) * act'(x + bias), dbias = sum over rows of dx. dx and dbias optional.
void bias_act_dropout_backward(const TensorView& dy, const TensorView& x,
                               const OptionalTensor& bias, const BiasActDropoutConfig& config,
                               const OptionalTensor& dx, const OptionalTensor& dbias,
                               const OptionalTensor& workspace = std::nullopt,
                               Stream stream = nullptr);

}  // namespace fusekit
