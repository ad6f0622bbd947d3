// LayerNorm / RMSNorm CUDA kernels.
//
// Two families:
//  * Register-resident ("row in registers"): a group of TPR threads owns one row at a time and
//    holds it in registers as ITERS vectors of VEC elements per thread, so each element is read
//    from memory once and written once. Used when the row is 16-byte aligned and fits.
//  * Generic: one block per row, re-reading the row from L1/L2 between passes. Any N up to
//    65536 and any alignment; correctness path, not the tuned one.
//
// Backward kernels run on a persistent grid: each block walks rows and accumulates its own
// dweight/dbias partial sums in registers, writes one partial row per block (or per cluster of
// blocks, summed through distributed shared memory) to the workspace, and a second small kernel
// sums the partials over blocks in a fixed order (deterministic).
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/device_vector.cuh"
#include "norm/norm_config.h"
#include "norm/norm_params.h"

namespace fusekit::norm::kernels {

// Element conversions and 16-byte vectors: core/device_vector.cuh.
using detail::device::from_float;
using detail::device::load4_floats;
using detail::device::load_floats;
using detail::device::LoadPath;
using detail::device::pack16;
using detail::device::to_float;
using detail::device::unpack16;

// Per-column floats in shared memory, laid out by quarter-vector: the 4 columns at 4u go to
// float4 slot (u % (VEC / 4)) * (cols / VEC) + u / (VEC / 4), so that the threads of a warp,
// reading consecutive VEC-column vectors, read consecutive 16-byte slots (a plain layout gives
// 8-column vectors a 32-byte stride across threads: 2-way bank conflicts on every load).
template <int VEC>
__device__ __forceinline__ int column_slot(int unit, int cols) {
  constexpr int kQuads = VEC / 4;
  return (unit % kQuads) * (cols / VEC) + unit / kQuads;
}
// The VEC floats of the vector starting at column `col` (a multiple of VEC).
template <int VEC>
__device__ __forceinline__ void load_shared_columns(const float* base, int cols, int col, float (&out)[VEC]) {
  const float4* slots = reinterpret_cast<const float4*>(base);
#pragma unroll
  for (int c = 0; c < VEC / 4; ++c) {
    const float4 v = slots[c * (cols / VEC) + col / VEC];
    out[4 * c] = v.x;
    out[4 * c + 1] = v.y;
    out[4 * c + 2] = v.z;
    out[4 * c + 3] = v.w;
  }
}

// ---- a row's partial last vector (rows whose N is not a multiple of the vector) -------------------
// Only the row's elements are touched, one element access each: nothing past N is read or written.

// The first `count` (0 < count < 16 / sizeof(T)) elements at p (16-byte aligned) as a vector
// whose further elements are zero bits (0.0 in every float type).
template <typename T>
__device__ __forceinline__ uint4 load_partial16(const T* p, int count) {
  using Bits = std::conditional_t<sizeof(T) == 2, unsigned short, unsigned>;
  constexpr int kVec = 16 / sizeof(T);
  const Bits* src = reinterpret_cast<const Bits*>(p);
  Bits e[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) e[i] = i < count ? src[i] : Bits(0);
  return detail::device::bit_copy<uint4>(e);
}
// Stores the first `count` elements of the vector `v` at p.
template <typename T>
__device__ __forceinline__ void store_partial16(T* p, const uint4 v, int count) {
  using Bits = std::conditional_t<sizeof(T) == 2, unsigned short, unsigned>;
  constexpr int kVec = 16 / sizeof(T);
  Bits* dst = reinterpret_cast<Bits*>(p);
  Bits e[kVec];
  memcpy(e, &v, sizeof(e));
#pragma unroll
  for (int i = 0; i < kVec; ++i)
    if (i < count) dst[i] = e[i];
}
// VEC per-column parameters at p as floats, `fill` past the first `count`.
template <typename W, int VEC>
__device__ __forceinline__ void load_partial_floats(const W* p, int count, float fill, float (&out)[VEC]) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = i < count ? to_float(p[i]) : fill;
}

// Bulk copies (TMA, sm_90) into shared memory with mbarrier completion: core/device_vector.cuh.
// One thread moves a whole row with one instruction: the other threads spend nothing on addresses
// or copy issue.
using detail::device::bulk_copy_to_shared;
using detail::device::bulk_prefetch_l2;
using detail::device::mbarrier_arrive;
using detail::device::mbarrier_arrive_expect_tx;
using detail::device::mbarrier_init;
using detail::device::mbarrier_init_fence;
using detail::device::mbarrier_wait;
using detail::device::shared_address;

// The launch shape (RowGeometry), the kernel variants and their limits: norm_config.h.

// Row groups of one block synchronize on their own hardware barriers (group_barrier), so that
// they never wait on each other's reductions.
using detail::device::group_barrier;

// A thread's place in its row group, computed once per kernel (the divisions by a run-time
// group size cost ~40 instructions per call otherwise).
struct RowTeam {
  int tpr;          // threads per row (a multiple of 32)
  int warp_in_row;  // this thread's warp within the row group
  int barrier_id;   // hardware barrier of the row group (1 + group index)
  __device__ RowTeam(int threads_per_row, int group, int t)
      : tpr(threads_per_row), warp_in_row(t / 32), barrier_id(1 + group) {}
};

// Sums K values over the `tpr` threads of a row group; every thread gets the total. The shuffle
// butterfly gives all lanes bitwise-identical sums, and the cross-warp step adds warps in index
// order, so the result does not depend on timing. `scratch` holds (tpr / 32) * K floats for this
// row group and must not be reused before the group's next barrier (callers alternate buffers).
// Contains the row group's barrier when tpr > 32: every thread of the group must call it.
// kGroupBarrier: synchronize only the row group (backward: several groups per block that must not
// wait on each other) or the whole block with __syncthreads (forward: a block whose kernel names
// no other barrier keeps full occupancy, while a run-time barrier id makes the compiler reserve
// barriers and caps resident blocks).
template <int K, bool kGroupBarrier>
__device__ __forceinline__ void row_allreduce(float (&v)[K], float* scratch, const RowTeam& team) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], offset);
  }
  if (team.tpr > 32) {
    if (threadIdx.x % 32 == 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) scratch[team.warp_in_row * K + k] = v[k];
    }
    if constexpr (kGroupBarrier) {
      group_barrier(team.barrier_id, team.tpr);
    } else {
      __syncthreads();
    }
    const int warps = team.tpr / 32;
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = scratch[k];
#pragma unroll 1
    for (int w = 1; w < warps; ++w) {
#pragma unroll
      for (int k = 0; k < K; ++k) v[k] += scratch[w * K + k];
    }
  }
}

