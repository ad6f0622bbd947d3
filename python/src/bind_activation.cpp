// Pieces shared by the families that take an activation (bias_act_dropout, linear), a device
// name (workspace-size queries) or a Philox seed (the dropout-mask helpers): the Activation enum
// and the conversions of Python arguments.
#include <nanobind/stl/string.h>

#include <string>

#include "bindings.h"
#include "fusekit/activation.h"

namespace fusekit::python {

namespace {

constexpr Activation kActivations[] = {Activation::none,         Activation::relu,
                                       Activation::gelu_erf,     Activation::gelu_tanh,
                                       Activation::squared_relu, Activation::leaky_relu,
                                       Activation::silu};

std::string activation_names() {
  std::string names;
  for (Activation a : kActivations) {
    if (!names.empty()) names += ", ";
    names += std::string("'") + activation_name(a) + "'";
  }
  return names;
}

}  // namespace

Activation activation_arg(nb::handle value, const char* op) {
  Activation parsed;
  if (nb::try_cast<Activation>(value, parsed, false)) return parsed;
  if (nb::isinstance<nb::str>(value)) {
    const std::string name = nb::cast<std::string>(value);
    for (Activation a : kActivations)
      if (name == activation_name(a)) return a;
    throw Error(ErrorKind::invalid_argument, op, "activation",
                "fusekit.Activation or one of " + activation_names(), "'" + name + "'");
  }
  throw Error(ErrorKind::invalid_argument, op, "activation",
              "fusekit.Activation or one of " + activation_names(),
              std::string(nb::type_name(value.type()).c_str()));
}

Device device_arg(const std::string& device, const char* op) {
  if (device == "cpu") return Device::cpu();
  if (device == "cuda") return Device::cuda(0);
  if (device.rfind("cuda:", 0) == 0) {
    try {
      std::size_t used = 0;
      const int index = std::stoi(device.substr(5), &used);
      if (used == device.size() - 5 && index >= 0) return Device::cuda(index);
    } catch (const std::exception&) {
    }
  }
  throw Error(ErrorKind::invalid_argument, op, "device", "'cpu', 'cuda' or 'cuda:N'",
              "'" + device + "'");
}

std::uint64_t u64_arg(nb::handle value, const char* op, const char* name) {
  const char* expected = "an integer in [0, 2^64)";
  // Any integer-like object (Python int, NumPy integer scalars), but not float or bool.
  if (!PyIndex_Check(value.ptr()) || PyBool_Check(value.ptr()))
    throw Error(ErrorKind::invalid_argument, op, name, expected,
                std::string(nb::type_name(value.type()).c_str()));
  nb::object as_int = nb::steal(PyNumber_Index(value.ptr()));
  if (!as_int.is_valid()) throw nb::python_error();
  const unsigned long long v = PyLong_AsUnsignedLongLong(as_int.ptr());
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();  // negative or too large: reported as a fusekit error instead
    throw Error(ErrorKind::invalid_argument, op, name, expected,
                nb::cast<std::string>(nb::str(as_int)));
  }
  return static_cast<std::uint64_t>(v);
}

PhiloxArgs keep_mask_args(OpCall& c, nb::handle seed, nb::handle offset, float p) {
  const PhiloxArgs philox{u64_arg(seed, c.op(), "seed"), u64_arg(offset, c.op(), "offset")};
  if (!(p >= 0.0f && p < 1.0f)) c.fail("p", "a drop probability in [0, 1)", std::to_string(p));
  return philox;
}

void bind_activation(nb::module_& m) {
  auto e = nb::enum_<Activation>(m, "Activation",
                                 "Activations fused into fusekit's ops (names as in the C++ API); "
                                 "ops also accept the names as strings.");
  for (Activation a : kActivations) e.value(activation_name(a), a);
}

}  // namespace fusekit::python
