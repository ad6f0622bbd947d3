// The Hopper attention backward's mainloop pieces (attention_sm90_kernels.cuh's dkdv_kernel): the
// producer's TMA copies of K and V and of the Q / dO (and bias) ring, the dQ warps' reduce-adds,
// and the consumer's step from the S^T and dP^T accumulators to P^T and dS^T in wgmma's
// A-operand registers.
#pragma once

#include <cute/tensor.hpp>  // first: the atom headers below need its declarations
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include <cstdint>
#include <type_traits>

#include "attention/attention_device.cuh"
#include "attention/attention_dropout.cuh"
#include "attention/attention_mask.cuh"
#include "attention/attention_params.h"
#include "attention/attention_sm90_epilogue.cuh"
#include "attention/attention_sm90_traits.cuh"
#include "attention/attention_sm90_utils.cuh"

namespace fusekit::attention::sm90 {

// The backward's mbarriers, initialized by thread 0 before the CTA's first barrier.
template <typename Traits, typename Storage>
__device__ __forceinline__ void backward_init_barriers(Storage& st) {
  constexpr int kStages = Traits::kStages;
if (threadIdx.x == 0) {
  tx_barrier(st.kv_full).init(1);
  for (int i = 0; i < kStages; ++i) {
    tx_barrier(st.q_full[i]).init(1);
    barrier(st.q_empty[i]).init(Traits::kConsumerWarps);
  }
  for (int wg = 0; wg < 2; ++wg) {
    barrier(st.dq_full[wg]).init(Traits::kConsumerWarps / 2);
    barrier(st.dq_empty[wg]).init(1);
  }
  cutlass::arch::fence_barrier_init();
}
__syncthreads();
}

// A dQ warp (BackwardTraits::kDQWarp) of consumer warpgroup wg's blocks: each step, once the
// block is in shared memory, a TMA reduce-add into the float32 accumulator; the block is free
// again once the TMA has read it.
template <typename Traits, typename Storage>
__device__ __forceinline__ void send_dq_blocks(const BackwardParams<Traits>& P, Storage& st, int wg,
                                               const kernels::Seq& s, int b, int hk, int ib_first,
                                               int blocks_per_head, int n_steps) {
  using namespace cute;
  constexpr int kBM = Traits::kBM;
  const kernels::KernelParams& p = P.base;
  for (int n = 0; n < n_steps; ++n) {
    const int h = hk * p.group + n / blocks_per_head, i0 = (ib_first + n % blocks_per_head) * kBM;
    barrier(st.dq_full[wg]).wait(n & 1);
    send_dq_block(P, st.dq, wg, s.q_base, h, b, i0);
    tma_store_wait<0>();
    barrier(st.dq_empty[wg]).arrive();
  }
}

// The producer's one lane: K and V of key block jb once, then for each of the n_steps (query
// head, query block) steps Q and dO (with the bias tile, into the step's dS buffer) into the
// two-stage ring, each stage reused once every consumer warp has released it.
template <typename Traits, bool kBias, typename Storage, typename SmemQ, typename SmemKV, typename SmemDS>
__device__ __forceinline__ void backward_producer(const BackwardParams<Traits>& P, Storage& st, SmemQ& sQ, SmemQ& sO,
                                                  SmemKV& sK, SmemKV& sV, SmemDS& sDS, const kernels::Seq& s, int b,
                                                  int hk, int jb, int ib_first, int blocks_per_head, int n_steps) {
  using namespace cute;
  constexpr int kBM = Traits::kBM, kBN = Traits::kBN, kD = Traits::kD, kStages = Traits::kStages;
  const kernels::KernelParams& p = P.base;
  const int qb = p.cu_q != nullptr ? 0 : b;
  Tensor mQ = P.tma_q.get_tma_tensor(P.shape_q);
  Tensor mO = P.tma_dout.get_tma_tensor(P.shape_dout);
  Tensor mK = P.tma_k.get_tma_tensor(P.shape_k);
  Tensor mV = P.tma_v.get_tma_tensor(P.shape_v);
  {
    Tensor gK = head_tiles<kBN, kD>(mK, s.k_base, hk, qb, jb);
    Tensor gV = head_tiles<kBN, kD>(mV, s.k_base, hk, qb, jb);
    auto [tKg, tKs] = tma_partition(P.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVg, tVs] = tma_partition(P.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    tx_barrier(st.kv_full).arrive_and_expect_tx(2 * Traits::kKVBytes);
    copy(P.tma_k.with(st.kv_full), tKg, tKs);
    copy(P.tma_v.with(st.kv_full), tVg, tVs);
  }
  for (int n = 0; n < n_steps; ++n) {
    const int h = hk * p.group + n / blocks_per_head, ib = ib_first + n % blocks_per_head;
    const int stage = n % kStages, use = n / kStages;
    if (use > 0) barrier(st.q_empty[stage]).wait((use - 1) & 1);
    {
      Tensor gQ = head_tiles<kBM, kD>(mQ, s.q_base, h, qb, ib);
      Tensor gO = head_tiles<kBM, kD>(mO, s.q_base, h, qb, ib);
      auto [tQg, tQs] = tma_partition(P.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto [tOg, tOs] = tma_partition(P.tma_dout, _0{}, Layout<_1>{}, group_modes<0, 2>(sO), group_modes<0, 2>(gO));
      tx_barrier(st.q_full[stage]).arrive_and_expect_tx(2 * Traits::kQBytes + (kBias ? Traits::kBiasBytes : 0));
      copy(P.tma_q.with(st.q_full[stage]), tQg, tQs(_, stage));
      copy(P.tma_dout.with(st.q_full[stage]), tOg, tOs(_, stage));
      if constexpr (kBias)
        copy_bias_tile<kBM, kBN>(P.tma_bias, P.shape_bias, P.bias, h, b, ib, jb, sDS, stage, st.q_full[stage]);
    }
  }
}

// One step's P^T (what dV takes: the kept probabilities, scaled) and dS^T = P^T (dP^T - delta),
// dP^T masked and scaled as the forward's P was, from the S^T and dP^T accumulators into the
// A-operand registers of the dV and dK products (rounded to the input dtype). S^T element
// 4 c + 2 r + e: key jrow + 8 r, query i0 + 8 c + 2 t + e; lse and delta of the step's queries
// from buffer `buf`, the bias tile (kBias) from the dS buffer of stage `stage`.
template <typename Traits, bool kDropout, bool kBias, typename FragS, typename FragA, typename Storage, typename Keep>
__device__ __forceinline__ void backward_probabilities(FragS& tSrS, FragS& tSrDP, FragA& tKVrP, FragA& tKVrDS,
                                                       Storage& st, const kernels::KernelParams& p,
                                                       const kernels::MaskRule& rule, Keep keep, float mult0, int sq,
                                                       int i0, int j0, int jrow, int stage, int buf, int lane) {
  using namespace cute;
  using T = typename Traits::T;
  constexpr int kBM = Traits::kBM, kBN = Traits::kBN, kSCols = kBM / 8;
  const int warp = threadIdx.x / 32, t = lane % 4;
  // Queries every key of the block sees in full keep the raw scores and fold the scale into
  // the exponent's FMA; other blocks are scaled and masked per element.
  int blk_lo, blk_hi, unused_lo, unused_hi;
  rule.range(min(i0 + kBM, sq) - 1, blk_lo, unused_hi);
  rule.range(i0, unused_lo, blk_hi);
  const float* lse2 = st.lse2[buf];
  const float* delta = st.delta[buf];
  // P^T (what dV takes: the kept probabilities, scaled) and dS^T = P^T (dP^T - delta) with
  // dP^T masked and scaled as the forward's P was.
  auto apply_dropout = [&](int x, int bit, float prob, float dl) {
    if constexpr (kDropout) {
      // (one multiplier z = kept ? keep_scale : 0 and an FMA look cheaper, but make ptxas spill)
      const bool kept = (keep >> bit) & 1u;
      tSrS(x) = kept ? prob * p.keep_scale : 0.0f;
      tSrDP(x) = prob * ((kept ? tSrDP(x) * p.keep_scale : 0.0f) - dl);
    } else {
      tSrS(x) = prob;
      tSrDP(x) = prob * (tSrDP(x) - dl);
    }
  };
  if constexpr (kBias) {
    // logit = S scale log2(e) + bias log2(e). The bias fragment comes by ldmatrix.trans from the
    // (query, key) tile in S^T's accumulator layout: matrix m of an x4 is keys + 8 (m % 2),
    // queries + 8 (m / 2).
    const unsigned char* tile = reinterpret_cast<const unsigned char*>(st.ds) + stage * Traits::kBiasBytes;
    const int lm_key = warp * 16 + 8 * ((lane / 8) % 2);
    auto add_bias = [&](auto full) {
      constexpr bool kFull = decltype(full)::value;
#pragma unroll
      for (int cp = 0; cp < kSCols; cp += 2) {
        std::uint32_t w[4];
        kernels::ldsm_x4_trans(w, tile + sw128_offset<kBM>(8 * (cp + lane / 16) + lane % 8, lm_key));
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int c = cp + half, il = 8 * c + 2 * t + e;
            const float l2 = lse2[il], dl = delta[il];
            int lo = 0, hi = 0;
            if constexpr (!kFull) rule.range(i0 + il, lo, hi);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int x = 4 * c + 2 * r + e;
              const float2 bias = kernels::unpack2<T>(w[2 * half + r]);
              const float bias2 = (e ? bias.y : bias.x) * kernels::kLog2e;
              float prob;
              if constexpr (kFull) {
                prob = kernels::fast_exp2(fmaf(tSrS(x), mult0, bias2 - l2));
              } else {
                const int j = jrow + 8 * r;
                const float logit = (j >= lo && j < hi) ? fmaf(tSrS(x), mult0, bias2) : kernels::neg_inf();
                prob = kernels::fast_exp2(logit - l2);
              }
              apply_dropout(x, 4 * c + 2 * e + r, prob, dl);
            }
          }
      }
    };
    if (j0 >= blk_lo && j0 + kBN <= blk_hi) add_bias(std::true_type{});
    else add_bias(std::false_type{});
    __syncwarp();  // the warp's bias reads precede its dS writes over them
  } else if (j0 >= blk_lo && j0 + kBN <= blk_hi) {
#pragma unroll
    for (int c = 0; c < kSCols; ++c)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int il = 8 * c + 2 * t + e;
        const float l2 = lse2[il], dl = delta[il];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int x = 4 * c + 2 * r + e;
          const float prob = kernels::fast_exp2(fmaf(tSrS(x), mult0, -l2));
          apply_dropout(x, 4 * c + 2 * e + r, prob, dl);
        }
      }
  } else {
#pragma unroll
    for (int c = 0; c < kSCols; ++c)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int il = 8 * c + 2 * t + e;
        const float l2 = lse2[il], dl = delta[il];
        int lo, hi;
        rule.range(i0 + il, lo, hi);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int x = 4 * c + 2 * r + e, j = jrow + 8 * r;
          const float logit = (j >= lo && j < hi) ? tSrS(x) * mult0 : kernels::neg_inf();
          const float prob = kernels::fast_exp2(logit - l2);
          apply_dropout(x, 4 * c + 2 * e + r, prob, dl);
        }
      }
  }
  {
    std::uint32_t* pw = reinterpret_cast<std::uint32_t*>(raw_pointer_cast(tKVrP.data()));
    std::uint32_t* dw = reinterpret_cast<std::uint32_t*>(raw_pointer_cast(tKVrDS.data()));
#pragma unroll
    for (int i = 0; i < size(tSrS) / 2; ++i) {
      pw[i] = kernels::pack2<T>(tSrS(2 * i), tSrS(2 * i + 1));
      dw[i] = kernels::pack2<T>(tSrDP(2 * i), tSrDP(2 * i + 1));
    }
  }
}

