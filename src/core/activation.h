// One definition of each activation and its derivative, for host and device code, in float (the
// kernels) or double (the CPU references). Every op that fuses an activation uses these.
#pragma once

#include <cmath>
#include <type_traits>

#include "fusekit/activation.h"
#include "fusekit/philox.h"  // FUSEKIT_HOST_DEVICE

namespace fusekit::detail {

#if defined(__CUDACC__)
// Single-instruction 2^x and 1/x (MUFU.EX2 / MUFU.RCP, about 2 ulp and 1 ulp): the float
// kernels' exponentials, instead of expf's range-reduced sequence and IEEE division.
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#endif

// How the float kernels evaluate gelu_erf (forward and derivative):
//  * exact: erff / expf (about 1e-7 absolute), the error PyTorch's float32 kernels carry too; for
//    kernels that store float32.
//  * fit_f32: a degree-9 erfc fit, fractional error 1.2e-7: terms accurate to float32's level, for
//    16-bit inputs whose results may still be summed into a float32 output (the dropout backward's
//    float32 dbias: with one row, dbias is the derivative itself). The default.
//  * fit_16bit: a degree-5 erfc fit, fractional error 4e-6, for results that only ever reach
//    16-bit storage (the linear forward's epilogue; the linear dz pass, whose dz and dbias share
//    the 16-bit dtype): far below their rounding (the fp16 half ulp is 2.4e-4 relative).
enum class GeluErfMath { exact, fit_f32, fit_16bit };

template <typename R, GeluErfMath kGeluErf = GeluErfMath::fit_f32>
struct ActivationMath {
  static FUSEKIT_HOST_DEVICE R sigmoid(R x) { return R(1) / (R(1) + exp(-x)); }
  static constexpr double kSqrt2OverPi = 0.7978845608028654;
  static constexpr double kInvSqrt2 = 0.7071067811865476;
  static constexpr double kInvSqrt2Pi = 0.3989422804014327;
  static constexpr double kLog2e = 1.4426950408889634;

#if defined(__CUDA_ARCH__)
  // Float kernels: gelu_tanh and silu through e = exp(-t) and s = 1 / (1 + e) = sigmoid(t),
  // since 0.5 (1 + tanh(z)) = sigmoid(2z). 1 - s is computed as e * s (no cancellation), and
  // the exponent is capped at 2^126 so that s and e * s stay finite where e would overflow.
  // Returns s and writes e * s.
  static __device__ __forceinline__ float sigmoid_parts(float minus_t_log2e, float* one_minus_s) {
    const float e = ex2_approx(fminf(minus_t_log2e, 126.0f));
    const float s = rcp_approx(1.0f + e);
    *one_minus_s = e * s;
    return s;
  }
  // Float kernels' erf-form gelu through Phi(x) = 0.5 erfc(-x / sqrt(2)): 0.5 erfc(z), z =
  // |x| / sqrt(2), as t 2^(-z^2 log2(e) + Q(t)) with t = 1 / (1 + p z) (the form of Numerical
  // Recipes' erfc fit), and an ex2 whose exponent shares -x^2 / 2 with the derivative's Gaussian.
  // Fractional errors hold everywhere, tail included (where 1 + erff(x) cancels). erff + expf cost
  // ~46 instructions per element and make the linear dz pass compute-bound (bench: linear bwd
  // gelu_erf (8192, 4096, 16384), H200).
  //  fit_f32: Numerical Recipes' Chebyshev coefficients, Q of degree 9, p = 0.5: 1.2e-7.
  //  fit_16bit: Q of degree 5 refitted (minimax over z in [0, 6.5], p = 0.47, the factor 0.5
  //  folded in as -1): 4e-6; gelu below 8.1e-6 relative in float32. Six instructions fewer (four
  //  FMAs, the multiplies by 0.5 and log2(e)), which keep the CUTLASS forward's epilogue within
  //  the GEMM's time (bench: linear fwd gelu_erf (8191, 4096, 12296), H200).
  static __device__ __forceinline__ float half_erfc_abs(float x, float minus_half_x2) {
    if constexpr (kGeluErf == GeluErfMath::fit_16bit) {
      constexpr float kP = 0.47f * static_cast<float>(kInvSqrt2);
      const float t = rcp_approx(fmaf(kP, fabsf(x), 1.0f));
      float q = 0.343785093f;
      q = fmaf(q, t, -1.18121297f);
      q = fmaf(q, t, 1.01811299f);
      q = fmaf(q, t, 0.233676057f);
      q = fmaf(q, t, 1.50539041f);
      q = fmaf(q, t, -2.91975552f);
      return t * ex2_approx(fmaf(minus_half_x2, static_cast<float>(kLog2e), q));
    } else {
      const float t = rcp_approx(fmaf(0.5f * static_cast<float>(kInvSqrt2), fabsf(x), 1.0f));
      float p = 0.17087277f;
      p = fmaf(p, t, -0.82215223f);
      p = fmaf(p, t, 1.48851587f);
      p = fmaf(p, t, -1.13520398f);
      p = fmaf(p, t, 0.27886807f);
      p = fmaf(p, t, -0.18628806f);
      p = fmaf(p, t, 0.09678418f);
      p = fmaf(p, t, 0.37409196f);
      p = fmaf(p, t, 1.00002368f);
      p = fmaf(p, t, -1.26551223f);
      return 0.5f * t * ex2_approx((minus_half_x2 + p) * static_cast<float>(kLog2e));
    }
  }
  // -x^2 / 2 rounded on its own: never contracted into the fit's next add, which the compiler
  // does only where the value has one use; forward(), derivative() and forward_and_derivative()
  // then give the same bits (ActivationGpu.ForwardAndDerivativeTogetherGiveTheSeparateBits).
  static __device__ __forceinline__ float minus_half_square(float x) { return __fmul_rn(-0.5f * x, x); }
  static __device__ __forceinline__ float normal_cdf(float x, float minus_half_x2) {
    const float h = half_erfc_abs(x, minus_half_x2);
    return x >= 0.0f ? 1.0f - h : h;
  }
  // -2 log2(e) z for gelu_tanh, z = sqrt(2/pi) (x + 0.044715 x^3).
  static __device__ __forceinline__ float gelu_tanh_exponent(float x, float x2) {
    constexpr float k0 = static_cast<float>(-2.0 * kLog2e * kSqrt2OverPi);
    constexpr float k1 = static_cast<float>(-2.0 * kLog2e * kSqrt2OverPi * 0.044715);
    return x * fmaf(x2, k1, k0);
  }
  // gelu_tanh's derivative from s = sigmoid(2z) and 1 - s: s + x s (1 - s) 2 dz/dx, with
  // 2 dz/dx = 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2).
  static __device__ __forceinline__ float gelu_tanh_derivative(float x, float x2, float s, float one_minus_s) {
    constexpr float d0 = static_cast<float>(2.0 * kSqrt2OverPi);
    constexpr float d1 = static_cast<float>(2.0 * kSqrt2OverPi * 3.0 * 0.044715);
    return fmaf(x * fmaf(x2, d1, d0) * one_minus_s, s, s);
  }
  // gelu_erf's derivative Phi(x) + x phi(x), given Phi(x) and -x^2 / 2.
  static __device__ __forceinline__ float gelu_erf_derivative(float x, float minus_half_x2, float cdf) {
    const float gaussian = ex2_approx(minus_half_x2 * static_cast<float>(kLog2e));
    return fmaf(x * static_cast<float>(kInvSqrt2Pi), gaussian, cdf);
  }
#endif

