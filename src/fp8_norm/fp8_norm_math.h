// The float32 arithmetic that defines FP8 RMSNorm's outputs, shared verbatim by the CPU reference
// (compiled by the host compiler) and the CUDA kernels, so that both evaluate the same
// operations in the same order. Only products and quotients appear (nothing a compiler could
// contract into an FMA), each rounded to float32.
#pragma once

#include <cmath>
#include <cstdint>

#include "fusekit/fp8_norm.h"

#if defined(__CUDACC__)
#define FUSEKIT_FP8_HD __host__ __device__ __forceinline__
#else
#define FUSEKIT_FP8_HD inline
#endif

namespace fusekit::fp8_norm {

// Largest finite value of the output format.
FUSEKIT_FP8_HD constexpr float fp8_max(bool e4m3) { return e4m3 ? 448.0f : 57344.0f; }

FUSEKIT_FP8_HD float dequantize(float q, float scale) { return q * scale; }

// y = (xd * w) * rstd. Multiplying by rstd last makes |y| a monotone function of |xd * w| within
// a row, so the row's max |y| is fl32(max |xd * w| * rstd): the statistics pass finds it without
// knowing rstd in advance.
FUSEKIT_FP8_HD float weighted(float xd, float w) { return xd * w; }
FUSEKIT_FP8_HD float normalized(float xw, float rstd) { return xw * rstd; }

FUSEKIT_FP8_HD float floored_amax(float amax) {
  return amax > kFp8NormAmaxFloor ? amax : kFp8NormAmaxFloor;
}
// The per-tensor scale written to y_scale: qy * s approximates y.
FUSEKIT_FP8_HD float tensor_scale(float amax, float max_finite) {
  return floored_amax(amax) / max_finite;
}
// What y is multiplied by before the fp8 conversion.
FUSEKIT_FP8_HD float quant_multiplier(float amax, float max_finite) {
  return max_finite / floored_amax(amax);
}

// The quantized output does not go through y: per (row, scale group) one factor
// f = fl32(scale * fl32(rstd * multiplier)), then per element fl32(fl32(q * w) * f), q the fp8
// value before its scale. Two float32 multiplies per element instead of the four of
// fl32(y * multiplier); the result approximates y * multiplier within three float32 roundings,
// so the largest |y| still maps onto fp8_max (the conversion saturates). The factor is held to
// +-FLT_MAX: a group of zeros with a huge scale (or an all-zero tensor, whose multiplier is
// fp8_max / 2^-100) must give 0, not 0 * inf = NaN. Only |q w| < 2^-100 could feel the clamp.
// NaN passes through (the comparison is false), as it must.
FUSEKIT_FP8_HD float quant_factor(float scale, float rstd, float multiplier) {
  const float f = scale * (rstd * multiplier);
  constexpr float kMax = 3.40282346638528859812e+38f;
  return f > kMax ? kMax : (f < -kMax ? -kMax : f);
}
FUSEKIT_FP8_HD float quant_value(float q, float w, float factor) { return (q * w) * factor; }

// rstd from the row's sum of squares (float64), rounded once to float32.
FUSEKIT_FP8_HD float rstd_from_sum_squares(double sum_squares, std::int64_t cols, float eps) {
  return static_cast<float>(1.0 / sqrt(sum_squares / static_cast<double>(cols) +
                                       static_cast<double>(eps)));
}

}  // namespace fusekit::fp8_norm
