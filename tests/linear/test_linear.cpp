// Linear + bias + activation: the CPU reference against finite differences, every GPU path against
// the float64 CPU reference (error at most twice that of PyTorch-style float32 accumulation in the
// same dtype, see linear_baseline.h) over a randomized grid, path routing, layouts, degenerate
// shapes, determinism and argument errors.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "fusekit/error.h"
#include "fusekit/linear.h"
#include "fusekit/runtime.h"
#include "core/overrides.h"
#include "linear/linear_paths.h"
#include "tests/harness/gtest_helpers.h"
#include "tests/linear/linear_baseline.h"

namespace fusekit {
namespace {

using linear::ForwardPath;
using testing::Buffer;
using testing::error_of;
namespace lb = testing::linear;

constexpr Activation kActivations[] = {Activation::none,      Activation::relu,
                                       Activation::gelu_erf,  Activation::gelu_tanh,
                                       Activation::squared_relu, Activation::silu};

::testing::AssertionResult passes(const lb::Verdict& v) {
  if (v.pass) return ::testing::AssertionSuccess() << v.message;
  return ::testing::AssertionFailure() << v.message;
}

// Restores automatic path selection when a test that forced a path ends (even by failing).
struct PathOverride {
  explicit PathOverride(ForwardPath p) { linear::set_forward_path_override(p); }
  ~PathOverride() { linear::set_forward_path_override(ForwardPath::automatic); }
};

// Autotuning of GEMM algorithms and forward paths switched for one scope (then back on, the
// library's default).
struct AutotuneSetting {
  explicit AutotuneSetting(bool on) { detail::set_override("linear.autotune", on ? "on" : "off"); }
  ~AutotuneSetting() { detail::set_override("linear.autotune", ""); }
};

// Forces how the backward forms dz (and how many rows the dz-in-dgrad path forms before its
// kernel) for one scope, then back to the automatic choice.
struct BackwardPathOverride {
  explicit BackwardPathOverride(linear::BackwardPath p, long long first_rows = -1) {
    linear::set_backward_path_override(p);
    detail::set_override("linear.backward.dz_first_rows", first_rows >= 0 ? std::to_string(first_rows) : "");
  }
  ~BackwardPathOverride() {
    linear::set_backward_path_override(linear::BackwardPath::automatic);
    detail::set_override("linear.backward.dz_first_rows", "");
  }
};

OptionalTensor opt(const std::optional<Buffer>& b) {
  return b ? OptionalTensor(b->view()) : std::nullopt;
}

// A row-major (rows, cols) test matrix, optionally with `pad` extra elements per row and `lead`
// elements before its first (a pointer off 16-byte alignment).
Buffer matrix(DType dtype, Device d, std::int64_t rows, std::int64_t cols, std::int64_t pad = 0,
              std::int64_t lead = 0) {
  return Buffer(dtype, d, {rows, cols}, {cols + pad, 1}, lead);
}

// A weight-shaped (n, k) test matrix: row-major like matrix(), or column-major (strides
// (1, n + pad): the transpose of a row-major (k, n) matrix, GPT-2's Conv1D layout).
Buffer weight_matrix(DType dtype, Device d, std::int64_t n, std::int64_t k, bool col_major, std::int64_t pad = 0,
                     std::int64_t lead = 0) {
  if (!col_major) return matrix(dtype, d, n, k, pad, lead);
  return Buffer(dtype, d, {n, k}, {1, n + pad}, lead);
}

Buffer workspace_for(std::size_t bytes, Device d) {
  return Buffer(DType::u8, d, {static_cast<std::int64_t>(std::max<std::size_t>(bytes, 1))});
}

std::vector<double> normal_values(std::mt19937_64& rng, std::size_t n, double mean, double stddev,
                                  DType dtype) {
  std::normal_distribution<double> dist(mean, stddev);
  std::vector<double> v(n);
  for (auto& e : v) e = detail::round_to(dtype, dist(rng));
  return v;
}

// ---- float64 CPU reference runs ---------------------------------------------------------------

struct ForwardReference {
  std::vector<double> y, pre;
};

ForwardReference reference_forward(const std::vector<double>& x, const std::vector<double>& w,
                                   const std::vector<double>& bias, std::int64_t m,
                                   std::int64_t n, std::int64_t k, Activation act) {
  const Device cpu = Device::cpu();
  Buffer x64(DType::f64, cpu, {m, k}), w64(DType::f64, cpu, {n, k}), y64(DType::f64, cpu, {m, n}),
      p64(DType::f64, cpu, {m, n});
  x64.set_values(x);
  w64.set_values(w);
  std::optional<Buffer> b64;
  if (!bias.empty()) {
    b64.emplace(DType::f64, cpu, std::vector<std::int64_t>{n});
    b64->set_values(bias);
  }
  linear_forward(x64.view(), w64.view(), opt(b64), act, y64.view(), p64.view(), std::nullopt);
  return {y64.values(), p64.values()};
}

struct BackwardReference {
  std::vector<double> dx, dw, dbias;
};

BackwardReference reference_backward(const std::vector<double>& dout,
                                     const std::vector<double>& pre, const std::vector<double>& x,
                                     const std::vector<double>& w, std::int64_t m, std::int64_t n,
                                     std::int64_t k, Activation act) {
  const Device cpu = Device::cpu();
  Buffer g64(DType::f64, cpu, {m, n}), p64(DType::f64, cpu, {m, n}), x64(DType::f64, cpu, {m, k}),
      w64(DType::f64, cpu, {n, k}), dx64(DType::f64, cpu, {m, k}), dw64(DType::f64, cpu, {n, k}),
      db64(DType::f64, cpu, {n});
  g64.set_values(dout);
  p64.set_values(pre);
  x64.set_values(x);
  w64.set_values(w);
  linear_backward(g64.view(), x64.view(), w64.view(), p64.view(), act, dx64.view(), dw64.view(),
                  db64.view(), std::nullopt);
  return {dx64.values(), dw64.values(), db64.values()};
}

// ---- GPU forward / backward against the reference ---------------------------------------------

struct ForwardCase {
  DType dtype = DType::bf16;
  Activation act = Activation::none;
  std::int64_t m = 1, n = 1, k = 1;
  bool bias = true, pre = false;
  std::int64_t pad = 0;  // extra elements per row of x, W, y, pre
  std::int64_t lead = 0;  // elements before every tensor's first: pointers off 16-byte alignment
  bool w_col_major = false;
  std::string str() const {
    return std::string("forward ") + dtype_name(dtype) + " " + activation_name(act) + " (M, N, K) = (" +
           std::to_string(m) + ", " + std::to_string(n) + ", " + std::to_string(k) + ")" +
           (bias ? " +bias" : "") + (pre ? " +pre" : "") + (pad ? " pad " + std::to_string(pad) : "") +
           (lead ? " lead " + std::to_string(lead) : "") + (w_col_major ? " W column-major" : "");
  }
};

// Runs one forward on the GPU and checks y (and pre) against the float64 reference. Returns the
// path that ran.
ForwardPath check_forward(const ForwardCase& c, std::uint64_t salt) {
  SCOPED_TRACE(c.str());
  auto rng = testing::make_rng(salt);
  const Device gpu = Device::cuda(0);
  Buffer x = matrix(c.dtype, gpu, c.m, c.k, c.pad, c.lead);
  Buffer w = weight_matrix(c.dtype, gpu, c.n, c.k, c.w_col_major, c.pad, c.lead);
  Buffer y = matrix(c.dtype, gpu, c.m, c.n, c.pad, c.lead);
  std::optional<Buffer> bias, pre;
  const auto xv = normal_values(rng, c.m * c.k, 0.0, 1.0, c.dtype);
  // Weights scaled so that x W^T is O(1): every activation's interesting region is exercised.
  const auto wv = normal_values(rng, c.n * c.k, 0.0, 1.0 / std::sqrt(double(std::max<std::int64_t>(c.k, 1))), c.dtype);
  std::vector<double> bv;
  x.set_values(xv);
  w.set_values(wv);
  if (c.bias) {
    bv = normal_values(rng, c.n, 0.0, 0.5, c.dtype);
    bias.emplace(c.dtype, gpu, std::vector<std::int64_t>{c.n}, std::vector<std::int64_t>{}, c.lead);
    bias->set_values(bv);
  }
  if (c.pre) pre.emplace(matrix(c.dtype, gpu, c.m, c.n, c.pad, c.lead));
  Buffer ws = workspace_for(linear_forward_workspace_size(c.m, c.n, c.k, c.dtype, c.act, gpu), gpu);

  y.poison();
  if (pre) pre->poison();
  linear_forward(x.view(), w.view(), opt(bias), c.act, y.view(), opt(pre), ws.view());
  const ForwardPath path = linear::last_forward_path();
  SCOPED_TRACE(std::string("path ") + linear::forward_path_name(path));

  const ForwardReference ref = reference_forward(xv, wv, bv, c.m, c.n, c.k, c.act);
  const lb::ForwardBaseline base = lb::forward_baseline(xv, wv, bv, c.m, c.n, c.k, c.act, c.dtype);
  EXPECT_TRUE(passes(lb::judge(y.values(), ref.y, base.y, c.dtype, "y")));
  if (pre) EXPECT_TRUE(passes(lb::judge(pre->values(), ref.pre, base.pre, c.dtype, "pre_activation")));
  EXPECT_TRUE(y.lead_untouched());
  if (pre) EXPECT_TRUE(pre->lead_untouched());
  return path;
}

struct BackwardCase {
  DType dtype = DType::bf16;
  Activation act = Activation::none;
  std::int64_t m = 1, n = 1, k = 1;
  bool dx = true, dw = true, dbias = true;
  std::int64_t pad = 0;
  std::int64_t lead = 0;  // elements before every tensor's first: pointers off 16-byte alignment
  bool w_col_major = false, dw_col_major = false;
  std::string str() const {
    return std::string("backward ") + dtype_name(dtype) + " " + activation_name(act) +
           " (M, N, K) = (" + std::to_string(m) + ", " + std::to_string(n) + ", " +
           std::to_string(k) + ")" + (dx ? " dx" : "") + (dw ? " dW" : "") + (dbias ? " dbias" : "") +
           (pad ? " pad " + std::to_string(pad) : "") + (lead ? " lead " + std::to_string(lead) : "") +
           (w_col_major ? " W column-major" : "") + (dw_col_major ? " dW column-major" : "");
  }
};

// Runs one backward on GPU `device_index` and checks every gradient asked for against the float64
// reference. Returns how dz was formed.
linear::BackwardPath check_backward(const BackwardCase& c, std::uint64_t salt, int device_index = 0) {
  SCOPED_TRACE(c.str());
  auto rng = testing::make_rng(salt);
  const Device gpu = Device::cuda(device_index);
  Buffer dout = matrix(c.dtype, gpu, c.m, c.n, c.pad, c.lead), pre = matrix(c.dtype, gpu, c.m, c.n, c.pad, c.lead);
  Buffer x = matrix(c.dtype, gpu, c.m, c.k, c.pad, c.lead);
  Buffer w = weight_matrix(c.dtype, gpu, c.n, c.k, c.w_col_major, c.pad, c.lead);
  const auto gv = normal_values(rng, c.m * c.n, 0.0, 1.0, c.dtype);
  const auto pv = normal_values(rng, c.m * c.n, 0.0, 1.5, c.dtype);
  const auto xv = normal_values(rng, c.m * c.k, 0.0, 1.0, c.dtype);
  const auto wv = normal_values(rng, c.n * c.k, 0.0, 1.0 / std::sqrt(double(std::max<std::int64_t>(c.k, 1))), c.dtype);
  dout.set_values(gv);
  pre.set_values(pv);
  x.set_values(xv);
  w.set_values(wv);
  std::optional<Buffer> dx, dw, db;
  if (c.dx) dx.emplace(matrix(c.dtype, gpu, c.m, c.k, c.pad, c.lead));
  if (c.dw) dw.emplace(weight_matrix(c.dtype, gpu, c.n, c.k, c.dw_col_major, c.pad, c.lead));
  if (c.dbias) db.emplace(c.dtype, gpu, std::vector<std::int64_t>{c.n}, std::vector<std::int64_t>{}, c.lead);
  Buffer ws = workspace_for(linear_backward_workspace_size(c.m, c.n, c.k, c.dtype, c.act, gpu), gpu);
  const OptionalTensor pre_view = c.act == Activation::none ? std::nullopt : OptionalTensor(pre.view());
  for (std::optional<Buffer>* out : {&dx, &dw, &db})
    if (*out) (*out)->poison();
  linear_backward(dout.view(), x.view(), w.view(), pre_view, c.act, opt(dx), opt(dw), opt(db), ws.view());
  const linear::BackwardPath path = linear::last_backward_path();
  SCOPED_TRACE(std::string("dz ") + linear::backward_path_name(path));

  const BackwardReference ref = reference_backward(gv, pv, xv, wv, c.m, c.n, c.k, c.act);
  const lb::BackwardBaseline base = lb::backward_baseline(gv, pv, xv, wv, c.m, c.n, c.k, c.act, c.dtype);
  const std::int64_t dz_values = c.m * c.n;
  if (dx) EXPECT_TRUE(passes(lb::judge(dx->values(), ref.dx, base.dx, c.dtype, "dx", dz_values)));
  if (dw) EXPECT_TRUE(passes(lb::judge(dw->values(), ref.dw, base.dw, c.dtype, "dW", dz_values)));
  if (db) EXPECT_TRUE(passes(lb::judge(db->values(), ref.dbias, base.dbias, c.dtype, "dbias", dz_values)));
  for (const std::optional<Buffer>* out : {&dx, &dw, &db})
    if (*out) EXPECT_TRUE((*out)->lead_untouched());
  return path;
}

// ---- CPU reference --------------------------------------------------------------------------

// The reference against a direct evaluation of the formula, for a 3-D x with padded rows.
TEST(LinearCpu, ForwardMatchesFormula) {
  auto rng = testing::make_rng(1);
  const Device cpu = Device::cpu();
  const std::int64_t b = 2, t = 3, k = 5, n = 4, m = b * t;
  for (Activation act : kActivations) {
    SCOPED_TRACE(activation_name(act));
    Buffer x(DType::f64, cpu, {b, t, k}, {t * (k + 2), k + 2, 1});  // padded rows
    Buffer w(DType::f64, cpu, {n, k}), bias(DType::f64, cpu, {n});
    Buffer y(DType::f64, cpu, {b, t, n}), pre(DType::f64, cpu, {b, t, n});
    x.fill_normal(rng);
    w.fill_normal(rng, 0.0, 0.5);
    bias.fill_normal(rng);
    linear_forward(x.view(), w.view(), bias.view(), act, y.view(), pre.view(), std::nullopt);
    const auto xv = x.values(), wv = w.values(), bv = bias.values(), yv = y.values(), pv = pre.values();
    for (std::int64_t r = 0; r < m; ++r)
      for (std::int64_t c = 0; c < n; ++c) {
        double z = bv[c];
        for (std::int64_t i = 0; i < k; ++i) z += xv[r * k + i] * wv[c * k + i];
        EXPECT_NEAR(pv[r * n + c], z, 1e-12);
        EXPECT_NEAR(yv[r * n + c], detail::ActivationMath<double>::forward(act, z, 0.0), 1e-12);
      }
  }
}

// A column-major W (and dW) gives the row-major one's outputs exactly: the reference reads the
// same values into the same float64 sums.
TEST(LinearCpu, ColumnMajorWeightEqualsRowMajor) {
  auto rng = testing::make_rng(3);
  const Device cpu = Device::cpu();
  const std::int64_t m = 6, n = 5, k = 7;
  for (Activation act : {Activation::none, Activation::gelu_tanh}) {
    SCOPED_TRACE(activation_name(act));
    Buffer x(DType::f64, cpu, {m, k}), bias(DType::f64, cpu, {n}), dout(DType::f64, cpu, {m, n});
    Buffer w_rows = weight_matrix(DType::f64, cpu, n, k, false), w_cols = weight_matrix(DType::f64, cpu, n, k, true, 3);
    x.fill_normal(rng);
    bias.fill_normal(rng);
    dout.fill_normal(rng);
    w_rows.fill_normal(rng, 0.0, 0.5);
    w_cols.set_values(w_rows.values());
    Buffer y_rows(DType::f64, cpu, {m, n}), y_cols(DType::f64, cpu, {m, n});
    Buffer pre_rows(DType::f64, cpu, {m, n}), pre_cols(DType::f64, cpu, {m, n});
    linear_forward(x.view(), w_rows.view(), bias.view(), act, y_rows.view(), pre_rows.view(), std::nullopt);
    linear_forward(x.view(), w_cols.view(), bias.view(), act, y_cols.view(), pre_cols.view(), std::nullopt);
    EXPECT_EQ(y_rows.values(), y_cols.values());
    EXPECT_EQ(pre_rows.values(), pre_cols.values());
    for (bool dw_col_major : {false, true}) {
      Buffer dx_rows(DType::f64, cpu, {m, k}), dx_cols(DType::f64, cpu, {m, k});
      Buffer dw_rows = weight_matrix(DType::f64, cpu, n, k, false);
      Buffer dw_cols = weight_matrix(DType::f64, cpu, n, k, dw_col_major, 2);
      dw_cols.poison();
      linear_backward(dout.view(), x.view(), w_rows.view(), pre_rows.view(), act, dx_rows.view(), dw_rows.view(),
                      std::nullopt, std::nullopt);
      linear_backward(dout.view(), x.view(), w_cols.view(), pre_cols.view(), act, dx_cols.view(), dw_cols.view(),
                      std::nullopt, std::nullopt);
      EXPECT_EQ(dx_rows.values(), dx_cols.values());
      EXPECT_EQ(dw_rows.values(), dw_cols.values()) << "dW column-major " << dw_col_major;
    }
  }
}

// Central differences of L = sum(y * dout) with respect to x, W and bias, every activation.
TEST(LinearCpu, GradientsMatchFiniteDifferences) {
  auto rng = testing::make_rng(2);
  const Device cpu = Device::cpu();
  const std::int64_t m = 3, n = 4, k = 5;
  for (Activation act : kActivations) {
    SCOPED_TRACE(activation_name(act));
    Buffer x(DType::f64, cpu, {m, k}), w(DType::f64, cpu, {n, k}), bias(DType::f64, cpu, {n});
    Buffer y(DType::f64, cpu, {m, n}), pre(DType::f64, cpu, {m, n}), dout(DType::f64, cpu, {m, n});
    Buffer dx(DType::f64, cpu, {m, k}), dw(DType::f64, cpu, {n, k}), db(DType::f64, cpu, {n});
    // Redraw until no pre-activation sits on relu's kink (within the difference step).
    for (int attempt = 0; attempt < 100; ++attempt) {
      x.fill_normal(rng);
      w.fill_normal(rng, 0.0, 0.5);
      bias.fill_normal(rng);
      linear_forward(x.view(), w.view(), bias.view(), act, y.view(), pre.view(), std::nullopt);
      bool near_kink = false;
      for (double z : pre.values()) near_kink |= std::abs(z) < 1e-3;
      if (!near_kink) break;
    }
    dout.fill_normal(rng);
    linear_backward(dout.view(), x.view(), w.view(), pre.view(), act, dx.view(), dw.view(), db.view(),
                    std::nullopt);
    const auto g = dout.values();
    auto loss = [&] {
      linear_forward(x.view(), w.view(), bias.view(), act, y.view(), std::nullopt, std::nullopt);
      const auto yv = y.values();
      double l = 0;
      for (std::size_t i = 0; i < yv.size(); ++i) l += yv[i] * g[i];
      return l;
    };
    auto fd = [&](Buffer& param, std::int64_t i) { return testing::central_difference(param, i, 1e-6, loss); };
    const auto dxv = dx.values(), dwv = dw.values(), dbv = db.values();
    for (std::int64_t i = 0; i < m * k; ++i) EXPECT_NEAR(fd(x, i), dxv[i], 1e-6 * (1 + std::abs(dxv[i]))) << "dx " << i;
    for (std::int64_t i = 0; i < n * k; ++i) EXPECT_NEAR(fd(w, i), dwv[i], 1e-6 * (1 + std::abs(dwv[i]))) << "dW " << i;
    for (std::int64_t i = 0; i < n; ++i) EXPECT_NEAR(fd(bias, i), dbv[i], 1e-6 * (1 + std::abs(dbv[i]))) << "dbias " << i;
  }
}

// In f32/f16/bf16 the CPU backend is the float64 computation rounded once to the dtype.
TEST(LinearCpu, LowPrecisionDtypesRoundTheFloat64Result) {
  auto rng = testing::make_rng(3);
  const Device cpu = Device::cpu();
  const std::int64_t m = 7, n = 9, k = 11;
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    Buffer x(dt, cpu, {m, k}), w(dt, cpu, {n, k}), b(dt, cpu, {n}), y(dt, cpu, {m, n}), pre(dt, cpu, {m, n});
    Buffer dout(dt, cpu, {m, n}), dx(dt, cpu, {m, k}), dw(dt, cpu, {n, k}), db(dt, cpu, {n});
    x.fill_normal(rng);
    w.fill_normal(rng, 0.0, 0.3);
    b.fill_normal(rng);
    dout.fill_normal(rng);
    linear_forward(x.view(), w.view(), b.view(), Activation::silu, y.view(), pre.view(), std::nullopt);
    linear_backward(dout.view(), x.view(), w.view(), pre.view(), Activation::silu, dx.view(), dw.view(),
                    db.view(), std::nullopt);
    const ForwardReference f = reference_forward(x.values(), w.values(), b.values(), m, n, k, Activation::silu);
    const BackwardReference g = reference_backward(dout.values(), pre.values(), x.values(), w.values(), m,
                                                   n, k, Activation::silu);
    auto rounded = [dt](std::vector<double> v) {
      for (auto& e : v) e = detail::round_to(dt, e);
      return v;
    };
    EXPECT_EQ(y.values(), rounded(f.y));
    EXPECT_EQ(pre.values(), rounded(f.pre));
    EXPECT_EQ(dx.values(), rounded(g.dx));
    EXPECT_EQ(dw.values(), rounded(g.dw));
    EXPECT_EQ(db.values(), rounded(g.dbias));
  }
}

// The GPU tests' bar itself: the emulated float32 baseline passes it, wrong results do not.
TEST(LinearCpu, ToleranceRejectsWrongResults) {
  auto rng = testing::make_rng(4);
  const std::int64_t m = 64, n = 48, k = 256;
  for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
    SCOPED_TRACE(dtype_name(dt));
    const auto xv = normal_values(rng, m * k, 0.0, 1.0, dt);
    const auto wv = normal_values(rng, n * k, 0.0, 1.0 / 16, dt);
    const auto bv = normal_values(rng, n, 0.0, 0.5, dt);
    const ForwardReference ref = reference_forward(xv, wv, bv, m, n, k, Activation::silu);
    const lb::ForwardBaseline base = lb::forward_baseline(xv, wv, bv, m, n, k, Activation::silu, dt);
    EXPECT_TRUE(lb::judge(base.y, ref.y, base.y, dt, "baseline").pass);
    auto rounded = ref.y;
    for (auto& v : rounded) v = detail::round_to(dt, v);
    EXPECT_TRUE(lb::judge(rounded, ref.y, base.y, dt, "rounded reference").pass);
    auto scaled = base.y;
    for (auto& v : scaled) v *= 1.01;
    EXPECT_FALSE(lb::judge(scaled, ref.y, base.y, dt, "1% off").pass);
    auto with_nan = base.y;
    with_nan[17] = std::nan("");
    EXPECT_FALSE(lb::judge(with_nan, ref.y, base.y, dt, "one NaN").pass);
    const lb::ForwardBaseline relu = lb::forward_baseline(xv, wv, bv, m, n, k, Activation::relu, dt);
    EXPECT_FALSE(lb::judge(relu.y, ref.y, base.y, dt, "wrong activation").pass);
    // Backward: a dW that forgot act'(pre) fails.
    const auto gv = normal_values(rng, m * n, 0.0, 1.0, dt);
    const BackwardReference bref = reference_backward(gv, ref.pre, xv, wv, m, n, k, Activation::silu);
    const lb::BackwardBaseline bbase = lb::backward_baseline(gv, ref.pre, xv, wv, m, n, k, Activation::silu, dt);
    const lb::BackwardBaseline no_act = lb::backward_baseline(gv, ref.pre, xv, wv, m, n, k, Activation::none, dt);
    EXPECT_TRUE(lb::judge(bbase.dw, bref.dw, bbase.dw, dt, "baseline dW").pass);
    EXPECT_FALSE(lb::judge(no_act.dw, bref.dw, bbase.dw, dt, "dW without act'").pass);
  }
}