  // act(x); `slope` is used by leaky_relu only.
  static FUSEKIT_HOST_DEVICE R forward(Activation a, R x, R slope) {
    switch (a) {
      case Activation::none: return x;
      case Activation::relu: return x > R(0) ? x : R(0);
      case Activation::gelu_erf:
#if defined(__CUDA_ARCH__)
        if constexpr (std::is_same_v<R, float> && kGeluErf != GeluErfMath::exact) return x * normal_cdf(x, minus_half_square(x));
#endif
        return R(0.5) * x * (R(1) + erf(x * R(kInvSqrt2)));
      case Activation::gelu_tanh: {
#if defined(__CUDA_ARCH__)
        if constexpr (std::is_same_v<R, float>) {
          float one_minus_s;
          return x * sigmoid_parts(gelu_tanh_exponent(x, x * x), &one_minus_s);
        }
#endif
        const R inner = R(kSqrt2OverPi) * (x + R(0.044715) * x * x * x);
        return R(0.5) * x * (R(1) + tanh(inner));
      }
      case Activation::squared_relu: return x > R(0) ? x * x : R(0);
      case Activation::leaky_relu: return x >= R(0) ? x : slope * x;
      case Activation::silu: {
#if defined(__CUDA_ARCH__)
        if constexpr (std::is_same_v<R, float>) {
          float one_minus_s;
          return x * sigmoid_parts(x * static_cast<float>(-kLog2e), &one_minus_s);
        }
#endif
        return x * sigmoid(x);
      }
    }
    return x;
  }

