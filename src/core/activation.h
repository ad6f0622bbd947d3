// One definition of each activation and its derivative, for host and device code, in float (the
// kernels) or double (the CPU references). Every op that fuses an activation uses these.
#pragma once

#include <cmath>

#include "fusekit/activation.h"
#include "fusekit/philox.h"  // FUSEKIT_HOST_DEVICE

namespace fusekit::detail {

template <typename R>
struct ActivationMath {
  static FUSEKIT_HOST_DEVICE R sigmoid(R x) { return R(1) / (R(1) + exp(-x)); }
  static constexpr double kSqrt2OverPi = 0.7978845608028654;
  static constexpr double kInvSqrt2 = 0.7071067811865476;
  static constexpr double kInvSqrt2Pi = 0.3989422804014327;

  // act(x); `slope` is used by leaky_relu only.
  static FUSEKIT_HOST_DEVICE R forward(Activation a, R x, R slope) {
    switch (a) {
      case Activation::none: return x;
      case Activation::relu: return x > R(0) ? x : R(0);
      case Activation::gelu_erf: return R(0.5) * x * (R(1) + erf(x * R(kInvSqrt2)));
      case Activation::gelu_tanh: {
        const R inner = R(kSqrt2OverPi) * (x + R(0.044715) * x * x * x);
        return R(0.5) * x * (R(1) + tanh(inner));
      }
      case Activation::squared_relu: return x > R(0) ? x * x : R(0);
      case Activation::leaky_relu: return x >= R(0) ? x : slope * x;
      case Activation::silu: return x * sigmoid(x);
    }
    return x;
  }

  // d act / dx at x.
  static FUSEKIT_HOST_DEVICE R derivative(Activation a, R x, R slope) {
    switch (a) {
      case Activation::none: return R(1);
      case Activation::relu: return x > R(0) ? R(1) : R(0);
      case Activation::gelu_erf:
        return R(0.5) * (R(1) + erf(x * R(kInvSqrt2))) + x * R(kInvSqrt2Pi) * exp(R(-0.5) * x * x);
      case Activation::gelu_tanh: {
        const R inner = R(kSqrt2OverPi) * (x + R(0.044715) * x * x * x);
        const R t = tanh(inner);
        const R d_inner = R(kSqrt2OverPi) * (R(1) + R(3 * 0.044715) * x * x);
        return R(0.5) * (R(1) + t) + R(0.5) * x * (R(1) - t * t) * d_inner;
      }
      case Activation::squared_relu: return x > R(0) ? R(2) * x : R(0);
      case Activation::leaky_relu: return x >= R(0) ? R(1) : slope;
      case Activation::silu: {
        const R s = sigmoid(x);
        return s * (R(1) + x * (R(1) - s));
      }
    }
    return R(1);
  }
};

}  // namespace fusekit::detail
