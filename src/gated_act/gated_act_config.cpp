#include "gated_act/gated_act_config.h"

#include <algorithm>

#include "core/overrides.h"

namespace fusekit::gated_act {

namespace {

// ---- tables ----------------------------------------------------------------------------------

// Rows per thread on the vector path, by direction. HBM needs its bandwidth times its latency in
// flight: about 4.8 TB/s x ~1 us = 4.8 MB on an H200, 36 KB per SM, i.e. 36 bytes per thread at
// 1024 resident threads. The forward loads two 16-byte vectors per row (gate, up), the backward
// three (dy, gate, up): four forward rows (128 bytes) and two backward rows (96 bytes) cover that
// with room for lower occupancy, in 32 and 24 registers of loaded data.
struct RowsPerThreadRow {
  bool backward;
  int rows_per_thread;
};
constexpr RowsPerThreadRow kRowsPerThreadTable[] = {
    {false, 4},
    {true, 2},
};

// Tile widths (threads along a row) from the widest: the first whose idle threads (the last tile's
// units past the row's end) are at most kMaxIdleFraction of the launched ones; where none is, the
// one with the fewest idle threads. Narrow tiles lose nothing to coalescing (a warp's access is
// 512 contiguous bytes whatever the tile), so an exact fit is worth more than a wide block.
constexpr int kTileWidths[] = {256, 128, 64, 32};
constexpr double kMaxIdleFraction = 1.0 / 16.0;

// Small problems trade rows per thread for blocks: rows_per_thread halves while the grid has fewer
// than kMinWaves waves of fully occupied SMs, so that every SM gets work and the last wave is short.
constexpr int kMinWaves = 2;
constexpr int kDefaultThreadsPerSm = 2048;  // where DeviceInfo does not say (CPU tests)

// ---- helpers ---------------------------------------------------------------------------------

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

int table_rows_per_thread(bool backward) {
  for (const RowsPerThreadRow& row : kRowsPerThreadTable)
    if (row.backward == backward) return row.rows_per_thread;
  return 1;
}

int tile_width(std::int64_t units) {
  int best = kTileWidths[0];
  std::int64_t best_idle = -1;
  for (int w : kTileWidths) {
    const std::int64_t launched = ceil_div(units, w) * w;
    const std::int64_t idle = launched - units;
    if (idle <= static_cast<std::int64_t>(kMaxIdleFraction * static_cast<double>(launched))) return w;
    if (best_idle < 0 || idle < best_idle) best = w, best_idle = idle;
  }
  return best;
}

std::int64_t row_groups(std::int64_t rows, const Launch& l) {
  return ceil_div(rows, std::int64_t(l.row_threads) * l.rows_per_thread);
}

}  // namespace

ForcedChoices forced_choices() {
  ForcedChoices f;
  f.forward_rows_per_thread = static_cast<int>(
      detail::override_choice<int>("gated_act.forward.rows", {{"1", 1}, {"2", 2}, {"4", 4}}).value_or(0));
  f.backward_rows_per_thread = static_cast<int>(
      detail::override_choice<int>("gated_act.backward.rows", {{"1", 1}, {"2", 2}, {"4", 4}}).value_or(0));
  return f;
}

Launch choose_launch(const Problem& p, const detail::DeviceInfo& device, const ForcedChoices& forced) {
  Launch l;
  l.vector = p.vector_ok && p.cols % vector_elems(p.element_bytes) == 0;
  l.unit_elems = l.vector ? vector_elems(p.element_bytes) : 1;
  l.units_per_row = p.cols / l.unit_elems;
  l.tile_threads = tile_width(l.units_per_row);
  l.row_threads = kBlockThreads / l.tile_threads;
  l.col_tiles = ceil_div(l.units_per_row, l.tile_threads);

  if (!l.vector) {
    l.rows_per_thread = kScalarRowsPerThread;
  } else {
    const int forced_rows = p.backward ? forced.backward_rows_per_thread : forced.forward_rows_per_thread;
    if (forced_rows > 0) {
      l.rows_per_thread = forced_rows;
    } else {
      l.rows_per_thread = table_rows_per_thread(p.backward);
      const int threads_per_sm = device.max_threads_per_sm > 0 ? device.max_threads_per_sm : kDefaultThreadsPerSm;
      const std::int64_t full_wave = std::int64_t(device.sm_count) * std::max(1, threads_per_sm / kBlockThreads);
      while (l.rows_per_thread > 1 && l.col_tiles * row_groups(p.rows, l) < kMinWaves * full_wave)
        l.rows_per_thread /= 2;
    }
  }
  l.row_blocks = static_cast<int>(std::min<std::int64_t>(row_groups(p.rows, l), kMaxRowBlocks));
  return l;
}

}  // namespace fusekit::gated_act
