// Bias + activation + dropout: the mask's documented mapping, the CPU reference against its
// definition and against finite differences, the CUDA kernels against the CPU reference over a
// randomized grid (mask bit for bit, forward against backward), the keep rate, p = 0, dbias
// determinism, layout edge cases and argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/activation.h"
#include "bias_act_dropout/bias_act_dropout_grid.h"
#include "bias_act_dropout/bias_act_dropout_mask.h"
#include "bias_act_dropout/bias_act_dropout_params.h"
#include "fusekit/bias_act_dropout.h"
#include "fusekit/error.h"
#include "tests/harness/gtest_helpers.h"

namespace fusekit {
namespace {

using testing::Buffer;
using testing::close_to_reference;
using testing::error_of;
using MathD = detail::ActivationMath<double>;

constexpr Activation kActivations[] = {Activation::none,         Activation::relu,
                                       Activation::gelu_erf,     Activation::gelu_tanh,
                                       Activation::squared_relu, Activation::leaky_relu,
                                       Activation::silu};

struct Case {
  DType dtype = DType::bf16;
  DType bias_dtype = DType::bf16;
  DType dbias_dtype = DType::bf16;
  std::int64_t rows = 1, cols = 1;
  bool bias = true;
  std::int64_t row_pad = 0;  // extra elements between rows of x, y, dx (row stride = cols + row_pad)
  BiasActDropoutConfig config;
  std::int64_t lead = 0;  // elements before every tensor's first: pointers off 16-byte alignment
  std::string str() const {
    return std::string(activation_name(config.activation)) + " p=" + std::to_string(config.p) + " " +
           dtype_name(dtype) + "/b:" + dtype_name(bias_dtype) + "/db:" + dtype_name(dbias_dtype) + " (" +
           std::to_string(rows) + ", " + std::to_string(cols) + ")" + (bias ? " +b" : "") +
           (row_pad ? " pad " + std::to_string(row_pad) : "") + " seed " + std::to_string(config.seed) +
           " offset " + std::to_string(config.offset) + (lead ? " lead " + std::to_string(lead) : "");
  }
};

// All tensors of one forward + backward problem on one device.
struct Problem {
  Case c;
  Device device;
  Buffer x, y, dy, dx;
  std::optional<Buffer> bias, dbias, workspace;

  Problem(const Case& c_, Device d)
      : c(c_), device(d),
        x(c.dtype, d, {c.rows, c.cols}, {c.cols + c.row_pad, 1}, c.lead),
        y(c.dtype, d, {c.rows, c.cols}, {c.cols + c.row_pad, 1}, c.lead),
        dy(c.dtype, d, {c.rows, c.cols}, {}, c.lead),
        dx(c.dtype, d, {c.rows, c.cols}, {c.cols + c.row_pad, 1}, c.lead) {
    const std::vector<std::int64_t> row{c.cols};
    if (c.bias) bias.emplace(c.bias_dtype, d, row, std::vector<std::int64_t>{}, c.lead);
    dbias.emplace(c.dbias_dtype, d, row, std::vector<std::int64_t>{}, c.lead);
    const std::size_t ws = bias_act_dropout_backward_workspace_size(c.rows, c.cols, c.dtype, d);
    if (ws > 0) workspace.emplace(DType::u8, d, std::vector<std::int64_t>{static_cast<std::int64_t>(ws)});
  }

