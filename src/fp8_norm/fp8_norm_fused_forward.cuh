// FP8 RMSNorm forward as one cooperative kernel that keeps part of x on chip between its two
// phases (the issue's "keep tiles on chip").
//
// Why: the two-kernel forward reads x twice and is held near what bare data movement of that
// traffic reaches (session 28: 86-90% of copy for the bytes the issue counts). Reading part of x
// only once is the way past that ceiling: here each SM keeps its rows' last column strips in
// shared memory, and the other strips are read last in phase 1 (so L2 still holds many of them
// when phase 2 reads them again, newest first).
//
// Work split. The grid is one 512-thread block per SM (cooperative launch: all resident). Rows
// are dealt to blocks in chunks of 32 (balanced to one chunk), so every row belongs to exactly
// one block: the block finds its rows' rstd itself and the grid needs a single barrier, for the
// global max. A block's rows (at most 256) are cut into strips of 128 columns (the unit of the
// transpose), and strips are grouped into steps: in a step every thread handles 4 units of 16
// columns, vector t % 8 of a strip for rows t / 8 + 64 j, j < kr (kr = 1, 2 or 4 rows per
// thread), in 4 / kr strips. Each thread copies exactly the x bytes it later reads (cp.async into
// its own slots: no barrier between copy and use); the rows' scales are copied by lanes of the
// same warp (a __syncwarp publishes them).
//
// Shared memory (host-computed FusedLayout): the weights as floats (the stats kernel's
// interleaved layout), rstd of the block's rows, `ring` step slots that stream the steps read
// twice, and `stash_steps` slots that hold the last steps of the rows for the whole kernel. A
// step slot is 4 / kr strip tiles, each 64 kr rows x 128 bytes of x in the quantize kernel's
// XOR-swizzled word layout (tile_word), then 64 kr rows x scale_bytes of the rows' scales.
//
// Phase 1 (statistics): stash steps first, then the ring steps in ascending order (the later
// ones also prefetched evict-last: phase 2 reads them back first). Per row: the sum of squares
// and max |xd * w| exactly as the stats kernel computes them (same per-vector float32 sums,
// float64 across vectors), rstd written out and kept in shared memory, the block's max |y| to
// the workspace. Grid barrier. Phase 2 (quantize): the multiplier from all blocks' maxima; the
// ring steps copied again, last first (from L2 where it still holds them), quantized and
// transposed; then the stash steps (their qy bytes replace x in place, the transpose reads them).
#pragma once

#include <cooperative_groups.h>

#include "fp8_norm/fp8_norm_kernels.cuh"

namespace fusekit::fp8_norm::kernels {

inline constexpr int kFusedThreads = 512;
inline constexpr int kFusedChunkRows = 32;   // rows are dealt in chunks of 32 (qy_t: whole 32-byte sectors)
inline constexpr int kFusedMaxRows = 256;    // per block: 64 row slots x 4
inline constexpr int kFusedStripCols = 128;  // 8 vectors of 16
inline constexpr int kFusedMaxRing = 9;      // cp.async.wait_group immediates 0..8

// Host-computed plan of one launch (fp8_norm_cuda.cu, plan_fused_forward).
struct FusedLayout {
  std::int64_t chunks = 0;  // rows / 32
  int strips = 0;           // cols / 128
  int log2_kr = 0;          // rows per thread (1, 2, 4: blocks of up to 64, 128, 256 rows)
  int steps = 0;            // ceil(strips / (4 / kr)): a step is 4 units of 16 bytes per thread
  int stash_steps = 0;      // the last stash_steps steps stay in shared memory
  int ring = 2;             // slots for the other steps (prefetch distance ring - 1)
  int keep_from_step = 0;   // phase 1 marks ring steps >= this one evict-last in L2
  int max_rows = 0;         // rows of the largest block (multiple of 32, <= 256)
  int scale_bytes = 0;      // scale bytes per row and strip: 4, 8, 16 or 32
  int slot_bytes = 0;       // one step: (4 / kr) strip tiles of 64 kr rows x (128 + scale_bytes)
  int rstd_offset = 0, ring_offset = 0, stash_offset = 0, total_bytes = 0;  // weights at 0
  int lab_phases = 2;      // LAB: 1 stops after the grid barrier (timing of phase 1 alone)
  bool lab_ring_first = true;  // LAB: phase 2 takes the ring strips (from L2) before the stash strips
};

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(shared_address(smem)), "l"(gmem) : "memory");
}

