// CUDA launchers for cross-entropy: describe the problem, launch what cross_entropy_config.h
// chooses, dispatching on the logits' and the targets' types. A call is at most three kernels on
// the caller's stream: the mean's gradient scale (fused and backward, reduction mean), the row or
// backward kernel, and the loss over the row losses (forward and fused, mean or sum).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_check.h"
#include "core/dependent_launch.h"
#include "core/device_info.h"
#include "core/launch_tuning.h"
#include "cross_entropy/cross_entropy_config.h"
#include "cross_entropy/cross_entropy_kernels.cuh"
#include "cross_entropy/cross_entropy_params.h"

namespace fusekit::cross_entropy {
namespace {

using namespace kernels;

const char* op_name(Pass pass) {
  switch (pass) {
    case Pass::forward: return "cross_entropy_forward";
    case Pass::backward: return "cross_entropy_backward";
    case Pass::forward_backward: return "cross_entropy_forward_backward";
  }
  return "cross_entropy";
}

bool aligned(const void* ptr, std::size_t alignment) {
  return reinterpret_cast<std::uintptr_t>(ptr) % alignment == 0;
}

// 16-byte accesses: element pointers aligned to the element size and, with dlogits, its rows at the
// same offset from a 16-byte boundary as the logits' rows (then a row's head, vectors and tail are
// the same columns in both).
bool vector_path_ok(const Params& p) {
  const std::size_t e = dtype_size(p.dtype);
  if (!aligned(p.logits, e)) return false;
  if (!p.dlogits) return true;
  if (!aligned(p.dlogits, e)) return false;
  const auto delta = reinterpret_cast<std::intptr_t>(p.dlogits) - reinterpret_cast<std::intptr_t>(p.logits);
  if (delta % kVectorBytes != 0) return false;
  const std::int64_t stride_delta = (p.dlogits_row_stride - p.logits_row_stride) * static_cast<std::int64_t>(e);
  return p.rows <= 1 || stride_delta % kVectorBytes == 0;
}

// Calls f(T{}, Index{}) with the storage types of (logits dtype, target dtype).
template <typename F>
void dispatch_types(DType dtype, DType target_dtype, F&& f) {
  auto with_index = [&](auto t) {
    if (target_dtype == DType::i32) f(t, std::int32_t{});
    else f(t, std::int64_t{});
  };
  switch (dtype) {
    case DType::f32: with_index(float{}); return;
    case DType::f16: with_index(__half{}); return;
    case DType::bf16: with_index(__nv_bfloat16{}); return;
    default: return;  // rejected by the argument checks
  }
}

// Launches `kernel` with clusters of `cluster` blocks along x (1: none) and, after the mean's
// scale kernel, as its programmatic dependent (the kernel waits for the scale before it reads it).
// Where the driver refuses the dependent launch, a plain launch in stream order does the same.
template <typename Kernel>
void launch(Kernel kernel, dim3 grid, int threads, int cluster, std::size_t smem_bytes, bool dependent,
            int device_index, cudaStream_t stream, const KernelParams& params, const char* op, const char* what) {
  if (smem_bytes > 0) detail::allow_dynamic_smem(op, kernel, smem_bytes, device_index, what);
  cudaLaunchAttribute attributes[2] = {};
  unsigned count = 0;
  if (cluster > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count].val.clusterDim.x = static_cast<unsigned>(cluster);
    attributes[count].val.clusterDim.y = 1;
    attributes[count].val.clusterDim.z = 1;
    ++count;
  }
  if (dependent) {  // last, so that the retry drops it alone
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = count;
  cudaError_t status = cudaLaunchKernelEx(&config, kernel, params);
  if (status != cudaSuccess && dependent) {
    cudaGetLastError();  // clear the refusal
    config.numAttrs = count - 1;
    status = cudaLaunchKernelEx(&config, kernel, params);
  }
  detail::check_cuda(status, op, what);
  detail::check_launch(op, what);
}

// The forward or fused kernel of `choice`: the staged row kernel or the (cluster) row kernel.
template <typename T, typename Index>
void launch_row_kernel(Pass pass, const Launch& choice, KernelParams k, bool dependent, int device_index,
                       cudaStream_t stream, const char* op) {
  const dim3 grid(static_cast<unsigned>(choice.blocks));
  const bool gradient = pass == Pass::forward_backward;
  if (choice.staged) {
    k.parts = 1;
    k.staged_vectors = static_cast<int>(choice.smem_bytes / kVectorBytes);
    if (gradient)
      launch(staged_row_kernel<T, Index, true>, grid, choice.threads, 1, choice.smem_bytes, dependent, device_index,
             stream, k, op, "cross_entropy staged forward-backward kernel");
    else
      launch(staged_row_kernel<T, Index, false>, grid, choice.threads, 1, choice.smem_bytes, false, device_index,
             stream, k, op, "cross_entropy staged forward kernel");
    return;
  }
  k.parts = choice.cluster;
  if (gradient)
    launch(row_kernel<T, Index, true>, grid, choice.threads, choice.cluster, 0, dependent, device_index, stream, k, op,
           "cross_entropy forward-backward kernel");
  else
    launch(row_kernel<T, Index, false>, grid, choice.threads, choice.cluster, 0, false, device_index, stream, k, op,
           "cross_entropy forward kernel");
}

Launch launch_for(const Params& p, int device_index, const char* op) {
  Problem problem;
  problem.rows = p.rows;
  problem.cols = p.cols;
  problem.element_bytes = static_cast<int>(dtype_size(p.dtype));
  problem.pass = p.pass;
  return choose_launch(problem, detail::device_info(op, device_index), read_launch_overrides());
}

// The kernels' view of p, the row losses going to `row_losses` (forward and fused).
KernelParams kernel_params(const Params& p, float* row_losses) {
  KernelParams k;
  k.logits = p.logits;
  k.logits_row_stride = p.logits_row_stride;
  k.dlogits = p.dlogits;
  k.dlogits_row_stride = p.dlogits_row_stride;
  k.targets = p.targets;
  k.row_loss = p.pass == Pass::backward ? nullptr : row_losses;
  k.lse = p.lse;
  k.rows = p.rows;
  k.cols = static_cast<int>(p.cols);
  k.ignore_index = p.ignore_index;
  k.one_minus_smoothing = 1.0f - p.label_smoothing;
  k.smoothing_per_class = static_cast<float>(static_cast<double>(p.label_smoothing) / static_cast<double>(p.cols));
  k.z_loss = p.z_loss;
  k.sum_logits = p.label_smoothing > 0.0f;
  k.vector_ok = vector_path_ok(p);
  return k;
}

template <typename T, typename Index>
void launch_call(const Params& p, int device_index, cudaStream_t stream) {
  const char* op = op_name(p.pass);
  const Launch launch_choice = launch_for(p, device_index, op);

  float* scale_slot = static_cast<float*>(p.workspace);
  float* row_losses = p.reduction == LossReduction::none
                          ? p.loss
                          : reinterpret_cast<float*>(static_cast<char*>(p.workspace) + kScaleSlotBytes);
  const auto* targets = static_cast<const Index*>(p.targets);

  KernelParams k = kernel_params(p, row_losses);

  // The gradient's scale: the mean's dloss / N from its own kernel; dloss itself (per row for
  // none) in the backward otherwise; 1 in the fused call otherwise.
  const bool mean_scale = p.pass != Pass::forward && p.reduction == LossReduction::mean;
  if (mean_scale) {
    mean_scale_kernel<Index><<<1, kReduceThreads, 0, stream>>>(
        targets, p.rows, p.ignore_index, p.pass == Pass::backward ? p.dloss : nullptr, scale_slot);
    detail::check_launch(op, "cross_entropy mean scale kernel");
    k.grad_scale = scale_slot;
  } else if (p.pass == Pass::backward) {
    k.grad_scale = p.dloss;
    k.grad_scale_stride = p.reduction == LossReduction::none ? 1 : 0;
  }

  if (p.pass == Pass::backward) {
    k.parts = launch_choice.chunks;
    launch(backward_kernel<T, Index>,
           dim3(static_cast<unsigned>(launch_choice.blocks), static_cast<unsigned>(launch_choice.chunks)),
           launch_choice.threads, 1, 0, mean_scale, device_index, stream, k, op, "cross_entropy backward kernel");
    return;
  }
  launch_row_kernel<T, Index>(p.pass, launch_choice, k, mean_scale, device_index, stream, op);
  if (p.reduction != LossReduction::none) {
    detail::launch_dependent(reduce_losses_kernel<Index>, dim3(1), dim3(kReduceThreads), 0, stream,
                             static_cast<const float*>(row_losses), targets, p.rows, p.ignore_index,
                             p.reduction == LossReduction::mean, p.loss);
    detail::check_launch(op, "cross_entropy loss reduction kernel");
  }
}

// The row kernel alone on p's rows: losses to row_loss, the gradient scaled by *grad_scale.
template <typename T, typename Index>
void launch_rows(const Params& p, float* row_loss, const float* grad_scale, int device_index, const char* op,
                 cudaStream_t stream) {
  const Launch launch_choice = launch_for(p, device_index, op);
  KernelParams k = kernel_params(p, row_loss);
  k.grad_scale = grad_scale;
  k.grad_scale_stride = 0;
  launch_row_kernel<T, Index>(p.pass, launch_choice, k, false, device_index, stream, op);
}

}  // namespace

void mean_scale_cuda(const void* targets, DType target_dtype, std::int64_t rows, std::int64_t ignore_index,
                     float* scale, const char* op, Stream stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (target_dtype == DType::i32)
    mean_scale_kernel<std::int32_t><<<1, kReduceThreads, 0, s>>>(static_cast<const std::int32_t*>(targets), rows,
                                                                 ignore_index, nullptr, scale);
  else
    mean_scale_kernel<std::int64_t><<<1, kReduceThreads, 0, s>>>(static_cast<const std::int64_t*>(targets), rows,
                                                                 ignore_index, nullptr, scale);
  detail::check_launch(op, "cross_entropy mean scale kernel");
}

void rows_cuda(const Params& p, float* row_loss, const float* grad_scale, int device_index, const char* op,
               Stream stream) {
  if (p.rows == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_types(p.dtype, p.target_dtype, [&](auto t, auto index) {
    launch_rows<decltype(t), decltype(index)>(p, row_loss, grad_scale, device_index, op, s);
  });
}

void reduce_losses_cuda(const float* row_loss, const void* targets, DType target_dtype, std::int64_t rows,
                        std::int64_t ignore_index, bool mean, float* loss, const char* op, Stream stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (target_dtype == DType::i32)
    reduce_losses_kernel<std::int32_t><<<1, kReduceThreads, 0, s>>>(
        row_loss, static_cast<const std::int32_t*>(targets), rows, ignore_index, mean, loss);
  else
    reduce_losses_kernel<std::int64_t><<<1, kReduceThreads, 0, s>>>(
        row_loss, static_cast<const std::int64_t*>(targets), rows, ignore_index, mean, loss);
  detail::check_launch(op, "cross_entropy loss reduction kernel");
}

void run_cuda(const Params& p, int device_index, Stream stream) {
  const char* op = op_name(p.pass);
  detail::DeviceGuard guard(op, device_index);
  auto s = static_cast<cudaStream_t>(stream);
  if (p.rows == 0) {
    // No rows: a mean or sum of nothing is 0 (all-zero bits are 0.0f); there is no gradient.
    if (p.pass != Pass::backward && p.reduction != LossReduction::none)
      FUSEKIT_CUDA_CHECK(op, cudaMemsetAsync(p.loss, 0, sizeof(float), s));
    return;
  }
  dispatch_types(p.dtype, p.target_dtype, [&](auto t, auto index) {
    launch_call<decltype(t), decltype(index)>(p, device_index, s);
  });
}

}  // namespace fusekit::cross_entropy
