// FP8 RMSNorm: properties of the CPU reference (against an independent float64 RMSNorm, finite
// differences and the bf16/f32 norm family), every argument error, and the CUDA kernels against
// the CPU reference over a randomized grid (bit-exact quantized outputs up to counted one-ulp
// differences), determinism and layout edge cases.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "fusekit/error.h"
#include "fusekit/fp8_norm.h"
#include "fusekit/norm.h"
#include "core/overrides.h"
#include "fp8_norm/fp8_norm_paths.h"
#include "tests/fp8_norm/fp8_norm_testing.h"
#include "tests/harness/gtest_helpers.h"

namespace fusekit {
namespace {

using testing::Buffer;
using testing::close_to_reference;
using testing::error_of;
using namespace testing::fp8;

// ---- CPU reference -------------------------------------------------------------------------

// A CPU problem of rows x cols with output format q_dtype (other choices default), filled from
// rng and run forward.
Problem cpu_forward(std::int64_t rows, std::int64_t cols, DType q_dtype, std::mt19937_64& rng) {
  Case c;
  c.rows = rows;
  c.cols = cols;
  c.q_dtype = q_dtype;
  Problem p(c, Device::cpu());
  fill_inputs(p, rng);
  p.forward();
  return p;
}

TEST(Fp8NormCpu, DequantizedOutputWithinFp8RoundingOfFloat64RmsNorm) {
  auto rng = testing::make_rng(601);
  for (DType xf : {DType::f8e4m3, DType::f8e5m2})
    for (DType qf : {DType::f8e4m3, DType::f8e5m2})
      for (DType sf : {DType::bf16, DType::f32}) {
        Case c;
        c.rows = 37;
        c.cols = 96;
        c.group = (sf == DType::bf16) ? 16 : 32;
        c.x_dtype = xf;
        c.q_dtype = qf;
        c.scale_dtype = sf;
        c.weight_dtype = (qf == DType::f8e4m3) ? DType::bf16 : DType::f32;
        SCOPED_TRACE(c.str());
        Problem p(c, Device::cpu());
        fill_inputs(p, rng);
        p.forward();
        const auto y64 = rms_norm_f64(p);
        const double s = p.y_scale.values()[0];
        const DequantCheck d = check_dequantized(p.qy.values(), s, y64, qf);
        EXPECT_EQ(d.violations, 0) << d.str();
        // Nothing better is possible than rounding y64 / s to fp8; nothing much worse is allowed.
        EXPECT_LE(d.rel_l2, 1.05 * d.fp8_baseline + 1e-6) << d.str();
        // The bf16 y is y64 rounded once more (float32 evaluation, then bf16).
        EXPECT_TRUE(close_to_reference(p.y->values(), y64, DType::bf16, "y"));
      }
}

TEST(Fp8NormCpu, ScaleIsAmaxOverFp8MaxAndAmaxSaturatesExactly) {
  auto rng = testing::make_rng(602);
  for (DType qf : {DType::f8e4m3, DType::f8e5m2}) {
    Problem p = cpu_forward(20, 64, qf, rng);
    const auto yv = p.y->values();  // bf16 of the float32 y; amax is over the float32 values
    const auto y64 = rms_norm_f64(p);
    double amax = 0;
    for (double v : y64) amax = std::max(amax, std::abs(v));
    const double s = p.y_scale.values()[0];
    EXPECT_NEAR(s, amax / fp8_max_finite(qf), 1e-6 * s);
    // The largest |y| lands exactly on +-fp8_max, and nothing exceeds it.
    double qmax = 0;
    for (double q : p.qy.values()) qmax = std::max(qmax, std::abs(q));
    EXPECT_EQ(qmax, fp8_max_finite(qf));
  }
}

// The GPU comparison recomputes the multiplier from the GPU's rstd (amax_from_rstd) when a row's
// rstd differs, because y_scale = amax / fp8_max does not determine fp8_max / amax. Both halves of
// that are checked here: the helper reproduces the reference's y_scale from the reference's
// rstd, and an rstd one ulp off in the max row can leave y_scale as it is and move the multiplier.
TEST(Fp8NormCpu, MultiplierFromRstdMatchesReferenceAndYScaleDoesNotFixIt) {
  auto rng = testing::make_rng(611);
  for (DType qf : {DType::f8e4m3, DType::f8e5m2}) {
    Problem p = cpu_forward(24, 96, qf, rng);
    const Case& c = p.c;
    const float max_finite = fp8_norm::fp8_max(qf == DType::f8e4m3);
    auto rstd = p.rstd.values();
    const float amax = amax_from_rstd(p, rstd);
    EXPECT_EQ(fp8_norm::tensor_scale(amax, max_finite), static_cast<float>(p.y_scale.values()[0]));
    // Nudge the max row's rstd up an ulp at a time: within a few steps some nudge keeps y_scale
    // and changes the multiplier.
    std::int64_t max_row = 0;  // the row whose max |y| is amax
    float row_max = -1.0f;
    for (std::int64_t r = 0; r < c.rows; ++r) {
      std::vector<double> only(rstd.size(), 0.0);
      only[r] = rstd[r];
      const float m = amax_from_rstd(p, only);
      if (m > row_max) row_max = m, max_row = r;
    }
    ASSERT_EQ(row_max, amax);
    // Collisions happen where amax / fp8_max has a smaller exponent step than amax (fp8_max is
    // 7 * 2^k: maxima with a significand of 1.75 or more): raise the max there first.
    double target = 1.8 * std::exp2(std::floor(std::log2(amax)));
    if (target < amax) target *= 2.0;
    rstd[max_row] = static_cast<float>(rstd[max_row] * (target / amax));
    bool found = false;
    float prev = amax_from_rstd(p, rstd);
    for (int step = 0; step < 4096 && !found; ++step) {
      rstd[max_row] = std::nextafter(static_cast<float>(rstd[max_row]), 1e30f);
      const float next = amax_from_rstd(p, rstd);
      found = next != prev && fp8_norm::tensor_scale(next, max_finite) == fp8_norm::tensor_scale(prev, max_finite) &&
              fp8_norm::quant_multiplier(next, max_finite) != fp8_norm::quant_multiplier(prev, max_finite);
      prev = next;
    }
    EXPECT_TRUE(found) << "no rstd nudge kept y_scale and moved the multiplier";
  }
}

TEST(Fp8NormCpu, TransposeEqualsRowMajorOutput) {
  auto rng = testing::make_rng(603);
  Case c;
  c.rows = 45;
  c.cols = 80;
  c.qy_pad = 3;
  c.qyt_pad = 5;
  Problem p(c, Device::cpu());
  fill_inputs(p, rng);
  p.forward();
  EXPECT_TRUE(transpose_consistent(element_bits(p.qy, c.rows, c.cols, c.cols + c.qy_pad),
                                   element_bits(p.qy_t, c.cols, c.rows, c.rows + c.qyt_pad), c.rows, c.cols));
}

// The conversion rule the reference (and, by bit-exact comparison, the kernels) follows.
TEST(Fp8NormCpu, Fp8ConversionRoundsToNearestEvenAndSaturates) {
  using detail::round_to;
  // e4m3: 448 is the largest finite value; beyond it saturates (no inf, no NaN).
  EXPECT_EQ(round_to(DType::f8e4m3, 1e9), 448.0);
  EXPECT_EQ(round_to(DType::f8e4m3, -1e9), -448.0);
  EXPECT_EQ(round_to(DType::f8e4m3, 470.0), 448.0);
  EXPECT_EQ(round_to(DType::f8e5m2, 1e9), 57344.0);
  EXPECT_EQ(round_to(DType::f8e5m2, -7e4), -57344.0);
  // Ties to even: 17 lies halfway between 16 and 18 (e4m3 spacing 2 in [16, 32)) -> 16;
  // 19 between 18 and 20 -> 20.
  EXPECT_EQ(round_to(DType::f8e4m3, 17.0), 16.0);
  EXPECT_EQ(round_to(DType::f8e4m3, 19.0), 20.0);
  // e5m2 spacing 0.25 in [1, 2): 1.125 -> 1.0, 1.375 -> 1.5.
  EXPECT_EQ(round_to(DType::f8e5m2, 1.125), 1.0);
  EXPECT_EQ(round_to(DType::f8e5m2, 1.375), 1.5);
  // Subnormals: e4m3's smallest is 2^-9; half of it rounds to zero (even), 0.75 of it up.
  EXPECT_EQ(round_to(DType::f8e4m3, std::ldexp(1.0, -10)), 0.0);
  EXPECT_EQ(round_to(DType::f8e4m3, 0.75 * std::ldexp(1.0, -9)), std::ldexp(1.0, -9));
}

TEST(Fp8NormCpu, AllZeroInputAndZeroRowsAreSafe) {
  auto rng = testing::make_rng(604);
  Case c;
  c.rows = 8;
  c.cols = 48;
  Problem p(c, Device::cpu());
  fill_inputs(p, rng);
  p.x.set_values(std::vector<double>(c.rows * c.cols, 0.0));
  p.forward();
  EXPECT_EQ(p.y_scale.values()[0], static_cast<double>(kFp8NormAmaxFloor / 448.0f));
  for (double q : p.qy.values()) ASSERT_EQ(q, 0.0);
  for (double q : p.qy_t.values()) ASSERT_EQ(q, 0.0);
  for (double r : p.rstd.values()) EXPECT_FLOAT_EQ(r, 1.0 / std::sqrt(c.eps));
  p.backward();
  for (double v : p.dx.values()) ASSERT_TRUE(std::isfinite(v));

  // Zero rows among ordinary rows: exactly zero outputs there, ordinary ones elsewhere.
  fill_inputs(p, rng, FillOptions{false});
  auto xv = p.x.values();
  for (std::int64_t k = 0; k < c.cols; ++k) xv[3 * c.cols + k] = 0.0;
  p.x.set_values(xv);
  p.forward();
  const auto q = p.qy.values();
  for (std::int64_t k = 0; k < c.cols; ++k) EXPECT_EQ(q[3 * c.cols + k], 0.0);
  double others = 0;
  for (std::int64_t k = 0; k < c.cols; ++k) others += std::abs(q[4 * c.cols + k]);
  EXPECT_GT(others, 0.0);
}

TEST(Fp8NormCpu, HugeTinyAndFlooredTensors) {
  auto rng = testing::make_rng(605);
  struct Variant {
    const char* name;
    double magnitude;
    float eps;
    double weight_mean, weight_std;
  };
  // Huge and tiny dequantized inputs (normalization brings y back to O(1)); a tiny eps so that
  // 1e-12-sized rows are still normalized; and weights so small that amax falls under the floor.
  for (const Variant v : {Variant{"huge", 1e30, 1e-5f, 1.0, 0.5}, Variant{"tiny", 1e-12, 1e-30f, 1.0, 0.5},
                          Variant{"tiny, eps dominates", 1e-20, 1e-5f, 1.0, 0.5},
                          Variant{"below floor", 1.0, 1e-5f, 1e-33, 1e-34}}) {
    SCOPED_TRACE(v.name);
    Case c;
    c.rows = 16;
    c.cols = 64;
    c.eps = v.eps;
    c.scale_dtype = DType::f32;
    c.weight_dtype = DType::f32;
    Problem p(c, Device::cpu());
    fill_inputs(p, rng, FillOptions{false, v.magnitude, v.weight_mean, v.weight_std});
    p.forward();
    const double s = p.y_scale.values()[0];
    ASSERT_TRUE(std::isfinite(s) && s > 0);
    const DequantCheck d = check_dequantized(p.qy.values(), s, rms_norm_f64(p), c.q_dtype);
    EXPECT_EQ(d.violations, 0) << d.str();
    if (std::string(v.name) == "below floor") EXPECT_EQ(s, static_cast<double>(kFp8NormAmaxFloor / 448.0f));
  }
}

TEST(Fp8NormCpu, LeadingDimensionsFlattenIntoRows) {
  auto rng = testing::make_rng(606);
  Case c;
  c.rows = 12;
  c.cols = 32;
  Problem p(c, Device::cpu());
  fill_inputs(p, rng);
  p.forward();
  // The same data seen as (3, 4, 32) with scales (3, 4, 2).
  Buffer qy3(c.q_dtype, Device::cpu(), {3, 4, 32}), qyt(c.q_dtype, Device::cpu(), {32, 12}),
      s(DType::f32, Device::cpu(), {1}), rstd(DType::f32, Device::cpu(), {3, 4});
  TensorView x3 = p.x.view(), sc3 = p.scales.view();
  x3 = TensorView(x3.data, x3.dtype, x3.device, {3, 4, 32});
  sc3 = TensorView(sc3.data, sc3.dtype, sc3.device, {3, 4, 2});
  fp8_rms_norm_forward(x3, sc3, p.weight.view(), c.eps, qy3.view(), qyt.view(), s.view(), rstd.view(),
                       std::nullopt, std::nullopt);
  EXPECT_EQ(qy3.values(), p.qy.values());
  EXPECT_EQ(qyt.values(), p.qy_t.values());
  EXPECT_EQ(rstd.values(), p.rstd.values());
}

// dx and dweight are the gradients of sum(y * dy) with respect to the dequantized input and the
// weight: checked against central differences of an independent float64 RMSNorm.
TEST(Fp8NormCpu, BackwardMatchesFiniteDifferences) {
  auto rng = testing::make_rng(607);
  for (DType wf : {DType::f32, DType::bf16}) {
    Case c;
    c.rows = 5;
    c.cols = 48;
    c.weight_dtype = wf;
    c.eps = 1e-3f;
    SCOPED_TRACE(c.str());
    Problem p(c, Device::cpu());
    fill_inputs(p, rng, FillOptions{false});
    p.forward();
    p.backward();
    const FiniteDifferences fd = finite_differences(p, 1);
    const auto dx = p.dx.values(), dw = p.dweight.values();
    std::vector<double> dx_at;
    for (auto i : fd.x_index) dx_at.push_back(dx[i]);
    // dx is stored in bf16, dweight in the weight's dtype: the bar is their rounding.
    EXPECT_TRUE(close_to_reference(dx_at, fd.dx, DType::bf16, "dx vs finite differences"));
    EXPECT_TRUE(close_to_reference(dw, fd.dw, wf, "dweight vs finite differences"));
  }
}

// Cross-check with the bf16/f32 norm family on the dequantized input: rstd bit-identical (same
// float64 formula on the same exact values), y and the gradients within rounding.
TEST(Fp8NormCpu, AgreesWithRmsNormOnDequantizedInput) {
  auto rng = testing::make_rng(608);
  Case c;
  c.rows = 64;
  c.cols = 256;
  c.weight_dtype = DType::f32;
  Problem p(c, Device::cpu());
  fill_inputs(p, rng);
  p.forward();
  p.backward();
  const auto xv = p.x.values(), sv = p.scales.values();
  std::vector<double> xd(c.rows * c.cols);
  for (std::int64_t r = 0; r < c.rows; ++r)
    for (std::int64_t k = 0; k < c.cols; ++k) xd[r * c.cols + k] = xv[r * c.cols + k] * sv[r * c.groups() + k / c.group];
  Buffer x32(DType::f32, Device::cpu(), {c.rows, c.cols}), y32(DType::f32, Device::cpu(), {c.rows, c.cols}),
      dy32(DType::f32, Device::cpu(), {c.rows, c.cols}), dx32(DType::f32, Device::cpu(), {c.rows, c.cols}),
      dw32(DType::f32, Device::cpu(), {c.cols}), rstd(DType::f32, Device::cpu(), {c.rows});
  x32.set_values(xd);  // exact: bf16 scale times an fp8 value fits in float32
  dy32.set_values(p.dy.values());
  rms_norm_forward(x32.view(), p.weight.view(), c.eps, y32.view(), rstd.view());
  rms_norm_backward(dy32.view(), x32.view(), p.weight.view(), rstd.view(), dx32.view(), dw32.view(), std::nullopt);
  EXPECT_EQ(rstd.values(), p.rstd.values());
  EXPECT_TRUE(close_to_reference(p.y->values(), y32.values(), DType::bf16, "y vs rms_norm"));
  EXPECT_TRUE(close_to_reference(p.dx.values(), dx32.values(), DType::bf16, "dx vs rms_norm_backward"));
  EXPECT_TRUE(close_to_reference(p.dweight.values(), dw32.values(), DType::f32, "dweight vs rms_norm_backward"));
}

// ---- argument errors (CPU tensors: the checks run before any backend) ---------------------------

#define EXPECT_ERROR(call, text) \
  EXPECT_NE(error_of([&] { call; }).find(text), std::string::npos) << error_of([&] { call; })

TEST(Fp8NormErrors, EachBadForwardArgumentIsNamed) {
  const Device cpu = Device::cpu();
  const std::int64_t M = 4, N = 32;
  std::vector<std::uint8_t> xb(M * N * 4), qb(M * N * 4), tb(M * N * 4);
  std::vector<float> sb(M * N), wb(N), stat(M + 8), ys(4);
  TensorView x(xb.data(), DType::f8e4m3, cpu, {M, N});
  TensorView sc(sb.data(), DType::bf16, cpu, {M, N / 16});
  TensorView w(wb.data(), DType::bf16, cpu, {N});
  TensorView qy(qb.data(), DType::f8e4m3, cpu, {M, N});
  TensorView qt(tb.data(), DType::f8e4m3, cpu, {N, M});
  TensorView s(ys.data(), DType::f32, cpu, {1});
  TensorView rstd(stat.data(), DType::f32, cpu, {M});
  auto fwd = [&](const TensorView& x_, const TensorView& sc_, const TensorView& w_, float eps,
                 const TensorView& qy_, const TensorView& qt_, const TensorView& s_, const TensorView& r_,
                 const OptionalTensor& y_ = std::nullopt, int group = 16) {
    fp8_rms_norm_forward(x_, sc_, w_, eps, qy_, qt_, s_, r_, y_, std::nullopt, group);
  };
  // The valid call goes through.
  EXPECT_EQ(error_of([&] { fwd(x, sc, w, 1e-5f, qy, qt, s, rstd); }), "no error");

  // N not a multiple of the group size.
  TensorView x40(xb.data(), DType::f8e4m3, cpu, {M, 40}), qy40(qb.data(), DType::f8e4m3, cpu, {M, 40});
  EXPECT_EQ(error_of([&] { fwd(x40, sc, w, 1e-5f, qy40, qt, s, rstd); }),
            "fusekit.fp8_rms_norm_forward: argument 'x': expected a last dimension N that is a multiple of "
            "group_size = 16, got N = 40");
  EXPECT_ERROR(fwd(x, sc, w, 1e-5f, qy, qt, s, rstd, std::nullopt, 64), "multiple of group_size = 64, got N = 32");
  // Group size not a power of two, or not positive.
  EXPECT_ERROR(fwd(x, sc, w, 1e-5f, qy, qt, s, rstd, std::nullopt, 24), "argument 'group_size': expected a power of two >= 1, got 24");
  EXPECT_ERROR(fwd(x, sc, w, 1e-5f, qy, qt, s, rstd, std::nullopt, 0), "argument 'group_size'");
  // Scales of the wrong shape: too many groups, too few rows, group size 8 expects (4, 4).
  TensorView sc_cols(sb.data(), DType::bf16, cpu, {M, 3});
  EXPECT_ERROR(fwd(x, sc_cols, w, 1e-5f, qy, qt, s, rstd),
               "argument 'x_scales': expected M x (N / group_size) = 4 x 2 values (x is (4, 32), group_size 16), got shape (4, 3)");
  TensorView sc_rows(sb.data(), DType::bf16, cpu, {M - 1, 2});
  EXPECT_ERROR(fwd(x, sc_rows, w, 1e-5f, qy, qt, s, rstd), "argument 'x_scales': expected M x (N / group_size) = 4 x 2");
  EXPECT_ERROR(fwd(x, sc, w, 1e-5f, qy, qt, s, rstd, std::nullopt, 8), "argument 'x_scales': expected M x (N / group_size) = 4 x 4");
  // Scales with a non-contiguous last dimension.
  TensorView sc_strided(sb.data(), DType::bf16, cpu, {M, 2}, {4, 2});
  EXPECT_ERROR(fwd(x, sc_strided, w, 1e-5f, qy, qt, s, rstd), "argument 'x_scales': expected a contiguous last dimension");
  // Scales of the wrong dtype.
  TensorView sc16(sb.data(), DType::f16, cpu, {M, 2});
  EXPECT_ERROR(fwd(x, sc16, w, 1e-5f, qy, qt, s, rstd), "argument 'x_scales': expected dtype bf16 or f32, got f16");
  TensorView sc8(sb.data(), DType::f8e4m3, cpu, {M, 2});
  EXPECT_ERROR(fwd(x, sc8, w, 1e-5f, qy, qt, s, rstd), "argument 'x_scales': expected dtype bf16 or f32, got f8e4m3");
  // Input format not an fp8 format fusekit supports.
  for (DType bad : {DType::bf16, DType::u8, DType::f16, DType::f32}) {
    TensorView xb16(xb.data(), bad, cpu, {M, N});
    EXPECT_ERROR(fwd(xb16, sc, w, 1e-5f, qy, qt, s, rstd),
                 std::string("argument 'x': expected dtype f8e4m3 or f8e5m2, got ") + dtype_name(bad));
  }
  // Output format likewise; qy_t must match qy.
  TensorView qy_bf(qb.data(), DType::bf16, cpu, {M, N});
  EXPECT_ERROR(fwd(x, sc, w, 1e-5f, qy_bf, qt, s, rstd), "argument 'qy': expected dtype f8e4m3 or f8e5m2, got bf16");
  TensorView qt52(tb.data(), DType::f8e5m2, cpu, {N, M});
  EXPECT_ERROR(fwd(x, sc, w, 1e-5f, qy, qt52, s, rstd), "argument 'qy_t': expected dtype f8e4m3 (as 'qy'), got f8e5m2");
  // qy_t not transposed, or with a short row stride.
  TensorView qt_wrong(tb.data(), DType::f8e4m3, cpu, {M, N});
  EXPECT_ERROR(fwd(x, sc, w, 1e-5f, qy, qt_wrong, s, rstd), "argument 'qy_t': expected shape (32, 4) (N, M): qy transposed, got (4, 32)");
  TensorView qt_overlap(tb.data(), DType::f8e4m3, cpu, {N, M}, {2, 1});
  EXPECT_ERROR(fwd(x, sc, w, 1e-5f, qy, qt_overlap, s, rstd), "argument 'qy_t': expected a row stride of at least N = 4");
  // qy of the wrong shape.
  TensorView qy_short(qb.data(), DType::f8e4m3, cpu, {M, 16});
  EXPECT_ERROR(fwd(x, sc, w, 1e-5f, qy_short, qt, s, rstd), "argument 'qy': expected shape (4, 32) (as 'x'), got (4, 16)");
  // y_scale: float32, one element.
  TensorView s16(ys.data(), DType::bf16, cpu, {1}), s2(ys.data(), DType::f32, cpu, {2});
  EXPECT_ERROR(fwd(x, sc, w, 1e-5f, qy, qt, s16, rstd), "argument 'y_scale': expected dtype f32");
  EXPECT_ERROR(fwd(x, sc, w, 1e-5f, qy, qt, s2, rstd), "argument 'y_scale': expected 1 elements, got 2");
  // rstd: M float32 values.
  TensorView rstd_long(stat.data(), DType::f32, cpu, {M + 1});
  EXPECT_ERROR(fwd(x, sc, w, 1e-5f, qy, qt, s, rstd_long), "argument 'rstd': expected 4 elements, got 5");
  // weight: bf16 or f32, length N.
  TensorView w16(wb.data(), DType::f16, cpu, {N}), w_short(wb.data(), DType::bf16, cpu, {N - 1});
  EXPECT_ERROR(fwd(x, sc, w16, 1e-5f, qy, qt, s, rstd), "argument 'weight': expected dtype bf16 or f32, got f16");
  EXPECT_ERROR(fwd(x, sc, w_short, 1e-5f, qy, qt, s, rstd), "argument 'weight': expected shape (32), got (31)");
  // y: bf16 like x.
  TensorView y32(wb.data(), DType::f32, cpu, {M, N});
  EXPECT_ERROR(fwd(x, sc, w, 1e-5f, qy, qt, s, rstd, y32), "argument 'y': expected dtype bf16");
  // eps must be positive.
  EXPECT_ERROR(fwd(x, sc, w, 0.0f, qy, qt, s, rstd), "argument 'eps': expected a positive finite number");
  EXPECT_ERROR(fwd(x, sc, w, std::nanf(""), qy, qt, s, rstd), "argument 'eps'");
  // Device mix.
  TensorView s_gpu(ys.data(), DType::f32, Device::cuda(0), {1});
  EXPECT_ERROR(fwd(x, sc, w, 1e-5f, qy, qt, s_gpu, rstd),
               "argument 'y_scale': expected a tensor on cpu (where 'x' is), got a tensor on cuda:0");
  // Null data.
  TensorView x_null(nullptr, DType::f8e4m3, cpu, {M, N});
  EXPECT_ERROR(fwd(x_null, sc, w, 1e-5f, qy, qt, s, rstd), "argument 'x': expected a non-null data pointer");
  // N past the limit.
  TensorView x_huge(xb.data(), DType::f8e4m3, cpu, {1, kFp8NormMaxCols + 16});
  EXPECT_ERROR(fwd(x_huge, sc, w, 1e-5f, qy, qt, s, rstd), "expected a last dimension N in 1..65536");
}

TEST(Fp8NormErrors, EachBadBackwardArgumentIsNamed) {
  const Device cpu = Device::cpu();
  const std::int64_t M = 4, N = 32;
  std::vector<std::uint8_t> xb(M * N);
  std::vector<float> sb(M * N), wb(N), stat(M), dyb(M * N), dxb(M * N), dwb(N);
  TensorView x(xb.data(), DType::f8e5m2, cpu, {M, N});
  TensorView sc(sb.data(), DType::f32, cpu, {M, N / 16});
  TensorView w(wb.data(), DType::f32, cpu, {N});
  TensorView rstd(stat.data(), DType::f32, cpu, {M});
  TensorView dy(dyb.data(), DType::bf16, cpu, {M, N});
  TensorView dx(dxb.data(), DType::bf16, cpu, {M, N});
  TensorView dw(dwb.data(), DType::f32, cpu, {N});
  auto bwd = [&](const TensorView& dy_, const TensorView& x_, const TensorView& sc_, const TensorView& w_,
                 const TensorView& r_, const OptionalTensor& dx_, const OptionalTensor& dw_, int group = 16) {
    fp8_rms_norm_backward(dy_, x_, sc_, w_, r_, dx_, dw_, std::nullopt, group);
  };
  std::vector<std::uint8_t> zeros(M * N, 0);
  std::memcpy(xb.data(), zeros.data(), zeros.size());
  std::fill(stat.begin(), stat.end(), 1.0f);
  EXPECT_EQ(error_of([&] { bwd(dy, x, sc, w, rstd, dx, dw); }), "no error");

  TensorView dy32(dyb.data(), DType::f32, cpu, {M, N});
  EXPECT_ERROR(bwd(dy32, x, sc, w, rstd, dx, dw), "argument 'dy': expected dtype bf16 (the gradients are bf16), got f32");
  TensorView x_short(xb.data(), DType::f8e5m2, cpu, {M - 1, N});
  EXPECT_ERROR(bwd(dy, x_short, sc, w, rstd, dx, dw), "argument 'x': expected shape (4, 32) (as 'dy'), got (3, 32)");
  TensorView x_bf(xb.data(), DType::bf16, cpu, {M, N});
  EXPECT_ERROR(bwd(dy, x_bf, sc, w, rstd, dx, dw), "argument 'x': expected dtype f8e4m3 or f8e5m2, got bf16");
  EXPECT_ERROR(bwd(dy, x, sc, w, rstd, dx, dw, 12), "argument 'group_size'");
  TensorView dy40(dyb.data(), DType::bf16, cpu, {M, 40}), x40(xb.data(), DType::f8e5m2, cpu, {M, 40});
  EXPECT_ERROR(bwd(dy40, x40, sc, w, rstd, std::nullopt, std::nullopt), "multiple of group_size = 16, got N = 40");
  TensorView sc_bad(sb.data(), DType::f32, cpu, {M, 4});
  EXPECT_ERROR(bwd(dy, x, sc_bad, w, rstd, dx, dw), "argument 'x_scales': expected M x (N / group_size) = 4 x 2");
  TensorView sc_u8(sb.data(), DType::u8, cpu, {M, 2});
  EXPECT_ERROR(bwd(dy, x, sc_u8, w, rstd, dx, dw), "argument 'x_scales': expected dtype bf16 or f32, got u8");
  TensorView dw16(dwb.data(), DType::bf16, cpu, {N});
  EXPECT_ERROR(bwd(dy, x, sc, w, rstd, dx, dw16), "argument 'dweight': expected dtype f32 (as 'weight'), got bf16");
  TensorView dx_bad(dxb.data(), DType::bf16, cpu, {M, N - 16});
  EXPECT_ERROR(bwd(dy, x, sc, w, rstd, dx_bad, dw), "argument 'dx': expected shape (4, 32) (as 'dy')");
  TensorView dx32(dxb.data(), DType::f32, cpu, {M, N});
  EXPECT_ERROR(bwd(dy, x, sc, w, rstd, dx32, dw), "argument 'dx': expected dtype bf16");
  TensorView rstd_short(stat.data(), DType::f32, cpu, {M - 1});
  EXPECT_ERROR(bwd(dy, x, sc, w, rstd_short, dx, dw), "argument 'rstd': expected 4 elements, got 3");
}

// ---- GPU -------------------------------------------------------------------------------------

// One case on both devices: the forward's quantized outputs bit-exact up to counted one-ulp
// differences, the backward within twice the bf16 rounding baseline. Accumulates the one-ulp
// counts so that the caller can bound their rate over the whole grid.
void check_gpu_against_cpu(const Case& c, std::uint64_t salt, CodeDiff* qy_total, CodeDiff* y_total,
                           std::int64_t* rstd_mismatches, const FillOptions& fill = {}) {
  SCOPED_TRACE(c.str());
  auto rng = testing::make_rng(salt);
  Problem cpu(c, Device::cpu()), gpu(c, Device::cuda(0));
  fill_inputs(cpu, rng, fill);
  copy_inputs(cpu, gpu);
  const ForwardComparison f = compare_forward(cpu, gpu);
  EXPECT_TRUE(f.qy.ok(1)) << "qy: " << f.qy.str();
  EXPECT_TRUE(f.qy_t.ok(1)) << "qy_t: " << f.qy_t.str();
  EXPECT_TRUE(f.transpose_ok) << "the GPU's qy_t is not its qy transposed";
  // rstd: the GPU's float32 partial sums of squares allow a few ulps (fp8_norm.h).
  EXPECT_TRUE(f.rstd.ok(4)) << "rstd: " << f.rstd.str();
  EXPECT_TRUE(f.scale.ok(4)) << "y_scale: " << f.scale.str();
  if (c.with_y) EXPECT_TRUE(f.y.ok(1)) << "y: " << f.y.str();
  // Everything downstream of rstd is the same float32 arithmetic: bit-identical where rstd is.
  EXPECT_EQ(f.qy_diff_in_exact_rows, 0) << "qy differs in rows whose rstd agrees";
  EXPECT_EQ(f.y_diff_in_exact_rows, 0) << "y differs in rows whose rstd agrees";
  EXPECT_EQ(f.dequant.violations, 0) << f.dequant.str();
  // A scale off by an ulp would move every element; it only can when some row's rstd is.
  if (f.rstd.mismatches == 0) EXPECT_EQ(f.scale.mismatches, 0);
  if (qy_total) *qy_total += f.qy;
  if (y_total) *y_total += f.y;
  if (rstd_mismatches) *rstd_mismatches += f.rstd.mismatches;

  // Backward from the same saved rstd on both sides.
  gpu.rstd.set_values(cpu.rstd.values());
  cpu.backward();
  gpu.dx.poison();
  gpu.dweight.poison();
  gpu.backward();
  EXPECT_TRUE(close_to_reference(gpu.dx.values(), cpu.dx.values(), DType::bf16, "dx", dx_term_norm(cpu)));
  const auto dw_ref = cpu.dweight.values();
  EXPECT_TRUE(testing::reduction_close(gpu.dweight.values(), dw_ref, c.weight_dtype,
                                       f32_column_sum_error(dweight_terms(cpu), c.rows, c.cols, dw_ref),
                                       "dweight"));
}

// A case of rows x cols without y, the other fields at their defaults and then `tweak` applied.
template <typename Tweak>
Case no_y_case(std::int64_t rows, std::int64_t cols, Tweak&& tweak) {
  Case c;
  c.rows = rows;
  c.cols = cols;
  c.with_y = false;
  tweak(c);
  return c;
}
void keep_defaults(Case&) {}

// The bar on quantized outputs: at most 1 in 10^5 elements one ulp off.
void expect_rare(const CodeDiff& d, const char* what) {
  EXPECT_LE(static_cast<double>(d.mismatches), 1e-5 * static_cast<double>(d.count)) << what << ": " << d.str();
  std::printf("[fp8_norm] %s: %s\n", what, d.str().c_str());
}

TEST(Fp8NormGpu, RandomizedGridMatchesCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(700);
  const std::int64_t rows_choices[] = {1, 2, 3, 17, 64, 129, 333, 1024, 2500};
  const int group_choices[] = {1, 2, 8, 16, 16, 16, 32, 64, 128};
  const DType fp8s[] = {DType::f8e4m3, DType::f8e5m2};
  const DType reals[] = {DType::bf16, DType::f32};
  CodeDiff qy_total, y_total;
  std::int64_t rstd_mismatches = 0;
  int cases = 0;
  for (int rep = 0; rep < 48; ++rep) {
    Case c;
    c.group = group_choices[rng() % 9];
    // N: from the group size itself (one group per row) up to 16384, sometimes odd multiples.
    const std::int64_t multiples[] = {1, 2, 3, 5, 8, 16, 31, 64, 128, 256};
    c.cols = c.group * multiples[rng() % 10];
    while (c.cols > 16384) c.cols /= 2;
    if (c.cols % c.group != 0) c.cols = c.group;
    c.rows = rows_choices[rng() % 9];
    if (c.cols >= 4096) c.rows = std::min<std::int64_t>(c.rows, 333);
    c.x_dtype = fp8s[rng() % 2];
    c.q_dtype = fp8s[rng() % 2];
    c.scale_dtype = reals[rng() % 2];
    c.weight_dtype = reals[rng() % 2];
    c.with_y = rng() % 2;
    if (rng() % 4 == 0) {  // padded rows: misaligned ones force the generic kernels
      c.x_pad = 16 * (rng() % 3) + (rng() % 2);
      c.scale_pad = rng() % 3;
      c.qy_pad = 16 * (rng() % 2) + (rng() % 2) * 3;
      c.qyt_pad = 16 * (rng() % 2) + (rng() % 2) * 5;
      c.y_pad = 8 * (rng() % 2);
      c.dy_pad = 8 * (rng() % 2) + (rng() % 2);
      c.dx_pad = 8 * (rng() % 2);
    }
    check_gpu_against_cpu(c, 7000 + cases, &qy_total, &y_total, &rstd_mismatches);
    ++cases;
  }
  // N at the limit, and the largest vector-path backward row.
  for (std::int64_t cols : {std::int64_t(16384), std::int64_t(16400), kFp8NormMaxCols}) {
    Case c;
    c.cols = cols;
    c.rows = 40;
    check_gpu_against_cpu(c, 7000 + cases++, &qy_total, &y_total, &rstd_mismatches);
  }
  std::printf("[fp8_norm] rstd differing by one ulp in %lld rows\n", static_cast<long long>(rstd_mismatches));
  expect_rare(qy_total, "qy one-ulp differences over the grid");
  expect_rare(y_total, "y one-ulp differences over the grid");
}

TEST(Fp8NormGpu, HugeTinyAndFlooredTensorsMatchCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  struct Variant {
    FillOptions fill;
    float eps;
  };
  int salt = 0;
  // Huge, tiny (normalized: eps below the mean square), tiny with eps dominating, the default mix
  // of special rows, and weights so small that amax falls under the floor.
  for (const Variant& v : {Variant{{false, 1e30}, 1e-5f}, Variant{{false, 1e-12}, 1e-30f},
                           Variant{{false, 1e-20}, 1e-5f}, Variant{{true, 1.0}, 1e-5f},
                           Variant{{false, 1.0, 1e-33, 1e-34}, 1e-5f}}) {
    for (DType sf : {DType::bf16, DType::f32}) {
      for (DType wf : {DType::bf16, DType::f32}) {
        // 300 rows with y: the quantize kernel's general path (a partial tile row); 256 rows
        // without y: its whole-tile path.
        for (bool whole_tiles : {false, true}) {
          Case c;
          c.rows = whole_tiles ? 256 : 300;
          c.cols = 1024;
          c.with_y = !whole_tiles;
          c.scale_dtype = sf;
          c.weight_dtype = wf;
          c.eps = v.eps;
          check_gpu_against_cpu(c, 7500 + salt++, nullptr, nullptr, nullptr, v.fill);
        }
      }
    }
  }
}

TEST(Fp8NormGpu, BenchmarkShapesMatchCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{16384, 4096}, {8192, 8192}, {32768, 2048}};
  CodeDiff qy_total, y_total;
  std::int64_t rstd_mismatches = 0;
  int salt = 0;
  for (auto [rows, cols] : shapes) {
    Case c;
    c.rows = rows;
    c.cols = cols;
    c.with_y = false;
    check_gpu_against_cpu(c, 7800 + salt++, &qy_total, nullptr, &rstd_mismatches);
  }
  std::printf("[fp8_norm] rstd differing by one ulp in %lld rows\n", static_cast<long long>(rstd_mismatches));
  expect_rare(qy_total, "qy one-ulp differences on the benchmark shapes");
}

// Forces one statistics kernel for the scope of a test, and sets (or clears) the bulk kernel's
// ring shape (override keys, read on every call).
struct StatsScope {
  StatsScope(fp8_norm::StatsDesign stats, const char* rounds = nullptr, const char* slots = nullptr) {
    fp8_norm::set_stats_design_override(stats);
    detail::set_override("fp8_norm.stats.chunk_rounds", rounds ? rounds : "");
    detail::set_override("fp8_norm.stats.ring_slots", slots ? slots : "");
  }
  ~StatsScope() {
    fp8_norm::set_stats_design_override(fp8_norm::StatsDesign::automatic);
    detail::set_override("fp8_norm.stats.chunk_rounds", "");
    detail::set_override("fp8_norm.stats.ring_slots", "");
  }
};

// The bulk-copy statistics kernel adds the same vectors in the same order as the register kernel
// with one warp per row, so the whole forward must come out bitwise equal, and both must match
// the CPU reference. Cases: one and several chunks per row, chunks of 1, 2 and 4 rounds, ring
// depths of 2 to 8 slots with many chunks per warp (the slots and barrier phases wrap many
// times), row counts that leave warps idle, every scale layout it takes (bf16 groups of 16 to
// 256, f32 groups of 32 and 512: 16 to 256 bytes of scales per round), e5m2, f32 weights, padded
// rows, special rows, and a tensor larger than the L2 share kept evict-last (both copy policies).
TEST(Fp8NormGpu, BulkStatisticsMatchRegisterKernelBitwise) {
  FUSEKIT_REQUIRE_GPU();
  using fp8_norm::StatsDesign;
  struct Variant {
    Case c;
    const char* rounds;
    const char* slots;
  };
  std::vector<Variant> variants;
  auto add = [&](std::int64_t rows, std::int64_t cols, const char* rounds, const char* slots, auto&& tweak) {
    variants.push_back({no_y_case(rows, cols, tweak), rounds, slots});
  };
  auto plain = keep_defaults;
  add(64, 2048, nullptr, nullptr, plain);        // one round per row, the default 2 slots
  add(3001, 2048, "1", "3", plain);              // ~3 rows per warp, 3 slots
  add(2500, 2048, "1", "8", plain);              // 8 slots
  add(203, 4096, nullptr, nullptr, [](Case& c) {  // chunks of 2 rounds, 2 slots
    c.weight_dtype = DType::f32;
    c.x_dtype = DType::f8e5m2;
  });
  add(301, 8192, "2", "3", [](Case& c) {  // 2 chunks per row
    c.group = 32;
    c.scale_dtype = DType::f32;
  });
  add(77, 8192, "4", "2", [](Case& c) { c.group = 64; });
  add(130, 8192, nullptr, nullptr, plain);  // rows of 4 rounds by default: 1-round chunks in 3 slots
  add(19, 16384, nullptr, nullptr, [](Case& c) {  // the longest rows, 16 bytes of scales per round
    c.group = 256;
    c.q_dtype = DType::f8e5m2;
  });
  add(40, 4096, "1", nullptr, [](Case& c) {  // 256 bytes of scales per round
    c.group = 512;
    c.scale_dtype = DType::f32;
  });
  add(150, 4096, nullptr, nullptr, [](Case& c) {  // padded rows (scale rows stay 16-byte multiples)
    c.x_pad = 32;
    c.scale_pad = 8;
    c.qy_pad = 16;
    c.qyt_pad = 48;
    c.with_y = true;
  });
  add(16384, 2048, nullptr, nullptr, plain);  // 32 MB of x: rows copied evict-first and evict-last
  int salt = 0;
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.c.str() + ", rounds " + (v.rounds ? v.rounds : "-") + ", slots " + (v.slots ? v.slots : "-"));
    auto rng = testing::make_rng(8100 + salt++);
    Problem reg(v.c, Device::cuda(0)), bulk(v.c, Device::cuda(0));
    fill_inputs(reg, rng);
    copy_inputs(reg, bulk);
    {
      StatsScope scope(StatsDesign::registers);
      reg.poison_outputs();
      reg.forward();
      EXPECT_EQ(fp8_norm::last_stats_design(), StatsDesign::registers);
    }
    {
      StatsScope scope(StatsDesign::bulk, v.rounds, v.slots);
      bulk.poison_outputs();
      bulk.forward();
      EXPECT_EQ(fp8_norm::last_stats_design(), StatsDesign::bulk);
    }
    EXPECT_EQ(reg.rstd.raw_bytes(), bulk.rstd.raw_bytes()) << "rstd";
    EXPECT_EQ(reg.y_scale.raw_bytes(), bulk.y_scale.raw_bytes()) << "y_scale";
    EXPECT_EQ(reg.qy.raw_bytes(), bulk.qy.raw_bytes()) << "qy";
    EXPECT_EQ(reg.qy_t.raw_bytes(), bulk.qy_t.raw_bytes()) << "qy_t";
    if (v.c.with_y) EXPECT_EQ(reg.y->raw_bytes(), bulk.y->raw_bytes()) << "y";
    if (v.c.rows <= 4096) {
      StatsScope scope(StatsDesign::bulk, v.rounds, v.slots);
      check_gpu_against_cpu(v.c, 8100 + salt++, nullptr, nullptr, nullptr);
      EXPECT_EQ(fp8_norm::last_stats_design(), StatsDesign::bulk);
    }
  }
  // Huge, tiny and floored tensors through the bulk kernel, against the CPU reference.
  for (const FillOptions& fill : {FillOptions{false, 1e30}, FillOptions{false, 1e-20}, FillOptions{false, 1.0, 1e-33, 1e-34}}) {
    StatsScope scope(StatsDesign::bulk);
    Case c;
    c.rows = 300;
    c.cols = 4096;
    c.with_y = false;
    check_gpu_against_cpu(c, 8100 + salt++, nullptr, nullptr, nullptr, fill);
    EXPECT_EQ(fp8_norm::last_stats_design(), StatsDesign::bulk);
  }
}

