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

// Block width TX (in chunks): 128 when that leaves at most 1/16 of a column tile's threads idle,
// else the nearest width that does; narrow rows get a 32-wide block with many row lanes. Narrower
// blocks mean fewer dbias partial rows: a wave of B blocks writes B * TX * kChunk floats of
// partials whatever N is, so TX = 128 keeps them near 1 MB.
inline int choose_block_width(std::int64_t chunks) {
  for (int tx : {128, 64, 256, 32, 512}) {
    const std::int64_t tiles = (chunks + tx - 1) / tx;
    if ((tiles * tx - chunks) * 16 <= chunks) return tx;
  }
  int tx = 32;
  while (tx < chunks && tx < kThreads) tx *= 2;
  return tx;
}

// A pure function of (rows, cols, SM count, blocks per SM), so that the workspace query and the
// launch agree. rows >= 1, cols >= 1.
inline TileGrid make_grid(std::int64_t rows, std::int64_t cols, int sm_count, int blocks_per_sm) {
  TileGrid g;
  const std::int64_t chunks = (cols + kChunk - 1) / kChunk;
  g.tx = choose_block_width(chunks);
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
