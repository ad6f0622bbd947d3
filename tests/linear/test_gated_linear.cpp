// Gated linear (the gate and up projections of a gated MLP in one GEMM): the float64 CPU reference
// against the linear and gated_act references it composes and against finite differences; both GPU
// paths (the epilogue kernel, the GEMM then the gated pass) against the reference over shapes,
// dtypes, layouts, activations, bias, saved pre-activation, padded and misaligned views, with
// outputs poisoned; the backward; routing and argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/activation.h"
#include "core/convert.h"
#include "fusekit/error.h"
#include "core/overrides.h"
#include "fusekit/linear.h"
#include "linear/linear_paths.h"
#include "tests/harness/error_testing.h"
#include "tests/harness/gtest_helpers.h"
#include "tests/linear/linear_baseline.h"

namespace fusekit {
namespace {

using linear::GatedForwardPath;
using testing::Buffer;
namespace lb = testing::linear;
using MathD = detail::ActivationMath<double>;
using MathF = detail::ActivationMath<float>;

constexpr Activation kGates[] = {Activation::silu, Activation::gelu_tanh, Activation::gelu_erf, Activation::relu};
constexpr GatedLayout kLayouts[] = {GatedLayout::interleaved, GatedLayout::halves};

::testing::AssertionResult passes(const lb::Verdict& v) {
  if (v.pass) return ::testing::AssertionSuccess() << v.message;
  return ::testing::AssertionFailure() << v.message;
}

struct GatedPathOverride {
  explicit GatedPathOverride(GatedForwardPath p) { linear::set_gated_forward_path_override(p); }
  ~GatedPathOverride() { linear::set_gated_forward_path_override(GatedForwardPath::automatic); }
};

OptionalTensor opt(const std::optional<Buffer>& b) { return b ? OptionalTensor(b->view()) : std::nullopt; }

Buffer matrix(DType dtype, Device d, std::int64_t rows, std::int64_t cols, std::int64_t pad = 0,
              std::int64_t lead = 0) {
  return Buffer(dtype, d, {rows, cols}, {cols + pad, 1}, lead);
}

Buffer vector_of(DType dtype, Device d, std::int64_t n, std::int64_t lead = 0) {
  return Buffer(dtype, d, std::vector<std::int64_t>{n}, std::vector<std::int64_t>{}, lead);
}

Buffer workspace_for(std::size_t bytes, Device d) {
  return Buffer(DType::u8, d, {static_cast<std::int64_t>(std::max<std::size_t>(bytes, 1))});
}

std::vector<double> normal_values(std::mt19937_64& rng, std::size_t n, double stddev, DType dtype) {
  std::normal_distribution<double> dist(0.0, stddev);
  std::vector<double> v(n);
  for (auto& e : v) e = detail::round_to(dtype, dist(rng));
  return v;
}

std::int64_t gate_col(GatedLayout l, std::int64_t, std::int64_t j) { return l == GatedLayout::interleaved ? 2 * j : j; }
std::int64_t up_col(GatedLayout l, std::int64_t f, std::int64_t j) {
  return l == GatedLayout::interleaved ? 2 * j + 1 : f + j;
}

// ---- float64 references --------------------------------------------------------------------

struct Forward {
  std::vector<double> y, pre;
};

Forward cpu_forward(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& bias,
                    std::int64_t m, std::int64_t f, std::int64_t k, const GatedLinearConfig& config,
                    DType dtype = DType::f64) {
  const Device cpu = Device::cpu();
  Buffer x64(dtype, cpu, {m, k}), w64(dtype, cpu, {2 * f, k}), y64(dtype, cpu, {m, f}), p64(dtype, cpu, {m, 2 * f});
  x64.set_values(x);
  w64.set_values(w);
  std::optional<Buffer> b64;
  if (!bias.empty()) {
    b64.emplace(vector_of(dtype, cpu, 2 * f));
    b64->set_values(bias);
  }
  gated_linear_forward(x64.view(), w64.view(), opt(b64), config, y64.view(), p64.view(), std::nullopt);
  return {y64.values(), p64.values()};
}

struct Backward {
  std::vector<double> dx, dw, dbias;
};

Backward cpu_backward(const std::vector<double>& dy, const std::vector<double>& pre, const std::vector<double>& x,
                      const std::vector<double>& w, std::int64_t m, std::int64_t f, std::int64_t k,
                      const GatedLinearConfig& config) {
  const Device cpu = Device::cpu();
  Buffer dy64(DType::f64, cpu, {m, f}), p64(DType::f64, cpu, {m, 2 * f}), x64(DType::f64, cpu, {m, k}),
      w64(DType::f64, cpu, {2 * f, k}), dx64(DType::f64, cpu, {m, k}), dw64(DType::f64, cpu, {2 * f, k}),
      db64(vector_of(DType::f64, cpu, 2 * f));
  dy64.set_values(dy);
  p64.set_values(pre);
  x64.set_values(x);
  w64.set_values(w);
  gated_linear_backward(dy64.view(), x64.view(), w64.view(), p64.view(), config, dx64.view(), dw64.view(),
                        db64.view(), std::nullopt);
  return {dx64.values(), dw64.values(), db64.values()};
}

// PyTorch eager in the same dtype: F.linear (float32 accumulation, rounded), then the gated
// activation in float32 on the rounded values, rounded.
std::vector<double> baseline_y(const std::vector<double>& pre_rounded, std::int64_t m, std::int64_t f,
                               const GatedLinearConfig& config, DType dtype) {
  std::vector<double> y(static_cast<std::size_t>(m * f));
  for (std::int64_t r = 0; r < m; ++r)
    for (std::int64_t j = 0; j < f; ++j) {
      const float g = static_cast<float>(pre_rounded[r * 2 * f + gate_col(config.layout, f, j)]);
      const float u = static_cast<float>(pre_rounded[r * 2 * f + up_col(config.layout, f, j)]);
      y[r * f + j] = lb::round_f(dtype, MathF::forward(config.activation, g, 0.0f) * u);
    }
  return y;
}

// ---- GPU cases ------------------------------------------------------------------------------

struct Case {
  DType dtype = DType::bf16;
  GatedLinearConfig config;
  std::int64_t m = 1, f = 4, k = 8;
  bool bias = true, pre = true;
  std::int64_t pad = 0, lead = 0;
  std::string str() const {
    return std::string(dtype_name(dtype)) + " " + activation_name(config.activation) + " " +
           gated_layout_name(config.layout) + " (M, F, K) = (" + std::to_string(m) + ", " + std::to_string(f) +
           ", " + std::to_string(k) + ")" + (bias ? " +bias" : "") + (pre ? " +pre" : "") +
           (pad ? " pad " + std::to_string(pad) : "") + (lead ? " lead " + std::to_string(lead) : "");
  }
};

GatedForwardPath check_forward(const Case& c, std::uint64_t salt) {
  SCOPED_TRACE(c.str());
  auto rng = testing::make_rng(salt);
  const Device gpu = Device::cuda(0);
  const std::int64_t n = 2 * c.f;
  Buffer x = matrix(c.dtype, gpu, c.m, c.k, c.pad, c.lead), w = matrix(c.dtype, gpu, n, c.k, c.pad, c.lead);
  Buffer y = matrix(c.dtype, gpu, c.m, c.f, c.pad, c.lead);
  std::optional<Buffer> bias, pre;
  const auto xv = normal_values(rng, c.m * c.k, 1.0, c.dtype);
  const auto wv = normal_values(rng, n * c.k, 1.0 / std::sqrt(double(std::max<std::int64_t>(c.k, 1))), c.dtype);
  std::vector<double> bv;
  x.set_values(xv);
  w.set_values(wv);
  if (c.bias) {
    bv = normal_values(rng, n, 0.5, c.dtype);
    bias.emplace(vector_of(c.dtype, gpu, n, c.lead));
    bias->set_values(bv);
  }
  if (c.pre) pre.emplace(matrix(c.dtype, gpu, c.m, n, c.pad, c.lead));
  Buffer ws = workspace_for(gated_linear_forward_workspace_size(c.m, c.f, c.k, c.dtype, c.config, c.pre, gpu), gpu);
  y.poison();
  if (pre) pre->poison();
  gated_linear_forward(x.view(), w.view(), opt(bias), c.config, y.view(), opt(pre), ws.view());
  const GatedForwardPath path = linear::last_gated_forward_path();
  SCOPED_TRACE(std::string("path ") + linear::gated_forward_path_name(path));

  const Forward ref = cpu_forward(xv, wv, bv, c.m, c.f, c.k, c.config);
  const lb::ForwardBaseline base = lb::forward_baseline(xv, wv, bv, c.m, n, c.k, Activation::none, c.dtype);
  EXPECT_TRUE(passes(lb::judge(y.values(), ref.y, baseline_y(base.pre, c.m, c.f, c.config, c.dtype), c.dtype, "y")));
  if (pre) EXPECT_TRUE(passes(lb::judge(pre->values(), ref.pre, base.pre, c.dtype, "pre_activation")));
  EXPECT_TRUE(y.lead_untouched());
  if (pre) EXPECT_TRUE(pre->lead_untouched());
  return path;
}

// Forces how the backward forms dpre (and the rows formed before the dx GEMM) for one scope.
struct DpreRoute {
  DpreRoute(linear::BackwardPath p, long long first_rows) {
    linear::set_backward_path_override(p);
    detail::set_override("linear.backward.dz_first_rows", first_rows >= 0 ? std::to_string(first_rows) : "");
  }
  ~DpreRoute() {
    linear::set_backward_path_override(linear::BackwardPath::automatic);
    detail::set_override("linear.backward.dz_first_rows", "");
  }
};

linear::BackwardPath check_backward(const Case& c, std::uint64_t salt) {
  SCOPED_TRACE("backward " + c.str());
  auto rng = testing::make_rng(salt);
  const Device gpu = Device::cuda(0);
  const std::int64_t n = 2 * c.f;
  Buffer dy = matrix(c.dtype, gpu, c.m, c.f, c.pad, c.lead), pre = matrix(c.dtype, gpu, c.m, n, c.pad, c.lead);
  Buffer x = matrix(c.dtype, gpu, c.m, c.k, c.pad, c.lead), w = matrix(c.dtype, gpu, n, c.k, c.pad, c.lead);
  const auto dyv = normal_values(rng, c.m * c.f, 1.0, c.dtype);
  const auto pv = normal_values(rng, c.m * n, 1.5, c.dtype);
  const auto xv = normal_values(rng, c.m * c.k, 1.0, c.dtype);
  const auto wv = normal_values(rng, n * c.k, 1.0 / std::sqrt(double(std::max<std::int64_t>(c.k, 1))), c.dtype);
  dy.set_values(dyv);
  pre.set_values(pv);
  x.set_values(xv);
  w.set_values(wv);
  Buffer dx = matrix(c.dtype, gpu, c.m, c.k, c.pad, c.lead), dw = matrix(c.dtype, gpu, n, c.k, c.pad, c.lead);
  std::optional<Buffer> db;
  if (c.bias) db.emplace(vector_of(c.dtype, gpu, n, c.lead));
  Buffer ws = workspace_for(gated_linear_backward_workspace_size(c.m, c.f, c.k, c.dtype, c.config, gpu), gpu);
  dx.poison();
  dw.poison();
  if (db) db->poison();
  gated_linear_backward(dy.view(), x.view(), w.view(), pre.view(), c.config, dx.view(), dw.view(), opt(db), ws.view());
  SCOPED_TRACE(std::string("dpre ") + linear::backward_path_name(linear::last_backward_path()));

  const Backward ref = cpu_backward(dyv, pv, xv, wv, c.m, c.f, c.k, c.config);
  // PyTorch eager: dgate and dup in float32 from the stored values, rounded, then the GEMMs.
  std::vector<double> dpre(static_cast<std::size_t>(c.m * n));
  for (std::int64_t r = 0; r < c.m; ++r)
    for (std::int64_t j = 0; j < c.f; ++j) {
      const std::int64_t gc = r * n + gate_col(c.config.layout, c.f, j), uc = r * n + up_col(c.config.layout, c.f, j);
      const float g = static_cast<float>(pv[gc]), u = static_cast<float>(pv[uc]),
                  d = static_cast<float>(dyv[r * c.f + j]);
      dpre[gc] = lb::round_f(c.dtype, d * u * MathF::derivative(c.config.activation, g, 0.0f));
      dpre[uc] = lb::round_f(c.dtype, d * MathF::forward(c.config.activation, g, 0.0f));
    }
  const lb::BackwardBaseline base = lb::backward_baseline(dpre, {}, xv, wv, c.m, n, c.k, Activation::none, c.dtype);
  const std::int64_t sources = c.m * n;
  EXPECT_TRUE(passes(lb::judge(dx.values(), ref.dx, base.dx, c.dtype, "dx", sources)));
  EXPECT_TRUE(passes(lb::judge(dw.values(), ref.dw, base.dw, c.dtype, "dW", sources)));
  if (db) EXPECT_TRUE(passes(lb::judge(db->values(), ref.dbias, base.dbias, c.dtype, "dbias", sources)));
  EXPECT_TRUE(dx.lead_untouched());
  EXPECT_TRUE(dw.lead_untouched());
  return linear::last_backward_path();
}

// ---- CPU reference ---------------------------------------------------------------------------

// pre is linear_forward's output (no activation) and y the gated_act definition on it, in float64
// exactly, in both layouts, with bias, through padded rows.
TEST(GatedLinearCpu, ComposesLinearAndTheGatedActivation) {
  auto rng = testing::make_rng(11);
  const std::int64_t m = 5, f = 7, k = 9;
  for (GatedLayout layout : kLayouts)
    for (Activation act : kGates) {
      GatedLinearConfig config{act, layout};
      SCOPED_TRACE(std::string(activation_name(act)) + " " + gated_layout_name(layout));
      const auto xv = normal_values(rng, m * k, 1.0, DType::f64);
      const auto wv = normal_values(rng, 2 * f * k, 0.4, DType::f64);
      const auto bv = normal_values(rng, 2 * f, 0.5, DType::f64);
      const Forward got = cpu_forward(xv, wv, bv, m, f, k, config);
      const Device cpu = Device::cpu();
      Buffer x64(DType::f64, cpu, {m, k}), w64(DType::f64, cpu, {2 * f, k}), b64(vector_of(DType::f64, cpu, 2 * f)),
          z64(DType::f64, cpu, {m, 2 * f});
      x64.set_values(xv);
      w64.set_values(wv);
      b64.set_values(bv);
      linear_forward(x64.view(), w64.view(), b64.view(), Activation::none, z64.view(), std::nullopt, std::nullopt);
      const auto z = z64.values();
      ASSERT_EQ(got.pre, z);
      for (std::int64_t r = 0; r < m; ++r)
        for (std::int64_t j = 0; j < f; ++j)
          ASSERT_EQ(got.y[r * f + j], MathD::forward(act, z[r * 2 * f + gate_col(layout, f, j)], 0.0) *
                                          z[r * 2 * f + up_col(layout, f, j)]);
    }
}

// Central differences of L = sum(y * dy) with respect to x, W and bias.
TEST(GatedLinearCpu, GradientsMatchFiniteDifferences) {
  auto rng = testing::make_rng(12);
  const std::int64_t m = 3, f = 4, k = 5;
  for (GatedLayout layout : kLayouts)
    for (Activation act : {Activation::silu, Activation::gelu_tanh, Activation::gelu_erf}) {
      GatedLinearConfig config{act, layout};
      SCOPED_TRACE(std::string(activation_name(act)) + " " + gated_layout_name(layout));
      auto xv = normal_values(rng, m * k, 1.0, DType::f64);
      auto wv = normal_values(rng, 2 * f * k, 0.5, DType::f64);
      auto bv = normal_values(rng, 2 * f, 0.5, DType::f64);
      const auto dyv = normal_values(rng, m * f, 1.0, DType::f64);
      const auto loss = [&] {
        const auto y = cpu_forward(xv, wv, bv, m, f, k, config).y;
        double s = 0.0;
        for (std::size_t i = 0; i < y.size(); ++i) s += y[i] * dyv[i];
        return s;
      };
      const Forward fw = cpu_forward(xv, wv, bv, m, f, k, config);
      const Backward g = cpu_backward(dyv, fw.pre, xv, wv, m, f, k, config);
      const double h = 1e-6;
      const auto check = [&](std::vector<double>& v, const std::vector<double>& grad, const char* what) {
        for (std::size_t i = 0; i < v.size(); ++i) {
          const double keep = v[i];
          v[i] = keep + h;
          const double up = loss();
          v[i] = keep - h;
          const double down = loss();
          v[i] = keep;
          EXPECT_NEAR(grad[i], (up - down) / (2 * h), 1e-6 * (1.0 + std::fabs(grad[i]))) << what << " " << i;
        }
      };
      check(xv, g.dx, "dx");
      check(wv, g.dw, "dW");
      check(bv, g.dbias, "dbias");
    }
}

// ---- errors ----------------------------------------------------------------------------------

TEST(GatedLinearErrors, ShapesActivationsAndMissingPieces) {
  const Device cpu = Device::cpu();
  Buffer x(DType::f32, cpu, {4, 8}), w(DType::f32, cpu, {6, 8}), y(DType::f32, cpu, {4, 3}), pre(DType::f32, cpu, {4, 6});
  Buffer w_odd(DType::f32, cpu, {5, 8}), y_bad(DType::f32, cpu, {4, 6}), w_k(DType::f32, cpu, {6, 7});
  Buffer b_bad(DType::f32, cpu, {3}), x16(DType::bf16, cpu, {4, 8});
  const GatedLinearConfig ok;
  testing::expect_error([&] { gated_linear_forward(x.view(), w_odd.view(), std::nullopt, ok, y.view(), std::nullopt, std::nullopt); },
                        ErrorKind::invalid_argument, "weight", "even number of rows");
  testing::expect_error([&] { gated_linear_forward(x.view(), w.view(), std::nullopt, ok, y_bad.view(), std::nullopt, std::nullopt); },
                        ErrorKind::invalid_argument, "y", "(4, 3)");
  testing::expect_error([&] { gated_linear_forward(x.view(), w_k.view(), std::nullopt, ok, y.view(), std::nullopt, std::nullopt); },
                        ErrorKind::invalid_argument, "weight", "K = x's last dimension");
  testing::expect_error([&] { gated_linear_forward(x.view(), w.view(), b_bad.view(), ok, y.view(), std::nullopt, std::nullopt); },
                        ErrorKind::invalid_argument, "bias", "6");
  testing::expect_error([&] { gated_linear_forward(x16.view(), w.view(), std::nullopt, ok, y.view(), std::nullopt, std::nullopt); },
                        ErrorKind::invalid_argument, "weight", "bf16");
  GatedLinearConfig squared{Activation::squared_relu, GatedLayout::interleaved};
  testing::expect_error([&] { gated_linear_forward(x.view(), w.view(), std::nullopt, squared, y.view(), std::nullopt, std::nullopt); },
                        ErrorKind::invalid_argument, "config.activation", "silu, gelu_tanh");
  GatedLinearConfig bad_layout{Activation::silu, static_cast<GatedLayout>(7)};
  testing::expect_error([&] { gated_linear_forward(x.view(), w.view(), std::nullopt, bad_layout, y.view(), std::nullopt, std::nullopt); },
                        ErrorKind::invalid_argument, "config.layout", "halves or interleaved");
  testing::expect_error([&] { gated_linear_backward(y.view(), x.view(), w.view(), y.view(), ok, x.view(), std::nullopt, std::nullopt, std::nullopt); },
                        ErrorKind::invalid_argument, "pre_activation", "(4, 6)");
  testing::expect_error([&] { gated_linear_forward(x.view(), w.view(), std::nullopt, ok, y.view(), x.view(), std::nullopt); },
                        ErrorKind::invalid_argument, "pre_activation", "(4, 6)");
  testing::expect_error([&] { gated_linear_forward_workspace_size(4, -1, 8, DType::bf16, ok, true, Device::cuda(0)); },
                        ErrorKind::invalid_argument, "f", "-1");
}

// ---- GPU -------------------------------------------------------------------------------------

// Every activation and layout, both 16-bit dtypes and f32, with and without bias and a saved
// pre-activation; tiles cut by M, F and K that are not tile multiples.
TEST(GatedLinearGpu, ForwardMatchesReference) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  for (DType dtype : {DType::bf16, DType::f16, DType::f32})
    for (GatedLayout layout : kLayouts)
      for (Activation act : kGates) {
        Case c;
        c.dtype = dtype;
        c.config = {act, layout};
        c.m = 200 + 37 * (salt % 3);
        c.f = 132;
        c.k = 136;
        c.bias = salt % 2 == 0;
        c.pre = salt % 3 != 0;
        const GatedForwardPath path = check_forward(c, 100 + salt++);
        const bool epilogue = dtype != DType::f32 && layout == GatedLayout::interleaved;
        EXPECT_EQ(path, epilogue ? GatedForwardPath::epilogue : GatedForwardPath::gemm_then_gated);
      }
}

// Shapes around the 128 x 128 tile and the 64-deep k-block, a single row, large K; the epilogue
// kernel and the separate path on the same problems.
TEST(GatedLinearGpu, ShapesAndBothPaths) {
  FUSEKIT_REQUIRE_GPU();
  const std::int64_t shapes[][3] = {{1, 4, 8}, {1, 64, 4096}, {129, 64, 64}, {128, 68, 72},
                                    {255, 196, 200}, {1000, 512, 1024}, {2048, 1408, 512}};
  int salt = 0;
  for (const auto& s : shapes)
    for (GatedForwardPath forced : {GatedForwardPath::automatic, GatedForwardPath::gemm_then_gated}) {
      GatedPathOverride scope(forced);
      Case c;
      c.config = {salt % 2 ? Activation::gelu_tanh : Activation::silu, GatedLayout::interleaved};
      c.m = s[0];
      c.f = s[1];
      c.k = s[2];
      c.bias = salt % 3 != 1;
      c.pre = salt % 2 == 0;
      const GatedForwardPath path = check_forward(c, 300 + salt++);
      EXPECT_EQ(path, forced == GatedForwardPath::automatic ? GatedForwardPath::epilogue : forced);
    }
}

// Views the epilogue kernel cannot take (odd F, rows off alignment, misaligned pointers) run the
// separate path with the same results; padded rows are never written.
TEST(GatedLinearGpu, UnalignedViewsAndPadding) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  struct View {
    std::int64_t f, k, pad, lead;
    bool epilogue;
  };
  for (const View& v : {View{13, 40, 0, 0, false}, View{64, 40, 8, 0, true}, View{64, 40, 3, 0, false},
                        View{64, 40, 0, 1, false}, View{66, 48, 0, 0, false}, View{32, 36, 0, 0, false}}) {
    Case c;
    c.dtype = DType::bf16;
    c.config = {Activation::silu, GatedLayout::interleaved};
    c.m = 77;
    c.f = v.f;
    c.k = v.k;
    c.pad = v.pad;
    c.lead = v.lead;
    const GatedForwardPath path = check_forward(c, 500 + salt++);
    EXPECT_EQ(path, v.epilogue ? GatedForwardPath::epilogue : GatedForwardPath::gemm_then_gated) << v.f << " " << v.pad;
  }
}

