#include "fusekit/activation.h"

namespace fusekit {

const char* activation_name(Activation a) {
  switch (a) {
    case Activation::none: return "none";
    case Activation::relu: return "relu";
    case Activation::gelu_erf: return "gelu_erf";
    case Activation::gelu_tanh: return "gelu_tanh";
    case Activation::squared_relu: return "squared_relu";
    case Activation::leaky_relu: return "leaky_relu";
    case Activation::silu: return "silu";
  }
  return "unknown";
}

}  // namespace fusekit
