// Array arguments -> TensorView, and the stream/device of a call (see bindings.h).
#include <cuda_runtime.h>
#include <nanobind/stl/string.h>

#include <cstdlib>
#include <string>

#include "bindings.h"
#include "dlpack_exchange.h"

namespace fusekit::python {

namespace {

std::string python_type_name(nb::handle obj) {
  return nb::cast<std::string>(nb::type_name(obj.type()));
}

// The exchange table a tensor type publishes, cached per type (a handful of types are ever seen:
// torch.Tensor, nn.Parameter, numpy.ndarray, ...). nullptr when the type publishes none or one of
// an unsupported major version. Cached types are kept alive so that an address is never reused.
const dl::ExchangeApi* exchange_api_of(PyTypeObject* type) {
  // FUSEKIT_DLPACK_EXCHANGE=0 forces the __dlpack__() path (tests of older frameworks, debugging).
  static const bool enabled = [] {
    const char* env = std::getenv("FUSEKIT_DLPACK_EXCHANGE");
    return !(env && std::string(env) == "0");
  }();
  if (!enabled) return nullptr;
  struct Entry {
    PyTypeObject* type;
    const dl::ExchangeApi* api;
  };
  static std::array<Entry, 32> cache{};
  static int used = 0;
  for (int i = 0; i < used; ++i)
    if (cache[i].type == type) return cache[i].api;

  const dl::ExchangeApi* api = nullptr;
  PyObject* capsule = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type),
                                             dl::kExchangeApiAttribute);
  if (capsule) {
    auto* header = static_cast<dl::ExchangeApiHeader*>(
        PyCapsule_GetPointer(capsule, dl::kExchangeApiCapsuleName));
    // A newer major version may chain an older table we understand.
    while (header && header->version.major > dl::kSupportedMajorVersion) header = header->prev_api;
    // The table layout fusekit declares is that of DLPack 1.3 (what PyTorch 2.11 publishes);
    // an older minor version may lack entries, so it is not read.
    if (header && header->version.major == dl::kSupportedMajorVersion &&
        header->version.minor >= dl::kMinimumMinorVersion) {
      auto* table = reinterpret_cast<const dl::ExchangeApi*>(header);
      if (table->dltensor_from_py_object_no_sync && table->current_work_stream) api = table;
    }
    Py_DECREF(capsule);
  }
  PyErr_Clear();  // no attribute / wrong capsule: fall back to __dlpack__
  if (used < static_cast<int>(cache.size())) {
    Py_INCREF(type);
    cache[used++] = {type, api};
  }
  return api;
}

std::string dlpack_dtype_string(std::uint8_t code, std::uint8_t bits, std::uint16_t lanes) {
  const char* kind = code == dl::kInt      ? "int"
                     : code == dl::kUInt   ? "uint"
                     : code == dl::kFloat  ? "float"
                     : code == dl::kBfloat ? "bfloat"
                     : code == 5           ? "complex"
                     : code == dl::kBool   ? "bool"
                                           : nullptr;
  std::string s = kind ? std::string(kind) + std::to_string(bits)
                       : "DLPack type code " + std::to_string(code) + " of " + std::to_string(bits) + " bits";
  if (lanes != 1) s += " x" + std::to_string(lanes) + " lanes";
  return s;
}

bool to_fusekit_dtype(std::uint8_t code, std::uint8_t bits, DType* out) {
  switch (code) {
    case dl::kFloat:
      if (bits == 16) { *out = DType::f16; return true; }
      if (bits == 32) { *out = DType::f32; return true; }
      if (bits == 64) { *out = DType::f64; return true; }
      return false;
    case dl::kBfloat:
      if (bits == 16) { *out = DType::bf16; return true; }
      return false;
    case dl::kFloat8_e4m3fn:
      if (bits == 8) { *out = DType::f8e4m3; return true; }
      return false;
    case dl::kFloat8_e5m2:
      if (bits == 8) { *out = DType::f8e5m2; return true; }
      return false;
    case dl::kUInt:
      if (bits == 8) { *out = DType::u8; return true; }
      return false;
    case dl::kInt:
      if (bits == 32) { *out = DType::i32; return true; }
      if (bits == 64) { *out = DType::i64; return true; }
      return false;
    default:
      return false;
  }
}

constexpr const char* kAcceptedDtypes = "f32, f16, bf16, f8e4m3 (e4m3fn), f8e5m2, f64, u8, i32 or i64";

// NumPy cannot export ml_dtypes' extension types through DLPack; they are imported as same-size
// unsigned integers and relabelled.
struct ExtensionDtype {
  const char* numpy_name;
  const char* view_as;
  DType dtype;
};
constexpr ExtensionDtype kExtensionDtypes[] = {
    {"bfloat16", "u2", DType::bf16},
    {"float8_e4m3fn", "u1", DType::f8e4m3},
    {"float8_e5m2", "u1", DType::f8e5m2},
};

}  // namespace

