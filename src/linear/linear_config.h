// Launch choices of the linear family as pure functions of the problem and the device (no CUDA
// calls), so the CPU tests check them; linear_cuda.cu fills the problem structs (alignment
// checks included) and runs what these return. Timing stays in linear_cuda.cu /
// linear_cublaslt.cpp: where autotuning is on, the forward's path here is its first guess and the
// candidates below are what it times; where it is off, or a problem is too small to time, the
// choice here is final.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/device_info.h"
#include "fusekit/activation.h"
#include "fusekit/tensor.h"
#include "linear/linear_cublaslt.h"
#include "linear/linear_params.h"
#include "linear/linear_paths.h"

namespace fusekit::linear {

// ---- forward ---------------------------------------------------------------------------------

struct ForwardProblem {
  std::int64_t m = 0, n = 0, k = 0;
  DType dtype = DType::bf16;
  Activation activation = Activation::none;
  bool bias = false;
  bool pre = false;  // the pre-activation is stored too
  // pre's leading dimension a multiple of 8 and pre 16-byte aligned (cuBLASLt's aux output).
  bool pre_fits_aux = false;
  // The fused CUTLASS kernel can take the call: 16-bit dtype, K, N and every leading dimension
  // multiples of 8, every pointer 16-byte aligned (cutlass_eligible in linear_cuda.cu).
  bool cutlass_ok = false;
};

// The problem of a call (alignment checks on its pointers and leading dimensions included).
ForwardProblem forward_problem(const ForwardParams& p);

// The cuBLASLt epilogue that computes this forward in one GEMM, if there is one (table below).
std::optional<lt::Epilogue> cublaslt_epilogue(const ForwardProblem& p);

// The untimed choice of path. `forced` (a test's or benchmark's override, automatic if none) wins
// where it can serve the call.
ForwardPath choose_forward_path(const ForwardProblem& p, ForwardPath forced = ForwardPath::automatic);

// The paths worth timing, `guess` first; fewer than two means nothing to tune. f32 keeps its rule;
// bias / relu through cuBLASLt's own epilogue cost the plain GEMM and are not timed.
std::vector<ForwardPath> forward_candidates(const ForwardProblem& p, ForwardPath guess);

// Whether a problem of this size is timed (autotuning on and at least lt::kMinTimedFlops).
bool timed_problem(std::int64_t m, std::int64_t n, std::int64_t k, bool autotune);

// ---- backward --------------------------------------------------------------------------------

struct BackwardProblem {
  std::int64_t m = 0, n = 0, k = 0;  // m, n, k >= 1
  DType dtype = DType::bf16;
  Activation activation = Activation::none;
  bool dx = false, dw = false, dbias = false;
  // N, K and every leading dimension multiples of 8; dout, pre, w and dx 16-byte aligned (what
  // the dz-in-dgrad kernel's TMA and forming warps need).
  bool dz_in_dgrad_aligned = false;
  // A gated backward with gate and up in halves: a dz unit's gate and up columns lie F apart,
  // which the dz-in-dgrad kernel's units (whole column slices) do not follow.
  bool gated_halves = false;
  // dx multiplied by the input's activation derivative (linear_backward_through_input_activation):
  // the dz-in-dgrad kernel writes plain dx.
  bool through_input_activation = false;
};

// How dz is formed, by the dx GEMM's output width K and the problem's size: the first row whose
// bounds hold. The separate pass costs about 6 M N bytes against 4 M N K flops, a share of the
// backward that falls as 1 / K, which the CUTLASS dx GEMM must win back against cuBLAS's; below
// 2^36 flops the pass is short and the cuBLASLt GEMMs are tuned per shape (bench: linear bwd relu
// (8191, 4096, 12296), (8192, 4096, 16384), (16384, 8192, 8192), (8192, 16384, 4096), H200). A
// narrow dx loses in the CUTLASS dx GEMM more than the pass costs (bench: linear bwd gelu_tanh
// (16384, 768, 3072) 463 us inside against 309 separate, (16384, 2048, 8192) 1948 against 1776).
struct DzRouteRow {
  std::int64_t min_k;  // K at least
  std::int64_t max_k;  // K at most
  double min_flops;    // 2 M N K at least
  BackwardPath path;
};
inline constexpr DzRouteRow kDzRoutes[] = {
    {4096, 6144, 68719476736.0 /* 2^36 */, BackwardPath::dz_in_dgrad},
    {0, INT64_MAX, 0.0, BackwardPath::separate_dz},
};

struct BackwardPlan {
  BackwardPath path = BackwardPath::no_dz;
  std::int64_t first_rows = 0;  // dz_in_dgrad: rows the elementwise pass forms first (multiple of 128)
};

// The problem of a call (alignment checks on its pointers and leading dimensions included).
BackwardProblem backward_problem(const BackwardParams& p);

// Whether the dz-in-dgrad kernel can serve the call (dtype, activation, dx asked, int sizes).
bool dz_in_dgrad_eligible(const BackwardProblem& p);

// The dz route and, for dz_in_dgrad, the rows formed before the kernel. `forced`: a test's or
// benchmark's route (automatic if none), obeyed where it can serve; `forced_first_rows`: a row
// count for the dz-in-dgrad path (rounded down to a multiple of 128).
BackwardPlan choose_backward(const BackwardProblem& p, const detail::DeviceInfo& device,
                             BackwardPath forced = BackwardPath::automatic,
                             std::optional<long long> forced_first_rows = std::nullopt);

// ---- elementwise kernels (activation, dz pass, column sums) ----------------------------------

inline constexpr int kElementwiseThreads = 256;

struct ElementwiseGrid {
  std::int64_t gx = 0, gy = 0;
};

// Column blocks of kElementwiseThreads threads covering a row of n elements in `vec`-element
// chunks, and block rows to make about 32 blocks per SM in total (each block walks rows with a
// stride of gy). m, n >= 1.
ElementwiseGrid elementwise_grid(std::int64_t m, std::int64_t n, int vec, int sm_count);

// Block rows of the dbias column sums: about 1024 blocks in all (one wave at full occupancy on a
// 132-SM GPU), each leaving one float32 partial row. A function of M and N only, not of the GPU,
// so dbias is summed in the same order on every device. m, n >= 1.
int dbias_slots(std::int64_t m, std::int64_t n);

// Threads per block of the dz pass: the row's chunks split evenly over the grid's column blocks,
// rounded up to whole warps.
int dz_pass_threads(std::int64_t n, int vec, std::int64_t gx);

// ---- gated forward ---------------------------------------------------------------------------

struct GatedForwardProblem {
  std::int64_t m = 0, f = 0, k = 0;
  DType dtype = DType::bf16;
  GatedLayout layout = GatedLayout::interleaved;
  // What the epilogue kernel needs of the views: row-major W, K and every x / W row stride
  // multiples of 8 and x, W 16-byte aligned (TMA); F a multiple of 4; pre rows 16-byte aligned
  // and y rows 8-byte aligned (its stores of whole 8-column blocks); bias 4-byte aligned.
  bool epilogue_aligned = false;
};

GatedForwardProblem gated_forward_problem(const GatedForwardParams& p);

// The epilogue kernel wherever it can serve (16-bit dtype, interleaved layout, aligned views,
// M, F, K >= 1); else the GEMM then the gated pass. `forced` wins where it can serve.
GatedForwardPath choose_gated_forward_path(const GatedForwardProblem& p,
                                           GatedForwardPath forced = GatedForwardPath::automatic);

}  // namespace fusekit::linear