// Which statistics kernel the two-pass forward runs: the bulk one where its contract holds, the
// register one where it does not (N not a multiple of 2048 or over 16384, under 16 bytes of
// scales per round, scale rows not 16-byte multiples) or when forced, the generic one for groups
// under 16. Each call is also checked against the CPU reference.
TEST(Fp8NormGpu, StatsDesignRouting) {
  FUSEKIT_REQUIRE_GPU();
  using fp8_norm::StatsDesign;
  struct Route {
    Case c;
    StatsDesign forced, expected;
  };
  auto make = [](std::int64_t rows, std::int64_t cols, auto&& tweak) { return no_y_case(rows, cols, tweak); };
  auto plain = keep_defaults;
  const Route routes[] = {
      {make(256, 2048, plain), StatsDesign::automatic, StatsDesign::bulk},
      {make(256, 2048, plain), StatsDesign::registers, StatsDesign::registers},
      {make(256, 1024, plain), StatsDesign::bulk, StatsDesign::registers},
      {make(256, 6144, plain), StatsDesign::automatic, StatsDesign::bulk},
      {make(32, 16384 + 2048, plain), StatsDesign::bulk, StatsDesign::registers},
      {make(256, 4096, [](Case& c) { c.group = 512; }), StatsDesign::bulk, StatsDesign::registers},
      {make(256, 4096, [](Case& c) { c.scale_pad = 1; }), StatsDesign::bulk, StatsDesign::registers},
      {make(256, 2048, [](Case& c) { c.group = 8; }), StatsDesign::bulk, StatsDesign::generic},
  };
  int salt = 0;
  for (const Route& r : routes) {
    StatsScope scope(r.forced);
    SCOPED_TRACE(std::string("forced ") + fp8_norm::stats_design_name(r.forced));
    check_gpu_against_cpu(r.c, 8190 + salt++, nullptr, nullptr, nullptr);
    EXPECT_EQ(fp8_norm::last_stats_design(), r.expected) << r.c.str();
  }
}

