#include "fp8_norm/fp8_norm_config.h"

#include <algorithm>

#include "core/choice_override.h"
#include "core/overrides.h"

namespace fusekit::fp8_norm {

namespace {

// ---- tables ----------------------------------------------------------------------------------

// Fraction of L2 that the statistics pass keeps x in (evict-last) for the quantize pass's second
// read (bench: fp8_rms_norm fwd (16384, 4096) and (8192, 8192), H200: the best of 16-40 MB).
constexpr double kL2KeepFraction = 0.4;

// The bulk statistics ring by row length in rounds (first row that applies): long rows in 1-round
// chunks and 3 slots, shorter rows in 2-round chunks and 2 slots (bench: fp8_rms_norm fwd, H200).
struct StatsRingRow {
  std::int64_t min_row_rounds;
  int rounds, slots;
};
constexpr StatsRingRow kStatsRingTable[] = {
    {4, 1, 3},
    {0, 2, 2},
};
// Two blocks per SM must fit: each also has about 4 KB of static shared memory and reserve.
constexpr std::size_t kStatsBulkBlocksPerSm = 2;
constexpr std::size_t kStatsBulkStaticSmemBytes = 4096;

// The backward tuning by DRAM bytes per SM clock (first row whose open interval holds it; an
// unknown bandwidth, 0, matches none): under 15 (H100 SXM, 12.83) two runs and streaming hints,
// else (H200, 18.42) four runs with the default priority (bench: fp8_rms_norm bwd (32768, 2048)
// and (16384, 4096), H100 and H200).
struct TuningRow {
  double above, below;
  BackwardTuning tuning;
};
constexpr TuningRow kTuningTable[] = {
    {0.0, 15.0, BackwardTuning::two_runs_streaming},
};
constexpr BackwardTuning kDefaultTuning = BackwardTuning::four_runs_cached;

// The vector backward's runs per thread by row length in runs (first row that applies; longer
// rows take the generic kernel). Row groups are 32 to 256 threads: 4 runs per thread (32 columns
// share the per-row work: row sum, addresses), 8 for the longest rows. `streaming`: the staged
// kernel copies evict-first and stores dx streaming.
struct BackwardShapeRow {
  std::int64_t max_row_runs;
  int runs_per_thread;
  bool streaming;
};
constexpr BackwardShapeRow kFourRunsCached[] = {
    {1024, 4, false},
    {2048, 8, false},
};
// (bench: fp8_rms_norm bwd (32768, 2048) and (16384, 4096), H100.)
constexpr BackwardShapeRow kTwoRunsStreaming[] = {
    {128, 4, false},
    {256, 2, false},
    {512, 4, true},
    {1024, 4, false},
    {2048, 8, false},
};

// ---- helpers ---------------------------------------------------------------------------------

bool aligned16(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; }

int log2_ceil(std::int64_t v) {
  int l = 0;
  while ((std::int64_t(1) << l) < v) ++l;
  return l;
}

int scale_bytes(DType scale_dtype) { return scale_dtype == DType::f32 ? 4 : 2; }

std::size_t round_up_256(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

int persistent_grid(std::int64_t work_items, std::int64_t cap) {
  return static_cast<int>(std::max<std::int64_t>(1, std::min(work_items, cap)));
}

// A persistent grid of at most `cap` blocks that gives every block the same number of work
// items, give or take one: no block starts a last round that most others do not have.
int balanced_grid(std::int64_t work_items, std::int64_t cap) {
  const std::int64_t rounds = std::max<std::int64_t>(1, (work_items + cap - 1) / std::max<std::int64_t>(1, cap));
  return persistent_grid((work_items + rounds - 1) / rounds, cap);
}

StatsRing bulk_ring(const ForwardParams& p, const detail::DeviceInfo& device, const ForcedChoices& forced) {
  const std::int64_t row_rounds = p.cols / kStatsBulkRoundBytes;
  StatsRing ring{1, 2};
  for (const StatsRingRow& row : kStatsRingTable) {
    if (row_rounds >= row.min_row_rounds) {
      ring = {row.rounds, row.slots};
      break;
    }
  }
  if (forced.stats_chunk_rounds > 0) ring.rounds = forced.stats_chunk_rounds;
  if (forced.stats_ring_slots > 0) ring.slots = forced.stats_ring_slots;
  while (ring.rounds > 1 && row_rounds % ring.rounds != 0) ring.rounds /= 2;
  const int sb = scale_bytes(p.scale_dtype);
  auto fits = [&] {
    const std::size_t smem = stats_bulk_smem_bytes(p.cols, p.log2_group, sb, ring);
    return kStatsBulkBlocksPerSm * (smem + kStatsBulkStaticSmemBytes) <= device.max_smem_per_block_optin;
  };
  while (ring.slots > 2 && !fits()) --ring.slots;
  while (ring.rounds > 1 && !fits()) ring.rounds /= 2;
  return ring;
}

StatsConfig choose_stats(const ForwardParams& p, bool vector, const detail::DeviceInfo& device,
                         const ForcedChoices& forced) {
  StatsConfig c;
  const int sb = scale_bytes(p.scale_dtype);
  // The bulk kernel's contract: whole rounds, weights staged, 16-byte aligned rows and rounds of
  // scales.
  const int round_scale_bytes = vector ? stats_bulk_round_scale_bytes(p.log2_group, sb) : 0;
  const bool bulk_fits = vector && p.cols % kStatsBulkRoundBytes == 0 && p.cols <= kStatsSmemWeightCols &&
                         round_scale_bytes >= 16 && round_scale_bytes % 16 == 0 && aligned16(p.scales) &&
                         (p.scale_row_stride * std::int64_t(sb)) % 16 == 0;
  if (bulk_fits && forced.stats != StatsDesign::registers) {
    c.design = StatsDesign::bulk;
    c.rows_per_block = kStatsBulkWarps;
    c.ring = bulk_ring(p, device, forced);
    c.smem_bytes = stats_bulk_smem_bytes(p.cols, p.log2_group, sb, c.ring);
  } else if (vector) {
    c.design = StatsDesign::registers;
    c.log2_row_threads = std::min(5, log2_ceil(p.cols / 16));
    c.rows_per_block = kStatsThreads >> c.log2_row_threads;
    const bool whole_rounds = (p.cols / 16) % ((std::int64_t(1) << c.log2_row_threads) * kStatsUnroll) == 0;
    if (p.cols > kStatsSmemWeightCols) {
      c.variant = StatsVariant::global_weights;
      c.smem_bytes = 0;
    } else {
      c.variant = whole_rounds ? StatsVariant::staged_weights_whole_rounds : StatsVariant::staged_weights;
      c.smem_bytes = static_cast<std::size_t>(p.cols) * sizeof(float);
    }
  } else {
    c.design = StatsDesign::generic;
    c.rows_per_block = kGenericStatsRowsPerBlock;
  }
  return c;
}

QuantizeConfig choose_quantize(const ForwardParams& p, bool vector) {
  QuantizeConfig c;
  if (!vector) return c;
  c.vector = true;
  c.qy_t_vector_stores = aligned16(p.qy_t) && p.qy_t_row_stride % 16 == 0;
  const bool whole = p.rows % kTile == 0 && p.cols % kTile == 0 && c.qy_t_vector_stores && p.y == nullptr;
  c.tiles = whole ? QuantizeTiles::whole : QuantizeTiles::any;
  c.smem_bytes = kQuantSmemBytes;
  return c;
}

}  // namespace

ForcedChoices forced_choices() {
  ForcedChoices f;
  f.stats = detail::ChoiceOverride<StatsDesign>::requested(
      "fp8_norm.stats", {{"registers", StatsDesign::registers}, {"bulk", StatsDesign::bulk}});
  f.stats_chunk_rounds = static_cast<int>(detail::override_int("fp8_norm.stats.chunk_rounds", 1, 4).value_or(0));
  f.stats_ring_slots =
      static_cast<int>(detail::override_int("fp8_norm.stats.ring_slots", 2, kStatsBulkMaxSlots).value_or(0));
  f.backward = detail::ChoiceOverride<BackwardTuning>::requested(
      "fp8_norm.backward.tuning", {{"four_runs_cached", BackwardTuning::four_runs_cached},
                                   {"two_runs_streaming", BackwardTuning::two_runs_streaming}});
  return f;
}

bool forward_vector_ok(const ForwardParams& p) {
  const std::int64_t tiles = ((p.rows + kTile - 1) / kTile) * ((p.cols + kTile - 1) / kTile);
  return tiles < (std::int64_t(1) << 31) && p.group_size >= 16 && p.x_row_stride % 16 == 0 && aligned16(p.x) &&
         aligned16(p.weight) && p.qy_row_stride % 16 == 0 && aligned16(p.qy) &&
         (p.y == nullptr || (p.y_row_stride % 8 == 0 && aligned16(p.y)));
}

ForwardConfig choose_forward(const ForwardParams& p, const detail::DeviceInfo& device, const ForcedChoices& forced) {
  ForwardConfig c;
  const std::int64_t keep_rows =
      static_cast<std::int64_t>(kL2KeepFraction * device.l2_bytes) / std::max<std::int64_t>(1, p.x_row_stride);
  c.l2_keep_from_row = std::max<std::int64_t>(0, p.rows - keep_rows);
  const bool vector = forward_vector_ok(p);
  c.stats = choose_stats(p, vector, device, forced);
  c.quantize = choose_quantize(p, vector);
  return c;
}

BackwardTuning choose_backward_tuning(const detail::DeviceInfo& device, BackwardTuning forced) {
  if (forced != BackwardTuning::automatic) return forced;
  const double bytes = device.dram_bytes_per_sm_clock;
  for (const TuningRow& row : kTuningTable)
    if (bytes > row.above && bytes < row.below) return row.tuning;
  return kDefaultTuning;
}

BackwardConfig choose_backward(const BackwardParams& p, const detail::DeviceInfo& device, const ForcedChoices& forced) {
  BackwardConfig c;
  const bool aligned = p.group_size >= 16 && p.x_row_stride % 16 == 0 && aligned16(p.x) && p.dy_row_stride % 8 == 0 &&
                       aligned16(p.dy) && aligned16(p.weight) &&
                       (p.dx == nullptr || (p.dx_row_stride % 8 == 0 && aligned16(p.dx)));
  if (!aligned) return c;
  const BackwardTuning tuning = choose_backward_tuning(device, forced.backward);
  const std::int64_t row_runs = p.cols / kRunCols;
  const BackwardShapeRow* row = nullptr;
  auto find = [&](const auto& table) {
    for (const BackwardShapeRow& r : table)
      if (row_runs <= r.max_row_runs) return &r;
    return static_cast<const BackwardShapeRow*>(nullptr);
  };
  row = tuning == BackwardTuning::two_runs_streaming ? find(kTwoRunsStreaming) : find(kFourRunsCached);
  if (!row) return c;
  c.vector = true;
  c.tuning = tuning;
  c.runs_per_thread = row->runs_per_thread;
  c.log2_row_threads = std::max(5, log2_ceil((row_runs + c.runs_per_thread - 1) / c.runs_per_thread));
  c.rows_per_block = kBwdThreads >> c.log2_row_threads;
  const int row_threads = 1 << c.log2_row_threads;
  const int sb = scale_bytes(p.scale_dtype);
  // Rows of exactly runs * row threads runs (N = 1024, 2048, 4096, 8192) take the variant without
  // per-run bounds tests (20% fewer instructions per row); with 8 runs per thread it would spill.
  const bool exact = c.runs_per_thread != 8 && p.cols == std::int64_t(kRunCols) * c.runs_per_thread * row_threads;
  // Those rows' scales come through the copy pipeline when they are 16-byte chunks.
  const bool staged =
      exact && p.log2_group == 4 && aligned16(p.scales) && (p.scale_row_stride * std::int64_t(sb)) % 16 == 0;
  c.variant = staged ? (row->streaming ? BackwardVariant::staged_scales_streaming : BackwardVariant::staged_scales)
                     : (exact ? BackwardVariant::exact_rows : BackwardVariant::bounds_checked);
  c.smem_bytes = backward_smem_bytes(c.runs_per_thread, row_threads) +
                 (staged ? backward_scale_stage_bytes(c.runs_per_thread, sb) : 0);
  return c;
}

int stats_grid(const StatsConfig& c, std::int64_t rows, int sm_count, int blocks_per_sm) {
  const int per_sm = std::min(kStatsBlocksPerSm, blocks_per_sm);
  return persistent_grid((rows + c.rows_per_block - 1) / c.rows_per_block, std::int64_t(sm_count) * per_sm);
}

int quantize_grid(const QuantizeConfig& c, std::int64_t rows, std::int64_t cols, int sm_count, int blocks_per_sm) {
  const std::int64_t capacity = std::int64_t(sm_count) * blocks_per_sm;
  if (!c.vector) {
    const std::int64_t tiles = ((rows + kGenericTile - 1) / kGenericTile) * ((cols + kGenericTile - 1) / kGenericTile);
    return persistent_grid(tiles, capacity);
  }
  // As many blocks as fit at once, sized so that every block gets the same number of tiles give
  // or take one.
  const std::int64_t tiles = ((rows + kTile - 1) / kTile) * ((cols + kTile - 1) / kTile);
  const std::int64_t per_block = std::max<std::int64_t>(1, (tiles + capacity - 1) / capacity);
  return persistent_grid((tiles + per_block - 1) / per_block, capacity);
}

int backward_grid(const BackwardConfig& c, std::int64_t rows, int sm_count, int blocks_per_sm) {
  const std::int64_t cap = std::int64_t(sm_count) * std::min(kBwdBlocksPerSm, blocks_per_sm);
  if (!c.vector) return persistent_grid(rows, cap);
  return balanced_grid((rows + c.rows_per_block - 1) / c.rows_per_block, cap);
}

std::size_t forward_workspace_bytes(std::int64_t rows, std::int64_t cols, int sm_count) {
  if (rows <= 0 || cols <= 0) return 0;
  return round_up_256(static_cast<std::size_t>(sm_count) * kStatsBlocksPerSm * sizeof(float));
}

std::size_t backward_workspace_bytes(std::int64_t rows, std::int64_t cols, int sm_count) {
  if (rows <= 0 || cols <= 0) return 0;
  return round_up_256(static_cast<std::size_t>(sm_count) * kBwdBlocksPerSm * cols * sizeof(float));
}

}  // namespace fusekit::fp8_norm