// lse (log2 units) and delta of step n's query rows into buffer n & 1 (threads tid < kBM), one
// step ahead. (bench: attention backward D = 64, H200: issuing the loads here and storing them
// after the products' wait, or splitting them over both warpgroups, was 1-2% slower.)
template <typename Traits, typename Storage>
__device__ __forceinline__ void backward_row_scalars(const kernels::KernelParams& p, Storage& st,
                                                     const kernels::Seq& s, int b, int hk, int ib_first,
                                                     int blocks_per_head, int n_steps, int n, int tid) {
  constexpr int kBM = Traits::kBM;
  if (n >= n_steps || tid >= kBM) return;
  const int h = hk * p.group + n / blocks_per_head, i = (ib_first + n % blocks_per_head) * kBM + tid;
  float lse2 = kernels::pos_inf(), delta = 0.0f;
  if (i < s.sq) {
    const std::int64_t index = kernels::lse_index(p, s, b, h, i);
    const float lse = p.lse[index];
    // A fully masked row (lse = -inf) contributes nothing: P = exp(S - inf) = 0, never NaN.
    lse2 = lse == kernels::neg_inf() ? kernels::pos_inf() : lse * kernels::kLog2e;
    delta = p.delta[index];
  }
  st.lse2[n & 1][tid] = lse2;
  st.delta[n & 1][tid] = delta;
}

