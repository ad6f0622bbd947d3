// Attention forward for Hopper (sm_90a): warpgroup MMA (wgmma) on shared-memory operands, tiles
// brought in by TMA. Serves the common case at the speed the mma.sync kernel cannot reach:
// f16 / bf16, D = Dv = 64 or 128, scale > 0; every mask, window, variable lengths, dropout,
// grouped-query heads, and a bias in the input dtype with fixed lengths (attention_sm90_forward.cu
// decides; everything else stays on attention_kernels.cuh's forward_kernel, which defines the
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
#include <cutlass/numeric_types.h>

#include "attention/attention_kernels.cuh"

namespace fusekit::attention::sm90 {

template <typename T>
struct CuteElement;
template <>
struct CuteElement<__nv_bfloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CuteElement<__half> {
  using type = cutlass::half_t;
};

// The kernel's shapes, layouts and TMA types for one dtype and head dim.
template <typename T_, int kD_>
struct ForwardTraits {
  using T = T_;
  using Element = typename CuteElement<T>::type;
  static constexpr int kD = kD_, kBM = 128, kBN = 128, kStages = 2;
  static constexpr int kConsumerWarps = kBM / 16;  // 64 rows per warpgroup, 16 per warp
  static constexpr int kConsumerThreads = kConsumerWarps * 32;
  // + a producer warpgroup: one lane issues the copies. A whole warpgroup, because registers
  // move between warpgroups (setmaxnreg): the producer gives its registers to the consumers, whose
  // S and O accumulators need more than the 168 per thread an even split of 384 threads gives.
  static constexpr int kThreads = kConsumerThreads + 128;
  static constexpr int kProducerRegisters = 24, kConsumerRegisters = 240;

  using AtomLayout = cute::Layout<cute::Shape<cute::Int<kBM / 64>, cute::_1, cute::_1>>;
  using MmaQK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::Int<kBN>, cute::Int<kD>>>(),
      AtomLayout{}));
  using MmaPV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::Int<kD>, cute::Int<kBN>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      AtomLayout{}));

  // Rows of Q, K and V are kD elements (128 or 256 bytes): the 128-byte swizzle atom tiles them.
  using SmemAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBM>, cute::Int<kD>>{}));
  using SmemLayoutKV =
      decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBN>, cute::Int<kD>, cute::Int<kStages>>{}));
  // V seen as (d, key, stage): the B operand of O += P V, major in d. A view, not a copy.
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_ordered_layout(cute::Shape<cute::Int<kD>, cute::Int<kBN>, cute::Int<kStages>>{},
                                                cute::Step<cute::_2, cute::_1, cute::_3>{})));

  // Global q / k / v as (token, d, head, batch); with variable lengths the batch extent is 1 and
  // tokens are packed.
  using GmemShape = cute::Shape<std::int32_t, std::int32_t, std::int32_t, std::int32_t>;
  using GmemStride = cute::Stride<std::int64_t, cute::_1, std::int64_t, std::int64_t>;
  using GmemTensor = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)),
                                                cute::make_layout(GmemShape{}, GmemStride{})));
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{},
                                            cute::Shape<cute::Int<kBM>, cute::Int<kD>>{}, cute::_1{}));
  using TmaKV = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{},
                                             cute::take<0, 2>(SmemLayoutKV{}),
                                             cute::Shape<cute::Int<kBN>, cute::Int<kD>>{}, cute::_1{}));

  // The bias tile of a (query block, key block), in the input dtype: (query, key, stage), keys
  // contiguous, swizzled as Q is; it travels with K through K's ring.
  using SmemLayoutBias =
      decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBM>, cute::Int<kBN>, cute::Int<kStages>>{}));
  using TmaBias = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, cute::take<0, 2>(SmemLayoutBias{}),
                                               cute::Shape<cute::Int<kBM>, cute::Int<kBN>>{}, cute::_1{}));

  static constexpr std::uint32_t kQBytes = kBM * kD * sizeof(Element);
  static constexpr std::uint32_t kKVBytes = kBN * kD * sizeof(Element);
  static constexpr std::uint32_t kBiasBytes = kBM * kBN * sizeof(Element);

  template <bool kBias>
  struct SharedStorage {
    alignas(1024) Element q[cute::cosize_v<SmemLayoutQ>];
    alignas(1024) Element k[cute::cosize_v<SmemLayoutKV>];
    alignas(1024) Element v[cute::cosize_v<SmemLayoutKV>];
    alignas(1024) Element bias[kBias ? cute::cosize_v<SmemLayoutBias> : 8];
    alignas(8) std::uint64_t q_full;
    std::uint64_t k_full[kStages], v_full[kStages], k_empty[kStages], v_empty[kStages];
  };
  // + 1 KB so that the kernel can align the dynamic shared memory to the swizzle's 1024 bytes.
  template <bool kBias>
  static constexpr int smem_bytes() { return static_cast<int>(sizeof(SharedStorage<kBias>)) + 1024; }
};