  static OptionalTensor opt(const std::optional<Buffer>& b) {
    return b ? OptionalTensor(b->view()) : std::nullopt;
  }
  void forward() { bias_act_dropout_forward(x.view(), opt(bias), c.config, y.view()); }
  void backward() {
    bias_act_dropout_backward(dy.view(), x.view(), opt(bias), c.config, dx.view(), opt(dbias),
                              opt(workspace));
  }
  void poison_outputs() {
    y.poison();
    dx.poison();
    dbias->poison();
  }
};

void copy_inputs(const Problem& from, Problem& to) {
  to.x.set_values(from.x.values());
  to.dy.set_values(from.dy.values());
  if (from.bias) to.bias->set_values(from.bias->values());
}

// x ~ N(0, 1.5), bias ~ N(0, 0.5), dy ~ N(0, 1): every activation sees both signs.
void fill_inputs(Problem& p, std::mt19937_64& rng) {
  p.x.fill_normal(rng, 0.0, 1.5);
  p.dy.fill_normal(rng);
  if (p.bias) p.bias->fill_normal(rng, 0.0, 0.5);
}

// The exact dx of the reference's inputs (float64), for the reduction baseline of dbias.
std::vector<double> exact_dx(const Problem& p) {
  const auto x = p.x.values(), dy = p.dy.values();
  const auto b = p.bias ? p.bias->values() : std::vector<double>(p.c.cols, 0.0);
  const std::uint32_t t = dropout_keep_threshold(p.c.config.p);
  std::vector<double> out(x.size());
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < p.c.rows; ++r) {
    philox::Words4 words{};
    std::int64_t group = -1;
    for (std::int64_t k = 0; k < p.c.cols; ++k) {
      const std::int64_t i = r * p.c.cols + k;
      if (i / 8 != group) {  // one Philox call per group of 8 (dropout_keeps() would make 8)
        group = i / 8;
        words = philox::random4(p.c.config.seed, p.c.config.offset, group);
      }
      const bool kept = dropout_random16_of_group(words, i) >= t;
      out[i] = kept ? dy[i] / (1.0 - p.c.config.p) *
                          MathD::derivative(p.c.config.activation, x[i] + b[k], p.c.config.slope)
                    : 0.0;
    }
  }
  return out;
}

// Runs one case on the GPU and on the CPU reference and compares every output.
void check_gpu_against_cpu(const Case& c, std::uint64_t salt) {
  SCOPED_TRACE(c.str());
  auto rng = testing::make_rng(salt);
  Problem cpu(c, Device::cpu()), gpu(c, Device::cuda(0));
  fill_inputs(cpu, rng);
  copy_inputs(cpu, gpu);
  cpu.forward();
  cpu.backward();
  gpu.poison_outputs();
  gpu.forward();
  gpu.backward();
  EXPECT_TRUE(close_to_reference(gpu.y.values(), cpu.y.values(), c.dtype, "y"));
  // dx = dy * keep / (1 - p) * act'(x + b): where act' is near its zero (gelu near x = -0.75) or
  // few elements survive, ||dx|| is far below its terms; measure against ||dy|| / (1 - p).
  double dy_norm = 0.0;
  const std::vector<double> dy = cpu.dy.values();
#pragma omp parallel for schedule(static) reduction(+ : dy_norm)
  for (std::size_t i = 0; i < dy.size(); ++i) dy_norm += dy[i] * dy[i];
  const double terms = std::sqrt(dy_norm) / (1.0 - c.config.p);
  EXPECT_TRUE(close_to_reference(gpu.dx.values(), cpu.dx.values(), c.dtype, "dx", terms));
  const auto ref = cpu.dbias->values();
  EXPECT_TRUE(testing::reduction_close(gpu.dbias->values(), ref, c.dbias_dtype,
                                       testing::f32_column_sum_error(exact_dx(cpu), c.rows, c.cols, ref),
                                       "dbias"));
}

// ---- the mask ------------------------------------------------------------------------------

TEST(BiasActDropoutMask, FollowsTheDocumentedPhiloxMapping) {
  auto rng = testing::make_rng(1);
  for (int trial = 0; trial < 200; ++trial) {
    const std::uint64_t seed = rng(), offset = rng() >> (trial % 64), index = rng() >> (trial % 40);
    const philox::Words4 w = philox::random4(seed, offset, index / 8);
    const std::uint32_t words[4] = {w.x, w.y, w.z, w.w};
    const std::uint32_t word = words[(index % 8) / 2];
    const std::uint32_t expected = (index % 2 == 0) ? (word & 0xFFFFu) : (word >> 16);
    ASSERT_EQ(dropout_random16(seed, offset, index), expected) << "index " << index;
    const std::uint32_t t = static_cast<std::uint32_t>(rng() % 65536);
    ASSERT_EQ(dropout_keeps(seed, offset, index, t), expected >= t);
  }
}

TEST(BiasActDropoutMask, KernelKeyScheduleMatchesPhilox) {
  // The kernels run Philox from a key schedule precomputed on the host; it must give the same
  // words as philox::random4 (the CPU reference's path).
  auto rng = testing::make_rng(2);
  for (int trial = 0; trial < 100; ++trial) {
    bias_act_dropout::Scalars s;
    s.set_seed(rng());
    s.offset = rng();
    const std::uint64_t n = rng() >> (trial % 64);
    const philox::Words4 a = s.random4(n), b = philox::random4(s.seed, s.offset, n);
    ASSERT_TRUE(a.x == b.x && a.y == b.y && a.z == b.z && a.w == b.w) << "n " << n;
    // And with the first round's offset terms precomputed (the kernels' path).
    const philox::Words4 c = bias_act_dropout::random4_from(s, bias_act_dropout::philox_prefix(s), n);
    ASSERT_TRUE(c.x == b.x && c.y == b.y && c.z == b.z && c.w == b.w) << "prefix, n " << n;
  }
}

TEST(BiasActDropoutMask, KernelChunkMasksMatchTheDefinition) {
  // The kernels' 8-element chunk masks (aligned: one Philox call; unaligned: two, re-packed),
  // run on the CPU, against dropout_keeps() element by element, for every shift.
  auto rng = testing::make_rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const float p = (trial % 3 == 0) ? 0.5f : static_cast<float>(rng() % 1000) / 1000.0f;
    bias_act_dropout::Scalars s;
    s.set_seed(rng());
    s.offset = rng() >> (trial % 60);
    s.keep_threshold = dropout_keep_threshold(p);
    s.keep_threshold2 = s.keep_threshold | (s.keep_threshold << 16);
    const bias_act_dropout::PhiloxPrefix pre = bias_act_dropout::philox_prefix(s);
    const std::uint64_t first = (rng() >> (trial % 50)) + trial % 8;
    const bias_act_dropout::MaskWords u = bias_act_dropout::unaligned_mask(s, pre, first);
    for (int i = 0; i < 8; ++i)
      ASSERT_EQ(u.kept(i, s.keep_threshold), dropout_keeps(s.seed, s.offset, first + i, s.keep_threshold))
          << "unaligned, first " << first << " element " << i << " p " << p;
    const std::uint64_t aligned = first / 8 * 8;
    const bias_act_dropout::MaskWords a = bias_act_dropout::aligned_mask(s, pre, aligned / 8);
    for (int i = 0; i < 8; ++i)
      ASSERT_EQ(a.kept(i, s.keep_threshold), dropout_keeps(s.seed, s.offset, aligned + i, s.keep_threshold))
          << "aligned, first " << aligned << " element " << i;
    for (int j = 0; j < 4; ++j) {  // the pairwise form the kernels use
      bool lo = false, hi = false;
      a.kept_pair(j, s.keep_threshold2, lo, hi);
      ASSERT_EQ(lo, a.kept(2 * j, s.keep_threshold)) << "pair " << j;
      ASSERT_EQ(hi, a.kept(2 * j + 1, s.keep_threshold)) << "pair " << j;
    }
  }
  bias_act_dropout::Scalars none;  // p = 0: every element kept, no Philox
  const bias_act_dropout::MaskWords all = bias_act_dropout::unaligned_mask(none, bias_act_dropout::philox_prefix(none), 13);
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(all.kept(i, none.keep_threshold));
}