// Few dz values: the bar of every backward output is that of its dz values (floored for fewer
// than 1024), however many elements the output has; it still refuses a 1% error. The case is the
// one a random draw failed: f32 gelu_erf (M, N, K) = (3, 1, 512), a device erff 2 ulp from glibc's.
TEST(LinearCpu, FewDzValuesHaveTheSmallSampleBar) {
  auto rng = testing::make_rng(5);
  const std::int64_t m = 3, n = 1, k = 512;
  const DType dt = DType::f32;
  const auto xv = normal_values(rng, m * k, 0.0, 1.0, dt);
  const auto wv = normal_values(rng, n * k, 0.0, 1.0 / 16, dt);
  const auto gv = normal_values(rng, m * n, 0.0, 1.0, dt);
  const auto pv = normal_values(rng, m * n, 0.0, 1.5, dt);
  const BackwardReference ref = reference_backward(gv, pv, xv, wv, m, n, k, Activation::gelu_erf);
  const lb::BackwardBaseline base = lb::backward_baseline(gv, pv, xv, wv, m, n, k, Activation::gelu_erf, dt);
  // dx = dz w exactly here (one term), so a dz 4 float32 ulp off is a dx 4 ulp off.
  auto ulps_off = ref.dx;
  for (auto& v : ulps_off) v = static_cast<double>(static_cast<float>(v * (1.0 + 0x1p-22)));
  EXPECT_TRUE(lb::judge(ulps_off, ref.dx, base.dx, dt, "dx 4 ulp off", m * n).pass);
  auto scaled = ref.dx;
  for (auto& v : scaled) v *= 1.01;
  EXPECT_FALSE(lb::judge(scaled, ref.dx, base.dx, dt, "dx 1% off", m * n).pass);
  // With many dz values the bar is the float32 baseline's again: 1e-5 relative is refused.
  const std::int64_t mm = 64, nn = 48;
  const auto xv2 = normal_values(rng, mm * k, 0.0, 1.0, dt);
  const auto wv2 = normal_values(rng, nn * k, 0.0, 1.0 / 16, dt);
  const auto gv2 = normal_values(rng, mm * nn, 0.0, 1.0, dt);
  const auto pv2 = normal_values(rng, mm * nn, 0.0, 1.5, dt);
  const BackwardReference ref2 = reference_backward(gv2, pv2, xv2, wv2, mm, nn, k, Activation::gelu_erf);
  const lb::BackwardBaseline base2 =
      lb::backward_baseline(gv2, pv2, xv2, wv2, mm, nn, k, Activation::gelu_erf, dt);
  auto off = ref2.dx;
  for (auto& v : off) v *= 1.0 + 1e-5;
  EXPECT_FALSE(lb::judge(off, ref2.dx, base2.dx, dt, "dx 1e-5 off", mm * nn).pass);
}

