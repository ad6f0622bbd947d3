// FP8 RMSNorm: group-quantized FP8 input, per-tensor-scaled FP8 output with its transpose,
// and the backward pass, for FP8 training in the style of COAT (activations kept in FP8 between
// layers).
//
// Shapes and dtypes (forward):
//   x         (..., N)  f8e4m3 or f8e5m2; the leading dims are flattened into M rows (one row
//                        stride, last dim contiguous, as in fusekit/norm.h). 1 <= N <= 65536.
//   x_scales  (..., N / group_size)  bf16 or f32, the same leading dims (M rows, any row stride):
//                        element (r, c) of x stands for q[r, c] * x_scales[r, c / group_size].
//   group_size  a power of two that divides N (16 by default).
//   weight    (N) bf16 or f32, contiguous.
//   eps       > 0 (so that an all-zero row has a finite rstd).
//   qy        (..., N) like x, f8e4m3 or f8e5m2 (need not be x's format): the output, row-major.
//   qy_t      (N, M) 2-D, qy's dtype, last dim contiguous, row stride >= M: qy transposed.
//   y_scale   one f32 element (any shape), on the device: the per-tensor scale s, qy * s ~ y.
//   rstd      M f32 values, contiguous: saved for the backward.
//   y         optional (..., N) bf16: the unquantized output.
//
// The arithmetic, exactly (the CPU reference performs the same float32 operations):
//   xd    = fl32(q * scale)                              dequantized input
//   rstd  = fl32(1 / sqrt(sum_c (q * scale)^2 / N + eps)) evaluated in float64
//   y     = fl32(fl32(xd * w) * rstd)
//   amax  = max |y| over the whole tensor
//   s     = fl32(max(amax, kFp8NormAmaxFloor) / fp8_max)   -> y_scale
//   m     = fl32(fp8_max / max(amax, kFp8NormAmaxFloor))
//   qy    = fp8(fl32(fl32(q * w) * fl32(scale * fl32(rstd * m))))
// that is y * m = y / s, evaluated from q with one factor per row and scale group so that the
// GPU spends two multiplies per element on it (within three float32 roundings of fl32(y * m)).
// That factor is held to +-FLT_MAX, so that a group of zeros under a huge scale gives 0 rather
// than 0 * inf = NaN (only |q * w| < 2^-100 could feel the clamp). fp8_max is the largest finite
// value of qy's format (448 for e4m3, 57344 for e5m2). The conversion to fp8 rounds to nearest,
// ties to even, and saturates to +-fp8_max instead of producing inf/NaN (cuda_fp8.h
// __NV_SATFINITE, the same routine on host and device); the largest |y| therefore maps to exactly
// +-fp8_max. The floor keeps an all-zero tensor (amax = 0) finite: s = 2^-100 / fp8_max, qy = 0.
// Only tensors whose amax is below 2^-100 (~7.9e-31) are affected by it. NaN inputs give NaN
// outputs in their row and are ignored by amax.
//
// Where the GPU can differ from the CPU reference: only through rstd. The CPU sums the squares in
// float64; the GPU sums the 16 exact squares q^2 of each 16-element vector in float32 (at most 5
// roundings, relative error <= 5 * 2^-24) and combines those sums in float64. The saved rstd can
// therefore differ by a few float32 ulps (at most 4; usually 0, sometimes 1), y in that row by as
// much, and an element of qy (by one fp8 ulp) only where y * (fp8_max / amax) lies that close to
// an fp8 rounding boundary: about 1e-6 of the elements or fewer. y_scale can differ only when the
// row that holds the maximum has such an rstd. With rstd equal, scale, qy, qy_t and y are
// bit-identical to the reference. |xd * w| must stay below the float32 maximum (3.4e38); with
// bf16 scales and bf16 weights the GPU finds max |y| from exact products, which assumes
// |q * w| >= 2^-126 (no subnormal weights).
//
// Backward: dy (..., N) bf16; dx (..., N) bf16 and dweight (N) in weight's dtype, each optional:
//   x_hat = xd * rstd,  g = dy * w,  dx = rstd * (g - x_hat * mean_c(g * x_hat)),
//   dweight = sum over rows of dy * x_hat,
// math in float32 on the GPU (float64 on the CPU). dweight is reduced in parallel with a fixed
// reduction order: bitwise the same result on every run on a given kind of GPU (the backward's
// row grouping is tuned by the device's memory bandwidth, so an H100 and an H200 may differ in
// the last bits).
//
// Workspace: on a GPU both passes need scratch memory (the forward: one float per block for the
// global max; the backward: one partial dweight row per block). Ask the *_workspace_size
// functions (rows in 0..2^31 - 1 and cols in 0..kFp8NormMaxCols, or an invalid_argument Error)
// and pass a contiguous u8 tensor of at least that many bytes on the same device,
// 16-byte aligned. The CPU backend needs none. Nothing is allocated and there is no host round
// trip: the global max is reduced on the device and y_scale stays on the device.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusekit/tensor.h"

namespace fusekit {

inline constexpr int kFp8NormDefaultGroupSize = 16;
inline constexpr std::int64_t kFp8NormMaxCols = 65536;
inline constexpr float kFp8NormAmaxFloor = 0x1p-100f;

std::size_t fp8_rms_norm_forward_workspace_size(std::int64_t rows, std::int64_t cols,
                                                Device device);

void fp8_rms_norm_forward(const TensorView& x, const TensorView& x_scales,
                          const TensorView& weight, float eps, const TensorView& qy,
                          const TensorView& qy_t, const TensorView& y_scale,
                          const TensorView& rstd, const OptionalTensor& y,
                          const OptionalTensor& workspace,
                          int group_size = kFp8NormDefaultGroupSize, Stream stream = nullptr);

std::size_t fp8_rms_norm_backward_workspace_size(std::int64_t rows, std::int64_t cols,
                                                 Device device);

void fp8_rms_norm_backward(const TensorView& dy, const TensorView& x, const TensorView& x_scales,
                           const TensorView& weight, const TensorView& rstd,
                           const OptionalTensor& dx, const OptionalTensor& dweight,
                           const OptionalTensor& workspace,
                           int group_size = kFp8NormDefaultGroupSize, Stream stream = nullptr);

}  // namespace fusekit