// Where a kernel finds the bias (or dbias) of query head h, batch b in its TMA tensor
// (query, key, head, batch): a dimension the bias broadcasts has extent 1 there (TMA cannot step
// by 0), and its coordinate is always 0.
struct BiasCoords {
  int head_step = 0, batch_step = 0;  // 1: the dim is materialized, 0: broadcast
  __device__ __forceinline__ int head(int h) const { return h * head_step; }
  __device__ __forceinline__ int batch(int b) const { return b * batch_step; }
};

template <typename Traits>
struct ForwardParams {
  kernels::KernelParams base;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaKV tma_k, tma_v;
  typename Traits::GmemShape shape_q, shape_k, shape_v;
  typename Traits::TmaBias tma_bias;  // set only with a bias
  typename Traits::GmemShape shape_bias;
  BiasCoords bias;
};

using Barrier = cutlass::arch::ClusterBarrier;
using TxBarrier = cutlass::arch::ClusterTransactionBarrier;

__device__ __forceinline__ Barrier& barrier(std::uint64_t& b) { return *reinterpret_cast<Barrier*>(&b); }

// The kernel's shared storage at the dynamic shared memory aligned up to the 1024 bytes of the
// 128-byte swizzle pattern (smem_bytes() reserves the slack).
template <typename Storage>
__device__ __forceinline__ Storage& shared_storage() {
  extern __shared__ unsigned char smem_raw[];
  return *reinterpret_cast<Storage*>((reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) & ~std::uintptr_t{1023});
}
__device__ __forceinline__ TxBarrier& tx_barrier(std::uint64_t& b) { return *reinterpret_cast<TxBarrier*>(&b); }

// Output rows (o, dK, dV) leave the kernels through shared memory when every row of the operand
// starts on 16 bytes: then each global store is a whole 16-byte piece of a row, 8 x fewer store
// instructions than the 4-byte pairs the accumulators hold (H200, session 16: backward at D = 128
// 1.5-4.7% faster, D = 64 unchanged; the forward's figures at its use).
__device__ __forceinline__ bool rows_16b_aligned(const kernels::OperandArg& o) {
  return ((reinterpret_cast<std::uintptr_t>(o.data) | static_cast<std::uintptr_t>((o.b | o.s | o.h) * 2)) & 15) == 0;
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a staging tile of `kRows` rows laid out as
// the 128-byte swizzle lays out Q: column blocks of 64 elements (128 bytes) one after the other,
// rows of 128 bytes within a block, chunks XOR-swizzled by row % 8. The accumulators' 4-byte pairs
// (rows g and g + 8 of a warp's 16, chunk c) and the row-wise 16-byte reads are conflict-free.
template <int kRows>
__device__ __forceinline__ int staging_offset(int row, int chunk) {
  return (chunk / 8) * (kRows * 128) + row * 128 + 16 * ((chunk % 8) ^ (row % 8));
}

// The producer's TMA copy of bias tile (row_block, col_block) (kRows x kCols) of query head h,
// batch b into stage `stage` of `smem` (rows, cols, stage), completing on `full`.
template <int kRows, int kCols, typename Tma, typename GShape, typename SmemTensor>
__device__ __forceinline__ void copy_bias_tile(const Tma& tma, const GShape& shape, BiasCoords coords, int h, int b,
                                               int row_block, int col_block, SmemTensor& smem, int stage,
                                               std::uint64_t& full) {
  using namespace cute;
  Tensor m = tma.get_tma_tensor(shape);
  Tensor g = local_tile(m(_, _, coords.head(h), coords.batch(b)), Shape<Int<kRows>, Int<kCols>>{},
                        make_coord(row_block, col_block));
  auto [tg, ts] = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(smem), group_modes<0, 2>(g));
  copy(tma.with(full), tg, ts(_, stage));
}

// Byte offset of element (row, col) of a (kRows x N) 16-bit tile in the layout above
// (GMMA::Layout_K_SW128_Atom tiled down the rows, then across 64-column panels), col a multiple
// of 8: rows are 128 bytes within a panel, and the 16-byte chunk c of row r sits at chunk
// c ^ (r % 8) (the 128-byte swizzle TMA writes and wgmma reads; 1024-byte aligned tiles).
// ldmatrix takes these 16-byte row pieces directly.
template <int kRows>
__device__ __forceinline__ int sw128_offset(int row, int col) {
  return (col / 64) * (kRows * 128) + row * 128 + ((((col % 64) / 8) ^ (row % 8)) << 4);
}

// The (kRows x kD) tiles of one head of one sequence in a (token, d, head, batch) TMA tensor,
// tokens counted from the sequence's first (`base`, packed with variable lengths): block `block`
// of them, or all of them with block = cute::_ (indexed later by block).
template <int kRows, int kD, typename TmaTensor, typename Block>
__device__ __forceinline__ auto head_tiles(const TmaTensor& m, std::int64_t base, int head, int batch, Block block) {
  using namespace cute;
  return local_tile(domain_offset(make_coord(static_cast<int>(base), _0{}), m(_, _, head, batch)),
                    Shape<Int<kRows>, Int<kD>>{}, make_coord(block, _0{}));
}