TEST(BiasActDropoutGrid, EveryRowOfEveryColumnTileIsVisitedOnce) {
  const std::pair<std::int64_t, std::int64_t> shapes[] = {
      {1, 1}, {3, 7}, {17, 1001}, {1000, 8}, {16384, 4096}, {32768, 1024}, {8192, 16384},
      {16384, 5120}, {7, 70000}, {300000, 24}, {2, 65536}};
  for (auto [rows, cols] : shapes)
    for (int sms : {1, 114, 132})
      for (int per_sm : {1, 2})
        for (int width : {bias_act_dropout::kForwardBlockWidth, bias_act_dropout::kBackwardBlockWidth, 128}) {
          const bias_act_dropout::TileGrid g = bias_act_dropout::make_grid(rows, cols, sms, per_sm, width);
          SCOPED_TRACE("(" + std::to_string(rows) + ", " + std::to_string(cols) + ") sms " +
                       std::to_string(sms) + " x" + std::to_string(per_sm) + " width " + std::to_string(width));
          ASSERT_EQ(g.tx * g.ty, bias_act_dropout::kThreads);
          ASSERT_GE(std::int64_t(g.gx) * g.tx * bias_act_dropout::kChunk, cols);              // all columns
          ASSERT_LT(std::int64_t(g.gx - 1) * g.tx * bias_act_dropout::kChunk, cols);          // no empty tile
          ASSERT_LE(g.gy, 65535);
          if (g.gx <= sms * per_sm) ASSERT_LE(std::int64_t(g.gx) * g.gy, sms * per_sm);  // one wave
          std::vector<int> visits(rows, 0);
          for (int by = 0; by < g.gy; ++by)
            for (int ty = 0; ty < g.ty; ++ty) {
              const bias_act_dropout::ThreadRows t = bias_act_dropout::thread_rows(g, by, ty);
              for (int k = 0; k < t.count; ++k) ++visits.at(t.first + std::int64_t(k) * bias_act_dropout::row_step(g));
            }
          ASSERT_TRUE(std::all_of(visits.begin(), visits.end(), [](int v) { return v == 1; }));
        }
}

TEST(BiasActDropoutMask, KeepThreshold) {
  EXPECT_EQ(dropout_keep_threshold(0.0f), 0u);
  EXPECT_EQ(dropout_keep_threshold(0.5f), 32768u);
  EXPECT_EQ(dropout_keep_threshold(0.1f), 6554u);  // ceil(6553.6)
  EXPECT_EQ(dropout_keep_threshold(1e-9f), 1u);     // any p > 0 drops something
  EXPECT_EQ(dropout_keep_threshold(0.99999f), 65535u);
  EXPECT_EQ(dropout_keep_threshold(std::nextafter(1.0f, 0.0f)), 65535u);
  // Within 2^-16 of p everywhere.
  for (float p = 0.0f; p < 1.0f; p += 0.0137f)
    EXPECT_LE(std::abs(dropout_keep_threshold(p) / 65536.0 - p), 1.0 / 65536) << p;
}

// ---- CPU reference -------------------------------------------------------------------------

TEST(BiasActDropoutCpu, ForwardFollowsTheDefinition) {
  // With a padded row stride, so that the mask index r * N + c is told apart from the memory
  // offset r * stride + c.
  auto rng = testing::make_rng(3);
  for (Activation act : kActivations) {
    Case c{DType::f32, DType::f32, DType::f32, 9, 37, true, 5, {act, 0.05f, 0.3f, rng(), rng() % 1000}};
    SCOPED_TRACE(c.str());
    Problem p(c, Device::cpu());
    fill_inputs(p, rng);
    p.forward();
    const auto x = p.x.values(), b = p.bias->values(), y = p.y.values();
    const std::uint32_t t = dropout_keep_threshold(c.config.p);
    int dropped = 0;
    for (std::int64_t r = 0; r < c.rows; ++r)
      for (std::int64_t k = 0; k < c.cols; ++k) {
        const std::int64_t i = r * c.cols + k;
        const bool kept = dropout_keeps(c.config.seed, c.config.offset, i, t);
        dropped += !kept;
        const double scale = 1.0 / (1.0 - static_cast<double>(c.config.p));
        const double expected =
            kept ? static_cast<float>(MathD::forward(act, x[i] + b[k], c.config.slope) * scale) : 0.0;
        ASSERT_EQ(y[i], expected) << "row " << r << " col " << k;
      }
    EXPECT_GT(dropped, 0);
    EXPECT_LT(dropped, c.rows * c.cols);
  }
}

// Finite differences of L = sum(y * dy) with respect to x and bias, under a fixed mask.
TEST(BiasActDropoutCpu, GradientsMatchFiniteDifferences) {
  auto rng = testing::make_rng(4);
  for (Activation act : kActivations) {
    Case c{DType::f32, DType::f32, DType::f32, 4, 11, true, 3, {act, 0.1f, 0.3f, rng(), rng() % 1000}};
    SCOPED_TRACE(c.str());
    Problem p(c, Device::cpu());
    fill_inputs(p, rng);
    // Keep x + b away from the kinks of relu, leaky_relu and squared_relu (|x + b| >= 0.2), so
    // that a step of h = 1e-2 never crosses one.
    auto xv = p.x.values();
    const auto bv = p.bias->values();
    for (std::int64_t r = 0; r < c.rows; ++r)
      for (std::int64_t k = 0; k < c.cols; ++k) {
        double& v = xv[r * c.cols + k];
        if (std::abs(v + bv[k]) < 0.2) v += (v + bv[k] >= 0 ? 0.3 : -0.3);
      }
    p.x.set_values(xv);
    p.forward();
    p.backward();
    const auto dy = p.dy.values();
    auto loss = [&] {
      p.forward();
      const auto y = p.y.values();
      double l = 0;
      for (std::size_t i = 0; i < y.size(); ++i) l += y[i] * dy[i];
      return l;
    };
    auto fd = [&](Buffer& param, std::int64_t i) { return testing::central_difference(param, i, 1e-2, loss); };
    const auto dx = p.dx.values(), db = p.dbias->values();
    int nonzero = 0;
    for (std::int64_t i = 0; i < c.rows * c.cols; ++i) {
      const double g = fd(p.x, i);
      EXPECT_NEAR(g, dx[i], 2e-3 * std::max(1.0, std::abs(g))) << "dx " << i;
      nonzero += dx[i] != 0.0;
    }
    for (std::int64_t k = 0; k < c.cols; ++k) {
      const double g = fd(*p.bias, k);
      EXPECT_NEAR(g, db[k], 2e-3 * std::max(1.0, std::abs(g))) << "dbias " << k;
    }
    EXPECT_GT(nonzero, 0);
  }
}