void OpCall::fail(const char* name, const std::string& expected, const std::string& got) const {
  throw Error(ErrorKind::invalid_argument, op_, name, expected, got);
}

TensorView OpCall::from_dlpack(const char* name, void* data, std::int32_t device_type,
                               std::int32_t device_id, std::int32_t ndim, std::uint8_t code,
                               std::uint8_t bits, std::uint16_t lanes, const std::int64_t* shape,
                               const std::int64_t* strides) {
  DType dtype{};
  if (lanes != 1 || !to_fusekit_dtype(code, bits, &dtype))
    fail(name, std::string("an array of dtype ") + kAcceptedDtypes, dlpack_dtype_string(code, bits, lanes));
  Device device;
  switch (device_type) {
    case dl::kCPU:
    case dl::kCUDAHost:
      device = Device::cpu();
      break;
    case dl::kCUDA:
      device = Device::cuda(device_id);
      break;
    default:
      fail(name, "an array on the CPU or a CUDA device",
           "an array on DLPack device type " + std::to_string(device_type) +
               (device_type == dl::kCUDAManaged ? " (CUDA managed memory)" : ""));
  }
  if (ndim < 0 || ndim > kMaxDims)
    fail(name, "an array of at most " + std::to_string(kMaxDims) + " dimensions",
         std::to_string(ndim) + " dimensions");
  // An array without elements has no meaningful strides (NumPy exports zeros); describe it as
  // contiguous so that layout checks do not reject it.
  for (std::int32_t d = 0; d < ndim; ++d)
    if (shape[d] == 0) strides = nullptr;
  return TensorView::from_arrays(data, dtype, device, ndim, shape, strides);
}

void OpCall::note_device(const TensorView& t, const void* exchange_api) {
  if (imports_total_++ == 0) {
    first_api_ = exchange_api;
    first_device_ = t.device;
  }
  if (t.device.is_cuda() && cuda_device_ < 0) {
    cuda_device_ = t.device.index;
    stream_source_ = exchange_api;
  }
}

bool OpCall::import_exchange(nb::handle obj, const char* name, TensorView* out) {
  const dl::ExchangeApi* api = exchange_api_of(Py_TYPE(obj.ptr()));
  if (!api) return false;
  dl::Tensor t{};
  if (api->dltensor_from_py_object_no_sync(obj.ptr(), &t) != 0) {
    nb::python_error why;  // takes the pending exception
    // The first line only: PyTorch appends a C++ backtrace.
    std::string reason = why.what();
    reason = reason.substr(0, reason.find('\n'));
    fail(name, "an array its framework can export through DLPack",
         python_type_name(obj) + " that it refused to export (" + reason + ")");
  }
  *out = from_dlpack(name, static_cast<char*>(t.data) + t.byte_offset, t.device.device_type,
                     t.device.device_id, t.ndim, t.dtype.code, t.dtype.bits, t.dtype.lanes,
                     t.shape, t.strides);
  note_device(*out, api);
  return true;
}

bool OpCall::import_ndarray(nb::handle obj, const char* name, Access access, TensorView* out,
                            const DType* relabel) {
  if (imports_ >= kMaxImports)
    throw Error(ErrorKind::unsupported, op_, "more array arguments than the binding layer holds");
  nb::ndarray<nb::ro> held;
  if (access == Access::read) {
    if (!nb::try_cast(obj, held, /*convert=*/false)) return false;
  } else {
    nb::ndarray<> writable;
    if (!nb::try_cast(obj, writable, /*convert=*/false)) return false;
    held = nb::ndarray<nb::ro>(writable);
  }
  auto dtype = held.dtype();
  if (relabel) {  // the same-size unsigned view of an extension dtype (see kExtensionDtypes)
    dtype.code = *relabel == DType::bf16 ? dl::kBfloat
                 : *relabel == DType::f8e4m3 ? dl::kFloat8_e4m3fn
                                             : dl::kFloat8_e5m2;
  }
  const std::int32_t ndim = static_cast<std::int32_t>(held.ndim());
  std::int64_t shape[kMaxDims], strides[kMaxDims];
  for (std::int32_t d = 0; d < ndim && d < kMaxDims; ++d) {
    shape[d] = static_cast<std::int64_t>(held.shape(d));
    strides[d] = held.stride(d);
  }
  *out = from_dlpack(name, const_cast<void*>(held.data()), held.device_type(), held.device_id(),
                     ndim, dtype.code, dtype.bits, dtype.lanes, shape, strides);
  keep_alive_[imports_++] = std::move(held);
  note_device(*out, nullptr);
  return true;
}

