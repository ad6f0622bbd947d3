// CUDA backend of the gated linear ops (fusekit/linear.h).
//
// Forward. With W's rows interleaved, one CUTLASS GEMM over all 2F columns writes y from its
// epilogue (linear_gated_sm90.cuh): y costs no pass of its own, and pre is stored only when the
// caller keeps it. The halves order puts a gate and its up in different tiles of that GEMM, so
// halves (and f32, column-major W, misaligned views) run the linear forward into pre, then
// gated_act_forward over it: one extra read of (M, 2F) and write of (M, F).
//
// Backward. dpre is the input of both GEMMs (dx = dpre W, dW = dpre^T x), so it is formed once, as
// the linear backward forms dz (linear_cuda.cu): for large problems by the dx GEMM's idle producer
// warps while its tensor cores run (interleaved layout; the first rows by gated_act_backward), else
// by gated_act_backward before the GEMMs. dbias is the same fixed-order column sum as the plain op's.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/choice_override.h"
#include "core/cuda_check.h"
#include "core/device_info.h"
#include "fusekit/gated_act.h"
#include "linear/linear_config.h"
#include "linear/linear_cutlass.h"
#include "linear/linear_params.h"
#include "linear/linear_paths.h"

namespace fusekit::linear {

namespace {

constexpr const char* kGatedForwardOp = "gated_linear_forward";
constexpr const char* kGatedBackwardOp = "gated_linear_backward";

using GatedForwardChoice = detail::ChoiceOverride<GatedForwardPath>;

std::size_t round_up(std::size_t v, std::size_t a) { return (v + a - 1) / a * a; }

// The scratch copy of pre or dpre: rows of 2F padded to 8 elements (16-byte rows for the GEMMs).
std::int64_t scratch_row_stride(std::int64_t f) { return static_cast<std::int64_t>(round_up(2 * f, 8)); }
std::size_t scratch_bytes(std::int64_t m, std::int64_t f, DType dtype) {
  return round_up(static_cast<std::size_t>(m) * scratch_row_stride(f) * dtype_size(dtype), 256);
}

TensorView matrix_view(const void* data, DType dtype, int device_index, std::int64_t rows, std::int64_t cols,
                       std::int64_t ld) {
  return TensorView(const_cast<void*>(data), dtype, Device::cuda(device_index), {rows, cols}, {ld, 1});
}

GatedActConfig gated_act_config(Activation activation, GatedLayout layout) {
  GatedActConfig c;
  c.activation = activation;
  c.layout = layout;
  return c;
}

void run_epilogue(const GatedForwardParams& p, int device_index, cudaStream_t stream) {
  sm90::GatedForwardArgs a;
  a.m = static_cast<int>(p.m);
  a.n = static_cast<int>(2 * p.f);
  a.k = static_cast<int>(p.k);
  a.x = p.x;
  a.ldx = p.ldx;
  a.w = p.w;
  a.ldw = p.ldw;
  a.bias = p.bias;
  a.y = p.y;
  a.ldy = p.ldy;
  a.pre = p.pre;
  a.ldpre = p.ldpre;
  a.activation = p.activation;
  a.device_index = device_index;
  a.sm_count = detail::device_info(kGatedForwardOp, device_index).sm_count;
  a.workspace = p.workspace;
  a.workspace_bytes = p.workspace_bytes;
  if (p.dtype == DType::bf16) sm90::gated_forward_bf16(kGatedForwardOp, a, stream);
  else sm90::gated_forward_f16(kGatedForwardOp, a, stream);
}

void run_gemm_then_gated(const GatedForwardParams& p, int device_index, Stream stream) {
  // pre lands in the caller's tensor, or in the workspace after the GEMM's own scratch.
  const std::size_t gemm_bytes = forward_workspace_cuda(p.m, 2 * p.f, p.k, p.dtype, Activation::none);
  void* pre = p.pre;
  std::int64_t ldpre = p.ldpre;
  if (pre == nullptr) {
    pre = static_cast<unsigned char*>(p.workspace) + gemm_bytes;
    ldpre = scratch_row_stride(p.f);
  }
  ForwardParams g;
  g.m = p.m;
  g.n = 2 * p.f;
  g.k = p.k;
  g.dtype = p.dtype;
  g.activation = Activation::none;
  g.x = p.x;
  g.ldx = p.ldx;
  g.w = p.w;
  g.ldw = p.ldw;
  g.w_col_major = p.w_col_major;
  g.bias = p.bias;
  g.y = pre;
  g.ldy = ldpre;
  g.workspace = p.workspace;
  g.workspace_bytes = gemm_bytes;
  forward_cuda(g, device_index, stream);
  gated_act_forward(matrix_view(pre, p.dtype, device_index, p.m, 2 * p.f, ldpre),
                    gated_act_config(p.activation, p.layout),
                    matrix_view(p.y, p.dtype, device_index, p.m, p.f, p.ldy), stream);
}

}  // namespace

const char* gated_forward_path_name(GatedForwardPath path) {
  switch (path) {
    case GatedForwardPath::automatic: return "automatic";
    case GatedForwardPath::epilogue: return "epilogue";
    case GatedForwardPath::gemm_then_gated: return "gemm_then_gated";
    case GatedForwardPath::trivial: return "trivial";
  }
  return "unknown";
}
void set_gated_forward_path_override(GatedForwardPath path) { GatedForwardChoice::force(path); }
GatedForwardPath last_gated_forward_path() { return GatedForwardChoice::last(); }

std::size_t gated_forward_workspace_cuda(std::int64_t m, std::int64_t f, std::int64_t k, DType dtype,
                                         GatedLayout, bool keeps_pre) {
  // The GEMM's scratch (cuBLASLt's; the epilogue kernel's scheduler fits inside it), and room for
  // pre on the path that forms it first when the caller does not keep it. Sized for either path:
  // which one runs also depends on the views' alignment.
  const std::size_t gemm = forward_workspace_cuda(m, 2 * f, k, dtype, Activation::none);
  return keeps_pre ? gemm : gemm + scratch_bytes(m, f, dtype);
}

std::size_t gated_backward_workspace_cuda(std::int64_t m, std::int64_t f, std::int64_t k, DType dtype,
                                          Activation activation) {
  return backward_workspace_cuda(m, 2 * f, k, dtype, activation);
}

void gated_forward_cuda(const GatedForwardParams& p, int device_index, Stream stream) {
  detail::DeviceGuard guard(kGatedForwardOp, device_index);
  const GatedForwardPath forced = GatedForwardChoice::requested(
      "linear.gated.forward", {{"epilogue", GatedForwardPath::epilogue}, {"separate", GatedForwardPath::gemm_then_gated}});
  const GatedForwardPath path = choose_gated_forward_path(gated_forward_problem(p), forced);
  if (path == GatedForwardPath::epilogue) run_epilogue(p, device_index, static_cast<cudaStream_t>(stream));
  else if (path == GatedForwardPath::gemm_then_gated) run_gemm_then_gated(p, device_index, stream);
  GatedForwardChoice::record(path);
}

void gated_backward_cuda(const GatedBackwardParams& p, int device_index, Stream stream) {
  BackwardParams b;
  b.m = p.m;
  b.n = 2 * p.f;
  b.k = p.k;
  b.dtype = p.dtype;
  b.activation = p.activation;
  b.gated = true;
  b.gated_layout = p.layout;
  b.dout = p.dy;
  b.lddout = p.lddy;
  b.pre = p.pre;
  b.ldpre = p.ldpre;
  b.x = p.x;
  b.ldx = p.ldx;
  b.w = p.w;
  b.ldw = p.ldw;
  b.w_col_major = p.w_col_major;
  b.dx = p.dx;
  b.lddx = p.lddx;
  b.dw = p.dw;
  b.lddw = p.lddw;
  b.dw_col_major = p.dw_col_major;
  b.dbias = p.dbias;
  b.workspace = p.workspace;
  b.workspace_bytes = p.workspace_bytes;
  backward_cuda(b, device_index, stream);
}

}  // namespace fusekit::linear