TEST(BiasActDropoutCpu, DbiasIsTheColumnSumOfDx) {
  auto rng = testing::make_rng(5);
  Case c{DType::f32, DType::f32, DType::f32, 50, 19, true, 0, {Activation::silu, 0.0f, 0.25f, rng(), 7}};
  Problem p(c, Device::cpu());
  fill_inputs(p, rng);
  p.backward();
  const auto dx = exact_dx(p), db = p.dbias->values();
  for (std::int64_t k = 0; k < c.cols; ++k) {
    double s = 0;
    for (std::int64_t r = 0; r < c.rows; ++r) s += dx[r * c.cols + k];
    EXPECT_NEAR(db[k], s, 1e-5 * std::max(1.0, std::abs(s)));
  }
}

TEST(BiasActDropoutCpu, ZeroProbabilityIsThePlainActivation) {
  auto rng = testing::make_rng(6);
  for (Activation act : kActivations) {
    Case c{DType::f32, DType::f32, DType::f32, 6, 21, true, 0, {act, 0.2f, 0.0f, rng(), 3}};
    Problem p(c, Device::cpu());
    fill_inputs(p, rng);
    p.forward();
    p.backward();
    const auto x = p.x.values(), b = p.bias->values(), y = p.y.values(), dy = p.dy.values(),
               dx = p.dx.values();
    for (std::int64_t r = 0; r < c.rows; ++r)
      for (std::int64_t k = 0; k < c.cols; ++k) {
        const std::int64_t i = r * c.cols + k;
        ASSERT_EQ(y[i], static_cast<float>(MathD::forward(act, x[i] + b[k], c.config.slope)));
        ASSERT_EQ(dx[i], static_cast<float>(dy[i] * MathD::derivative(act, x[i] + b[k], c.config.slope)));
      }
  }
}

TEST(BiasActDropoutCpu, KeepRateIsOneMinusP) {
  // 2^20 elements: the standard deviation of the kept fraction is below 5e-4.
  auto rng = testing::make_rng(7);
  for (float p : {0.1f, 0.5f, 0.9f}) {
    Case c{DType::f32, DType::f32, DType::f32, 1024, 1024, false, 0, {Activation::none, 0.0f, p, rng(), rng()}};
    Problem q(c, Device::cpu());
    std::vector<double> ones(c.rows * c.cols);
    for (auto& v : ones) v = 1.0 + std::abs(std::normal_distribution<double>(0, 1)(rng));
    q.x.set_values(ones);
    q.forward();
    std::int64_t kept = 0;
    for (double v : q.y.values()) kept += v != 0.0;
    const double n = static_cast<double>(c.rows * c.cols), rate = kept / n;
    const double sigma = std::sqrt(p * (1 - p) / n);
    EXPECT_NEAR(rate, 1.0 - p, 5 * sigma + 1.0 / 65536) << "p = " << p;
  }
}

TEST(BiasActDropoutCpu, OffsetsAndSeedsGiveIndependentMasks) {
  auto rng = testing::make_rng(8);
  const std::uint64_t seed = rng();
  auto mask = [&](std::uint64_t s, std::uint64_t o) {
    Case c{DType::f32, DType::f32, DType::f32, 64, 64, false, 0, {Activation::none, 0.0f, 0.5f, s, o}};
    Problem q(c, Device::cpu());
    std::vector<double> ones(c.rows * c.cols, 1.0);
    q.x.set_values(ones);
    q.forward();
    return q.y.values();
  };
  const auto a = mask(seed, 0), again = mask(seed, 0), other_offset = mask(seed, 1), other_seed = mask(seed + 1, 0);
  EXPECT_EQ(a, again);
  auto agreement = [](const std::vector<double>& u, const std::vector<double>& v) {
    int same = 0;
    for (std::size_t i = 0; i < u.size(); ++i) same += (u[i] != 0) == (v[i] != 0);
    return same / static_cast<double>(u.size());
  };
  // Independent masks at p = 0.5 agree on about half the elements (4096 elements: sigma 0.008).
  EXPECT_NEAR(agreement(a, other_offset), 0.5, 0.05);
  EXPECT_NEAR(agreement(a, other_seed), 0.5, 0.05);
}