TensorView OpCall::tensor(nb::handle obj, const char* name, Access access) {
  constexpr const char* kExpected =
      "an array (NumPy, PyTorch, CuPy, JAX or any DLPack / buffer-protocol object)";
  if (!obj.is_valid() || obj.is_none()) fail(name, kExpected, "None");
  TensorView view;
  if (import_exchange(obj, name, &view)) return view;
  if (capsule_view(obj, &view)) return view;
  // NumPy arrays of ml_dtypes' bfloat16 / float8 types: checked first, since their buffer export
  // claims plain unsigned integers.
  if (nb::hasattr(obj, "dtype") && nb::hasattr(obj, "view")) {
    nb::object np_dtype = obj.attr("dtype");
    if (nb::hasattr(np_dtype, "name")) {
      const std::string numpy_name = nb::cast<std::string>(nb::str(np_dtype.attr("name")));
      for (const ExtensionDtype& ext : kExtensionDtypes) {
        if (numpy_name != ext.numpy_name) continue;
        nb::object as_uint = obj.attr("view")(ext.view_as);
        if (import_ndarray(as_uint, name, access, &view, &ext.dtype)) return view;
      }
    }
  }
  if (import_ndarray(obj, name, access, &view)) return view;
  if (access == Access::write) {
    // Distinguish "read-only" from "not an array" for the caller.
    TensorView probe;
    bool readable = false;
    try {
      readable = import_ndarray(obj, name, Access::read, &probe);
    } catch (const Error&) {
    }
    if (readable)
      fail(name, "a writable array (this argument is an output)", "a read-only " + python_type_name(obj));
  }
  fail(name, kExpected, python_type_name(obj));
}

OptionalTensor OpCall::optional(nb::handle obj, const char* name, Access access) {
  if (!obj.is_valid() || obj.is_none()) return std::nullopt;
  return tensor(obj, name, access);
}

OpCall::~OpCall() {
  if (scratch_) {
    auto* t = static_cast<dl::ManagedTensorVersioned*>(scratch_);
    if (t->deleter) t->deleter(t);
  }
}

namespace {
// What an exchange-table allocator reports through its set_error callback.
struct AllocatorError {
  std::string text;
};
void record_allocator_error(void* ctx, const char* kind, const char* message) {
  auto* e = static_cast<AllocatorError*>(ctx);
  e->text = std::string(kind ? kind : "error") + ": " + (message ? message : "");
}

// Capsules of new_f32_capsule: a framework tensor (DLManagedTensorVersioned) freed with the capsule.
constexpr const char* kF32CapsuleName = "fusekit.f32_array";

void free_f32_capsule(PyObject* capsule) {
  auto* t = static_cast<dl::ManagedTensorVersioned*>(PyCapsule_GetPointer(capsule, kF32CapsuleName));
  if (!t) {
    PyErr_Clear();
    return;
  }
  if (t->deleter) t->deleter(t);
}
}  // namespace

bool OpCall::capsule_view(nb::handle obj, TensorView* out) {
  if (!PyCapsule_CheckExact(obj.ptr()) || !PyCapsule_IsValid(obj.ptr(), kF32CapsuleName)) return false;
  auto* t = static_cast<dl::ManagedTensorVersioned*>(PyCapsule_GetPointer(obj.ptr(), kF32CapsuleName));
  const dl::Tensor& d = t->dl_tensor;
  const Device device = d.device.device_type == dl::kCUDA ? Device::cuda(d.device.device_id) : Device::cpu();
  *out = TensorView::from_arrays(static_cast<char*>(d.data) + d.byte_offset, DType::f32, device,
                                 d.ndim, d.shape, nullptr);
  return true;
}

nb::object OpCall::new_f32_capsule(std::int64_t count, TensorView* view) {
  return new_f32_capsule(1, &count, view);
}

