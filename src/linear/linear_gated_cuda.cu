// CUDA backend of the gated linear ops (fusekit/linear.h).
//
// Forward. With W's rows interleaved, one CUTLASS GEMM over all 2F columns writes y from its
// epilogue (linear_gated_sm90.cuh): y costs no pass of its own, and pre is stored only when the
// caller keeps it. The halves order puts a gate and its up in different tiles of that GEMM, so
// halves (and f32, column-major W, misaligned views) run the linear forward into pre, then
// gated_act_forward over it: one extra read of (M, 2F) and write of (M, F).
//
// Backward: linear_cuda.cu's, with BackwardParams::gated. dpre is the input of both GEMMs (dx =
// dpre W, dW = dpre^T x), so it is formed once, as dz is: for large problems by the dx GEMM's idle
// producer warps while its tensor cores run (interleaved layout; the first rows by
// gated_act_backward), else by gated_act_backward before the GEMMs.
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

// The GEMM over all 2F columns, its output (y) and pre-activation as `p` gives them.
ForwardParams gemm_params(const GatedForwardParams& p) {
  ForwardParams g;
  g.m = p.m;
  g.n = 2 * p.f;
  g.k = p.k;
  g.dtype = p.dtype;
  g.activation = p.activation;
  g.x = p.x;
  g.ldx = p.ldx;
  g.w = p.w;
  g.ldw = p.ldw;
  g.w_col_major = p.w_col_major;
  g.bias = p.bias;
  g.y = p.y;
  g.ldy = p.ldy;
  g.pre = p.pre;
  g.ldpre = p.ldpre;
  g.workspace = p.workspace;
  g.workspace_bytes = p.workspace_bytes;
  return g;
}

void run_epilogue(const GatedForwardParams& p, int device_index, cudaStream_t stream) {
  const sm90::FusedForwardArgs a = sm90::fused_forward_args(gemm_params(p), device_index);
  if (p.dtype == DType::bf16) sm90::gated_forward_bf16(kGatedForwardOp, a, stream);
  else sm90::gated_forward_f16(kGatedForwardOp, a, stream);
}

void run_gemm_then_gated(const GatedForwardParams& p, int device_index, Stream stream) {
  // pre lands in the caller's tensor, or in the workspace after the GEMM's own scratch.
  const std::size_t gemm_bytes = forward_workspace_cuda(p.m, 2 * p.f, p.k, p.dtype, Activation::none);
  ForwardParams g = gemm_params(p);
  g.activation = Activation::none;
  if (g.pre == nullptr) {
    g.pre = static_cast<unsigned char*>(p.workspace) + gemm_bytes;
    g.ldpre = scratch_row_stride(p.f);
  }
  g.y = g.pre;  // the linear forward's output is pre; it stores no second copy
  g.ldy = g.ldpre;
  g.pre = nullptr;
  g.workspace_bytes = gemm_bytes;
  forward_cuda(g, device_index, stream);
  gated_act_forward(matrix_view(g.y, p.dtype, device_index, p.m, 2 * p.f, g.ldy),
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

void gated_forward_cuda(const GatedForwardParams& p, int device_index, Stream stream) {
  detail::DeviceGuard guard(kGatedForwardOp, device_index);
  const GatedForwardPath forced = GatedForwardChoice::requested(
      "linear.gated.forward", {{"epilogue", GatedForwardPath::epilogue}, {"separate", GatedForwardPath::gemm_then_gated}});
  const GatedForwardPath path = choose_gated_forward_path(gated_forward_problem(p), forced);
  if (path == GatedForwardPath::epilogue) run_epilogue(p, device_index, static_cast<cudaStream_t>(stream));
  else if (path == GatedForwardPath::gemm_then_gated) run_gemm_then_gated(p, device_index, stream);
  GatedForwardChoice::record(path);
}

}  // namespace fusekit::linear