inline constexpr int kMaxWarpsPerBlock = 32;

// ---------------------------------------------------------------------------------------------
// Forward, row in registers. A group of threads_per_row threads owns one row at a time: each
// thread loads ITERS 16-byte vectors (all loads in flight together) and keeps them packed (4
// registers per vector), unpacking in each of its two passes. Latency is hidden by many
// resident blocks (the grid covers all rows; a block takes further rows only when the grid is
// capped) and, for rows longer than a warp, by asking L2 for the next wave's rows (choose_forward_launch).
//
// LayerNorm's statistics come from one reduction of (sum d, sum d^2) with d = x - K, K the row's
// first element: var = E[d^2] - E[d]^2. Any element of the row lies within sqrt(N) standard
// deviations of the mean, so the cancellation costs at most log2(N) / 2 bits of the float
// mantissa (typically none) and a barrier round per row is saved over the two-pass form.
//
// ROWS (ForwardRows) fixes at compile time what the common calls share: rows that fill every
// thread's ITERS vectors, with the usual affine parameters. Then the per-vector bounds tests, the
// weight / bias presence tests and the kind test go away. Those rows load the weight of the second
// pass before the row reduction, so that its latency runs under it (LayerNorm's bias stays after
// the reduction: both held across it cost more registers than the early load saves).
//
// RESIDUAL: the row is round(x + residual) in T, formed as the row is loaded (the float sum of two
// T values rounded once to T is the correctly rounded sum, as the CPU reference's) and written to
// p.sum, when given, beside y.
//
// TAIL: N is not a multiple of kVec. The row's last vector is partial: its elements past N are
// loaded as zeros (one element load each, nothing past N read), set to the shift K for
// LayerNorm's sums so that they add exactly 0, and never stored. Without TAIL none of that code
// exists.
inline constexpr int kForwardMinBlocks = 2;
template <typename T, typename W, int ITERS, ForwardRows ROWS, bool RESIDUAL, bool TAIL = false>
__global__ void __launch_bounds__(512, kForwardMinBlocks)
    forward_registers_kernel(ForwardParams p, RowGeometry geo) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr bool kFull = ROWS != ForwardRows::any;  // cols == threads_per_row * ITERS * kVec, weight given
  static_assert(!(kFull && TAIL), "full rows have no partial vector");
  // Weights in the input's type only (one 16-byte load per vector): float32 weights of 16-bit
  // inputs would hold twice the registers.
  constexpr bool kEarlyWeight = kFull && kVec * sizeof(W) == 16;
  constexpr int kWChunks = kVec * sizeof(W) / 16;  // 16-byte weight loads per vector
  __shared__ float scratch[2][kMaxWarpsPerBlock * 2];
  const int tpr = geo.threads_per_row, rpb = geo.rows_per_block;
  // One row per block (the default launch) needs no division.
  const int group = rpb == 1 ? 0 : threadIdx.x / tpr, t = threadIdx.x - group * tpr;
  const RowTeam team(tpr, group, t);
  const bool layer_norm = kFull ? ROWS == ForwardRows::full_layer_norm : p.kind == Kind::layer_norm;
  const int cols = static_cast<int>(p.cols);
  const float inv_cols = __frcp_rn(static_cast<float>(cols));  // = 1.0f / cols, correctly rounded
  const W* __restrict__ weight = static_cast<const W*>(p.weight);
  const W* __restrict__ bias = static_cast<const W*>(p.bias);
  const bool has_weight = kFull || weight != nullptr;
  const bool has_bias = kFull ? ROWS == ForwardRows::full_layer_norm : bias != nullptr;
  const int step = tpr * kVec;  // elements between a thread's vectors
  const int col0 = t * kVec;
  // Vectors past the row end (only the last may be) hold zeros and are skipped by the passes.
  auto in_row = [&](int it) { return kFull || col0 + it * step < cols; };
  // Elements of the row in vector `it` (kVec for every vector but a TAIL row's last).
  auto count_in_row = [&](int it) { return TAIL ? min(kVec, cols - (col0 + it * step)) : kVec; };
  auto partial = [&](int it) { return TAIL && col0 + it * step + kVec > cols; };
  // A vector of a row tensor at `at` (a vector's first column).
  auto load_vector = [&](const T* at, int it) {
    if (partial(it)) return load_partial16<T>(at, count_in_row(it));
    return *reinterpret_cast<const uint4*>(at);
  };
  auto store_vector = [&](T* at, int it, const uint4 v) {
    if (partial(it)) store_partial16<T>(at, v, count_in_row(it));
    else *reinterpret_cast<uint4*>(at) = v;
  };
  // kVec weights or biases of vector `it` as floats (`fill` past N).
  auto load_params = [&](const W* at, int it, float fill, float (&out)[kVec]) {
    if (partial(it)) load_partial_floats<W, kVec>(at, count_in_row(it), fill, out);
    else load_floats<W, kVec, LoadPath::read_only>(at, out);
  };
  int phase = 0;

  // A row's 16-byte vectors (zeros past the row end or for rows past the last) and, for
  // LayerNorm, its first element (the shift of the one-pass variance), kept in the storage type:
  // converting it here would make the thread wait for the load at once.
  auto load_row = [&](std::int64_t row, uint4 (&raw)[ITERS], T& shift_raw) {
    const bool valid_row = row < p.rows;
    const T* __restrict__ x = static_cast<const T*>(p.x) + row * p.x_row_stride;
    shift_raw = T(0.0f);
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      raw[it] = make_uint4(0, 0, 0, 0);
      if (valid_row && in_row(it)) raw[it] = load_vector(x + col0 + it * step, it);
    }
    if constexpr (RESIDUAL) {
      const T* __restrict__ res = static_cast<const T*>(p.residual) + row * p.residual_row_stride;
      uint4 res_raw[ITERS];
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        res_raw[it] = make_uint4(0, 0, 0, 0);
        if (valid_row && in_row(it)) res_raw[it] = load_vector(res + col0 + it * step, it);
      }
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        float a[kVec], b[kVec];
        unpack16<T>(raw[it], a);
        unpack16<T>(res_raw[it], b);