// Launches whose dynamic shared memory is exactly the default 48 KB: with the kernels' static
// shared memory on top they need the opt-in (without it: cudaErrorInvalidValue). The bulk kernel at N = 2048 with f32 scales in groups of 16
// (8 KB of weights + 8 warps x 2 slots x (2 KB + 512 B) of ring = 48 KB), the register kernel at
// N = 12288 (48 KB of staged weights).
TEST(Fp8NormGpu, StatisticsLaunchesAtTheDefaultSharedMemoryLimit) {
  FUSEKIT_REQUIRE_GPU();
  using fp8_norm::StatsDesign;
  struct Route {
    Case c;
    StatsDesign forced;
  };
  const Route routes[] = {
      {no_y_case(333, 2048, [](Case& c) { c.scale_dtype = DType::f32; }), StatsDesign::bulk},
      {no_y_case(333, 2048, [](Case& c) { c.scale_dtype = DType::f32; }), StatsDesign::automatic},
      {no_y_case(97, 12288, [](Case& c) { c.weight_dtype = DType::f32; }), StatsDesign::registers},
  };
  int salt = 0;
  for (const Route& r : routes) {
    StatsScope scope(r.forced);
    SCOPED_TRACE(std::string("forced ") + fp8_norm::stats_design_name(r.forced));
    check_gpu_against_cpu(r.c, 8290 + salt++, nullptr, nullptr, nullptr);
    EXPECT_EQ(fp8_norm::last_stats_design(),
              r.forced == StatsDesign::automatic ? StatsDesign::bulk : r.forced) << r.c.str();
  }
}