// C (+)= A B over every k-block of the fragments, issued as one wgmma batch (not waited for).
// kRegisterA: A is a register fragment (fenced like C), not shared-memory descriptors.
template <bool kZeroInit, bool kRegisterA, typename Mma, typename FragA, typename FragB, typename FragC>
__device__ __forceinline__ void wgmma(Mma& mma, const FragA& a, const FragB& b, FragC& c) {
  using namespace cute;
  if constexpr (kRegisterA) warpgroup_fence_operand(const_cast<FragA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(a); ++kb) {
    cute::gemm(mma, a(_, _, kb), b(_, _, kb), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
  if constexpr (kRegisterA) warpgroup_fence_operand(const_cast<FragA&>(a));
}

// ---- dropout keep bits in the accumulator layouts ------------------------------------------------
//
// One philox::random4 call gives one byte: the keep bits of keys 8 m .. 8 m + 7 of one query (the
// mapping of attention_dropout_keeps, the one the mma.sync kernels and the CPU reference use). A
// byte's bits belong to several lanes of an accumulator, so every lane computes a share of the
// calls and the bytes are exchanged by shuffles: no call is made twice, nothing goes through
// shared memory, and the calls run while the tensor cores compute the step's scores.
__device__ __forceinline__ std::uint32_t keep_byte(const kernels::KernelParams& p, std::uint64_t subsequence, int i,
                                                   int key_group) {
  const philox::Words4 w =
      philox::random4(p.seed, subsequence, (static_cast<std::uint64_t>(i) << 29) + static_cast<std::uint64_t>(key_group));
  // Element e is half e % 2 of word e / 2 (dropout_random16_of_group); both halves of a word are
  // compared at once (per-halfword >=, 1 or 0), and the halves' bits folded into one byte.
  const std::uint32_t threshold2 = p.threshold * 0x10001u;  // threshold <= 0xFFFF in both halves
  const std::uint32_t v = __vsetgeu2(w.x, threshold2) | (__vsetgeu2(w.y, threshold2) << 2) |
                          (__vsetgeu2(w.z, threshold2) << 4) | (__vsetgeu2(w.w, threshold2) << 6);
  return (v | (v >> 15)) & 0xFFu;
}

// Forward, queries as rows: lane (g, t) holds rows row0 + 8 r and keys j0 + 8 c + 2 t + e of a
// 128-key block (c < 16). The byte of (r, c) is made by lane c % 4 of the quad, as byte c / 4 of
// its word for row r; words[r][s] is lane s's word, so the element's bit is
// (words[r][c % 4] >> (8 (c / 4) + 2 t + e)) & 1.
__device__ __forceinline__ void forward_keep_words(std::uint32_t (&words)[2][4], const kernels::KernelParams& p,
                                                   std::uint64_t subsequence, int row0, int j0, int lane) {
  const int t = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    std::uint32_t own = 0;
#pragma unroll
    for (int m = 0; m < 4; ++m) own |= keep_byte(p, subsequence, row0 + 8 * r, j0 / 8 + t + 4 * m) << (8 * m);
#pragma unroll
    for (int src = 0; src < 4; ++src) words[r][src] = __shfl_sync(0xffffffffu, own, (lane & ~3) | src);
  }
}

// Backward, keys as rows: lane (g, t) holds keys 8 key_group0 + g + 8 r and queries
// i0 + 8 c + 2 t + e. The byte of (query, r) has one bit for each of the 8 lanes g of that t; the
// kBM / 2 bytes of a t are made kBM / 16 per lane (call k = 4 c + 2 e + r by lane k / (kBM / 16))
// and transposed by shuffles: bit k of the result is the keep bit of the lane's element (r, c, e).
// The mask's type: 32 bits with 64 queries per step (the common case: no 64-bit shifts).
template <int kBM>
using KeepMask = std::conditional_t<(kBM / 2 <= 32), std::uint32_t, std::uint64_t>;

template <int kBM>
__device__ __forceinline__ KeepMask<kBM> backward_keep_mask(const kernels::KernelParams& p, std::uint64_t subsequence,
                                                            int i0, int key_group0, int lane) {
  constexpr int kCalls = kBM / 16, kWords = kCalls / 4;
  static_assert(kCalls % 4 == 0 && kBM / 2 <= 64, "calls pack into whole words, the mask into 64 bits");
  const int g = lane / 4, t = lane % 4;
  std::uint32_t own[kWords] = {};
#pragma unroll
  for (int m = 0; m < kCalls; ++m) {
    const int k = g * kCalls + m, c = k >> 2, e = (k >> 1) & 1, r = k & 1;
    own[m / 4] |= keep_byte(p, subsequence, i0 + 8 * c + 2 * t + e, key_group0 + r) << (8 * (m % 4));
  }
  KeepMask<kBM> mask = 0;
#pragma unroll
  for (int src = 0; src < 8; ++src)
#pragma unroll
    for (int wi = 0; wi < kWords; ++wi) {
      const std::uint32_t w = __shfl_sync(0xffffffffu, own[wi], src * 4 + t);
      // bit g of each of the word's four bytes, gathered into four bits (the product's bits
      // 24-27 are exactly those bytes' low bits; no other partial products reach them)
      const std::uint32_t four = (((w >> g) & 0x01010101u) * 0x01020408u) >> 24;
      mask |= static_cast<KeepMask<kBM>>(four) << (src * kCalls + 4 * wi);
    }
  return mask;
}

// kDropout: dropout on P (a compile-time switch, so that the common case pays nothing for it).
// kBias: an additive bias in the input dtype, its tiles brought by TMA with K's
// (attention_sm90_forward.cu decides which biases TMA can describe).
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
  const int i_block = gridDim.x - 1 - blockIdx.x, i0 = i_block * kBM;
  const kernels::Seq s = kernels::seq_of(p, b);
  if (i0 >= s.sq) return;  // the whole CTA, before any barrier exists
  const int hk = h / p.group;
  const kernels::MaskRule rule = kernels::mask_rule(p, s);
  int jb_begin, jb_end, all_lo, all_hi;
  rule.key_blocks<kBN>(i0, min(i0 + kBM, s.sq), jb_begin, jb_end, all_lo, all_hi);
  const int n_blocks = jb_end - jb_begin;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    tx_barrier(st.q_full).init(1);
    for (int i = 0; i < kStages; ++i) {
      tx_barrier(st.k_full[i]).init(1);
      tx_barrier(st.v_full[i]).init(1);
      barrier(st.k_empty[i]).init(Traits::kConsumerWarps);
      barrier(st.v_empty[i]).init(Traits::kConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(st.q), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(st.k), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(st.v), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(st.v), typename Traits::SmemLayoutVt{});
  Tensor sBias = make_tensor(make_smem_ptr(st.bias), typename Traits::SmemLayoutBias{});

  if (warp >= Traits::kConsumerWarps) {
    // ---- producer: one lane issues every copy ----
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if (warp == Traits::kConsumerWarps && lane == 0 && n_blocks > 0) {
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

    float mult = mult0;
    const bool every_key_visible = j0 >= all_lo && j0 + kBN <= all_hi;
    if constexpr (kBias) {
      // logits (log2 units) = S scale log2(e) + bias log2(e), masked per element unless every
      // key of the block is visible to every row. The bias fragment comes by ldmatrix in S's
      // accumulator layout: matrix m of an x4 is rows + 8 (m % 2), columns + 8 (m / 2).
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
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = kernels::neg_inf();
#pragma unroll
      for (int c = 0; c < kSCols; ++c) mx = fmaxf(mx, fmaxf(tSrS(4 * c + 2 * r), tSrS(4 * c + 2 * r + 1)));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[r], mx * mult);
      const float m_use = m_new == kernels::neg_inf() ? 0.0f : m_new;  // nothing visible yet
      const float alpha = kernels::fast_exp2(m[r] - m_use);             // 0 when m = -inf
      m[r] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < kSCols; ++c)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = tSrS(4 * c + 2 * r + e);
          x = kernels::fast_exp2(fmaf(x, mult, -m_use));
          sum += x;
        }
      l[r] = l[r] * alpha + sum;
#pragma unroll
      for (int c = 0; c < kOCols; ++c) {
        tOrO(4 * c + 2 * r) *= alpha;
        tOrO(4 * c + 2 * r + 1) *= alpha;
      }
    }
    if constexpr (kDropout) {
      // the row sums above count every probability; O sums the kept ones (scaled at the end)
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

    tx_barrier(st.v_full[stage]).wait(phase);
    wgmma<false, true>(mma_pv, tOrP, tOrV(_, _, _, stage), tOrO);
    warpgroup_wait<0>();
    __syncwarp();
    if (lane == 0) barrier(st.v_empty[stage]).arrive();
  }

  // O: through this warpgroup's own rows of the Q tile when rows are 16-byte aligned (its last
  // product that reads them is done; staging_offset lays rows out where Q's layout has them). At
  // D = 128 only: forward 2-5% faster there, 1.5-4% slower at D = 64 (H200, session 16).
  const bool staged = kD == 128 && rows_16b_aligned(p.out);
  unsigned char* const staging = reinterpret_cast<unsigned char*>(st.q);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = l[r] + __shfl_xor_sync(0xffffffffu, l[r], 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int i = row0 + 8 * r;
    const float inv = sum > 0.0f ? (kDropout ? p.keep_scale : 1.0f) / sum : 0.0f;
    if (staged) {
#pragma unroll
      for (int c = 0; c < kOCols; ++c)
        *reinterpret_cast<std::uint32_t*>(staging + staging_offset<kBM>(warp * 16 + g + 8 * r, c) + 4 * t) =
            kernels::pack2<T>(tOrO(4 * c + 2 * r) * inv, tOrO(4 * c + 2 * r + 1) * inv);
    }
    if (i < s.sq) {
      if (!staged) {
        T* out = kernels::row_ptr<T>(p.out, b, s.q_base + i, h);
#pragma unroll
        for (int c = 0; c < kOCols; ++c)
          *reinterpret_cast<std::uint32_t*>(out + 8 * c + 2 * t) =
              kernels::pack2<T>(tOrO(4 * c + 2 * r) * inv, tOrO(4 * c + 2 * r + 1) * inv);
      }
      if (t == 0)
        p.lse[kernels::lse_index(p, s, b, h, i)] = sum > 0.0f ? m[r] * kernels::kLn2 + logf(sum) : kernels::neg_inf();
    }
  }
  if (staged) {
    const int wg = warp / 4;
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg));  // the warpgroup's rows are staged
    constexpr int kChunks = 64 * kD / 8;                 // per warpgroup
