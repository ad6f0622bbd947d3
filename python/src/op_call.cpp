// Array arguments -> TensorView, and the stream/device of a call (see bindings.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <bit>
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

void ScalarArgs::fail(const char* name, const std::string& expected, const std::string& got) const {
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
  if (imports_ < kMaxImports)
    keep_alive_[imports_++] = std::move(held);
  else
    keep_alive_more_.push_back(std::move(held));
  note_device(*out, nullptr);
  return true;
}

std::vector<TensorView> OpCall::tensor_list(nb::handle obj, const char* name, Access access) {
  if (!obj.is_valid() || !(nb::isinstance<nb::list>(obj) || nb::isinstance<nb::tuple>(obj)))
    fail(name, "a list or tuple of arrays", obj.is_valid() ? python_type_name(obj) : std::string("None"));
  const nb::sequence items = nb::borrow<nb::sequence>(obj);
  const std::size_t count = nb::len(items);
  std::vector<TensorView> views;
  views.reserve(count);
  for (std::size_t i = 0; i < count; ++i) {
    element_names_.push_back(std::string(name) + "[" + std::to_string(i) + "]");
    views.push_back(tensor(items[i], element_names_.back().c_str(), access));
  }
  return views;
}

TensorView OpCall::tensor(nb::handle obj, const char* name, Access access) {
  constexpr const char* kExpected =
      "an array (NumPy, PyTorch, CuPy, JAX or any DLPack / buffer-protocol object)";
  if (!obj.is_valid() || obj.is_none()) fail(name, kExpected, "None");
  TensorView view;
  if (import_exchange(obj, name, &view)) {
    // A DTensor (tensor parallelism) exports its metadata but no local data: name it rather than
    // its null pointer. Checked only when the pointer is null, so plain arrays pay nothing.
    if (view.data == nullptr && view.numel() > 0 && python_type_name(obj).find("DTensor") != std::string::npos)
      fail(name, "a local tensor (DTensor inputs are not supported: tensor parallelism; pass DTensor.to_local())",
           "a DTensor");
    return view;
  }
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
  fail_unexported_dtype(obj, name);
  fail(name, kExpected, python_type_name(obj));
}

void OpCall::fail_unexported_dtype(nb::handle obj, const char* name) const {
  // NumPy exports neither through DLPack nor through the buffer protocol as nanobind reads it an
  // array of another byte order or of a dtype without a DLPack equivalent; say which dtype it is.
  nb::object dtype = nb::getattr(obj, "dtype", nb::none());
  if (dtype.is_none() || !nb::hasattr(dtype, "byteorder") || !nb::hasattr(dtype, "kind") ||
      !nb::hasattr(dtype, "itemsize"))
    return;
  std::string byteorder, kind, text, numpy_name;
  long itemsize = 0;
  try {
    numpy_name = nb::cast<std::string>(nb::str(nb::getattr(dtype, "name", nb::str(""))));
    byteorder = nb::cast<std::string>(nb::str(dtype.attr("byteorder")));
    kind = nb::cast<std::string>(nb::str(dtype.attr("kind")));
    itemsize = nb::cast<long>(dtype.attr("itemsize"));
    text = nb::cast<std::string>(nb::str(dtype));
  } catch (const std::exception&) {
    PyErr_Clear();
    return;  // not a NumPy-like dtype
  }
  for (const ExtensionDtype& ext : kExtensionDtypes)
    if (numpy_name == ext.numpy_name) return;  // a supported dtype: not the reason
  const std::string expected = std::string("an array of dtype ") + kAcceptedDtypes;
  constexpr bool kLittleEndian = std::endian::native == std::endian::little;
  const char foreign = kLittleEndian ? '>' : '<';
  if (byteorder.size() == 1 && byteorder[0] == foreign)
    fail(name, expected + " in the machine's byte order (" + (kLittleEndian ? "little" : "big") + "-endian)",
         text + (kLittleEndian ? " (big-endian)" : " (little-endian)"));
  const bool supported = (kind == "f" && (itemsize == 2 || itemsize == 4 || itemsize == 8)) ||
                         (kind == "i" && (itemsize == 4 || itemsize == 8)) ||
                         (kind == "u" && itemsize == 1);
  if (!supported) fail(name, expected, text);
  fail(name, "an array NumPy can export through DLPack or the buffer protocol",
       python_type_name(obj) + " of dtype " + text + " that it could not export (strides that are "
       "not whole elements?)");
}

