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
// producer warps form dz while its tensor cores run, for large problems with 4096 <= K <= 6144, where the
// separate pass costs the most) or by one elementwise pass into the workspace (skipped for
// activation none); both GEMMs read it. The pass (and the forming warps) also sum dz over rows, so
// dbias costs no extra read of dz (a fixed-order sum of the blocks' partial rows finishes it:
// deterministic). Without an activation the same kernel, not storing anything, sums dout. Both
// beat cuBLASLt's BGRADB epilogue (dbias summed inside the dW GEMM), which slows that GEMM by
// more than the column sums cost (bench: linear bwd none (8192, 4096, 16384), H200).
//
// Which path runs is chosen by linear_config.h; this file measures (autotuning) and launches.
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
#include "core/overrides.h"
#include "fusekit/gated_act.h"
#include "linear/linear_config.h"
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

BackwardPath last_backward_path() { return BackwardChoice::last(); }

namespace {

constexpr const char* kForwardOp = "linear_forward";
constexpr const char* kBackwardOp = "linear_backward";
constexpr int kThreads = kElementwiseThreads;

std::size_t round_up(std::size_t v, std::size_t a) { return (v + a - 1) / a * a; }
bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// Rows of the dz scratch matrix are padded to 8 elements (16 bytes for f16/bf16) so that the two
// backward GEMMs read it at full alignment whatever N is.
std::int64_t dz_row_stride(std::int64_t n) { return static_cast<std::int64_t>(round_up(n, 8)); }

std::size_t dz_bytes(std::int64_t m, std::int64_t n, DType dtype) {
  return round_up(static_cast<std::size_t>(m) * dz_row_stride(n) * dtype_size(dtype), 256);
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

dim3 elementwise_dim3(std::int64_t m, std::int64_t n, int vec, int device_index, const char* op) {
  const ElementwiseGrid g = elementwise_grid(m, n, vec, detail::device_info(op, device_index).sm_count);
  return dim3(static_cast<unsigned>(g.gx), static_cast<unsigned>(g.gy));
}

void launch_activation(const char* op, DType dtype, Activation act, const void* z, std::int64_t ldz,
                       const void* bias, void* pre, std::int64_t ldpre, void* y, std::int64_t ldy,
                       std::int64_t m, std::int64_t n, int device_index, cudaStream_t stream) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const int vec = vector_width<T>(n, {ldz, ldpre, ldy}, {z, pre, y, bias});
    const dim3 grid = elementwise_dim3(m, n, vec, device_index, op);
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

// Rows of 16-byte chunks each thread of the dz pass loads before it computes any. Two take the
// transcendental activations from latency-bound to nearly memory-bound; four cost gelu_erf
// registers (bench: linear bwd gelu_erf, silu (8192, 4096, 16384), H200).
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
    dim3 grid = elementwise_dim3(m, n, vec, device_index, op);
    if (partial) grid.y = static_cast<unsigned>(dbias_slots(m, n));
    // The row's chunks split evenly over the grid's column blocks (whole warps): with kThreads per
    // block, N = 12296 would give six full blocks and a seventh with one busy thread.
    const int threads = dz_pass_threads(n, vec, grid.x);
    const kernels::Rows rows{m, n};
    dispatch_activation(act, [&](auto a) {
      constexpr Activation A = decltype(a)::value;
      constexpr int kVec = 16 / sizeof(T);
      auto launch = [&](auto kernel) {
        kernel<<<grid, threads, 0, stream>>>(static_cast<const T*>(dout), lddout, static_cast<const T*>(pre),
                                             ldpre, static_cast<T*>(dz), lddz, partial, rows);
      };
      auto with_width = [&](auto outputs) {
        constexpr kernels::DzOutputs kOut = decltype(outputs)::value;
        if (vec == 1) launch(kernels::dz_kernel<T, A, 1, kOut, 1>);
        else launch(kernels::dz_kernel<T, A, kVec, kOut, kDzRowsInFlight>);
      };
      using kernels::DzOutputs;
      if constexpr (A == Activation::none) {
        if (partial) with_width(std::integral_constant<DzOutputs, DzOutputs::sums>{});
      } else if (dz && partial) {
        with_width(std::integral_constant<DzOutputs, DzOutputs::dz_and_sums>{});
      } else if (dz) {
        with_width(std::integral_constant<DzOutputs, DzOutputs::dz>{});
      } else if (partial) {
        with_width(std::integral_constant<DzOutputs, DzOutputs::sums>{});
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

// dz of the first `rows` rows into `dz` (null: not stored) and, with `dbias`, its column sums into
// dbias_slots(rows, n) partial rows: dout * act'(pre) by the dz pass, or for a gated backward
// gated_act's backward (which stores dz) and then the column sums of the dz it wrote.
void form_dz_rows(const BackwardParams& p, std::int64_t rows, void* dz, std::int64_t lddz, void* dbias,
                  float* partial, int device_index, cudaStream_t stream, bool finish_dbias = true) {
  if (!p.gated) {
    launch_dz(kBackwardOp, p.dtype, p.activation, p.dout, p.lddout, p.pre, p.ldpre, dz, lddz, dbias, partial, rows,
              p.n, device_index, stream, finish_dbias);
    return;
  }
  if (rows == 0 || (!dz && !dbias)) return;
  const Device device = Device::cuda(device_index);
  GatedActConfig config;
  config.activation = p.activation;
  config.layout = p.gated_layout;
  gated_act_backward(TensorView(const_cast<void*>(p.dout), p.dtype, device, {rows, p.n / 2}, {p.lddout, 1}),
                     TensorView(const_cast<void*>(p.pre), p.dtype, device, {rows, p.n}, {p.ldpre, 1}), config,
                     TensorView(dz, p.dtype, device, {rows, p.n}, {lddz, 1}), stream);
  if (dbias)
    launch_dz(kBackwardOp, p.dtype, Activation::none, dz, lddz, nullptr, 0, nullptr, 0, dbias, partial, rows, p.n,
              device_index, stream, finish_dbias);
}

// ---- forward -------------------------------------------------------------------------------

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

// y^T (N x M, column-major) = W (op T of the K x N column-major view of a row-major W; a
// column-major W is the N x K column-major matrix itself) * x^T (K x M).
lt::Gemm forward_gemm(const ForwardParams& p, lt::Epilogue e, void* d, std::int64_t ldd) {
  lt::Gemm g = column_major_gemm(p.dtype, p.n, p.m, p.k, {p.w, p.ldw, !p.w_col_major}, {p.x, p.ldx, false},
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

// dx^T (K x M) = W^T (the K x N column-major view of a row-major W; op T of a column-major
// W's N x K) * dz^T (N x M).
lt::Gemm dx_gemm(const BackwardParams& p, const void* dz, std::int64_t lddz) {
  return column_major_gemm(p.dtype, p.k, p.m, p.n, {p.w, p.ldw, p.w_col_major}, {dz, lddz, false}, p.dx,
                           p.lddx);
}

// dx, or through the input's activation dx * x_activation'(x_pre) with its column sums in dx_sum:
// cuBLASLt's DGELU epilogue (the tanh form, on the float32 accumulator, x_pre as its aux) where it
// applies, then the column-sum pass over what it wrote; else dx into `dx_scratch` and the dz pass
// over it (partial rows in `x_partial`). DGELU_BGRAD, which sums inside the GEMM, picks slower
// GEMMs (train_gpt GPT-2 124M, 16 x 1024 tokens, H200: 32.1 ms per step against 29.7 for DGELU
// and the pass, 29.9 for dx and the elementwise pass).
void run_dx(const BackwardParams& p, const void* dz, std::int64_t lddz, void* dx_scratch, float* x_partial,
            int device_index, cudaStream_t stream) {
  lt::Gemm g = dx_gemm(p, dz, lddz);
  if (!p.through_input_activation) {
    if (!lt::run(kBackwardOp, g, device_index, p.workspace, stream)) no_algorithm(kBackwardOp, "the dx", p);
    return;
  }
  enum class Route { bgrad_epilogue, epilogue, pass };
  const Route route = detail::override_choice<Route>("linear.backward.input_activation",
                                                     {{"bgrad_epilogue", Route::bgrad_epilogue},
                                                      {"epilogue", Route::epilogue},
                                                      {"pass", Route::pass}})
                          .value_or(Route::epilogue);
  if (route != Route::pass && p.x_activation == Activation::gelu_tanh && p.dtype != DType::f32 &&
      p.ldx_pre % 8 == 0 && aligned16(p.x_pre)) {
    lt::Gemm e = g;
    const bool bgrad = p.dx_sum && route == Route::bgrad_epilogue;
    e.epilogue = bgrad ? lt::Epilogue::dgelu_bgrad : lt::Epilogue::dgelu;
    e.aux = const_cast<void*>(p.x_pre);
    e.ld_aux = p.ldx_pre;
    e.bias = bgrad ? p.dx_sum : nullptr;
    if (lt::run(kBackwardOp, e, device_index, p.workspace, stream)) {
      if (p.dx_sum && !bgrad)  // the column sums of what the epilogue wrote
        launch_dz(kBackwardOp, p.dtype, Activation::none, p.dx, p.lddx, nullptr, 0, nullptr, 0, p.dx_sum, x_partial,
                  p.m, p.k, device_index, stream);
      return;
    }
  }
  g.d = dx_scratch;
  g.ldd = dz_row_stride(p.k);
  if (!lt::run(kBackwardOp, g, device_index, p.workspace, stream)) no_algorithm(kBackwardOp, "the dx", p);
  launch_dz(kBackwardOp, p.dtype, p.x_activation, dx_scratch, g.ldd, p.x_pre, p.ldx_pre, p.dx, p.lddx, p.dx_sum,
            x_partial, p.m, p.k, device_index, stream);
}

// Row-major dW: dW^T (K x N) = x^T (K x M) * dz (op T of the N x M column-major view of dz).
// Column-major dW: dW (N x K) = dz^T (N x M) * x (op T of the K x M column-major view of x).
lt::Gemm dw_gemm(const BackwardParams& p, const void* dz, std::int64_t lddz) {
  if (p.dw_col_major)
    return column_major_gemm(p.dtype, p.n, p.k, p.m, {dz, lddz, false}, {p.x, p.ldx, true}, p.dw, p.lddw);
  return column_major_gemm(p.dtype, p.k, p.n, p.m, {p.x, p.ldx, false}, {dz, lddz, true}, p.dw, p.lddw);
}

ForwardPath run_forward_path(const ForwardParams& p, ForwardPath path, lt::Epilogue epilogue,
                             int device_index, cudaStream_t stream);

// ---- forward path tuning ---------------------------------------------------------------------
//
// For the activations cuBLASLt cannot fuse (and gelu_tanh, where its epilogue is slow), two or
// three paths compute the same forward: the fused CUTLASS kernel, cuBLASLt's epilogue, and the
// tuned cuBLASLt GEMM followed by the elementwise activation. Which is fastest depends on the
// shape: the CUTLASS kernel's one tile configuration loses ~20% to cuBLASLt's best algorithm plus
// the separate activation at (8192, 16384, 4096) (bench: linear fwd silu, H200). So, like the GEMM
// algorithms (linear_cublaslt.cpp), the first call of a problem times the
// candidate paths on the caller's stream and buffers and keeps the fastest for the process.

struct ForwardKey {
  int device = 0;
  DType dtype = DType::bf16;
  Activation activation = Activation::none;
  bool bias = false, pre = false, cutlass_ok = false, lt_ok = false, w_col_major = false;
  std::int64_t m = 0, n = 0, k = 0, ldx = 0, ldw = 0, ldy = 0, ldpre = 0;
  bool operator==(const ForwardKey& o) const {
    return device == o.device && dtype == o.dtype && activation == o.activation &&
           bias == o.bias && pre == o.pre && cutlass_ok == o.cutlass_ok && lt_ok == o.lt_ok &&
           w_col_major == o.w_col_major && m == o.m && n == o.n && k == o.k && ldx == o.ldx && ldw == o.ldw && ldy == o.ldy &&
           ldpre == o.ldpre;
  }
};

struct ForwardKeyHash {
  std::size_t operator()(const ForwardKey& k) const {
    std::size_t h = 1469598103934665603ull;
    auto mix = [&h](std::uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    mix(std::uint64_t(k.device) << 8 | std::uint64_t(k.dtype));
    mix(std::uint64_t(k.activation) << 5 | std::uint64_t(k.w_col_major) << 4 | std::uint64_t(k.bias) << 3 |
        std::uint64_t(k.pre) << 2 | std::uint64_t(k.cutlass_ok) << 1 | std::uint64_t(k.lt_ok));
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

ForwardPath tuned_forward_path(const ForwardParams& p, const ForwardProblem& problem, lt::Epilogue epilogue,
                               ForwardPath guess, int device_index, cudaStream_t stream) {
  if (!timed_problem(p.m, p.n, p.k, autotune_enabled())) return guess;
  ForwardKey key;
  key.device = device_index;
  key.dtype = p.dtype;
  key.activation = p.activation;
  key.bias = p.bias != nullptr;
  key.pre = p.pre != nullptr;
  key.cutlass_ok = problem.cutlass_ok;
  key.lt_ok = cublaslt_epilogue(problem).has_value();
  key.m = p.m;
  key.n = p.n;
  key.k = p.k;
  key.ldx = p.ldx;
  key.ldw = p.ldw;
  key.w_col_major = p.w_col_major;
  key.ldy = p.ldy;
  key.ldpre = p.pre ? p.ldpre : 0;

  ForwardPathCache& cache = forward_path_cache();
  {
    std::shared_lock lock(cache.mutex);
    auto it = cache.paths.find(key);
    if (it != cache.paths.end()) return it->second;
  }
  const std::vector<ForwardPath> candidates = forward_candidates(problem, guess);
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

// Through the input's activation (never the dz-in-dgrad path): cuBLASLt's workspace, dz (with an
// activation), dbias's partial rows, dx_sum's partial rows, and dx itself for the path that forms
// dx * act'(x_pre) in the dz pass.
std::size_t backward_through_input_activation_workspace_cuda(std::int64_t m, std::int64_t n, std::int64_t k,
                                                             DType dtype, Activation activation) {
  return lt::kWorkspaceBytes + (activation == Activation::none ? 0 : dz_bytes(m, n, dtype)) + partial_bytes(m, n) +
         partial_bytes(m, k) + dz_bytes(m, k, dtype);
}

sm90::FusedForwardArgs sm90::fused_forward_args(const ForwardParams& p, int device_index) {
  FusedForwardArgs a;
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
  return a;
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
  const ForwardProblem problem = forward_problem(p);
  const lt::Epilogue epilogue = cublaslt_epilogue(problem).value_or(lt::Epilogue::none);
  const ForwardPath forced = forward_path_override();
  ForwardPath path = choose_forward_path(problem, forced);
  if (forced == ForwardPath::automatic) path = tuned_forward_path(p, problem, epilogue, path, device_index, stream);
  record_forward_path(run_forward_path(p, path, epilogue, device_index, stream));
}

namespace {

ForwardPath run_forward_path(const ForwardParams& p, ForwardPath path, lt::Epilogue epilogue,
                             int device_index, cudaStream_t stream) {
  if (path == ForwardPath::cublaslt_epilogue &&
      !lt::run(kForwardOp, forward_gemm(p, epilogue, p.y, p.ldy), device_index, p.workspace, stream))
    path = ForwardPath::unfused;  // no cuBLASLt kernel for this epilogue and layout
  if (path == ForwardPath::cutlass_fused) {
    const sm90::FusedForwardArgs a = sm90::fused_forward_args(p, device_index);
    if (p.dtype == DType::bf16) sm90::fused_forward_bf16(kForwardOp, a, stream);
    else sm90::fused_forward_f16(kForwardOp, a, stream);
  }
  if (path == ForwardPath::unfused) run_unfused_forward(p, device_index, stream);
  return path;
}

}  // namespace

namespace {

// dz formed inside the dx GEMM (linear_dgrad_sm90.cuh), its first `first_row` rows by the
// elementwise pass; dbias from both parts' partial rows.
void backward_dz_in_dgrad(const BackwardParams& p, void* dz_buffer, float* partial, std::int64_t first_row,
                          int device_index, cudaStream_t stream) {
  const std::int64_t lddz = dz_row_stride(p.n);
  const bool sums = p.dbias != nullptr;
  const int sm_count = detail::device_info(kBackwardOp, device_index).sm_count;
  int pre_slots = 0;
  if (first_row > 0) {
    form_dz_rows(p, first_row, dz_buffer, lddz, sums ? p.dbias : nullptr, partial, device_index, stream,
                 /*finish_dbias=*/false);
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
  a.gated = p.gated;
  a.device_index = device_index;
  a.sm_count = sm_count;
  if (p.dtype == DType::bf16) sm90::dgrad_forming_bf16(kBackwardOp, a, stream);
  else sm90::dgrad_forming_f16(kBackwardOp, a, stream);

  if (p.dw && !lt::run(kBackwardOp, dw_gemm(p, dz_buffer, lddz), device_index, p.workspace, stream))
    no_algorithm(kBackwardOp, "the dW", p);
  if (sums) {
    dispatch_dtype(p.dtype, [&](auto tag) {
      using T = decltype(tag);
      detail::device::launch_sum_partial_rows(partial, pre_slots + static_cast<int>(groups), p.n,
                                              static_cast<T*>(p.dbias), stream, kBackwardOp,
                                              "dbias partial-row sum kernel");
    });
  }
}

}  // namespace

void backward_cuda(const BackwardParams& p, int device_index, Stream stream_handle) {
  detail::DeviceGuard guard(kBackwardOp, device_index);
  const auto stream = static_cast<cudaStream_t>(stream_handle);
  if (p.m == 0) {  // empty sums
    if (p.dw_col_major)
      zero_rows(kBackwardOp, p.dw, p.k, p.n, p.lddw, p.dtype, stream);
    else
      zero_rows(kBackwardOp, p.dw, p.n, p.k, p.lddw, p.dtype, stream);
    zero_rows(kBackwardOp, p.dbias, 1, p.n, p.n, p.dtype, stream);
    zero_rows(kBackwardOp, p.dx_sum, 1, p.k, p.k, p.dtype, stream);
    return;
  }
  if (p.n == 0) {
    zero_rows(kBackwardOp, p.dx, p.m, p.k, p.lddx, p.dtype, stream);
    zero_rows(kBackwardOp, p.dx_sum, 1, p.k, p.k, p.dtype, stream);
    return;
  }
  unsigned char* scratch = static_cast<unsigned char*>(p.workspace) + lt::kWorkspaceBytes;
  void* dz_buffer = p.activation == Activation::none ? nullptr : scratch;
  float* partial = reinterpret_cast<float*>(scratch + (dz_buffer ? dz_bytes(p.m, p.n, p.dtype) : 0));
  if (p.k == 0) {  // dx and dW are empty; dbias still sums dz (which a gated backward stores first)
    form_dz_rows(p, p.m, p.gated ? dz_buffer : nullptr, dz_row_stride(p.n), p.dbias, partial, device_index, stream);
    return;
  }

  // With an activation dz is formed here (inside the dx GEMM or by the elementwise pass), and its
  // pass sums dbias on the way; without one, the column-sum kernel sums dout after the GEMMs.
  const BackwardPlan plan =
      choose_backward(backward_problem(p), detail::device_info(kBackwardOp, device_index),
                      BackwardChoice::requested("linear.backward.dz", {{"separate", BackwardPath::separate_dz},
                                                                       {"in_dgrad", BackwardPath::dz_in_dgrad}}),
                      detail::override_int("linear.backward.dz_first_rows", 0, INT_MAX));
  BackwardChoice::record(plan.path);
  if (plan.path == BackwardPath::dz_in_dgrad) {
    backward_dz_in_dgrad(p, dz_buffer, partial, plan.first_rows, device_index, stream);
    return;
  }
  const void* dz = p.dout;
  std::int64_t lddz = p.lddout;
  const bool materialize_dz = plan.path == BackwardPath::separate_dz;
  if (materialize_dz) {
    lddz = dz_row_stride(p.n);
    form_dz_rows(p, p.m, dz_buffer, lddz, p.dbias, partial, device_index, stream);
    dz = dz_buffer;
  }
  if (p.dx) {
    unsigned char* x_partial = reinterpret_cast<unsigned char*>(partial) + partial_bytes(p.m, p.n);
    run_dx(p, dz, lddz, x_partial + partial_bytes(p.m, p.k), reinterpret_cast<float*>(x_partial), device_index,
           stream);
  }
  if (p.dw && !lt::run(kBackwardOp, dw_gemm(p, dz, lddz), device_index, p.workspace, stream))
    no_algorithm(kBackwardOp, "the dW", p);
  if (p.dbias && !materialize_dz)
    form_dz_rows(p, p.m, p.gated ? dz_buffer : nullptr, dz_row_stride(p.n), p.dbias, partial, device_index, stream);
}

}  // namespace fusekit::linear