TEST(BiasActDropoutCpu, KeptPreActivationGivesTheSameGradients) {
  auto rng = testing::make_rng(9);
  Case c{DType::f32, DType::f32, DType::f32, 33, 40, true, 0, {Activation::gelu_tanh, 0.0f, 0.2f, rng(), 11}};
  Problem p(c, Device::cpu());
  fill_inputs(p, rng);
  Buffer pre(DType::f32, Device::cpu(), {c.rows, c.cols}), dx2(DType::f32, Device::cpu(), {c.rows, c.cols}),
      db2(DType::f32, Device::cpu(), {c.cols});
  bias_act_dropout_forward(p.x.view(), p.bias->view(), c.config, p.y.view(), pre.view());
  p.backward();
  bias_act_dropout_backward(p.dy.view(), pre.view(), std::nullopt, c.config, dx2.view(), db2.view());
  EXPECT_TRUE(close_to_reference(dx2.values(), p.dx.values(), DType::f32, "dx from pre_activation"));
  EXPECT_TRUE(close_to_reference(db2.values(), p.dbias->values(), DType::f32, "dbias from pre_activation"));
  // The kept tensor is x + bias.
  const auto x = p.x.values(), b = p.bias->values(), h = pre.values();
  for (std::int64_t i = 0; i < c.rows * c.cols; ++i)
    ASSERT_EQ(h[i], static_cast<float>(x[i] + b[i % c.cols]));
}

TEST(BiasActDropoutCpu, OptionalOutputsAreIndependent) {
  auto rng = testing::make_rng(10);
  Case c{DType::bf16, DType::f32, DType::f32, 20, 24, true, 0, {Activation::relu, 0.0f, 0.4f, rng(), 2}};
  Problem p(c, Device::cpu());
  fill_inputs(p, rng);
  p.backward();
  Buffer dx_only(c.dtype, Device::cpu(), {c.rows, c.cols}), db_only(DType::f32, Device::cpu(), {c.cols});
  bias_act_dropout_backward(p.dy.view(), p.x.view(), p.bias->view(), c.config, dx_only.view(), std::nullopt);
  bias_act_dropout_backward(p.dy.view(), p.x.view(), p.bias->view(), c.config, std::nullopt, db_only.view());
  EXPECT_EQ(dx_only.values(), p.dx.values());
  EXPECT_EQ(db_only.values(), p.dbias->values());
}

// ---- argument errors (CPU tensors: checks run before any backend) ----------------------------

