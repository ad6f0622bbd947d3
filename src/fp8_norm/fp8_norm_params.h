// The validated, backend-neutral description of one FP8 RMSNorm call. fp8_norm.cpp checks the
// arguments and fills these; the CPU reference and the CUDA kernels read them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusekit/tensor.h"

namespace fusekit::fp8_norm {

struct ForwardParams {
  std::int64_t rows = 0, cols = 0;
  int group_size = 16;
  int log2_group = 4;
  DType x_dtype = DType::f8e4m3;      // f8e4m3 or f8e5m2
  DType q_dtype = DType::f8e4m3;      // qy and qy_t
  DType scale_dtype = DType::bf16;    // bf16 or f32
  DType weight_dtype = DType::bf16;   // bf16 or f32
  const void* x = nullptr;
  std::int64_t x_row_stride = 0;
  const void* scales = nullptr;
  std::int64_t scale_row_stride = 0;
  const void* weight = nullptr;
  float eps = 1e-5f;
  void* qy = nullptr;
  std::int64_t qy_row_stride = 0;
  void* qy_t = nullptr;
  std::int64_t qy_t_row_stride = 0;
  float* y_scale = nullptr;
  float* rstd = nullptr;
  void* y = nullptr;  // optional bf16 output
  std::int64_t y_row_stride = 0;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  // Set by the CUDA launcher: rows at or past this one are read by the statistics pass with an
  // L2 evict-last priority (the quantize pass, walking the rows backwards, reads them first), the
  // rows before it evict-first. The default keeps none.
  std::int64_t l2_keep_from_row = INT64_MAX;
};

struct BackwardParams {
  std::int64_t rows = 0, cols = 0;
  int group_size = 16;
  int log2_group = 4;
  DType x_dtype = DType::f8e4m3;
  DType scale_dtype = DType::bf16;
  DType weight_dtype = DType::bf16;  // weight and dweight
  const void* dy = nullptr;          // bf16
  std::int64_t dy_row_stride = 0;
  const void* x = nullptr;
  std::int64_t x_row_stride = 0;
  const void* scales = nullptr;
  std::int64_t scale_row_stride = 0;
  const void* weight = nullptr;
  const float* rstd = nullptr;
  void* dx = nullptr;  // optional, bf16
  std::int64_t dx_row_stride = 0;
  void* dweight = nullptr;  // optional
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

void forward_cpu(const ForwardParams& p);
void backward_cpu(const BackwardParams& p);

void forward_cuda(const ForwardParams& p, int device_index, Stream stream);
void backward_cuda(const BackwardParams& p, int device_index, Stream stream);
std::size_t forward_workspace_cuda(std::int64_t rows, std::int64_t cols, int device_index);
std::size_t backward_workspace_cuda(std::int64_t rows, std::int64_t cols, int device_index);

}  // namespace fusekit::fp8_norm
