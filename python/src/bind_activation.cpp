// The activation shared by bias_act_dropout and linear: the Activation enum and the conversion of
// an `activation` argument.
#include "bindings.h"
#include "fusekit/activation.h"

namespace fusekit::python {

namespace {

constexpr Activation kActivations[] = {Activation::none,         Activation::relu,
                                       Activation::gelu_erf,     Activation::gelu_tanh,
                                       Activation::squared_relu, Activation::leaky_relu,
                                       Activation::silu};

}  // namespace

Activation ScalarArgs::activation(nb::handle value, const char* name) const {
  return option(value, name, "fusekit.Activation", kActivations, activation_name);
}

void bind_activation(nb::module_& m) {
  auto e = nb::enum_<Activation>(m, "Activation",
                                 "Activations fused into fusekit's ops (names as in the C++ API); "
                                 "ops also accept the names as strings.");
  for (Activation a : kActivations) e.value(activation_name(a), a);
}

}  // namespace fusekit::python
