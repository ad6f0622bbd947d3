// Launch choices of bias + activation + dropout: which kernel runs a problem, with what tuning
// and grid. Pure host functions of the problem and the device (no CUDA calls), so the CPU tests
// check them; bias_act_dropout_cuda.cu launches what they return.
//
// Forward kernels:
//  * row groups (16-bit types, the vector path, the cheap activations, no pre-activation output,
//    rows that split into whole warps of kRowGroupVectors vectors per thread, N <= 8192): one
//    block per `rows_per_block` rows, the norm forward's shape (bench: bias_act_dropout fwd relu
//    (16384, 4096), (16384, 5120), (32768, 1024), H200). Longer rows and the transcendental
//    activations (issue-bound: the walking grid overlaps their math with the next row's loads)
//    keep the walking grid.
//  * the walking grid (bias_act_dropout_grid.h): one wave of blocks, each thread a fixed chunk of
//    8 columns walking rows; vector accesses where N, the row strides and the pointers allow,
//    element accesses (the generic tuning) elsewhere.
// Backward: the walking grid, vector or generic, always.
#pragma once

#include <cstddef>
#include <cstdint>

#include "bias_act_dropout/bias_act_dropout_grid.h"
#include "core/device_info.h"
#include "fusekit/activation.h"
#include "fusekit/tensor.h"

