// The DLPack ABI pieces fusekit's tensor import reads, declared from the DLPack specification
// (dlpack.h, v1.x): DLTensor and the C exchange table that frameworks publish on their tensor
// type as `__dlpack_c_exchange_api__` (PyTorch 2.10 and later do).
//
// Why not only `__dlpack__()`: that method is Python code in most frameworks and builds a capsule
// and a managed tensor per call (microseconds each). The exchange table fills a DLTensor in place
// from C, with no allocation, and also tells the framework's current CUDA stream, which is what
// keeps a call through fusekit.torch within its host-overhead budget.
#pragma once

#include <cstdint>

namespace fusekit::python::dl {

// DLDeviceType values fusekit understands.
enum DeviceType : std::int32_t {
  kCPU = 1,
  kCUDA = 2,
  kCUDAHost = 3,     // pinned host memory: the CPU reads it directly
  kCUDAManaged = 13, // unified memory
};

// DLDataTypeCode values fusekit understands.
enum TypeCode : std::uint8_t {
  kInt = 0,
  kUInt = 1,
  kFloat = 2,
  kBfloat = 4,
  kBool = 6,
  kFloat8_e4m3fn = 10,
  kFloat8_e5m2 = 12,
};

struct Device {
  std::int32_t device_type;
  std::int32_t device_id;
};

struct DataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};

struct Tensor {
  void* data;
  Device device;
  std::int32_t ndim;
  DataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;  // in elements; nullptr means row-major contiguous
  std::uint64_t byte_offset;
};

struct Version {
  std::uint32_t major;
  std::uint32_t minor;
};

// DLManagedTensorVersioned: a tensor together with its owner's deleter.
struct ManagedTensorVersioned {
  Version version;
  void* manager_ctx;
  void (*deleter)(ManagedTensorVersioned* self);
  std::uint64_t flags;
  Tensor dl_tensor;
};

struct ExchangeApiHeader {
  Version version;
  ExchangeApiHeader* prev_api;
};

// Only the entries fusekit calls are typed; the others are kept as opaque slots so that the
// layout matches the specification.
struct ExchangeApi {
  ExchangeApiHeader header;
  // A new tensor of the prototype's dtype, shape and device from the framework's allocator
  // (PyTorch: its caching allocator, on the device's current stream). 0 on success; on failure
  // -1 after calling set_error(error_ctx, kind, message).
  int (*managed_tensor_allocator)(Tensor* prototype, ManagedTensorVersioned** out, void* error_ctx,
                                  void (*set_error)(void* error_ctx, const char* kind,
                                                    const char* message));
  void* managed_tensor_from_py_object_no_sync;
  // Turns a managed tensor (ownership taken) into the framework's tensor object (a new
  // reference in *out_py_object). 0 on success, -1 with a Python exception set.
  int (*managed_tensor_to_py_object_no_sync)(ManagedTensorVersioned* tensor, void** out_py_object);
  // Fills `out` for a tensor object of the publishing type; the shape/strides arrays stay valid
  // while the object lives. 0 on success, -1 with a Python exception set.
  int (*dltensor_from_py_object_no_sync)(void* py_object, Tensor* out);
  // The framework's current stream for a device. 0 on success, -1 with a Python exception set.
  int (*current_work_stream)(std::int32_t device_type, std::int32_t device_id, void** out_stream);
};

inline constexpr const char* kExchangeApiAttribute = "__dlpack_c_exchange_api__";
inline constexpr const char* kExchangeApiCapsuleName = "dlpack_exchange_api";
inline constexpr std::uint32_t kSupportedMajorVersion = 1;
inline constexpr std::uint32_t kMinimumMinorVersion = 3;

}  // namespace fusekit::python::dl
