// CUDA launchers for bias + activation + dropout: choose the vector or generic path from the
// alignment, size the tiled grid, dispatch on element types and activation, and reduce the dbias
// partial rows.
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

std::size_t partial_bytes(const TileGrid& g, std::int64_t cols) {
  const std::size_t bytes = static_cast<std::size_t>(g.gy) * cols * sizeof(float);
  return (bytes + 255) / 256 * 256;
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

// The vector path's tunings, measured on the H200 (performance-notes.md). The forward of the
// activations that go through the special-function unit (exp, reciprocal, erf) is issue-bound:
// one row in flight with the next row's loads issued before the math keeps memory busy during it,
// and the row after that asked of L2 (prefetch.global.L2) lets those loads hit L2: session 24,
// gelu_tanh (16384, 4096) 73.5 -> 71.9 us, (16384, 5120) 89.9 -> 89.2, (32768, 1024) 39.1 -> 38.4,
// (8192, 16384) even; 2 rows ahead were even or slower and 3 or 5 rows 4-22% slower. The cheap
// activations' forward runs best with two rows loaded together and neither register nor L2
// prefetch (the register prefetch costs 5-8%, the L2 one 11-17%). The backward reads two tensors
// per row and always prefetches into registers.
using ForwardTuningCheap = Tuning<2, false, 2>;
using ForwardTuningTranscendental = Tuning<1, true, 2, 1>;
using BackwardTuning = Tuning<1, true, 2>;
static_assert(ForwardTuningCheap::kBlocksPerSm == BackwardTuning::kBlocksPerSm &&
                  ForwardTuningTranscendental::kBlocksPerSm == BackwardTuning::kBlocksPerSm,
              "one grid size for the vector path");

template <Activation A>
using ForwardTuning = std::conditional_t<A == Activation::gelu_erf || A == Activation::gelu_tanh ||
                                             A == Activation::silu,
                                         ForwardTuningTranscendental, ForwardTuningCheap>;

int sm_count(const char* op, int device_index) {
  return detail::device_info(op, device_index).sm_count;
}

template <typename T, typename W, typename Chunk, typename Act>
void forward_with(const ForwardParams& p, int sms, cudaStream_t stream) {
  const TileGrid g = make_grid(p.rows, p.cols, sms, Chunk::Tune::kBlocksPerSm, kForwardBlockWidth);
  RowSteps steps;
  steps.in0 = row_step(g) * p.x_row_stride;
  steps.out0 = row_step(g) * p.y_row_stride;
  steps.out1 = row_step(g) * p.pre_activation_row_stride;
  steps.index = static_cast<std::uint64_t>(row_step(g) * p.cols) >> Chunk::kIndexShift;
  steps.philox = philox_prefix(p.s);
  forward_kernel<T, W, Chunk, Act><<<dim3(g.gx, g.gy), dim3(g.tx, g.ty), 0, stream>>>(p, g, steps);
}

// The row-group forward's shape for rows of `cols` (a multiple of 8): tpr threads per row and rpb
// rows per block (blocks of at least 128 threads), or tpr = 0 where the row does not split into
// whole warps of kRowGroupVectors vectors per thread or needs more than 512 threads (N > 8192).
struct RowGroupShape {
  int tpr = 0, rpb = 0;
};

RowGroupShape row_group_shape(std::int64_t cols) {
  const std::int64_t vectors = cols / kChunk;
  if (vectors % (32 * kRowGroupVectors) != 0 || vectors / kRowGroupVectors > 512) return {};
  const int tpr = static_cast<int>(vectors / kRowGroupVectors);
  return {tpr, tpr >= 128 ? 1 : 128 / tpr};
}

constexpr bool cheap_activation(Activation a) {
  return a == Activation::none || a == Activation::relu || a == Activation::squared_relu ||
         a == Activation::leaky_relu;
}

template <typename T, typename W, typename Act>
void forward_row_groups(const ForwardParams& p, RowGroupShape shape, int sms, int device_index, cudaStream_t stream) {
  const char* op = "bias_act_dropout_forward";
  auto kernel = forward_row_group_kernel<T, W, Act>;
  const int block = shape.tpr * shape.rpb;
  // FUSEKIT_DROPOUT_ROW_GROUP_L2=0 drops the L2 request (benchmark knob, read once).
  static const bool ask_l2 = detail::env_flag("FUSEKIT_DROPOUT_ROW_GROUP_L2", true);
  const int l2_ahead = ask_l2 ? detail::blocks_per_sm(op, kernel, block, 0, device_index) * sms * shape.rpb : 0;
  const std::int64_t grid = (p.rows + shape.rpb - 1) / shape.rpb;  // rows < 2^31: fits a grid's x
  kernel<<<static_cast<unsigned>(grid), block, 0, stream>>>(p, philox_prefix(p.s), shape.tpr, shape.rpb, l2_ahead);
}

template <typename T, typename W>
void launch_forward(const ForwardParams& p, int device_index, cudaStream_t stream) {
  const char* op = "bias_act_dropout_forward";
  const int sms = sm_count(op, device_index);
  const bool vector =
      vector_path_ok(p.cols, {p.x_row_stride, p.y_row_stride, p.pre_activation ? p.pre_activation_row_stride : 0},
                     {p.x, p.y, p.bias, p.pre_activation});
  // FUSEKIT_DROPOUT_ROW_GROUPS=0 keeps every forward on the walking grid (benchmark knob).
  static const bool row_groups_on = detail::env_flag("FUSEKIT_DROPOUT_ROW_GROUPS", true);
  const RowGroupShape row_groups = row_groups_on && vector && sizeof(T) == 2 && p.pre_activation == nullptr &&
                                           cheap_activation(p.s.activation)
                                       ? row_group_shape(p.cols)
                                       : RowGroupShape{};
  dispatch_activation(p.s.activation, [&](auto act) {
    using Act = decltype(act);
    if constexpr (sizeof(T) == 2 && cheap_activation(Act::kAct)) {
      if (row_groups.tpr > 0) {
        forward_row_groups<T, W, Act>(p, row_groups, sms, device_index, stream);
        return;
      }
    }
    if (vector) forward_with<T, W, VectorChunk<T, ForwardTuning<Act::kAct>>, Act>(p, sms, stream);
    else forward_with<T, W, ScalarChunk<T>, Act>(p, sms, stream);
  });
  detail::check_launch(op, "bias_act_dropout forward kernel");
}

bool backward_vector_path(const BackwardParams& p) {
  return vector_path_ok(p.cols, {p.dy_row_stride, p.x_row_stride, p.dx ? p.dx_row_stride : 0},
                        {p.dy, p.x, p.dx, p.bias});
}

// Launches the backward kernel on the Chunk's grid; returns the grid (its gy partial rows).
template <typename T, typename W, typename Chunk>
TileGrid backward_with(const BackwardParams& p, int sms, cudaStream_t stream, const char* op) {
  const TileGrid g = make_grid(p.rows, p.cols, sms, Chunk::Tune::kBlocksPerSm, kBackwardBlockWidth);
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
  return g;
}

template <typename T, typename W>
void launch_backward(const BackwardParams& p, int device_index, cudaStream_t stream) {
  const char* op = "bias_act_dropout_backward";
  const int sms = sm_count(op, device_index);
  const TileGrid g = backward_vector_path(p) ? backward_with<T, W, VectorChunk<T, BackwardTuning>>(p, sms, stream, op)
                                             : backward_with<T, W, ScalarChunk<T>>(p, sms, stream, op);
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
  const int sms = sm_count("bias_act_dropout_backward_workspace_size", device_index);
  // The grid depends on the path (alignment decides it at launch time), not on the dtype: size
  // for the larger of the two.
  (void)dtype;
  return std::max(partial_bytes(make_grid(rows, cols, sms, BackwardTuning::kBlocksPerSm, kBackwardBlockWidth), cols),
                  partial_bytes(make_grid(rows, cols, sms, GenericTuning::kBlocksPerSm, kBackwardBlockWidth), cols));
}

}  // namespace fusekit::bias_act_dropout