TensorView OpCall::contiguous(nb::handle obj, const char* name) {
  TensorView view = tensor(obj, name, Access::read);
  if (view.is_contiguous() || !nb::hasattr(obj, "contiguous")) return view;  // else: its error
  if (contiguous_made_ >= static_cast<int>(contiguous_copies_.size()))
    throw Error(ErrorKind::unsupported, op_, "too many non-contiguous arguments in one call");
  nb::object copy = obj.attr("contiguous")();
  view = tensor(copy, name, Access::read);
  contiguous_copies_[contiguous_made_++] = std::move(copy);
  return view;
}

OptionalTensor OpCall::optional_contiguous(nb::handle obj, const char* name) {
  if (!obj.is_valid() || obj.is_none()) return std::nullopt;
  return contiguous(obj, name);
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

namespace {
dl::DataType to_dlpack_dtype(DType dtype) {
  switch (dtype) {
    case DType::f32: return {dl::kFloat, 32, 1};
    case DType::f16: return {dl::kFloat, 16, 1};
    case DType::f64: return {dl::kFloat, 64, 1};
    case DType::bf16: return {dl::kBfloat, 16, 1};
    case DType::f8e4m3: return {dl::kFloat8_e4m3fn, 8, 1};
    case DType::f8e5m2: return {dl::kFloat8_e5m2, 8, 1};
    case DType::u8: return {dl::kUInt, 8, 1};
    case DType::i32: return {dl::kInt, 32, 1};
    case DType::i64: return {dl::kInt, 64, 1};
  }
  return {dl::kUInt, 8, 1};
}
}  // namespace

void* OpCall::allocate(const void* exchange_api, Device device, DType dtype, int ndim,
                       const std::int64_t* shape, const char* what) {
  const auto* api = static_cast<const dl::ExchangeApi*>(exchange_api);
  if (!api || !api->managed_tensor_allocator)
    throw Error(ErrorKind::unsupported, op_,
                std::string("allocating ") + what + " needs arrays from a framework whose DLPack "
                "exchange table has an allocator (PyTorch 2.10 or later); pass preallocated "
                "arrays instead");
  if (ndim < 0 || ndim > kMaxDims)
    fail("shape", "0 to " + std::to_string(kMaxDims) + " sizes", std::to_string(ndim));
  std::int64_t sizes[kMaxDims];
  for (int d = 0; d < ndim; ++d) {
    if (shape[d] < 0) fail("shape", "non-negative sizes", std::to_string(shape[d]));
    sizes[d] = shape[d];
  }
  dl::Tensor prototype{};
  prototype.device = device.is_cuda() ? dl::Device{dl::kCUDA, device.index} : dl::Device{dl::kCPU, 0};
  prototype.ndim = ndim;
  prototype.dtype = to_dlpack_dtype(dtype);
  prototype.shape = sizes;
  AllocatorError error;
  dl::ManagedTensorVersioned* out = nullptr;
  if (api->managed_tensor_allocator(&prototype, &out, &error, record_allocator_error) != 0 || !out) {
    PyErr_Clear();  // an allocator may also have set a Python error: the message is in `error`
    // The bytes asked for, as the caller needs them to size a retry (saturating: the shape was
    // checked above, its product may still be absurd).
    std::int64_t bytes = static_cast<std::int64_t>(dtype_size(dtype));
    bool overflow = false;
    for (int d = 0; d < ndim; ++d) overflow = overflow || __builtin_mul_overflow(bytes, sizes[d], &bytes);
    throw Error(ErrorKind::cuda, op_,
                std::string("could not allocate ") + what + " of " +
                    (overflow ? std::string("more than 2^63") : std::to_string(bytes)) + " bytes on " +
                    to_string(device) + " through the framework's allocator (" + error.text + ")");
  }
  return out;
}

nb::object OpCall::new_array(const ArraySpec& spec, TensorView* view) {
  const auto* api = static_cast<const dl::ExchangeApi*>(first_api_);
  if (api && !api->managed_tensor_to_py_object_no_sync) api = nullptr;
  if (spec.transposed && spec.ndim != 2)
    throw Error(ErrorKind::unsupported, op_, "only 2-D framework arrays are laid out transposed");
  // A transposed array is allocated as its (shape[1], shape[0]) transpose, handed out through the
  // framework's transpose(0, 1).
  const std::int64_t stored[2] = {spec.transposed ? spec.shape[1] : 0, spec.transposed ? spec.shape[0] : 0};
  auto* out = static_cast<dl::ManagedTensorVersioned*>(
      allocate(api, first_device_, spec.dtype, spec.ndim, spec.transposed ? stored : spec.shape, "an output"));
  const dl::Tensor& t = out->dl_tensor;
  const std::int64_t transposed_strides[2] = {1, std::max<std::int64_t>(spec.shape[0], 1)};
  *view = TensorView::from_arrays(static_cast<char*>(t.data) + t.byte_offset, spec.dtype, first_device_,
                                  spec.ndim, spec.shape, spec.transposed ? transposed_strides : nullptr);
  void* object = nullptr;
  if (api->managed_tensor_to_py_object_no_sync(out, &object) != 0 || !object)
    throw nb::python_error();  // the table took ownership of `out` either way
  nb::object array = nb::steal(static_cast<PyObject*>(object));
  return spec.transposed ? array.attr("transpose")(0, 1) : array;
}

nb::object OpCall::new_optional(bool wanted, const ArraySpec& spec, OptionalTensor* view) {
  if (!wanted) {
    *view = std::nullopt;
    return nb::none();
  }
  TensorView made;
  nb::object object = new_array(spec, &made);
  *view = made;
  return object;
}

namespace {
// One framework allocation shared by the arrays new_arrays carves from it: released when the
// last view's deleter runs (from any thread: framework tensors may die without the GIL).
struct SharedAllocation {
  dl::ManagedTensorVersioned* owner;
  std::atomic<int> views;
};

struct SharedView {
  dl::ManagedTensorVersioned managed;
  std::int64_t shape[kMaxDims];
  std::int64_t strides[kMaxDims];
  SharedAllocation* allocation;
};

void release_shared_view(dl::ManagedTensorVersioned* self) {
  auto* view = static_cast<SharedView*>(self->manager_ctx);
  SharedAllocation* allocation = view->allocation;
  delete view;
  if (allocation->views.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    if (allocation->owner->deleter) allocation->owner->deleter(allocation->owner);
    delete allocation;
  }
}

constexpr std::size_t kArrayAlignment = 256;
std::size_t aligned_bytes(std::size_t bytes) {
  return (bytes + kArrayAlignment - 1) / kArrayAlignment * kArrayAlignment;
}
}  // namespace

OpCall::ArraySpec OpCall::spec(DType dtype, std::initializer_list<std::int64_t> shape, bool capsule) {
  ArraySpec s{dtype, static_cast<int>(shape.size()), {}, capsule};
  int d = 0;
  for (std::int64_t size : shape)
    if (d < kMaxDims) s.shape[d++] = size;
  return s;
}

OpCall::ArraySpec OpCall::spec_like(const TensorView& like, DType dtype, std::int64_t last) {
  ArraySpec s{dtype, like.ndim > 0 ? like.ndim : 1, {}, false};
  for (int d = 0; d < like.ndim; ++d) s.shape[d] = like.shape[d];
  s.shape[s.ndim - 1] = last;
  return s;
}

void OpCall::new_arrays(int count, const ArraySpec* specs, nb::object* objects, TensorView* views,
                        std::size_t scratch_bytes, OptionalTensor* scratch) {
  const auto* api = static_cast<const dl::ExchangeApi*>(first_api_);
  if (api && !api->managed_tensor_to_py_object_no_sync) api = nullptr;
  // Layout: each array at a 256-byte aligned offset, the scratch memory last.
  std::size_t offsets[kMaxImports + 1];
  std::size_t total = 0;
  if (count < 1 || count > kMaxImports)
    throw Error(ErrorKind::unsupported, op_, "1 to 16 outputs in one allocation");
  for (int i = 0; i < count; ++i) {
    const ArraySpec& s = specs[i];
    if (s.ndim < 1 || s.ndim > kMaxDims)
      fail("shape", "1 to " + std::to_string(kMaxDims) + " sizes", std::to_string(s.ndim));
    if (s.capsule && s.dtype != DType::f32)
      throw Error(ErrorKind::unsupported, op_, "opaque capsules hold float32 arrays only");
    if (s.transposed && (s.ndim != 2 || s.capsule))
      throw Error(ErrorKind::unsupported, op_, "only 2-D framework arrays are laid out transposed");
    std::size_t elements = 1;
    for (int d = 0; d < s.ndim; ++d) {
      if (s.shape[d] < 0) fail("shape", "non-negative sizes", std::to_string(s.shape[d]));
      elements *= static_cast<std::size_t>(s.shape[d]);
    }
    offsets[i] = total;
    total += aligned_bytes(elements * dtype_size(s.dtype));
  }
  offsets[count] = total;
  total += scratch_bytes;
  const std::int64_t total_size[1] = {static_cast<std::int64_t>(total)};
  auto* owner = static_cast<dl::ManagedTensorVersioned*>(
      allocate(api, first_device_, DType::u8, 1, total_size, "the outputs"));
  char* base = static_cast<char*>(owner->dl_tensor.data) + owner->dl_tensor.byte_offset;
  auto* allocation = new SharedAllocation{owner, count};

  // Every view is built first, so that a failure while handing them out releases each once.
  SharedView* made[kMaxImports];
  for (int i = 0; i < count; ++i) {
    const ArraySpec& s = specs[i];
    auto* v = new SharedView{};
    v->allocation = allocation;
    std::int64_t stride = 1;
    for (int d = s.ndim - 1; d >= 0; --d) {
      v->shape[d] = s.shape[d];
      v->strides[d] = stride;
      stride *= s.shape[d] > 0 ? s.shape[d] : 1;
    }
    if (s.transposed) {
      v->strides[0] = 1;
      v->strides[1] = s.shape[0] > 0 ? s.shape[0] : 1;
    }
    v->managed.version = owner->version;
    v->managed.manager_ctx = v;
    v->managed.deleter = release_shared_view;
    v->managed.flags = 0;
    dl::Tensor& t = v->managed.dl_tensor;
    t.data = base + offsets[i];
    t.device = owner->dl_tensor.device;
    t.ndim = s.ndim;
    t.dtype = to_dlpack_dtype(s.dtype);
    t.shape = v->shape;
    t.strides = v->strides;
    t.byte_offset = 0;
    made[i] = v;
    views[i] = TensorView::from_arrays(t.data, s.dtype, first_device_, s.ndim, s.shape,
                                       s.transposed ? v->strides : nullptr);
  }
  if (scratch) {
    if (scratch_bytes > 0) {
      const std::int64_t bytes[1] = {static_cast<std::int64_t>(scratch_bytes)};
      *scratch = TensorView::from_arrays(base + offsets[count], DType::u8, first_device_, 1, bytes,
                                         nullptr);
    } else {
      *scratch = std::nullopt;
    }
  }
  for (int i = 0; i < count; ++i) {
    dl::ManagedTensorVersioned* m = &made[i]->managed;
    PyObject* object = nullptr;
    if (specs[i].capsule) {
      object = PyCapsule_New(m, kF32CapsuleName, free_f32_capsule);
      if (!object) m->deleter(m);
    } else if (api->managed_tensor_to_py_object_no_sync(m, reinterpret_cast<void**>(&object)) != 0) {
      object = nullptr;  // the table took ownership of m
    }
    if (!object) {
      nb::python_error why;
      for (int j = i + 1; j < count; ++j) made[j]->managed.deleter(&made[j]->managed);
      throw why;
    }
    objects[i] = nb::steal(object);
  }
}

nb::object OpCall::new_f32_capsule(std::int64_t count, TensorView* view) {
  return new_f32_capsule(1, &count, view);
}

nb::object OpCall::new_f32_capsule(int ndim, const std::int64_t* sizes, TensorView* view) {
  if (ndim < 1) fail("shape", "1 to " + std::to_string(kMaxDims) + " sizes", std::to_string(ndim));
  auto* out = static_cast<dl::ManagedTensorVersioned*>(
      allocate(first_api_, first_device_, DType::f32, ndim, sizes, "float32 statistics"));
  PyObject* capsule = PyCapsule_New(out, kF32CapsuleName, free_f32_capsule);
  if (!capsule) {
    if (out->deleter) out->deleter(out);
    throw nb::python_error();
  }
  const dl::Tensor& t = out->dl_tensor;
  *view = TensorView::from_arrays(static_cast<char*>(t.data) + t.byte_offset, DType::f32,
                                  first_device_, ndim, sizes, nullptr);
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
  const std::string what = "the " + std::to_string(bytes) + "-byte workspace";
  scratch_ = allocate(api, Device::cuda(cuda_device_), DType::u8, 1, shape, what.c_str());
  auto_workspace_ = true;
  const dl::Tensor& t = static_cast<dl::ManagedTensorVersioned*>(scratch_)->dl_tensor;
  return TensorView::from_arrays(static_cast<char*>(t.data) + t.byte_offset, DType::u8,
                                 Device::cuda(cuda_device_), 1, shape, nullptr);
}

namespace {
constexpr const char* kStreamRange =
    "None or a non-negative int holding a cudaStream_t (0 = legacy default stream)";
}  // namespace

void OpCall::check_stream(nb::handle stream) const {
  if (stream.is_valid() && !stream.is_none())
    unsigned_integer(stream, "stream", "int or None", kStreamRange);
}

Stream OpCall::resolve_stream(nb::handle stream) const {
  if (stream.is_valid() && !stream.is_none()) {
    // The framework ties the workspace it allocated to its current stream; another stream could
    // reuse the memory while the op still runs.
    if (auto_workspace_)
      fail("stream", "None with workspace='auto' (the workspace belongs to the framework's current "
           "stream)", "an explicit stream");
    const std::uint64_t value = unsigned_integer(stream, "stream", "int or None", kStreamRange);
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