TEST(LinearCpu, EmptyDimensions) {
  const Device cpu = Device::cpu();
  // K = 0: y = act(bias); dbias = sum of dz; dx, dW are empty.
  {
    Buffer x(DType::f64, cpu, {3, 0}), w(DType::f64, cpu, {2, 0}), b(DType::f64, cpu, {2});
    Buffer y(DType::f64, cpu, {3, 2}), pre(DType::f64, cpu, {3, 2});
    b.set_values({-1.0, 2.0});
    linear_forward(x.view(), w.view(), b.view(), Activation::relu, y.view(), pre.view(), std::nullopt);
    EXPECT_EQ(y.values(), (std::vector<double>{0, 2, 0, 2, 0, 2}));
    EXPECT_EQ(pre.values(), (std::vector<double>{-1, 2, -1, 2, -1, 2}));
    Buffer dout(DType::f64, cpu, {3, 2}), db(DType::f64, cpu, {2});
    dout.set_values({1, 1, 2, 2, 3, 3});
    linear_backward(dout.view(), x.view(), w.view(), pre.view(), Activation::relu, std::nullopt,
                    std::nullopt, db.view(), std::nullopt);
    EXPECT_EQ(db.values(), (std::vector<double>{0, 6}));
  }
  // M = 0: dW and dbias are zero.
  {
    Buffer x(DType::f64, cpu, {0, 4}), w(DType::f64, cpu, {2, 4}), dout(DType::f64, cpu, {0, 2});
    Buffer dw(DType::f64, cpu, {2, 4}), db(DType::f64, cpu, {2});
    linear_backward(dout.view(), x.view(), w.view(), std::nullopt, Activation::none, std::nullopt,
                    dw.view(), db.view(), std::nullopt);
    for (double v : dw.values()) EXPECT_EQ(v, 0.0);
    for (double v : db.values()) EXPECT_EQ(v, 0.0);
  }
}

// ---- argument errors (checked before any backend runs) -------------------------------------

bool has(const std::string& message, const std::string& part) {
  return message.find(part) != std::string::npos;
}

struct ErrorFixture {
  const Device cpu = Device::cpu();
  std::vector<std::uint16_t> xb = std::vector<std::uint16_t>(64 * 32 + 8);
  std::vector<std::uint16_t> wb = std::vector<std::uint16_t>(48 * 32 + 8);
  std::vector<std::uint16_t> yb = std::vector<std::uint16_t>(64 * 48 + 8);
  std::vector<std::uint16_t> pb = std::vector<std::uint16_t>(64 * 48 + 8);
  std::vector<std::uint16_t> bb = std::vector<std::uint16_t>(48 + 8);
  TensorView x{xb.data(), DType::bf16, cpu, {64, 32}};
  TensorView w{wb.data(), DType::bf16, cpu, {48, 32}};
  TensorView y{yb.data(), DType::bf16, cpu, {64, 48}};
  TensorView pre{pb.data(), DType::bf16, cpu, {64, 48}};
  TensorView b{bb.data(), DType::bf16, cpu, {48}};
};

TEST(LinearErrors, MismatchedShapes) {
  ErrorFixture f;
  TensorView w_bad(f.wb.data(), DType::bf16, f.cpu, {48, 31});
  EXPECT_EQ(error_of([&] { linear_forward(f.x, w_bad, f.b, Activation::relu, f.y, std::nullopt, std::nullopt); }),
            "fusekit.linear_forward: argument 'weight': expected shape (N, 32) (K = x's last "
            "dimension), got (48, 31)");
  TensorView y_bad(f.yb.data(), DType::bf16, f.cpu, {64, 47});
  EXPECT_TRUE(has(error_of([&] { linear_forward(f.x, f.w, f.b, Activation::relu, y_bad, std::nullopt, std::nullopt); }),
                  "argument 'y': expected shape (64, 48)"));
  TensorView b_bad(f.bb.data(), DType::bf16, f.cpu, {47});
  EXPECT_TRUE(has(error_of([&] { linear_forward(f.x, f.w, b_bad, Activation::relu, f.y, std::nullopt, std::nullopt); }),
                  "argument 'bias': expected shape (48), got (47)"));
  TensorView pre_bad(f.pb.data(), DType::bf16, f.cpu, {63, 48});
  EXPECT_TRUE(has(error_of([&] { linear_forward(f.x, f.w, f.b, Activation::relu, f.y, pre_bad, std::nullopt); }),
                  "argument 'pre_activation': expected shape (64, 48)"));
  TensorView w3(f.wb.data(), DType::bf16, f.cpu, {2, 24, 32});
  EXPECT_TRUE(has(error_of([&] { linear_forward(f.x, w3, std::nullopt, Activation::none, f.y, std::nullopt, std::nullopt); }),
                  "argument 'weight': expected a 2-D tensor (N, K), got shape (2, 24, 32)"));
  // Backward: dout not (M, N); dx not like x; dweight not like weight.
  TensorView dout_bad(f.yb.data(), DType::bf16, f.cpu, {64, 40});
  EXPECT_TRUE(has(error_of([&] { linear_backward(dout_bad, f.x, f.w, f.pre, Activation::gelu_erf, std::nullopt, std::nullopt, std::nullopt, std::nullopt); }),
                  "argument 'dout': expected shape (64, 48)"));
  TensorView dx_bad(f.xb.data(), DType::bf16, f.cpu, {64, 16});
  EXPECT_TRUE(has(error_of([&] { linear_backward(f.y, f.x, f.w, f.pre, Activation::silu, dx_bad, std::nullopt, std::nullopt, std::nullopt); }),
                  "argument 'dx': expected shape (64, 32)"));
  TensorView dw_bad(f.wb.data(), DType::bf16, f.cpu, {32, 48});
  EXPECT_TRUE(has(error_of([&] { linear_backward(f.y, f.x, f.w, f.pre, Activation::silu, std::nullopt, dw_bad, std::nullopt, std::nullopt); }),
                  "argument 'dweight': expected shape (48, 32)"));
  // Strides: a non-contiguous last dimension.
  TensorView x_strided(f.xb.data(), DType::bf16, f.cpu, {32, 32}, {64, 2});
  TensorView y_half(f.yb.data(), DType::bf16, f.cpu, {32, 48});
  EXPECT_TRUE(has(error_of([&] { linear_forward(x_strided, f.w, f.b, Activation::none, y_half, std::nullopt, std::nullopt); }),
                  "argument 'x': expected a contiguous last dimension"));
}