// Forces one backward tuning for the scope of a test.
struct TuningScope {
  explicit TuningScope(fp8_norm::BackwardTuning tuning) { fp8_norm::set_backward_tuning_override(tuning); }
  ~TuningScope() { fp8_norm::set_backward_tuning_override(fp8_norm::BackwardTuning::automatic); }
};

// Both backward tunings on whatever device runs the tests (the automatic choice takes one by the
// device's bandwidth), each against the CPU reference and bitwise stable from run to run. The
// two_runs_streaming tuning's own kernels: rows of 129-256 runs in 2-run, 128-thread groups
// (N = 2048 staged, N = 2048 with padded scale rows, N = 1536 and 1040 with idle run slots, a
// single row, fewer rows than blocks), and the N = 4096 staged kernel with L2 hints (bf16 and f32 scales, e5m2,
// f32 weights, padded rows); its unhinted neighbours (N = 4096 with padded scale rows, N = 8192)
// and the generic kernel (groups of 8) for routing.
TEST(Fp8NormGpu, BackwardTuningsMatchCpuReferenceAndAreDeterministic) {
  FUSEKIT_REQUIRE_GPU();
  using fp8_norm::BackwardTuning;
  const Case cases[] = {
      no_y_case(1000, 2048, keep_defaults),
      no_y_case(613, 2048, [](Case& c) { c.scale_pad = 3; c.dx_pad = 8; }),
      no_y_case(700, 1536, [](Case& c) { c.weight_dtype = DType::f32; }),
      no_y_case(257, 1040, [](Case& c) { c.x_dtype = DType::f8e5m2; }),
      no_y_case(64, 2048, [](Case& c) { c.group = 8; }),
      no_y_case(1, 2048, keep_defaults),
      no_y_case(77, 2048, [](Case& c) { c.scale_dtype = DType::f32; }),
      no_y_case(1100, 4096, keep_defaults),
      no_y_case(515, 4096, [](Case& c) { c.scale_dtype = DType::f32; c.x_dtype = DType::f8e5m2; c.dy_pad = 8; }),
      no_y_case(300, 4096, [](Case& c) { c.weight_dtype = DType::f32; c.x_pad = 16; }),
      no_y_case(300, 4096, [](Case& c) { c.scale_pad = 1; }),
      no_y_case(129, 8192, keep_defaults),
  };
  int salt = 0;
  for (BackwardTuning tuning : {BackwardTuning::four_runs_cached, BackwardTuning::two_runs_streaming}) {
    TuningScope scope(tuning);
    SCOPED_TRACE(fp8_norm::backward_tuning_name(tuning));
    for (const Case& c : cases) {
      check_gpu_against_cpu(c, 8400 + salt++, nullptr, nullptr, nullptr);
      // Groups under 16 take the generic kernel, which has no tunings.
      EXPECT_EQ(fp8_norm::last_backward_tuning(), c.group >= 16 ? tuning : BackwardTuning::automatic) << c.str();
    }
    auto rng = testing::make_rng(8450 + salt++);
    for (std::int64_t cols : {std::int64_t(2048), std::int64_t(4096)}) {
      Case c = no_y_case(3000, cols, keep_defaults);
      SCOPED_TRACE(c.str());
      Problem p(c, Device::cuda(0));
      fill_inputs(p, rng);
      p.forward();
      EXPECT_TRUE(testing::same_bytes_every_run(
          [&] {
            p.dx.poison();
            p.dweight.poison();
            p.backward();
          },
          {&p.dx, &p.dweight}));
    }
  }
}

