// The validated, backend-neutral description of one normalization call. The public entry points
// (norm.cpp) check the arguments and fill these; each backend (CPU reference, CUDA) reads them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusekit/tensor.h"

namespace fusekit::norm {

enum class Kind { layer_norm, rms_norm };

struct ForwardParams {
  Kind kind = Kind::layer_norm;
  std::int64_t rows = 0, cols = 0;
  DType dtype = DType::f32;         // x and y
  DType weight_dtype = DType::f32;  // weight and bias
  const void* x = nullptr;
  std::int64_t x_row_stride = 0;
  // Residual forward: the rows normalized are round(x + residual) in x's dtype, written to `sum`
  // when it is given (sum overlaps no other tensor).
  const void* residual = nullptr;  // null: the plain norm of x
  std::int64_t residual_row_stride = 0;
  void* sum = nullptr;  // may be null
  std::int64_t sum_row_stride = 0;
  const void* weight = nullptr;  // may be null: weight of ones
  const void* bias = nullptr;    // may be null: bias of zeros (always null for RMSNorm)
  void* y = nullptr;
  std::int64_t y_row_stride = 0;
  float* mean = nullptr;  // may be null (always null for RMSNorm)
  float* rstd = nullptr;  // may be null
  float eps = 1e-5f;
};

struct BackwardParams {
  Kind kind = Kind::layer_norm;
  bool from_output = false;  // `input` is y (x_hat recomputed as (y - bias) / weight), not x
  std::int64_t rows = 0, cols = 0;
  DType dtype = DType::f32;
  DType weight_dtype = DType::f32;
  const void* dy = nullptr;
  std::int64_t dy_row_stride = 0;
  const void* input = nullptr;  // x, or y when from_output
  std::int64_t input_row_stride = 0;
  const void* weight = nullptr;
  const void* bias = nullptr;  // used only when from_output
  const float* mean = nullptr; // used only for LayerNorm from x
  const float* rstd = nullptr;
  // Residual backward: dx also gets the gradient arriving at the sum from the skip path. dsum may
  // be exactly dx (in place): each element is read before the same element of dx is written.
  const void* dsum = nullptr;  // may be null: none
  std::int64_t dsum_row_stride = 0;
  void* dx = nullptr;  // each output may be null: not computed
  std::int64_t dx_row_stride = 0;
  void* dweight = nullptr;
  void* dbias = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

void forward_cpu(const ForwardParams& p);
void backward_cpu(const BackwardParams& p);

void forward_cuda(const ForwardParams& p, int device_index, Stream stream);
void backward_cuda(const BackwardParams& p, int device_index, Stream stream);
std::size_t backward_workspace_cuda(std::int64_t rows, std::int64_t cols, DType dtype,
                                    int device_index);

}  // namespace fusekit::norm