// The step's dQ part = dS K (issued, not waited for): dS^T into this step's buffer `buf` (the
// other one may still be read by the other warpgroup's dQ of the previous step), then both
// warpgroups meet before dQ reads both halves. With a bias, dbias = dS leaves that buffer by one
// thread's TMA store.
template <typename Traits, bool kBias, typename Storage, typename MmaQ, typename SmemDSt, typename FragDS,
          typename FragQDS, typename FragKt, typename FragDQ, typename SmemDS>
__device__ __forceinline__ void backward_dq_product(const BackwardParams<Traits>& P, Storage& st, MmaQ& mma_q,
                                                    SmemDSt& tSsDSt, FragDS& tKVrDS, FragQDS& tQrDS, FragKt& tQrKt,
                                                    FragDQ& tQrDQ, SmemDS& sDS, int h, int b, int ib, int jb, int buf,
                                                    bool dq_issuer) {
  using namespace cute;
  constexpr int kBM = Traits::kBM, kBN = Traits::kBN;
  const kernels::KernelParams& p = P.base;
  const int tid = threadIdx.x;
#pragma unroll
  for (int i = 0; i < size(tKVrDS); ++i) tSsDSt(i, _0{}, _0{}, buf) = tKVrDS(i);
  cutlass::arch::fence_view_async_shared();
  // (without the dQ warp) the dQ tile is free again once the previous step's reduce-add has
  // read it: its issuer waits here, and the barrier tells everyone
  if (dq_issuer) tma_store_wait<0>();
  asm volatile("bar.sync 1, %0;\n" ::"n"(Traits::kConsumerThreads));
  if constexpr (kBias) {
    if (tid == 0 && p.dbias_direct != 0) {  // dbias = dS: one thread sends the whole tile
      Tensor mDB = P.tma_dbias.get_tma_tensor(P.shape_dbias);
      Tensor gDB = local_tile(mDB(_, _, h, b), Shape<Int<kBM>, Int<kBN>>{}, make_coord(ib, jb));
      auto [tDBg, tDBs] =
          tma_partition(P.tma_dbias, _0{}, Layout<_1>{}, group_modes<0, 2>(sDS), group_modes<0, 2>(gDB));
      copy(P.tma_dbias, tDBs(_, buf), tDBg);
      tma_store_arrive();
    }
  }
  wgmma<true, false>(mma_q, tQrDS(_, _, _, buf), tQrKt, tQrDQ);
}

