// CUDA backend of the linear family: chooses, for each call, which GEMM (cuBLASLt or the fused
// CUTLASS kernel) and which elementwise kernels run, and launches them on the caller's stream.
//
// Why each piece is where it is:
//
// Forward. cuBLASLt's bias and relu epilogues are one GEMM as fast as the plain GEMM. Its gelu
// (tanh form, with or without the input saved as "aux") measured 3-11% slower than the plain
// GEMM; it has no epilogue for squared relu, silu or the erf form of gelu, and its relu aux is a
// bit-mask, not the pre-activation this API returns. For all of those a CUTLASS 3 Hopper GEMM
// (linear_cutlass_sm90.cuh) applies bias + activation in its epilogue and stores y and, if asked,
// the pre-activation in the same pass; gelu_tanh keeps cuBLASLt as its fallback. The CUTLASS kernel needs TMA-friendly layouts (16-byte aligned rows, K and N
// multiples of 8); anything else, and f32, takes the unfused path: a cuBLASLt GEMM with the bias
// epilogue, then one elementwise activation kernel (one extra read + write of the output; the same
// numerics as PyTorch's eager F.linear followed by the activation).
//
// Backward. dz = dout * act'(pre) feeds two GEMMs (dx = dz W and dW = dz^T x) as an *input*.
// cuBLASLt's DRELU_BGRAD / DGELU_BGRAD epilogues multiply a GEMM's *output* by act'(aux): they
// fit the derivative of the activation that produced this layer's input x (the next-layer dgrad
// of a transformer MLP, as TransformerEngine uses them), not the derivative of this layer's own
// output activation, which is what linear_backward(dout, pre, ...) is given. Folding act' into
// both GEMMs' operand loads would repeat it once per CTA that reads a dz tile. Instead dz is
// formed once, either by the dx GEMM itself (linear_dgrad_sm90.cuh: a CUTLASS kernel whose idle
// producer warps form dz while its tensor cores run, for large problems with K <= 6144, where the
// separate pass costs the most) or by one elementwise pass into the workspace (skipped for
// activation none); both GEMMs read it. The pass (and the forming warps) also sum dz over rows, so
// dbias costs no extra read of dz (a fixed-order sum of the blocks' partial rows finishes it:
// deterministic). Without an activation the same kernel, not storing anything, sums dout. Both
// beat cuBLASLt's BGRADB epilogue (dbias summed inside the dW GEMM), which slowed that GEMM by
// more than the column sums cost; BGRADB stays selectable for comparisons (linear_paths.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "core/choice_override.h"
#include "core/cuda_check.h"
#include "core/device_info.h"
#include "core/partial_rows.cuh"
#include "linear/linear_cublaslt.h"
#include "linear/linear_cutlass.h"
#include "linear/linear_kernels.cuh"
#include "linear/linear_params.h"
#include "linear/linear_paths.h"

namespace fusekit::linear {

// ---- path override (tests and benchmarks) --------------------------------------------------

namespace {
using ForwardChoice = detail::ChoiceOverride<ForwardPath>;
using BackwardChoice = detail::ChoiceOverride<BackwardPath>;
}  // namespace

const char* forward_path_name(ForwardPath path) {
  switch (path) {
    case ForwardPath::automatic: return "automatic";
    case ForwardPath::cublaslt_epilogue: return "cublaslt_epilogue";
    case ForwardPath::cutlass_fused: return "cutlass_fused";
    case ForwardPath::unfused: return "unfused";
    case ForwardPath::trivial: return "trivial";
  }
  return "unknown";
}

void set_forward_path_override(ForwardPath path) { ForwardChoice::force(path); }
ForwardPath forward_path_override() { return ForwardChoice::forced(); }
ForwardPath last_forward_path() { return ForwardChoice::last(); }
void record_forward_path(ForwardPath path) { ForwardChoice::record(path); }

const char* backward_path_name(BackwardPath path) {
  switch (path) {
    case BackwardPath::automatic: return "automatic";
    case BackwardPath::separate_dz: return "separate_dz";
    case BackwardPath::dz_in_dgrad: return "dz_in_dgrad";
    case BackwardPath::no_dz: return "no_dz";
  }
  return "unknown";
}

void set_backward_path_override(BackwardPath path) { BackwardChoice::force(path); }

namespace {
std::atomic<long long> g_first_rows_override{-1};
}  // namespace
void set_dz_in_dgrad_first_rows(long long rows) { g_first_rows_override = rows; }
BackwardPath last_backward_path() { return BackwardChoice::last(); }

namespace {
// -1: not set by a test; then FUSEKIT_LINEAR_DBIAS=gemm or automatic.
std::atomic<int> g_dbias_override{-1};
}  // namespace

void set_dbias_route_override(DbiasRoute route) { g_dbias_override = static_cast<int>(route); }

DbiasRoute dbias_route() {
  if (const int v = g_dbias_override.load(); v >= 0) return static_cast<DbiasRoute>(v);
  static const DbiasRoute from_env = [] {
    const char* v = std::getenv("FUSEKIT_LINEAR_DBIAS");
    if (v && std::strcmp(v, "gemm") == 0) return DbiasRoute::gemm_epilogue;
    return DbiasRoute::automatic;
  }();
  return from_env;
}

namespace {

constexpr const char* kForwardOp = "linear_forward";
constexpr const char* kBackwardOp = "linear_backward";
constexpr int kThreads = 256;

std::size_t round_up(std::size_t v, std::size_t a) { return (v + a - 1) / a * a; }
bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// Rows of the dz scratch matrix are padded to 8 elements (16 bytes for f16/bf16) so that the two
// backward GEMMs read it at full alignment whatever N is.
std::int64_t dz_row_stride(std::int64_t n) { return static_cast<std::int64_t>(round_up(n, 8)); }

std::size_t dz_bytes(std::int64_t m, std::int64_t n, DType dtype) {
  return round_up(static_cast<std::size_t>(m) * dz_row_stride(n) * dtype_size(dtype), 256);
}

// The column sums behind dbias run on a grid of about 1024 blocks of kThreads (one wave at full
// occupancy on a 132-SM H100/H200), each block walking every dbias_slots-th row and leaving one
// float32 partial row. The count depends on N and M only (not on the GPU), so dbias is summed in
// the same order on every device; the partial rows take at most ~8 MB.
int dbias_slots(std::int64_t m, std::int64_t n) {
  const std::int64_t column_blocks = (n + 8 * kThreads - 1) / (8 * kThreads);
  return static_cast<int>(std::clamp<std::int64_t>(1024 / column_blocks, 1, std::min<std::int64_t>(m, 65535)));
}

std::size_t partial_bytes(std::int64_t m, std::int64_t n) {
  if (m <= 0 || n <= 0) return 0;
  return round_up(static_cast<std::size_t>(dbias_slots(m, n)) * n * sizeof(float), 256);
}

// The dz-in-dgrad path (linear_dgrad_sm90.cuh): dz in units of kDgradUnitRows x kDgradSliceCols.
std::int64_t forming_groups(std::int64_t m) { return (m + sm90::kDgradUnitRows - 1) / sm90::kDgradUnitRows; }
std::int64_t forming_slices(std::int64_t n) { return (n + sm90::kDgradSliceCols - 1) / sm90::kDgradSliceCols; }
std::size_t forming_partial_bytes(std::int64_t m, std::int64_t n) {
  if (m <= 0 || n <= 0) return 0;
  return round_up(static_cast<std::size_t>(forming_groups(m)) * n * sizeof(float), 256);
}
std::size_t forming_flag_bytes(std::int64_t m, std::int64_t n) {
  if (m <= 0 || n <= 0) return 0;
  return round_up(static_cast<std::size_t>(forming_groups(m) * forming_slices(n) + 1) * sizeof(unsigned), 256);
}

template <typename F>
void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32: f(float{}); return;
    case DType::f16: f(__half{}); return;
    case DType::bf16: f(__nv_bfloat16{}); return;
    default: return;  // rejected by the argument checks
  }
}

