// Launcher of the Hopper attention dK / dV kernel (attention_sm90_kernels.cuh): builds the TMA
// descriptors of q, dout, k, v (and the bias, dbias) from the caller's strides and launches one
// CTA per (key block, kv head, batch).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attention/attention_config.h"
#include "attention/attention_sm90.h"
#include "attention/attention_sm90_launch.h"

namespace fusekit::attention::sm90 {
namespace {

using namespace launch_detail;

template <typename Traits, bool kAtomicDQ, bool kBias>
void launch_dkdv(const BackwardProblem& p, const kernels::KernelParams& k, int cta_group, int device_index,
                 cudaStream_t stream) {
  using namespace cute;
  using E = typename Traits::Element;
  const char* op = "attention_backward";
  const TmaExtents x = tma_extents(p);
  const auto [gq, gk, gv] = qkv_tensors<Traits>(p);
  const auto go = gmem_tensor<Traits>(p.dout, x.tokens_q, p.heads_q, x.batch, p.varlen);
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
                           gv.shape(),
                           {}, {}, {}, {}, {},  // the bias's members: below
                           cta_group,
                           {},
                           {}};  // the dQ accumulator's members: below
  if constexpr (kAtomicDQ) {
    // the float32 dQ accumulator, (token, head, d) contiguous (batch-major with fixed lengths)
    const std::int64_t row = p.heads_q * Traits::kD;
    const auto shape = make_shape(static_cast<std::int32_t>(x.tokens_q), static_cast<std::int32_t>(Traits::kD),
                                  static_cast<std::int32_t>(p.heads_q), static_cast<std::int32_t>(x.batch));
    auto gdq = make_tensor(make_gmem_ptr(k.dq_accum),
                           make_layout(shape, make_stride(row, _1{}, std::int64_t{Traits::kD},
                                                          p.varlen ? row : p.seqlen_q * row)));
    P.tma_dq = make_tma_copy(SM90_TMA_REDUCE_ADD{}, gdq, typename Traits::SmemLayoutDQBlock{}, Shape<_64, _64>{}, _1{});
    P.shape_dq = gdq.shape();
  }
  if constexpr (kBias) {
    const auto bias_tile = Shape<Int<Traits::kBM>, Int<Traits::kBN>>{};
    auto gb = bias_tensor(p.bias, static_cast<const E*>(p.bias.data));
    P.tma_bias = make_tma_copy(SM90_TMA_LOAD{}, gb, take<0, 2>(typename Traits::SmemLayoutDS{}), bias_tile, _1{});
    P.shape_bias = gb.shape();
    P.bias = bias_coords(p.bias);
    if (k.dbias_direct != 0) {
      auto gdb = bias_tensor(p.dbias, static_cast<E*>(p.dbias.data));
      P.tma_dbias = make_tma_copy(SM90_TMA_STORE{}, gdb, take<0, 2>(typename Traits::SmemLayoutDS{}), bias_tile, _1{});
      P.shape_dbias = gdb.shape();
    }
  }
  auto kernel = dkdv_kernel<Traits, kAtomicDQ, false, kBias>;
  if (k.dropout) {
    if constexpr (sm90_dropout_with_bias_fits(Traits::kD) || !kBias) kernel = dkdv_kernel<Traits, kAtomicDQ, true, kBias>;
  }
  const dim3 grid(static_cast<unsigned>((p.seqlen_k + Traits::kBN - 1) / Traits::kBN * p.heads_kv * p.batch));
  launch_kernel(op, "attention backward dk/dv kernel (sm90)", kernel, grid, Traits::kThreads, Traits::smem_bytes(), P,
                device_index, stream);
}

template <typename Traits>
void launch_dkdv(const BackwardProblem& p, const kernels::KernelParams& k, int cta_group, int device_index,
                 cudaStream_t stream) {
  static_assert(Traits::kBN == kSm90BackwardKeyBlock, "the grid bound of sm90_backward_supported");
  // (sm90_backward_supported sends a bias here only in the atomic-dQ mode)
  if (k.atomic_dq == 0) launch_dkdv<Traits, false, false>(p, k, cta_group, device_index, stream);
  else if (p.bias.data != nullptr) launch_dkdv<Traits, true, true>(p, k, cta_group, device_index, stream);
  else launch_dkdv<Traits, true, false>(p, k, cta_group, device_index, stream);
}

}  // namespace

void dkdv(const BackwardProblem& p, const kernels::KernelParams& k, int cta_group, int device_index,
          cudaStream_t stream) {
  with_traits<BackwardTraits>(p, [&](auto traits) {
    launch_dkdv<decltype(traits)>(p, k, cta_group, device_index, stream);
  });
}

}  // namespace fusekit::attention::sm90
