// fusekit._C: the framework-agnostic bindings. Exceptions, dtypes, runtime queries, and one
// bind_<family>() call per op family.
#include <string>

#include "bindings.h"
#include "fusekit/runtime.h"

namespace fusekit::python {
namespace {

// Python exception classes, created once at import. Error is the base; InvalidArgumentError is
// also a ValueError, ArgumentTypeError an InvalidArgumentError and a TypeError, the others also
// RuntimeErrors, so generic handlers keep working.
struct ExceptionTypes {
  PyObject* base = nullptr;
  PyObject* invalid_argument = nullptr;
  PyObject* argument_type = nullptr;
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
  nb::object type_bases =
      nb::make_tuple(nb::handle(g_exceptions.invalid_argument), nb::handle(PyExc_TypeError));
  g_exceptions.argument_type = new_exception(
      m, "ArgumentTypeError", type_bases.ptr(),
      "A scalar or option argument of the wrong Python type (None, a str where a number goes, a "
      "float where an int goes, ...): a TypeError, as PyTorch raises, and an "
      "InvalidArgumentError. The message reads \"fusekit.<op>: argument '<name>' must be <type>, "
      "not <type>\"; expected holds the type the argument takes, got the type that came.");
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

// Raises `type` with `message` and the parts of the error as attributes.
void raise_with_parts(PyObject* type, const char* message, const std::string& op,
                      const std::string& argument, const std::string& expected,
                      const std::string& got, const char* kind) {
  nb::object instance = nb::steal(PyObject_CallOneArg(type, nb::str(message).ptr()));
  if (!instance.is_valid()) return;  // the failed call left its own exception set
  instance.attr("op") = nb::str(op.c_str());
  instance.attr("argument") = nb::str(argument.c_str());
  instance.attr("expected") = nb::str(expected.c_str());
  instance.attr("got") = nb::str(got.c_str());
  instance.attr("kind") = nb::str(kind);
  PyErr_SetObject(type, instance.ptr());
}

// Raises the Python exception for a fusekit::Error with the C++ message unchanged and its parts
// as attributes.
void raise_error(const Error& e) {
  PyObject* type = e.kind() == ErrorKind::invalid_argument ? g_exceptions.invalid_argument
                   : e.kind() == ErrorKind::unsupported    ? g_exceptions.unsupported
                                                           : g_exceptions.cuda;
  raise_with_parts(type, e.what(), e.op(), e.argument(), e.expected(), e.got(), kind_name(e.kind()));
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
  m.def(
      "describe_cuda_device",
      [](nb::handle device_index) {
        const ScalarArgs c("describe_cuda_device");
        const int index = c.i32(device_index, "device_index");
        const int count = cuda_device_count();
        if (index < 0 || index >= count)
          c.fail("device_index",
                 count == 0 ? std::string("the index of a CUDA device present on this machine (it "
                                          "has none: no GPU or no CUDA driver)")
                            : "a CUDA device index below " + std::to_string(count),
                 std::to_string(index));
        return describe_cuda_device(index);
      },
      nb::arg("device_index").none(), "One line describing a CUDA device.");
  m.def(
      "cuda_device_supported",
      [](nb::handle device_index) {
        const ScalarArgs c("cuda_device_supported");
        return cuda_device_supported(c.i32(device_index, "device_index"));
      },
      nb::arg("device_index").none(),
      "Whether CUDA device `device_index` exists and this build has kernels for it.");
  m.def(
      "supports_compute_capability",
      [](nb::handle major, nb::handle minor) {
        const ScalarArgs c("supports_compute_capability");
        const int major_value = c.i32(major, "major"), minor_value = c.i32(minor, "minor");
        return supports_compute_capability(major_value, minor_value);
      },
      nb::arg("major").none(), nb::arg("minor").none(),
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
        } catch (const ArgumentTypeError& e) {
          raise_with_parts(g_exceptions.argument_type, e.what(), e.op(), e.argument(),
                           e.expected(), e.got(), "invalid_argument");
        }
      },
      nullptr);
  bind_runtime(m);

  // One line per op family (python/src/bind_<family>.cpp).
  bind_norm(m);
  bind_activation(m);
  bind_bias_act_dropout(m);
  bind_gated_act(m);
  bind_linear(m);
  bind_fp8_norm(m);
  bind_attention(m);
  bind_cross_entropy(m);
  bind_rope(m);
  bind_embedding(m);
  bind_linear_cross_entropy(m);
  bind_optim(m);
}