namespace fusekit::bias_act_dropout {

// ---- tunings of the walking-grid kernels ------------------------------------------------------
//
// kRows: rows a thread loads together; kPipelined: the next rows' loads are issued before the
// current rows' math (one more set of registers); kBlocksPerSm: the occupancy the grid is sized
// for (<= 64 registers for 2 blocks of 512 threads per SM); kL2PrefetchRows: rows beyond the
// loads in flight the forward asks L2 to fetch ahead (prefetch.global.L2; 0 = none).

// The transcendental activations' forward (exp, reciprocal, erf) is issue-bound: one row in
// flight, the next row's loads issued before the math, the row after that asked of L2 (bench:
// bias_act_dropout fwd gelu_tanh (16384, 4096), (16384, 5120), (32768, 1024), H200).
struct TranscendentalForwardTuning {
  static constexpr int kRows = 1;
  static constexpr bool kPipelined = true;
  static constexpr int kBlocksPerSm = 2;
  static constexpr int kL2PrefetchRows = 1;
};
// The cheap activations' forward: two rows loaded together, no register or L2 prefetch.
struct CheapForwardTuning {
  static constexpr int kRows = 2;
  static constexpr bool kPipelined = false;
  static constexpr int kBlocksPerSm = 2;
  static constexpr int kL2PrefetchRows = 0;
};
// The backward reads two tensors per row and always prefetches into registers.
struct BackwardTuning {
  static constexpr int kRows = 1;
  static constexpr bool kPipelined = true;
  static constexpr int kBlocksPerSm = 2;
  static constexpr int kL2PrefetchRows = 0;
};
// Element accesses: the unaligned Philox pairs need more registers (one block per SM), one row
// at a time.
struct GenericTuning {
  static constexpr int kRows = 1;
  static constexpr bool kPipelined = false;
  static constexpr int kBlocksPerSm = 1;
  static constexpr int kL2PrefetchRows = 0;
};
static_assert(CheapForwardTuning::kBlocksPerSm == BackwardTuning::kBlocksPerSm &&
                  TranscendentalForwardTuning::kBlocksPerSm == BackwardTuning::kBlocksPerSm,
              "one grid size for the vector path");

// ---- the activation table ---------------------------------------------------------------------

// Whether an activation's forward goes through the special-function unit: it picks the forward's
// tuning, and only the others (cheap) may run in row groups.
struct ActivationRow {
  Activation activation;
  bool transcendental;
};
inline constexpr ActivationRow kActivationRows[] = {
    {Activation::none, false},         {Activation::relu, false},   {Activation::gelu_erf, true},
    {Activation::gelu_tanh, true},     {Activation::squared_relu, false}, {Activation::leaky_relu, false},
    {Activation::silu, true},
};

constexpr bool transcendental_activation(Activation a) {
  for (const ActivationRow& row : kActivationRows)
    if (row.activation == a) return row.transcendental;
  return false;
}

// ---- row groups -------------------------------------------------------------------------------

inline constexpr int kRowGroupVectors = 2;        // 16-byte vectors per thread
inline constexpr int kRowGroupMaxThreads = 512;   // threads per row at most (N <= 8192)
inline constexpr int kRowGroupMinBlockThreads = 128;

// A row of threads_per_row threads, rows_per_block rows per block (as many whole rows as fit in
// kRowGroupMinBlockThreads threads, at least one); threads_per_row = 0 where the
// row does not split into whole warps of kRowGroupVectors vectors per thread or needs more than
// kRowGroupMaxThreads threads.
struct RowGroupShape {
  int threads_per_row = 0, rows_per_block = 0;
};

// `cols` a multiple of kChunk.
constexpr RowGroupShape row_group_shape(std::int64_t cols) {
  const std::int64_t vectors = cols / kChunk;
  if (vectors % (32 * kRowGroupVectors) != 0 || vectors / kRowGroupVectors > kRowGroupMaxThreads) return {};
  const int tpr = static_cast<int>(vectors / kRowGroupVectors);
  return {tpr, tpr >= kRowGroupMinBlockThreads ? 1 : kRowGroupMinBlockThreads / tpr};
}

// ---- the problem and the launch ---------------------------------------------------------------

struct Problem {
  std::int64_t rows = 0, cols = 0;  // rows >= 1, cols >= 1
  DType dtype = DType::bf16;
  Activation activation = Activation::none;
  // N, every row stride a multiple of kChunk and every pointer (bias included) 16-byte aligned.
  bool vector_ok = false;
  bool pre_activation = false;  // forward only: h = x + bias is stored too
};

enum class ForwardKernel { row_groups, walking_vector, walking_generic };
enum class BackwardKernel { walking_vector, walking_generic };

struct ForwardLaunch {
  ForwardKernel kernel = ForwardKernel::walking_generic;
  bool transcendental = false;  // walking_vector: TranscendentalForwardTuning, else CheapForwardTuning
  TileGrid grid;                // the walking kernels
  RowGroupShape row_groups;     // row_groups
  std::int64_t row_group_blocks = 0;  // row_groups: blocks of the 1-D grid
};

struct BackwardLaunch {
  BackwardKernel kernel = BackwardKernel::walking_generic;
  TileGrid grid;  // its gy partial rows of dbias
};

constexpr int blocks_per_sm(ForwardKernel k, bool transcendental) {
  return k == ForwardKernel::walking_generic ? GenericTuning::kBlocksPerSm
         : transcendental                    ? TranscendentalForwardTuning::kBlocksPerSm
                                             : CheapForwardTuning::kBlocksPerSm;
}

inline ForwardLaunch choose_forward(const Problem& p, const detail::DeviceInfo& device) {
  ForwardLaunch l;
  l.transcendental = transcendental_activation(p.activation);
  const bool sixteen_bit = p.dtype == DType::f16 || p.dtype == DType::bf16;
  if (p.vector_ok && sixteen_bit && !p.pre_activation && !l.transcendental) {
    const RowGroupShape shape = row_group_shape(p.cols);
    if (shape.threads_per_row > 0) {
      l.kernel = ForwardKernel::row_groups;
      l.row_groups = shape;
      l.row_group_blocks = (p.rows + shape.rows_per_block - 1) / shape.rows_per_block;
      return l;
    }
  }
  l.kernel = p.vector_ok ? ForwardKernel::walking_vector : ForwardKernel::walking_generic;
  l.grid = make_grid(p.rows, p.cols, device.sm_count, blocks_per_sm(l.kernel, l.transcendental), kForwardBlockWidth);
  return l;
}

// Rows ahead of its own that each row group asks L2 for: the row of the block that takes its slot
// in the next wave. `blocks_per_sm` is the row-group kernel's occupancy at its block size
// (measured on the device).
constexpr std::int64_t row_group_l2_ahead(const RowGroupShape& shape, int blocks_per_sm, int sm_count) {
  return std::int64_t(blocks_per_sm) * sm_count * shape.rows_per_block;
}

inline BackwardLaunch choose_backward(const Problem& p, const detail::DeviceInfo& device) {
  BackwardLaunch l;
  l.kernel = p.vector_ok ? BackwardKernel::walking_vector : BackwardKernel::walking_generic;
  const int per_sm = p.vector_ok ? BackwardTuning::kBlocksPerSm : GenericTuning::kBlocksPerSm;
  l.grid = make_grid(p.rows, p.cols, device.sm_count, per_sm, kBackwardBlockWidth);
  return l;
}

// Bytes of dbias partial rows (float32, 256-byte multiple) a backward grid writes.
constexpr std::size_t partial_bytes(const TileGrid& g, std::int64_t cols) {
  const std::size_t bytes = static_cast<std::size_t>(g.gy) * cols * sizeof(float);
  return (bytes + 255) / 256 * 256;
}

// The backward's workspace: the alignment (which picks vector or generic) is known only at
// launch time, so the larger of the two grids' partial rows. rows >= 1, cols >= 1.
inline std::size_t backward_workspace_bytes(std::int64_t rows, std::int64_t cols, const detail::DeviceInfo& device) {
  const std::size_t vector = partial_bytes(
      make_grid(rows, cols, device.sm_count, BackwardTuning::kBlocksPerSm, kBackwardBlockWidth), cols);
  const std::size_t generic = partial_bytes(
      make_grid(rows, cols, device.sm_count, GenericTuning::kBlocksPerSm, kBackwardBlockWidth), cols);
  return vector > generic ? vector : generic;
}

}  // namespace fusekit::bias_act_dropout