template <Activation A>
using ActivationTag = std::integral_constant<Activation, A>;

template <typename F>
void dispatch_activation(Activation a, F&& f) {
  switch (a) {
    case Activation::none: f(ActivationTag<Activation::none>{}); return;
    case Activation::relu: f(ActivationTag<Activation::relu>{}); return;
    case Activation::gelu_erf: f(ActivationTag<Activation::gelu_erf>{}); return;
    case Activation::gelu_tanh: f(ActivationTag<Activation::gelu_tanh>{}); return;
    case Activation::squared_relu: f(ActivationTag<Activation::squared_relu>{}); return;
    case Activation::silu: f(ActivationTag<Activation::silu>{}); return;
    default: return;  // leaky_relu is rejected by the argument checks
  }
}

// 16-byte accesses when every row start is 16-byte aligned, element accesses otherwise.
template <typename T>
int vector_width(std::int64_t n, std::initializer_list<std::int64_t> strides,
                 std::initializer_list<const void*> pointers) {
  constexpr int kVec = 16 / sizeof(T);
  if (n % kVec != 0) return 1;
  for (std::int64_t s : strides)
    if (s % kVec != 0) return 1;
  for (const void* p : pointers)
    if (p && !aligned16(p)) return 1;
  return kVec;
}

dim3 elementwise_grid(std::int64_t m, std::int64_t n, int vec, int device_index, const char* op) {
  const std::int64_t chunks = (n + vec - 1) / vec;
  const std::int64_t gx = (chunks + kThreads - 1) / kThreads;
  // About 32 blocks per SM in total; each block walks rows with a stride of gridDim.y.
  const std::int64_t target = std::int64_t(detail::device_info(op, device_index).sm_count) * 32;
  const std::int64_t gy = std::clamp<std::int64_t>((target + gx - 1) / gx, 1, std::min<std::int64_t>(m, 65535));
  return dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
}

void launch_activation(const char* op, DType dtype, Activation act, const void* z, std::int64_t ldz,
                       const void* bias, void* pre, std::int64_t ldpre, void* y, std::int64_t ldy,
                       std::int64_t m, std::int64_t n, int device_index, cudaStream_t stream) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const int vec = vector_width<T>(n, {ldz, ldpre, ldy}, {z, pre, y, bias});
    const dim3 grid = elementwise_grid(m, n, vec, device_index, op);
    const kernels::Rows rows{m, n};
    dispatch_activation(act, [&](auto a) {
      constexpr Activation A = decltype(a)::value;
      constexpr int kVec = 16 / sizeof(T);
      auto kernel = vec == 1 ? kernels::activation_kernel<T, A, 1> : kernels::activation_kernel<T, A, kVec>;
      kernel<<<grid, kThreads, 0, stream>>>(static_cast<const T*>(z), ldz, static_cast<const T*>(bias),
                                            static_cast<T*>(pre), ldpre, static_cast<T*>(y), ldy, rows);
    });
  });
  detail::check_launch(op, "activation_kernel");
}

// Rows of 16-byte chunks each thread of the dz pass loads before it computes any. Two took the
// transcendental activations from latency-bound to nearly memory-bound (Nsight, (8192, 4096,
// 16384) bf16, H200, session 27, us for one row / two / four: gelu_erf 234 / 218 / 240, silu 239
// / 210 / 201, relu 195 / 198 / 197: four cost gelu_erf registers).
constexpr int kDzRowsInFlight = 2;