// W and dW: rows contiguous or columns contiguous, nothing else.
TEST(LinearErrors, WeightLayout) {
  ErrorFixture f;
  std::vector<std::uint16_t> big(48 * 64 + 8);
  TensorView w_strided(big.data(), DType::bf16, f.cpu, {48, 32}, {64, 2});
  EXPECT_EQ(error_of([&] { linear_forward(f.x, w_strided, f.b, Activation::none, f.y, std::nullopt, std::nullopt); }),
            "fusekit.linear_forward: argument 'weight': expected rows or columns contiguous: strides (ld, 1) "
            "with ld >= K (the nn.Linear layout) or (1, ld) with ld >= N (the transpose of a row-major (K, N) "
            "matrix), got strides (64, 2)");
  TensorView w_short(big.data(), DType::bf16, f.cpu, {48, 32}, {1, 40});
  EXPECT_TRUE(has(error_of([&] { linear_forward(f.x, w_short, f.b, Activation::none, f.y, std::nullopt, std::nullopt); }),
                  "argument 'weight': expected a column stride of at least N = 48 (columns contiguous), got column "
                  "stride 40"));
  TensorView w_cols(big.data(), DType::bf16, f.cpu, {48, 32}, {1, 48});
  TensorView dw_strided(f.wb.data(), DType::bf16, f.cpu, {24, 32}, {32, 2});
  EXPECT_TRUE(has(error_of([&] { linear_backward(f.y, f.x, w_cols, std::nullopt, Activation::none, std::nullopt,
                                                 dw_strided, std::nullopt, std::nullopt); }),
                  "argument 'dweight': expected rows or columns contiguous"));
  TensorView dw_cols_wrong(f.wb.data(), DType::bf16, f.cpu, {32, 48}, {1, 32});
  EXPECT_TRUE(has(error_of([&] { linear_backward(f.y, f.x, w_cols, std::nullopt, Activation::none, std::nullopt,
                                                 dw_cols_wrong, std::nullopt, std::nullopt); }),
                  "argument 'dweight': expected shape (48, 32) (as 'weight'), got (32, 48)"));
}

TEST(LinearErrors, DtypeMismatch) {
  ErrorFixture f;
  TensorView w16(f.wb.data(), DType::f16, f.cpu, {48, 32});
  EXPECT_EQ(error_of([&] { linear_forward(f.x, w16, f.b, Activation::relu, f.y, std::nullopt, std::nullopt); }),
            "fusekit.linear_forward: argument 'weight': expected dtype bf16 (as 'x'), got f16");
  std::vector<float> b32_storage(48);
  TensorView bias_f32(b32_storage.data(), DType::f32, f.cpu, {48});
  EXPECT_TRUE(has(error_of([&] { linear_forward(f.x, f.w, bias_f32, Activation::relu, f.y, std::nullopt, std::nullopt); }),
                  "argument 'bias': expected dtype bf16 (as 'x'), got f32"));
  TensorView y16(f.yb.data(), DType::f16, f.cpu, {64, 48});
  EXPECT_TRUE(has(error_of([&] { linear_forward(f.x, f.w, f.b, Activation::relu, y16, std::nullopt, std::nullopt); }),
                  "argument 'y': expected dtype bf16 (as 'x'), got f16"));
  std::vector<std::int32_t> xi(64 * 32);
  TensorView x_int(xi.data(), DType::i32, f.cpu, {64, 32});
  EXPECT_TRUE(has(error_of([&] { linear_forward(x_int, f.w, f.b, Activation::relu, f.y, std::nullopt, std::nullopt); }),
                  "argument 'x': expected dtype f32, f16, bf16 or f64, got i32"));
  // f64 is the CPU reference's alone (checked before anything touches the device).
  TensorView x64(reinterpret_cast<void*>(0x1000), DType::f64, Device::cuda(0), {64, 32});
  TensorView w64(reinterpret_cast<void*>(0x2000), DType::f64, Device::cuda(0), {48, 32});
  TensorView y64(reinterpret_cast<void*>(0x3000), DType::f64, Device::cuda(0), {64, 48});
  EXPECT_TRUE(has(error_of([&] { linear_forward(x64, w64, std::nullopt, Activation::none, y64, std::nullopt, std::nullopt); }),
                  "argument 'x': expected dtype f32, f16 or bf16 on a CUDA device (f64 runs on the CPU reference only), got f64"));
}

TEST(LinearErrors, Alignment) {
  ErrorFixture f;
  // A bf16 tensor starting at an odd byte address.
  auto* odd = reinterpret_cast<unsigned char*>(f.xb.data()) + 1;
  TensorView x_odd(odd, DType::bf16, f.cpu, {64, 32});
  EXPECT_EQ(error_of([&] { linear_forward(x_odd, f.w, f.b, Activation::relu, f.y, std::nullopt, std::nullopt); }),
            "fusekit.linear_forward: argument 'x': expected a data pointer aligned to 2 bytes (the "
            "bf16 element size), got an address 1 bytes past such a boundary");
  TensorView y_odd(reinterpret_cast<unsigned char*>(f.yb.data()) + 1, DType::bf16, f.cpu, {64, 48});
  EXPECT_TRUE(has(error_of([&] { linear_forward(f.x, f.w, f.b, Activation::relu, y_odd, std::nullopt, std::nullopt); }),
                  "argument 'y': expected a data pointer aligned to 2 bytes"));
  TensorView b_odd(reinterpret_cast<unsigned char*>(f.bb.data()) + 1, DType::bf16, f.cpu, {48});
  EXPECT_TRUE(has(error_of([&] { linear_backward(f.y, f.x, f.w, f.pre, Activation::relu, std::nullopt, std::nullopt, b_odd, std::nullopt); }),
                  "argument 'dbias': expected a data pointer aligned to 2 bytes"));
}

TEST(LinearErrors, DeviceMix) {
  ErrorFixture f;
  TensorView w_gpu(f.wb.data(), DType::bf16, Device::cuda(0), {48, 32});
  EXPECT_EQ(error_of([&] { linear_forward(f.x, w_gpu, f.b, Activation::relu, f.y, std::nullopt, std::nullopt); }),
            "fusekit.linear_forward: argument 'weight': expected a tensor on cpu (where 'x' is), got "
            "a tensor on cuda:0");
  TensorView dx_gpu(f.xb.data(), DType::bf16, Device::cuda(1), {64, 32});
  EXPECT_TRUE(has(error_of([&] { linear_backward(f.y, f.x, f.w, f.pre, Activation::relu, dx_gpu, std::nullopt, std::nullopt, std::nullopt); }),
                  "argument 'dx': expected a tensor on cpu (where 'dout' is), got a tensor on cuda:1"));
}

// Outputs that share memory with an input or with each other: the GEMMs read while they write and
// autotuning runs them more than once, so this would be a silent wrong answer; it is refused.
TEST(LinearErrors, OverlappingOutputs) {
  ErrorFixture f;
  std::vector<std::uint16_t> big(64 * 48 + 8);
  TensorView y_big(big.data(), DType::bf16, f.cpu, {64, 48});
  TensorView x_in_big(big.data() + 8, DType::bf16, f.cpu, {64, 32});
  EXPECT_EQ(error_of([&] { linear_forward(x_in_big, f.w, f.b, Activation::relu, y_big, std::nullopt, std::nullopt); }),
            "fusekit.linear_forward: argument 'y': expected memory that does not overlap 'x', got a "
            "view sharing bytes with 'x'");
  EXPECT_TRUE(has(error_of([&] { linear_forward(f.x, f.w, f.b, Activation::gelu_tanh, f.y, f.y, std::nullopt); }),
                  "argument 'y': expected memory that does not overlap 'pre_activation'"));
  TensorView dx_on_dout(f.yb.data(), DType::bf16, f.cpu, {64, 32});
  EXPECT_TRUE(has(error_of([&] { linear_backward(f.y, f.x, f.w, f.pre, Activation::relu, dx_on_dout, std::nullopt, std::nullopt, std::nullopt); }),
                  "argument 'dx': expected memory that does not overlap 'dout'"));
  std::vector<std::uint16_t> dwb(48 * 32 + 8);
  TensorView dw(dwb.data(), DType::bf16, f.cpu, {48, 32});
  TensorView db_in_dw(dwb.data() + 40, DType::bf16, f.cpu, {48});
  EXPECT_TRUE(has(error_of([&] { linear_backward(f.y, f.x, f.w, f.pre, Activation::relu, std::nullopt, dw, db_in_dw, std::nullopt); }),
                  "argument 'dweight': expected memory that does not overlap 'dbias'"));
  EXPECT_TRUE(has(error_of([&] { linear_backward(f.y, f.x, f.w, f.pre, Activation::relu, std::nullopt, f.w, std::nullopt, std::nullopt); }),
                  "argument 'dweight': expected memory that does not overlap 'weight'"));
  // Adjacent but disjoint buffers are fine: y right after x's last element.
  TensorView x_front(big.data(), DType::bf16, f.cpu, {8, 32});
  TensorView y_after(big.data() + 8 * 32, DType::bf16, f.cpu, {8, 48});
  EXPECT_NO_THROW(linear_forward(x_front, f.w, f.b, Activation::relu, y_after, std::nullopt, std::nullopt));
  // Column blocks of one (64, 80) matrix: x its first 32 columns, y the other 48. Their spans
  // interleave, their bytes do not: accepted. One column more and they share bytes.
  TensorView x_cols(big.data(), DType::bf16, f.cpu, {16, 32}, {80, 1});
  TensorView y_cols(big.data() + 32, DType::bf16, f.cpu, {16, 48}, {80, 1});
  EXPECT_NO_THROW(linear_forward(x_cols, f.w, f.b, Activation::relu, y_cols, std::nullopt, std::nullopt));
  TensorView y_cols_shared(big.data() + 31, DType::bf16, f.cpu, {16, 48}, {80, 1});
  EXPECT_TRUE(has(error_of([&] { linear_forward(x_cols, f.w, f.b, Activation::relu, y_cols_shared, std::nullopt, std::nullopt); }),
                  "argument 'y': expected memory that does not overlap 'x'"));
}

TEST(LinearErrors, ActivationAndMissingInputs) {
  ErrorFixture f;
  EXPECT_TRUE(has(error_of([&] { linear_forward(f.x, f.w, f.b, Activation::leaky_relu, f.y, std::nullopt, std::nullopt); }),
                  "argument 'activation': expected none, relu, gelu_erf, gelu_tanh, squared_relu or silu"));
  EXPECT_TRUE(has(error_of([&] { linear_forward(f.x, f.w, f.b, static_cast<Activation>(77), f.y, std::nullopt, std::nullopt); }),
                  "got activation code 77"));
  EXPECT_EQ(error_of([&] { linear_backward(f.y, f.x, f.w, std::nullopt, Activation::gelu_tanh, std::nullopt, std::nullopt, std::nullopt, std::nullopt); }),
            "fusekit.linear_backward: argument 'pre_activation': expected the saved pre-activation "
            "(required for activation gelu_tanh), got none");
  TensorView x_null(nullptr, DType::bf16, f.cpu, {64, 32});
  EXPECT_TRUE(has(error_of([&] { linear_forward(x_null, f.w, f.b, Activation::relu, f.y, std::nullopt, std::nullopt); }),
                  "argument 'x': expected a non-null data pointer"));
}

// ---- GPU ---------------------------------------------------------------------------------------

// The randomized grids' draw of a case's dtype and (M, N, K): sizes from 1 to over 1000 that are
// and are not multiples of 8 (the fused kernel's alignment), in every GPU dtype.
template <typename GemmCase>
void draw_dtype_and_sizes(std::mt19937_64& rng, GemmCase& c) {
  constexpr std::int64_t ms[] = {1, 2, 3, 17, 64, 127, 128, 333, 1000};
  constexpr std::int64_t ns[] = {1, 5, 8, 24, 96, 130, 256, 264, 1000};
  constexpr std::int64_t ks[] = {1, 3, 8, 13, 64, 136, 512, 1000, 1024};
  constexpr DType dtypes[] = {DType::bf16, DType::f16, DType::f32};
  c.dtype = dtypes[rng() % 3];
  c.m = ms[rng() % 9];
  c.n = ns[rng() % 9];
  c.k = ks[rng() % 9];
}