#pragma unroll
        for (int i = 0; i < kVec; ++i) a[i] += b[i];
        raw[it] = pack16<T>(a);
      }
      if (layer_norm && valid_row) shift_raw = from_float<T>(to_float(x[0]) + to_float(res[0]));
    } else {
      if (layer_norm && valid_row) shift_raw = x[0];
    }
  };
  const std::int64_t base_step = std::int64_t(gridDim.x) * rpb;
  for (std::int64_t base = std::int64_t(blockIdx.x) * rpb; base < p.rows; base += base_step) {
    const std::int64_t row = base + group;
    const bool valid_row = row < p.rows;
    uint4 raw[ITERS];
    T shift_raw;
    load_row(row, raw, shift_raw);
    // The row the block taking this slot in the next wave will read, so that its loads find L2
    // (choose_forward_launch says where that pays).
    if (geo.l2_prefetch_rows > 0 && row + geo.l2_prefetch_rows < p.rows) {
      const T* ahead = static_cast<const T*>(p.x) + (row + geo.l2_prefetch_rows) * p.x_row_stride + col0;
#pragma unroll
      for (int it = 0; it < ITERS; ++it)
        if (in_row(it)) detail::device::prefetch_l2(ahead + it * step);
      if constexpr (RESIDUAL) {
        const T* res_ahead =
            static_cast<const T*>(p.residual) + (row + geo.l2_prefetch_rows) * p.residual_row_stride + col0;
#pragma unroll
        for (int it = 0; it < ITERS; ++it)
          if (in_row(it)) detail::device::prefetch_l2(res_ahead + it * step);
      }
    }
    const float shift_k = to_float(shift_raw);
    float s[ITERS], q[ITERS];
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      s[it] = q[it] = 0.0f;
      if (!in_row(it)) continue;
      float v[kVec];
      unpack16<T>(raw[it], v);
      if (layer_norm) {
        if (partial(it)) {
          // Past N, d = 0 exactly.
#pragma unroll
          for (int i = 0; i < kVec; ++i)
            if (i >= count_in_row(it)) v[i] = shift_k;
        }
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const float d = v[i] - shift_k;
          s[it] += d;
          q[it] = fmaf(d, d, q[it]);
        }
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) q[it] = fmaf(v[i], v[i], q[it]);
      }
    }
    float sums[2] = {s[0], q[0]};
#pragma unroll
    for (int it = 1; it < ITERS; ++it) {
      sums[0] += s[it];
      sums[1] += q[it];
    }
    [[maybe_unused]] uint4 w_raw[kEarlyWeight ? ITERS : 1][kWChunks];
    if constexpr (kEarlyWeight) {
#pragma unroll
      for (int it = 0; it < ITERS; ++it)
#pragma unroll
        for (int c = 0; c < kWChunks; ++c) w_raw[it][c] = __ldg(reinterpret_cast<const uint4*>(weight + col0 + it * step) + c);
    }
    float* my_scratch = &scratch[phase][group * (tpr / 32) * 2];
    phase ^= 1;
    float mean = 0.0f, rstd;
    if (layer_norm) {
      row_allreduce<2, false>(sums, my_scratch, team);
      const float mean_d = sums[0] * inv_cols;
      const float var = fmaxf(fmaf(-mean_d, mean_d, sums[1] * inv_cols), 0.0f);
      mean = shift_k + mean_d;
      rstd = rsqrtf(var + p.eps);
    } else {
      float sq[1] = {sums[1]};
      row_allreduce<1, false>(sq, my_scratch, team);
      rstd = rsqrtf(sq[0] * inv_cols + p.eps);
    }
    if (!valid_row) continue;
    const float shift = -mean * rstd;
    T* __restrict__ y = static_cast<T*>(p.y) + row * p.y_row_stride;
    [[maybe_unused]] T* __restrict__ sum = RESIDUAL && p.sum ? static_cast<T*>(p.sum) + row * p.sum_row_stride : nullptr;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      if (!in_row(it)) continue;
      const int col = col0 + it * step;
      if constexpr (RESIDUAL) {
        if (sum) store_vector(sum + col, it, raw[it]);
      }
      float v[kVec], out[kVec];
      unpack16<T>(raw[it], v);
      if constexpr (kEarlyWeight) {
        float w[kVec];
#pragma unroll
        for (int c = 0; c < kWChunks; ++c) {
          constexpr int kPer = 16 / sizeof(W);
          float part[kPer];
          unpack16<W>(w_raw[it][c], part);
#pragma unroll
          for (int i = 0; i < kPer; ++i) w[c * kPer + i] = part[i];
        }
        if (has_bias) {
          float b[kVec];
          load_floats<W, kVec, LoadPath::read_only>(bias + col, b);
#pragma unroll
          for (int i = 0; i < kVec; ++i) out[i] = fmaf(fmaf(v[i], rstd, shift), w[i], b[i]);
        } else {
#pragma unroll
          for (int i = 0; i < kVec; ++i) out[i] = fmaf(v[i], rstd, shift) * w[i];
        }
      } else if (has_weight) {
        float w[kVec];
        load_params(weight + col, it, 1.0f, w);
        if (has_bias) {
          float b[kVec];
          load_params(bias + col, it, 0.0f, b);
#pragma unroll
          for (int i = 0; i < kVec; ++i) out[i] = fmaf(fmaf(v[i], rstd, shift), w[i], b[i]);
        } else {
#pragma unroll
          for (int i = 0; i < kVec; ++i) out[i] = fmaf(v[i], rstd, shift) * w[i];
        }
      } else if (has_bias) {
        float b[kVec];
        load_params(bias + col, it, 0.0f, b);
#pragma unroll
        for (int i = 0; i < kVec; ++i) out[i] = fmaf(v[i], rstd, shift) + b[i];
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) out[i] = fmaf(v[i], rstd, shift);
      }
      store_vector(y + col, it, pack16<T>(out));
    }
    if (t == 0) {
      if (p.mean) p.mean[row] = mean;
      if (p.rstd) p.rstd[row] = rstd;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The blocks of a thread-block cluster sum their partial rows through distributed shared memory
// before any goes to global memory, so the workspace holds one partial row per cluster instead of
// one per block (at N = 16384, 132 per-block rows are 8.6 MB written and read again, 17 MB with
// dbias). `block_sums` holds this block's dweight (and, with BIAS_GRAD, dbias `cols` floats
// after it) for `cols` columns (a multiple of 4, at most `partial_stride`, the floats between
// partial rows). Block rank r sums the r-th slice of the columns over the cluster's blocks in
// rank order (a fixed order: the result does not depend on timing) into partial row blockIdx.x /
// cluster size. Every thread of every block of the cluster must call it.
template <bool BIAS_GRAD>
__device__ __forceinline__ void cluster_sum_partials(float* block_sums, int cols, std::int64_t partial_stride,
                                                     float* __restrict__ partial_dw, float* __restrict__ partial_db) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  // Release this block's sums to the cluster, acquire the others'.
  cluster.sync();
  const int blocks = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int units = cols / 4;
  const int per_rank = (units + blocks - 1) / blocks;
  const int begin = rank * per_rank, end = min(units, begin + per_rank);
  const std::int64_t row = blockIdx.x / blocks;
  const int arrays = BIAS_GRAD ? 2 : 1;
  for (int a = 0; a < arrays; ++a) {
    float* out = (a == 0 ? partial_dw : partial_db) + row * partial_stride;
    for (int u = begin + static_cast<int>(threadIdx.x); u < end; u += static_cast<int>(blockDim.x)) {
      float4 total = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      for (int b = 0; b < blocks; ++b) {
        const float4 v = reinterpret_cast<const float4*>(cluster.map_shared_rank(block_sums + a * cols, b))[u];
        total.x += v.x, total.y += v.y, total.z += v.z, total.w += v.w;
      }
      reinterpret_cast<float4*>(out)[u] = total;
    }
  }
  // No block may exit (releasing its shared memory) while the others still read it.
  cluster.sync();
}

