#include "fusekit/tensor.h"

#include <optional>

#include "core/format.h"
#include "core/validate.h"

namespace fusekit {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f64: case DType::i64: return 8;
    case DType::f32: case DType::i32: return 4;
    case DType::f16: case DType::bf16: return 2;
    case DType::f8e4m3: case DType::f8e5m2: case DType::u8: return 1;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::f8e4m3: return "f8e4m3";
    case DType::f8e5m2: return "f8e5m2";
    case DType::f64: return "f64";
    case DType::u8: return "u8";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
  }
  return "unknown";
}

std::string to_string(Device device) {
  return device.is_cuda() ? "cuda:" + std::to_string(device.index) : "cpu";
}

static void fill_contiguous_strides(TensorView& t) {
  std::int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.strides[d] = stride;
    stride *= t.shape[d];
  }
}

TensorView TensorView::from_arrays(void* data, DType dtype, Device device, int ndim,
                                   const std::int64_t* shape, const std::int64_t* strides) {
  if (ndim < 0 || ndim > kMaxDims) {
    throw Error(ErrorKind::invalid_argument, "TensorView", "ndim",
                "0.." + std::to_string(kMaxDims), std::to_string(ndim));
  }
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = ndim;
  for (int d = 0; d < ndim; ++d) {
    if (shape[d] < 0) {
      throw Error(ErrorKind::invalid_argument, "TensorView", "shape", "non-negative sizes",
                  std::to_string(shape[d]));
    }
    t.shape[d] = shape[d];
  }
  if (strides) {
    for (int d = 0; d < ndim; ++d) t.strides[d] = strides[d];
  } else {
    std::int64_t numel = 1;  // contiguous strides are partial products: they must not wrap
    for (int d = 0; d < ndim; ++d) {
      const std::optional<std::int64_t> n = detail::checked_mul(numel, shape[d]);
      if (!n)
        throw Error(ErrorKind::invalid_argument, "TensorView", "shape",
                    "sizes whose product fits in 2^63 - 1", detail::format_int_list(shape, ndim));
      numel = *n;
    }
    fill_contiguous_strides(t);
  }
  detail::ArgCheck("TensorView").well_formed(t, "shape");
  return t;
}

TensorView::TensorView(void* data, DType dtype, Device device,
                       std::initializer_list<std::int64_t> shape)
    : TensorView(from_arrays(data, dtype, device, static_cast<int>(shape.size()), shape.begin(),
                             nullptr)) {}

TensorView::TensorView(void* data, DType dtype, Device device,
                       std::initializer_list<std::int64_t> shape,
                       std::initializer_list<std::int64_t> strides) {
  if (shape.size() != strides.size()) {
    throw Error(ErrorKind::invalid_argument, "TensorView", "strides",
                std::to_string(shape.size()) + " strides (one per dimension)",
                std::to_string(strides.size()));
  }
  *this = from_arrays(data, dtype, device, static_cast<int>(shape.size()), shape.begin(),
                      strides.begin());
}

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

std::int64_t TensorView::size(int dim) const { return shape[dim < 0 ? dim + ndim : dim]; }
std::int64_t TensorView::stride(int dim) const { return strides[dim < 0 ? dim + ndim : dim]; }

bool TensorView::is_contiguous() const {
  std::int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string TensorView::shape_string() const { return detail::format_int_list(shape, ndim); }
std::string TensorView::strides_string() const { return detail::format_int_list(strides, ndim); }

}  // namespace fusekit
