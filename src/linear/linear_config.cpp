#include "linear/linear_config.h"

#include <algorithm>
#include <climits>
#include <cstdint>

#include "linear/linear_cutlass.h"

namespace fusekit::linear {

namespace {

// The cuBLASLt epilogues per activation: without the pre-activation output, and with it (only
// where cuBLASLt's aux output is the pre-activation: its relu aux is a bit-mask). cuBLASLt has
// none for squared relu, silu or the erf form of gelu.
struct EpilogueRow {
  Activation activation;
  lt::Epilogue plain, plain_bias;
  bool has_aux;
  lt::Epilogue aux, aux_bias;
};
constexpr EpilogueRow kEpilogues[] = {
    {Activation::none, lt::Epilogue::none, lt::Epilogue::bias, false, {}, {}},
    {Activation::relu, lt::Epilogue::relu, lt::Epilogue::relu_bias, false, {}, {}},
    {Activation::gelu_tanh, lt::Epilogue::gelu, lt::Epilogue::gelu_bias, true, lt::Epilogue::gelu_aux,
     lt::Epilogue::gelu_aux_bias},
};

double flops(std::int64_t m, std::int64_t n, std::int64_t k) {
  return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

}  // namespace

ForwardProblem forward_problem(const ForwardParams& p) {
  ForwardProblem f;
  f.m = p.m;
  f.n = p.n;
  f.k = p.k;
  f.dtype = p.dtype;
  f.activation = p.activation;
  f.bias = p.bias != nullptr;
  f.pre = p.pre != nullptr;
  f.pre_fits_aux = p.pre && p.ldpre % 8 == 0 && aligned16(p.pre);
  constexpr std::int64_t a = sm90::kFusedAlignmentElements;
  // The fused kernel reads W K-major (row-major); a column-major W takes the cuBLASLt paths.
  f.cutlass_ok = !p.w_col_major && (p.dtype == DType::f16 || p.dtype == DType::bf16) && p.k % a == 0 && p.n % a == 0 &&
                 p.ldx % a == 0 && p.ldw % a == 0 && p.ldy % a == 0 && (!p.pre || p.ldpre % a == 0);
  for (const void* ptr : {p.x, p.w, p.bias, static_cast<const void*>(p.y), static_cast<const void*>(p.pre)})
    if (ptr && !aligned16(ptr)) f.cutlass_ok = false;
  return f;
}

BackwardProblem backward_problem(const BackwardParams& p) {
  BackwardProblem b;
  b.m = p.m;
  b.n = p.n;
  b.k = p.k;
  b.dtype = p.dtype;
  b.activation = p.activation;
  b.dx = p.dx != nullptr;
  b.dw = p.dw != nullptr;
  b.dbias = p.dbias != nullptr;
  b.gated_halves = p.gated && p.gated_layout == GatedLayout::halves;
  b.through_input_activation = p.through_input_activation;
  constexpr std::int64_t a = sm90::kFusedAlignmentElements;
  // The dz-in-dgrad kernel reads W row-major too. A gated backward's forming warps read dy in
  // 8-byte vectors (4 values per 8 dz columns).
  const bool dout_aligned = p.gated ? p.lddout % (a / 2) == 0 && reinterpret_cast<std::uintptr_t>(p.dout) % 8 == 0
                                    : p.lddout % a == 0 && aligned16(p.dout);
  b.dz_in_dgrad_aligned = !p.w_col_major && p.n % a == 0 && p.k % a == 0 && dout_aligned && p.ldpre % a == 0 &&
                          p.ldw % a == 0 && p.lddx % a == 0;
  for (const void* ptr : {p.pre, p.w, static_cast<const void*>(p.dx)})
    if (!aligned16(ptr)) b.dz_in_dgrad_aligned = false;
  return b;
}

std::optional<lt::Epilogue> cublaslt_epilogue(const ForwardProblem& p) {
  for (const EpilogueRow& row : kEpilogues) {
    if (row.activation != p.activation) continue;
    if (!p.pre) return p.bias ? row.plain_bias : row.plain;
    // The aux leading dimension must be a multiple of 8 (cublasLt.h, EPILOGUE_AUX_LD).
    if (!row.has_aux || !p.pre_fits_aux) return std::nullopt;
    return p.bias ? row.aux_bias : row.aux;
  }
  return std::nullopt;
}

ForwardPath choose_forward_path(const ForwardProblem& p, ForwardPath forced) {
  const bool lt_ok = cublaslt_epilogue(p).has_value();
  switch (forced) {
    case ForwardPath::cublaslt_epilogue:
      if (lt_ok) return ForwardPath::cublaslt_epilogue;
      break;
    case ForwardPath::cutlass_fused:
      if (p.cutlass_ok) return ForwardPath::cutlass_fused;
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
  // the plain GEMM's time where cuBLASLt's GELU / GELU_AUX epilogues run 3-11% over it (bench:
  // linear fwd gelu_tanh, H200). cuBLASLt's other epilogues (bias, relu) cost the plain GEMM.
  if (p.activation == Activation::gelu_tanh && p.cutlass_ok) return ForwardPath::cutlass_fused;
  if (lt_ok) return ForwardPath::cublaslt_epilogue;
  if (p.cutlass_ok) return ForwardPath::cutlass_fused;
  return ForwardPath::unfused;
}

std::vector<ForwardPath> forward_candidates(const ForwardProblem& p, ForwardPath guess) {
  std::vector<ForwardPath> c;
  if (p.dtype == DType::f32) return c;
  const bool lt_ok = cublaslt_epilogue(p).has_value();
  if (lt_ok && (p.activation == Activation::none || p.activation == Activation::relu)) return c;
  c.push_back(guess);
  auto add = [&c](ForwardPath path) {
    if (std::find(c.begin(), c.end(), path) == c.end()) c.push_back(path);
  };
  if (p.cutlass_ok) add(ForwardPath::cutlass_fused);
  if (lt_ok) add(ForwardPath::cublaslt_epilogue);
  add(ForwardPath::unfused);
  return c;
}

bool timed_problem(std::int64_t m, std::int64_t n, std::int64_t k, bool autotune) {
  return autotune && !(flops(m, n, k) < lt::kMinTimedFlops);
}

bool dz_in_dgrad_eligible(const BackwardProblem& p) {
  if (p.dtype != DType::f16 && p.dtype != DType::bf16) return false;
  if (p.activation == Activation::none || !p.dx || !p.dz_in_dgrad_aligned || p.gated_halves ||
      p.through_input_activation)
    return false;
  constexpr std::int64_t kIntLimit = INT_MAX / 2;
  return p.m <= kIntLimit && p.n <= kIntLimit && p.k <= kIntLimit;
}

namespace {

// Rows the elementwise pass forms before the dz-in-dgrad kernel: the 128-row blocks that the
// first wave of output tiles (one per SM, 128 x 256, rastered along the dx columns) covers
// entirely, which would otherwise wait at once for units no warp has formed yet (bench: linear
// bwd relu (8191, 4096, 12296), H200).
std::int64_t dz_in_dgrad_first_rows(const BackwardProblem& p, int sm_count, std::optional<long long> forced) {
  constexpr std::int64_t kTile = 128, kTileColumns = 256;
  const std::int64_t tiles_per_row = (p.k + kTileColumns - 1) / kTileColumns;
  std::int64_t blocks = std::max<std::int64_t>(2, sm_count / tiles_per_row);
  if (forced) blocks = *forced / kTile;
  return std::min(blocks * kTile, p.m / kTile * kTile);
}

}  // namespace

BackwardPlan choose_backward(const BackwardProblem& p, const detail::DeviceInfo& device, BackwardPath forced,
                             std::optional<long long> forced_first_rows) {
  BackwardPlan plan;
  if (p.activation == Activation::none || !(p.dx || p.dw)) return plan;  // no_dz
  plan.path = BackwardPath::separate_dz;
  if (!dz_in_dgrad_eligible(p)) return plan;
  BackwardPath route = forced;
  if (route != BackwardPath::dz_in_dgrad && route != BackwardPath::separate_dz) {
    const double f = flops(p.m, p.n, p.k);
    for (const DzRouteRow& row : kDzRoutes) {
      if (p.k >= row.min_k && p.k <= row.max_k && f >= row.min_flops) {
        route = row.path;
        break;
      }
    }
  }
  if (route == BackwardPath::dz_in_dgrad) {
    plan.path = BackwardPath::dz_in_dgrad;
    plan.first_rows = dz_in_dgrad_first_rows(p, device.sm_count, forced_first_rows);
  }
  return plan;
}

ElementwiseGrid elementwise_grid(std::int64_t m, std::int64_t n, int vec, int sm_count) {
  const std::int64_t chunks = (n + vec - 1) / vec;
  ElementwiseGrid g;
  g.gx = (chunks + kElementwiseThreads - 1) / kElementwiseThreads;
  const std::int64_t target = std::int64_t(sm_count) * 32;
  g.gy = std::clamp<std::int64_t>((target + g.gx - 1) / g.gx, 1, std::min<std::int64_t>(m, 65535));
  return g;
}

int dbias_slots(std::int64_t m, std::int64_t n) {
  const std::int64_t column_blocks = (n + 8 * kElementwiseThreads - 1) / (8 * kElementwiseThreads);
  return static_cast<int>(std::clamp<std::int64_t>(1024 / column_blocks, 1, std::min<std::int64_t>(m, 65535)));
}

int dz_pass_threads(std::int64_t n, int vec, std::int64_t gx) {
  const std::int64_t chunks = (n + vec - 1) / vec;
  const std::int64_t per_block = (chunks + gx - 1) / gx;
  return static_cast<int>((per_block + 31) / 32 * 32);
}

}  // namespace fusekit::linear

namespace fusekit::linear {

GatedForwardProblem gated_forward_problem(const GatedForwardParams& p) {
  GatedForwardProblem g;
  g.m = p.m;
  g.f = p.f;
  g.k = p.k;
  g.dtype = p.dtype;
  g.layout = p.layout;
  const auto aligned = [](const void* ptr, std::uintptr_t bytes) {
    return reinterpret_cast<std::uintptr_t>(ptr) % bytes == 0;
  };
  constexpr std::int64_t a = sm90::kFusedAlignmentElements;
  g.epilogue_aligned = !p.w_col_major && p.k % a == 0 && p.f % 4 == 0 && p.ldx % a == 0 && p.ldw % a == 0 &&
                       aligned16(p.x) && aligned16(p.w) && p.ldy % 4 == 0 && aligned(p.y, 8) &&
                       (!p.pre || (p.ldpre % a == 0 && aligned16(p.pre))) && (!p.bias || aligned(p.bias, 4));
  return g;
}

GatedForwardPath choose_gated_forward_path(const GatedForwardProblem& p, GatedForwardPath forced) {
  if (p.m == 0 || p.f == 0) return GatedForwardPath::trivial;
  const bool epilogue_serves = p.k > 0 && p.epilogue_aligned && p.layout == GatedLayout::interleaved &&
                               (p.dtype == DType::f16 || p.dtype == DType::bf16);
  if (forced == GatedForwardPath::gemm_then_gated) return forced;
  return epilogue_serves ? GatedForwardPath::epilogue : GatedForwardPath::gemm_then_gated;
}

}  // namespace fusekit::linear
