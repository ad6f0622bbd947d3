// The validated, backend-neutral description of one global_norm or adamw_step call. The public
// entry points (optim.cpp) check the arguments and fill these; each backend reads them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "fusekit/tensor.h"

namespace fusekit::optim {

// One tensor of global_norm's list (contiguous).
struct NormTensor {
  const void* data = nullptr;
  DType dtype = DType::f32;
  std::int64_t numel = 0;
};

struct NormParams {
  std::vector<NormTensor> tensors;
  float* norm = nullptr;  // one float32
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

// One parameter's tensors in adamw_step (all contiguous, numel elements each).
struct AdamWTensor {
  float* param = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::f32;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  void* copy = nullptr;  // null: no low-precision copy
  DType copy_dtype = DType::f32;
  std::int64_t numel = 0;
};

// The config as both backends use it; the bias corrections are formed in float64 on the host.
struct AdamWScalars {
  double lr = 0.0, beta1 = 0.0, beta2 = 0.0, eps = 0.0, weight_decay = 0.0;
  double bias_correction1 = 1.0;  // 1 - beta1^step
  double bias_correction2 = 1.0;  // 1 - beta2^step
  double max_grad_norm = 0.0;     // > 0: clip by the norm in grad_norm
};

struct AdamWParams {
  std::vector<AdamWTensor> tensors;
  AdamWScalars s;
  const float* grad_norm = nullptr;  // set exactly when s.max_grad_norm > 0
};

void global_norm_cpu(const NormParams& p);
void adamw_step_cpu(const AdamWParams& p);

void global_norm_cuda(const NormParams& p, int device_index, Stream stream);
void adamw_step_cuda(const AdamWParams& p, int device_index, Stream stream);

}  // namespace fusekit::optim
