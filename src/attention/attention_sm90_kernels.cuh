// Attention forward and dK / dV backward for Hopper (sm_90a): warpgroup MMA (wgmma) on
// shared-memory operands, tiles brought in by TMA. The kernels here; their types in
// attention_sm90_traits.cuh, their pieces in attention_sm90_mainloop_fwd.cuh / _bwd.cuh,
// attention_sm90_epilogue.cuh and attention_sm90_scheduler.cuh.
//
// The forward serves the common case at the speed the mma.sync kernel cannot reach:
// f16 / bf16, D = Dv = 64 or 128, scale > 0; every mask, window, variable lengths, dropout,
// grouped-query heads, and a bias in the input dtype with fixed lengths (attention_config.cpp
// decides; everything else stays on attention_mma_kernels.cuh's forward_kernel, which defines the
// same outputs). A bias tile (128 queries x 128 keys) comes by TMA with each K tile, through K's
// ring, and is added to the scores in registers (read by ldmatrix in the accumulator layout).
//
// One CTA per (block of 128 query rows, query head, batch); 384 threads:
//   two consumer warpgroups (warps 0-7), each owning 64 query rows, and a producer warpgroup
//   (warps 8-11) that hands most of its registers to the consumers and whose first lane issues
//   the TMA copies. Q is copied once; K and V tiles of 128 keys go
//   through a two-stage ring each, guarded by mbarriers: "full" (the TMA's transaction count,
//   the consumers wait on it) and "empty" (one arrive per consumer warp once its wgmma has read
//   the stage, the producer waits on it before reusing the slot).
// Per key block a consumer warpgroup computes S = Q K^T (wgmma, A and B from shared memory, the
//   64 x 128 float accumulator in registers), the online softmax on S in registers (as the
//   mma.sync kernel does: blocks every row sees in full fold the scale into the exponent's FMA,
//   others are scaled and masked per element), zeroes the dropped probabilities (keep bits made
//   under the S product, see forward_keep_words), rounds P to the input dtype in registers, and
//   accumulates O += P V (wgmma with A from registers, B = V read transposed from its shared
//   tile, which the 128-byte swizzle allows without a copy). The accumulator of S has the
//   register layout of wgmma's A operand element for element (the m64nNk16 C layout per 8
//   columns is the A layout per half k-step), so P needs no shuffle.
// Key blocks are walked from the last to the first: under a causal mask the diagonal (masked)
//   block comes first, while the ring fills.
// Rows past a sequence end (the tile's tail, or with variable lengths the next sequence's
//   tokens) are computed and not stored; keys past the end are masked to -inf. TMA zero-fills
//   what lies outside the tensor.
#pragma once

#include <cute/tensor.hpp>  // first: the atom headers below need its declarations
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <cstdint>

#include "attention/attention_device.cuh"
#include "attention/attention_dropout.cuh"
#include "attention/attention_mask.cuh"
#include "attention/attention_params.h"
#include "attention/attention_sm90_epilogue.cuh"
#include "attention/attention_sm90_mainloop_bwd.cuh"
#include "attention/attention_sm90_mainloop_fwd.cuh"
#include "attention/attention_sm90_scheduler.cuh"
#include "attention/attention_sm90_traits.cuh"
#include "attention/attention_sm90_utils.cuh"
#include "attention/attention_softmax.cuh"

