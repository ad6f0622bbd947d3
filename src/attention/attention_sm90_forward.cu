// Launcher of the Hopper attention forward (attention_sm90_kernels.cuh): builds the TMA
// descriptors of q, k, v (and the bias) from the caller's strides and launches one CTA per
// (query block, query head, batch).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attention/attention_sm90.h"
#include "attention/attention_sm90_launch.h"

namespace fusekit::attention::sm90 {
namespace {

using namespace launch_detail;

template <typename Traits, bool kBias>
void launch(const Problem& p, const kernels::KernelParams& k, int device_index, cudaStream_t stream) {
  using namespace cute;
  using E = typename Traits::Element;
  const char* op = "attention_forward";
  const auto [gq, gk, gv] = qkv_tensors<Traits>(p);
  ForwardParams<Traits> P{
      k,
      make_tma_copy(SM90_TMA_LOAD{}, gq, typename Traits::SmemLayoutQ{}, Shape<Int<Traits::kBM>, Int<Traits::kD>>{},
                    _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, gk, take<0, 2>(typename Traits::SmemLayoutKV{}),
                    Shape<Int<Traits::kBN>, Int<Traits::kD>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, gv, take<0, 2>(typename Traits::SmemLayoutKV{}),
                    Shape<Int<Traits::kBN>, Int<Traits::kD>>{}, _1{}),
      gq.shape(), gk.shape(), gv.shape(), {}, {}, {}};  // the bias's members: below
  if constexpr (kBias) {
    auto gb = bias_tensor(p.bias, static_cast<const E*>(p.bias.data));
    P.tma_bias = make_tma_copy(SM90_TMA_LOAD{}, gb, take<0, 2>(typename Traits::SmemLayoutBias{}),
                               Shape<Int<Traits::kBM>, Int<Traits::kBN>>{}, _1{});
    P.shape_bias = gb.shape();
    P.bias = bias_coords(p.bias);
  }
  auto kernel = k.dropout ? forward_kernel<Traits, true, kBias> : forward_kernel<Traits, false, kBias>;
  const dim3 grid(static_cast<unsigned>((p.seqlen_q + Traits::kBM - 1) / Traits::kBM),
                  static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.batch));
  launch_kernel(op, "attention forward kernel (sm90)", kernel, grid, Traits::kThreads,
                Traits::template smem_bytes<kBias>(), P, device_index, stream);
}

template <typename Traits>
void launch(const Problem& p, const kernels::KernelParams& k, int device_index, cudaStream_t stream) {
  if (p.bias.data != nullptr) launch<Traits, true>(p, k, device_index, stream);
  else launch<Traits, false>(p, k, device_index, stream);
}

}  // namespace

void forward(const Problem& p, const kernels::KernelParams& k, int device_index, cudaStream_t stream) {
  with_traits<ForwardTraits>(p, [&](auto traits) { launch<decltype(traits)>(p, k, device_index, stream); });
}

}  // namespace fusekit::attention::sm90