TEST(Fp8NormGpu, ForwardAndBackwardAreBitwiseDeterministic) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(710);
  for (std::int64_t cols : {std::int64_t(1024), std::int64_t(4096), std::int64_t(16384), std::int64_t(3000)}) {
    Case c;
    c.rows = 4096;
    c.cols = cols;
    c.group = cols == 3000 ? 8 : 16;
    c.weight_dtype = DType::f32;
    SCOPED_TRACE(c.str());
    Problem p(c, Device::cuda(0));
    fill_inputs(p, rng);
    EXPECT_TRUE(testing::same_bytes_every_run(
        [&] {
          p.poison_outputs();
          p.forward();
          p.backward();
        },
        {&p.qy, &p.qy_t, &p.y_scale, &p.rstd, &p.dx, &p.dweight}));
  }
}

TEST(Fp8NormGpu, RowPaddingIsNeverWritten) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(711);
  Case c;
  c.rows = 200;
  c.cols = 512;
  c.qy_pad = 16;
  c.qyt_pad = 48;
  c.y_pad = 8;
  c.dx_pad = 8;
  Problem p(c, Device::cuda(0));
  fill_inputs(p, rng);
  p.poison_outputs();
  p.forward();
  p.backward();
  EXPECT_EQ(testing::poisoned_padding(p.qy, c.rows, c.cols, c.qy_pad), (c.rows - 1) * c.qy_pad);
  EXPECT_EQ(testing::poisoned_padding(p.qy_t, c.cols, c.rows, c.qyt_pad), (c.cols - 1) * c.qyt_pad);
  EXPECT_EQ(testing::poisoned_padding(*p.y, c.rows, c.cols, c.y_pad), (c.rows - 1) * c.y_pad);
  EXPECT_EQ(testing::poisoned_padding(p.dx, c.rows, c.cols, c.dx_pad), (c.rows - 1) * c.dx_pad);
}