// dz = dout * act'(pre) into `dz` (null: not stored), and, with `dbias` set, dbias = the column
// sums of dz, through dbias_slots(m, n) partial rows in `partial`. Activation none only sums dout.
// finish_dbias = false leaves the partial rows for the caller to sum (with more rows after them).
void launch_dz(const char* op, DType dtype, Activation act, const void* dout, std::int64_t lddout,
               const void* pre, std::int64_t ldpre, void* dz, std::int64_t lddz, void* dbias,
               float* partial, std::int64_t m, std::int64_t n, int device_index, cudaStream_t stream,
               bool finish_dbias = true) {
  if (!dbias) partial = nullptr;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const int vec = vector_width<T>(n, {lddout, ldpre, dz ? lddz : 0}, {dout, pre, dz});
    dim3 grid = elementwise_grid(m, n, vec, device_index, op);
    if (partial) grid.y = static_cast<unsigned>(dbias_slots(m, n));
    // The row's chunks split evenly over the grid's column blocks (whole warps): with kThreads per
    // block, N = 12296 gave six full blocks and a seventh with one busy thread.
    const std::int64_t chunks = (n + vec - 1) / vec;
    const int threads = static_cast<int>(round_up(static_cast<std::size_t>((chunks + grid.x - 1) / grid.x), 32));
    const kernels::Rows rows{m, n};
    dispatch_activation(act, [&](auto a) {
      constexpr Activation A = decltype(a)::value;
      constexpr int kVec = 16 / sizeof(T);
      auto launch = [&](auto kernel) {
        kernel<<<grid, threads, 0, stream>>>(static_cast<const T*>(dout), lddout, static_cast<const T*>(pre),
                                             ldpre, static_cast<T*>(dz), lddz, partial, rows);
      };
      auto with_width = [&](auto write_dz, auto sums) {
        constexpr bool kWrite = decltype(write_dz)::value, kSums = decltype(sums)::value;
        if (vec == 1) launch(kernels::dz_kernel<T, A, 1, kWrite, kSums, 1>);
        else launch(kernels::dz_kernel<T, A, kVec, kWrite, kSums, kDzRowsInFlight>);
      };
      using Yes = std::true_type;
      using No = std::false_type;
      if constexpr (A == Activation::none) {
        if (partial) with_width(No{}, Yes{});
      } else if (dz && partial) {
        with_width(Yes{}, Yes{});
      } else if (dz) {
        with_width(Yes{}, No{});
      } else if (partial) {
        with_width(No{}, Yes{});
      }
    });
  });
  detail::check_launch(op, "dz_kernel");
  if (dbias && finish_dbias) {
    dispatch_dtype(dtype, [&](auto tag) {
      using T = decltype(tag);
      detail::device::launch_sum_partial_rows(partial, dbias_slots(m, n), n, static_cast<T*>(dbias), stream, op,
                                              "dbias partial-row sum kernel");
    });
  }
}

void zero_rows(const char* op, void* data, std::int64_t rows, std::int64_t cols, std::int64_t ld,
               DType dtype, cudaStream_t stream) {
  if (!data || rows == 0 || cols == 0) return;
  const std::size_t e = dtype_size(dtype);
  detail::check_cuda(cudaMemset2DAsync(data, static_cast<std::size_t>(std::max(ld, cols)) * e, 0,
                                       static_cast<std::size_t>(cols) * e,
                                       static_cast<std::size_t>(rows), stream),
                     op, "cudaMemset2DAsync");
}

// ---- forward -------------------------------------------------------------------------------

// The cuBLASLt epilogue that computes this forward in one GEMM, if there is one.
bool cublaslt_epilogue_for(const ForwardParams& p, lt::Epilogue* e) {
  const bool b = p.bias != nullptr;
  switch (p.activation) {
    case Activation::none:
      if (p.pre) return false;
      *e = b ? lt::Epilogue::bias : lt::Epilogue::none;
      return true;
    case Activation::relu:
      if (p.pre) return false;  // cuBLASLt's relu aux is a bit-mask, not the pre-activation
      *e = b ? lt::Epilogue::relu_bias : lt::Epilogue::relu;
      return true;
    case Activation::gelu_tanh:
      if (!p.pre) {
        *e = b ? lt::Epilogue::gelu_bias : lt::Epilogue::gelu;
        return true;
      }
      // The aux leading dimension must be a multiple of 8 (cublasLt.h, EPILOGUE_AUX_LD).
      if (p.ldpre % 8 != 0 || !aligned16(p.pre)) return false;
      *e = b ? lt::Epilogue::gelu_aux_bias : lt::Epilogue::gelu_aux;
      return true;
    default: return false;
  }
}

bool cutlass_eligible(const ForwardParams& p) {
  if (p.dtype != DType::f16 && p.dtype != DType::bf16) return false;
  constexpr std::int64_t a = sm90::kFusedAlignmentElements;
  if (p.k % a || p.n % a || p.ldx % a || p.ldw % a || p.ldy % a) return false;
  if (p.pre && p.ldpre % a) return false;
  for (const void* ptr : {p.x, p.w, p.bias, static_cast<const void*>(p.y), static_cast<const void*>(p.pre)})
    if (ptr && !aligned16(ptr)) return false;
  return true;
}

