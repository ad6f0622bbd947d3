// The Hopper attention kernels' epilogues: the forward's O and lse, the backward's dK and dV
// rows, and the backward's dQ blocks sent to the float32 accumulator by a TMA reduce-add.
#pragma once

#include <cute/tensor.hpp>  // first: the atom headers below need its declarations
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>

#include <cstdint>

#include "attention/attention_device.cuh"
#include "attention/attention_lse.cuh"
#include "attention/attention_mask.cuh"
#include "attention/attention_params.h"
#include "attention/attention_sm90_traits.cuh"
#include "attention/attention_sm90_utils.cuh"

namespace fusekit::attention::sm90 {

// The forward's outputs of one consumer thread: its rows row0 and row0 + 8 of O (divided by the
// row sum, times 1 / (1 - p) with dropout) and their lse = max + log(sum) (a row with sum 0:
// out = 0, lse = -inf). Accumulator element 4 c + 2 r + e: row g + 8 r of the warp's 16, column
// 8 c + 2 t + e.
template <typename Traits, bool kDropout, typename Storage, typename FragO>
__device__ __forceinline__ void forward_epilogue(const kernels::KernelParams& p, Storage& st, FragO& tOrO,
                                                 const float (&m)[2], const float (&l)[2], const kernels::Seq& s,
                                                 int b, int h, int i0, int row0, int warp, int g, int t,
                                                 int tid) {
  using T = typename Traits::T;
  constexpr int kBM = Traits::kBM, kD = Traits::kD, kOCols = kD / 8;
  // O: through this warpgroup's own rows of the Q tile when rows are 16-byte aligned (its last
  // product that reads them is done; staging_offset lays rows out where Q's layout has them). At
  // D = 128 only (bench: attention forward D = 128, H200: 2-5% faster; D = 64: 1.5-4% slower).
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
}

// The backward's dK (times the scale) and dV rows of one consumer thread: key g + 8 r of the
// warp's 16 at jrow + 8 r, column 8 c + 2 t + e (element 4 c + 2 r + e).
template <typename Traits, typename Storage, typename FragDK, typename FragDV>
__device__ __forceinline__ void backward_epilogue(const kernels::KernelParams& p, Storage& st, FragDK& tKVrDK,
                                                  FragDV& tKVrDV, const kernels::Seq& s, int b, int hk, int j0,
                                                  int jrow, bool want_dk, bool want_dv, int tid) {
  using T = typename Traits::T;
  using Element = typename Traits::Element;
  constexpr int kBN = Traits::kBN, kD = Traits::kD, kDCols = kD / 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
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

}  // namespace fusekit::attention::sm90