// Pointers off 16-byte alignment (every tensor starts `lead` elements past an aligned address)
// with odd row strides: the generic kernels run, match the reference and write nothing before a
// tensor or into its row padding.
TEST(Fp8NormGpu, UnalignedPointersAndOddRowStrides) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(713);
  CodeDiff qy_total, y_total;
  std::int64_t rstd_mismatches = 0;
  int cases = 0;
  for (const std::int64_t cols : {std::int64_t(512), std::int64_t(4096), std::int64_t(1040)}) {
    for (const std::int64_t lead : {1, 3, 8}) {
      Case c;
      c.rows = 37;
      c.cols = cols;
      c.group = cols == 1040 ? 16 : 128;
      c.lead = lead;
      c.x_pad = 3, c.scale_pad = 1, c.qy_pad = 5, c.qyt_pad = 7, c.y_pad = 1, c.dy_pad = 3, c.dx_pad = 1;
      check_gpu_against_cpu(c, 7500 + cases, &qy_total, &y_total, &rstd_mismatches);
      Problem p(c, Device::cuda(0));
      fill_inputs(p, rng);
      p.poison_outputs();
      p.forward();
      p.backward();
      EXPECT_EQ(testing::poisoned_padding(p.qy, c.rows, c.cols, c.qy_pad), (c.rows - 1) * c.qy_pad) << c.str();
      EXPECT_EQ(testing::poisoned_padding(p.qy_t, c.cols, c.rows, c.qyt_pad), (c.cols - 1) * c.qyt_pad) << c.str();
      EXPECT_EQ(testing::poisoned_padding(*p.y, c.rows, c.cols, c.y_pad), (c.rows - 1) * c.y_pad) << c.str();
      EXPECT_EQ(testing::poisoned_padding(p.dx, c.rows, c.cols, c.dx_pad), (c.rows - 1) * c.dx_pad) << c.str();
      for (const Buffer* b : {&p.qy, &p.qy_t, &*p.y, &p.dx, &p.dweight}) EXPECT_TRUE(b->lead_untouched()) << c.str();
      ++cases;
    }
  }
  EXPECT_EQ(cases, 9);
  expect_rare(qy_total, "qy one-ulp differences");
  expect_rare(y_total, "y one-ulp differences");
}