// This warpgroup's dQ block of step n into shared memory (once the previous step's has been read
// by its TMA), then added to the accumulator by a TMA reduce-add (the additions happen in L2),
// sent by the dQ warp or by one thread of the warpgroup (Traits::kDQWarp). Rows past the
// sequence's end hold exact zeros (their P is 0): adding them to the next sequence's rows
// (variable lengths) changes nothing; TMA clips what lies past the tensor.
template <typename Traits, typename Storage, typename SmemDQ, typename FragDQ>
__device__ __forceinline__ void write_dq_block(const BackwardParams<Traits>& P, Storage& st, SmemDQ& tQsDQ,
                                               FragDQ& tQrDQ, std::int64_t q_base, int h, int b, int i0, int n,
                                               bool dq_issuer) {
  using namespace cute;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wg = warp / 4;
  if constexpr (Traits::kDQWarp)
    if (n > 0) barrier(st.dq_empty[wg]).wait((n - 1) & 1);
#pragma unroll
  for (int i = 0; i < size(tQrDQ); ++i) tQsDQ(i) = tQrDQ(i);
  cutlass::arch::fence_view_async_shared();
  if constexpr (Traits::kDQWarp) {
    __syncwarp();
    if (lane == 0) barrier(st.dq_full[wg]).arrive();
  } else {
    asm volatile("bar.sync %0, 128;\n" ::"r"(3 + wg));
    if (dq_issuer) send_dq_block(P, st.dq, wg, q_base, h, b, i0);
  }
}

}  // namespace fusekit::attention::sm90
