// The Hopper attention forward's mainloop pieces (attention_sm90_kernels.cuh's forward_kernel):
// the producer's TMA copies of Q and the K / V (and bias) ring, and the consumer's step from the
// score accumulator S to the probabilities P in wgmma's A-operand registers.
#pragma once

#include <cute/tensor.hpp>  // first: the atom headers below need its declarations
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include <cstdint>
#include <type_traits>

#include "attention/attention_device.cuh"
#include "attention/attention_mask.cuh"
#include "attention/attention_params.h"
#include "attention/attention_sm90_traits.cuh"
#include "attention/attention_sm90_utils.cuh"

namespace fusekit::attention::sm90 {

// The forward's mbarriers, initialized by thread 0 before the CTA's first barrier.
template <typename Traits, typename Storage>
__device__ __forceinline__ void forward_init_barriers(Storage& st) {
  if (threadIdx.x == 0) {
    tx_barrier(st.q_full).init(1);
    for (int i = 0; i < Traits::kStages; ++i) {
      tx_barrier(st.k_full[i]).init(1);
      tx_barrier(st.v_full[i]).init(1);
      barrier(st.k_empty[i]).init(Traits::kConsumerWarps);
      barrier(st.v_empty[i]).init(Traits::kConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
}

// The producer's one lane: Q once, then for n_blocks key blocks from jb_end - 1 down the K tile
// (with the bias tile, on K's barrier) and the V tile into the two-stage rings, each stage reused
// once every consumer warp has released it.
template <typename Traits, bool kBias, typename Storage, typename SmemQ, typename SmemKV, typename SmemBias>
__device__ __forceinline__ void forward_producer(const ForwardParams<Traits>& P, Storage& st, SmemQ& sQ, SmemKV& sK,
                                                 SmemKV& sV, SmemBias& sBias, const kernels::Seq& s, int b, int h,
                                                 int hk, int i_block, int jb_end, int n_blocks) {
  using namespace cute;
  constexpr int kBM = Traits::kBM, kBN = Traits::kBN, kD = Traits::kD, kStages = Traits::kStages;
  const kernels::KernelParams& p = P.base;
  const int qb = p.cu_q != nullptr ? 0 : b;
  Tensor mQ = P.tma_q.get_tma_tensor(P.shape_q);
  Tensor mK = P.tma_k.get_tma_tensor(P.shape_k);
  Tensor mV = P.tma_v.get_tma_tensor(P.shape_v);
  Tensor gQ = head_tiles<kBM, kD>(mQ, s.q_base, h, qb, i_block);
  Tensor gK = head_tiles<kBN, kD>(mK, s.k_base, hk, qb, _);
  Tensor gV = head_tiles<kBN, kD>(mV, s.k_base, hk, qb, _);
  auto [tQg, tQs] = tma_partition(P.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
  auto [tKg, tKs] = tma_partition(P.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
  auto [tVg, tVs] = tma_partition(P.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

  tx_barrier(st.q_full).arrive_and_expect_tx(Traits::kQBytes);
  copy(P.tma_q.with(st.q_full), tQg, tQs);
  for (int n = 0; n < n_blocks; ++n) {
    const int jb = jb_end - 1 - n, stage = n % kStages, use = n / kStages;
    if (use > 0) barrier(st.k_empty[stage]).wait((use - 1) & 1);
    tx_barrier(st.k_full[stage]).arrive_and_expect_tx(Traits::kKVBytes + (kBias ? Traits::kBiasBytes : 0));
    copy(P.tma_k.with(st.k_full[stage]), tKg(_, jb), tKs(_, stage));
    if constexpr (kBias)
      copy_bias_tile<kBM, kBN>(P.tma_bias, P.shape_bias, P.bias, h, b, i_block, jb, sBias, stage, st.k_full[stage]);
    if (use > 0) barrier(st.v_empty[stage]).wait((use - 1) & 1);
    tx_barrier(st.v_full[stage]).arrive_and_expect_tx(Traits::kKVBytes);
    copy(P.tma_v.with(st.v_full[stage]), tVg(_, jb), tVs(_, stage));
  }
}

// The scores of key block j0 (stage `stage`) as log2-unit logits where they must be: with a bias
// (logit = S scale log2(e) + bias log2(e), the bias fragment read by ldmatrix in S's accumulator
// layout: matrix m of an x4 is rows + 8 (m % 2), columns + 8 (m / 2)), and for a block not every
// row sees in full (every key of the block in [all_lo, all_hi), see MaskRule::key_blocks; masked
// per element otherwise). Returns the multiplier the softmax still applies: 1
// for logits, scale log2(e) for raw scores (folded into the exponent's FMA). Releases K's stage
// (with a bias once its tile is read). Accumulator element 4 c + 2 r + e: row row0 + 8 r, key
// j0 + 8 c + 2 t + e.
template <typename Traits, bool kBias, typename Storage, typename FragS>
__device__ __forceinline__ float forward_logits(FragS& tSrS, Storage& st, const kernels::MaskRule& rule, int stage,
                                                int row0, int j0, int all_lo, int all_hi, float mult0, int warp,
                                                int lane, int t) {
  using T = typename Traits::T;
  constexpr int kBM = Traits::kBM, kBN = Traits::kBN, kSCols = kBN / 8;
  // here, next to its branches (computed by the caller and passed as a bool, it became one
  // select and the branches' order changed: 14ac103's SASS differed in every bias kernel)
  const bool every_key_visible = j0 >= all_lo && j0 + kBN <= all_hi;
  float mult = mult0;
  if constexpr (kBias) {
    const unsigned char* tile = reinterpret_cast<const unsigned char*>(st.bias) + stage * Traits::kBiasBytes;
    const int lm_row = warp * 16 + lane % 8 + 8 * ((lane / 8) % 2);
    auto add_bias = [&](auto full) {
      constexpr bool kFull = decltype(full)::value;
      int lo[2] = {0, 0}, hi[2] = {0, 0};
      if constexpr (!kFull)
#pragma unroll
        for (int r = 0; r < 2; ++r) rule.range(row0 + 8 * r, lo[r], hi[r]);
#pragma unroll
      for (int cp = 0; cp < kSCols; cp += 2) {
        std::uint32_t w[4];
        kernels::ldsm_x4(w, tile + sw128_offset<kBM>(lm_row, 8 * (cp + lane / 16)));
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const int r = m % 2, c = cp + m / 2;
          const float2 bias = kernels::unpack2<T>(w[m]);
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = tSrS(4 * c + 2 * r + e);
            const float logit = fmaf(x, mult0, (e ? bias.y : bias.x) * kernels::kLog2e);
            if constexpr (kFull) {
              x = logit;
            } else {
              const int j = j0 + 8 * c + 2 * t + e;
              x = (j >= lo[r] && j < hi[r]) ? logit : kernels::neg_inf();
            }
          }
        }
      }
    };
    if (every_key_visible) add_bias(std::true_type{});
    else add_bias(std::false_type{});
    __syncwarp();
    if (lane == 0) barrier(st.k_empty[stage]).arrive();
    mult = 1.0f;
  } else if (!every_key_visible) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      int lo, hi;
      rule.range(row0 + 8 * r, lo, hi);
#pragma unroll
      for (int c = 0; c < kSCols; ++c)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = j0 + 8 * c + 2 * t + e;
          float& x = tSrS(4 * c + 2 * r + e);
          x = (j >= lo && j < hi) ? x * mult0 : kernels::neg_inf();
        }
    }
    mult = 1.0f;
  }
  return mult;
}

// P into wgmma's A-operand registers (the S accumulator's layout element for element), rounded
// to the input dtype, the dropped probabilities zeroed first (keep words of forward_keep_words;
// the row sums counted every probability, O sums the kept ones, scaled at the end).
template <typename Traits, bool kDropout, typename FragS, typename FragP>
__device__ __forceinline__ void forward_probabilities(FragS& tSrS, FragP& tOrP, const std::uint32_t (&keep)[2][4],
                                                      int t) {
  using namespace cute;
  using T = typename Traits::T;
  constexpr int kSCols = Traits::kBN / 8;
  if constexpr (kDropout) {
#pragma unroll
    for (int c = 0; c < kSCols; ++c)
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          if (!((keep[r][c % 4] >> (8 * (c / 4) + 2 * t + e)) & 1u)) tSrS(4 * c + 2 * r + e) = 0.0f;
  }
  std::uint32_t* pw = reinterpret_cast<std::uint32_t*>(raw_pointer_cast(tOrP.data()));
#pragma unroll
  for (int i = 0; i < size(tSrS) / 2; ++i) pw[i] = kernels::pack2<T>(tSrS(2 * i), tSrS(2 * i + 1));
}

}  // namespace fusekit::attention::sm90