ForwardPath choose_forward_path(const ForwardParams& p, lt::Epilogue* e) {
  const bool lt_ok = cublaslt_epilogue_for(p, e);
  switch (forward_path_override()) {
    case ForwardPath::cublaslt_epilogue:
      if (lt_ok) return ForwardPath::cublaslt_epilogue;
      break;
    case ForwardPath::cutlass_fused:
      if (cutlass_eligible(p)) return ForwardPath::cutlass_fused;
      break;
    case ForwardPath::unfused: return ForwardPath::unfused;
    default: break;
  }
  if (p.dtype == DType::f32) {
    // f32: plain float32 GEMMs. Only the exact epilogues (bias, relu) are fused: cuBLASLt's gelu
    // is not promised to be accurate to float32 resolution, the elementwise kernel is.
    const bool exact = p.activation == Activation::none || p.activation == Activation::relu;
    return (lt_ok && exact) ? ForwardPath::cublaslt_epilogue : ForwardPath::unfused;
  }
  // gelu_tanh: the CUTLASS epilogue (sigmoid form, one ex2 and one rcp per element) stays within
  // the plain GEMM's time where cuBLASLt's GELU / GELU_AUX epilogues ran 3-11% over it (H200,
  // session 5, performance-notes.md). The other cuBLASLt epilogues (bias, relu) are kept.
  if (p.activation == Activation::gelu_tanh && cutlass_eligible(p)) return ForwardPath::cutlass_fused;
  if (lt_ok) return ForwardPath::cublaslt_epilogue;
  if (cutlass_eligible(p)) return ForwardPath::cutlass_fused;
  return ForwardPath::unfused;
}

// One column-major operand of a cuBLASLt GEMM: its data, leading dimension and whether the GEMM
// reads it transposed.
struct Operand {
  const void* data;
  std::int64_t ld;
  bool transposed;
};

// D (m x n) = op(A) (m x k) * op(B) (k x n), column-major, without an epilogue: the part the
// forward and both backward GEMMs share.
lt::Gemm column_major_gemm(DType dtype, std::int64_t m, std::int64_t n, std::int64_t k, Operand a,
                           Operand b, void* d, std::int64_t ldd) {
  lt::Gemm g;
  g.dtype = dtype;
  g.trans_a = a.transposed;
  g.trans_b = b.transposed;
  g.m = m;
  g.n = n;
  g.k = k;
  g.a = a.data;
  g.lda = a.ld;
  g.b = b.data;
  g.ldb = b.ld;
  g.d = d;
  g.ldd = ldd;
  return g;
}

// y^T (N x M, column-major) = W (op T of the K x N column-major view of W) * x^T (K x M).
lt::Gemm forward_gemm(const ForwardParams& p, lt::Epilogue e, void* d, std::int64_t ldd) {
  lt::Gemm g = column_major_gemm(p.dtype, p.n, p.m, p.k, {p.w, p.ldw, true}, {p.x, p.ldx, false},
                                 d, ldd);
  g.epilogue = e;
  g.bias = p.bias;
  g.aux = p.pre;
  g.ld_aux = p.ldpre;
  return g;
}

// A GEMM no other path can stand in for found no cuBLASLt algorithm. `gemm` names it in the
// message: "this" (the unfused forward's GEMM), "the dx" or "the dW".
template <typename Params>
[[noreturn]] void no_algorithm(const char* op, const char* gemm, const Params& p) {
  throw Error(ErrorKind::unsupported, op,
              std::string("cuBLASLt has no algorithm for ") + gemm + " GEMM (M = " +
                  std::to_string(p.m) + ", N = " + std::to_string(p.n) + ", K = " +
                  std::to_string(p.k) + ", " + dtype_name(p.dtype) + ")");
}

void run_unfused_forward(const ForwardParams& p, int device_index, cudaStream_t stream) {
  // z = x W^T + b goes where it is kept: the pre-activation output if asked for, else y itself
  // (then the activation runs in place).
  void* z = p.pre ? p.pre : p.y;
  const std::int64_t ldz = p.pre ? p.ldpre : p.ldy;
  const lt::Gemm g = forward_gemm(p, p.bias ? lt::Epilogue::bias : lt::Epilogue::none, z, ldz);
  if (!lt::run(kForwardOp, g, device_index, p.workspace, stream))
    no_algorithm(kForwardOp, "this", p);
  if (p.activation != Activation::none || z != p.y)
    launch_activation(kForwardOp, p.dtype, p.activation, z, ldz, nullptr, nullptr, 0, p.y, p.ldy,
                      p.m, p.n, device_index, stream);
}

// ---- backward ------------------------------------------------------------------------------

// dx^T (K x M) = W^T (the K x N column-major view of W) * dz^T (N x M).
lt::Gemm dx_gemm(const BackwardParams& p, const void* dz, std::int64_t lddz) {
  return column_major_gemm(p.dtype, p.k, p.m, p.n, {p.w, p.ldw, false}, {dz, lddz, false}, p.dx,
                           p.lddx);
}

// dW^T (K x N) = x^T (K x M) * dz (op T of the N x M column-major view of dz); BGRADB sums
// op(B) = dz over the GEMM's k = M: exactly dbias.
constexpr std::int64_t kMinKForFusedDbias = 64;

lt::Gemm dw_gemm(const BackwardParams& p, const void* dz, std::int64_t lddz, bool with_dbias) {
  lt::Gemm g = column_major_gemm(p.dtype, p.k, p.n, p.m, {p.x, p.ldx, false}, {dz, lddz, true},
                                 p.dw, p.lddw);
  if (with_dbias) {
    g.epilogue = lt::Epilogue::bgradb;
    g.bias = p.dbias;
  }
  return g;
}

ForwardPath run_forward_path(const ForwardParams& p, ForwardPath path, lt::Epilogue epilogue,
                             int device_index, cudaStream_t stream);