// ---------------------------------------------------------------------------------------------
// Backward on a persistent grid. Each row group streams its rows of dy and the input (x or y)
// through its own ring of `stages` row slots in shared memory, filled by bulk copies that one
// thread issues (a "full" mbarrier per slot counts the bytes in, an "empty" one
// counts the group's threads out). The weight (and, from y, 1/w and b) is converted to float
// once per block into shared memory (column_slot's conflict-free layout). Per-column
// dweight/dbias sums stay in registers for the whole loop; at the end the row groups of a block
// are combined in a fixed tree and one partial row per block goes to the workspace, summed over
// blocks by reduce_partials_kernel.
// VARIANT: a BackwardVariant (norm_config.h), packed.
//  source: where x_hat comes from (Source).
//  full_rows: the row fills every thread's vectors (N = threads per row x vectors x VEC), so the
//    passes carry no per-vector bounds test and the compiler may issue a pass's shared-memory
//    loads together (without dbias only: with it the hoisted loads spill).
//  cluster: launched in thread-block clusters whose blocks pre-sum their partial rows
//    (cluster_sum_partials). A compile-time choice: the untaken cluster code alone slows the
//    plain kernel (bench: layer_norm bwd (16384, 5120), H200).
//  dsum: the residual backward, dx += dsum (a compile-time choice: the test alone costs the plain
//    kernels registers).
//  keep_g: g = dy * w stays in registers from the first pass to the second, which then reads only
//    the input from the ring: no dy or weight loads, no unpack of dy and no multiply per element
//    there, for one register per element held across the row reduction.
//  tail: N is not a multiple of VEC. Shared-memory rows and columns take `pitch` = N rounded up
//    to VEC elements; the ring gets the row's whole vectors by bulk copy, and the thread whose
//    vector is the partial last one reads it per element into registers, a row ahead (nothing
//    past N read). Past N, dy and the input are zero and the weight 1 (1/w 1, b 0), so those
//    columns add exactly 0 to every sum; dx is stored per element up to N. Without tail none of
//    that code exists.
// Two vectors per thread from x without dbias pay only at two 512-thread blocks per SM, i.e. at
// most 64 registers: the launch bounds hold the compiler to that (bench: rms_norm bwd (8192,
// 8192), H200).
// The variant's fields as compile-time constants (class members, not kernel locals, so that they
// add nothing to the kernel's code).
template <int VARIANT>
struct Backward {
  static constexpr BackwardVariant kVariant = BackwardVariant::unpack(VARIANT);
  static constexpr int kIters = kVariant.vectors_per_thread;
  static constexpr Source kSource = kVariant.source;
  static constexpr bool kBiasGrad = kVariant.bias_grad, kFullRows = kVariant.full_rows, kCluster = kVariant.cluster,
                        kKeepG = kVariant.keep_g, kDsum = kVariant.dsum, kTail = kVariant.tail;
  static constexpr int kMinBlocks = kIters == 2 && kSource == Source::x && !kBiasGrad && !kKeepG ? 2 : 1;
};
template <typename T, typename W, int VARIANT>
__global__ void __launch_bounds__(512, Backward<VARIANT>::kMinBlocks)
    backward_streaming_kernel(BackwardParams p, RowGeometry geo, float* __restrict__ partial_dw,
                              float* __restrict__ partial_db) {
  using V = Backward<VARIANT>;
  constexpr int kVec = 16 / sizeof(T);
  extern __shared__ uint4 smem[];
  __shared__ float scratch[2][kMaxWarpsPerBlock * 2];
  __shared__ std::uint64_t full_bar[kMaxRowGroups * kMaxStages], empty_bar[kMaxRowGroups * kMaxStages];
  const int tpr = geo.threads_per_row, rpb = geo.rows_per_block, stages = geo.stages;
  const int group = threadIdx.x / tpr, t = threadIdx.x - group * tpr;
  const RowTeam team(tpr, group, t);
  const int cols = static_cast<int>(p.cols);
  // Elements per row in shared memory (the ring, the columns, the dweight / dbias tree).
  const int pitch = V::kTail ? (cols + kVec - 1) / kVec * kVec : cols;
  // Bytes of a row the bulk copies move: its whole vectors (a partial last vector is read by the
  // thread that owns it, below).
  const unsigned row_bytes = static_cast<unsigned>(V::kTail ? cols / kVec * 16 : cols * sizeof(T));
  const std::int64_t partial_stride = partial_pitch(cols);
  const bool layer_norm = p.kind == Kind::layer_norm;
  constexpr bool kFromOutput = V::kSource != Source::x;
  const bool needs_mean = layer_norm && !kFromOutput;
  const float inv_cols = 1.0f / static_cast<float>(cols);
  // From y, 1/w and b are in shared memory when they fit (Source::y; Source::y_uncached reads
  // them per use: rows too long for both the ring and three float columns). w always is.
  constexpr bool cached = V::kSource != Source::y_uncached;
  constexpr int arrays = V::kSource == Source::y ? 3 : 1;
  float* col_w = reinterpret_cast<float*>(smem);
  float* col_inv_w = col_w + pitch;
  float* col_shift = col_inv_w + pitch;
  // A ring slot holds a row of dy, of the input and, in the residual backward where it fits, of
  // dsum (else dsum is read from memory as dx is formed).
  const bool ring_dsum = V::kDsum && geo.ring_dsum;
  const int slot_rows = ring_dsum ? 3 : 2;
  T* ring = reinterpret_cast<T*>(col_w + arrays * pitch) + std::size_t(group) * stages * slot_rows * pitch;
  std::uint64_t* full = full_bar + group * kMaxStages;
  std::uint64_t* empty = empty_bar + group * kMaxStages;
  const W* __restrict__ weight = static_cast<const W*>(p.weight);
  const W* __restrict__ bias = static_cast<const W*>(p.bias);
  const T* __restrict__ dy = static_cast<const T*>(p.dy);
  const T* __restrict__ in = static_cast<const T*>(p.input);
  const std::int64_t rows = p.rows;
  const std::int64_t stride_rows = std::int64_t(gridDim.x) * rpb;
  const std::int64_t first_row = std::int64_t(blockIdx.x) * rpb + group;

  if (t < stages) {
    mbarrier_init(&full[t], 1);
    mbarrier_init(&empty[t], tpr);
  }
  mbarrier_init_fence();
  __syncthreads();

  // Row k of this group goes to slot k % stages.
  auto issue = [&](int k) {
    const std::int64_t row = first_row + k * stride_rows;
    if (row >= rows) return;
    const int slot = k % stages;
    T* dst = ring + slot * slot_rows * pitch;
    const T* src_dy = dy + row * p.dy_row_stride;
    const T* src_in = in + row * p.input_row_stride;
    if (V::kTail && row_bytes == 0) {  // rows shorter than one vector: nothing to copy
      mbarrier_arrive(&full[slot]);
      return;
    }
    mbarrier_arrive_expect_tx(&full[slot], slot_rows * row_bytes);
    bulk_copy_to_shared(dst, src_dy, row_bytes, &full[slot]);
    bulk_copy_to_shared(dst + pitch, src_in, row_bytes, &full[slot]);
    if constexpr (V::kDsum) {
      const T* src_dsum = static_cast<const T*>(p.dsum) + row * p.dsum_row_stride;
      // Outside the ring dsum is read as dx is formed: from L2, fetched now, rows ahead.
      if (ring_dsum) bulk_copy_to_shared(dst + 2 * pitch, src_dsum, row_bytes, &full[slot]);
      else bulk_prefetch_l2(src_dsum, row_bytes);
    }
  };
  if (t == 0) {
    for (int k = 0; k < stages - 1; ++k) issue(k);
  }

  // The weight (and from y 1/w and b) as floats, 4 columns per item, all of a thread's loads in
  // flight together.
  struct Columns {
    float4 w, b;
  };
  // Four columns at 4u as floats, `fill` past N (tail rows: a unit may lie partly or wholly past it).
  auto load4_columns = [&](const W* base, int u, float fill) {
    if (V::kTail && 4 * u + 4 > cols) {
      float f[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) f[i] = 4 * u + i < cols ? to_float(base[4 * u + i]) : fill;
      return make_float4(f[0], f[1], f[2], f[3]);
    }
    return load4_floats(base + 4 * u);
  };
  detail::device::staged_for_each<4>(
      pitch / 4,
      [&](int u) {
        Columns v{};
        v.w = weight ? load4_columns(weight, u, 1.0f) : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
        if constexpr (kFromOutput && cached)
          v.b = bias ? load4_columns(bias, u, 0.0f) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        return v;
      },
      [&](int u, const Columns& v) {
        const int slot = column_slot<kVec>(u, pitch);
        reinterpret_cast<float4*>(col_w)[slot] = v.w;
        if constexpr (kFromOutput && cached) {
          reinterpret_cast<float4*>(col_inv_w)[slot] =
              make_float4(1.0f / v.w.x, 1.0f / v.w.y, 1.0f / v.w.z, 1.0f / v.w.w);
          reinterpret_cast<float4*>(col_shift)[slot] = v.b;
        }
      });
  __syncthreads();

  // The dbias sums exist only when asked for (never for RMSNorm): they would otherwise cost
  // kIters * kVec registers per thread.
  constexpr int kDbIters = V::kBiasGrad ? V::kIters : 1, kDbVec = V::kBiasGrad ? kVec : 1;
  float acc_dw[V::kIters][kVec], acc_db[kDbIters][kDbVec];
#pragma unroll
  for (int it = 0; it < V::kIters; ++it)
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc_dw[it][i] = 0.0f;
#pragma unroll
  for (int it = 0; it < kDbIters; ++it)
#pragma unroll
    for (int i = 0; i < kDbVec; ++i) acc_db[it][i] = 0.0f;

  const int step = tpr * kVec;
  const int col0 = t * kVec;
  auto in_row = [&](int it) { return V::kFullRows || col0 + it * step < cols; };
  [[maybe_unused]] auto partial = [&](int it) { return V::kTail && col0 + it * step + kVec > cols; };
  // A tail row's partial last vector of dy, of the input and of dsum: read from global memory by
  // the one thread whose vector it is, one element load each (nothing past N read; a 16-byte copy
  // into the ring would read past the end of the last row), the next row's while this one is
  // processed. Elements past N are zero.
  [[maybe_unused]] const int tail_col = cols / kVec * kVec;
  [[maybe_unused]] const bool tail_owner =
      V::kTail && tail_col >= col0 && (tail_col - col0) % step == 0 && (tail_col - col0) / step < V::kIters;
  [[maybe_unused]] uint4 tail_dy = make_uint4(0, 0, 0, 0), tail_in = tail_dy, tail_dsum = tail_dy,
                         tail_dy_next = tail_dy, tail_in_next = tail_dy, tail_dsum_next = tail_dy;
  [[maybe_unused]] auto load_tail = [&](std::int64_t row, uint4& d, uint4& v, uint4& s) {
    d = load_partial16<T>(dy + row * p.dy_row_stride + tail_col, cols - tail_col);
    v = load_partial16<T>(in + row * p.input_row_stride + tail_col, cols - tail_col);
    if constexpr (V::kDsum)
      s = load_partial16<T>(static_cast<const T*>(p.dsum) + row * p.dsum_row_stride + tail_col, cols - tail_col);
  };
  // From y: x_hat = (y - b) * (1/w), per column. y - b first: when x_hat is small against b / w,
  // y * (1/w) - b / w would cancel two large rounded terms (seen as f32 dweight errors 3x the
  // float32 summation bound on random draws with small weights).
  auto from_y_factors = [&](int col, float (&inv_w)[kVec], float (&sh)[kVec]) {
    if constexpr (cached) {
      load_shared_columns<kVec>(col_inv_w, pitch, col, inv_w);
      load_shared_columns<kVec>(col_shift, pitch, col, sh);
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const bool in = !V::kTail || col + i < cols;  // past N: 1/w = 1, b = 0
        const float w = weight && in ? to_float(weight[col + i]) : 1.0f;
        inv_w[i] = 1.0f / w;
        sh[i] = bias && in ? to_float(bias[col + i]) : 0.0f;
      }
    }
  };

  float rstd_next = 0.0f, mean_next = 0.0f;
  if (first_row < rows) {
    rstd_next = p.rstd[first_row];
    if (needs_mean) mean_next = p.mean[first_row];
    if (tail_owner) load_tail(first_row, tail_dy_next, tail_in_next, tail_dsum_next);
  }
  int slot = 0, parity = 0, prev_slot = stages - 1, prev_parity = 1, phase = 0;
  for (int k = 0;; ++k) {
    const std::int64_t row = first_row + k * stride_rows;
    if (row >= rows) break;
    const float rstd = rstd_next, mean = mean_next;
    if constexpr (V::kTail) tail_dy = tail_dy_next, tail_in = tail_in_next, tail_dsum = tail_dsum_next;
    if (row + stride_rows < rows) {
      rstd_next = p.rstd[row + stride_rows];
      if (needs_mean) mean_next = p.mean[row + stride_rows];
      if (tail_owner) load_tail(row + stride_rows, tail_dy_next, tail_in_next, tail_dsum_next);
    }
    if (t == 0) {
      // Row k + stages - 1 reuses the slot of row k - 1: wait until the group has left it.
      if (k > 0) mbarrier_wait(&empty[prev_slot], prev_parity);
      issue(k + stages - 1);
    }
    mbarrier_wait(&full[slot], parity);
    const T* r_dy = ring + slot * slot_rows * pitch;
    const T* r_in = r_dy + pitch;
    [[maybe_unused]] const T* r_dsum = r_in + pitch;
    // A vector of dy or of the input: from the ring, or a partial last one from the registers.
    auto dy_vector = [&](int it, int col) {
      return partial(it) ? tail_dy : *reinterpret_cast<const uint4*>(r_dy + col);
    };
    auto in_vector = [&](int it, int col) {
      return partial(it) ? tail_in : *reinterpret_cast<const uint4*>(r_in + col);
    };
    const float shift = -mean * rstd;

    // sum(g) and sum(g * x_hat) with g = dy * w, one accumulator pair per vector.
    float part_g[V::kIters], part_gx[V::kIters];
    float kept_g[V::kKeepG ? V::kIters : 1][V::kKeepG ? kVec : 1];
#pragma unroll
    for (int it = 0; it < V::kIters; ++it) {
      part_g[it] = part_gx[it] = 0.0f;
      if (!in_row(it)) continue;
      const int col = col0 + it * step;
      float d[kVec], v[kVec], w[kVec];
      unpack16<T>(dy_vector(it, col), d);
      unpack16<T>(in_vector(it, col), v);
      load_shared_columns<kVec>(col_w, pitch, col, w);
      float xh[kVec];
      if constexpr (kFromOutput) {
        float inv_w[kVec], sh[kVec];
        from_y_factors(col, inv_w, sh);
#pragma unroll
        for (int i = 0; i < kVec; ++i) xh[i] = (v[i] - sh[i]) * inv_w[i];
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) xh[i] = (v[i] - mean) * rstd;
      }
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float g = d[i] * w[i];
        if constexpr (V::kKeepG) kept_g[it][i] = g;
        part_g[it] += g;
        part_gx[it] = fmaf(g, xh[i], part_gx[it]);
        acc_dw[it][i] = fmaf(d[i], xh[i], acc_dw[it][i]);
        if constexpr (V::kBiasGrad) acc_db[it][i] += d[i];
      }
    }
    float sums[2] = {part_g[0], part_gx[0]};
