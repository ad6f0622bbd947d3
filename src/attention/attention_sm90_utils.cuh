// Device helpers of the Hopper attention kernels: mbarriers, the aligned shared storage, the
// 128-byte swizzle's offsets, TMA tiles of one head, and one wgmma batch.
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

#include "attention/attention_params.h"
#include "attention/attention_sm90_traits.cuh"

namespace fusekit::attention::sm90 {

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
// instructions than the 4-byte pairs the accumulators hold (bench: attention backward, H200:
// D = 128 1.5-4.7% faster, D = 64 unchanged; the forward's figures at forward_epilogue).
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

}  // namespace fusekit::attention::sm90