TEST(Fp8NormGpu, AllZeroInputIsSafe) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(712);
  Case c;
  c.rows = 256;
  c.cols = 2048;
  Problem p(c, Device::cuda(0));
  fill_inputs(p, rng);
  p.x.set_values(std::vector<double>(c.rows * c.cols, 0.0));
  p.poison_outputs();
  p.forward();
  EXPECT_EQ(p.y_scale.values()[0], static_cast<double>(kFp8NormAmaxFloor / 448.0f));
  for (double q : p.qy.values()) ASSERT_EQ(q, 0.0);
  for (double q : p.qy_t.values()) ASSERT_EQ(q, 0.0);
  for (double v : p.y->values()) ASSERT_EQ(v, 0.0);
  p.backward();
  for (double v : p.dx.values()) ASSERT_TRUE(std::isfinite(v));
  for (double v : p.dweight.values()) ASSERT_EQ(v, 0.0);
}

// A group of zeros under a huge scale: its quantization factor overflows float32 (the factor is
// clamped, so 0 * factor stays 0 instead of NaN). Both quantize paths: with y (general) and
// without (whole tiles).
TEST(Fp8NormGpu, ZeroGroupUnderHugeScaleQuantizesToZero) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(714);
  for (bool with_y : {true, false}) {
    Case c;
    c.rows = 256;
    c.cols = 1024;
    c.scale_dtype = DType::f32;
    c.with_y = with_y;
    Problem p(c, Device::cuda(0));
    fill_inputs(p, rng);
    auto x = p.x.values();
    auto scales = p.scales.values();
    for (int k = 0; k < 16; ++k) x[5 * c.cols + 32 + k] = 0.0;  // row 5, group 2
    scales[5 * (c.cols / 16) + 2] = 1e38;
    p.x.set_values(x);
    p.scales.set_values(scales);
    p.poison_outputs();
    p.forward();
    const auto qy = p.qy.values();
    for (double q : qy) ASSERT_TRUE(std::isfinite(q));
    for (int k = 0; k < 16; ++k) EXPECT_EQ(qy[5 * c.cols + 32 + k], 0.0);
  }
}