#pragma unroll
    for (int it = 1; it < V::kIters; ++it) {
      sums[0] += part_g[it];
      sums[1] += part_gx[it];
    }
    row_allreduce<2, true>(sums, &scratch[phase][group * (tpr / 32) * 2], team);
    phase ^= 1;

    if (p.dx != nullptr) {
      // dx = rstd * (g - mean(g) - x_hat * mean(g x_hat)) = g * rstd + (x_hat * a + c).
      const float a = -rstd * sums[1] * inv_cols;
      const float c = layer_norm ? -rstd * sums[0] * inv_cols : 0.0f;
      // From x, x_hat * a + c = x * (a * rstd) + (shift * a + c).
      [[maybe_unused]] const float a_x = a * rstd, c_x = fmaf(shift, a, c);
      T* __restrict__ dx = static_cast<T*>(p.dx) + row * p.dx_row_stride + col0;
      // The residual backward's skip-path gradient, from the ring or from memory (a partial last
      // vector: read a row ahead, above). It may be dx itself: the ring and the partial vector got
      // the row before any of it was written, and other elements read from memory are read by the
      // thread that writes them.
      [[maybe_unused]] const T* dsum =
          V::kDsum ? static_cast<const T*>(p.dsum) + row * p.dsum_row_stride + col0 : nullptr;
#pragma unroll
      for (int it = 0; it < V::kIters; ++it) {
        if (!in_row(it)) continue;
        const int col = col0 + it * step;
        float d[kVec], v[kVec], w[kVec], out[kVec];
        unpack16<T>(in_vector(it, col), v);
        if constexpr (V::kKeepG) {
          // d * w below then equals the kept g exactly (x * 1.0f == x), and the compiler drops
          // the multiply: the two branches share the dx expressions that follow.
#pragma unroll
          for (int i = 0; i < kVec; ++i) d[i] = kept_g[it][i], w[i] = 1.0f;
        } else {
          unpack16<T>(dy_vector(it, col), d);
          load_shared_columns<kVec>(col_w, pitch, col, w);
        }
        if constexpr (kFromOutput) {
          float inv_w[kVec], sh[kVec];
          from_y_factors(col, inv_w, sh);
#pragma unroll
          for (int i = 0; i < kVec; ++i) out[i] = fmaf(d[i] * w[i], rstd, fmaf((v[i] - sh[i]) * inv_w[i], a, c));
        } else {
#pragma unroll
          for (int i = 0; i < kVec; ++i) out[i] = fmaf(d[i] * w[i], rstd, fmaf(v[i], a_x, c_x));
        }
        if constexpr (V::kDsum) {
          float skip[kVec];
          unpack16<T>(partial(it)  ? tail_dsum
                      : ring_dsum ? *reinterpret_cast<const uint4*>(r_dsum + col)
                                  : *reinterpret_cast<const uint4*>(dsum + it * step),
                      skip);
#pragma unroll
          for (int i = 0; i < kVec; ++i) out[i] += skip[i];
        }
        if (partial(it)) store_partial16<T>(dx + it * step, pack16<T>(out), cols - col);
        else *reinterpret_cast<uint4*>(dx + it * step) = pack16<T>(out);
      }
    }
    mbarrier_arrive(&empty[slot]);
    prev_slot = slot;
    prev_parity = parity;
    if (++slot == stages) {
      slot = 0;
      parity ^= 1;
    }
  }
  if (partial_dw == nullptr) return;

  // The tree and block_sums below overwrite the ring. One block barrier orders every ring read
  // before those writes; compute-sanitizer racecheck (CUDA 13.0) does not see that order for the
  // reads that follow a row group's named barrier (the dx pass's) and reports write-after-read
  // hazards (NormResidualGpu.DsumFromTheRingAndFromMemory, f32 (17, 768)), which a second barrier
  // clears. Two barriers once per block.
  auto leave_ring = [] {
    __syncthreads();
    __syncthreads();
  };
  if (rpb > 1) {
    // The row groups' sums meet in group 0 through the (now idle) ring as a binary tree: in the
    // round of stride s, group g (g mod 2s = s) stores its sums in slot g - 1 and group g - s adds
    // them. log2(rpb) rounds with every group busy, where a chain through group 0 took rpb - 1
    // dependent rounds (15 at N = 1024: most of the cost of dweight/dbias there). The tree is
    // fixed, so the sums are bitwise reproducible. A round's slots (g - 1 = s - 1 mod 2s) are
    // never those the previous round read (s/2 - 1 mod s), so one barrier per round suffices.
    leave_ring();
    float* combine = reinterpret_cast<float*>(col_w + arrays * pitch);
    for (int s = 1; s < rpb; s *= 2) {
      if (group % (2 * s) == s) {
#pragma unroll
        for (int it = 0; it < V::kIters; ++it) {
          if (!in_row(it)) continue;
#pragma unroll
          for (int i = 0; i < kVec; ++i) {
            const int c = col0 + it * step + i;
            combine[((group - 1) * 2 + 0) * pitch + c] = acc_dw[it][i];
            if constexpr (V::kBiasGrad) combine[((group - 1) * 2 + 1) * pitch + c] = acc_db[it][i];
          }
        }
      }
      __syncthreads();
      if (group % (2 * s) == 0 && group + s < rpb) {
        const int src = group + s;
#pragma unroll
        for (int it = 0; it < V::kIters; ++it) {
          if (!in_row(it)) continue;
#pragma unroll
          for (int i = 0; i < kVec; ++i) {
            const int c = col0 + it * step + i;
            acc_dw[it][i] += combine[((src - 1) * 2 + 0) * pitch + c];
            if constexpr (V::kBiasGrad) acc_db[it][i] += combine[((src - 1) * 2 + 1) * pitch + c];
          }
        }
      }
    }
    if (!V::kCluster && group > 0) return;
  }
  // From y the per-column x_hat factor 1/w is already inside acc_dw (x_hat = (y - b) / w).
  // Group 0 now holds the block's sums. It writes them as the block's partial row, or, in a
  // cluster, to shared memory (the ring, past the tree's slots), from where the cluster's blocks
  // sum them into one partial row. The tree's slots and block_sums take 2 * rpb * pitch floats, and
  // the ring holds at least rpb * stages * 2 * pitch elements of T: enough for stages >= 2 and
  // 16-bit T.
  // Partial rows are partial_pitch(N) floats apart: a partial last vector's columns past N (zero
  // sums) stay inside the row.
  float* block_sums = reinterpret_cast<float*>(col_w + arrays * pitch) + std::size_t(rpb - 1) * 2 * pitch;
  // With one row group per block no tree ran: other warps may still read their last row from the
  // ring that block_sums overwrites.
  if constexpr (V::kCluster) {
    if (rpb > 1) __syncthreads();
    else leave_ring();
  }
  float* out_dw = V::kCluster ? block_sums : partial_dw + std::int64_t(blockIdx.x) * partial_stride;
  float* out_db = V::kCluster ? block_sums + pitch : partial_db + std::int64_t(blockIdx.x) * partial_stride;
  if (!V::kCluster || group == 0) {
#pragma unroll
    for (int it = 0; it < V::kIters; ++it) {
      if (!in_row(it)) continue;
      const int col = col0 + it * step;
#pragma unroll
      for (int i = 0; i < kVec; i += 4) {
        *reinterpret_cast<float4*>(out_dw + col + i) =
            make_float4(acc_dw[it][i], acc_dw[it][i + 1], acc_dw[it][i + 2], acc_dw[it][i + 3]);
        if constexpr (V::kBiasGrad)
          *reinterpret_cast<float4*>(out_db + col + i) =
              make_float4(acc_db[it][i], acc_db[it][i + 1], acc_db[it][i + 2], acc_db[it][i + 3]);
      }
    }
  }
  if constexpr (V::kCluster)
    cluster_sum_partials<V::kBiasGrad>(block_sums, pitch, partial_stride, partial_dw, partial_db);
}

