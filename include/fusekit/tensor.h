// Non-owning tensor views: what every fusekit op takes and writes.
//
// fusekit never allocates on behalf of the caller: outputs and scratch memory are views of
// buffers the caller owns (the model of cuDNN and TransformerEngine). A view records where the
// data lives (CPU or a CUDA device), its element type, shape and strides in elements.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

namespace fusekit {

enum class DType : std::uint8_t {
  f32,
  f16,
  bf16,
  f8e4m3,  // OCP FP8 E4M3 (finite max 448, no infinities)
  f8e5m2,  // OCP FP8 E5M2 (finite max 57344)
  f64,
  u8,
  i32,
  i64,
};

std::size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);

enum class DeviceType : std::uint8_t { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;

  static Device cpu() { return {DeviceType::cpu, 0}; }
  static Device cuda(int index = 0) { return {DeviceType::cuda, index}; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  friend bool operator==(const Device& a, const Device& b) {
    return a.type == b.type && (a.type == DeviceType::cpu || a.index == b.index);
  }
};

std::string to_string(Device device);

// A cudaStream_t, passed as an opaque pointer so that the public headers need no CUDA headers.
// nullptr is the legacy default stream. CPU ops ignore it.
using Stream = void*;

inline constexpr int kMaxDims = 6;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device{};
  int ndim = 0;
  std::int64_t shape[kMaxDims] = {};
  std::int64_t strides[kMaxDims] = {};  // in elements, not bytes

  TensorView() = default;
  // Contiguous (row-major) view.
  TensorView(void* data, DType dtype, Device device, std::initializer_list<std::int64_t> shape);
  // Strided view; strides in elements.
  TensorView(void* data, DType dtype, Device device, std::initializer_list<std::int64_t> shape,
             std::initializer_list<std::int64_t> strides);
  // From arrays (bindings); strides == nullptr means contiguous.
  static TensorView from_arrays(void* data, DType dtype, Device device, int ndim,
                                const std::int64_t* shape, const std::int64_t* strides);

  std::int64_t numel() const;
  std::int64_t size(int dim) const;    // negative dims count from the end
  std::int64_t stride(int dim) const;  // negative dims count from the end
  bool is_contiguous() const;
  std::string shape_string() const;   // "(4, 1024)"
  std::string strides_string() const; // "(1024, 1)"

  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data);
  }
};

// An argument the caller may leave out (no weight, no gradient wanted, ...).
using OptionalTensor = std::optional<TensorView>;

}  // namespace fusekit