// Padded rows (8 or 3 extra elements) in about a quarter of the cases.
std::int64_t draw_pad(std::mt19937_64& rng) { return (rng() % 4 == 0) ? (rng() % 2 ? 8 : 3) : 0; }

// The randomized grids and the forced-path sweeps run as one test per activation, shape or path
// (LinearGpu/<suite>.<test>/<param>), so that the sanitizer runs (scripts/sanitize_gpu.sh) can
// spread them over GoogleTest shards.
std::string activation_param_name(const ::testing::TestParamInfo<Activation>& info) {
  return activation_name(info.param);
}

class PerActivation : public ::testing::TestWithParam<Activation> {
 protected:
  int index() const {
    return static_cast<int>(std::find(std::begin(kActivations), std::end(kActivations), GetParam()) -
                            std::begin(kActivations));
  }
};

using ForwardGrid = PerActivation;
TEST_P(ForwardGrid, MatchesReference) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(100 + index());
  for (int rep = 0; rep < 10; ++rep) {
    ForwardCase c;
    c.act = GetParam();
    draw_dtype_and_sizes(rng, c);
    c.bias = rng() % 4 != 0;
    c.pre = rng() % 2 == 0;
    c.pad = draw_pad(rng);
    check_forward(c, 1000 + 10 * index() + rep);
  }
}
INSTANTIATE_TEST_SUITE_P(LinearGpu, ForwardGrid, ::testing::ValuesIn(kActivations),
                         activation_param_name);

// Every small K with dbias, in every dtype: cuBLASLt's fused BGRADB returned non-finite dbias for
// K = 1 in f16 (found by the randomized grid); small K now sums dz in fusekit's own kernel.
TEST(LinearGpu, BackwardDbiasWithSmallK) {
  FUSEKIT_REQUIRE_GPU();
  int cases = 0;
  for (DType dtype : {DType::f16, DType::bf16, DType::f32}) {
    for (std::int64_t k : {1, 2, 3, 8, 13, 63, 64, 136}) {
      for (Activation act : {Activation::none, Activation::silu, Activation::relu}) {
        BackwardCase c;
        c.dtype = dtype;
        c.act = act;
        c.m = 1000;
        c.n = 1000;
        c.k = k;
        check_backward(c, 5000 + cases++);
      }
    }
  }
  EXPECT_EQ(cases, 72);
}

// dbias from fusekit's column sums (in the dz pass with an activation, by the column-sum kernel
// without one). The shapes cover one row (one partial row), fewer rows than partial slots, N past
// one block of columns (2 x 2048 + 8: several column blocks and a partial one), odd N
// (element-wise kernel) and rows padded in memory.
TEST(LinearGpu, DbiasMatchesReference) {
  FUSEKIT_REQUIRE_GPU();
  struct Shape {
    std::int64_t m, n, k, pad;
  };
  const Shape shapes[] = {{1, 64, 64, 0}, {5, 4104, 72, 0}, {3001, 1000, 128, 8}, {700, 4104, 64, 0}, {1500, 333, 96, 3}};
  int cases = 0;
  for (DType dtype : {DType::bf16, DType::f32}) {
    for (Activation act : {Activation::none, Activation::gelu_tanh, Activation::relu}) {
      for (const Shape& s : shapes) {
        // With and without the dx GEMM.
        const BackwardCase c{dtype, act, s.m, s.n, s.k, cases % 2 == 0, true, true, s.pad};
        check_backward(c, 7300 + cases++);
      }
    }
  }
  EXPECT_EQ(cases, 30);
}

using BackwardGrid = PerActivation;
TEST_P(BackwardGrid, MatchesReference) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(200 + index());
  for (int rep = 0; rep < 10; ++rep) {
    BackwardCase c;
    c.act = GetParam();
    draw_dtype_and_sizes(rng, c);
    c.dx = rng() % 5 != 0;
    c.dw = rng() % 5 != 0;
    c.dbias = rng() % 3 != 0;
    if (!c.dx && !c.dw && !c.dbias) c.dbias = true;
    c.pad = draw_pad(rng);
    check_backward(c, 2000 + 10 * index() + rep);
  }
}
INSTANTIATE_TEST_SUITE_P(LinearGpu, BackwardGrid, ::testing::ValuesIn(kActivations),
                         activation_param_name);

// Several waves of CTAs and a partial last tile in M and N.
TEST(LinearGpu, LargerShapesMatchReference) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  for (Activation act : kActivations) {
    check_forward({DType::bf16, act, 1531, 2056, 1024, true, true, 0}, 3000 + salt++);
    check_backward({DType::bf16, act, 1531, 2056, 1024, true, true, true, 0}, 3100 + salt++);
  }
}

// The dx GEMM that forms dz in its idle producer warps (linear_dgrad_sm90.cuh), forced, for every
// activation and 16-bit dtype: rows formed before the kernel or not, a partial last row group,
// tile and k-tile, several waves of tiles, N not a multiple of the 256-column unit, padded rows,
// with and without dW and dbias. Every case must take the path (none may fall back unnoticed).
struct DgradShape {
  std::int64_t m, n, k, pad, first_rows;
  bool dw, dbias;
};
constexpr DgradShape kDgradShapes[] = {{1, 8, 8, 0, 0, true, true},          {129, 264, 136, 0, 0, true, true},
                                       {1531, 2056, 1024, 0, 128, true, true}, {700, 4104, 72, 8, 256, false, true},
                                       {2000, 1000, 520, 0, 0, true, false},   {333, 96, 2048, 8, 1024, true, true}};

class DzInDgrad : public ::testing::TestWithParam<int> {};
TEST_P(DzInDgrad, MatchesReference) {
  FUSEKIT_REQUIRE_GPU();
  const DgradShape& s = kDgradShapes[GetParam()];
  BackwardPathOverride force(linear::BackwardPath::dz_in_dgrad, s.first_rows);
  int salt = 10 * GetParam();
  for (DType dtype : {DType::bf16, DType::f16}) {
    for (Activation act : kActivations) {
      if (act == Activation::none) continue;
      const BackwardCase c{dtype, act, s.m, s.n, s.k, true, s.dw, s.dbias, s.pad};
      SCOPED_TRACE("first rows " + std::to_string(s.first_rows));
      EXPECT_EQ(check_backward(c, 8100 + salt++), linear::BackwardPath::dz_in_dgrad);
    }
  }
}
INSTANTIATE_TEST_SUITE_P(LinearGpu, DzInDgrad,
                         ::testing::Range(0, static_cast<int>(std::size(kDgradShapes))));

TEST(LinearGpu, DzInDgradFallsBackWhereItCannotServe) {
  FUSEKIT_REQUIRE_GPU();
  // What the path cannot serve falls back to the separate pass: f32, rows not 16-byte aligned.
  BackwardPathOverride force(linear::BackwardPath::dz_in_dgrad, 0);
  EXPECT_EQ(check_backward({DType::f32, Activation::relu, 64, 64, 64, true, true, true, 0}, 8200),
            linear::BackwardPath::separate_dz);
  EXPECT_EQ(check_backward({DType::bf16, Activation::relu, 64, 64, 64, true, true, true, 3}, 8201),
            linear::BackwardPath::separate_dz);
}

// The path's kernel needs more shared memory than a launch gets by default, and that limit is an
// attribute of the kernel on each GPU: raised on one GPU, it is not raised on another. Forced on
// every visible GPU in turn (the last first), the path must run and match the reference on each.
TEST(LinearGpu, DzFormedInsideTheDgradGemmOnEveryGpu) {
  FUSEKIT_REQUIRE_GPU();
  const int gpus = cuda_device_count();
  if (gpus < 2) GTEST_SKIP() << "one GPU: LinearGpu/DzInDgrad covers it";
  BackwardPathOverride force(linear::BackwardPath::dz_in_dgrad, 0);
  for (int d = gpus - 1; d >= 0; --d) {
    SCOPED_TRACE("GPU " + std::to_string(d));
    const BackwardCase c{DType::bf16, Activation::gelu_tanh, 129, 264, 136, true, true, true, 0};
    EXPECT_EQ(check_backward(c, 8300 + static_cast<std::uint64_t>(d), d), linear::BackwardPath::dz_in_dgrad);
  }
}

// The automatic choice of how dz is formed (linear_config.h, choose_backward): inside the dx GEMM
// for problems of at least 2^36 flops with 4096 <= K <= 6144, the separate pass otherwise. Only the route
// is checked here (these sizes are too large for the float64 reference; the test above checks the
// path's values).
TEST(LinearGpu, BackwardRouting) {
  FUSEKIT_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  struct Route {
    std::int64_t m, n, k;
    linear::BackwardPath expected;
  };
  const Route routes[] = {{2048, 4096, 4096, linear::BackwardPath::dz_in_dgrad},
                          {4096, 4096, 2048, linear::BackwardPath::separate_dz},
                          {2048, 2048, 8192, linear::BackwardPath::separate_dz},
                          {1024, 1024, 1024, linear::BackwardPath::separate_dz}};
  for (const Route& r : routes) {
    Buffer dout = matrix(DType::bf16, gpu, r.m, r.n), pre = matrix(DType::bf16, gpu, r.m, r.n);
    Buffer x = matrix(DType::bf16, gpu, r.m, r.k), w = matrix(DType::bf16, gpu, r.n, r.k);
    Buffer dx = matrix(DType::bf16, gpu, r.m, r.k), dw = matrix(DType::bf16, gpu, r.n, r.k);
    Buffer db(DType::bf16, gpu, {r.n});
    auto rng = testing::make_rng(8300);
    for (Buffer* b : {&dout, &pre, &x, &w}) b->fill_normal(rng, 0.0, 0.05);
    Buffer ws = workspace_for(linear_backward_workspace_size(r.m, r.n, r.k, DType::bf16, Activation::gelu_tanh, gpu), gpu);
    linear_backward(dout.view(), x.view(), w.view(), pre.view(), Activation::gelu_tanh, dx.view(), dw.view(),
                    db.view(), ws.view());
    EXPECT_EQ(linear::last_backward_path(), r.expected) << r.m << " x " << r.n << " x " << r.k;
    // Without dx there is no dx GEMM to form dz in.
    linear_backward(dout.view(), x.view(), w.view(), pre.view(), Activation::gelu_tanh, std::nullopt, dw.view(),
                    db.view(), ws.view());
    EXPECT_EQ(linear::last_backward_path(), linear::BackwardPath::separate_dz);
  }
}

// Every forward path, forced, for every activation it can serve.
class ForwardPathForced : public ::testing::TestWithParam<ForwardPath> {};
TEST_P(ForwardPathForced, MatchesReference) {
  FUSEKIT_REQUIRE_GPU();
  const ForwardPath path = GetParam();
  PathOverride force(path);
  int salt = 100 * static_cast<int>(path);
  for (DType dt : {DType::bf16, DType::f16}) {
    for (Activation act : kActivations) {
      for (bool pre : {false, true}) {
        for (auto [m, n, k] : {std::array<std::int64_t, 3>{333, 264, 136}, std::array<std::int64_t, 3>{1000, 1024, 512}}) {
          const ForwardCase c{dt, act, m, n, k, (salt % 3) != 0, pre, 0};
          const ForwardPath ran = check_forward(c, 4000 + salt++);
          const bool lt_can = !pre ? (act == Activation::none || act == Activation::relu || act == Activation::gelu_tanh)
                                   : act == Activation::gelu_tanh;
          if (path == ForwardPath::cublaslt_epilogue && lt_can && ran == ForwardPath::unfused) {
            // Legal: cuBLASLt offered no kernel for this epilogue and layout (reported, not failed).
            std::printf("note: %s: cuBLASLt has no epilogue kernel, ran unfused\n", c.str().c_str());
          } else if (path != ForwardPath::cublaslt_epilogue || lt_can) {
            EXPECT_EQ(ran, path) << c.str();
          }
        }
      }
    }
  }
}
INSTANTIATE_TEST_SUITE_P(LinearGpu, ForwardPathForced,
                         ::testing::Values(ForwardPath::cutlass_fused, ForwardPath::cublaslt_epilogue,
                                           ForwardPath::unfused),
                         [](const ::testing::TestParamInfo<ForwardPath>& info) {
                           return std::string(linear::forward_path_name(info.param));
                         });