// ---- forward path tuning ---------------------------------------------------------------------
//
// For the activations cuBLASLt cannot fuse (and gelu_tanh, where its epilogue is slow), two or
// three paths compute the same forward: the fused CUTLASS kernel, cuBLASLt's epilogue, and the
// tuned cuBLASLt GEMM followed by the elementwise activation. Which is fastest depends on the
// shape: the CUTLASS kernel's one tile configuration ran 1762 us at (8192, 16384, 4096) where
// cuBLASLt's best algorithm took 1412 us plus 35 us for the separate activation (H200, session
// 19). So, like the GEMM algorithms (linear_cublaslt.cpp), the first call of a problem times the
// candidate paths on the caller's stream and buffers and keeps the fastest for the process.

struct ForwardKey {
  int device = 0;
  DType dtype = DType::bf16;
  Activation activation = Activation::none;
  bool bias = false, pre = false, cutlass_ok = false, lt_ok = false;
  std::int64_t m = 0, n = 0, k = 0, ldx = 0, ldw = 0, ldy = 0, ldpre = 0;
  bool operator==(const ForwardKey& o) const {
    return device == o.device && dtype == o.dtype && activation == o.activation &&
           bias == o.bias && pre == o.pre && cutlass_ok == o.cutlass_ok && lt_ok == o.lt_ok &&
           m == o.m && n == o.n && k == o.k && ldx == o.ldx && ldw == o.ldw && ldy == o.ldy &&
           ldpre == o.ldpre;
  }
};

struct ForwardKeyHash {
  std::size_t operator()(const ForwardKey& k) const {
    std::size_t h = 1469598103934665603ull;
    auto mix = [&h](std::uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    mix(std::uint64_t(k.device) << 8 | std::uint64_t(k.dtype));
    mix(std::uint64_t(k.activation) << 4 | std::uint64_t(k.bias) << 3 | std::uint64_t(k.pre) << 2 |
        std::uint64_t(k.cutlass_ok) << 1 | std::uint64_t(k.lt_ok));
    for (std::int64_t v : {k.m, k.n, k.k, k.ldx, k.ldw, k.ldy, k.ldpre}) mix(std::uint64_t(v));
    return h;
  }
};

// Read on every automatic forward: lookups share the lock, only a problem's first call takes it
// alone.
struct ForwardPathCache {
  std::shared_mutex mutex;
  std::unordered_map<ForwardKey, ForwardPath, ForwardKeyHash> paths;
};

ForwardPathCache& forward_path_cache() {
  static ForwardPathCache* c = new ForwardPathCache();  // never destroyed, like the GEMM plans
  return *c;
}

// The paths worth timing for this call, best guess first; fewer than two means nothing to tune.
// f32 keeps its exact-epilogue rule (choose_forward_path); bias / relu through cuBLASLt's own
// epilogue cost the plain GEMM and are not timed against slower paths.
std::vector<ForwardPath> forward_candidates(const ForwardParams& p, lt::Epilogue epilogue,
                                            ForwardPath guess) {
  std::vector<ForwardPath> c;
  if (p.dtype == DType::f32) return c;
  const bool lt_ok = cublaslt_epilogue_for(p, &epilogue);
  if (lt_ok && (p.activation == Activation::none || p.activation == Activation::relu)) return c;
  c.push_back(guess);
  auto add = [&c](ForwardPath path) {
    if (std::find(c.begin(), c.end(), path) == c.end()) c.push_back(path);
  };
  if (cutlass_eligible(p)) add(ForwardPath::cutlass_fused);
  if (lt_ok) add(ForwardPath::cublaslt_epilogue);
  add(ForwardPath::unfused);
  return c;
}

ForwardPath tuned_forward_path(const ForwardParams& p, lt::Epilogue epilogue, ForwardPath guess,
                               int device_index, cudaStream_t stream) {
  if (!autotune_enabled() || 2.0 * double(p.m) * double(p.n) * double(p.k) < lt::kMinTimedFlops) return guess;
  ForwardKey key;
  key.device = device_index;
  key.dtype = p.dtype;
  key.activation = p.activation;
  key.bias = p.bias != nullptr;
  key.pre = p.pre != nullptr;
  key.cutlass_ok = cutlass_eligible(p);
  lt::Epilogue unused = lt::Epilogue::none;
  key.lt_ok = cublaslt_epilogue_for(p, &unused);
  key.m = p.m;
  key.n = p.n;
  key.k = p.k;
  key.ldx = p.ldx;
  key.ldw = p.ldw;
  key.ldy = p.ldy;
  key.ldpre = p.pre ? p.ldpre : 0;

  ForwardPathCache& cache = forward_path_cache();
  {
    std::shared_lock lock(cache.mutex);
    auto it = cache.paths.find(key);
    if (it != cache.paths.end()) return it->second;
  }
  const std::vector<ForwardPath> candidates = forward_candidates(p, epilogue, guess);
  if (candidates.size() < 2) {
    // Nothing to time: the rule's choice is final, and remembered so that the next call of this
    // problem costs one lookup instead of rebuilding its candidates.
    std::unique_lock lock(cache.mutex);
    cache.paths.try_emplace(key, guess);
    return guess;
  }
  if (!lt::can_time_on(stream)) return guess;  // tuned at the next uncaptured call

  // The first (untimed) run of each path also tunes the GEMMs inside it.
  std::vector<ForwardPath> ran(candidates.size());
  const int count = static_cast<int>(candidates.size());
  const std::vector<float> us = lt::time_in_turns(kForwardOp, count, stream, [&](int i) {
    ran[i] = run_forward_path(p, candidates[i], epilogue, device_index, stream);
  });
  int best = 0;
  for (int i = 0; i < count; ++i) {
    if (lt::autotune_log())
      std::fprintf(stderr, "fusekit autotune linear_forward: m %lld n %lld k %lld %s path %s: %.1f us\n",
                   static_cast<long long>(p.m), static_cast<long long>(p.n),
                   static_cast<long long>(p.k), activation_name(p.activation),
                   forward_path_name(ran[i]), us[i]);
    if (us[i] < us[best]) best = i;
  }
  // A path that fell back (no cuBLASLt algorithm for the epilogue) is remembered as what ran.
  const ForwardPath chosen = ran[best];
  std::unique_lock lock(cache.mutex);
  cache.paths.try_emplace(key, chosen);
  return chosen;
}

}  // namespace

