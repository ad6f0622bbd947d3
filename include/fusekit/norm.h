// LayerNorm and RMSNorm, forward and backward.
//
// Shapes: x is (..., N): all leading dimensions are flattened into M rows, which must be
// expressible with a single row stride (any stride >= N; the last dimension contiguous).
//   LayerNorm: y = (x - mean) * rstd * weight + bias,   rstd = 1 / sqrt(var(x) + eps)
//   RMSNorm:   y = x * rstd * weight,                   rstd = 1 / sqrt(mean(x^2) + eps)
// x, y, dy, dx: f32, f16 or bf16 (one dtype for all four), each with exactly x's shape; math in
// float32. eps: finite and >= 0.
// weight, bias, dweight, dbias: (N) contiguous, in x's dtype or f32 (one dtype for all).
// mean, rstd: M float32 values (any shape with M elements, contiguous), saved for backward.
// N may be 1 .. 65536; M up to 2^31 - 1.
//
// Backward computes any subset of dx, dweight, dbias. dweight/dbias are reduced over rows in
// parallel with a fixed reduction order: the same inputs give bitwise the same gradients on every
// run. The reduction needs scratch memory: ask *_backward_workspace_size() and pass a u8 view of
// at least that many bytes on the tensors' device (none is needed on the CPU).
//
// The *_from_output variants recompute the normalized input from the saved output y instead of x
// (x_hat = (y - bias) / weight), so that x need not be kept when y is kept anyway. They require
// every weight element to be non-zero: on the CPU a zero element is refused (invalid_argument); on
// the GPU it is the caller's precondition (checking would cost a device-to-host copy per call) and
// a zero element gives NaN in dx and dweight.
//
// Residual variants (the pre-norm transformer block's "h = h + f(h); y = norm(h)"):
//   forward:  sum = round(x + residual) in x's dtype, y = norm(sum), in one pass. The sum is
//             rounded before it is normalized, so the saved sum is exactly what was normalized
//             and the backward recomputes nothing differently. sum is written when given (the
//             caller may keep its own copy of x + residual and pass nothing).
//   backward: dx = d loss / d sum = norm_backward(dy, sum) + dsum, the gradient reaching both
//             x and residual (dsum: the gradient arriving at sum from the skip path; absent = 0).
//             dweight/dbias as in the plain backward (same determinism and workspace:
//             norm_backward_workspace_size).
// residual, sum, dsum: x's dtype and shape, each with its own row stride (last dim contiguous).
// dx may be exactly dsum (same data, shape and strides: updated in place); any other overlap
// between an output and another argument is refused (sum over x or residual too). All other
// rules as for the plain norms.
//
// norm_backward_workspace_size checks its arguments: rows in 0..2^31 - 1, cols in 0..kNormMaxCols,
// an x dtype.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusekit/tensor.h"

namespace fusekit {

inline constexpr std::int64_t kNormMaxCols = 65536;

void layer_norm_forward(const TensorView& x, const OptionalTensor& weight,
                        const OptionalTensor& bias, float eps, const TensorView& y,
                        const OptionalTensor& mean, const OptionalTensor& rstd,
                        Stream stream = nullptr);

void rms_norm_forward(const TensorView& x, const OptionalTensor& weight, float eps,
                      const TensorView& y, const OptionalTensor& rstd, Stream stream = nullptr);

// Bytes of scratch memory the backward needs for an (rows, cols) problem on `device`.
std::size_t norm_backward_workspace_size(std::int64_t rows, std::int64_t cols, DType dtype,
                                         Device device);

void layer_norm_backward(const TensorView& dy, const TensorView& x, const OptionalTensor& weight,
                         const TensorView& mean, const TensorView& rstd,
                         const OptionalTensor& dx, const OptionalTensor& dweight,
                         const OptionalTensor& dbias, const OptionalTensor& workspace,
                         Stream stream = nullptr);

void layer_norm_backward_from_output(const TensorView& dy, const TensorView& y,
                                     const OptionalTensor& weight, const OptionalTensor& bias,
                                     const TensorView& rstd, const OptionalTensor& dx,
                                     const OptionalTensor& dweight, const OptionalTensor& dbias,
                                     const OptionalTensor& workspace, Stream stream = nullptr);

void rms_norm_backward(const TensorView& dy, const TensorView& x, const OptionalTensor& weight,
                       const TensorView& rstd, const OptionalTensor& dx,
                       const OptionalTensor& dweight, const OptionalTensor& workspace,
                       Stream stream = nullptr);

void rms_norm_backward_from_output(const TensorView& dy, const TensorView& y,
                                   const OptionalTensor& weight, const TensorView& rstd,
                                   const OptionalTensor& dx, const OptionalTensor& dweight,
                                   const OptionalTensor& workspace, Stream stream = nullptr);

// sum = x + residual (written when given), y = norm(sum), one pass.
void layer_norm_residual_forward(const TensorView& x, const TensorView& residual,
                                 const OptionalTensor& weight, const OptionalTensor& bias,
                                 float eps, const TensorView& y, const OptionalTensor& sum,
                                 const OptionalTensor& mean, const OptionalTensor& rstd,
                                 Stream stream = nullptr);

void rms_norm_residual_forward(const TensorView& x, const TensorView& residual,
                               const OptionalTensor& weight, float eps, const TensorView& y,
                               const OptionalTensor& sum, const OptionalTensor& rstd,
                               Stream stream = nullptr);

// dx = d loss / d sum = norm_backward(dy, sum) + dsum: the gradient of both x and residual.
void layer_norm_residual_backward(const TensorView& dy, const TensorView& sum,
                                  const OptionalTensor& dsum, const OptionalTensor& weight,
                                  const TensorView& mean, const TensorView& rstd,
                                  const OptionalTensor& dx, const OptionalTensor& dweight,
                                  const OptionalTensor& dbias, const OptionalTensor& workspace,
                                  Stream stream = nullptr);

void rms_norm_residual_backward(const TensorView& dy, const TensorView& sum,
                                const OptionalTensor& dsum, const OptionalTensor& weight,
                                const TensorView& rstd, const OptionalTensor& dx,
                                const OptionalTensor& dweight, const OptionalTensor& workspace,
                                Stream stream = nullptr);

}  // namespace fusekit