// The untimed routing rules (autotuning off): what runs when nothing has been measured.
TEST(LinearGpu, AutomaticRouting) {
  FUSEKIT_REQUIRE_GPU();
  AutotuneSetting untimed(false);
  struct Expect {
    ForwardCase c;
    ForwardPath path;
  };
  const Expect expectations[] = {
      {{DType::bf16, Activation::gelu_tanh, 256, 512, 128, true, false, 0}, ForwardPath::cutlass_fused},
      {{DType::bf16, Activation::gelu_tanh, 256, 512, 128, true, true, 0}, ForwardPath::cutlass_fused},
      {{DType::bf16, Activation::gelu_tanh, 256, 512, 126, true, true, 0}, ForwardPath::cublaslt_epilogue},  // K % 8
      {{DType::bf16, Activation::relu, 256, 512, 128, true, false, 0}, ForwardPath::cublaslt_epilogue},
      {{DType::bf16, Activation::none, 256, 512, 128, false, false, 0}, ForwardPath::cublaslt_epilogue},
      {{DType::bf16, Activation::relu, 256, 512, 128, true, true, 0}, ForwardPath::cutlass_fused},
      {{DType::bf16, Activation::squared_relu, 256, 512, 128, true, true, 0}, ForwardPath::cutlass_fused},
      {{DType::f16, Activation::silu, 255, 512, 128, false, false, 0}, ForwardPath::cutlass_fused},
      {{DType::bf16, Activation::gelu_erf, 256, 512, 128, true, false, 8}, ForwardPath::cutlass_fused},
      {{DType::bf16, Activation::silu, 256, 510, 128, true, false, 0}, ForwardPath::unfused},   // N % 8
      {{DType::bf16, Activation::silu, 256, 512, 126, true, false, 0}, ForwardPath::unfused},   // K % 8
      {{DType::bf16, Activation::silu, 256, 512, 128, true, false, 3}, ForwardPath::unfused},   // row stride
      {{DType::f32, Activation::gelu_tanh, 64, 64, 64, true, false, 0}, ForwardPath::unfused},
      {{DType::f32, Activation::relu, 64, 64, 64, true, false, 0}, ForwardPath::cublaslt_epilogue},
  };
  int salt = 0;
  for (const Expect& e : expectations) EXPECT_EQ(check_forward(e.c, 5000 + salt++), e.path) << e.c.str();
}

// With autotuning on, the first call of a problem times the eligible paths: whichever wins must
// be one that can serve the call, its result must match the reference, and later calls of the
// same problem must keep it.
TEST(LinearGpu, AutotunedPathIsEligibleAndKept) {
  FUSEKIT_REQUIRE_GPU();
  AutotuneSetting timed(true);
  using P = ForwardPath;
  struct Expect {
    ForwardCase c;
    std::vector<ForwardPath> allowed;
  };
  const Expect expectations[] = {
      {{DType::bf16, Activation::gelu_erf, 1000, 1024, 512, true, true, 0}, {P::cutlass_fused, P::unfused}},
      {{DType::f16, Activation::silu, 777, 512, 256, false, false, 0}, {P::cutlass_fused, P::unfused}},
      {{DType::bf16, Activation::gelu_tanh, 640, 768, 384, true, false, 0},
       {P::cutlass_fused, P::cublaslt_epilogue, P::unfused}},
      {{DType::bf16, Activation::squared_relu, 512, 520, 256, true, true, 0}, {P::cutlass_fused, P::unfused}},
      {{DType::bf16, Activation::silu, 600, 510, 256, true, false, 0}, {P::unfused}},  // N % 8: no CUTLASS
      {{DType::bf16, Activation::relu, 600, 512, 256, true, false, 0}, {P::cublaslt_epilogue}},  // not timed
      {{DType::f32, Activation::gelu_tanh, 96, 64, 64, true, false, 0}, {P::unfused}},  // f32 rule
  };
  int salt = 0;
  for (const Expect& e : expectations) {
    const ForwardPath first = check_forward(e.c, 7000 + salt);
    EXPECT_NE(std::find(e.allowed.begin(), e.allowed.end(), first), e.allowed.end())
        << e.c.str() << " ran " << linear::forward_path_name(first);
    EXPECT_EQ(check_forward(e.c, 7100 + salt), first) << e.c.str();
    ++salt;
  }
}