std::size_t forward_workspace_cuda(std::int64_t, std::int64_t, std::int64_t, DType, Activation) {
  // cuBLASLt's workspace; the fused CUTLASS kernel's (persistent scheduler) fits inside it.
  return lt::kWorkspaceBytes;
}

// cuBLASLt's workspace, then dz (with an activation), then dbias's partial rows.
// With an activation, also the dz-in-dgrad path's partial rows (one per unit row group, after the
// elementwise pass's) and its unit flags.
std::size_t backward_workspace_cuda(std::int64_t m, std::int64_t n, std::int64_t, DType dtype,
                                    Activation activation) {
  if (activation == Activation::none) return lt::kWorkspaceBytes + partial_bytes(m, n);
  return lt::kWorkspaceBytes + dz_bytes(m, n, dtype) + partial_bytes(m, n) + forming_partial_bytes(m, n) +
         forming_flag_bytes(m, n);
}

void forward_cuda(const ForwardParams& p, int device_index, Stream stream_handle) {
  detail::DeviceGuard guard(kForwardOp, device_index);
  const auto stream = static_cast<cudaStream_t>(stream_handle);
  if (p.m == 0 || p.n == 0) {
    record_forward_path(ForwardPath::trivial);
    return;
  }
  if (p.k == 0) {  // x W^T is all zeros: pre = bias, y = act(bias), row by row
    launch_activation(kForwardOp, p.dtype, p.activation, nullptr, 0, p.bias, p.pre, p.ldpre, p.y,
                      p.ldy, p.m, p.n, device_index, stream);
    record_forward_path(ForwardPath::trivial);
    return;
  }
  lt::Epilogue epilogue = lt::Epilogue::none;
  ForwardPath path = choose_forward_path(p, &epilogue);
  if (forward_path_override() == ForwardPath::automatic)
    path = tuned_forward_path(p, epilogue, path, device_index, stream);
  record_forward_path(run_forward_path(p, path, epilogue, device_index, stream));
}

namespace {

ForwardPath run_forward_path(const ForwardParams& p, ForwardPath path, lt::Epilogue epilogue,
                             int device_index, cudaStream_t stream) {
  if (path == ForwardPath::cublaslt_epilogue &&
      !lt::run(kForwardOp, forward_gemm(p, epilogue, p.y, p.ldy), device_index, p.workspace, stream))
    path = ForwardPath::unfused;  // no cuBLASLt kernel for this epilogue and layout
  if (path == ForwardPath::cutlass_fused) {
    sm90::FusedForwardArgs a;
    a.m = static_cast<int>(p.m);
    a.n = static_cast<int>(p.n);
    a.k = static_cast<int>(p.k);
    a.x = p.x;
    a.ldx = p.ldx;
    a.w = p.w;
    a.ldw = p.ldw;
    a.bias = p.bias;
    a.y = p.y;
    a.ldy = p.ldy;
    a.pre = p.pre;
    a.ldpre = p.ldpre;
    a.activation = p.activation;
    a.device_index = device_index;
    a.sm_count = detail::device_info(kForwardOp, device_index).sm_count;
    a.workspace = p.workspace;
    a.workspace_bytes = p.workspace_bytes;
    if (p.dtype == DType::bf16) sm90::fused_forward_bf16(kForwardOp, a, stream);
    else sm90::fused_forward_f16(kForwardOp, a, stream);
  }
  if (path == ForwardPath::unfused) run_unfused_forward(p, device_index, stream);
  return path;
}

}  // namespace