// ---------------------------------------------------------------------------------------------
// Generic kernels: one block per row (grid-stride over rows), any N, any alignment.

template <typename T, typename W>
__global__ void __launch_bounds__(kGenericThreads) forward_generic_kernel(ForwardParams p) {
  __shared__ float scratch[2][kGenericThreads / 32];
  const RowTeam team(kGenericThreads, 0, threadIdx.x);
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const T* __restrict__ residual = static_cast<const T*>(p.residual);
  T* __restrict__ y = static_cast<T*>(p.y);
  T* __restrict__ sum = static_cast<T*>(p.sum);
  const W* __restrict__ weight = static_cast<const W*>(p.weight);
  const W* __restrict__ bias = static_cast<const W*>(p.bias);
  const float inv_cols = 1.0f / static_cast<float>(p.cols);
  for (std::int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* xr = x + row * p.x_row_stride;
    // The row's element c: x, or round(x + residual) in T (recomputed in each pass, identically).
    auto element = [&](std::int64_t c) {
      if (!residual) return to_float(xr[c]);
      return to_float(from_float<T>(to_float(xr[c]) + to_float(residual[row * p.residual_row_stride + c])));
    };
    float mean = 0.0f;
    if (p.kind == Kind::layer_norm) {
      float s[1] = {0.0f};
      for (std::int64_t c = threadIdx.x; c < p.cols; c += kGenericThreads) s[0] += element(c);
      row_allreduce<1, false>(s, scratch[0], team);
      mean = s[0] * inv_cols;
    }
    float q[1] = {0.0f};
    for (std::int64_t c = threadIdx.x; c < p.cols; c += kGenericThreads) {
      const float d = element(c) - mean;
      q[0] += d * d;
    }
    row_allreduce<1, false>(q, scratch[1], team);
    const float rstd = rsqrtf(q[0] * inv_cols + p.eps);
    for (std::int64_t c = threadIdx.x; c < p.cols; c += kGenericThreads) {
      const float v = element(c);
      if (sum) sum[row * p.sum_row_stride + c] = from_float<T>(v);
      float o = (v - mean) * rstd;
      if (weight) o *= to_float(weight[c]);
      if (bias) o += to_float(bias[c]);
      y[row * p.y_row_stride + c] = from_float<T>(o);
    }
    if (threadIdx.x == 0) {
      if (p.mean) p.mean[row] = mean;
      if (p.rstd) p.rstd[row] = rstd;
    }
    __syncthreads();  // scratch is reused by the next row
  }
}