#pragma unroll
    for (int x = tid % 128; x < kChunks; x += 128) {
      const int row = 64 * wg + x / (kD / 8), chunk = x % (kD / 8), i = i0 + row;
      if (i < s.sq)
        *reinterpret_cast<uint4*>(kernels::row_ptr<T>(p.out, b, s.q_base + i, h) + 8 * chunk) =
            *reinterpret_cast<const uint4*>(staging + staging_offset<kBM>(row, chunk));
    }
  }
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
template <typename T_, int kD_>
struct BackwardTraits {
  using T = T_;
  using Element = typename CuteElement<T>::type;
  // 64 queries per step at D = 128 (register budget: dK and dV take 128 per thread); 128 at
  // D = 64, where the step's matrix products would otherwise be too small to keep wgmma busy.
  static constexpr int kD = kD_, kBN = 128, kBM = kD == 64 ? 128 : 64, kStages = 2;
  static constexpr int kConsumerWarps = kBN / 16;
  static constexpr int kConsumerThreads = kConsumerWarps * 32;
  static constexpr int kThreads = kConsumerThreads + 128;
  static constexpr int kProducerRegisters = 24, kConsumerRegisters = 240;

  template <int M, int N, int K>
  using Tile = cute::Shape<cute::Int<M>, cute::Int<N>, cute::Int<K>>;
  using KeysAtoms = cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>;   // warpgroups along the keys
  using HeadDimAtoms = cute::Layout<cute::Shape<cute::_1, cute::_2, cute::_1>>;  // along the head dim
  using MmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, Tile<64, kBM, kD>>(), KeysAtoms{}));
  using MmaKV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, Tile<64, kD, kBM>, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      KeysAtoms{}));
  // dQ part (kBM x kD) over the 128 keys: with 128 queries each warpgroup takes 64 of them, with
  // 64 queries each takes half of the head dim.
  static constexpr bool kDQSplitsQueries = kBM == 128;
  // Who sends a warpgroup's dQ block to the accumulator. At D = 128 a warp of the producer
  // warpgroup (the consumers only write the block and arrive on an mbarrier): backward 2-5%
  // faster than one consumer thread per warpgroup issuing it after a 128-thread barrier (H200,
  // session 15; bias + dbias 2133 -> 2066 us). At D = 64 that was 0.6-1.2% slower (the waiting
  // warps take issue slots from consumers that are busier there): the consumer thread stays.
  static constexpr bool kDQWarp = !kDQSplitsQueries;
  static constexpr int kDQCols = kDQSplitsQueries ? kD : kD / 2;  // per warpgroup
  using MmaQ = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, Tile<64, kDQCols, kBN>, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      std::conditional_t<kDQSplitsQueries, KeysAtoms, HeadDimAtoms>{}));

  using SmemAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutKV = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBN>, cute::Int<kD>>{}));
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutKV{},
      cute::make_ordered_layout(cute::Shape<cute::Int<kD>, cute::Int<kBN>>{}, cute::Step<cute::_2, cute::_1>{})));
  using SmemLayoutQ =
      decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBM>, cute::Int<kD>, cute::Int<kStages>>{}));
  using SmemLayoutQt = decltype(cute::composition(
      SmemLayoutQ{}, cute::make_ordered_layout(cute::Shape<cute::Int<kD>, cute::Int<kBM>, cute::Int<kStages>>{},
                                               cute::Step<cute::_2, cute::_1, cute::_3>{})));
  // dS as (query, key, buffer), keys contiguous: the K-major A operand of dQ = dS K; written
  // through its transposed view (key, query, buffer) from the S^T accumulators.
  using SmemLayoutDS =
      decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBM>, cute::Int<kBN>, cute::_2>{}));
  using SmemLayoutDSt = decltype(cute::composition(
      SmemLayoutDS{}, cute::make_ordered_layout(cute::Shape<cute::Int<kBN>, cute::Int<kBM>, cute::_2>{},
                                                cute::Step<cute::_2, cute::_1, cute::_3>{})));

  // A step's dQ part, float32, as two 64 x 64 blocks, one per warpgroup (its queries or its half
  // of the head dim), each 128-byte swizzled (conflict-free stores from the accumulator) and
  // added to the float32 accumulator in global memory by one TMA reduce-add.
  using SmemLayoutDQBlock = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<float>{},
                                                         cute::Shape<cute::_64, cute::_64>{}));
  using SmemLayoutDQ = decltype(cute::tile_to_shape(SmemLayoutDQBlock{}, cute::Shape<cute::Int<kBM>, cute::Int<kD>>{}));
  static_assert(kDQSplitsQueries ? kBM == 128 && kD == 64 : kBM == 64 && kD == 128, "two 64 x 64 dQ blocks");

  using GmemShape = typename ForwardTraits<T, kD>::GmemShape;
  using GmemTensor = typename ForwardTraits<T, kD>::GmemTensor;
  using GmemTensorDQ = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<float*>(nullptr)),
                                                  cute::make_layout(GmemShape{}, typename ForwardTraits<T, kD>::GmemStride{})));
  using TmaDQ = decltype(cute::make_tma_copy(cute::SM90_TMA_REDUCE_ADD{}, GmemTensorDQ{}, SmemLayoutDQBlock{},
                                             cute::Shape<cute::_64, cute::_64>{}, cute::_1{}));
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, cute::take<0, 2>(SmemLayoutQ{}),
                                            cute::Shape<cute::Int<kBM>, cute::Int<kD>>{}, cute::_1{}));
  using TmaKV = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutKV{},
                                             cute::Shape<cute::Int<kBN>, cute::Int<kD>>{}, cute::_1{}));
  // The bias tile of a step lands in the dS buffer of that step (same shape and layout; each
  // warp reads the bias of its 16 keys before it writes their dS over it), and dbias leaves from
  // there once dS is complete.
  using GmemTensorOut = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<Element*>(nullptr)),
                                                   cute::make_layout(GmemShape{}, typename ForwardTraits<T, kD>::GmemStride{})));
  using TmaBias = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, cute::take<0, 2>(SmemLayoutDS{}),
                                               cute::Shape<cute::Int<kBM>, cute::Int<kBN>>{}, cute::_1{}));
  using TmaDbias = decltype(cute::make_tma_copy(cute::SM90_TMA_STORE{}, GmemTensorOut{}, cute::take<0, 2>(SmemLayoutDS{}),
                                                cute::Shape<cute::Int<kBM>, cute::Int<kBN>>{}, cute::_1{}));

  static constexpr std::uint32_t kQBytes = kBM * kD * sizeof(Element);
  static constexpr std::uint32_t kKVBytes = kBN * kD * sizeof(Element);
  static constexpr std::uint32_t kBiasBytes = kBM * kBN * sizeof(Element);

  struct SharedStorage {
    alignas(1024) Element k[cute::cosize_v<SmemLayoutKV>];
    alignas(1024) Element v[cute::cosize_v<SmemLayoutKV>];
    alignas(1024) Element q[cute::cosize_v<SmemLayoutQ>];
    alignas(1024) Element dout[cute::cosize_v<SmemLayoutQ>];
    alignas(1024) Element ds[cute::cosize_v<SmemLayoutDS>];
    alignas(1024) float dq[cute::cosize_v<SmemLayoutDQ>];
    float lse2[kStages][kBM], delta[kStages][kBM];  // lse in log2 units (+inf: the row sees nothing)
    alignas(8) std::uint64_t kv_full;
    std::uint64_t q_full[kStages], q_empty[kStages];
    std::uint64_t dq_full[2], dq_empty[2];  // a warpgroup's dQ block written / read by its TMA
  };
  static constexpr int smem_bytes() { return static_cast<int>(sizeof(SharedStorage)) + 1024; }
};