TEST(BiasActDropoutErrors, EachBadArgumentIsNamed) {
  std::vector<float> xb(16 * 8), yb(16 * 8), bb(8);
  std::vector<std::uint16_t> hb(16 * 8);
  const Device cpu = Device::cpu();
  TensorView x(xb.data(), DType::f32, cpu, {16, 8}), y(yb.data(), DType::f32, cpu, {16, 8});
  TensorView bias(bb.data(), DType::f32, cpu, {8});
  BiasActDropoutConfig ok{Activation::gelu_tanh, 0.01f, 0.1f, 1, 2};
  const std::string fwd = "fusekit.bias_act_dropout_forward: ";
  const std::string bwd = "fusekit.bias_act_dropout_backward: ";

  // p outside [0, 1), both directions.
  for (float p : {1.0f, -0.1f, 1.5f, std::nanf("")}) {
    BiasActDropoutConfig bad = ok;
    bad.p = p;
    EXPECT_NE(error_of([&] { bias_act_dropout_forward(x, bias, bad, y); })
                  .find(fwd + "argument 'p': expected a drop probability in [0, 1), got "),
              std::string::npos) << p;
    EXPECT_NE(error_of([&] { bias_act_dropout_backward(y, x, bias, bad, x, std::nullopt); })
                  .find(bwd + "argument 'p': expected a drop probability in [0, 1)"),
              std::string::npos) << p;
  }
  EXPECT_EQ(error_of([&] {
              BiasActDropoutConfig bad = ok;
              bad.p = 1.0f;
              bias_act_dropout_forward(x, bias, bad, y);
            }),
            fwd + "argument 'p': expected a drop probability in [0, 1), got 1");
  // An output over an input.
  EXPECT_EQ(error_of([&] { bias_act_dropout_backward(y, x, bias, ok, y, std::nullopt); }),
            bwd + "argument 'dx': expected memory that does not overlap 'dy', got a view sharing "
                  "bytes with 'dy'");
  // Bias length not N.
  TensorView short_bias(bb.data(), DType::f32, cpu, {7});
  EXPECT_EQ(error_of([&] { bias_act_dropout_forward(x, short_bias, ok, y); }),
            fwd + "argument 'bias': expected shape (8), got (7)");
  EXPECT_NE(error_of([&] { bias_act_dropout_backward(y, x, short_bias, ok, x, std::nullopt); })
                .find(bwd + "argument 'bias': expected shape (8)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { bias_act_dropout_backward(y, x, bias, ok, x, short_bias); })
                .find(bwd + "argument 'dbias': expected shape (8)"),
            std::string::npos);
  // Dtype mismatch: y f16 for an f32 x; bias neither x's dtype nor f32; dy and x differing.
  TensorView y16(hb.data(), DType::f16, cpu, {16, 8});
  EXPECT_EQ(error_of([&] { bias_act_dropout_forward(x, bias, ok, y16); }),
            fwd + "argument 'y': expected dtype f32 (as 'x'), got f16");
  TensorView bias16(hb.data(), DType::bf16, cpu, {8});
  EXPECT_EQ(error_of([&] { bias_act_dropout_forward(x, bias16, ok, y); }),
            fwd + "argument 'bias': expected dtype f32 (as x) or f32, got bf16");
  EXPECT_EQ(error_of([&] { bias_act_dropout_backward(y, y16, bias, ok, x, std::nullopt); }),
            bwd + "argument 'x': expected dtype f32 (as 'dy'), got f16");
  EXPECT_EQ(error_of([&] { bias_act_dropout_backward(y, x, bias, ok, y16, std::nullopt); }),
            bwd + "argument 'dx': expected dtype f32 (as 'dy'), got f16");
  // Unsupported input dtype.
  std::vector<double> xd(16 * 8);
  TensorView x64(xd.data(), DType::f64, cpu, {16, 8});
  EXPECT_EQ(error_of([&] { bias_act_dropout_forward(x64, std::nullopt, ok, x64); }),
            fwd + "argument 'x': expected dtype f32, f16 or bf16, got f64");
  // Device mix: bias (forward) and dx (backward) claim a GPU while x is on the CPU. Only the
  // views' metadata is read: no GPU is needed.
  TensorView gpu_bias(bb.data(), DType::f32, Device::cuda(0), {8});
  EXPECT_EQ(error_of([&] { bias_act_dropout_forward(x, gpu_bias, ok, y); }),
            fwd + "argument 'bias': expected a tensor on cpu (where 'x' is), got a tensor on cuda:0");
  TensorView gpu_dx(yb.data(), DType::f32, Device::cuda(0), {16, 8});
  EXPECT_EQ(error_of([&] { bias_act_dropout_backward(y, x, bias, ok, gpu_dx, std::nullopt); }),
            bwd + "argument 'dx': expected a tensor on cpu (where 'dy' is), got a tensor on cuda:0");
  // Shape: y not like x.
  TensorView y_bad(yb.data(), DType::f32, cpu, {8, 8});
  EXPECT_EQ(error_of([&] { bias_act_dropout_forward(x, bias, ok, y_bad); }),
            fwd + "argument 'y': expected shape (16, 8) (as 'x'), got (8, 8)");
  TensorView pre_bad(yb.data(), DType::f32, cpu, {16, 4});
  EXPECT_NE(error_of([&] { bias_act_dropout_forward(x, bias, ok, y, pre_bad); })
                .find(fwd + "argument 'pre_activation': expected shape (16, 8)"),
            std::string::npos);
  // Activation value outside the enum; non-finite leaky_relu slope.
  BiasActDropoutConfig bad_act = ok;
  bad_act.activation = static_cast<Activation>(42);
  EXPECT_NE(error_of([&] { bias_act_dropout_forward(x, bias, bad_act, y); })
                .find(fwd + "argument 'activation': expected one of none, relu"),
            std::string::npos);
  BiasActDropoutConfig bad_slope = ok;
  bad_slope.activation = Activation::leaky_relu;
  bad_slope.slope = INFINITY;
  EXPECT_NE(error_of([&] { bias_act_dropout_forward(x, bias, bad_slope, y); }).find(fwd + "argument 'slope'"),
            std::string::npos);
  // Layout: last dimension not contiguous.
  TensorView x_strided(xb.data(), DType::f32, cpu, {8, 8}, {16, 2});
  EXPECT_NE(error_of([&] { bias_act_dropout_forward(x_strided, bias, ok, y_bad); })
                .find("argument 'x': expected a contiguous last dimension"),
            std::string::npos);
}

// ---- GPU ---------------------------------------------------------------------------------------

TEST(BiasActDropoutGpu, RandomizedGridMatchesCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(100);
  // Multiples of 8 (vector path) and not (generic path), narrow and wide.
  const std::int64_t cols_choices[] = {1, 3, 7, 8, 13, 64, 100, 256, 1000, 1001, 1024, 3000, 4096,
                                       5120, 6001, 8192, 16384};
  const std::int64_t rows_choices[] = {1, 2, 5, 17, 64, 333, 1024};
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  const float ps[] = {0.0f, 0.1f, 0.5f, 0.9f};
  int cases = 0;
  for (std::int64_t cols : cols_choices) {
    for (Activation act : kActivations) {
      Case c;
      c.dtype = dtypes[rng() % 3];
      c.bias_dtype = (rng() % 3 == 0) ? DType::f32 : c.dtype;
      c.dbias_dtype = (rng() % 3 == 0) ? DType::f32 : c.dtype;
      c.rows = rows_choices[rng() % 7];
      c.cols = cols;
      c.bias = rng() % 5 != 0;
      c.row_pad = (rng() % 4 == 0) ? 8 * (1 + rng() % 3) + (rng() % 2) : 0;
      c.config = {act, 0.05f + 0.2f * static_cast<float>(rng() % 4), ps[rng() % 4], rng(), rng()};
      check_gpu_against_cpu(c, 1000 + cases);
      ++cases;
    }
  }
  EXPECT_EQ(cases, 17 * 7);
}

TEST(BiasActDropoutGpu, BenchmarkShapesMatchCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{16384, 4096}, {8192, 16384}, {32768, 1024},
                                                          {16384, 5120}};
  int salt = 0;
  for (auto [rows, cols] : shapes)
    for (Activation act : {Activation::gelu_tanh, Activation::relu}) {
      Case c{DType::bf16, DType::bf16, DType::bf16, rows, cols, true, 0, {act, 0.0f, 0.1f, 1234567u + salt, 99}};
      check_gpu_against_cpu(c, 5000 + salt++);
    }
}

// The cheap activations' forward in 16-bit types runs in row groups where N / 8 splits into whole
// warps of two vectors per thread and N <= 8192 (one, two or four rows per block), else on the
// walking grid: both sides of each boundary, row counts that leave a block partly empty, padded
// rows, p = 0 and p > 0, f16 and bf16 with either bias type. This grid is what first showed the
// f16 miscompile around the packed 16-bit mask compare (bias_act_dropout_mask.h).
TEST(BiasActDropoutGpu, RowGroupForwardShapes) {
  FUSEKIT_REQUIRE_GPU();
  const std::int64_t cols_choices[] = {504, 512, 1024, 1536, 4096, 5120, 8192, 8704, 16384};
  const std::int64_t rows_choices[] = {1, 3, 5, 67};
  const Activation acts[] = {Activation::none, Activation::relu, Activation::squared_relu, Activation::leaky_relu};
  int salt = 0;
  for (DType dtype : {DType::f16, DType::bf16})
    for (std::int64_t cols : cols_choices)
      for (Activation act : acts) {
        Case c;
        c.dtype = dtype;
        c.bias_dtype = salt % 3 == 0 ? DType::f32 : dtype;
        c.dbias_dtype = dtype;
        c.rows = rows_choices[salt % 4];
        c.cols = cols;
        c.bias = salt % 5 != 4;
        c.row_pad = (salt / 4) % 2 == 1 ? 16 : 0;
        c.config = {act, 0.1f, salt % 2 == 0 ? 0.1f : 0.0f, 777u + salt, 31u * salt};
        check_gpu_against_cpu(c, 9000 + salt++);
      }
  EXPECT_EQ(salt, 2 * 9 * 4);
}

