// The validated, backend-neutral description of one linear call. The public entry points
// (linear.cpp) check the arguments and fill these; each backend (CPU reference, CUDA) reads them.
// Matrices are row-major with the given row strides (in elements); the last dimension contiguous.
// W and dW may instead be column-major (w_col_major, dw_col_major: element (n, k) at n + k * ld).
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusekit/activation.h"
#include "fusekit/gated_act.h"
#include "fusekit/tensor.h"

namespace fusekit::linear {

struct ForwardParams {
  std::int64_t m = 0, n = 0, k = 0;
  DType dtype = DType::bf16;  // every tensor
  Activation activation = Activation::none;
  const void* x = nullptr;  // (m, k)
  std::int64_t ldx = 0;
  const void* w = nullptr;  // (n, k)
  std::int64_t ldw = 0;
  bool w_col_major = false;
  const void* bias = nullptr;  // (n) or null
  void* y = nullptr;           // (m, n)
  std::int64_t ldy = 0;
  void* pre = nullptr;  // (m, n) or null
  std::int64_t ldpre = 0;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

struct BackwardParams {
  std::int64_t m = 0, n = 0, k = 0;
  DType dtype = DType::bf16;
  Activation activation = Activation::none;
  const void* dout = nullptr;  // (m, n)
  std::int64_t lddout = 0;
  const void* x = nullptr;  // (m, k)
  std::int64_t ldx = 0;
  const void* w = nullptr;  // (n, k)
  std::int64_t ldw = 0;
  bool w_col_major = false;
  const void* pre = nullptr;  // (m, n); null only for Activation::none
  std::int64_t ldpre = 0;
  void* dx = nullptr;  // (m, k), each output may be null: not computed
  std::int64_t lddx = 0;
  void* dw = nullptr;  // (n, k)
  std::int64_t lddw = 0;
  bool dw_col_major = false;
  void* dbias = nullptr;  // (n)
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  // gated_linear_backward: dout is dy with n / 2 columns and dz is the gated activation's backward
  // of (dy, pre) in gated_layout, [dy * up * act'(gate), dy * act(gate)] (activation: the gate's),
  // instead of dout * act'(pre).
  bool gated = false;
  GatedLayout gated_layout = GatedLayout::interleaved;
  // linear_backward_through_input_activation: x is x_activation(x_pre), and dx is written as
  // dx * x_activation'(x_pre) (the gradient at x_pre), with its column sums in dx_sum (or null).
  bool through_input_activation = false;
  Activation x_activation = Activation::none;
  const void* x_pre = nullptr;  // (m, k)
  std::int64_t ldx_pre = 0;
  void* dx_sum = nullptr;  // (k)
};

// The gated forward (fusekit/linear.h): the GEMM has n = 2f columns, gate and up in `layout`'s
// order in W, bias and pre.
struct GatedForwardParams {
  std::int64_t m = 0, f = 0, k = 0;
  DType dtype = DType::bf16;
  Activation activation = Activation::silu;
  GatedLayout layout = GatedLayout::interleaved;
  const void* x = nullptr;  // (m, k)
  std::int64_t ldx = 0;
  const void* w = nullptr;  // (2f, k)
  std::int64_t ldw = 0;
  bool w_col_major = false;
  const void* bias = nullptr;  // (2f) or null
  void* y = nullptr;           // (m, f)
  std::int64_t ldy = 0;
  void* pre = nullptr;  // (m, 2f) or null
  std::int64_t ldpre = 0;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

// Column of gate j and up j among the 2f.
inline std::int64_t gate_column(GatedLayout layout, std::int64_t j) {
  return layout == GatedLayout::interleaved ? 2 * j : j;
}
inline std::int64_t up_column(GatedLayout layout, std::int64_t f, std::int64_t j) {
  return layout == GatedLayout::interleaved ? 2 * j + 1 : f + j;
}

void forward_cpu(const ForwardParams& p);
void backward_cpu(const BackwardParams& p);

void forward_cuda(const ForwardParams& p, int device_index, Stream stream);
void backward_cuda(const BackwardParams& p, int device_index, Stream stream);
std::size_t forward_workspace_cuda(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype,
                                   Activation activation);
std::size_t backward_workspace_cuda(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype,
                                    Activation activation);
// The workspace of backward_cuda with through_input_activation.
std::size_t backward_through_input_activation_workspace_cuda(std::int64_t m, std::int64_t n, std::int64_t k,
                                                             DType dtype, Activation activation);

// The gated backward is backward_cpu / backward_cuda with BackwardParams::gated.
void gated_forward_cpu(const GatedForwardParams& p);
void gated_forward_cuda(const GatedForwardParams& p, int device_index, Stream stream);
std::size_t gated_forward_workspace_cuda(std::int64_t m, std::int64_t f, std::int64_t k, DType dtype,
                                         GatedLayout layout, bool keeps_pre);

}  // namespace fusekit::linear