namespace fusekit::attention::sm90 {

// kDropout: dropout on P (a compile-time switch, so that the common case pays nothing for it).
// kBias: an additive bias in the input dtype, its tiles brought by TMA with K's
// (attention_config.cpp decides which biases TMA can describe).
template <typename Traits, bool kDropout, bool kBias>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    forward_kernel(const __grid_constant__ ForwardParams<Traits> P) {
#if defined(__CUDA_ARCH__) && defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  using namespace cute;
  using T = typename Traits::T;
  using Element = typename Traits::Element;
  constexpr int kBM = Traits::kBM, kBN = Traits::kBN, kD = Traits::kD, kStages = Traits::kStages;
  using Storage = typename Traits::template SharedStorage<kBias>;
  const kernels::KernelParams& p = P.base;

  Storage& st = shared_storage<Storage>();

  const int b = blockIdx.z, h = blockIdx.y;
  const int i_block = forward_query_block(), i0 = i_block * kBM;
  const kernels::Seq s = kernels::seq_of(p, b);
  if (i0 >= s.sq) return;  // the whole CTA, before any barrier exists
  const int hk = h / p.group;
  const kernels::MaskRule rule = kernels::mask_rule(p, s);
  // jb_end declared first: with the pieces below inlined, this order gives the PTX of 14ac103's
  // single-body kernel (the other order swaps the two phis' virtual registers, and ptxas then
  // schedules the D = 128 bias kernels differently).
  int jb_end, jb_begin, all_lo, all_hi;
  rule.key_blocks<kBN>(i0, min(i0 + kBM, s.sq), jb_begin, jb_end, all_lo, all_hi);
  const int n_blocks = jb_end - jb_begin;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  forward_init_barriers<Traits>(st);

  Tensor sQ = make_tensor(make_smem_ptr(st.q), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(st.k), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(st.v), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(st.v), typename Traits::SmemLayoutVt{});
  Tensor sBias = make_tensor(make_smem_ptr(st.bias), typename Traits::SmemLayoutBias{});

  if (warp >= Traits::kConsumerWarps) {
    // ---- producer: one lane issues every copy ----
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if (warp == Traits::kConsumerWarps && lane == 0 && n_blocks > 0)
      forward_producer<Traits, kBias>(P, st, sQ, sK, sV, sBias, s, b, h, hk, i_block, jb_end, n_blocks);
    return;
  }

  // ---- consumers ----
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
  const int tid = threadIdx.x;
  typename Traits::MmaQK mma_qk;
  typename Traits::MmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tid);
  auto thr_pv = mma_pv.get_thread_slice(tid);
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // descriptors
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (mma, n, k, stage)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (mma, n, k, stage)
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBM>, Int<kBN>>{});
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBM>, Int<kD>>{});
  Tensor tOrP = make_tensor<Element>(partition_shape_A(mma_pv, Shape<Int<kBM>, Int<kBN>>{}));
  static_assert(size(tSrS) == size(tOrP), "P takes S's registers one for one");
  constexpr int kSCols = kBN / 8, kOCols = kD / 8;  // 8-column groups of S and O per thread
  static_assert(size(tSrS) == 4 * kSCols && size(tOrO) == 4 * kOCols, "m64nNk16 accumulator layout");
  static_assert(kSCols == 16, "forward_keep_words covers 128-key blocks");
  clear(tOrO);

  // Accumulator element 4 c + 2 r + e: row g + 8 r of the warp's 16, column 8 c + 2 t + e.
  const int g = lane / 4, t = lane % 4;
  const int row0 = i0 + warp * 16 + g;
  const float mult0 = p.scale_log2;
  float m[2] = {kernels::neg_inf(), kernels::neg_inf()}, l[2] = {0.0f, 0.0f};
  const std::uint64_t subsequence = kDropout ? attention_dropout_subsequence(p.offset, b, h, p.heads_q) : 0;

  if (n_blocks > 0) tx_barrier(st.q_full).wait(0);
  for (int n = 0; n < n_blocks; ++n) {
    const int jb = jb_end - 1 - n, j0 = jb * kBN, stage = n % kStages, phase = (n / kStages) & 1;
    tx_barrier(st.k_full[stage]).wait(phase);
    wgmma<true, false>(mma_qk, tSrQ, tSrK(_, _, _, stage), tSrS);
    std::uint32_t keep[2][4];
    if constexpr (kDropout) forward_keep_words(keep, p, subsequence, row0, j0, lane);  // under the wgmma
    warpgroup_wait<0>();
    __syncwarp();
    if (!kBias && lane == 0) barrier(st.k_empty[stage]).arrive();  // with a bias: once it is read

    const float mult =
        forward_logits<Traits, kBias>(tSrS, st, rule, stage, row0, j0, all_lo, all_hi, mult0, warp, lane, t);
#pragma unroll
    for (int r = 0; r < 2; ++r)
      kernels::online_softmax_row<kSCols, kOCols>([&](int c, int e) -> float& { return tSrS(4 * c + 2 * r + e); },
                                                  [&](int c, int e) -> float& { return tOrO(4 * c + 2 * r + e); },
                                                  m[r], l[r], mult);
    forward_probabilities<Traits, kDropout>(tSrS, tOrP, keep, t);

    tx_barrier(st.v_full[stage]).wait(phase);
    wgmma<false, true>(mma_pv, tOrP, tOrV(_, _, _, stage), tOrO);
    warpgroup_wait<0>();
    __syncwarp();
    if (lane == 0) barrier(st.v_empty[stage]).arrive();
  }

  forward_epilogue<Traits, kDropout>(p, st, tOrO, m, l, s, b, h, i0, row0, warp, g, t, tid);
#endif
}

