// CUDA launcher of linear_cross_entropy: the tokens a chunk at a time, each chunk composed of the
// linear and cross_entropy families' tested pieces, all on the caller's stream without a host
// synchronization:
//   (once)       mean: the gradient's scale 1 / N over all T rows (cross_entropy's kernel)
//   per chunk    logits = h_c W^T (+ b)                 cuBLASLt, into the workspace (h's dtype)
//                row losses, dx in place of the logits  cross_entropy's fused row kernel
//                dh_c = dx W                            cuBLASLt
//                dW (+)= dx^T h_c                       cuBLASLt, float32 D, beta = 1 after chunk 0
//                db (+)= column sums of dx              column_sums_kernel (fixed order)
//   (once)       the loss over all row losses (fixed order); dW, db rounded into their dtype
// Row-major tensors are column-major transposes for cuBLASLt (linear_cublaslt.h): a row-major
// (R, C) matrix with row stride ld is a column-major (C x R) one with leading dimension ld.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda_check.h"
#include "cross_entropy/cross_entropy_params.h"
#include "fusekit/error.h"
#include "linear/linear_cublaslt.h"
#include "linear_cross_entropy/linear_cross_entropy_kernels.cuh"
#include "linear_cross_entropy/linear_cross_entropy_params.h"

namespace fusekit::lxent {
namespace {

static_assert(kCublasLtBytes == linear::lt::kWorkspaceBytes, "the workspace's cuBLASLt part");

constexpr const char* kOp = "linear_cross_entropy";

void gemm(const linear::lt::Gemm& g, int device_index, void* cublaslt_workspace, Stream stream, const char* what) {
  if (!linear::lt::run(kOp, g, device_index, cublaslt_workspace, stream))
    throw Error(ErrorKind::unsupported, kOp, std::string("cuBLASLt has no algorithm for the ") + what + " GEMM");
}

// Calls f(T{}) with the storage type of `dtype` (f32, f16, bf16).
template <typename F>
void dispatch_float(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32: f(float{}); return;
    case DType::f16: f(__half{}); return;
    case DType::bf16: f(__nv_bfloat16{}); return;
    default: return;  // rejected by the argument checks
  }
}

// Rounds a float32 accumulator of rows x cols (contiguous) into dst (its dtype, row stride ld).
void store_rows(const float* src, std::int64_t rows, std::int64_t cols, void* dst, DType dtype, std::int64_t ld,
                cudaStream_t stream) {
  const std::int64_t total = rows * cols;
  const std::int64_t blocks = std::min<std::int64_t>((total + kernels::kStoreThreads - 1) / kernels::kStoreThreads,
                                                     std::int64_t(1) << 16);
  dispatch_float(dtype, [&](auto t) {
    using T = decltype(t);
    kernels::store_rows_kernel<T><<<static_cast<unsigned>(blocks), kernels::kStoreThreads, 0, stream>>>(
        src, rows, cols, static_cast<T*>(dst), ld);
  });
  detail::check_launch(kOp, "linear_cross_entropy store kernel");
}

// No rows: a mean or sum of nothing is 0, dW and db are 0 (all-zero bits are 0 in every dtype).
void zero_outputs(const Params& p, cudaStream_t s) {
  if (p.reduction != LossReduction::none) FUSEKIT_CUDA_CHECK(kOp, cudaMemsetAsync(p.loss, 0, sizeof(float), s));
  if (p.dweight) {
    const std::size_t e = dtype_size(p.dweight_dtype);
    FUSEKIT_CUDA_CHECK(kOp, cudaMemset2DAsync(p.dweight, static_cast<std::size_t>(p.lddw) * e, 0,
                                              static_cast<std::size_t>(p.hidden) * e,
                                              static_cast<std::size_t>(p.vocab), s));
  }
  if (p.dbias)
    FUSEKIT_CUDA_CHECK(kOp, cudaMemsetAsync(p.dbias, 0, static_cast<std::size_t>(p.vocab) * dtype_size(p.dbias_dtype), s));
}

}  // namespace