// cp.async.wait_group with a run-time count (an immediate in PTX).
__device__ __forceinline__ void cp_async_wait_upto(int n) {
  switch (n) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    case 6: cp_async_wait<6>(); break;
    case 7: cp_async_wait<7>(); break;
    default: cp_async_wait<8>(); break;
  }
}

template <class XF, class QF, typename SC, typename W>
__global__ void __launch_bounds__(kFusedThreads, 1)
    fused_forward_kernel(ForwardParams p, FusedLayout L, float* __restrict__ block_amax) {
  extern __shared__ __align__(16) unsigned char fused_smem[];
  __shared__ float scratch[32];
  float4* w4 = reinterpret_cast<float4*>(fused_smem);
  float* rstd_s = reinterpret_cast<float*>(fused_smem + L.rstd_offset);
  unsigned char* ring = fused_smem + L.ring_offset;
  unsigned char* stash = fused_smem + L.stash_offset;

  const std::uint8_t* __restrict__ x = static_cast<const std::uint8_t*>(p.x);
  const unsigned char* __restrict__ scales = static_cast<const unsigned char*>(p.scales);
  std::uint8_t* __restrict__ qy = static_cast<std::uint8_t*>(p.qy);
  std::uint8_t* __restrict__ qy_t = static_cast<std::uint8_t*>(p.qy_t);
  const int nvec = static_cast<int>(p.cols >> 4);
  stage_weights(static_cast<const W*>(p.weight), nvec, 4, nvec, w4);

  // This block's rows [row0, row0 + rows).
  const int grid = static_cast<int>(gridDim.x), block = static_cast<int>(blockIdx.x);
  const std::int64_t c0 = L.chunks * block / grid, c1 = L.chunks * (block + 1) / grid;
  const std::int64_t row0 = c0 * kFusedChunkRows;
  const int rows = static_cast<int>((c1 - c0) * kFusedChunkRows);
  const int tid = static_cast<int>(threadIdx.x);
  const int row_slot = tid >> 3, vec = tid & 7;
  // A step is 4 units per thread: unit k is row row_slot + 64 (k % kr) of strip k / kr of the
  // step (kr = 2^log2_kr rows per thread, 4 / kr strips per step), so that every shape does the
  // same work per step and thread (session 33: with one vector per thread and strip, the
  // per-strip costs made (8192, 8192) 27% slower than (32768, 2048)).
  const int log2_kr = L.log2_kr, kr_mask = (1 << log2_kr) - 1, per_step = 4 >> log2_kr;
  const int tile_rows = 64 << log2_kr;
  const int tile_x_bytes = tile_rows * kFusedStripCols;
  const int tile_bytes = tile_rows * (kFusedStripCols + L.scale_bytes);
  const int group_shift = p.log2_group - 4;  // vector -> scale group
  const int strips = L.strips, steps = L.steps, K = L.stash_steps, D = L.ring, ring_steps = steps - K;
  const int ahead = D - 1;
  // unit_ok[k]: unit k's row exists (its strip is tested per step).
  bool unit_row_ok[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) unit_row_ok[k] = row_slot + 64 * (k & kr_mask) < rows;

  const std::uint8_t* x_thread = x + (row0 + row_slot) * p.x_row_stride + vec * 16;
  const std::int64_t x_step = 64 * p.x_row_stride;
  const std::int64_t sc_stride_bytes = p.scale_row_stride * static_cast<std::int64_t>(sizeof(SC));
  // No L2 policy operands in this kernel: with a run-time-selected cache policy on cp.async,
  // ptxas 13.0 emitted copies that fault (illegal instruction, H200). Rows to keep in L2 are
  // marked instead by an evict-last prefetch of each 128-byte row segment (lane vec == 0).
  auto unit_strip = [&](int step, int k) { return step * per_step + (k >> log2_kr); };
  auto issue = [&](int step, unsigned char* base, bool keep) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int s = unit_strip(step, k), rk = k & kr_mask;
      if (!unit_row_ok[k] || s >= strips) continue;
      const std::uint8_t* src = x_thread + rk * x_step + s * kFusedStripCols;
      cp_async16(base + (k >> log2_kr) * tile_bytes + 4 * tile_word(row_slot + 64 * rk, vec * 4), src);
      if (keep && vec == 0) asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(src));
    }
    // Lane vec == k copies the scales of unit k's row for its strip (the lanes that read them
    // are the 8 of the same row: the same warp).
    if (vec < 4) {
      const int k = vec, s = unit_strip(step, k), rk = k & kr_mask;
      if (row_slot + 64 * rk < rows && s < strips) {
        const int r = row_slot + 64 * rk;
        const unsigned char* sc_src = scales + (row0 + r) * sc_stride_bytes + std::int64_t(s) * L.scale_bytes;
        unsigned char* sc_dst = base + (k >> log2_kr) * tile_bytes + tile_x_bytes + r * L.scale_bytes;
        switch (L.scale_bytes) {
          case 4: cp_async4(sc_dst, sc_src); break;
          case 8: cp_async8(sc_dst, sc_src); break;
          case 16: cp_async16(sc_dst, sc_src); break;
          default:
            cp_async16(sc_dst, sc_src);
            cp_async16(sc_dst + 16, sc_src + 16);
            break;
        }
      }
    }
  };
  auto x_of = [&](const unsigned char* base, int k) -> uint4* {
    return reinterpret_cast<uint4*>(const_cast<unsigned char*>(base) + (k >> log2_kr) * tile_bytes +
                                    4 * tile_word(row_slot + 64 * (k & kr_mask), vec * 4));
  };
  auto scale_of = [&](const unsigned char* base, int k) {
    const int r = row_slot + 64 * (k & kr_mask);
    return to_float(*reinterpret_cast<const SC*>(base + (k >> log2_kr) * tile_bytes + tile_x_bytes + r * L.scale_bytes +
                                                 (vec >> group_shift) * static_cast<int>(sizeof(SC))));
  };
  auto weights_of = [&](int s, float (&w)[16]) { staged_weights16(w4, nvec, s * 8 + vec, w); };

  // ---- phase 1: statistics ------------------------------------------------------------------
  // Phase-1 order j: stash steps (ring_steps + j) first, then ring steps j - K ascending.
  auto p1_step = [&](int j) { return j < K ? ring_steps + j : j - K; };
  auto p1_slot = [&](int j) { return j < K ? stash + j * L.slot_bytes : ring + ((j - K) % D) * L.slot_bytes; };
  auto p1_issue = [&](int j) {
    if (j < steps) {
      const int st = p1_step(j);
      issue(st, p1_slot(j), j >= K && st >= L.keep_from_step);
    }
    cp_async_commit();
  };
  __syncthreads();  // the staged weights
  for (int j = 0; j < ahead; ++j) p1_issue(j);

  // Per unit (not per row: a row's index k % kr is not a compile-time one); the units of one row
  // are added at the end.
  double sum_squares[4] = {0.0, 0.0, 0.0, 0.0};
  float max_xw[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int j = 0; j < steps; ++j) {
    __syncwarp();  // the warp's lanes are done with the slot this copy refills (its scales)
    p1_issue(j + ahead);
    cp_async_wait_upto(ahead);
    __syncwarp();  // the row scales copied by other lanes of the warp
    const int st = p1_step(j);
    const unsigned char* base = p1_slot(j);
    float w[16];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int s = unit_strip(st, k);
      if (!unit_row_ok[k] || s >= strips) continue;
      if (k == 0 || (k & kr_mask) == 0 || !unit_row_ok[k - 1]) weights_of(s, w);  // a new strip
      float q[16];
      decode16<XF>(*x_of(base, k), q);
      const float sc = scale_of(base, k);
      accumulate_vector_stats<SC, W>(q, w, sc, sum_squares[k], max_xw[k]);  // as the stats kernel
    }
  }

  // Row rk of this thread (row_slot + 64 rk) is the units k with k % kr == rk; their totals over
  // the row's 8 lanes; lane vec == 0 finalizes.
  float amax = 0.0f;
