// The float32 steps that define the rotary angles (fusekit/rope.h), shared verbatim by the
// entry points, the CPU reference and the kernels: the float64 reference then differs from the
// kernels only by the rounding of cos, sin and the rotation, not by the angle's float32
// rounding, which at positions of 1e5 is far above any output tolerance.
#pragma once

#include <cmath>
#include <cstdint>

#include "fusekit/philox.h"  // FUSEKIT_HOST_DEVICE

namespace fusekit::rope {

// fl32(p): round to nearest (exact below 2^24).
FUSEKIT_HOST_DEVICE float position_as_float(std::int64_t position) {
  return static_cast<float>(position);
}

// a_i = fl32(fl32(p) * inv_freq[i]): one float32 multiply, never contracted into an FMA.
FUSEKIT_HOST_DEVICE float rotary_angle(float position, float inv_freq) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(position, inv_freq);
#else
  return position * inv_freq;
#endif
}

// inv_freq[i] = fl32(theta^(-2i / r) / linear_scaling) for i < r / 2, in float64 rounded once.
inline void inv_freq_from_theta(double theta, double linear_scaling, std::int64_t rotary_dim, float* out) {
  for (std::int64_t i = 0; i < rotary_dim / 2; ++i)
    out[i] = static_cast<float>(std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(rotary_dim)) /
                                linear_scaling);
}

}  // namespace fusekit::rope