template <typename Traits>
struct BackwardParams {
  kernels::KernelParams base;
  typename Traits::TmaQ tma_q, tma_dout;
  typename Traits::TmaKV tma_k, tma_v;
  typename Traits::GmemShape shape_q, shape_dout, shape_k, shape_v;
  typename Traits::TmaBias tma_bias;    // set only with a bias
  typename Traits::TmaDbias tma_dbias;  // set only with dbias (p.dbias_direct)
  typename Traits::GmemShape shape_bias, shape_dbias;
  BiasCoords bias;
  int cta_group;  // (kv head, batch) pairs per group of CTAs (dkdv_block_of)
  typename Traits::TmaDQ tma_dq;  // set only in the atomic-dQ mode: p.dq_accum as (token, d, head, batch)
  typename Traits::GmemShape shape_dq;
};

// The (batch, kv head, key block) of a dK / dV CTA: CTAs come in groups of `group_size` (kv head,
// batch) pairs, key-block major within a group. Under a causal mask the first key blocks are the
// heaviest (they see every query): each group starts with them and ends with light ones, which
// fill the grid's last wave. The launcher sizes the groups so that a group's Q and dO (read by
// each of its key blocks) stay in L2; 1 without a mask (the key blocks of a pair adjacent).
__device__ __forceinline__ void dkdv_block_of(const kernels::KernelParams& p, int block_keys, int group_size, int cta,
                                              int& b, int& hk, int& jb) {
  const int key_blocks = (p.seqlen_k + block_keys - 1) / block_keys, pairs = p.heads_kv * p.batch;
  const int group = cta / (group_size * key_blocks), in_group = cta % (group_size * key_blocks);
  const int group_pairs = min(group_size, pairs - group * group_size);
  jb = in_group / group_pairs;
  const int pair = group * group_size + in_group % group_pairs;
  hk = pair % p.heads_kv;
  b = pair / p.heads_kv;
}