TEST(GatedLinearGpu, EmptyAndDegenerate) {
  FUSEKIT_REQUIRE_GPU();
  for (const auto& s : {std::array<std::int64_t, 3>{0, 8, 16}, {5, 8, 0}}) {
    Case c;
    c.m = s[0];
    c.f = s[1];
    c.k = s[2];
    c.bias = true;
    check_forward(c, 700 + static_cast<int>(s[0]));
    check_backward(c, 710 + static_cast<int>(s[0]));
  }
}

TEST(GatedLinearGpu, BackwardMatchesReference) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  for (DType dtype : {DType::bf16, DType::f16, DType::f32})
    for (GatedLayout layout : kLayouts)
      for (Activation act : kGates) {
        Case c;
        c.dtype = dtype;
        c.config = {act, layout};
        c.m = 130 + 61 * (salt % 3);
        c.f = salt % 4 == 3 ? 45 : 96;
        c.k = 72;
        c.bias = salt % 2 == 0;
        check_backward(c, 900 + salt++);
      }
  Case big;
  big.m = 2048;
  big.f = 1408;
  big.k = 512;
  check_backward(big, 990);
}

// dpre formed by the dx GEMM's producer warps (interleaved layout), all of it or after rows the
// elementwise pass formed first, with and without dbias, both 16-bit dtypes, every gate; halves
// cannot take that route and form dpre before the GEMMs.
TEST(GatedLinearGpu, DpreFormedInsideTheDgradGemm) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  for (long long first_rows : {0LL, 128LL, 384LL})
    for (Activation act : kGates) {
      DpreRoute route(linear::BackwardPath::dz_in_dgrad, first_rows);
      Case c;
      c.dtype = salt % 2 ? DType::f16 : DType::bf16;
      c.config = {act, GatedLayout::interleaved};
      c.m = 515;
      c.f = 324;
      c.k = 264;
      c.bias = salt % 3 != 2;
      EXPECT_EQ(check_backward(c, 1100 + salt++), linear::BackwardPath::dz_in_dgrad);
    }
  DpreRoute route(linear::BackwardPath::dz_in_dgrad, -1);
  Case halves;
  halves.config = {Activation::silu, GatedLayout::halves};
  halves.m = 515;
  halves.f = 324;
  halves.k = 264;
  EXPECT_EQ(check_backward(halves, 1190), linear::BackwardPath::separate_dz);
}

}  // namespace
}  // namespace fusekit
