// ScalarArgs (see bindings.h): Python scalars to the C++ parameter types, with errors that name
// the op and the argument. The common case (an exact float, int or bool) is one CPython type check
// and one conversion, as nanobind's own casts; NumPy scalars and every error take a slower path.
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "bindings.h"

namespace fusekit::python {

namespace {

std::string type_name_of(nb::handle value) {
  return nb::cast<std::string>(nb::type_name(value.type()));
}

// NumPy's scalar classes numpy.bool_ and numpy.complexfloating, looked up once NumPy is imported
// (a NumPy scalar cannot exist before): they convert to float in Python but are not real numbers
// here. The references are kept for the process's lifetime.
struct NumpyScalarTypes {
  PyTypeObject* boolean = nullptr;
  PyTypeObject* complex = nullptr;
};

const NumpyScalarTypes& numpy_scalar_types() {
  static NumpyScalarTypes types;
  if (types.boolean) return types;
  nb::object name = nb::str("numpy");
  PyObject* numpy = PyImport_GetModule(name.ptr());
  if (numpy) {
    PyObject* boolean = PyObject_GetAttrString(numpy, "bool_");
    PyObject* complex = PyObject_GetAttrString(numpy, "complexfloating");
    if (boolean && complex && PyType_Check(boolean) && PyType_Check(complex)) {
      types.boolean = reinterpret_cast<PyTypeObject*>(boolean);
      types.complex = reinterpret_cast<PyTypeObject*>(complex);
    } else {
      Py_XDECREF(boolean);
      Py_XDECREF(complex);
    }
    Py_DECREF(numpy);
  }
  PyErr_Clear();
  return types;
}

bool is_numpy_bool(PyObject* o) {
  const NumpyScalarTypes& t = numpy_scalar_types();
  return t.boolean && PyObject_TypeCheck(o, t.boolean);
}

bool is_numpy_complex(PyObject* o) {
  const NumpyScalarTypes& t = numpy_scalar_types();
  return t.complex && PyObject_TypeCheck(o, t.complex);
}

// `value` as a Python int: itself when it is one, else its __index__() (NumPy integer scalars);
// false for a bool (an int to Python, not a number here) and for anything not integral.
bool integral(nb::handle value, nb::object* out) {
  PyObject* o = value.ptr();
  if (PyBool_Check(o) || !PyIndex_Check(o)) return false;
  if (PyLong_Check(o)) {
    *out = nb::borrow(o);
    return true;
  }
  PyObject* index = PyNumber_Index(o);
  if (!index) {  // e.g. a multi-element array's __index__
    PyErr_Clear();
    return false;
  }
  *out = nb::steal(index);
  return true;
}

// An int for an error message: its digits, or its size where the digits would flood the message.
std::string int_text(PyObject* i) {
  PyObject* bits = PyObject_CallMethod(i, "bit_length", nullptr);
  const long long n = bits ? PyLong_AsLongLong(bits) : -1;
  Py_XDECREF(bits);
  if (n >= 0 && n <= 128) {
    PyObject* text = PyObject_Str(i);
    if (text) {
      nb::object owned = nb::steal(text);
      return nb::cast<std::string>(owned);
    }
  }
  PyErr_Clear();
  const bool negative = PyObject_RichCompareBool(i, nb::int_(0).ptr(), Py_LT) == 1;
  PyErr_Clear();
  return std::string(negative ? "a negative int of " : "an int of ") + std::to_string(n) + " bits";
}

// repr(value), e.g. 'cuda:x' with its quotes (also for strings that are not valid UTF-8).
std::string repr_text(nb::handle value) {
  PyObject* text = PyObject_Repr(value.ptr());
  if (!text) {
    PyErr_Clear();
    return "a " + type_name_of(value);
  }
  nb::object owned = nb::steal(text);
  return nb::cast<std::string>(owned);
}

std::string float_text(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.9g", v);
  return text;
}

// float32 from a real number: a float, an int (anything with __index__: NumPy integer scalars)
// or anything else with __float__ (NumPy floating scalars, 0-d arrays and tensors), but not a bool
// or a complex number; `type` names what the argument takes in a type error.
float to_f32(const ScalarArgs& c, nb::handle value, const char* name, const char* type) {
  constexpr const char* kRange = "a number float32 can hold (magnitude at most 3.4028235e38)";
  PyObject* o = value.ptr();
  double v;
  nb::object i;
  if (PyFloat_CheckExact(o)) {
    v = PyFloat_AS_DOUBLE(o);
  } else if (PyLong_CheckExact(o) || integral(value, &i)) {
    PyObject* as_int = i.is_valid() ? i.ptr() : o;
    v = PyLong_AsDouble(as_int);
    if (v == -1.0 && PyErr_Occurred()) {  // beyond double's range
      PyErr_Clear();
      c.fail(name, kRange, int_text(as_int));
    }
  } else {
    const PyNumberMethods* number = Py_TYPE(o)->tp_as_number;
    if (!number || !number->nb_float || PyBool_Check(o) || is_numpy_bool(o) || is_numpy_complex(o))
      c.fail_type(name, type, value);
    v = PyFloat_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred()) {  // e.g. an array of several elements
      PyErr_Clear();
      c.fail_type(name, type, value);
    }
  }
  const float f = static_cast<float>(v);
  if (std::isinf(f) && std::isfinite(v)) c.fail(name, kRange, float_text(v));
  return f;
}

}  // namespace

