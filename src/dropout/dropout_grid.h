// Launch geometry of the bias + activation + dropout kernels, shared by the host launcher, the
// kernels and the tests (which check on the CPU that every row is visited exactly once).
//
// Blocks of (TX, TY) = kThreads threads tile the (M, N) tensor: each thread owns a chunk of
// kChunk consecutive columns; the grid is one wave of blocks_per_sm blocks per SM, split into
// column tiles (gx) and block rows (gy); block row b gets a contiguous, balanced range of rows,
// which its threads walk TY rows apart.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "fusekit/philox.h"  // FUSEKIT_HOST_DEVICE

namespace fusekit::dropout {

inline constexpr int kThreads = 512;  // threads per block, TX * TY
inline constexpr int kChunk = 8;      // columns per thread: one Philox call when aligned

struct TileGrid {
  int tx = 0, ty = 0;               // block shape
  int gx = 0, gy = 0;               // grid shape
  std::int64_t rows_per_block = 0;  // block row b gets rows_per_block rows, plus one if b < extra_rows
  int extra_rows = 0;
};

// Block widths TX (in chunks of kChunk columns), swept on the H200 (session 11; 16..512 against
// the former choice of 128 for most N): narrow blocks with many row lanes run best, the forward
// at 32 (relu (16384, 5120) 92.4 -> 89.6 us, gelu_tanh 92.4 -> 90.8), the backward at 16 (3%
// faster at (16384, 4096), 2% at (8192, 16384) and (16384, 5120)); widths of 256 and 512 lost
// up to 65% at N = 1024. Narrower blocks also mean fewer dbias partial rows: a wave of B blocks
// writes B * TX * kChunk floats of partials whatever N is.
inline constexpr int kForwardBlockWidth = 32;
inline constexpr int kBackwardBlockWidth = 16;

// A pure function of (rows, cols, SM count, blocks per SM, block width), so that the workspace
// query and the launch agree. rows >= 1, cols >= 1, block_width a power of two <= kThreads.
inline TileGrid make_grid(std::int64_t rows, std::int64_t cols, int sm_count, int blocks_per_sm,
                          int block_width) {
  TileGrid g;
  const std::int64_t chunks = (cols + kChunk - 1) / kChunk;
  g.tx = block_width;
  g.ty = kThreads / g.tx;
  g.gx = static_cast<int>((chunks + g.tx - 1) / g.tx);
  const std::int64_t wave = std::int64_t(sm_count) * blocks_per_sm;
  std::int64_t gy = std::max<std::int64_t>(1, wave / g.gx);
  gy = std::min<std::int64_t>(gy, (rows + g.ty - 1) / g.ty);
  gy = std::clamp<std::int64_t>(gy, 1, 65535);
  g.gy = static_cast<int>(gy);
  g.rows_per_block = rows / gy;
  g.extra_rows = static_cast<int>(rows % gy);
  return g;
}

// The rows a thread visits: first, first + TY, ... (count of them).
struct ThreadRows {
  std::int64_t first = 0;
  int count = 0;
};

FUSEKIT_HOST_DEVICE ThreadRows thread_rows(const TileGrid& g, int block_y, int thread_y) {
  const std::int64_t begin =
      std::int64_t(block_y) * g.rows_per_block + (block_y < g.extra_rows ? block_y : g.extra_rows);
  const std::int64_t end = begin + g.rows_per_block + (block_y < g.extra_rows ? 1 : 0);
  ThreadRows t;
  t.first = begin + thread_y;
  // Fewer than 2^31 rows per block (M itself is limited to 2^31 - 1): a 32-bit division.
  t.count = t.first < end ? (static_cast<int>(end - t.first) - 1) / g.ty + 1 : 0;
  return t;
}

}  // namespace fusekit::dropout