// Each block accumulates its partial dweight/dbias directly in its own workspace row (only this
// block touches it, and each thread always touches the same columns: no races, fixed order).
template <typename T, typename W>
__global__ void __launch_bounds__(kGenericThreads)
    backward_generic_kernel(BackwardParams p, float* __restrict__ partial_dw,
                            float* __restrict__ partial_db) {
  __shared__ float scratch[2][kGenericThreads / 32 * 2];
  const RowTeam team(kGenericThreads, 0, threadIdx.x);
  const T* __restrict__ dy = static_cast<const T*>(p.dy);
  const T* __restrict__ in = static_cast<const T*>(p.input);
  T* dx = static_cast<T*>(p.dx);  // not __restrict__: dsum may be dx
  const T* dsum = static_cast<const T*>(p.dsum);
  const W* __restrict__ weight = static_cast<const W*>(p.weight);
  const W* __restrict__ bias = static_cast<const W*>(p.bias);
  const bool layer_norm = p.kind == Kind::layer_norm;
  const float inv_cols = 1.0f / static_cast<float>(p.cols);
  float* my_dw = partial_dw ? partial_dw + std::int64_t(blockIdx.x) * partial_pitch(p.cols) : nullptr;
  float* my_db = partial_db ? partial_db + std::int64_t(blockIdx.x) * partial_pitch(p.cols) : nullptr;
  if (my_dw) {
    for (std::int64_t c = threadIdx.x; c < p.cols; c += kGenericThreads) my_dw[c] = my_db[c] = 0.0f;
  }
  for (std::int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const float rstd = p.rstd[row];
    const float mean = (layer_norm && !p.from_output) ? p.mean[row] : 0.0f;
    auto element = [&](std::int64_t c, float* g, float* xh, float* d) {
      *d = to_float(dy[row * p.dy_row_stride + c]);
      const float v = to_float(in[row * p.input_row_stride + c]);
      const float w = weight ? to_float(weight[c]) : 1.0f;
      if (p.from_output) {
        *xh = (v - (bias ? to_float(bias[c]) : 0.0f)) / w;
      } else {
        *xh = (v - mean) * rstd;
      }
      *g = *d * w;
    };
    float sums[2] = {0.0f, 0.0f};
    for (std::int64_t c = threadIdx.x; c < p.cols; c += kGenericThreads) {
      float g, xh, d;
      element(c, &g, &xh, &d);
      sums[0] += g;
      sums[1] += g * xh;
    }
    row_allreduce<2, false>(sums, scratch[0], team);
    const float mean_g = layer_norm ? sums[0] * inv_cols : 0.0f;
    const float mean_gx = sums[1] * inv_cols;
    for (std::int64_t c = threadIdx.x; c < p.cols; c += kGenericThreads) {
      float g, xh, d;
      element(c, &g, &xh, &d);
      if (dx) {
        float out = rstd * (g - mean_g - xh * mean_gx);
        if (dsum) out += to_float(dsum[row * p.dsum_row_stride + c]);  // may be dx: read first
        dx[row * p.dx_row_stride + c] = from_float<T>(out);
      }
      if (my_dw) {
        my_dw[c] += d * xh;
        my_db[c] += d;
      }
    }
    __syncthreads();  // scratch is reused by the next row
  }
}