#pragma unroll
  for (int rk = 0; rk < 4; ++rk) {
    double ss = 0.0;
    float mx = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if ((k & kr_mask) == rk) {
        ss += sum_squares[k];
        mx = fmaxf(mx, max_xw[k]);
      }
    }
#pragma unroll
    for (int off = 4; off > 0; off >>= 1) {
      ss += __shfl_xor_sync(0xffffffffu, ss, off);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    }
    const int r = row_slot + 64 * rk;
    if (vec == 0 && rk <= kr_mask && r < rows) {
      const float rstd = rstd_from_sum_squares(ss, p.cols, p.eps);
      p.rstd[row0 + r] = rstd;
      rstd_s[r] = rstd;
      amax = fmaxf(amax, normalized(mx, rstd));
    }
  }
  amax = block_max(amax, scratch);
  if (tid == 0) block_amax[block] = amax;

  // Phase 2's first ring copies do not depend on the statistics: issue them before the barrier.
  // Ring order t: steps ring_steps - 1 - t (the reverse of phase 1), slot t % D.
  auto p2_issue = [&](int t) {
    if (t < ring_steps) issue(ring_steps - 1 - t, ring + (t % D) * L.slot_bytes, false);
    cp_async_commit();
  };
  cp_async_wait<0>();
  __syncthreads();  // every thread's phase-1 reads of the ring are done
  for (int t = 0; t < ahead; ++t) p2_issue(t);

  cooperative_groups::this_grid().sync();
  if (L.lab_phases == 1) {
    cp_async_wait<0>();
    return;
  }

  // ---- phase 2: quantize and transpose --------------------------------------------------------
  float a = 0.0f;
  for (int i = tid; i < grid; i += kFusedThreads) a = fmaxf(a, __ldcg(block_amax + i));
  a = block_max(a, scratch);
  const float max_finite = fp8_max(QF::kIsE4M3);
  if (block == 0 && tid == 0) *p.y_scale = tensor_scale(a, max_finite);
  const float multiplier = quant_multiplier(a, max_finite);

  std::uint8_t* qy_thread = qy + (row0 + row_slot) * p.qy_row_stride + vec * 16;
  const std::int64_t qy_step = 64 * p.qy_row_stride;
  // Step `st` from the slot at `base`: qy rows out, and the fp8 bytes over x in place.
  auto quantize = [&](int st, const unsigned char* base) {
    float w[16];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int s = unit_strip(st, k), rk = k & kr_mask;
      if (!unit_row_ok[k] || s >= strips) continue;
      if (k == 0 || rk == 0 || !unit_row_ok[k - 1]) weights_of(s, w);
      const int r = row_slot + 64 * rk;
      uint4* slot = x_of(base, k);
      float q[16];
      decode16<XF>(*slot, q);
      const float f = quant_factor(scale_of(base, k), rstd_s[r], multiplier);
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = quant_value(q[i], w[i], f);
      const uint4 packed = encode16<QF>(v);
      __stcs(reinterpret_cast<uint4*>(qy_thread + rk * qy_step + s * kFusedStripCols), packed);
      *slot = packed;
    }
  };
  // The transpose: item (strip of the step, word, segment) = 16 rows x 4 columns -> 4 rows of
  // qy_t, 16 bytes each. A step has at most (4 / kr) x 32 x (64 kr / 16) = 512 items: one per
  // thread, fixed for all steps.
  const int segments = rows >> 4;
  const bool has_item = tid < per_step * 32 * segments;
  const int segment = has_item ? tid % segments : 0;
  const int word = has_item ? (tid / segments) & 31 : 0;
  const int item_strip = has_item ? tid / (32 * segments) : 0;
  std::uint8_t* qt_thread = qy_t + std::int64_t(4 * word) * p.qy_t_row_stride + row0 + 16 * segment;
  auto transpose = [&](int st, const unsigned char* base) {
    const int s = st * per_step + item_strip;
    if (!has_item || s >= strips) return;
    const std::uint32_t* tile = reinterpret_cast<const std::uint32_t*>(base + item_strip * tile_bytes);
    std::uint32_t in[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) in[i] = tile[tile_word(16 * segment + i, word)];
    std::uint8_t* dst = qt_thread + std::int64_t(s) * kFusedStripCols * p.qy_t_row_stride;
    transpose_bytes_4x4(in);
#pragma unroll
    for (int c = 0; c < 4; ++c)
      __stcs(reinterpret_cast<uint4*>(dst + c * p.qy_t_row_stride), make_uint4(in[c], in[4 + c], in[8 + c], in[12 + c]));
  };

  // Stash steps: all quantized, one barrier, all transposed (their slots are never refilled).
  auto stash_steps = [&] {
    for (int j = 0; j < K; ++j) quantize(ring_steps + j, stash + j * L.slot_bytes);
    __syncthreads();
    for (int j = 0; j < K; ++j) transpose(ring_steps + j, stash + j * L.slot_bytes);
  };
  // Ring steps first: they were read last in phase 1, so L2 still holds many of them, until the
  // outputs written in phase 2 push them out (the stash steps' 2 bytes out per byte would).
  if (!L.lab_ring_first) stash_steps();
  for (int t = 0; t < ring_steps; ++t) {
    p2_issue(t + ahead);  // refills the slot of step t - 1, whose transpose the barrier below ended
    cp_async_wait_upto(ahead);
    __syncwarp();
    const unsigned char* base = ring + (t % D) * L.slot_bytes;
    quantize(ring_steps - 1 - t, base);
    __syncthreads();
    transpose(ring_steps - 1 - t, base);
    __syncthreads();
  }
  if (L.lab_ring_first) stash_steps();
  cp_async_wait<0>();
}

}  // namespace fusekit::fp8_norm::kernels