  // d act / dx at x.
  static FUSEKIT_HOST_DEVICE R derivative(Activation a, R x, R slope) {
    switch (a) {
      case Activation::none: return R(1);
      case Activation::relu: return x > R(0) ? R(1) : R(0);
      case Activation::gelu_erf: {
#if defined(__CUDA_ARCH__)
        if constexpr (std::is_same_v<R, float> && kGeluErf != GeluErfMath::exact) {
          const float minus_half_x2 = minus_half_square(x);
          return gelu_erf_derivative(x, minus_half_x2, normal_cdf(x, minus_half_x2));
        }
#endif
        return R(0.5) * (R(1) + erf(x * R(kInvSqrt2))) + x * R(kInvSqrt2Pi) * exp(R(-0.5) * x * x);
      }
      case Activation::gelu_tanh: {
#if defined(__CUDA_ARCH__)
        if constexpr (std::is_same_v<R, float>) {
          const float x2 = x * x;
          float one_minus_s;
          const float s = sigmoid_parts(gelu_tanh_exponent(x, x2), &one_minus_s);
          return gelu_tanh_derivative(x, x2, s, one_minus_s);
        }
#endif
        const R inner = R(kSqrt2OverPi) * (x + R(0.044715) * x * x * x);
        const R t = tanh(inner);
        const R d_inner = R(kSqrt2OverPi) * (R(1) + R(3 * 0.044715) * x * x);
        return R(0.5) * (R(1) + t) + R(0.5) * x * (R(1) - t * t) * d_inner;
      }
      case Activation::squared_relu: return x > R(0) ? R(2) * x : R(0);
      // At x = 0 the slope, as PyTorch defines it (bf16 inputs hit x + b = 0 exactly often enough
      // for the convention to show in a gradient comparison).
      case Activation::leaky_relu: return x > R(0) ? R(1) : slope;
      case Activation::silu: {
#if defined(__CUDA_ARCH__)
        if constexpr (std::is_same_v<R, float>) {
          float one_minus_s;
          const float s = sigmoid_parts(x * static_cast<float>(-kLog2e), &one_minus_s);
          return fmaf(x * one_minus_s, s, s);  // s (1 + x (1 - s))
        }
#endif
        const R s = sigmoid(x);
        return s * (R(1) + x * (R(1) - s));
      }
    }
    return R(1);
  }

  // act(x) and act'(x) together, each the value forward() and derivative() give (the same
  // expressions), sharing their exponential and reciprocal: for ops that need both of one input
  // (the gated activations' backward).
  static FUSEKIT_HOST_DEVICE void forward_and_derivative(Activation a, R x, R slope, R* act, R* deriv) {
#if defined(__CUDA_ARCH__)
    if constexpr (std::is_same_v<R, float>) {
      switch (a) {
        case Activation::silu: {
          float one_minus_s;
          const float s = sigmoid_parts(x * static_cast<float>(-kLog2e), &one_minus_s);
          *act = x * s;
          *deriv = fmaf(x * one_minus_s, s, s);
          return;
        }
        case Activation::gelu_tanh: {
          const float x2 = x * x;
          float one_minus_s;
          const float s = sigmoid_parts(gelu_tanh_exponent(x, x2), &one_minus_s);
          *act = x * s;
          *deriv = gelu_tanh_derivative(x, x2, s, one_minus_s);
          return;
        }
        case Activation::gelu_erf:
          if constexpr (kGeluErf != GeluErfMath::exact) {
            const float minus_half_x2 = minus_half_square(x);
            const float cdf = normal_cdf(x, minus_half_x2);
            *act = x * cdf;
            *deriv = gelu_erf_derivative(x, minus_half_x2, cdf);
            return;
          }
          break;
        default: break;
      }
    }
#endif
    *act = forward(a, x, slope);
    *deriv = derivative(a, x, slope);
  }
};

}  // namespace fusekit::detail