namespace {

// The dz-in-dgrad path needs what the CUTLASS kernel's TMA needs (16-byte aligned rows: N, K and
// every leading dimension a multiple of 8 elements) and the forming warps' 16-byte vectors
// (dout and pre rows, N a multiple of 8), in a 16-bit dtype; and dx, whose GEMM it is.
bool dz_in_dgrad_eligible(const BackwardParams& p) {
  if (p.dtype != DType::f16 && p.dtype != DType::bf16) return false;
  if (p.activation == Activation::none || !p.dx) return false;
  constexpr std::int64_t a = sm90::kFusedAlignmentElements;
  if (p.n % a || p.k % a || p.lddout % a || p.ldpre % a || p.ldw % a || p.lddx % a) return false;
  for (const void* ptr : {p.dout, p.pre, p.w, static_cast<const void*>(p.dx)})
    if (!aligned16(ptr)) return false;
  constexpr std::int64_t kIntLimit = INT_MAX / 2;
  return p.m <= kIntLimit && p.n <= kIntLimit && p.k <= kIntLimit;
}

// Automatic: the dz-in-dgrad path for GEMMs of at least 2^36 flops whose K (the dx GEMM's output
// columns) is at most 6144. The separate dz pass costs about 6 M N bytes against 4 M N K flops,
// i.e. a share of the backward that falls as 1 / K; the CUTLASS dx GEMM has to win it back against
// cuBLAS's. Measured on an H200 (session 32, backward over the two plain GEMMs, dz inside /
// separate): K = 4096 at (8191, 4096, 12296) 1.036-1.041 / 1.060-1.082, at (8192, 4096, 16384)
// 0.998-1.002 / 1.032-1.064; K = 8192 at (16384, 8192, 8192) 0.995-1.004 / 0.981-0.987; K = 16384
// at (8192, 16384, 4096) 1.020-1.029 / 0.968-0.974. Below 2^36 flops the pass is short and the
// cuBLASLt GEMMs are tuned per shape. FUSEKIT_LINEAR_DGRAD=separate / inside overrides both rules
// (benchmarks); a test's override comes first.
constexpr double kMinDzInDgradFlops = 68719476736.0;  // 2^36
constexpr std::int64_t kMaxDzInDgradK = 6144;

bool choose_dz_in_dgrad(const BackwardParams& p) {
  if (!dz_in_dgrad_eligible(p)) return false;
  const BackwardPath forced = BackwardChoice::forced();
  if (forced == BackwardPath::dz_in_dgrad) return true;
  if (forced == BackwardPath::separate_dz) return false;
  static const int from_env = [] {
    const char* v = std::getenv("FUSEKIT_LINEAR_DGRAD");
    if (v && std::strcmp(v, "separate") == 0) return 0;
    if (v && std::strcmp(v, "inside") == 0) return 1;
    return -1;
  }();
  if (from_env >= 0) return from_env == 1;
  return p.k <= kMaxDzInDgradK &&
         2.0 * static_cast<double>(p.m) * static_cast<double>(p.n) * static_cast<double>(p.k) >= kMinDzInDgradFlops;
}

// Rows the elementwise pass forms before the kernel: the 128-row blocks that the first wave of
// output tiles (one per SM, 128 x 256, rastered along the dx columns) covers entirely, which
// would otherwise wait at once for units no warp has formed yet. Measured at (8191, 4096, 12296)
// (H200, session 32): 0 / 1024 / 2048 rows (1024 is this rule there) 1.057-1.060 / 1.040 / 1.042x
// the plain GEMMs with relu. FUSEKIT_LINEAR_DGRAD_FIRST_ROWS (a multiple of 128) overrides it,
// as a benchmark knob; set_dz_in_dgrad_first_rows (tests) before that.
std::int64_t dz_in_dgrad_first_row(const BackwardParams& p, int sm_count) {
  constexpr std::int64_t kTile = 128, kTileColumns = 256;
  const std::int64_t tiles_per_row = (p.k + kTileColumns - 1) / kTileColumns;
  std::int64_t blocks = std::max<std::int64_t>(2, sm_count / tiles_per_row);
  if (const char* v = std::getenv("FUSEKIT_LINEAR_DGRAD_FIRST_ROWS")) blocks = std::atoll(v) / kTile;
  if (const long long forced = g_first_rows_override.load(); forced >= 0) blocks = forced / kTile;
  return std::min(blocks * kTile, p.m / kTile * kTile);
}

void backward_dz_in_dgrad(const BackwardParams& p, void* dz_buffer, float* partial, DbiasRoute route,
                          int device_index, cudaStream_t stream) {
  const std::int64_t lddz = dz_row_stride(p.n);
  const bool sums = p.dbias && route == DbiasRoute::automatic;
  const int sm_count = detail::device_info(kBackwardOp, device_index).sm_count;
  const std::int64_t first_row = dz_in_dgrad_first_row(p, sm_count);
  int pre_slots = 0;
  if (first_row > 0) {
    launch_dz(kBackwardOp, p.dtype, p.activation, p.dout, p.lddout, p.pre, p.ldpre, dz_buffer, lddz,
              sums ? p.dbias : nullptr, partial, first_row, p.n, device_index, stream, /*finish_dbias=*/false);
    if (sums) pre_slots = dbias_slots(first_row, p.n);
  }
  unsigned char* flag_area = reinterpret_cast<unsigned char*>(partial) + partial_bytes(p.m, p.n) +
                             forming_partial_bytes(p.m, p.n);
  const std::int64_t groups = forming_groups(p.m - first_row);
  const std::int64_t units = groups * forming_slices(p.n);
  detail::check_cuda(cudaMemsetAsync(flag_area, 0, static_cast<std::size_t>(units + 1) * sizeof(unsigned), stream),
                     kBackwardOp, "cudaMemsetAsync (dz unit flags)");

  sm90::DgradFormingArgs a;
  a.m = static_cast<int>(p.m);
  a.n = static_cast<int>(p.n);
  a.k = static_cast<int>(p.k);
  a.dout = p.dout;
  a.lddout = p.lddout;
  a.pre = p.pre;
  a.ldpre = p.ldpre;
  a.dz = dz_buffer;
  a.lddz = lddz;
  a.w = p.w;
  a.ldw = p.ldw;
  a.dx = p.dx;
  a.lddx = p.lddx;
  a.partial = sums ? partial + static_cast<std::int64_t>(pre_slots) * p.n : nullptr;
  a.flags = reinterpret_cast<unsigned*>(flag_area) + 1;
  a.counter = reinterpret_cast<int*>(flag_area);
  a.first_row = static_cast<int>(first_row);
  a.slices = static_cast<int>(forming_slices(p.n));
  a.units = static_cast<int>(units);
  a.activation = p.activation;
  a.device_index = device_index;
  a.sm_count = sm_count;
  if (p.dtype == DType::bf16) sm90::dgrad_forming_bf16(kBackwardOp, a, stream);
  else sm90::dgrad_forming_f16(kBackwardOp, a, stream);

  bool dbias_done = sums || !p.dbias;
  if (p.dw) {
    const bool fuse_dbias = !dbias_done && p.k >= kMinKForFusedDbias;
    if (fuse_dbias && lt::run(kBackwardOp, dw_gemm(p, dz_buffer, lddz, true), device_index, p.workspace, stream))
      dbias_done = true;
    else if (!lt::run(kBackwardOp, dw_gemm(p, dz_buffer, lddz, false), device_index, p.workspace, stream))
      no_algorithm(kBackwardOp, "the dW", p);
  }
  if (sums) {
    dispatch_dtype(p.dtype, [&](auto tag) {
      using T = decltype(tag);
      detail::device::launch_sum_partial_rows(partial, pre_slots + static_cast<int>(groups), p.n,
                                              static_cast<T*>(p.dbias), stream, kBackwardOp,
                                              "dbias partial-row sum kernel");
    });
  } else if (!dbias_done) {
    launch_dz(kBackwardOp, p.dtype, Activation::none, dz_buffer, lddz, nullptr, 0, nullptr, 0, p.dbias, partial,
              p.m, p.n, device_index, stream);
  }
}

}  // namespace