// The zero pattern of y (forward) and of dx (backward) is exactly the mask dropout_keeps()
// defines: x > 0 and the identity activation make every kept element non-zero.
TEST(BiasActDropoutGpu, MaskIsBitIdenticalToCpuAndBetweenForwardAndBackward) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(101);
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{333, 1024}, {100, 1001}, {64, 7}, {17, 8200},
                                                          {2048, 4096}};
  int salt = 0;
  for (auto [rows, cols] : shapes) {
    for (DType dt : {DType::bf16, DType::f32}) {
      for (std::int64_t pad : {0, 3}) {
        Case c{dt, dt, dt, rows, cols, false, pad,
               {Activation::none, 0.0f, 0.1f + 0.2f * (salt % 4), rng(), rng()}};
        SCOPED_TRACE(c.str());
        ++salt;
        Problem g(c, Device::cuda(0));
        std::vector<double> xv(rows * cols), dyv(rows * cols);
        std::normal_distribution<double> n01(0.0, 1.0);
        for (auto& v : xv) v = 0.5 + std::abs(n01(rng));
        for (auto& v : dyv) v = (rng() % 2 ? 1.0 : -1.0) * (0.5 + std::abs(n01(rng)));
        g.x.set_values(xv);
        g.dy.set_values(dyv);
        g.poison_outputs();
        g.forward();
        g.backward();
        const auto y = g.y.values(), dx = g.dx.values();
        const std::uint32_t t = dropout_keep_threshold(c.config.p);
        std::int64_t mismatches_y = 0, mismatches_dx = 0, kept = 0;
        for (std::int64_t i = 0; i < rows * cols; ++i) {
          const bool keep = dropout_keeps(c.config.seed, c.config.offset, i, t);
          kept += keep;
          mismatches_y += (y[i] != 0.0) != keep;
          mismatches_dx += (dx[i] != 0.0) != keep;
        }
        EXPECT_EQ(mismatches_y, 0);
        EXPECT_EQ(mismatches_dx, 0);
        EXPECT_GT(kept, 0);
        EXPECT_LT(kept, rows * cols);
      }
    }
  }
}

TEST(BiasActDropoutGpu, KeepRateWithinStatisticalBounds) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(102);
  const std::int64_t rows = 8192, cols = 8192;  // 2^26 elements
  for (float p : {0.1f, 0.5f}) {
    Case c{DType::bf16, DType::bf16, DType::bf16, rows, cols, false, 0, {Activation::none, 0.0f, p, rng(), rng()}};
    Problem g(c, Device::cuda(0));
    std::vector<double> xv(rows * cols);
    for (auto& v : xv) v = 1.0 + (rng() % 1024) / 1024.0;
    g.x.set_values(xv);
    g.y.poison();
    g.forward();
    const auto raw = g.y.raw_bytes();
    std::int64_t kept = 0;
    for (std::size_t i = 0; i < raw.size(); i += 2) {
      std::uint16_t v;
      std::memcpy(&v, &raw[i], 2);
      ASSERT_NE(v, 0xFFFFu) << "unwritten element " << i / 2;
      kept += v != 0;
    }
    const double n = static_cast<double>(rows * cols), rate = kept / n;
    const double sigma = std::sqrt(p * (1 - p) / n);
    EXPECT_NEAR(rate, 1.0 - p, 5 * sigma + 1.0 / 65536) << "p = " << p << ", sigma " << sigma;
  }
}

TEST(BiasActDropoutGpu, ZeroProbabilityIsThePlainActivation) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  for (Activation act : kActivations)
    for (std::int64_t cols : {4096, 1001}) {
      Case c{DType::bf16, DType::bf16, DType::bf16, 300, cols, true, 0, {act, 0.1f, 0.0f, 5, 6}};
      check_gpu_against_cpu(c, 6000 + salt++);
    }
  // And bit for bit against p = 0's meaning: with p = 0, seeds do not matter.
  auto rng = testing::make_rng(103);
  Case a{DType::f32, DType::f32, DType::f32, 128, 512, true, 0, {Activation::gelu_tanh, 0.0f, 0.0f, 1, 2}};
  Case b = a;
  b.config.seed = 77;
  b.config.offset = 88;
  Problem pa(a, Device::cuda(0)), pb(b, Device::cuda(0));
  fill_inputs(pa, rng);
  copy_inputs(pa, pb);
  pa.forward();
  pb.forward();
  EXPECT_EQ(pa.y.raw_bytes(), pb.y.raw_bytes());
}

TEST(BiasActDropoutGpu, DbiasIsBitwiseDeterministic) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(104);
  for (std::int64_t cols : {1024, 4096, 5120, 3001}) {
    Case c{DType::bf16, DType::f32, DType::f32, 8192, cols, true, 0, {Activation::gelu_tanh, 0.0f, 0.1f, rng(), 3}};
    SCOPED_TRACE(c.str());
    Problem p(c, Device::cuda(0));
    fill_inputs(p, rng);
    EXPECT_TRUE(testing::same_bytes_every_run(
        [&] {
          p.dx.poison();
          p.dbias->poison();
          p.backward();
        },
        {&*p.dbias, &p.dx}));
  }
}