// The first call of a problem captured into a CUDA graph: no timing may happen inside a capture
// (it would fail or be recorded), so the call must capture cleanly and the replayed graph must
// compute the right result; the problem is tuned at its next uncaptured call.
TEST(LinearGpu, FirstCallInsideGraphCapture) {
  FUSEKIT_REQUIRE_GPU();
  AutotuneSetting timed(true);
  const Device gpu = Device::cuda(0);
  auto rng = testing::make_rng(11);
  // Shapes no other test uses, so that nothing is tuned yet.
  const std::int64_t m = 1064, n = 1544, k = 712;
  const Activation act = Activation::gelu_erf;
  Buffer x = matrix(DType::bf16, gpu, m, k), w = matrix(DType::bf16, gpu, n, k), b(DType::bf16, gpu, {n});
  Buffer y = matrix(DType::bf16, gpu, m, n), pre = matrix(DType::bf16, gpu, m, n), dout = matrix(DType::bf16, gpu, m, n);
  Buffer dx = matrix(DType::bf16, gpu, m, k), dw = matrix(DType::bf16, gpu, n, k), db(DType::bf16, gpu, {n});
  const auto xv = normal_values(rng, m * k, 0.0, 1.0, DType::bf16);
  const auto wv = normal_values(rng, n * k, 0.0, 1.0 / std::sqrt(double(k)), DType::bf16);
  const auto bv = normal_values(rng, n, 0.0, 0.5, DType::bf16);
  const auto gv = normal_values(rng, m * n, 0.0, 1.0, DType::bf16);
  x.set_values(xv);
  w.set_values(wv);
  b.set_values(bv);
  dout.set_values(gv);
  Buffer wsf = workspace_for(linear_forward_workspace_size(m, n, k, DType::bf16, act, gpu), gpu);
  Buffer wsb = workspace_for(linear_backward_workspace_size(m, n, k, DType::bf16, act, gpu), gpu);
  for (Buffer* o : {&y, &pre, &dx, &dw, &db}) o->poison();

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  linear_forward(x.view(), w.view(), b.view(), act, y.view(), pre.view(), wsf.view(), stream);
  linear_backward(dout.view(), x.view(), w.view(), pre.view(), act, dx.view(), dw.view(), db.view(),
                  wsb.view(), stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);

  const ForwardReference ref = reference_forward(xv, wv, bv, m, n, k, act);
  const lb::ForwardBaseline base = lb::forward_baseline(xv, wv, bv, m, n, k, act, DType::bf16);
  EXPECT_TRUE(passes(lb::judge(y.values(), ref.y, base.y, DType::bf16, "y")));
  EXPECT_TRUE(passes(lb::judge(pre.values(), ref.pre, base.pre, DType::bf16, "pre_activation")));
  const auto pv = pre.values();
  const BackwardReference bref = reference_backward(gv, pv, xv, wv, m, n, k, act);
  const lb::BackwardBaseline bbase = lb::backward_baseline(gv, pv, xv, wv, m, n, k, act, DType::bf16);
  EXPECT_TRUE(passes(lb::judge(dx.values(), bref.dx, bbase.dx, DType::bf16, "dx")));
  EXPECT_TRUE(passes(lb::judge(dw.values(), bref.dw, bbase.dw, DType::bf16, "dW")));
  EXPECT_TRUE(passes(lb::judge(db.values(), bref.dbias, bbase.dbias, DType::bf16, "dbias")));

  // Uncaptured now: this call tunes the problem and must still be right.
  y.poison();
  linear_forward(x.view(), w.view(), b.view(), act, y.view(), pre.view(), wsf.view(), stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_TRUE(passes(lb::judge(y.values(), ref.y, base.y, DType::bf16, "y after tuning")));

  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// A single row, a single 8-column tile, K = 8 exactly (one partial k-block).
TEST(LinearGpu, EdgeShapes) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  for (Activation act : kActivations) {
    check_forward({DType::bf16, act, 1, 4096, 8, true, true, 0}, 6000 + salt++);
    check_forward({DType::bf16, act, 4097, 8, 8, true, true, 0}, 6000 + salt++);
    check_backward({DType::bf16, act, 1, 4096, 8, true, true, true, 0}, 6100 + salt++);
    check_backward({DType::bf16, act, 4097, 8, 8, true, true, true, 0}, 6100 + salt++);
  }
}

TEST(LinearGpu, EmptyDimensions) {
  FUSEKIT_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  auto ws = [&](std::size_t bytes) { return workspace_for(bytes, gpu); };
  {  // K = 0: y = act(bias), pre = bias; backward: dbias = column sums of dz.
    Buffer x(DType::bf16, gpu, {3, 0}), w(DType::bf16, gpu, {2, 0}), b(DType::bf16, gpu, {2});
    Buffer y(DType::bf16, gpu, {3, 2}), pre(DType::bf16, gpu, {3, 2}), dout(DType::bf16, gpu, {3, 2});
    Buffer db(DType::bf16, gpu, {2});
    b.set_values({-1.0, 2.0});
    dout.set_values({1, 1, 2, 2, 3, 3});
    Buffer wf = ws(linear_forward_workspace_size(3, 2, 0, DType::bf16, Activation::relu, gpu));
    linear_forward(x.view(), w.view(), b.view(), Activation::relu, y.view(), pre.view(), wf.view());
    EXPECT_EQ(y.values(), (std::vector<double>{0, 2, 0, 2, 0, 2}));
    EXPECT_EQ(pre.values(), (std::vector<double>{-1, 2, -1, 2, -1, 2}));
    Buffer wb = ws(linear_backward_workspace_size(3, 2, 0, DType::bf16, Activation::relu, gpu));
    linear_backward(dout.view(), x.view(), w.view(), pre.view(), Activation::relu, std::nullopt,
                    std::nullopt, db.view(), wb.view());
    EXPECT_EQ(db.values(), (std::vector<double>{0, 6}));
  }
  {  // M = 0: dW and dbias are zero (the poison must go).
    Buffer x(DType::bf16, gpu, {0, 16}), w(DType::bf16, gpu, {8, 16}), dout(DType::bf16, gpu, {0, 8});
    Buffer dw(DType::bf16, gpu, {8, 16}), db(DType::bf16, gpu, {8});
    Buffer wb = ws(linear_backward_workspace_size(0, 8, 16, DType::bf16, Activation::none, gpu));
    linear_backward(dout.view(), x.view(), w.view(), std::nullopt, Activation::none, std::nullopt,
                    dw.view(), db.view(), wb.view());
    for (double v : dw.values()) ASSERT_EQ(v, 0.0);
    for (double v : db.values()) ASSERT_EQ(v, 0.0);
  }
  {  // N = 0: dx is zero.
    Buffer x(DType::bf16, gpu, {4, 16}), w(DType::bf16, gpu, {0, 16}), dout(DType::bf16, gpu, {4, 0});
    Buffer dx(DType::bf16, gpu, {4, 16});
    Buffer wb = ws(linear_backward_workspace_size(4, 0, 16, DType::bf16, Activation::none, gpu));
    linear_backward(dout.view(), x.view(), w.view(), std::nullopt, Activation::none, dx.view(),
                    std::nullopt, std::nullopt, wb.view());
    for (double v : dx.values()) ASSERT_EQ(v, 0.0);
  }
}

// Row padding of y and pre is never written, on every forward path.
TEST(LinearGpu, RowPaddingIsNeverWritten) {
  FUSEKIT_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  auto rng = testing::make_rng(9);
  const std::int64_t m = 300, n = 256, k = 64, pad = 8;
  for (ForwardPath path : {ForwardPath::cutlass_fused, ForwardPath::cublaslt_epilogue, ForwardPath::unfused}) {
    PathOverride force(path);
    for (Activation act : {Activation::gelu_tanh, Activation::silu}) {
      Buffer x = matrix(DType::bf16, gpu, m, k), w = matrix(DType::bf16, gpu, n, k);
      Buffer y = matrix(DType::bf16, gpu, m, n, pad), pre = matrix(DType::bf16, gpu, m, n, pad);
      x.fill_normal(rng);
      w.fill_normal(rng, 0.0, 0.1);
      Buffer ws = workspace_for(linear_forward_workspace_size(m, n, k, DType::bf16, act, gpu), gpu);
      linear_forward(x.view(), w.view(), std::nullopt, act, y.view(), pre.view(), ws.view());
      SCOPED_TRACE(std::string(linear::forward_path_name(linear::last_forward_path())) + " " + activation_name(act));
      for (const Buffer* b : {&y, &pre}) EXPECT_EQ(testing::poisoned_padding(*b, m, n, pad), (m - 1) * pad);
    }
  }
}

TEST(LinearGpu, RunsAreBitwiseReproducible) {
  FUSEKIT_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  auto rng = testing::make_rng(10);
  const std::int64_t m = 2048, n = 1536, k = 1024;
  for (Activation act : {Activation::gelu_tanh, Activation::squared_relu, Activation::silu}) {
    // silu with dz formed inside the dx GEMM (units claimed in whatever order the warps reach
    // them; dz, dx and dbias must not depend on it).
    BackwardPathOverride force(act == Activation::silu ? linear::BackwardPath::dz_in_dgrad
                                                       : linear::BackwardPath::automatic, 0);
    Buffer x = matrix(DType::bf16, gpu, m, k), w = matrix(DType::bf16, gpu, n, k), b(DType::bf16, gpu, {n});
    Buffer y = matrix(DType::bf16, gpu, m, n), pre = matrix(DType::bf16, gpu, m, n), dout = matrix(DType::bf16, gpu, m, n);
    Buffer dx = matrix(DType::bf16, gpu, m, k), dw = matrix(DType::bf16, gpu, n, k), db(DType::bf16, gpu, {n});
    x.fill_normal(rng);
    w.fill_normal(rng, 0.0, 0.03);
    b.fill_normal(rng);
    dout.fill_normal(rng);
    Buffer wsf = workspace_for(linear_forward_workspace_size(m, n, k, DType::bf16, act, gpu), gpu);
    Buffer wsb = workspace_for(linear_backward_workspace_size(m, n, k, DType::bf16, act, gpu), gpu);
    EXPECT_TRUE(testing::same_bytes_every_run(
        [&] {
          for (Buffer* o : {&y, &pre, &dx, &dw, &db}) o->poison();
          linear_forward(x.view(), w.view(), b.view(), act, y.view(), pre.view(), wsf.view());
          linear_backward(dout.view(), x.view(), w.view(), pre.view(), act, dx.view(), dw.view(), db.view(),
                          wsb.view());
        },
        {&y, &pre, &dx, &dw, &db}))
        << activation_name(act);
  }
}

// Pointers aligned to their element but not to 16 bytes, with odd row strides: the paths that
// take them (cuBLASLt at a smaller alignment, the separate dz pass) must match the reference and
// write nothing before a tensor.
TEST(LinearGpu, UnalignedPointersAndOddRowStrides) {
  FUSEKIT_REQUIRE_GPU();
  struct Shape {
    std::int64_t m, n, k, pad;
  };
  const Shape shapes[] = {{64, 96, 72, 1}, {200, 130, 256, 3}, {33, 1000, 520, 5}};
  int salt = 0;
  for (const Shape& s : shapes)
    for (DType dtype : {DType::bf16, DType::f16, DType::f32})
      for (std::int64_t lead : {1, 3}) {
        const Activation act = salt % 2 ? Activation::gelu_tanh : Activation::relu;
        ForwardCase f{dtype, act, s.m, s.n, s.k, true, true, s.pad};
        f.lead = lead;
        check_forward(f, 8300 + salt);
        BackwardCase b{dtype, act, s.m, s.n, s.k, true, true, true, s.pad};
        b.lead = lead;
        check_backward(b, 8400 + salt);
        ++salt;
      }
  EXPECT_EQ(salt, 18);
}

// A column-major W (GPT-2's Conv1D layout) and dW in either layout: the cuBLASLt GEMMs read them
// transposed. The fused CUTLASS forward and the dz-in-dgrad backward read W row-major: asked for
// (as a test override), they are passed over for a column-major W.
TEST(LinearGpu, ColumnMajorWeightMatchesReference) {
  FUSEKIT_REQUIRE_GPU();
  std::uint64_t salt = 9100;
  PathOverride fused(ForwardPath::cutlass_fused);
  BackwardPathOverride in_dgrad(linear::BackwardPath::dz_in_dgrad);
  for (DType dt : {DType::bf16, DType::f16})
    for (Activation act : {Activation::none, Activation::relu, Activation::gelu_tanh, Activation::silu})
      for (auto [m, n, k, pad] : {std::array<std::int64_t, 4>{256, 768, 2304, 0}, std::array<std::int64_t, 4>{77, 130, 66, 3},
                                  std::array<std::int64_t, 4>{128, 512, 1024, 8}}) {
        for (bool pre : {false, true}) {
          ForwardCase c{dt, act, m, n, k, true, pre, pad};
          c.w_col_major = true;
          EXPECT_NE(check_forward(c, salt++), ForwardPath::cutlass_fused) << c.str();
        }
        for (bool dw_col_major : {false, true}) {
          BackwardCase c{dt, act, m, n, k, true, true, true, pad};
          c.w_col_major = true;
          c.dw_col_major = dw_col_major;
          EXPECT_NE(check_backward(c, salt++), linear::BackwardPath::dz_in_dgrad) << c.str();
          c.w_col_major = false;  // a row-major W with a column-major dW
          if (dw_col_major) check_backward(c, salt++);
        }
      }
}

TEST(LinearGpu, WorkspaceErrors) {
  FUSEKIT_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  Buffer x = matrix(DType::bf16, gpu, 64, 32), w = matrix(DType::bf16, gpu, 48, 32), y = matrix(DType::bf16, gpu, 64, 48);
  const std::size_t need = linear_forward_workspace_size(64, 48, 32, DType::bf16, Activation::silu, gpu);
  EXPECT_TRUE(has(error_of([&] { linear_forward(x.view(), w.view(), std::nullopt, Activation::silu, y.view(), std::nullopt, std::nullopt); }),
                  "argument 'workspace': expected a u8 tensor of at least " + std::to_string(need) + " bytes"));
  Buffer small(DType::u8, gpu, {static_cast<std::int64_t>(need / 2)});
  EXPECT_TRUE(has(error_of([&] { linear_forward(x.view(), w.view(), std::nullopt, Activation::silu, y.view(), std::nullopt, small.view()); }),
                  "argument 'workspace'"));
  Buffer big(DType::u8, gpu, {static_cast<std::int64_t>(need + 512)});
  TensorView shifted = big.view();
  shifted.data = static_cast<unsigned char*>(shifted.data) + 16;
  shifted.shape[0] = static_cast<std::int64_t>(need);
  EXPECT_TRUE(has(error_of([&] { linear_forward(x.view(), w.view(), std::nullopt, Activation::silu, y.view(), std::nullopt, shifted); }),
                  "argument 'workspace': expected a 256-byte aligned pointer"));
  // Backward with an activation needs room for dz on top of cuBLASLt's share.
  const std::size_t need_bwd = linear_backward_workspace_size(64, 48, 32, DType::bf16, Activation::silu, gpu);
  EXPECT_GT(need_bwd, need);
  Buffer fwd_sized(DType::u8, gpu, {static_cast<std::int64_t>(need)});
  Buffer dx = matrix(DType::bf16, gpu, 64, 32);  // not x itself: outputs may not overlap inputs
  EXPECT_TRUE(has(error_of([&] { linear_backward(y.view(), x.view(), w.view(), y.view(), Activation::silu, dx.view(), std::nullopt, std::nullopt, fwd_sized.view()); }),
                  "argument 'workspace': expected a u8 tensor of at least " + std::to_string(need_bwd)));
}

// ---- backward through the input's activation -------------------------------------------------

// x = x_act(x_pre): the float64 reference's dx_pre is linear_backward's dx times x_act'(x_pre),
// its sum the column sums; dW and dbias are linear_backward's.
TEST(LinearCpu, BackwardThroughInputActivationIsDxTimesTheDerivative) {
  const Device cpu = Device::cpu();
  auto rng = testing::make_rng(9100);
  const std::int64_t m = 37, n = 24, k = 19;
  for (Activation x_act : {Activation::gelu_tanh, Activation::relu, Activation::silu, Activation::gelu_erf})
    for (Activation act : {Activation::none, Activation::silu}) {
      SCOPED_TRACE(std::string(activation_name(x_act)) + " / " + activation_name(act));
      Buffer dout(DType::f64, cpu, {m, n}), pre(DType::f64, cpu, {m, n}), x_pre(DType::f64, cpu, {m, k}),
          x(DType::f64, cpu, {m, k}), w(DType::f64, cpu, {n, k});
      for (Buffer* b : {&dout, &pre, &x_pre, &w}) b->fill_normal(rng, 0.0, 1.0);
      std::vector<double> xv = x_pre.values();
      for (double& v : xv) v = detail::ActivationMath<double>::forward(x_act, v, 0.0);
      x.set_values(xv);
      Buffer dx(DType::f64, cpu, {m, k}), dw(DType::f64, cpu, {n, k}), db(DType::f64, cpu, {n});
      Buffer dxp(DType::f64, cpu, {m, k}), dw2(DType::f64, cpu, {n, k}), db2(DType::f64, cpu, {n}),
          sum(DType::f64, cpu, {k});
      const OptionalTensor pre_view = act == Activation::none ? std::nullopt : OptionalTensor(pre.view());
      linear_backward(dout.view(), x.view(), w.view(), pre_view, act, dx.view(), dw.view(), db.view(), std::nullopt);
      linear_backward_through_input_activation(dout.view(), x.view(), w.view(), pre_view, act, x_pre.view(), x_act,
                                               dxp.view(), sum.view(), dw2.view(), db2.view(), std::nullopt);
      const std::vector<double> dxv = dx.values(), xp = x_pre.values(), got = dxp.values(), got_sum = sum.values();
      std::vector<double> want_sum(static_cast<std::size_t>(k), 0.0);
      for (std::int64_t r = 0; r < m; ++r)
        for (std::int64_t i = 0; i < k; ++i) {
          const double want = dxv[r * k + i] * detail::ActivationMath<double>::derivative(x_act, xp[r * k + i], 0.0);
          want_sum[i] += want;
          ASSERT_NEAR(got[r * k + i], want, 1e-12 * (1.0 + std::abs(want))) << r << ", " << i;
        }
      for (std::int64_t i = 0; i < k; ++i) ASSERT_NEAR(got_sum[i], want_sum[i], 1e-11 * (1.0 + std::abs(want_sum[i])));
      EXPECT_EQ(dw2.values(), dw.values());
      EXPECT_EQ(db2.values(), db.values());
    }
}

TEST(LinearErrors, BackwardThroughInputActivationArguments) {
  ErrorFixture f;
  std::vector<std::uint16_t> xpb(64 * 32 + 8), dxpb(64 * 32 + 8), sb(32 + 8);
  TensorView x_pre{xpb.data(), DType::bf16, f.cpu, {64, 32}}, dxp{dxpb.data(), DType::bf16, f.cpu, {64, 32}};
  TensorView sum{sb.data(), DType::bf16, f.cpu, {32}};
  auto call = [&](const TensorView& xp, Activation x_act, const TensorView& d, const OptionalTensor& s) {
    return error_of([&] {
      linear_backward_through_input_activation(f.y, f.x, f.w, std::nullopt, Activation::none, xp, x_act, d, s,
                                               std::nullopt, std::nullopt, std::nullopt);
    });
  };
  EXPECT_EQ(call(x_pre, Activation::gelu_tanh, dxp, sum), "no error");
  EXPECT_TRUE(has(call(x_pre, Activation::none, dxp, sum), "argument 'x_activation'"));
  EXPECT_TRUE(has(call(x_pre, Activation::leaky_relu, dxp, sum), "argument 'x_activation'"));
  TensorView short_pre = x_pre;
  short_pre.shape[0] = 63;
  EXPECT_TRUE(has(call(short_pre, Activation::gelu_tanh, dxp, sum), "argument 'x_pre_activation'"));
  TensorView short_sum = sum;
  short_sum.shape[0] = 31;
  EXPECT_TRUE(has(call(x_pre, Activation::gelu_tanh, dxp, short_sum), "argument 'dx_pre_activation_sum'"));
  EXPECT_TRUE(has(call(x_pre, Activation::gelu_tanh, x_pre, sum), "dx_pre_activation"));  // overlaps an input
  EXPECT_TRUE(has(error_of([] {
                    linear_backward_through_input_activation_workspace_size(-1, 1, 1, DType::bf16, Activation::none,
                                                                            Device::cpu());
                  }),
                  "argument 'm'"));
}

// The GPU against the float64 reference: the baseline is PyTorch's eager chain (dx rounded to the
// dtype, then dx * act'(x_pre) in float32, rounded; its sum in float32 over rows).
void check_through_input_activation(DType dtype, Activation act, Activation x_act, std::int64_t m, std::int64_t n,
                                    std::int64_t k, bool with_sum, std::int64_t pad, std::uint64_t salt) {
  SCOPED_TRACE(std::string("through ") + dtype_name(dtype) + " " + activation_name(act) + " input " +
               activation_name(x_act) + " (M, N, K) = (" + std::to_string(m) + ", " + std::to_string(n) + ", " +
               std::to_string(k) + ")" + (with_sum ? " +sum" : "") + (pad ? " pad " + std::to_string(pad) : ""));
  auto rng = testing::make_rng(salt);
  const Device gpu = Device::cuda(0);
  Buffer dout = matrix(dtype, gpu, m, n, pad), pre = matrix(dtype, gpu, m, n, pad), x_pre = matrix(dtype, gpu, m, k, pad);
  Buffer x = matrix(dtype, gpu, m, k, pad), w = matrix(dtype, gpu, n, k, pad);
  const auto gv = normal_values(rng, m * n, 0.0, 1.0, dtype);
  const auto pv = normal_values(rng, m * n, 0.0, 1.5, dtype);
  const auto xpv = normal_values(rng, m * k, 0.0, 1.5, dtype);
  std::vector<double> xv(xpv.size());
  for (std::size_t i = 0; i < xv.size(); ++i)
    xv[i] = detail::round_to(dtype, detail::ActivationMath<double>::forward(x_act, xpv[i], 0.0));
  const auto wv = normal_values(rng, n * k, 0.0, 1.0 / std::sqrt(double(std::max<std::int64_t>(n, 1))), dtype);
  dout.set_values(gv);
  pre.set_values(pv);
  x_pre.set_values(xpv);
  x.set_values(xv);
  w.set_values(wv);
  Buffer dxp = matrix(dtype, gpu, m, k, pad), dw = matrix(dtype, gpu, n, k, pad), db(dtype, gpu, {n});
  std::optional<Buffer> sum;
  if (with_sum) sum.emplace(dtype, gpu, std::vector<std::int64_t>{k});
  Buffer ws = workspace_for(linear_backward_through_input_activation_workspace_size(m, n, k, dtype, act, gpu), gpu);
  const OptionalTensor pre_view = act == Activation::none ? std::nullopt : OptionalTensor(pre.view());
  auto run = [&] {
    for (Buffer* b : {&dxp, &dw, &db}) b->poison();
    if (sum) sum->poison();
    linear_backward_through_input_activation(dout.view(), x.view(), w.view(), pre_view, act, x_pre.view(), x_act,
                                             dxp.view(), opt(sum), dw.view(), db.view(), ws.view());
  };
  run();
  const std::vector<double> first = dxp.values();

  // Reference: the CPU backend in float64 on the same values.
  const Device cpu = Device::cpu();
  Buffer g64(DType::f64, cpu, {m, n}), p64(DType::f64, cpu, {m, n}), xp64(DType::f64, cpu, {m, k}),
      x64(DType::f64, cpu, {m, k}), w64(DType::f64, cpu, {n, k}), dxp64(DType::f64, cpu, {m, k}),
      dw64(DType::f64, cpu, {n, k}), db64(DType::f64, cpu, {n}), s64(DType::f64, cpu, {k});
  g64.set_values(gv);
  p64.set_values(pv);
  xp64.set_values(xpv);
  x64.set_values(xv);
  w64.set_values(wv);
  linear_backward_through_input_activation(g64.view(), x64.view(), w64.view(),
                                           act == Activation::none ? std::nullopt : OptionalTensor(p64.view()), act,
                                           xp64.view(), x_act, dxp64.view(), s64.view(), dw64.view(), db64.view(),
                                           std::nullopt);
  lb::BackwardBaseline base = lb::backward_baseline(gv, pv, xv, wv, m, n, k, act, dtype);
  std::vector<double> base_sum(static_cast<std::size_t>(k), 0.0);
  {
    std::vector<float> acc(static_cast<std::size_t>(k), 0.0f);
    for (std::int64_t r = 0; r < m; ++r)
      for (std::int64_t i = 0; i < k; ++i) {
        const float v = lb::round_f(dtype, static_cast<float>(base.dx[r * k + i]) *
                                               lb::MathF::derivative(x_act, static_cast<float>(xpv[r * k + i]), 0.0f));
        base.dx[r * k + i] = v;
        acc[i] += v;
      }
    for (std::int64_t i = 0; i < k; ++i) base_sum[i] = lb::round_f(dtype, acc[i]);
  }
  const std::int64_t dz_values = m * n;
  EXPECT_TRUE(passes(lb::judge(dxp.values(), dxp64.values(), base.dx, dtype, "dx_pre_activation", dz_values)));
  if (sum) EXPECT_TRUE(passes(lb::judge(sum->values(), s64.values(), base_sum, dtype, "dx_pre_activation_sum", dz_values)));
  EXPECT_TRUE(passes(lb::judge(dw.values(), dw64.values(), base.dw, dtype, "dW", dz_values)));
  EXPECT_TRUE(passes(lb::judge(db.values(), db64.values(), base.dbias, dtype, "dbias", dz_values)));
  run();
  EXPECT_EQ(dxp.values(), first) << "a second run differs";
}

// Each route (linear.backward.input_activation): cuBLASLt's DGELU_BGRAD or DGELU epilogue (gelu_tanh
// in 16-bit with aligned rows; otherwise the pass) and the pass after a plain dx GEMM.
class ThroughInputActivation : public ::testing::TestWithParam<const char*> {};

TEST_P(ThroughInputActivation, MatchesReference) {
  FUSEKIT_REQUIRE_GPU();
  struct Guard {
    explicit Guard(const char* route) { detail::set_override("linear.backward.input_activation", route); }
    ~Guard() { detail::set_override("linear.backward.input_activation", ""); }
  } guard(GetParam());
  std::uint64_t salt = 9200;
  for (DType dtype : {DType::bf16, DType::f16, DType::f32})
    for (Activation x_act : {Activation::gelu_tanh, Activation::relu, Activation::silu, Activation::gelu_erf})
      for (Activation act : {Activation::none, Activation::gelu_tanh})
        for (bool with_sum : {true, false})
          check_through_input_activation(dtype, act, x_act, 333, 264, 136, with_sum, 0, salt++);
  // GPT-2's MLP down projection (N = 768, K = 3072) at 1024 tokens; padded rows (the epilogue
  // then needs aux rows of a multiple of 8 elements: 3 is not); one row; K = 1.
  check_through_input_activation(DType::bf16, Activation::none, Activation::gelu_tanh, 1024, 768, 3072, true, 0, salt++);
  check_through_input_activation(DType::bf16, Activation::none, Activation::gelu_tanh, 200, 64, 96, true, 8, salt++);
  check_through_input_activation(DType::bf16, Activation::none, Activation::gelu_tanh, 200, 64, 96, true, 3, salt++);
  check_through_input_activation(DType::f16, Activation::silu, Activation::gelu_tanh, 1, 40, 24, true, 0, salt++);
  check_through_input_activation(DType::bf16, Activation::none, Activation::relu, 50, 16, 1, true, 0, salt++);
}

INSTANTIATE_TEST_SUITE_P(LinearGpu, ThroughInputActivation, ::testing::Values("bgrad_epilogue", "epilogue", "pass"),
                         [](const ::testing::TestParamInfo<const char*>& info) { return std::string(info.param); });

TEST(LinearGpu, BackwardThroughInputActivationEmptyDimensions) {
  FUSEKIT_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  for (auto [m, n, k] : {std::array<std::int64_t, 3>{0, 16, 8}, std::array<std::int64_t, 3>{16, 0, 8}}) {
    SCOPED_TRACE(std::to_string(m) + " x " + std::to_string(n) + " x " + std::to_string(k));
    Buffer dout = matrix(DType::bf16, gpu, m, n), x = matrix(DType::bf16, gpu, m, k), w = matrix(DType::bf16, gpu, n, k);
    Buffer x_pre = matrix(DType::bf16, gpu, m, k), dxp = matrix(DType::bf16, gpu, m, k), sum(DType::bf16, gpu, {k});
    dxp.poison();
    sum.poison();
    Buffer ws = workspace_for(
        linear_backward_through_input_activation_workspace_size(m, n, k, DType::bf16, Activation::none, gpu), gpu);
    linear_backward_through_input_activation(dout.view(), x.view(), w.view(), std::nullopt, Activation::none,
                                             x_pre.view(), Activation::gelu_tanh, dxp.view(), sum.view(), std::nullopt,
                                             std::nullopt, ws.view());
    for (double v : sum.values()) EXPECT_EQ(v, 0.0);
    for (double v : dxp.values()) EXPECT_EQ(v, 0.0);
  }
}

}  // namespace
}  // namespace fusekit