// ---- backward: dK, dV (and the dQ parts) ---------------------------------------------------------
//
// One CTA per (block of 128 keys, kv head, batch); 384 threads as in the forward: two consumer
// warpgroups owning 64 keys each, a producer warpgroup. K and V are copied once; the CTA walks
// every query head of its GQA group and every block of 64 queries that sees its keys (one
// interval of blocks), with Q and dO through a two-stage ring of TMA copies (issued by the
// producer's first lane) and the rows' lse and delta loaded by the consumers one step ahead into a
// double buffer (a barrier of the consumer warpgroups per step orders its reuse). Per query
// block a consumer warpgroup computes, with the keys as the M dimension,
//   S^T = K Q^T and dP^T = V dO^T   (wgmma, both operands in shared memory),
//   P^T = exp(S^T scale - lse), dS^T = P^T (dP^T - delta)   (registers),
//   dV += P^T dO and dK += dS^T Q    (wgmma with A from registers: the accumulator layout of S^T
//                                     is the A layout, as in the forward; B = Q or dO read
//                                     transposed from its shared tile),
// and, when dQ goes through the float32 accumulator (the non-deterministic mode), stores dS^T to
// shared memory (double-buffered) so that after a barrier of both warpgroups
//   dQ part = dS K                   (wgmma, both operands in shared memory; each warpgroup takes
//                                     half of the head dim over all 128 keys)
// is added to the accumulator by a TMA reduce-add of a shared tile (sent at D = 128 by two
// otherwise idle warps of the producer warpgroup, BackwardTraits::kDQWarp). dK and dV are summed over the group's
// heads inside the CTA in a fixed order (deterministic in both modes) and every key row is written.
// With a bias (atomic-dQ mode only) the step's bias tile comes by TMA with Q and dO into the
// step's dS buffer, is read by ldmatrix.trans in S^T's layout and overwritten by dS, which is dbias:
// one thread sends the finished tile to dbias by a TMA store. CTAs are ordered by dkdv_block_of.
//
// kAtomicDQ: the dQ parts go to the float32 accumulator (p.atomic_dq). A compile-time switch: with
// a run-time one, ptxas serializes every wgmma of the kernel (C7514) and spills.
// kDropout as in the forward. kBias: an additive bias in the input dtype, and dbias (written
// from the dS tile by TMA) when p.dbias_direct; needs kAtomicDQ, whose dS tile it uses.
template <typename Traits, bool kAtomicDQ, bool kDropout, bool kBias>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    dkdv_kernel(const __grid_constant__ BackwardParams<Traits> P) {
  static_assert(!kBias || kAtomicDQ, "the bias tiles use the dS buffers of the dQ product");
#if defined(__CUDA_ARCH__) && defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  using namespace cute;
  using T = typename Traits::T;
  using Element = typename Traits::Element;
  constexpr int kBM = Traits::kBM, kBN = Traits::kBN, kD = Traits::kD, kStages = Traits::kStages;
  using Storage = typename Traits::SharedStorage;
  const kernels::KernelParams& p = P.base;

  Storage& st = shared_storage<Storage>();

  int b, hk, jb;
  dkdv_block_of(p, kBN, P.cta_group, blockIdx.x, b, hk, jb);
  const int j0 = jb * kBN;
  const kernels::Seq s = kernels::seq_of(p, b);
  if (j0 >= s.sk) return;
  const int j1 = min(j0 + kBN, s.sk);
  const kernels::MaskRule rule = kernels::mask_rule(p, s);
  int ib_first, ib_last;
  rule.query_blocks<kBM>(j0, j1, ib_first, ib_last);
  const int blocks_per_head = ib_last >= ib_first ? ib_last - ib_first + 1 : 0;
  const int n_steps = blocks_per_head * p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  backward_init_barriers<Traits>(st);

  Tensor sK = make_tensor(make_smem_ptr(st.k), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(st.v), typename Traits::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(st.k), typename Traits::SmemLayoutKt{});
  Tensor sQ = make_tensor(make_smem_ptr(st.q), typename Traits::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(st.q), typename Traits::SmemLayoutQt{});
  Tensor sO = make_tensor(make_smem_ptr(st.dout), typename Traits::SmemLayoutQ{});
  Tensor sOt = make_tensor(make_smem_ptr(st.dout), typename Traits::SmemLayoutQt{});
  Tensor sDS = make_tensor(make_smem_ptr(st.ds), typename Traits::SmemLayoutDS{});
  Tensor sDSt = make_tensor(make_smem_ptr(st.ds), typename Traits::SmemLayoutDSt{});
  Tensor sDQ = make_tensor(make_smem_ptr(st.dq), typename Traits::SmemLayoutDQ{});

  if (warp >= Traits::kConsumerWarps) {
    // ---- producer ----
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if constexpr (kAtomicDQ && Traits::kDQWarp) {
      // Warps 1 and 2 of the producer warpgroup send the two consumer warpgroups' dQ blocks: each
      // step, once the block is in shared memory, a TMA reduce-add into the float32 accumulator
      // (the additions happen in L2); the block is free again once the TMA has read it. The
      // consumers neither wait for each other nor issue the copy.
      const int wg = warp - Traits::kConsumerWarps - 1;
      if ((wg == 0 || wg == 1) && lane == 0) {
        send_dq_blocks(P, st, wg, s, b, hk, ib_first, blocks_per_head, n_steps);
        return;
      }
    }
    if (warp != Traits::kConsumerWarps || lane != 0 || n_steps == 0) return;
    backward_producer<Traits, kBias>(P, st, sQ, sO, sK, sV, sDS, s, b, hk, jb, ib_first, blocks_per_head, n_steps);
    return;
  }

  // ---- consumers ----
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
  const int tid = threadIdx.x;
  typename Traits::MmaSdP mma_sdp;
  typename Traits::MmaKV mma_kv;
  typename Traits::MmaQ mma_q;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_kv = mma_kv.get_thread_slice(tid);
  auto thr_q = mma_q.get_thread_slice(tid);
  Tensor tSrK = thr_sdp.partition_fragment_A(sK);   // this warpgroup's 64 keys
  Tensor tSrV = thr_sdp.partition_fragment_A(sV);
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);   // (mma, n, k, stage)
  Tensor tSrO = thr_sdp.partition_fragment_B(sO);
  Tensor tKVrQt = thr_kv.partition_fragment_B(sQt);  // (mma, n, k, stage)
  Tensor tKVrOt = thr_kv.partition_fragment_B(sOt);
  Tensor tQrDS = thr_q.partition_fragment_A(sDS);    // (mma, m, k, buffer)
  Tensor tQrKt = thr_q.partition_fragment_B(sKt);
  Tensor tSsDSt = thr_sdp.partition_C(sDSt);         // where this thread's dS^T elements go
  Tensor tQsDQ = thr_q.partition_C(sDQ);             // where this thread's dQ elements go
  Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBN>, Int<kBM>>{});
  Tensor tSrDP = partition_fragment_C(mma_sdp, Shape<Int<kBN>, Int<kBM>>{});
  Tensor tKVrDK = partition_fragment_C(mma_kv, Shape<Int<kBN>, Int<kD>>{});
  Tensor tKVrDV = partition_fragment_C(mma_kv, Shape<Int<kBN>, Int<kD>>{});
  Tensor tQrDQ = partition_fragment_C(mma_q, Shape<Int<kBM>, Int<kD>>{});
  Tensor tKVrP = make_tensor<Element>(partition_shape_A(mma_kv, Shape<Int<kBN>, Int<kBM>>{}));
  Tensor tKVrDS = make_tensor<Element>(partition_shape_A(mma_kv, Shape<Int<kBN>, Int<kBM>>{}));
  constexpr int kSCols = kBM / 8, kDCols = kD / 8;
  static_assert(size(tSrS) == 4 * kSCols && size(tKVrP) == size(tSrS), "m64nNk16 accumulator layout");
  static_assert(size(tKVrDK) == 4 * kDCols && size(tQrDQ) == Traits::kDQCols / 2, "dK / dQ accumulator layouts");
  clear(tKVrDK);
  clear(tKVrDV);

  // S^T element 4 c + 2 r + e: key g + 8 r of the warp's 16, query 8 c + 2 t + e of the block.
  const int g = lane / 4;
  const int jrow = j0 + warp * 16 + g;  // the thread's key of r = 0
  const float mult0 = p.scale_log2;
  const bool want_dk = p.want_dk != 0, want_dv = p.want_dv != 0;
  constexpr bool want_dq = kAtomicDQ;
  // without the dQ warp: one thread per warpgroup sends its dQ block
  const bool dq_issuer = want_dq && !Traits::kDQWarp && tid % 128 == 0;

  // Dropout keep bits of step n (bit 4 c + 2 e + r: element (r, c, e) is kept), made one step
  // ahead, under the previous step's dK product after the dQ block is written, where only dK, dV and
  // dS^T are live. Measured against the alternatives: under the step's own S^T and dP^T
  // products the calls cost 3% more at D = 128 (and at D = 64 ptxas runs out of registers and
  // serializes wgmma); half under the dV product, half here, 2.6% more.
  auto make_keep = [&](int n) -> KeepMask<kBM> {
    if (!kDropout || n >= n_steps) return 0;
    const int h = hk * p.group + n / blocks_per_head, i0 = (ib_first + n % blocks_per_head) * kBM;
    return backward_keep_mask<kBM>(p, attention_dropout_subsequence(p.offset, b, h, p.heads_q), i0,
                                   (j0 + 16 * warp) / 8, lane);
  };
  KeepMask<kBM> keep_next = make_keep(0);
  backward_row_scalars<Traits>(p, st, s, b, hk, ib_first, blocks_per_head, n_steps, 0, tid);
  asm volatile("bar.sync 2, %0;\n" ::"n"(Traits::kConsumerThreads));
  if (n_steps > 0) tx_barrier(st.kv_full).wait(0);
  for (int n = 0; n < n_steps; ++n) {
    const int h = hk * p.group + n / blocks_per_head, ib = ib_first + n % blocks_per_head, i0 = ib * kBM;
    const int stage = n % kStages, phase = (n / kStages) & 1, buf = n & 1;
    // Buffer (n + 1) & 1 is written during step n, before a barrier of both consumer warpgroups
    // that step n + 1's reads follow: with dQ that is the dS barrier of step n (and the last reads
    // of that buffer, step n - 1's, precede the dS barrier of step n - 1); without dQ a barrier
    // at the top of each step.
    if constexpr (!want_dq) asm volatile("bar.sync 2, %0;\n" ::"n"(Traits::kConsumerThreads));
    tx_barrier(st.q_full[stage]).wait(phase);
    wgmma<true, false>(mma_sdp, tSrK, tSrQ(_, _, _, stage), tSrS);
    wgmma<true, false>(mma_sdp, tSrV, tSrO(_, _, _, stage), tSrDP);
    // the next step's lse and delta: their load latency runs under the matrix products
    backward_row_scalars<Traits>(p, st, s, b, hk, ib_first, blocks_per_head, n_steps, n + 1, tid);
    const KeepMask<kBM> keep = keep_next;
    warpgroup_wait<0>();

    backward_probabilities<Traits, kDropout, kBias>(tSrS, tSrDP, tKVrP, tKVrDS, st, p, rule, keep, mult0, s.sq, i0,
                                                     j0, jrow, stage, buf, lane);
    // dV first: it needs nothing from the other warpgroup, and the dS^T stores and the barrier
    // run under it. Then dQ and dK; the dQ block is sent under dK.
    if (want_dv) wgmma<false, true>(mma_kv, tKVrP, tKVrOt(_, _, _, stage), tKVrDV);
    if constexpr (want_dq)
      backward_dq_product<Traits, kBias>(P, st, mma_q, tSsDSt, tKVrDS, tQrDS, tQrKt, tQrDQ, sDS, h, b, ib, jb, buf,
                                         dq_issuer);
    if (want_dk) {
      wgmma<false, true>(mma_kv, tKVrDS, tKVrQt(_, _, _, stage), tKVrDK);
      warpgroup_wait<1>();  // dV and dQ are done (batches complete in order); dK runs on
    } else {
      warpgroup_wait<0>();
    }

    if constexpr (want_dq) write_dq_block<Traits>(P, st, tQsDQ, tQrDQ, s.q_base, h, b, i0, n, dq_issuer);
    if constexpr (kDropout) keep_next = make_keep(n + 1);
    warpgroup_wait<0>();
    // the next use of this stage's dS buffer (a bias tile) waits for dbias to have left it (without
    // the dQ warp the same thread's dQ reduce-add, committed after it, may run on)
    if constexpr (kBias)
      if (tid == 0 && p.dbias_direct != 0) tma_store_wait<Traits::kDQWarp ? 0 : 1>();
    __syncwarp();
    if (lane == 0) barrier(st.q_empty[stage]).arrive();
  }

  backward_epilogue<Traits>(p, st, tKVrDK, tKVrDV, s, b, hk, j0, jrow, want_dk, want_dv, tid);
  // The last dQ block must be read by its TMA before shared memory goes; waited for only here,
  // so that the epilogue above runs under it (the staging uses the Q / dO stages, not the dQ
  // tile), instead of every consumer warp waiting for it at the epilogue's first barrier, where
  // ncu sampled ~2% of the D = 64 kernel's stalls (bench: attention backward causal S = 1024,
  // H200: D = 64 4% faster, D = 128 2%, with bias and dbias 1.3%).
  if (dq_issuer) tma_store_wait<0>();
#endif
}

}  // namespace fusekit::attention::sm90
