// The Hopper attention kernels' types: per dtype and head dim the tile shapes, shared-memory
// layouts, wgmma atoms, TMA copy types and shared storage (ForwardTraits, BackwardTraits), and the
// kernels' parameters (the mma.sync KernelParams plus the TMA descriptors).
#pragma once

#include <cute/tensor.hpp>  // first: the atom headers below need its declarations
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include <cstdint>
#include <type_traits>

#include "attention/attention_params.h"

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

// The backward dK / dV kernel's types (the kernel: attention_sm90_kernels.cuh).
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
  // warpgroup (the consumers only write the block and arrive on an mbarrier): 2-5% faster than
  // one consumer thread per warpgroup issuing it after a 128-thread barrier (bench: attention
  // backward D = 128, H200). At D = 64 that was 0.6-1.2% slower (the waiting warps take issue
  // slots from consumers that are busier there): the consumer thread stays.
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

}  // namespace fusekit::attention::sm90
