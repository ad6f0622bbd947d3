// CUDA launchers for the optimizer family: split the tensor list into launches (optim_plan.h),
// fill each launch's tensor table and dispatch on the dtypes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "optim/optim_kernels.cuh"
#include "optim/optim_params.h"
#include "optim/optim_plan.h"

namespace fusekit::optim {
namespace {

using namespace kernels;

bool aligned_for_vectors(const void* ptr, DType dtype) {
  return reinterpret_cast<std::uintptr_t>(ptr) % (kVector * dtype_size(dtype)) == 0;
}

// Calls f(T{}) with the storage type of a float dtype (f32, f16, bf16; the checks allow no other).
template <typename F>
void dispatch_float(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32: f(float{}); return;
    case DType::f16: f(__half{}); return;
    case DType::bf16: f(__nv_bfloat16{}); return;
    default: return;
  }
}

int dtype_key(DType dtype) { return static_cast<int>(dtype); }

// A launch's grouping key: the gradient dtype and the copy's (or none).
int adamw_key(const AdamWTensor& t) {
  return static_cast<int>(t.grad_dtype) * 256 + (t.copy ? 1 + static_cast<int>(t.copy_dtype) : 0);
}

AdamWConstants constants_of(const AdamWScalars& s) {
  AdamWConstants c;
  c.beta1 = static_cast<float>(s.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - s.beta1);
  c.beta2 = static_cast<float>(s.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - s.beta2);
  c.decay = static_cast<float>(1.0 - s.lr * s.weight_decay);
  c.step_size = static_cast<float>(s.lr / s.bias_correction1);
  c.bias_correction2_sqrt = static_cast<float>(std::sqrt(s.bias_correction2));
  c.eps = static_cast<float>(s.eps);
  c.max_grad_norm = static_cast<float>(s.max_grad_norm);
  return c;
}

}  // namespace

void global_norm_cuda(const NormParams& p, int device_index, Stream stream) {
  const char* op = "global_norm";
  detail::DeviceGuard guard(op, device_index);
  auto s = static_cast<cudaStream_t>(stream);
  std::vector<int> keys;
  std::vector<std::int64_t> numels;
  for (const NormTensor& t : p.tensors) {
    keys.push_back(dtype_key(t.dtype));
    numels.push_back(t.numel);
  }
  const std::int64_t partial_count = norm_partial_count(numels);
  if (p.workspace_bytes < static_cast<std::size_t>(partial_count) * sizeof(float))
    throw Error(ErrorKind::invalid_argument, op, "workspace",
                "at least " + std::to_string(partial_count * sizeof(float)) + " bytes",
                std::to_string(p.workspace_bytes) + " bytes");
  float* partials = static_cast<float*>(p.workspace);
  for (const PlannedLaunch& launch : plan_launches(keys, numels, kNormTensorsPerLaunch)) {
    NormTable<kNormTensorsPerLaunch> table{};
    table.count = static_cast<int>(launch.tensors.size());
    std::int64_t chunk = 0;
    for (int k = 0; k < table.count; ++k) {
      const NormTensor& t = p.tensors[static_cast<std::size_t>(launch.tensors[static_cast<std::size_t>(k)])];
      table.data[k] = t.data;
      table.numel[k] = t.numel;
      table.first_chunk[k] = static_cast<int>(chunk);
      table.vector_ok[k] = aligned_for_vectors(t.data, t.dtype);
      chunk += chunk_count(t.numel);
    }
    dispatch_float(static_cast<DType>(launch.key), [&](auto type) {
      norm_partial_kernel<decltype(type), kNormTensorsPerLaunch>
          <<<static_cast<unsigned>(launch.chunks), kThreads, 0, s>>>(table, partials + launch.first_chunk);
    });
    detail::check_launch(op, "global_norm partial-sum kernel");
  }
  norm_final_kernel<<<1, kThreads, 0, s>>>(partials, partial_count, p.norm);
  detail::check_launch(op, "global_norm final kernel");
}

void adamw_step_cuda(const AdamWParams& p, int device_index, Stream stream) {
  const char* op = "adamw_step";
  detail::DeviceGuard guard(op, device_index);
  auto s = static_cast<cudaStream_t>(stream);
  std::vector<int> keys;
  std::vector<std::int64_t> numels;
  for (const AdamWTensor& t : p.tensors) {
    keys.push_back(adamw_key(t));
    numels.push_back(t.numel);
  }
  const AdamWConstants constants = constants_of(p.s);
  for (const PlannedLaunch& launch : plan_launches(keys, numels, kAdamWTensorsPerLaunch)) {
    AdamWTable<kAdamWTensorsPerLaunch> table{};
    table.count = static_cast<int>(launch.tensors.size());
    std::int64_t chunk = 0;
    for (int k = 0; k < table.count; ++k) {
      const AdamWTensor& t = p.tensors[static_cast<std::size_t>(launch.tensors[static_cast<std::size_t>(k)])];
      table.param[k] = t.param;
      table.grad[k] = t.grad;
      table.exp_avg[k] = t.exp_avg;
      table.exp_avg_sq[k] = t.exp_avg_sq;
      table.copy[k] = t.copy;
      table.numel[k] = t.numel;
      table.first_chunk[k] = static_cast<int>(chunk);
      table.vector_ok[k] = aligned_for_vectors(t.param, DType::f32) &&
                           aligned_for_vectors(t.grad, t.grad_dtype) &&
                           aligned_for_vectors(t.exp_avg, DType::f32) &&
                           aligned_for_vectors(t.exp_avg_sq, DType::f32) &&
                           (!t.copy || aligned_for_vectors(t.copy, t.copy_dtype));
      chunk += chunk_count(t.numel);
    }
    const AdamWTensor& first = p.tensors[static_cast<std::size_t>(launch.tensors.front())];
    const auto blocks = static_cast<unsigned>(launch.chunks);
    dispatch_float(first.grad_dtype, [&](auto grad_type) {
      using G = decltype(grad_type);
      if (!first.copy) {
        adamw_kernel<G, NoCopy, kAdamWTensorsPerLaunch><<<blocks, kThreads, 0, s>>>(table, constants, p.grad_norm);
        return;
      }
      dispatch_float(first.copy_dtype, [&](auto copy_type) {
        adamw_kernel<G, decltype(copy_type), kAdamWTensorsPerLaunch>
            <<<blocks, kThreads, 0, s>>>(table, constants, p.grad_norm);
      });
    });
    detail::check_launch(op, "adamw_step kernel");
  }
}

}  // namespace fusekit::optim
