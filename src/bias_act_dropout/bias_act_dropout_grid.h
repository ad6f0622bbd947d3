// Launch geometry of the bias + activation + dropout kernels, shared by the host launcher, the
// kernels and the tests (which check on the CPU that every row is visited exactly once).
//
// Blocks of (TX, TY) = kThreads threads tile the (M, N) tensor: each thread owns a chunk of
// kChunk consecutive columns; the grid is one wave of blocks_per_sm blocks per SM, split into
// column tiles (gx) and block rows (gy). The block rows are interleaved: thread row t of block
// row b visits rows b * TY + t + k * gy * TY, so the whole grid streams through one window of
// gy * TY consecutive rows at a time (as a copy does), 0.5-3% faster than contiguous row ranges
// per block row (bench: bias_act_dropout fwd and bwd (16384, 4096), (32768, 1024), H200).
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "fusekit/philox.h"  // FUSEKIT_HOST_DEVICE

namespace fusekit::bias_act_dropout {

inline constexpr int kThreads = 512;  // threads per block, TX * TY
inline constexpr int kChunk = 8;      // columns per thread: one Philox call when aligned

struct TileGrid {
  int tx = 0, ty = 0;               // block shape
  int gx = 0, gy = 0;               // grid shape
  std::int64_t rows = 0;            // M
};

// The distance between a thread's consecutive rows: one window of the grid's row lanes.
FUSEKIT_HOST_DEVICE std::int64_t row_step(const TileGrid& g) { return std::int64_t(g.gy) * g.ty; }

// Block widths TX (in chunks of kChunk columns): narrow blocks with many row lanes run best, the
// forward at 32, the backward at 16 (bench: bias_act_dropout fwd / bwd (16384, 4096),
// (16384, 5120), H200); widths of 256 and 512 lose up to 65% at N = 1024. Narrower blocks also
// mean fewer dbias partial rows: a wave of B blocks writes B * TX * kChunk floats whatever N is.
inline constexpr int kForwardBlockWidth = 32;
inline constexpr int kBackwardBlockWidth = 16;

// A pure function of (rows, cols, SM count, blocks per SM, block width), so that the workspace
// query and the launch agree. rows >= 1, cols >= 1, block_width a power of two <= kThreads.
inline TileGrid make_grid(std::int64_t rows, std::int64_t cols, int sm_count, int blocks_per_sm,
                          int block_width) {
  TileGrid g;
  g.rows = rows;
  const std::int64_t chunks = (cols + kChunk - 1) / kChunk;
  g.tx = block_width;
  g.ty = kThreads / g.tx;
  g.gx = static_cast<int>((chunks + g.tx - 1) / g.tx);
  const std::int64_t wave = std::int64_t(sm_count) * blocks_per_sm;
  std::int64_t gy = std::max<std::int64_t>(1, wave / g.gx);
  gy = std::min<std::int64_t>(gy, (rows + g.ty - 1) / g.ty);
  gy = std::clamp<std::int64_t>(gy, 1, 65535);
  g.gy = static_cast<int>(gy);
  return g;
}

// The rows a thread visits: first, first + row_step(g), ... (count of them).
struct ThreadRows {
  std::int64_t first = 0;
  int count = 0;
};

FUSEKIT_HOST_DEVICE ThreadRows thread_rows(const TileGrid& g, int block_y, int thread_y) {
  ThreadRows t;
  t.first = std::int64_t(block_y) * g.ty + thread_y;
  // A 32-bit division: M is limited to 2^31 - 1 and gy * TY <= 65535 * 512.
  t.count = t.first < g.rows ? static_cast<int>(static_cast<std::uint32_t>(g.rows - t.first - 1) /
                                                static_cast<std::uint32_t>(row_step(g))) + 1
                             : 0;
  return t;
}

}  // namespace fusekit::bias_act_dropout