void run_cuda(const Params& p, std::int64_t chunk, int device_index, Stream stream) {
  detail::DeviceGuard guard(kOp, device_index);
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.tokens == 0) {
    zero_outputs(p, s);
    return;
  }
  const std::int64_t T = p.tokens, V = p.vocab, H = p.hidden;
  const Layout l = workspace_layout(T, V, H, chunk, p.dtype, p.dweight ? p.dweight_dtype : DType::f32,
                                    p.dbias != nullptr, p.reduction);
  char* ws = static_cast<char*>(p.workspace);
  void* cublaslt = ws + l.cublaslt;
  float* scale = reinterpret_cast<float*>(ws + l.scale);
  float* row_losses = p.reduction == LossReduction::none ? p.loss : reinterpret_cast<float*>(ws + l.row_losses);
  void* logits = ws + l.logits;
  const std::int64_t ldl = chunk_row_stride(V);
  // dW accumulates in float32: in dweight itself when it is float32, else in the workspace.
  const bool dweight_direct = p.dweight_dtype == DType::f32;
  float* dw = p.dweight ? (dweight_direct ? static_cast<float*>(p.dweight) : reinterpret_cast<float*>(ws + l.dweight_acc))
                        : nullptr;
  const std::int64_t lddw = dweight_direct ? p.lddw : H;
  float* db = p.dbias ? reinterpret_cast<float*>(ws + l.dbias_acc) : nullptr;

  const bool gradients = p.gradients();
  const bool mean_scale = gradients && p.reduction == LossReduction::mean;
  if (mean_scale) cross_entropy::mean_scale_cuda(p.targets, p.target_dtype, T, p.ignore_index, scale, kOp, stream);

  const std::size_t e = dtype_size(p.dtype), target_bytes = dtype_size(p.target_dtype);
  int index = 0;
  for (std::int64_t r0 = 0; r0 < T; r0 += chunk, ++index) {
    const std::int64_t rows = std::min(chunk, T - r0);
    const char* h_chunk = static_cast<const char*>(p.h) + static_cast<std::size_t>(r0 * p.ldh) * e;

    // logits^T (V x rows) = W (V x H, stored as its transpose) h_chunk^T (H x rows), + b per row.
    linear::lt::Gemm fwd;
    fwd.dtype = p.dtype;
    fwd.trans_a = true;
    fwd.m = V;
    fwd.n = rows;
    fwd.k = H;
    fwd.a = p.weight;
    fwd.lda = p.ldw;
    fwd.b = h_chunk;
    fwd.ldb = p.ldh;
    fwd.d = logits;
    fwd.ldd = ldl;
    fwd.epilogue = p.bias ? linear::lt::Epilogue::bias : linear::lt::Epilogue::none;
    fwd.bias = p.bias;
    gemm(fwd, device_index, cublaslt, stream, "logits");

    cross_entropy::Params ce;
    ce.pass = gradients ? cross_entropy::Pass::forward_backward : cross_entropy::Pass::forward;
    ce.rows = rows;
    ce.cols = V;
    ce.dtype = p.dtype;
    ce.target_dtype = p.target_dtype;
    ce.logits = logits;
    ce.logits_row_stride = ldl;
    ce.targets = static_cast<const char*>(p.targets) + static_cast<std::size_t>(r0) * target_bytes;
    ce.dlogits = gradients ? logits : nullptr;  // in place
    ce.dlogits_row_stride = ldl;
    ce.ignore_index = p.ignore_index;
    ce.label_smoothing = p.label_smoothing;
    ce.z_loss = p.z_loss;
    ce.reduction = p.reduction;
    cross_entropy::rows_cuda(ce, row_losses + r0, mean_scale ? scale : nullptr, device_index, kOp, stream);

    if (p.dh) {
      // dh_chunk^T (H x rows) = W^T (H x V, W as stored) dx^T (V x rows, dx as stored).
      linear::lt::Gemm g;
      g.dtype = p.dtype;
      g.m = H;
      g.n = rows;
      g.k = V;
      g.a = p.weight;
      g.lda = p.ldw;
      g.b = logits;
      g.ldb = ldl;
      g.d = static_cast<char*>(p.dh) + static_cast<std::size_t>(r0 * p.lddh) * e;
      g.ldd = p.lddh;
      gemm(g, device_index, cublaslt, stream, "dh");
    }
    if (dw) {
      // dW^T (H x V) (+)= h_chunk^T (H x rows, h as stored) dx (rows x V, the transpose of dx as stored).
      linear::lt::Gemm g;
      g.dtype = p.dtype;
      g.trans_b = true;
      g.m = H;
      g.n = V;
      g.k = rows;
      g.a = h_chunk;
      g.lda = p.ldh;
      g.b = logits;
      g.ldb = ldl;
      g.d = dw;
      g.ldd = lddw;
      g.d_f32 = true;
      g.accumulate = index > 0;
      gemm(g, device_index, cublaslt, stream, "dW");
    }
    if (db) {
      const dim3 grid(static_cast<unsigned>((V + kernels::kSumColumns - 1) / kernels::kSumColumns));
      const dim3 block(kernels::kSumColumns, kernels::kSumRowGroups);
      dispatch_float(p.dtype, [&](auto t) {
        using T = decltype(t);
        kernels::column_sums_kernel<T><<<grid, block, 0, s>>>(static_cast<const T*>(logits), rows, V, ldl, db,
                                                              index > 0);
      });
      detail::check_launch(kOp, "linear_cross_entropy column sums kernel");
    }
  }

  if (p.reduction != LossReduction::none)
    cross_entropy::reduce_losses_cuda(row_losses, p.targets, p.target_dtype, T, p.ignore_index,
                                      p.reduction == LossReduction::mean, p.loss, kOp, stream);
  if (p.dweight && !dweight_direct) store_rows(dw, V, H, p.dweight, p.dweight_dtype, p.lddw, s);
  if (db) store_rows(db, 1, V, p.dbias, p.dbias_dtype, V, s);
}

}  // namespace fusekit::lxent