void backward_cuda(const BackwardParams& p, int device_index, Stream stream_handle) {
  detail::DeviceGuard guard(kBackwardOp, device_index);
  const auto stream = static_cast<cudaStream_t>(stream_handle);
  if (p.m == 0) {  // empty sums
    zero_rows(kBackwardOp, p.dw, p.n, p.k, p.lddw, p.dtype, stream);
    zero_rows(kBackwardOp, p.dbias, 1, p.n, p.n, p.dtype, stream);
    return;
  }
  if (p.n == 0) {
    zero_rows(kBackwardOp, p.dx, p.m, p.k, p.lddx, p.dtype, stream);
    return;
  }
  unsigned char* scratch = static_cast<unsigned char*>(p.workspace) + lt::kWorkspaceBytes;
  void* dz_buffer = p.activation == Activation::none ? nullptr : scratch;
  float* partial = reinterpret_cast<float*>(scratch + (dz_buffer ? dz_bytes(p.m, p.n, p.dtype) : 0));
  if (p.k == 0) {  // dx and dW are empty; dbias still sums dz
    launch_dz(kBackwardOp, p.dtype, p.activation, p.dout, p.lddout, p.pre, p.ldpre, nullptr, 0, p.dbias,
              partial, p.m, p.n, device_index, stream);
    return;
  }

  // With an activation dz is formed here, and its pass sums dbias on the way; without one, the
  // column-sum kernel sums dout after the GEMMs. cuBLASLt's BGRADB epilogue on the dW GEMM only
  // when a comparison asks for it (dbias_route()): it cost more than the column sums with and
  // without an activation (H200, session 27: (8192, 4096, 16384) none 1.014-1.026x the plain
  // GEMMs with BGRADB, 0.992-0.995x with the column sums).
  const void* dz = p.dout;
  std::int64_t lddz = p.lddout;
  const bool materialize_dz = p.activation != Activation::none && (p.dx || p.dw);
  const DbiasRoute route = dbias_route();
  BackwardChoice::record(materialize_dz ? BackwardPath::separate_dz : BackwardPath::no_dz);
  if (materialize_dz && choose_dz_in_dgrad(p)) {
    backward_dz_in_dgrad(p, dz_buffer, partial, route, device_index, stream);
    BackwardChoice::record(BackwardPath::dz_in_dgrad);
    return;
  }
  const bool sums_in_dz_pass = materialize_dz && route == DbiasRoute::automatic;
  if (materialize_dz) {
    lddz = dz_row_stride(p.n);
    launch_dz(kBackwardOp, p.dtype, p.activation, p.dout, p.lddout, p.pre, p.ldpre, dz_buffer, lddz,
              sums_in_dz_pass ? p.dbias : nullptr, partial, p.m, p.n, device_index, stream);
    dz = dz_buffer;
  }
  bool dbias_done = sums_in_dz_pass || !p.dbias;
  if (p.dx && !lt::run(kBackwardOp, dx_gemm(p, dz, lddz), device_index, p.workspace, stream))
    no_algorithm(kBackwardOp, "the dx", p);
  if (p.dw) {
    // BGRADB only where K (the dW GEMM's m) is not tiny: with K = 1 in f16, cuBLASLt returned an
    // algorithm whose dbias came back non-finite (999 of 1000 columns, H200, CUDA 13.0), and
    // for small K the separate column sum costs no more than the GEMM's own read of dz.
    const bool fuse_dbias = !dbias_done && p.k >= kMinKForFusedDbias && route == DbiasRoute::gemm_epilogue;
    if (fuse_dbias && lt::run(kBackwardOp, dw_gemm(p, dz, lddz, true), device_index, p.workspace, stream))
      dbias_done = true;
    else if (!lt::run(kBackwardOp, dw_gemm(p, dz, lddz, false), device_index, p.workspace, stream))
      no_algorithm(kBackwardOp, "the dW", p);
  }
  if (!dbias_done) {
    if (materialize_dz)
      launch_dz(kBackwardOp, p.dtype, Activation::none, dz, lddz, nullptr, 0, nullptr, 0, p.dbias, partial,
                p.m, p.n, device_index, stream);
    else
      launch_dz(kBackwardOp, p.dtype, p.activation, p.dout, p.lddout, p.pre, p.ldpre, nullptr, 0, p.dbias,
                partial, p.m, p.n, device_index, stream);
  }
}

}  // namespace fusekit::linear