TEST(BiasActDropoutGpu, KeptPreActivationPath) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(105);
  for (std::int64_t cols : {2048, 1003}) {
    Case c{DType::bf16, DType::bf16, DType::f32, 257, cols, true, 0, {Activation::silu, 0.0f, 0.2f, rng(), 4}};
    SCOPED_TRACE(c.str());
    Problem cpu(c, Device::cpu()), gpu(c, Device::cuda(0));
    fill_inputs(cpu, rng);
    copy_inputs(cpu, gpu);
    Buffer pre_cpu(c.dtype, Device::cpu(), {c.rows, c.cols}), pre_gpu(c.dtype, Device::cuda(0), {c.rows, c.cols});
    Buffer dx_gpu(c.dtype, Device::cuda(0), {c.rows, c.cols}), db_gpu(DType::f32, Device::cuda(0), {c.cols});
    bias_act_dropout_forward(cpu.x.view(), cpu.bias->view(), c.config, cpu.y.view(), pre_cpu.view());
    bias_act_dropout_forward(gpu.x.view(), gpu.bias->view(), c.config, gpu.y.view(), pre_gpu.view());
    EXPECT_EQ(pre_gpu.values(), pre_cpu.values());  // x + b in float32, rounded once: exact
    // Backward from the kept h (no bias) against the CPU reference from the same h.
    Buffer dx_cpu(c.dtype, Device::cpu(), {c.rows, c.cols}), db_cpu(DType::f32, Device::cpu(), {c.cols});
    bias_act_dropout_backward(cpu.dy.view(), pre_cpu.view(), std::nullopt, c.config, dx_cpu.view(), db_cpu.view());
    bias_act_dropout_backward(gpu.dy.view(), pre_gpu.view(), std::nullopt, c.config, dx_gpu.view(), db_gpu.view(),
                              gpu.workspace->view());
    EXPECT_TRUE(close_to_reference(dx_gpu.values(), dx_cpu.values(), c.dtype, "dx from pre_activation"));
    EXPECT_TRUE(close_to_reference(db_gpu.values(), db_cpu.values(), DType::f32, "dbias from pre_activation"));
  }
}

TEST(BiasActDropoutGpu, RowPaddingIsNeverWritten) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(106);
  for (std::int64_t pad : {8, 5}) {
    Case c{DType::bf16, DType::bf16, DType::bf16, 100, 1024, true, pad, {Activation::relu, 0.0f, 0.3f, 9, 9}};
    Problem p(c, Device::cuda(0));
    fill_inputs(p, rng);
    p.poison_outputs();
    p.forward();
    p.backward();
    for (const Buffer* b : {&p.y, &p.dx})
      EXPECT_EQ(testing::poisoned_padding(*b, c.rows, c.cols, c.row_pad), (c.rows - 1) * c.row_pad);
  }
}

// Pointers off 16-byte alignment (every tensor starts `lead` elements past an aligned address)
// with odd row strides: the kernels for unaligned rows must match the reference (the mask bit for
// bit with it) and write nothing before a tensor or into its row padding.
TEST(BiasActDropoutGpu, UnalignedPointersAndOddRowStrides) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(107);
  const std::int64_t shapes[][3] = {{64, 1000, 3}, {33, 4096, 1}, {17, 777, 5}};
  const Activation acts[] = {Activation::gelu_tanh, Activation::relu, Activation::silu};
  int cases = 0;
  for (const auto& shape : shapes) {
    for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
      for (std::int64_t lead : {1, 3}) {
        Case c{dtype, dtype, DType::f32, shape[0], shape[1], true, shape[2],
               {acts[cases % 3], 0.01f, cases % 2 ? 0.2f : 0.0f, 77 + std::uint64_t(cases), 5}};
        c.lead = lead;
        check_gpu_against_cpu(c, 9100 + cases);
        Problem p(c, Device::cuda(0));
        fill_inputs(p, rng);
        p.poison_outputs();
        p.forward();
        p.backward();
        for (const Buffer* b : {&p.y, &p.dx}) {
          EXPECT_EQ(testing::poisoned_padding(*b, c.rows, c.cols, c.row_pad), (c.rows - 1) * c.row_pad) << c.str();
          EXPECT_TRUE(b->lead_untouched()) << c.str();
        }
        EXPECT_TRUE(p.dbias->lead_untouched()) << c.str();
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 18);
}

TEST(BiasActDropoutGpu, WorkspaceMissingOrTooSmallIsAnError) {
  FUSEKIT_REQUIRE_GPU();
  Case c{DType::bf16, DType::bf16, DType::bf16, 4096, 1024, true, 0, {Activation::relu, 0.0f, 0.1f, 1, 1}};
  Problem p(c, Device::cuda(0));
  Buffer tiny(DType::u8, Device::cuda(0), {16});
  for (const OptionalTensor& ws : {OptionalTensor(tiny.view()), OptionalTensor()}) {
    const std::string e = error_of([&] {
      bias_act_dropout_backward(p.dy.view(), p.x.view(), p.bias->view(), c.config, p.dx.view(),
                                p.dbias->view(), ws);
    });
    EXPECT_NE(e.find("argument 'workspace': expected a contiguous u8 tensor of at least"), std::string::npos) << e;
  }
  // Without dbias no workspace is needed.
  EXPECT_EQ(error_of([&] {
              bias_act_dropout_backward(p.dy.view(), p.x.view(), p.bias->view(), c.config, p.dx.view(),
                                        std::nullopt);
            }),
            "no error");
}

TEST(BiasActDropoutGpu, EmptyBatchGivesZeroDbias) {
  FUSEKIT_REQUIRE_GPU();
  Case c{DType::bf16, DType::bf16, DType::f32, 0, 256, true, 0, {Activation::gelu_tanh, 0.0f, 0.1f, 1, 1}};
  Problem p(c, Device::cuda(0));
  p.poison_outputs();
  p.forward();
  p.backward();
  for (double v : p.dbias->values()) ASSERT_EQ(v, 0.0);
}

}  // namespace
}  // namespace fusekit
