// CUDA launchers for bias + activation + dropout: describe the problem (alignment decides the
// vector or generic path), launch what bias_act_dropout_config.h chooses, dispatching on element
// types and activation, and reduce the dbias partial rows.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/device_info.h"
#include "core/launch_tuning.h"
#include "core/partial_rows.cuh"
#include "bias_act_dropout/bias_act_dropout_config.h"
#include "bias_act_dropout/bias_act_dropout_kernels.cuh"
#include "bias_act_dropout/bias_act_dropout_params.h"

namespace fusekit::bias_act_dropout {
namespace {

using namespace kernels;

bool aligned16(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; }

// 16-byte accesses of 8-element chunks need N and every row stride to be multiples of 8 and every
// pointer (the bias included) 16-byte aligned. Then every chunk starts at a multiple of 8 in the
// linear index, i.e. on a Philox group boundary.
bool vector_path_ok(std::int64_t cols, std::initializer_list<std::int64_t> row_strides,
                    std::initializer_list<const void*> pointers) {
  if (cols % kChunk != 0) return false;
  for (std::int64_t s : row_strides)
    if (s % kChunk != 0) return false;
  for (const void* ptr : pointers)
    if (ptr && !aligned16(ptr)) return false;
  return true;
}

// Calls f(T{}, W{}) with the storage types of (dtype, bias dtype).
template <typename F>
void dispatch_types(DType dtype, DType bias_dtype, F&& f) {
  switch (dtype) {
    case DType::f32: f(float{}, float{}); return;
    case DType::f16:
      if (bias_dtype == DType::f32) f(__half{}, float{});
      else f(__half{}, __half{});
      return;
    case DType::bf16:
      if (bias_dtype == DType::f32) f(__nv_bfloat16{}, float{});
      else f(__nv_bfloat16{}, __nv_bfloat16{});
      return;
    default: return;  // rejected by the argument checks
  }
}

// Calls f(StaticActivation<A>{}) for the run-time activation.
template <typename F>
void dispatch_activation(Activation a, F&& f) {
  switch (a) {
    case Activation::none: f(StaticActivation<Activation::none>{}); return;
    case Activation::relu: f(StaticActivation<Activation::relu>{}); return;
    case Activation::gelu_erf: f(StaticActivation<Activation::gelu_erf>{}); return;
    case Activation::gelu_tanh: f(StaticActivation<Activation::gelu_tanh>{}); return;
    case Activation::squared_relu: f(StaticActivation<Activation::squared_relu>{}); return;
    case Activation::leaky_relu: f(StaticActivation<Activation::leaky_relu>{}); return;
    case Activation::silu: f(StaticActivation<Activation::silu>{}); return;
  }
}

// A walking-grid kernel's tuning for the forward of activation A (bias_act_dropout_config.h).
template <Activation A>
using ForwardTuning =
    std::conditional_t<transcendental_activation(A), TranscendentalForwardTuning, CheapForwardTuning>;

template <typename T, typename W, typename Chunk, typename Act>
void forward_with(const ForwardParams& p, const TileGrid& g, cudaStream_t stream) {
  RowSteps steps;
  steps.in0 = row_step(g) * p.x_row_stride;
  steps.out0 = row_step(g) * p.y_row_stride;
  steps.out1 = row_step(g) * p.pre_activation_row_stride;
  steps.index = static_cast<std::uint64_t>(row_step(g) * p.cols) >> Chunk::kIndexShift;
  steps.philox = philox_prefix(p.s);
  forward_kernel<T, W, Chunk, Act><<<dim3(g.gx, g.gy), dim3(g.tx, g.ty), 0, stream>>>(p, g, steps);
}

template <typename T, typename W, typename Act>
void forward_row_groups(const ForwardParams& p, const ForwardLaunch& launch, int sms, int device_index,
                        cudaStream_t stream) {
  const char* op = "bias_act_dropout_forward";
  auto kernel = forward_row_group_kernel<T, W, Act>;
  const RowGroupShape shape = launch.row_groups;
  const int block = shape.threads_per_row * shape.rows_per_block;
  const int l2_ahead = static_cast<int>(
      row_group_l2_ahead(shape, detail::blocks_per_sm(op, kernel, block, 0, device_index), sms));
  // rows < 2^31: the block count fits a grid's x
  kernel<<<static_cast<unsigned>(launch.row_group_blocks), block, 0, stream>>>(
      p, philox_prefix(p.s), shape.threads_per_row, shape.rows_per_block, l2_ahead);
}

template <typename T, typename W>
void launch_forward(const ForwardParams& p, int device_index, cudaStream_t stream) {
  const char* op = "bias_act_dropout_forward";
  const detail::DeviceInfo& device = detail::device_info(op, device_index);
  Problem problem;
  problem.rows = p.rows;
  problem.cols = p.cols;
  problem.dtype = p.dtype;
  problem.activation = p.s.activation;
  problem.vector_ok =
      vector_path_ok(p.cols, {p.x_row_stride, p.y_row_stride, p.pre_activation ? p.pre_activation_row_stride : 0},
                     {p.x, p.y, p.bias, p.pre_activation});
  problem.pre_activation = p.pre_activation != nullptr;
  const ForwardLaunch launch = choose_forward(problem, device);
  dispatch_activation(p.s.activation, [&](auto act) {
    using Act = decltype(act);
    switch (launch.kernel) {
      case ForwardKernel::row_groups:
        if constexpr (sizeof(T) == 2 && !transcendental_activation(Act::kAct))
          forward_row_groups<T, W, Act>(p, launch, device.sm_count, device_index, stream);
        break;
      case ForwardKernel::walking_vector:
        forward_with<T, W, VectorChunk<T, ForwardTuning<Act::kAct>>, Act>(p, launch.grid, stream);
        break;
      case ForwardKernel::walking_generic: forward_with<T, W, ScalarChunk<T>, Act>(p, launch.grid, stream); break;
    }
  });
  detail::check_launch(op, "bias_act_dropout forward kernel");
}

bool backward_vector_path(const BackwardParams& p) {
  return vector_path_ok(p.cols, {p.dy_row_stride, p.x_row_stride, p.dx ? p.dx_row_stride : 0},
                        {p.dy, p.x, p.dx, p.bias});
}

// Launches the backward kernel on grid g (its gy partial rows).
template <typename T, typename W, typename Chunk>
void backward_with(const BackwardParams& p, const TileGrid& g, cudaStream_t stream, const char* op) {
  RowSteps steps;
  steps.in0 = row_step(g) * p.dy_row_stride;
  steps.in1 = row_step(g) * p.x_row_stride;
  steps.out0 = row_step(g) * p.dx_row_stride;
  steps.index = static_cast<std::uint64_t>(row_step(g) * p.cols) >> Chunk::kIndexShift;
  steps.philox = philox_prefix(p.s);
  float* partial = nullptr;
  if (p.dbias) {
    const std::size_t need = partial_bytes(g, p.cols);
    if (p.workspace == nullptr || p.workspace_bytes < need)
      throw Error(ErrorKind::invalid_argument, op, "workspace", "at least " + std::to_string(need) + " bytes",
                  std::to_string(p.workspace_bytes) + " bytes");
    partial = static_cast<float*>(p.workspace);
  }
  dispatch_activation(p.s.activation, [&](auto act) {
    backward_kernel<T, W, Chunk, decltype(act)>
        <<<dim3(g.gx, g.gy), dim3(g.tx, g.ty), 0, stream>>>(p, g, steps, partial);
  });
  detail::check_launch(op, "bias_act_dropout backward kernel");
}

template <typename T, typename W>
void launch_backward(const BackwardParams& p, int device_index, cudaStream_t stream) {
  const char* op = "bias_act_dropout_backward";
  Problem problem;
  problem.rows = p.rows;
  problem.cols = p.cols;
  problem.dtype = p.dtype;
  problem.activation = p.s.activation;
  problem.vector_ok = backward_vector_path(p);
  const BackwardLaunch launch = choose_backward(problem, detail::device_info(op, device_index));
  const TileGrid& g = launch.grid;
  if (launch.kernel == BackwardKernel::walking_vector)
    backward_with<T, W, VectorChunk<T, BackwardTuning>>(p, g, stream, op);
  else
    backward_with<T, W, ScalarChunk<T>>(p, g, stream, op);
  if (p.dbias) {
    const float* partial = static_cast<const float*>(p.workspace);
    constexpr const char* kWhat = "bias_act_dropout dbias reduction kernel";
    if (p.dbias_dtype == DType::f32)
      detail::device::launch_sum_partial_rows(partial, g.gy, p.cols, static_cast<float*>(p.dbias), stream, op, kWhat);
    else
      detail::device::launch_sum_partial_rows(partial, g.gy, p.cols, static_cast<T*>(p.dbias), stream, op, kWhat);
  }
}

}  // namespace

void forward_cuda(const ForwardParams& p, int device_index, Stream stream) {
  if (p.rows == 0) return;
  detail::DeviceGuard guard("bias_act_dropout_forward", device_index);
  dispatch_types(p.dtype, p.bias_dtype, [&](auto t, auto w) {
    launch_forward<decltype(t), decltype(w)>(p, device_index, static_cast<cudaStream_t>(stream));
  });
}

void backward_cuda(const BackwardParams& p, int device_index, Stream stream) {
  const char* op = "bias_act_dropout_backward";
  detail::DeviceGuard guard(op, device_index);
  auto s = static_cast<cudaStream_t>(stream);
  if (p.rows == 0) {
    // The gradient of an empty batch: dbias is zero (all-zero bits are 0.0 in every float type).
    if (p.dbias) FUSEKIT_CUDA_CHECK(op, cudaMemsetAsync(p.dbias, 0, p.cols * dtype_size(p.dbias_dtype), s));
    return;
  }
  dispatch_types(p.dtype, p.bias_dtype, [&](auto t, auto w) {
    launch_backward<decltype(t), decltype(w)>(p, device_index, s);
  });
}

std::size_t backward_workspace_cuda(std::int64_t rows, std::int64_t cols, DType dtype,
                                    int device_index) {
  if (rows <= 0 || cols <= 0) return 0;
  (void)dtype;  // the grid depends on the path, not on the dtype
  return backward_workspace_bytes(rows, cols, detail::device_info("bias_act_dropout_backward_workspace_size", device_index));
}

}  // namespace fusekit::bias_act_dropout
