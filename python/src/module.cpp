// fusekit._C: the framework-agnostic bindings. Exceptions, dtypes, runtime queries, and one
// bind_<family>() call per op family.
#include <nanobind/stl/string.h>

#include <string>

#include "bindings.h"
#include "fusekit/runtime.h"

namespace fusekit::python {
namespace {

// Python exception classes, created once at import. Error is the base; InvalidArgumentError is
// also a ValueError, the others also RuntimeErrors, so generic handlers keep working.
struct ExceptionTypes {
  PyObject* base = nullptr;
  PyObject* invalid_argument = nullptr;
  PyObject* unsupported = nullptr;
  PyObject* cuda = nullptr;
};
ExceptionTypes g_exceptions;

PyObject* new_exception(nb::module_& m, const char* name, PyObject* bases, const char* doc) {
  const std::string qualified = std::string("fusekit._C.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
  if (!type) throw nb::python_error();
  m.attr(name) = nb::handle(type);  // the module keeps a reference
  return type;
}

void create_exceptions(nb::module_& m) {
  g_exceptions.base = new_exception(
      m, "Error", PyExc_Exception,
      "An error reported by fusekit. Attributes: op, argument, expected, got (empty strings "
      "where the error is not about one argument) and kind.");
  nb::object base = nb::borrow(g_exceptions.base);
  nb::object value_bases = nb::make_tuple(base, nb::handle(PyExc_ValueError));
  nb::object runtime_bases = nb::make_tuple(base, nb::handle(PyExc_RuntimeError));
  g_exceptions.invalid_argument = new_exception(
      m, "InvalidArgumentError", value_bases.ptr(),
      "A bad argument: shape, dtype, strides, alignment, device, missing data or a size limit.");
  g_exceptions.unsupported = new_exception(
      m, "UnsupportedError", runtime_bases.ptr(),
      "A valid request that this build or this GPU cannot serve.");
  g_exceptions.cuda = new_exception(m, "CudaError", runtime_bases.ptr(),
                                    "A CUDA runtime or library call failed.");
}

const char* kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::invalid_argument: return "invalid_argument";
    case ErrorKind::unsupported: return "unsupported";
    case ErrorKind::cuda: return "cuda";
  }
  return "unknown";
}

// Raises the Python exception for a fusekit::Error with the C++ message unchanged and its parts
// as attributes.
void raise_error(const Error& e) {
  PyObject* type = e.kind() == ErrorKind::invalid_argument ? g_exceptions.invalid_argument
                   : e.kind() == ErrorKind::unsupported    ? g_exceptions.unsupported
                                                           : g_exceptions.cuda;
  nb::object instance = nb::steal(PyObject_CallOneArg(type, nb::str(e.what()).ptr()));
  if (!instance.is_valid()) return;  // the failed call left its own exception set
  instance.attr("op") = nb::str(e.op().c_str());
  instance.attr("argument") = nb::str(e.argument().c_str());
  instance.attr("expected") = nb::str(e.expected().c_str());
  instance.attr("got") = nb::str(e.got().c_str());
  instance.attr("kind") = nb::str(kind_name(e.kind()));
  PyErr_SetObject(type, instance.ptr());
}

void bind_runtime(nb::module_& m) {
  nb::enum_<DType>(m, "DType", "fusekit element types (names as in the C++ API)")
      .value("f32", DType::f32)
      .value("f16", DType::f16)
      .value("bf16", DType::bf16)
      .value("f8e4m3", DType::f8e4m3)
      .value("f8e5m2", DType::f8e5m2)
      .value("f64", DType::f64)
      .value("u8", DType::u8)
      .value("i32", DType::i32)
      .value("i64", DType::i64);

  m.def("cuda_device_count", &cuda_device_count,
        "Number of usable CUDA devices (0 without a driver or GPU).");
  m.def("built_cuda_architectures", &built_cuda_architectures,
        "CUDA architectures the kernels were compiled for, e.g. '90a'.");
  m.def("describe_cuda_device", &describe_cuda_device, nb::arg("device_index"),
        "One line describing a CUDA device.");
  m.def("cuda_device_supported", &cuda_device_supported, nb::arg("device_index"),
        "Whether CUDA device `device_index` exists and this build has kernels for it.");
  m.def("supports_compute_capability", &supports_compute_capability, nb::arg("major"), nb::arg("minor"),
        "Whether this build has kernels for GPUs of compute capability major.minor.");
  m.def("version", &version, "fusekit's version, e.g. '0.1.0'.");

  // How fusekit sees an array: what every op receives after conversion. For tests and debugging.
  m.def(
      "tensor_info",
      [](nb::handle array) {
        OpCall call("tensor_info");
        const TensorView t = call.tensor(array, "array", Access::read);
        nb::dict info;
        info["dtype"] = nb::str(dtype_name(t.dtype));
        info["device"] = nb::str(to_string(t.device).c_str());
        info["shape"] = nb::str(t.shape_string().c_str());
        info["strides"] = nb::str(t.strides_string().c_str());
        info["data"] = nb::int_(reinterpret_cast<std::uintptr_t>(t.data));
        return info;
      },
      nb::arg("array"),
      "The dtype, device, shape, strides (in elements) and data pointer fusekit sees for an array.");
}

}  // namespace
}  // namespace fusekit::python

NB_MODULE(_C, m) {
  using namespace fusekit::python;
  m.doc() = "fusekit's framework-agnostic bindings: ops take DLPack / buffer-protocol arrays.";
  create_exceptions(m);
  nb::register_exception_translator(
      [](const std::exception_ptr& p, void*) {
        try {
          std::rethrow_exception(p);
        } catch (const fusekit::Error& e) {
          raise_error(e);
        }
      },
      nullptr);
  bind_runtime(m);

  // One line per op family (python/src/bind_<family>.cpp).
  bind_norm(m);
  bind_activation(m);
  bind_bias_act_dropout(m);
  bind_linear(m);
  bind_fp8_norm(m);
  bind_attention(m);
  bind_rope(m);
}