// Warpgroup wg's 64 x 64 dQ block of the step (query rows from i0, head h, batch b) from the shared
// tile to the float32 accumulator: one TMA reduce-add, committed as a bulk group of the calling
// thread (which waits for it before the tile is written again).
template <typename Traits>
__device__ __forceinline__ void send_dq_block(const BackwardParams<Traits>& P, float* tile, int wg,
                                              std::int64_t q_base, int h, int b, int i0) {
  using namespace cute;
  Tensor sBlock = make_tensor(make_smem_ptr(tile + wg * 64 * 64), typename Traits::SmemLayoutDQBlock{});
  Tensor mDQ = P.tma_dq.get_tma_tensor(P.shape_dq);
  Tensor gDQ = local_tile(domain_offset(make_coord(static_cast<int>(q_base), _0{}), mDQ(_, _, h, P.base.cu_q != nullptr ? 0 : b)),
                          Shape<_64, _64>{},
                          make_coord(i0 / 64 + (Traits::kDQSplitsQueries ? wg : 0), Traits::kDQSplitsQueries ? 0 : wg));
  auto [tg, ts] = tma_partition(P.tma_dq, _0{}, Layout<_1>{}, group_modes<0, 2>(sBlock), group_modes<0, 2>(gDQ));
  copy(P.tma_dq, ts, tg);
  tma_store_arrive();
}

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
        for (int n = 0; n < n_steps; ++n) {
          const int h = hk * p.group + n / blocks_per_head, i0 = (ib_first + n % blocks_per_head) * kBM;
          barrier(st.dq_full[wg]).wait(n & 1);
          send_dq_block(P, st.dq, wg, s.q_base, h, b, i0);
          tma_store_wait<0>();
          barrier(st.dq_empty[wg]).arrive();
        }
        return;
      }
    }
    if (warp != Traits::kConsumerWarps || lane != 0 || n_steps == 0) return;
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
  const int g = lane / 4, t = lane % 4;
  const int jrow = j0 + warp * 16 + g;  // the thread's key of r = 0
  const float mult0 = p.scale_log2;
  const bool want_dk = p.want_dk != 0, want_dv = p.want_dv != 0;
  constexpr bool want_dq = kAtomicDQ;
  // without the dQ warp: one thread per warpgroup sends its dQ block
  const bool dq_issuer = want_dq && !Traits::kDQWarp && tid % 128 == 0;

  // lse (log2 units) and delta of step n's query rows, into buffer n & 1 (threads tid < kBM).
  // (Issuing the loads here and storing them after the products' wait, or splitting them over
  // both warpgroups, was 1-2% slower at D = 64: H200, session 17.)
  auto load_row_scalars = [&](int n) {
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
  };
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
  load_row_scalars(0);
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
    load_row_scalars(n + 1);  // its load latency runs under the matrix products
    const KeepMask<kBM> keep = keep_next;
    warpgroup_wait<0>();

    // Queries every key of the block sees in full keep the raw scores and fold the scale into
    // the exponent's FMA; other blocks are scaled and masked per element.
    int blk_lo, blk_hi, unused_lo, unused_hi;
    rule.range(min(i0 + kBM, s.sq) - 1, blk_lo, unused_hi);
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
    // dV first: it needs nothing from the other warpgroup, and the dS^T stores and the barrier
    // run under it. Then dQ and dK; the dQ block is sent under dK.
    if (want_dv) wgmma<false, true>(mma_kv, tKVrP, tKVrOt(_, _, _, stage), tKVrDV);
    if constexpr (want_dq) {
      // dS^T into this step's buffer (the other one may still be read by the other warpgroup's
      // dQ of the previous step), then both warpgroups meet before dQ reads both halves.
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
    if (want_dk) {
      wgmma<false, true>(mma_kv, tKVrDS, tKVrQt(_, _, _, stage), tKVrDK);
      warpgroup_wait<1>();  // dV and dQ are done (batches complete in order); dK runs on
    } else {
      warpgroup_wait<0>();
    }

    if constexpr (want_dq) {
      // This warpgroup's dQ block into shared memory (once the previous step's has been read by
      // its TMA), then added to the accumulator by a TMA reduce-add (the additions happen in L2),
      // sent by the dQ warp or by one thread of the warpgroup (Traits::kDQWarp). Rows past the
      // sequence's end hold exact zeros (their P is 0): adding them to the next sequence's rows
      // (variable lengths) changes nothing; TMA clips what lies past the tensor.
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
        if (dq_issuer) send_dq_block(P, st.dq, wg, s.q_base, h, b, i0);
      }
    }
    if constexpr (kDropout) keep_next = make_keep(n + 1);
    warpgroup_wait<0>();
    // the next use of this stage's dS buffer (a bias tile) waits for dbias to have left it (without
    // the dQ warp the same thread's dQ reduce-add, committed after it, may run on)
    if constexpr (kBias)
      if (tid == 0 && p.dbias_direct != 0) tma_store_wait<Traits::kDQWarp ? 0 : 1>();
    __syncwarp();
    if (lane == 0) barrier(st.q_empty[stage]).arrive();
  }

  // dK and dV rows: key g + 8 r of the warp's 16, column 8 c + 2 t + e (element 4 c + 2 r + e).
  // With 16-byte aligned rows they are staged in the Q and dO stages (free once both warpgroups
  // are past their last products: a barrier), then stored a 16-byte piece of a row at a time.
  if ((!want_dk || rows_16b_aligned(p.grad_k)) && (!want_dv || rows_16b_aligned(p.grad_v))) {
    static_assert(sizeof(st.q) >= kBN * kD * sizeof(Element) && sizeof(st.dout) >= kBN * kD * sizeof(Element));
    unsigned char* const dk_tile = reinterpret_cast<unsigned char*>(st.q);
    unsigned char* const dv_tile = reinterpret_cast<unsigned char*>(st.dout);
    asm volatile("bar.sync 1, %0;\n" ::"n"(Traits::kConsumerThreads));  // Q and dO are read for the last time
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp * 16 + g + 8 * r;
#pragma unroll
      for (int c = 0; c < kDCols; ++c) {
        *reinterpret_cast<std::uint32_t*>(dk_tile + staging_offset<kBN>(row, c) + 4 * t) =
            kernels::pack2<T>(tKVrDK(4 * c + 2 * r) * p.scale, tKVrDK(4 * c + 2 * r + 1) * p.scale);
        *reinterpret_cast<std::uint32_t*>(dv_tile + staging_offset<kBN>(row, c) + 4 * t) =
            kernels::pack2<T>(tKVrDV(4 * c + 2 * r), tKVrDV(4 * c + 2 * r + 1));
      }
    }
    asm volatile("bar.sync 1, %0;\n" ::"n"(Traits::kConsumerThreads));
    // one tile after the other (each a compile-time pointer: no array in local memory)
    auto store_rows = [&](const unsigned char* tile, const kernels::OperandArg& grad) {
      constexpr int kChunks = kBN * kD / 8;  // 16-byte chunks per tile
      static_assert(kChunks % Traits::kConsumerThreads == 0, "whole passes");
#pragma unroll
      for (int x = tid; x < kChunks; x += Traits::kConsumerThreads) {
        const int row = x / (kD / 8), chunk = x % (kD / 8), j = j0 + row;
        if (j < s.sk)
          *reinterpret_cast<uint4*>(kernels::row_ptr<T>(grad, b, s.k_base + j, hk) + 8 * chunk) =
              *reinterpret_cast<const uint4*>(tile + staging_offset<kBN>(row, chunk));
      }
    };
    if (want_dk) store_rows(dk_tile, p.grad_k);
    if (want_dv) store_rows(dv_tile, p.grad_v);
  } else {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int j = jrow + 8 * r;
      if (j >= s.sk) continue;
#pragma unroll
      for (int c = 0; c < kDCols; ++c) {
        const int col = 8 * c + 2 * t;
        if (want_dk)
          *reinterpret_cast<std::uint32_t*>(kernels::row_ptr<T>(p.grad_k, b, s.k_base + j, hk) + col) =
              kernels::pack2<T>(tKVrDK(4 * c + 2 * r) * p.scale, tKVrDK(4 * c + 2 * r + 1) * p.scale);
        if (want_dv)
          *reinterpret_cast<std::uint32_t*>(kernels::row_ptr<T>(p.grad_v, b, s.k_base + j, hk) + col) =
              kernels::pack2<T>(tKVrDV(4 * c + 2 * r), tKVrDV(4 * c + 2 * r + 1));
      }
    }
  }
  // The last dQ block must be read by its TMA before shared memory goes; waited for only here,
  // so that the epilogue above runs under it (the staging uses the Q / dO stages, not the dQ
  // tile), instead of every consumer warp waiting for it at the epilogue's first barrier, where
  // ncu sampled ~2% of the D = 64 kernel's stalls. H200, session 17: D = 64 S = 1024 causal
  // backward 1010 -> 970 us, D = 128 S = 1024 2%, bias + dbias 2077 -> 2050 us.
  if (dq_issuer) tma_store_wait<0>();
#endif
}

}  // namespace fusekit::attention::sm90
