#include "norm/norm_config.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <string>

#include "core/overrides.h"
#include "fusekit/error.h"

namespace fusekit::norm {

namespace {

constexpr std::int64_t kAnyLength = std::numeric_limits<std::int64_t>::max();

// How rows of up to `max_vectors` 16-byte vectors (and more than the previous line's) are spread
// over threads: either a fixed number of threads per row (the vectors per thread follow) or a
// fixed number of vectors per thread (whole warps follow).
struct RowRule {
  std::int64_t max_vectors;
  int threads_per_row;     // > 0: fixed
  int vectors_per_thread;  // > 0: fixed
  bool keep_g = false;     // backward: g = dy * w kept in registers between the passes
  int block_threads = 0;   // backward: threads per block (0: kLongRowBlocks)
};

// Forward. One warp per row up to 127 vectors; rows of exactly 128 (N = 1024 in 16-bit types) on
// two warps at two vectors per lane, which also turns on the next wave's L2 request (bench:
// layer_norm / rms_norm fwd (16384, 1024), H200). Longer rows: 4 vectors per thread, or
// kForwardPartialRowVectors where the row does not fill them exactly.
constexpr RowRule kForwardRows[] = {
    {127, 32, 0},
    {128, 64, 0},
    {kAnyLength, 0, 4},
};
// Vectors per thread of the forward's longer rows that do not fill 4 per thread exactly (a partial
// last vector, or N not a multiple of 128 vectors), where 512 threads cover them at that (bench,
// H200, % of copy at 3 and at 4 vectors: rms_norm fwd (32768, 2049) 84% / 60%, (8192, 5001)
// 75% / 64%; layer_norm fwd (32768, 2049) 69% / 59%, (16384, 3000) 83% / 82%).
constexpr int kForwardPartialRowVectors = 3;

// Backward, by source and dbias. Short rows (up to one warp at 4 vectors) run one warp per row in
// 256-thread blocks (512 up to 32 vectors); LayerNorm's dbias from x at 97..128 vectors two warps
// per row, halving the dweight / dbias sums per lane (bench: layer_norm bwd (16384, 1024), H200).
// Longer rows: the vectors per thread and kept g measured per row length (bench: layer_norm and
// rms_norm bwd at N = 2048..12288, H200).
constexpr RowRule kBackwardRowsFromXWithDbias[] = {
    {32, 32, 0, false, 512},  {96, 32, 0, false, 256},  {128, 64, 0, false, 256},
    {640, 0, 3, true},        {1024, 0, 4, false},      {1536, 0, 3, true},
    {kAnyLength, 0, 4, false},
};
constexpr RowRule kBackwardRowsFromX[] = {
    {32, 32, 0, false, 512}, {128, 32, 0, false, 256}, {512, 0, 3, true},          {640, 0, 3, false},
    {1024, 0, 2, false},     {1280, 0, 4, true},       {kAnyLength, 0, 4, false},
};
// Backward rows from x whose vectors per thread differ from the tables above (g never kept): by
// dbias, rows longer than 128 vectors, a partial last vector and the residual backward (dsum), whose
// ring of three rows a slot shifts the balance to more threads per row (bench: layer_norm /
// rms_norm bwd and their _residual twins at 18 row lengths 1536..12288, 64 Mi elements, H200:
// rms_norm_residual (32752, 2049) 209.5 -> 149.8 us, (8192, 8192) 189.8 -> 141.8 us; layer_norm
// (8193, 8191) 180.1 -> 144.1 us, layer_norm_residual 212.5 -> 174.0 us).
struct BackwardVectorsRule {
  bool dsum_only;  // only the residual backward
  bool bias_grad;
  bool tail;  // only rows whose last vector is partial
  std::int64_t min_vectors, max_vectors;
  int vectors_per_thread;
};
constexpr BackwardVectorsRule kBackwardVectorsRules[] = {
    {true, false, true, 129, 1536, 3},   // not 4 with g kept
    {true, false, false, 641, 1024, 4},  // not 2 at two blocks per SM
    {true, true, false, 129, 512, 2},    // not 3 with g kept
    {false, true, true, 641, 1024, 2},   // not 4
    // RMSNorm's tail rows (bench, H200, % of copy at 4 vectors and at the table's: rms_norm bwd
    // (32768, 2049) 73% / 69%, (8192, 4095) 73% / 63%, (8192, 5001) 80% / 57%; with dbias the
    // table's stay ahead: layer_norm bwd (32768, 2049) 70% at 3, 52% at 4).
    {false, false, true, 129, kAnyLength, 4},
};

constexpr RowRule kBackwardRowsFromY[] = {
    {32, 32, 0, false, 512},
    {128, 32, 0, false, 256},
    {640, 0, 3, false},
    {kAnyLength, 0, 4, false},
};

// Backward blocks of rows longer than one warp's 4 vectors, by threads per row: rows of up to 4
// warps grouped into blocks of at most 384 threads (bench: layer_norm bwd (32768, 2048)), longer rows
// in 512 (one block per SM at ~128 registers).
struct BlockRule {
  int max_threads_per_row;
  int block_threads;
};
constexpr BlockRule kLongRowBlocks[] = {{128, 384}, {kMaxThreadsPerRow, 512}};

// Forward rows of one warp: at most this many blocks per SM in the grid, beyond which blocks
// walk rows (bench: fwd (16384, 1024), H200).
constexpr int kForwardOneWarpBlocksPerSm = 128;

// Clusters of two blocks pre-sum dweight and dbias where those partial rows are largest (bench:
// layer_norm bwd (4096, 16384), H200).
constexpr int kClusterBlocks = 2;
constexpr std::int64_t kClusterMinCols = 16384;

// LayerNorm with dbias from x at 1024 vectors per row runs on 27/32 of the SMs' blocks (bench:
// layer_norm bwd (8192, 8192) and (16384, 8192), H200).
constexpr std::int64_t kPartialGridVectors = 1024;
constexpr int kPartialGridNumerator = 27, kPartialGridDenominator = 32;

// Backward grids by rows per SM: each row group takes at least this many rows (the grid never
// drops below one block per SM for it), so that a block's fixed costs - staging the weight
// columns, filling its ring, a partial row of dweight / dbias written and read again by the
// reduction - are shared by several rows. Batches of a few rows per SM keep one row per group:
// their latency is one row's.
struct GridRowRule {
  std::int64_t max_rows_per_sm;
  int min_rows_per_group;
};
constexpr GridRowRule kBackwardGridRows[] = {{8, 1}, {kAnyLength, 4}};

template <std::size_t N>
const RowRule& rule_for(const RowRule (&table)[N], std::int64_t vectors) {
  for (const RowRule& r : table)
    if (vectors <= r.max_vectors) return r;
  return table[N - 1];
}

struct RowShape {
  int threads_per_row = 0;
  int vectors_per_thread = 0;  // 0: no row kernel
};

// Threads per row and vectors per thread from a rule; `forced_vectors` replaces a fixed vectors
// per thread. No row kernel when the row needs more than kMaxThreadsPerRow threads.
RowShape row_shape(const RowRule& rule, std::int64_t vectors, int forced_vectors) {
  RowShape s;
  if (rule.threads_per_row > 0) {
    s.threads_per_row = rule.threads_per_row;
    s.vectors_per_thread = static_cast<int>((vectors + rule.threads_per_row - 1) / rule.threads_per_row);
    return s;
  }
  s.vectors_per_thread = forced_vectors > 0 ? forced_vectors : rule.vectors_per_thread;
  const std::int64_t per_warp = std::int64_t(s.vectors_per_thread) * 32;
  const std::int64_t threads = (vectors + per_warp - 1) / per_warp * 32;
  if (threads > kMaxThreadsPerRow) return RowShape{};
  s.threads_per_row = static_cast<int>(threads);
  return s;
}

int vector_width(int element_bytes) { return 16 / element_bytes; }

// Persistent grid: every resident block slot once, or fewer blocks when rows are few.
int persistent_grid(int blocks_per_sm, int rows_per_block, std::int64_t rows, const detail::DeviceInfo& device) {
  const std::int64_t needed = (rows + rows_per_block - 1) / rows_per_block;
  return static_cast<int>(
      std::max<std::int64_t>(1, std::min<std::int64_t>(needed, std::int64_t(device.sm_count) * blocks_per_sm)));
}

// The fewest blocks (a multiple of `multiple`, at most `max_blocks`, itself a multiple) whose row
// groups take no more rows each than `max_blocks` blocks would: 4096 rows on 132 one-group blocks
// are 31.03 rows per group, so 4 groups would take a 32nd row while 128 wait; 128 blocks take 32.
int balanced_blocks(int max_blocks, int rows_per_block, std::int64_t rows, int multiple) {
  const std::int64_t needed = (rows + rows_per_block - 1) / rows_per_block;
  std::int64_t blocks = std::min<std::int64_t>(needed, max_blocks);
  const std::int64_t slots = std::int64_t(max_blocks) * rows_per_block;
  const std::int64_t per_group = (rows + slots - 1) / slots;
  const std::int64_t groups = (rows + per_group - 1) / per_group;
  blocks = std::min<std::int64_t>(blocks, (groups + rows_per_block - 1) / rows_per_block);
  blocks = (blocks + multiple - 1) / multiple * multiple;
  return static_cast<int>(std::max<std::int64_t>(multiple, blocks));
}

// The most blocks (a multiple of `multiple`) a backward of `rows` rows may take under
// kBackwardGridRows.
int few_rows_blocks(std::int64_t rows, int rows_per_block, int multiple, const detail::DeviceInfo& device) {
  const std::int64_t rows_per_sm = (rows + device.sm_count - 1) / device.sm_count;
  int min_rows = 1;
  for (const GridRowRule& r : kBackwardGridRows)
    if (rows_per_sm <= r.max_rows_per_sm) {
      min_rows = r.min_rows_per_group;
      break;
    }
  if (min_rows <= 1) return std::numeric_limits<int>::max();
  const std::int64_t groups = (rows + min_rows - 1) / min_rows;
  const std::int64_t blocks = std::max<std::int64_t>((groups + rows_per_block - 1) / rows_per_block, device.sm_count);
  const std::int64_t rounded = (blocks + multiple - 1) / multiple * multiple;
  return static_cast<int>(std::min<std::int64_t>(rounded, std::numeric_limits<int>::max() / 2));
}

// Shared memory one block of `v` may take for its ring without lowering the blocks per SM below
// what its registers and threads allow, or below `blocks_cap` when that is smaller (an SM holds
// about the opt-in limit plus 1 KB, and 1 KB of it is reserved per block).
std::size_t ring_budget(const BackwardVariant& v, int block_threads, int blocks_cap, const detail::DeviceInfo& device,
                        const KernelOccupancy& occupancy) {
  int blocks = occupancy.backward_blocks_per_sm(v, block_threads, 0);
  if (blocks_cap > 0) blocks = std::min(blocks, blocks_cap);
  const std::size_t optin = device.max_smem_per_block_optin;
  const std::size_t per_block = (optin + 1024) / std::max(1, blocks) - 1024;
  const std::size_t limit = std::min(per_block, optin);
  return limit - std::min(limit, occupancy.backward_static_smem(v));
}

// The deepest ring of 2..max_stages rows of `row_slot_bytes` beside `fixed_bytes` within
// `budget`, or 0.
int ring_stages(std::size_t row_slot_bytes, std::size_t fixed_bytes, std::size_t budget, int max_stages) {
  for (int stages = max_stages; stages >= 2; --stages)
    if (fixed_bytes + stages * row_slot_bytes <= budget) return stages;
  return 0;
}

// The backward row kernel for a problem, with its geometry and shared memory (no grid), and the
// variant that launches in clusters where that pays; nullopt: the generic kernel.
struct BackwardPlan {
  BackwardVariant variant;
  std::optional<BackwardVariant> cluster_variant;
  RowGeometry geometry{};
  int block_threads = 0;
  std::size_t smem_bytes = 0;
};

std::optional<BackwardPlan> plan_backward(const BackwardProblem& problem, const detail::DeviceInfo& device,
                                          const KernelOccupancy& occupancy, const LaunchOverrides& overrides) {
  const int vec = vector_width(problem.element_bytes);
  if (!problem.aligned) return std::nullopt;
  // A row whose last vector is partial takes the row kernels' tail variants (masked last vector).
  const std::int64_t vectors = (problem.cols + vec - 1) / vec;
  const bool tail = problem.cols % vec != 0;
  const std::int64_t pitch = vectors * vec;  // elements per row in shared memory
  const RowRule& rule = problem.from_output ? rule_for(kBackwardRowsFromY, vectors)
                        : problem.bias_grad ? rule_for(kBackwardRowsFromXWithDbias, vectors)
                                            : rule_for(kBackwardRowsFromX, vectors);
  const int by_rule =
      problem.from_output ? 0 : backward_vectors_by_rule(problem.dsum, problem.bias_grad, vectors, tail);
  const int vectors_asked = overrides.backward_vectors > 0 ? overrides.backward_vectors : by_rule;
  const RowShape shape = row_shape(rule, vectors, vectors_asked);
  if (shape.vectors_per_thread == 0) return std::nullopt;
  const int tpr = shape.threads_per_row, iters = shape.vectors_per_thread;

  int block = rule.block_threads;
  if (block == 0)
    for (const BlockRule& b : kLongRowBlocks)
      if (tpr <= b.max_threads_per_row) {
        block = b.block_threads;
        break;
      }
  if (overrides.backward_block > 0) block = overrides.backward_block;
  BackwardPlan plan;
  plan.geometry.threads_per_row = tpr;
  plan.geometry.rows_per_block = std::max(1, std::min(block / tpr, tpr > 32 ? kMaxRowGroups - 1 : kMaxRowGroups));
  plan.block_threads = tpr * plan.geometry.rows_per_block;

  const bool keep_g = rule.keep_g && vectors_asked == 0 && tpr > 32;
  const bool full = !problem.bias_grad && iters == 4 && tpr <= 256 && problem.cols == std::int64_t(tpr) * iters * vec;
  // Full rows first, then kept g, each where compiled for the source.
  auto pick = [&](Source source) {
    BackwardVariant v{iters, source, problem.bias_grad};
    v.dsum = problem.dsum;
    v.tail = tail;
    BackwardVariant refined = v;
    if (full) refined.full_rows = true;
    else if (keep_g) refined.keep_g = true;
    return is_compiled(refined) ? refined : v;
  };

  // A ring slot: a row of dy and of the input, and of dsum in the residual backward where that
  // leaves room for a ring (else dsum is read from memory).
  const std::size_t row_bytes = std::size_t(plan.geometry.rows_per_block) * pitch * problem.element_bytes;
  std::size_t slot = 2 * row_bytes;
  const std::size_t column = std::size_t(pitch) * sizeof(float);
  const int max_stages = overrides.backward_stages > 0 ? overrides.backward_stages : kMaxStages;
  BackwardVariant v = pick(Source::x);
  int arrays = 1;
  if (problem.from_output) {
    v = pick(Source::y);
    arrays = 3;
    if (ring_stages(slot, 3 * column, ring_budget(v, plan.block_threads, 0, device, occupancy), max_stages) == 0) {
      v = pick(Source::y_uncached);
      arrays = 1;
    }
  }
  plan.variant = v;
  plan.geometry.cached_columns = arrays == 3;
  // The residual backward's dsum rows may ride in the ring where that still leaves two stages at
  // the blocks per SM the registers allow: bulk copies issued rows ahead, where a read as dx is
  // formed waits on L2 after the row reduction (bench: rms_norm_residual bwd (32768, 2048) 138 us
  // against 203, H200).
  if (problem.dsum && overrides.backward_ring_dsum >= 0 &&
      ring_stages(3 * row_bytes, column, ring_budget(v, plan.block_threads, 0, device, occupancy), max_stages) >= 2) {
    plan.geometry.ring_dsum = 1;
    slot = 3 * row_bytes;
  }
  int stages = ring_stages(slot, arrays * column, ring_budget(v, plan.block_threads, 0, device, occupancy), max_stages);
  // Where two rows of ring do not fit beside the columns at the blocks per SM the registers
  // allow, fewer blocks per SM get the room (bench: rms_norm bwd (8192, 10240), H200).
  for (int cap = occupancy.backward_blocks_per_sm(v, plan.block_threads, 0) - 1; stages < 2 && cap >= 1; --cap)
    stages = ring_stages(slot, arrays * column, ring_budget(v, plan.block_threads, cap, device, occupancy), max_stages);
  if (stages < 2) return std::nullopt;
  plan.geometry.stages = stages;
  plan.smem_bytes = arrays * column + stages * slot;
  if (iters == 4 && problem.bias_grad && problem.cols >= kClusterMinCols)
    plan.cluster_variant = BackwardVariant{4, v.source, true, false, true, false, problem.dsum, tail};
  return plan;
}

int backward_generic_grid(std::int64_t rows, const detail::DeviceInfo& device, const KernelOccupancy& occupancy) {
  return persistent_grid(occupancy.backward_generic_blocks_per_sm(), 1, rows, device);
}

}  // namespace

LaunchOverrides read_launch_overrides() {
  LaunchOverrides o;
  o.forward_vectors = static_cast<int>(detail::override_int("norm.forward.vectors", 1, 4).value_or(0));
  o.backward_vectors = static_cast<int>(detail::override_int("norm.backward.vectors", 1, 4).value_or(0));
  o.backward_block = static_cast<int>(detail::override_int("norm.backward.block", 128, 512).value_or(0));
  o.backward_stages = static_cast<int>(detail::override_int("norm.backward.stages", 2, kMaxStages).value_or(0));
  o.backward_cluster = static_cast<int>(detail::override_int("norm.backward.cluster", 1, 8).value_or(0));
  if (auto ring = detail::override_choice<int>("norm.backward.ring_dsum", {{"on", 1}, {"off", -1}}))
    o.backward_ring_dsum = *ring;
  if (o.backward_cluster & (o.backward_cluster - 1))
    throw Error(ErrorKind::invalid_argument, "fusekit.override", "norm.backward.cluster", "1, 2, 4 or 8",
                std::to_string(o.backward_cluster));
  return o;
}

ElementShape element_shape(std::int64_t cols) {
  ElementShape shape;
  if (cols <= 0 || cols > std::int64_t(kElementBlockThreads) * kElementMaxPerThread) return shape;
  int tpr = 32;
  while (std::int64_t(tpr) * kElementMaxPerThread < cols) tpr *= 2;
  shape.threads_per_row = tpr;
  shape.elements_per_thread = std::int64_t(tpr) * 4 >= cols ? 4 : 8;
  return shape;
}

ForwardLaunch choose_forward_launch(const ForwardProblem& problem, const detail::DeviceInfo& device,
                                    const KernelOccupancy& occupancy, const LaunchOverrides& overrides) {
  ForwardLaunch launch;
  const int vec = vector_width(problem.element_bytes);
  RowShape shape;
  if (problem.aligned) {
    const std::int64_t vectors = (problem.cols + vec - 1) / vec;
    const RowRule& rule = rule_for(kForwardRows, vectors);
    const int residual = problem.residual ? residual_forward_vectors(vectors, problem.cols % vec != 0) : 0;
    shape = row_shape(rule, vectors, overrides.forward_vectors > 0 ? overrides.forward_vectors : residual);
    if (overrides.forward_vectors == 0 && residual == 0 && rule.threads_per_row == 0 &&
        problem.cols != std::int64_t(shape.threads_per_row) * shape.vectors_per_thread * vec) {
      const RowShape partial = row_shape(rule, vectors, kForwardPartialRowVectors);
      if (partial.vectors_per_thread > 0) shape = partial;
    }
  }
  if (shape.vectors_per_thread == 0) {
    launch.grid = persistent_grid(occupancy.forward_generic_blocks_per_sm(), 1, problem.rows, device);
    launch.elements = element_shape(problem.cols);
    return launch;
  }
  const int tpr = shape.threads_per_row;
  launch.generic = false;
  launch.variant.vectors_per_thread = shape.vectors_per_thread;
  // The residual forward adds the residual row as it loads and holds one row in registers, as the
  // plain one does (its own row shapes: residual_forward_vectors). Its L2 request ahead covers
  // both input rows, and the distance comes from its own kernel's occupancy.
  launch.variant.residual = problem.residual;
  launch.variant.tail = problem.cols % vec != 0;
  const bool full = problem.cols == std::int64_t(tpr) * shape.vectors_per_thread * vec && problem.has_weight;
  if (full && problem.kind == Kind::layer_norm && problem.has_bias) launch.variant.rows = ForwardRows::full_layer_norm;
  if (full && problem.kind == Kind::rms_norm && !problem.has_bias) launch.variant.rows = ForwardRows::full_rms_norm;
  // One row per block, so that a block's slot frees as soon as its row is written.
  launch.geometry.threads_per_row = tpr;
  launch.geometry.rows_per_block = 1;
  launch.block_threads = tpr;
  // Rows of one warp: a capped grid whose blocks walk rows. Longer rows: one block per row, each
  // asking L2 for the row of the block that takes its slot in the next wave (one resident grid
  // ahead), so that a new block's loads find L2 (bench: fwd (4096, 16384), H200).
  const bool l2_prefetch = tpr > 32;
  launch.grid = static_cast<int>(
      l2_prefetch ? problem.rows
                  : std::min<std::int64_t>(problem.rows, std::int64_t(device.sm_count) * kForwardOneWarpBlocksPerSm));
  if (l2_prefetch)
    launch.geometry.l2_prefetch_rows =
        occupancy.forward_blocks_per_sm(launch.variant, launch.block_threads) * device.sm_count *
        launch.geometry.rows_per_block;
  return launch;
}

BackwardLaunch choose_backward_launch(const BackwardProblem& problem, const detail::DeviceInfo& device,
                                      const KernelOccupancy& occupancy, const LaunchOverrides& overrides) {
  BackwardLaunch launch;
  const std::optional<BackwardPlan> plan = plan_backward(problem, device, occupancy, overrides);
  if (!plan) {
    launch.grid = backward_generic_grid(problem.rows, device, occupancy);
    launch.elements = element_shape(problem.cols);
  } else {
    launch.generic = false;
    launch.variant = plan->variant;
    launch.geometry = plan->geometry;
    launch.block_threads = plan->block_threads;
    launch.smem_bytes = plan->smem_bytes;
    const int per_sm = occupancy.backward_blocks_per_sm(plan->variant, plan->block_threads, plan->smem_bytes);
    int max_blocks = persistent_grid(per_sm, 1, std::numeric_limits<int>::max(), device);
    const int cluster = overrides.backward_cluster > 0 ? overrides.backward_cluster : kClusterBlocks;
    if (problem.partials && plan->cluster_variant && cluster > 1) {
      const int clusters =
          occupancy.backward_max_clusters(*plan->cluster_variant, plan->block_threads, plan->smem_bytes, cluster);
      if (clusters > 0) {
        launch.cluster = cluster;
        launch.variant = *plan->cluster_variant;
        max_blocks = clusters * cluster;
      }
    }
    const int vec = vector_width(problem.element_bytes);
    if (problem.bias_grad && !problem.from_output && problem.cols == kPartialGridVectors * vec && launch.cluster == 1)
      max_blocks = std::min(max_blocks, device.sm_count * kPartialGridNumerator / kPartialGridDenominator);
    max_blocks = std::min(max_blocks, few_rows_blocks(problem.rows, plan->geometry.rows_per_block, launch.cluster, device));
    launch.grid = balanced_blocks(max_blocks, plan->geometry.rows_per_block, problem.rows, launch.cluster);
  }
  launch.partial_rows = launch.grid / launch.cluster;
  // One column per thread; four (16-byte loads) where that still leaves 1024 blocks or more
  // over both gradients (bench: layer_norm bwd (4096, 16384), H200).
  const int arrays = problem.bias_grad ? 2 : 1;
  launch.reduce_columns_per_thread = problem.cols % 4 == 0 && (problem.cols + 31) / 32 * arrays >= 1024 ? 4 : 1;
  const int columns_per_block = 32 * launch.reduce_columns_per_thread;
  launch.reduce_blocks = (problem.cols + columns_per_block - 1) / columns_per_block;
  return launch;
}

// The residual forward (four row tensors moved, not two) on rows that fill their vectors: 2 per
// thread up to 1024 vectors, 3 up to 1280, where the plain rows take 4 or 3 (bench: rms_norm_residual /
// layer_norm_residual fwd at 18 row lengths, 64 Mi elements, H200: (8192, 8192) 148.5 -> 130.9 us,
// (16384, 4096) 147.0 -> 131.0 us, (6553, 10240) 146.5 -> 135.4 us; rows with a partial last
// vector keep kForwardPartialRowVectors, faster there at 5001, 7167 and 10239).
int residual_forward_vectors(std::int64_t vectors, bool tail) {
  if (tail || vectors <= 128) return 0;
  return vectors <= 1024 ? 2 : vectors <= 1280 ? 3 : 0;
}

int backward_vectors_by_rule(bool dsum, bool bias_grad, std::int64_t vectors, bool tail) {
  for (const BackwardVectorsRule& r : kBackwardVectorsRules)
    if ((!r.dsum_only || dsum) && r.bias_grad == bias_grad && (!r.tail || tail) && vectors >= r.min_vectors &&
        vectors <= r.max_vectors)
      return r.vectors_per_thread;
  return 0;
}

int backward_workspace_rows(std::int64_t rows, std::int64_t cols, int element_bytes, const detail::DeviceInfo& device,
                            const KernelOccupancy& occupancy, const LaunchOverrides& overrides) {
  int grid = backward_generic_grid(rows, device, occupancy);
  // From x (with or without the residual backward's dsum) and from y.
  for (int source = 0; source < 3; ++source) {
    const bool from_output = source == 2;
    for (bool bias_grad : {false, true}) {
      BackwardProblem problem;
      problem.rows = rows;
      problem.cols = cols;
      problem.element_bytes = element_bytes;
      problem.from_output = from_output;
      problem.dsum = source == 1;
      problem.bias_grad = bias_grad;
      problem.partials = true;
      const std::optional<BackwardPlan> plan = plan_backward(problem, device, occupancy, overrides);
      if (!plan) continue;
      const int per_sm = occupancy.backward_blocks_per_sm(plan->variant, plan->block_threads, plan->smem_bytes);
      grid = std::max(grid, persistent_grid(per_sm, plan->geometry.rows_per_block, rows, device));
    }
  }
  return grid;
}

std::size_t partial_bytes(int partial_rows, std::int64_t cols) {
  const std::size_t bytes = 2 * static_cast<std::size_t>(partial_rows) * partial_pitch(cols) * sizeof(float);
  return (bytes + 255) / 256 * 256;
}

}  // namespace fusekit::norm