TEST(Fp8NormGpu, EmptyBatch) {
  FUSEKIT_REQUIRE_GPU();
  Case c;
  c.rows = 0;
  c.cols = 256;
  Problem p(c, Device::cuda(0));
  p.poison_outputs();
  p.forward();
  EXPECT_EQ(p.y_scale.values()[0], static_cast<double>(kFp8NormAmaxFloor / 448.0f));
  p.backward();
  for (double v : p.dweight.values()) ASSERT_EQ(v, 0.0);
}

TEST(Fp8NormGpu, MissingOrSmallWorkspaceIsAnError) {
  FUSEKIT_REQUIRE_GPU();
  Case c;
  c.rows = 4096;
  c.cols = 1024;
  Problem p(c, Device::cuda(0));
  Buffer tiny(DType::u8, Device::cuda(0), {16});
  EXPECT_ERROR(fp8_rms_norm_forward(p.x.view(), p.scales.view(), p.weight.view(), c.eps, p.qy.view(),
                                    p.qy_t.view(), p.y_scale.view(), p.rstd.view(), std::nullopt, std::nullopt),
               "argument 'workspace': expected a contiguous u8 tensor of at least");
  EXPECT_ERROR(fp8_rms_norm_forward(p.x.view(), p.scales.view(), p.weight.view(), c.eps, p.qy.view(),
                                    p.qy_t.view(), p.y_scale.view(), p.rstd.view(), std::nullopt, tiny.view()),
               "argument 'workspace'");
  EXPECT_ERROR(fp8_rms_norm_backward(p.dy.view(), p.x.view(), p.scales.view(), p.weight.view(), p.rstd.view(),
                                     p.dx.view(), p.dweight.view(), tiny.view()),
               "argument 'workspace'");
  // No dweight: no workspace needed.
  EXPECT_EQ(error_of([&] {
              fp8_rms_norm_backward(p.dy.view(), p.x.view(), p.scales.view(), p.weight.view(), p.rstd.view(),
                                    p.dx.view(), std::nullopt, std::nullopt);
            }),
            "no error");
}

}  // namespace
}  // namespace fusekit