nb::object OpCall::new_f32_capsule(int ndim, const std::int64_t* sizes, TensorView* view) {
  const auto* api = static_cast<const dl::ExchangeApi*>(first_api_);
  if (!api || !api->managed_tensor_allocator)
    throw Error(ErrorKind::unsupported, op_,
                "arrays allocated by fusekit need arrays from a framework whose DLPack exchange "
                "table has an allocator (PyTorch 2.10 or later); pass preallocated arrays instead");
  if (ndim < 1 || ndim > kMaxDims) fail("shape", "1 to " + std::to_string(kMaxDims) + " sizes", std::to_string(ndim));
  std::int64_t shape[kMaxDims];
  std::int64_t count = 1;
  for (int d = 0; d < ndim; ++d) {
    if (sizes[d] < 0) fail("shape", "non-negative sizes", std::to_string(sizes[d]));
    shape[d] = sizes[d];
    count *= sizes[d];
  }
  dl::Tensor prototype{};
  prototype.device = first_device_.is_cuda() ? dl::Device{dl::kCUDA, first_device_.index}
                                             : dl::Device{dl::kCPU, 0};
  prototype.ndim = ndim;
  prototype.dtype = {dl::kFloat, 32, 1};
  prototype.shape = shape;
  AllocatorError error;
  dl::ManagedTensorVersioned* out = nullptr;
  if (api->managed_tensor_allocator(&prototype, &out, &error, record_allocator_error) != 0 || !out) {
    PyErr_Clear();  // an allocator may also have set a Python error: the message is in `error`
    throw Error(ErrorKind::cuda, op_,
                "could not allocate " + std::to_string(count) +
                    " float32 values through the framework's allocator (" + error.text + ")");
  }
  PyObject* capsule = PyCapsule_New(out, kF32CapsuleName, free_f32_capsule);
  if (!capsule) {
    if (out->deleter) out->deleter(out);
    throw nb::python_error();
  }
  const dl::Tensor& t = out->dl_tensor;
  *view = TensorView::from_arrays(static_cast<char*>(t.data) + t.byte_offset, DType::f32,
                                  first_device_, ndim, shape, nullptr);
  return nb::steal(capsule);
}

bool OpCall::is_auto(nb::handle obj) {
  if (!obj.is_valid() || !PyUnicode_Check(obj.ptr())) return false;
  return PyUnicode_CompareWithASCIIString(obj.ptr(), "auto") == 0;
}

TensorView OpCall::framework_scratch(std::size_t bytes) {
  const auto* api = static_cast<const dl::ExchangeApi*>(stream_source_);
  if (cuda_device_ < 0 || !api || !api->managed_tensor_allocator)
    fail("workspace", "an array, or 'auto' with CUDA arrays from a framework whose DLPack exchange "
         "table has an allocator (PyTorch 2.10 or later)", "'auto'");
  if (scratch_) throw Error(ErrorKind::unsupported, op_, "more than one workspace='auto' in one call");
  std::int64_t shape[1] = {static_cast<std::int64_t>(bytes)};
  dl::Tensor prototype{};
  prototype.device = {dl::kCUDA, cuda_device_};
  prototype.ndim = 1;
  prototype.dtype = {dl::kUInt, 8, 1};
  prototype.shape = shape;
  AllocatorError error;
  dl::ManagedTensorVersioned* out = nullptr;
  if (api->managed_tensor_allocator(&prototype, &out, &error, record_allocator_error) != 0 || !out) {
    PyErr_Clear();  // an allocator may also have set a Python error: the message is in `error`
    throw Error(ErrorKind::cuda, op_,
                "could not allocate the " + std::to_string(bytes) +
                    "-byte workspace through the framework's allocator (" + error.text + ")");
  }
  scratch_ = out;
  auto_workspace_ = true;
  const dl::Tensor& t = out->dl_tensor;
  return TensorView::from_arrays(static_cast<char*>(t.data) + t.byte_offset, DType::u8,
                                 Device::cuda(cuda_device_), 1, shape, nullptr);
}

Stream OpCall::resolve_stream(nb::handle stream) const {
  if (stream.is_valid() && !stream.is_none()) {
    // The framework ties the workspace it allocated to its current stream; another stream could
    // reuse the memory while the op still runs.
    if (auto_workspace_)
      fail("stream", "None with workspace='auto' (the workspace belongs to the framework's current "
           "stream)", "an explicit stream");
    if (!PyLong_Check(stream.ptr()))
      fail("stream", "None or an int holding a cudaStream_t (0 = legacy default stream)",
           python_type_name(stream));
    const unsigned long long value = PyLong_AsUnsignedLongLong(stream.ptr());
    if (PyErr_Occurred()) {
      PyErr_Clear();
      fail("stream", "a non-negative int holding a cudaStream_t", nb::cast<std::string>(nb::repr(stream)));
    }
    return reinterpret_cast<Stream>(static_cast<std::uintptr_t>(value));
  }
  if (cuda_device_ < 0 || !stream_source_) return nullptr;
  const auto* api = static_cast<const dl::ExchangeApi*>(stream_source_);
  void* current = nullptr;
  if (api->current_work_stream(dl::kCUDA, cuda_device_, &current) != 0) {
    nb::python_error why;
    throw Error(ErrorKind::cuda, op_, std::string("could not get the framework's current stream: ") + why.what());
  }
  return current;
}

OpCall::DeviceScope::DeviceScope(int device) {
  if (device < 0) return;
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) {
    cudaGetLastError();
    return;  // the op itself reports the missing device
  }
  if (current == device) return;
  if (cudaSetDevice(device) == cudaSuccess) {
    previous_ = current;
  } else {
    cudaGetLastError();
  }
}

OpCall::DeviceScope::~DeviceScope() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

}  // namespace fusekit::python
