// CUDA launchers for the gated activations: describe the problem (alignment decides the vector or
// the scalar path), launch what gated_act_config.h chooses, dispatching on the element type, the
// activation, the layout and the rows per thread.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/device_info.h"
#include "gated_act/gated_act_config.h"
#include "gated_act/gated_act_kernels.cuh"
#include "gated_act/gated_act_params.h"

namespace fusekit::gated_act {
namespace {

// 16-byte units need F and every row stride to be multiples of a vector and every pointer 16-byte
// aligned (null pointers, outputs not asked for, are left out).
bool vector_path_ok(std::int64_t cols, int element_bytes, std::initializer_list<std::int64_t> row_strides,
                    std::initializer_list<const void*> pointers) {
  const int n = vector_elems(element_bytes);
  if (cols % n != 0) return false;
  for (std::int64_t s : row_strides)
    if (s % n != 0) return false;
  for (const void* ptr : pointers)
    if (ptr && reinterpret_cast<std::uintptr_t>(ptr) % 16 != 0) return false;
  return true;
}

// Row strides and pointers of a GateUp (planes: both; interleaved: the one tensor).
template <typename Ptr>
bool gate_up_vector_ok(std::int64_t cols, int element_bytes, const GateUp<Ptr>& t, bool interleaved) {
  if (interleaved) return vector_path_ok(cols, element_bytes, {t.gate_row_stride}, {t.gate});
  return vector_path_ok(cols, element_bytes, {t.gate ? t.gate_row_stride : 0, t.up ? t.up_row_stride : 0},
                        {t.gate, t.up});
}

// Calls f(T{}) with the storage type of `dtype`.
template <typename F>
void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32: f(float{}); return;
    case DType::f16: f(__half{}); return;
    case DType::bf16: f(__nv_bfloat16{}); return;
    default: return;  // refused by the argument checks
  }
}

// Calls f(std::integral_constant<Activation, A>{}) for the gated activations.
template <typename F>
void dispatch_activation(Activation a, F&& f) {
  switch (a) {
    case Activation::silu: f(std::integral_constant<Activation, Activation::silu>{}); return;
    case Activation::gelu_tanh: f(std::integral_constant<Activation, Activation::gelu_tanh>{}); return;
    case Activation::gelu_erf: f(std::integral_constant<Activation, Activation::gelu_erf>{}); return;
    case Activation::relu: f(std::integral_constant<Activation, Activation::relu>{}); return;
    default: return;  // refused by the argument checks
  }
}

// Calls f(T{}, act, interleaved, vector, rows) with every choice of a launch as a compile-time
// constant (std::integral_constant). The scalar path is compiled for kScalarRowsPerThread only.
template <typename F>
void dispatch_all(DType dtype, Activation activation, bool interleaved, const Launch& launch, F&& f) {
  dispatch_dtype(dtype, [&](auto t) {
    dispatch_activation(activation, [&](auto act) {
      auto with_layout = [&](auto vector, auto rows) {
        if (interleaved) f(t, act, std::true_type{}, vector, rows);
        else f(t, act, std::false_type{}, vector, rows);
      };
      if (!launch.vector) {
        with_layout(std::false_type{}, std::integral_constant<int, kScalarRowsPerThread>{});
        return;
      }
      switch (launch.rows_per_thread) {  // kVectorRowsPerThread
        case 1: with_layout(std::true_type{}, std::integral_constant<int, 1>{}); return;
        case 2: with_layout(std::true_type{}, std::integral_constant<int, 2>{}); return;
        default: with_layout(std::true_type{}, std::integral_constant<int, 4>{}); return;
      }
    });
  });
}

Launch launch_for(const char* op, std::int64_t rows, std::int64_t cols, DType dtype, bool backward, bool vector_ok,
                  int device_index) {
  Problem problem;
  problem.rows = rows;
  problem.cols = cols;
  problem.element_bytes = static_cast<int>(dtype_size(dtype));
  problem.backward = backward;
  problem.vector_ok = vector_ok;
  return choose_launch(problem, detail::device_info(op, device_index), forced_choices());
}

}  // namespace

void forward_cuda(const char* op, const ForwardParams& p, int device_index, Stream stream) {
  detail::DeviceGuard guard(op, device_index);
  const int element_bytes = static_cast<int>(dtype_size(p.dtype));
  const bool vector_ok = gate_up_vector_ok(p.cols, element_bytes, p.in, p.interleaved) &&
                         vector_path_ok(p.cols, element_bytes, {p.y_row_stride}, {p.y});
  const Launch l = launch_for(op, p.rows, p.cols, p.dtype, false, vector_ok, device_index);
  const dim3 grid(static_cast<unsigned>(l.col_tiles), static_cast<unsigned>(l.row_blocks));
  const dim3 block(l.tile_threads, l.row_threads);
  dispatch_all(p.dtype, p.activation, p.interleaved, l, [&](auto t, auto act, auto interleaved, auto vector, auto rows) {
    kernels::forward_kernel<decltype(t), decltype(vector)::value, decltype(interleaved)::value, decltype(act)::value,
                            decltype(rows)::value>
        <<<grid, block, 0, static_cast<cudaStream_t>(stream)>>>(p, static_cast<int>(l.units_per_row));
  });
  detail::check_launch(op, "gated_act forward kernel");
}

void backward_cuda(const char* op, const BackwardParams& p, int device_index, Stream stream) {
  detail::DeviceGuard guard(op, device_index);
  const int element_bytes = static_cast<int>(dtype_size(p.dtype));
  const bool vector_ok = gate_up_vector_ok(p.cols, element_bytes, p.in, p.interleaved) &&
                         gate_up_vector_ok(p.cols, element_bytes, p.grad, p.interleaved) &&
                         vector_path_ok(p.cols, element_bytes, {p.dy_row_stride}, {p.dy});
  const Launch l = launch_for(op, p.rows, p.cols, p.dtype, true, vector_ok, device_index);
  const dim3 grid(static_cast<unsigned>(l.col_tiles), static_cast<unsigned>(l.row_blocks));
  const dim3 block(l.tile_threads, l.row_threads);
  dispatch_all(p.dtype, p.activation, p.interleaved, l, [&](auto t, auto act, auto interleaved, auto vector, auto rows) {
    kernels::backward_kernel<decltype(t), decltype(vector)::value, decltype(interleaved)::value, decltype(act)::value,
                             decltype(rows)::value>
        <<<grid, block, 0, static_cast<cudaStream_t>(stream)>>>(p, static_cast<int>(l.units_per_row));
  });
  detail::check_launch(op, "gated_act backward kernel");
}

}  // namespace fusekit::gated_act
