// The activation functions fused into fusekit's ops (bias+activation+dropout, gated activations,
// linear).
#pragma once

#include <cstdint>

namespace fusekit {

enum class Activation : std::uint8_t {
  none,          // identity
  relu,          // max(x, 0); derivative 0 at x = 0 (as PyTorch); likewise squared_relu
  gelu_erf,      // x * Phi(x), exact (erf) form
  gelu_tanh,     // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), PyTorch approximate="tanh"
  squared_relu,  // max(x, 0)^2
  leaky_relu,    // x >= 0 ? x : slope * x; derivative 1 for x > 0, slope for x <= 0 (as PyTorch)
  silu,          // x * sigmoid(x)
};

const char* activation_name(Activation a);

}  // namespace fusekit
