// Launch configuration of the LayerNorm / RMSNorm kernels: which compiled kernel variant runs a
// problem, how its rows are spread over threads, the backward's shared-memory ring, and the grid.
// Pure host code without CUDA calls: the device's figures (DeviceInfo) and the occupancy of the
// compiled kernels (KernelOccupancy) come in as arguments, so that the choice is tested on the CPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/device_info.h"
#include "norm/norm_params.h"

namespace fusekit::norm {

// Row groups per block: at most 16 (the per-group mbarrier arrays); rows of more than one warp
// synchronize on hardware barriers 1..15 (0 is __syncthreads), so at most 15 of those.
inline constexpr int kMaxRowGroups = 16;
inline constexpr int kMaxStages = 4;         // rows in flight per row group in the backward's ring
inline constexpr int kGenericThreads = 512;  // block of the generic kernels (one row per block)
inline constexpr int kMaxThreadsPerRow = 512;

// The launch shape of the row kernels, passed to them by value.
struct RowGeometry {
  int threads_per_row;       // a multiple of 32
  int rows_per_block;        // row groups per block (<= kMaxRowGroups)
  int stages;                // backward: rows per group in the shared-memory ring (2..kMaxStages)
  int cached_columns;        // backward from y: 1 where 1/w and b are cached in shared memory
  int l2_prefetch_rows = 0;  // forward: each row asks L2 for the row this far ahead (0: none)
  int ring_dsum = 0;         // residual backward: 1 where the ring carries dsum's rows too
};

// ---- kernel variants --------------------------------------------------------------------------

// Forward rows that fill every thread's vectors, with the usual affine parameters, are compiled
// without the per-vector bounds tests and the weight / bias / kind tests.
enum class ForwardRows : int { any = 0, full_layer_norm = 1, full_rms_norm = 2 };

struct ForwardVariant {
  int vectors_per_thread = 1;  // 16-byte vectors of a row per thread: 1..4
  ForwardRows rows = ForwardRows::any;
  bool residual = false;  // normalizes round(x + residual), optionally writing the sum
  bool tail = false;      // N is not a multiple of the vector: the row's last vector is partial (rows any)
};

// Where the backward's x_hat comes from.
enum class Source : int {
  x = 0,           // x_hat = (x - mean) * rstd
  y = 1,           // x_hat = (y - b) * (1/w), 1/w and b cached as float columns in shared memory
  y_uncached = 2,  // the same with 1/w and b read per use (rows too long for the cache and a ring)
};

// A compiled variant of backward_streaming_kernel. Packed into one int to be a template argument.
struct BackwardVariant {
  int vectors_per_thread = 4;  // 16-byte vectors of a row per thread: 1..4
  Source source = Source::x;
  bool bias_grad = false;  // accumulates dbias
  bool full_rows = false;  // N = threads per row x vectors per thread x vector: no bounds tests
  bool cluster = false;    // launched in clusters whose blocks pre-sum their partial rows
  bool keep_g = false;     // g = dy * w stays in registers from the first pass to the second
  bool dsum = false;       // the residual backward: dx += dsum (from x, i.e. the saved sum, only)
  bool tail = false;       // N is not a multiple of the vector: the row's last vector is partial

