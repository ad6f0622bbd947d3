// Launchers of the Hopper attention kernels (attention_sm90_kernels.cuh): build the TMA
// descriptors of q, k, v (and dout) from the caller's strides and launch one CTA per (query
// block, query head, batch) forward or (key block, kv head, batch) for dK / dV.
#include "attention/attention_sm90.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "attention/attention_sm90_kernels.cuh"
#include "core/cuda_check.h"
#include "core/device_info.h"
#include "fusekit/error.h"

namespace fusekit::attention::sm90 {
namespace {

template <typename Traits>
typename Traits::GmemTensor gmem_tensor(const Operand& op, std::int64_t tokens, std::int64_t heads,
                                        std::int64_t batch, bool varlen) {
  using namespace cute;
  using E = typename Traits::Element;
  // A dim of extent 1 is never stepped, and its stride may be anything the caller's view had (the
  // argument checks skip it), but TMA wants every stride a non-zero multiple of 16 bytes: such a
  // dim gets the row length (kD elements) instead. With variable lengths the batch extent is 1.
  auto stride_of = [](std::int64_t extent, std::int64_t stride) { return extent > 1 ? stride : std::int64_t{Traits::kD}; };
  return make_tensor(make_gmem_ptr(static_cast<const E*>(op.data)),
                     make_layout(make_shape(static_cast<std::int32_t>(tokens), static_cast<std::int32_t>(Traits::kD),
                                            static_cast<std::int32_t>(heads), static_cast<std::int32_t>(batch)),
                                 make_stride(stride_of(tokens, op.s_stride), _1{}, stride_of(heads, op.h_stride),
                                             stride_of(batch, varlen ? 0 : op.b_stride))));
}

// Whether TMA can describe the operand: every dim it steps has a positive stride (the argument
// checks allow 0, a view broadcast over heads or tokens; the mma.sync kernels take those).
bool tma_describable(const Operand& op, std::int64_t tokens, std::int64_t heads, std::int64_t batch) {
  return (tokens <= 1 || op.s_stride > 0) && (heads <= 1 || op.h_stride > 0) && (batch <= 1 || op.b_stride > 0);
}

// Launches `kernel` with `smem` bytes of dynamic shared memory (more than the default 48 KB: the
// kernel must be allowed it first, and the GPU must have it).
template <typename Kernel, typename Params>
void launch_kernel(const char* op, const char* what, Kernel kernel, dim3 grid, int threads, int smem, const Params& P,
                   int device_index, cudaStream_t stream) {
  const std::size_t optin = detail::device_info(op, device_index).max_smem_per_block_optin;
  if (static_cast<std::size_t>(smem) > optin)
    throw Error(ErrorKind::unsupported, op,
                std::string("the ") + what + " needs " + std::to_string(smem) +
                    " bytes of shared memory per block; the GPU allows " + std::to_string(optin));
  FUSEKIT_CUDA_CHECK(op, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, threads, smem, stream>>>(P);
  detail::check_launch(op, what);
}

template <typename Traits>
void launch(const Problem& p, const kernels::KernelParams& k, int device_index, cudaStream_t stream) {
  using namespace cute;
  const char* op = "attention_forward";
  const std::int64_t batch = p.varlen ? 1 : p.batch;
  const std::int64_t tokens_q = p.varlen ? p.total_q : p.seqlen_q;
  const std::int64_t tokens_k = p.varlen ? p.total_k : p.seqlen_k;
  auto gq = gmem_tensor<Traits>(p.q, tokens_q, p.heads_q, batch, p.varlen);
  auto gk = gmem_tensor<Traits>(p.k, tokens_k, p.heads_kv, batch, p.varlen);
  auto gv = gmem_tensor<Traits>(p.v, tokens_k, p.heads_kv, batch, p.varlen);
  ForwardParams<Traits> P{
      k,
      make_tma_copy(SM90_TMA_LOAD{}, gq, typename Traits::SmemLayoutQ{}, Shape<Int<Traits::kBM>, Int<Traits::kD>>{},
                    _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, gk, take<0, 2>(typename Traits::SmemLayoutKV{}),
                    Shape<Int<Traits::kBN>, Int<Traits::kD>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, gv, take<0, 2>(typename Traits::SmemLayoutKV{}),
                    Shape<Int<Traits::kBN>, Int<Traits::kD>>{}, _1{}),
      gq.shape(), gk.shape(), gv.shape()};

  auto kernel = k.dropout ? forward_kernel<Traits, true> : forward_kernel<Traits, false>;
  const dim3 grid(static_cast<unsigned>((p.seqlen_q + Traits::kBM - 1) / Traits::kBM),
                  static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.batch));
  launch_kernel(op, "attention forward kernel (sm90)", kernel, grid, Traits::kThreads, Traits::smem_bytes(), P,
                device_index, stream);
}

template <typename Traits>
void launch_dkdv(const BackwardProblem& p, const kernels::KernelParams& k, int device_index, cudaStream_t stream) {
  using namespace cute;
  const char* op = "attention_backward";
  const std::int64_t batch = p.varlen ? 1 : p.batch;
  const std::int64_t tokens_q = p.varlen ? p.total_q : p.seqlen_q;
  const std::int64_t tokens_k = p.varlen ? p.total_k : p.seqlen_k;
  auto gq = gmem_tensor<Traits>(p.q, tokens_q, p.heads_q, batch, p.varlen);
  auto go = gmem_tensor<Traits>(p.dout, tokens_q, p.heads_q, batch, p.varlen);
  auto gk = gmem_tensor<Traits>(p.k, tokens_k, p.heads_kv, batch, p.varlen);
  auto gv = gmem_tensor<Traits>(p.v, tokens_k, p.heads_kv, batch, p.varlen);
  const auto q_tile = Shape<Int<Traits::kBM>, Int<Traits::kD>>{};
  const auto kv_tile = Shape<Int<Traits::kBN>, Int<Traits::kD>>{};
  BackwardParams<Traits> P{k,
                           make_tma_copy(SM90_TMA_LOAD{}, gq, take<0, 2>(typename Traits::SmemLayoutQ{}), q_tile, _1{}),
                           make_tma_copy(SM90_TMA_LOAD{}, go, take<0, 2>(typename Traits::SmemLayoutQ{}), q_tile, _1{}),
                           make_tma_copy(SM90_TMA_LOAD{}, gk, typename Traits::SmemLayoutKV{}, kv_tile, _1{}),
                           make_tma_copy(SM90_TMA_LOAD{}, gv, typename Traits::SmemLayoutKV{}, kv_tile, _1{}),
                           gq.shape(),
                           go.shape(),
                           gk.shape(),
                           gv.shape()};
  auto kernel = k.atomic_dq != 0 ? (k.dropout ? dkdv_kernel<Traits, true, true> : dkdv_kernel<Traits, true, false>)
                                  : (k.dropout ? dkdv_kernel<Traits, false, true> : dkdv_kernel<Traits, false, false>);
  const dim3 grid(static_cast<unsigned>((p.seqlen_k + Traits::kBN - 1) / Traits::kBN),
                  static_cast<unsigned>(p.heads_kv), static_cast<unsigned>(p.batch));
  launch_kernel(op, "attention backward dk/dv kernel (sm90)", kernel, grid, Traits::kThreads, Traits::smem_bytes(), P,
                device_index, stream);
}

}  // namespace

bool backward_supported(const BackwardProblem& p, int device_index) {
  const std::int64_t batch = p.varlen ? 1 : p.batch, tokens_q = p.varlen ? p.total_q : p.seqlen_q;
  return forward_supported(p, device_index) && p.dbias.data == nullptr &&
         tma_describable(p.dout, tokens_q, p.heads_q, batch);
}

void dkdv(const BackwardProblem& p, const kernels::KernelParams& k, int device_index, cudaStream_t stream) {
  const bool bf16 = p.dtype == DType::bf16;
  if (p.head_dim == 64) {
    if (bf16) launch_dkdv<BackwardTraits<__nv_bfloat16, 64>>(p, k, device_index, stream);
    else launch_dkdv<BackwardTraits<__half, 64>>(p, k, device_index, stream);
  } else {
    if (bf16) launch_dkdv<BackwardTraits<__nv_bfloat16, 128>>(p, k, device_index, stream);
    else launch_dkdv<BackwardTraits<__half, 128>>(p, k, device_index, stream);
  }
}

bool forward_supported(const Problem& p, int device_index) {
  if (const char* env = std::getenv("FUSEKIT_ATTENTION_SM90"); env != nullptr && std::strcmp(env, "0") == 0)
    return false;
  const detail::DeviceInfo& info = detail::device_info("attention_forward", device_index);
  if (info.major != 9) return false;
  if (p.dtype != DType::bf16 && p.dtype != DType::f16) return false;
  if (p.head_dim != p.head_dim_v || (p.head_dim != 64 && p.head_dim != 128)) return false;
  // A TMA descriptor needs every extent >= 1: no query or no key tokens at all (variable lengths
  // that are all 0) stay with the mma.sync kernels, which define those outputs (zeros, -inf).
  if (p.total_q == 0 || p.total_k == 0 || p.heads_q == 0 || p.heads_kv == 0 || p.batch == 0) return false;
  const std::int64_t batch = p.varlen ? 1 : p.batch;
  const std::int64_t tokens_q = p.varlen ? p.total_q : p.seqlen_q, tokens_k = p.varlen ? p.total_k : p.seqlen_k;
  if (!tma_describable(p.q, tokens_q, p.heads_q, batch) || !tma_describable(p.k, tokens_k, p.heads_kv, batch) ||
      !tma_describable(p.v, tokens_k, p.heads_kv, batch))
    return false;
  return p.bias.data == nullptr && p.scale > 0.0;
}

void forward(const Problem& p, const kernels::KernelParams& k, int device_index, cudaStream_t stream) {
  const bool bf16 = p.dtype == DType::bf16;
  if (p.head_dim == 64) {
    if (bf16) launch<ForwardTraits<__nv_bfloat16, 64>>(p, k, device_index, stream);
    else launch<ForwardTraits<__half, 64>>(p, k, device_index, stream);
  } else {
    if (bf16) launch<ForwardTraits<__nv_bfloat16, 128>>(p, k, device_index, stream);
    else launch<ForwardTraits<__half, 128>>(p, k, device_index, stream);
  }
}

}  // namespace fusekit::attention::sm90