// Sums partials[slots][cols] (rows `pitch` floats apart) over slots, in a fixed order, into out[cols]. Block (32, 32): thread
// x owns VEC consecutive columns (16-byte loads when VEC = 4: a block row reads 512 contiguous
// bytes of one partial row), threadIdx.y strides over slots, and the 32 per-thread sums are then
// added in y order. blockIdx.y selects dweight (0) or dbias (1). Four columns per thread launch a
// quarter of the blocks (choose_backward_launch picks).
template <typename W, int VEC>
__global__ void __launch_bounds__(1024)
    reduce_partials_kernel(const float* __restrict__ partial_dw, const float* __restrict__ partial_db,
                           int slots, std::int64_t cols, std::int64_t pitch, W* __restrict__ dweight,
                           W* __restrict__ dbias) {
  static_assert(VEC == 1 || VEC == 4, "one column or four per thread");
  using Vec = std::conditional_t<VEC == 4, float4, float>;
  __shared__ Vec sums[32][32];
  const float* partial = blockIdx.y == 0 ? partial_dw : partial_db;
  W* out = blockIdx.y == 0 ? dweight : dbias;
  // Launched with programmatic stream serialization: the launch overlaps the producer's tail and
  // this waits until the producer grid's partial sums are complete and visible.
  cudaGridDependencySynchronize();
  if (out == nullptr) return;  // uniform over the block: that gradient was not asked for
  const std::int64_t col = (std::int64_t(blockIdx.x) * 32 + threadIdx.x) * VEC;
  auto add = [](Vec& a, const Vec& b) {
    if constexpr (VEC == 4) {
      a.x += b.x, a.y += b.y, a.z += b.z, a.w += b.w;
    } else {
      a += b;
    }
  };
  Vec s{};
  if (col < cols) {
#pragma unroll 4
    for (int slot = threadIdx.y; slot < slots; slot += 32)
      add(s, *reinterpret_cast<const Vec*>(partial + std::int64_t(slot) * pitch + col));
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    Vec total{};
#pragma unroll
    for (int k = 0; k < 32; ++k) add(total, sums[k][threadIdx.x]);
    if constexpr (VEC == 4) {
      out[col] = from_float<W>(total.x);
      out[col + 1] = from_float<W>(total.y);
      out[col + 2] = from_float<W>(total.z);
      out[col + 3] = from_float<W>(total.w);
    } else {
      out[col] = from_float<W>(total);
    }
  }
}

}  // namespace fusekit::norm::kernels