ArgumentTypeError::ArgumentTypeError(std::string op, std::string argument, std::string expected,
                                     std::string got)
    : op_(std::move(op)),
      argument_(std::move(argument)),
      expected_(std::move(expected)),
      got_(std::move(got)),
      message_("fusekit." + op_ + ": argument '" + argument_ + "' must be " + expected_ + ", not " +
               got_) {}

void ScalarArgs::fail_type(const char* name, const char* expected, nb::handle value) const {
  throw ArgumentTypeError(op_, name, expected, type_name_of(value));
}

float ScalarArgs::f32(nb::handle value, const char* name) const {
  return to_f32(*this, value, name, "float");
}

std::optional<float> ScalarArgs::optional_f32(nb::handle value, const char* name) const {
  if (value.is_none()) return std::nullopt;
  return to_f32(*this, value, name, "float or None");
}

std::int64_t ScalarArgs::i64(nb::handle value, const char* name) const {
  return signed_integer(value, name, std::numeric_limits<std::int64_t>::min(),
                        std::numeric_limits<std::int64_t>::max(), "an int in [-2^63, 2^63)");
}

int ScalarArgs::i32(nb::handle value, const char* name) const {
  return static_cast<int>(signed_integer(value, name, std::numeric_limits<int>::min(),
                                         std::numeric_limits<int>::max(), "an int in [-2^31, 2^31)"));
}

std::int64_t ScalarArgs::signed_integer(nb::handle value, const char* name, std::int64_t lo,
                                        std::int64_t hi, const char* range) const {
  nb::object i;
  PyObject* o = value.ptr();
  if (!PyLong_CheckExact(o)) {
    if (!integral(value, &i)) fail_type(name, "int", value);
    o = i.ptr();
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow != 0 || v < lo || v > hi) fail(name, range, int_text(o));
  return v;
}

std::uint64_t ScalarArgs::unsigned_integer(nb::handle value, const char* name, const char* type,
                                           const char* range) const {
  nb::object i;
  PyObject* o = value.ptr();
  if (!PyLong_CheckExact(o)) {
    if (!integral(value, &i)) fail_type(name, type, value);
    o = i.ptr();
  }
  const unsigned long long v = PyLong_AsUnsignedLongLong(o);
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {  // negative or too large
    PyErr_Clear();
    fail(name, range, int_text(o));
  }
  return static_cast<std::uint64_t>(v);
}

std::uint64_t ScalarArgs::u64(nb::handle value, const char* name) const {
  return unsigned_integer(value, name, "int", "an int in [0, 2^64)");
}

bool ScalarArgs::flag(nb::handle value, const char* name) const {
  PyObject* o = value.ptr();
  if (o == Py_True) return true;
  if (o == Py_False) return false;
  if (is_numpy_bool(o)) {
    const int truth = PyObject_IsTrue(o);
    if (truth >= 0) return truth == 1;
    PyErr_Clear();
  }
  fail_type(name, "bool", value);
}

DType ScalarArgs::dtype(nb::handle value, const char* name) const {
  DType parsed;
  if (nb::try_cast<DType>(value, parsed, /*convert=*/false)) return parsed;
  fail_type(name, "fusekit.DType", value);
}

Device ScalarArgs::device(nb::handle value, const char* name) const {
  if (!PyUnicode_Check(value.ptr())) fail_type(name, "str", value);
  Py_ssize_t size = 0;
  const char* utf8 = PyUnicode_AsUTF8AndSize(value.ptr(), &size);
  if (!utf8) PyErr_Clear();
  const std::string text = utf8 ? std::string(utf8, static_cast<std::size_t>(size)) : std::string();
  if (text == "cpu") return Device::cpu();
  // 'cuda' or 'cuda:' and decimal digits (no sign, no spaces).
  long long index = -1;
  if (text == "cuda") {
    index = 0;
  } else if (text.rfind("cuda:", 0) == 0 && text.size() > 5 && text.size() <= 5 + 9) {
    index = 0;
    for (std::size_t k = 5; k < text.size() && index >= 0; ++k)
      index = text[k] >= '0' && text[k] <= '9' ? index * 10 + (text[k] - '0') : -1;
  }
  if (index < 0) fail(name, "'cpu', 'cuda' or 'cuda:N'", repr_text(value));
  // Whether the device is present is the op's to check: some sizes are pure functions of the
  // problem and need no GPU.
  return Device::cuda(static_cast<int>(index));
}

int ScalarArgs::option_index(nb::handle value, const char* name, const char* type_name,
                             const char* const* names, int count) const {
  if (!PyUnicode_Check(value.ptr())) {
    const std::string expected = std::string(type_name) + " or str";
    fail_type(name, expected.c_str(), value);
  }
  for (int i = 0; i < count; ++i)
    if (PyUnicode_CompareWithASCIIString(value.ptr(), names[i]) == 0) return i;
  std::string expected = std::string(type_name) + " or one of ";
  for (int i = 0; i < count; ++i) expected += std::string(i ? ", '" : "'") + names[i] + "'";
  fail(name, expected, repr_text(value));
}

KeepMaskArgs keep_mask_args(const ScalarArgs& c, nb::handle seed, nb::handle offset, nb::handle p) {
  const KeepMaskArgs args{c.u64(seed, "seed"), c.u64(offset, "offset"), c.f32(p, "p")};
  if (!(args.p >= 0.0f && args.p < 1.0f))
    c.fail("p", "a drop probability in [0, 1)", float_text(args.p));
  return args;
}

}  // namespace fusekit::python