  constexpr int pack() const {
    return vectors_per_thread | static_cast<int>(source) << 3 | int(bias_grad) << 5 | int(full_rows) << 6 |
           int(cluster) << 7 | int(keep_g) << 8 | int(dsum) << 9 | int(tail) << 10;
  }
  static constexpr BackwardVariant unpack(int packed) {
    BackwardVariant v;
    v.vectors_per_thread = packed & 7;
    v.source = static_cast<Source>((packed >> 3) & 3);
    v.bias_grad = (packed >> 5) & 1;
    v.full_rows = (packed >> 6) & 1;
    v.cluster = (packed >> 7) & 1;
    v.keep_g = (packed >> 8) & 1;
    v.dsum = (packed >> 9) & 1;
    v.tail = (packed >> 10) & 1;
    return v;
  }
  constexpr bool operator==(const BackwardVariant& o) const { return pack() == o.pack(); }
};

// Every compiled backward variant (per element and weight type), each also compiled with a
// partial last vector (tail) where it is not a full-row or kept-g one (is_compiled). A choice
// falls back to the plain variant where a refinement (full rows, kept g) is not compiled.
inline constexpr BackwardVariant kBackwardVariants[] = {
    // Plain: any row, with and without dbias, each source.
    {1, Source::x, false}, {2, Source::x, false}, {3, Source::x, false}, {4, Source::x, false},
    {1, Source::x, true}, {2, Source::x, true}, {3, Source::x, true}, {4, Source::x, true},
    {1, Source::y, false}, {2, Source::y, false}, {3, Source::y, false}, {4, Source::y, false},
    {1, Source::y, true}, {2, Source::y, true}, {3, Source::y, true}, {4, Source::y, true},
    {1, Source::y_uncached, false}, {2, Source::y_uncached, false}, {3, Source::y_uncached, false},
    {4, Source::y_uncached, false}, {1, Source::y_uncached, true}, {2, Source::y_uncached, true},
    {3, Source::y_uncached, true}, {4, Source::y_uncached, true},
    // Full rows without dbias.
    {4, Source::x, false, true}, {4, Source::y, false, true},
    // g kept in registers, from x.
    {4, Source::x, false, false, false, true}, {3, Source::x, false, false, false, true},
    {3, Source::x, true, false, false, true},
    // Clusters pre-summing dweight and dbias.
    {4, Source::x, true, false, true}, {4, Source::y, true, false, true}, {4, Source::y_uncached, true, false, true},
    // The residual backward (dx += dsum): every variant from x again, so that the plain kernels
    // carry no dsum code (its registers).
    {1, Source::x, false, false, false, false, true}, {2, Source::x, false, false, false, false, true},
    {3, Source::x, false, false, false, false, true}, {4, Source::x, false, false, false, false, true},
    {1, Source::x, true, false, false, false, true}, {2, Source::x, true, false, false, false, true},
    {3, Source::x, true, false, false, false, true}, {4, Source::x, true, false, false, false, true},
    {4, Source::x, false, true, false, false, true},
    {4, Source::x, false, false, false, true, true}, {3, Source::x, false, false, false, true, true},
    {3, Source::x, true, false, false, true, true},
    {4, Source::x, true, false, true, false, true},
};

// Whether a listed variant also has a tail twin (rows of a partial last vector are never full;
// kept g is a refinement the tail rows do without).
constexpr bool has_tail_twin(const BackwardVariant& v) { return !v.tail && !v.full_rows && !v.keep_g; }

constexpr bool is_compiled(const BackwardVariant& v) {
  BackwardVariant listed = v;
  listed.tail = false;
  for (const BackwardVariant& c : kBackwardVariants)
    if (c == listed) return !v.tail || has_tail_twin(listed);
  return false;
}

// Elements per row of the workspace's dweight / dbias partial rows: N rounded up to 8, so that
// the row kernels' 16-byte stores of a partial last vector stay inside the row.
constexpr std::int64_t partial_pitch(std::int64_t cols) { return (cols + 7) / 8 * 8; }

// ---- the element kernels (rows the 16-byte vectors cannot take) ------------------------------

// Block of the element kernels (norm_element_kernels.cu): one team of threads_per_row threads per
// row at a time, kElementBlockThreads / threads_per_row teams.
inline constexpr int kElementBlockThreads = 512;
// Rows up to 512 x 8 = 4096 elements. Longer ones (one team a block, 16 or 32 elements a thread)
// ran slower than the generic kernel: scripts/norm_sweep.py, H200, bf16, N % 8 != 0 from 4096 to
// 16384, forward median 12-24% of copy against 41-42%, backward 11-18% against 12-19%.
inline constexpr int kElementMaxPerThread = 8;

struct ElementShape {
  int threads_per_row = 0;      // a power of two, 32..kElementBlockThreads
  int elements_per_thread = 0;  // 4 or 8; 0: the row is too long (the generic kernel)
};

// The fewest threads per row (a power of two, at least a warp) that hold the row in 8 elements
// a thread or fewer: N <= 256 on one warp, 4096 on the whole block.
ElementShape element_shape(std::int64_t cols);

// ---- inputs -----------------------------------------------------------------------------------

// The occupancy calculator's answers for the compiled kernels of one (element, weight) type pair,
// all at least 1 block. The CUDA launcher asks the device (cached; asking also raises the kernel's
// dynamic shared-memory limit to what it is asked about); a CPU test answers from a table.
class KernelOccupancy {
 public:
  virtual ~KernelOccupancy() = default;
  virtual int forward_blocks_per_sm(const ForwardVariant& v, int block_threads) const = 0;
  virtual int forward_generic_blocks_per_sm() const = 0;
  virtual int backward_blocks_per_sm(const BackwardVariant& v, int block_threads, std::size_t smem) const = 0;
  virtual int backward_generic_blocks_per_sm() const = 0;
  virtual std::size_t backward_static_smem(const BackwardVariant& v) const = 0;
  // Clusters of `cluster` blocks resident at once; 0 when one does not fit.
  virtual int backward_max_clusters(const BackwardVariant& v, int block_threads, std::size_t smem,
                                    int cluster) const = 0;
};

// Forced choices for tests and tuning sweeps (override keys "norm.*", core/overrides.h); 0: the
// table decides.
struct LaunchOverrides {
  int forward_vectors = 0;   // vectors per thread of forward rows longer than 128 vectors (1..4)
  int backward_vectors = 0;  // the same for the backward (g then not kept in registers)
  int backward_block = 0;    // threads per block of the backward row kernels (128..512)
  int backward_stages = 0;   // deepest backward ring (2..kMaxStages)
  int backward_cluster = 0;  // blocks per cluster where dweight / dbias pre-sum (1: no clusters)
  int backward_ring_dsum = 0;  // residual backward: 1 dsum through the ring where it fits; else from memory
};
// Reads the norm.* override keys.
LaunchOverrides read_launch_overrides();

struct ForwardProblem {
  std::int64_t rows = 0, cols = 0;
  int element_bytes = 2;  // x and y: 4 (f32) or 2 (f16, bf16)
  Kind kind = Kind::layer_norm;
  bool has_weight = true, has_bias = true;
  bool residual = false;  // the residual forward: x + residual normalized (4 row tensors moved, not 2)
  bool aligned = true;  // row strides and pointers allow 16-byte vectors (any N: a partial last vector is masked)
};

struct BackwardProblem {
  std::int64_t rows = 0, cols = 0;
  int element_bytes = 2;
  bool from_output = false;  // x_hat from y
  bool bias_grad = false;    // dbias asked for
  bool partials = false;     // dweight or dbias asked for: partial rows go to the workspace
  bool dsum = false;         // the residual backward's dx += dsum (from x only)
  bool aligned = true;
};

// ---- outputs ----------------------------------------------------------------------------------

struct ForwardLaunch {
  bool generic = true;  // forward_generic_kernel, kGenericThreads per block; else the row kernel
  ElementShape elements{};  // generic with elements.elements_per_thread > 0: the element kernel instead
  ForwardVariant variant{};
  RowGeometry geometry{};
  int block_threads = kGenericThreads;
  int grid = 1;
};

struct BackwardLaunch {
  bool generic = true;  // backward_generic_kernel, kGenericThreads per block; else the row kernel
  ElementShape elements{};  // generic with elements.elements_per_thread > 0: the element kernel instead
  BackwardVariant variant{};
  RowGeometry geometry{};
  int block_threads = kGenericThreads;
  std::size_t smem_bytes = 0;  // dynamic shared memory: weight columns and the ring
  int grid = 1;
  int cluster = 1;       // blocks per cluster (variant.cluster when above 1)
  int partial_rows = 1;  // workspace rows per gradient: grid / cluster
  // reduce_partials_kernel: columns per thread (1 or 4) and blocks per gradient.
  int reduce_columns_per_thread = 1;
  std::int64_t reduce_blocks = 1;
};

ForwardLaunch choose_forward_launch(const ForwardProblem& problem, const detail::DeviceInfo& device,
                                    const KernelOccupancy& occupancy, const LaunchOverrides& overrides = {});

BackwardLaunch choose_backward_launch(const BackwardProblem& problem, const detail::DeviceInfo& device,
                                      const KernelOccupancy& occupancy, const LaunchOverrides& overrides = {});

// Backward vectors per thread from x (g not kept) where kBackwardVectorsRules sets them, else 0:
// by the residual backward (dsum), dbias, the row's vectors and whether its last vector is partial.
int backward_vectors_by_rule(bool dsum, bool bias_grad, std::int64_t vectors, bool tail);
// The residual forward's vectors per thread where they differ from the plain forward's, else 0.
int residual_forward_vectors(std::int64_t vectors, bool tail);

// Workspace rows per gradient that every backward of (rows, cols) in this type pair fits: the
// largest persistent grid of any variant (from x or y, with or without dbias, row kernel or
// generic). A given call always takes the same variant and grid, so its sums have a fixed order.
int backward_workspace_rows(std::int64_t rows, std::int64_t cols, int element_bytes,
                            const detail::DeviceInfo& device, const KernelOccupancy& occupancy,
                            const LaunchOverrides& overrides = {});

// Bytes of workspace for `partial_rows` rows of dweight and dbias.
std::size_t partial_bytes(int partial_rows, std::int64_t cols);

}  // namespace fusekit::norm
