// LayerNorm / RMSNorm and their residual-add variants: the CPU reference against finite
// differences, the CUDA kernels against the CPU reference over a randomized grid, determinism,
// layout edge cases and argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/convert.h"
#include "core/overrides.h"
#include "fusekit/error.h"
#include "fusekit/norm.h"
#include "tests/harness/error_testing.h"
#include "tests/harness/gtest_helpers.h"

namespace fusekit {
namespace {

using testing::Buffer;
using testing::close_to_reference;
using testing::error_of;

enum class Kind { layer, rms };
const char* kind_name(Kind k) { return k == Kind::layer ? "layer_norm" : "rms_norm"; }

struct Case {
  Kind kind = Kind::layer;
  DType dtype = DType::bf16;
  DType weight_dtype = DType::bf16;
  std::int64_t rows = 1, cols = 1;
  bool weight = true, bias = true;
  std::int64_t row_pad = 0;  // extra elements between rows (row stride = cols + row_pad)
  std::int64_t lead = 0;     // elements before every tensor's first: pointers off 16-byte alignment
  // The *_residual_* ops: x + residual normalized, the sum saved for the backward (the forward
  // writes it unless sum_absent), and dx += dsum where with_dsum.
  bool residual = false;
  bool sum_absent = false;
  bool with_dsum = true;
  // Every row tensor's row stride rounded up to a multiple of 8 elements (16 bytes in every dtype),
  // so that any N takes the row kernels (a partial last vector when N is not a multiple of 8).
  bool vector_rows = false;
  // Row stride of a row tensor with `pad` elements after each row.
  std::int64_t stride(std::int64_t pad) const {
    const std::int64_t s = cols + pad;
    return vector_rows ? (s + 7) / 8 * 8 : s;
  }
  std::string str() const {
    return std::string(kind_name(kind)) + " " + dtype_name(dtype) + "/w:" + dtype_name(weight_dtype) +
           " (" + std::to_string(rows) + ", " + std::to_string(cols) + ")" + (weight ? " +w" : "") +
           (bias ? " +b" : "") + (row_pad ? " pad " + std::to_string(row_pad) : "") +
           (lead ? " lead " + std::to_string(lead) : "") + (vector_rows ? " vector rows" : "") +
           (residual ? std::string(" residual") + (sum_absent ? " -sum" : "") + (with_dsum ? " +dsum" : "") : "");
  }
};

// All tensors of one forward + backward problem on one device.
struct Problem {
  Case c;
  Device device;
  Buffer x, y, dy, dx;
  std::optional<Buffer> weight, bias, dweight, dbias;
  std::optional<Buffer> residual, sum, dsum;  // the residual ops only
  Buffer mean, rstd;
  std::optional<Buffer> workspace;

  Problem(const Case& c_, Device d)
      : c(c_), device(d),
        x(c.dtype, d, {c.rows, c.cols}, {c.stride(c.row_pad), 1}, c.lead),
        y(c.dtype, d, {c.rows, c.cols}, {c.stride(c.row_pad), 1}, c.lead),
        dy(c.dtype, d, {c.rows, c.cols}, {c.stride(0), 1}, c.lead),
        dx(c.dtype, d, {c.rows, c.cols}, {c.stride(c.row_pad), 1}, c.lead),
        mean(DType::f32, d, {c.rows}), rstd(DType::f32, d, {c.rows}) {
    const std::vector<std::int64_t> row{c.cols};
    if (c.weight) {
      weight.emplace(c.weight_dtype, d, row, std::vector<std::int64_t>{}, c.lead);
      dweight.emplace(c.weight_dtype, d, row, std::vector<std::int64_t>{}, c.lead);
    }
    if (c.bias && c.kind == Kind::layer) {
      bias.emplace(c.weight_dtype, d, row, std::vector<std::int64_t>{}, c.lead);
      dbias.emplace(c.weight_dtype, d, row, std::vector<std::int64_t>{}, c.lead);
    }
    if (c.residual) {
      // Row strides of their own: the residual unpadded, sum and dsum padded like x.
      residual.emplace(c.dtype, d, std::vector<std::int64_t>{c.rows, c.cols},
                       std::vector<std::int64_t>{c.stride(0), 1}, c.lead);
      sum.emplace(c.dtype, d, std::vector<std::int64_t>{c.rows, c.cols},
                  std::vector<std::int64_t>{c.stride(c.row_pad), 1}, c.lead);
      if (c.with_dsum)
        dsum.emplace(c.dtype, d, std::vector<std::int64_t>{c.rows, c.cols},
                     std::vector<std::int64_t>{c.stride(2 * c.row_pad), 1}, c.lead);
    }
    const std::size_t ws = norm_backward_workspace_size(c.rows, c.cols, c.dtype, d);
    if (ws > 0) workspace.emplace(DType::u8, d, std::vector<std::int64_t>{static_cast<std::int64_t>(ws)});
  }

  static OptionalTensor opt(const std::optional<Buffer>& b) {
    return b ? OptionalTensor(b->view()) : std::nullopt;
  }

  // with_sum: the residual forward writes the sum (the CPU reference always does: the backward
  // of both sides reads it).
  void forward(float eps, bool with_sum = true) {
    if (c.residual) {
      const OptionalTensor s = with_sum ? opt(sum) : std::nullopt;
      if (c.kind == Kind::layer)
        layer_norm_residual_forward(x.view(), residual->view(), opt(weight), opt(bias), eps, y.view(), s,
                                    mean.view(), rstd.view());
      else
        rms_norm_residual_forward(x.view(), residual->view(), opt(weight), eps, y.view(), s, rstd.view());
    } else if (c.kind == Kind::layer)
      layer_norm_forward(x.view(), opt(weight), opt(bias), eps, y.view(), mean.view(), rstd.view());
    else
      rms_norm_forward(x.view(), opt(weight), eps, y.view(), rstd.view());
  }
  void backward(bool from_output) {
    if (c.residual) {
      if (c.kind == Kind::layer)
        layer_norm_residual_backward(dy.view(), sum->view(), opt(dsum), opt(weight), mean.view(), rstd.view(),
                                     dx.view(), opt(dweight), opt(dbias), opt(workspace));
      else
        rms_norm_residual_backward(dy.view(), sum->view(), opt(dsum), opt(weight), rstd.view(), dx.view(),
                                   opt(dweight), opt(workspace));
    } else if (c.kind == Kind::layer) {
      if (from_output)
        layer_norm_backward_from_output(dy.view(), y.view(), opt(weight), opt(bias), rstd.view(),
                                        dx.view(), opt(dweight), opt(dbias), opt(workspace));
      else
        layer_norm_backward(dy.view(), x.view(), opt(weight), mean.view(), rstd.view(), dx.view(),
                            opt(dweight), opt(dbias), opt(workspace));
    } else {
      if (from_output)
        rms_norm_backward_from_output(dy.view(), y.view(), opt(weight), rstd.view(), dx.view(),
                                      opt(dweight), opt(workspace));
      else
        rms_norm_backward(dy.view(), x.view(), opt(weight), rstd.view(), dx.view(), opt(dweight),
                          opt(workspace));
    }
  }
  void poison_outputs() {
    y.poison();
    dx.poison();
    mean.poison();
    rstd.poison();
    if (dweight) dweight->poison();
    if (dbias) dbias->poison();
    if (sum) sum->poison();
  }
  // The rows normalized: x, or the residual ops' sum.
  std::vector<double> normalized_rows() const { return c.residual ? sum->values() : x.values(); }
};

// Copies every input of `from` into `to` (different devices), so both backends see the same data.
void copy_inputs(const Problem& from, Problem& to) {
  to.x.set_values(from.x.values());
  to.dy.set_values(from.dy.values());
  if (from.weight) to.weight->set_values(from.weight->values());
  if (from.bias) to.bias->set_values(from.bias->values());
  if (from.residual && to.residual) to.residual->set_values(from.residual->values());
  if (from.dsum && to.dsum) to.dsum->set_values(from.dsum->values());
}

void fill_inputs(Problem& p, std::mt19937_64& rng) {
  // Rows with an offset and a scale so that mean subtraction and rstd matter.
  std::vector<double> xv(p.c.rows * p.c.cols);
  testing::parallel_fill(p.c.rows, rng, [&](std::int64_t r, std::mt19937_64& row_rng) {
    std::normal_distribution<double> n01(0.0, 1.0);
    const double shift = 0.5 * n01(row_rng), scale = std::exp(0.5 * n01(row_rng));
    for (std::int64_t k = 0; k < p.c.cols; ++k) xv[r * p.c.cols + k] = shift + scale * n01(row_rng);
  });
  p.x.set_values(xv);
  p.dy.fill_normal(rng);
  if (p.weight) p.weight->fill_normal(rng, 1.0, 0.5);
  if (p.bias) p.bias->fill_normal(rng, 0.0, 0.5);
  if (p.residual) p.residual->fill_normal(rng, 0.0, 0.5);
  if (p.dsum) p.dsum->fill_normal(rng);
}

// Runs one case on the GPU and the CPU reference and compares every output.
void check_gpu_against_cpu(const Case& c, std::uint64_t salt, bool from_output) {
  SCOPED_TRACE(c.str() + (from_output ? " from_output" : ""));
  auto rng = testing::make_rng(salt);
  const float eps = 1e-5f;
  Problem cpu(c, Device::cpu()), gpu(c, Device::cuda(0));
  fill_inputs(cpu, rng);
  copy_inputs(cpu, gpu);

  cpu.forward(eps);
  gpu.poison_outputs();
  gpu.forward(eps, !c.sum_absent);
  const auto y_ref = cpu.y.values();
  if (c.residual) {
    // The sum is rounded once from exact operands on both sides: bitwise the same. Absent, it
    // is never written.
    const auto got = gpu.sum->values(), ref = cpu.sum->values();
    if (c.sum_absent)
      EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](double v) { return std::isnan(v); })) << "sum written";
    else
      EXPECT_TRUE(got == ref) << "sum differs from the CPU's";
  }
  // LayerNorm's y = (x - mean) rstd w + b: in float32, x - mean carries an error of about eps
  // times |mean|, which for a row whose spread is tiny against its mean (two close values, say)
  // is large against y. PyTorch's float32 result carries the same cancellation error, so y is
  // measured against the size of the cancelled term too, ||mean rstd w|| (an exhaustive sweep of
  // small cases drew 4.8e-6 and 8.8e-6 relative error at (1, 2) in f32 against a 4e-6 bar).
  double mean_term = 0.0;
  if (c.kind == Kind::layer) {
    const auto mean = cpu.mean.values(), rstd = cpu.rstd.values();
    const auto w = cpu.weight ? cpu.weight->values() : std::vector<double>(c.cols, 1.0);
    for (std::int64_t r = 0; r < c.rows; ++r)
      for (std::int64_t k = 0; k < c.cols; ++k) {
        const double term = mean[r] * rstd[r] * w[k];
        mean_term += term * term;
      }
  }
  EXPECT_TRUE(close_to_reference(gpu.y.values(), y_ref, c.dtype, "y", std::sqrt(mean_term)));
  EXPECT_TRUE(close_to_reference(gpu.rstd.values(), cpu.rstd.values(), DType::f32, "rstd"));
  if (c.kind == Kind::layer) {
    // A float32 row mean is exact to about eps times the row's RMS, not to its own size: means that
    // nearly cancel (one row of 65536 with mean 5e-5 and RMS 2.3 drew 1.5e-5 relative error from
    // the unchanged generic kernel) are measured against a tenth of the rows' RMS norm.
    const auto xv = cpu.normalized_rows();
    double rms_norm = 0.0;
    for (std::int64_t r = 0; r < c.rows; ++r) {
      double sq = 0.0;
      for (std::int64_t k = 0; k < c.cols; ++k) sq += xv[r * c.cols + k] * xv[r * c.cols + k];
      rms_norm += sq / static_cast<double>(c.cols);
    }
    EXPECT_TRUE(close_to_reference(gpu.mean.values(), cpu.mean.values(), DType::f32, "mean", std::sqrt(rms_norm)));
  }

  // Backward from identical saved tensors on both sides (the CPU's y, sum, mean, rstd).
  gpu.y.set_values(y_ref);
  if (c.residual) gpu.sum->set_values(cpu.sum->values());
  gpu.mean.set_values(cpu.mean.values());
  gpu.rstd.set_values(cpu.rstd.values());
  cpu.backward(from_output);
  gpu.dx.poison();
  if (gpu.dweight) gpu.dweight->poison();
  if (gpu.dbias) gpu.dbias->poison();
  gpu.backward(from_output);
  // dx = rstd * (g - mean(g) - x_hat * mean(g x_hat)) can cancel almost exactly (N = 1, say):
  // measure it against the size of the terms, ||rstd * g||.
  double g_norm = 0.0;
  {
    const auto dyv = cpu.dy.values(), rstd = cpu.rstd.values();
    const auto w = cpu.weight ? cpu.weight->values() : std::vector<double>(c.cols, 1.0);
    for (std::int64_t r = 0; r < c.rows; ++r)
      for (std::int64_t k = 0; k < c.cols; ++k) g_norm += std::pow(dyv[r * c.cols + k] * w[k] * rstd[r], 2);
    g_norm = std::sqrt(g_norm);
  }
  EXPECT_TRUE(close_to_reference(gpu.dx.values(), cpu.dx.values(), c.dtype, "dx", g_norm));
  // Nothing past N is written (the row padding of y, the sum, dx stays poisoned).
  const std::int64_t pad = c.stride(c.row_pad) - c.cols;
  if (pad > 0) {
    EXPECT_EQ(testing::poisoned_padding(gpu.y, c.rows, c.cols, pad), (c.rows - 1) * pad) << "y padding written";
    EXPECT_EQ(testing::poisoned_padding(gpu.dx, c.rows, c.cols, pad), (c.rows - 1) * pad) << "dx padding written";
    if (c.residual)
      EXPECT_EQ(testing::poisoned_padding(*gpu.sum, c.rows, c.cols, pad), (c.rows - 1) * pad) << "sum padding written";
  }

  if (gpu.dweight || gpu.dbias) {
    // Per-element terms of the column sums, for the float32 reduction baseline.
    const auto dy = cpu.dy.values(), x = cpu.normalized_rows(), mean = cpu.mean.values(), rstd = cpu.rstd.values();
    std::vector<double> w_terms(dy.size());
    for (std::int64_t r = 0; r < c.rows; ++r)
      for (std::int64_t k = 0; k < c.cols; ++k) {
        const double m = c.kind == Kind::layer ? mean[r] : 0.0;
        w_terms[r * c.cols + k] = dy[r * c.cols + k] * (x[r * c.cols + k] - m) * rstd[r];
      }
    if (gpu.dweight) {
      const auto ref = cpu.dweight->values();
      EXPECT_TRUE(testing::reduction_close(gpu.dweight->values(), ref, c.weight_dtype,
                                           testing::f32_column_sum_error(w_terms, c.rows, c.cols, ref),
                                           "dweight"));
    }
    if (gpu.dbias) {
      const auto ref = cpu.dbias->values();
      EXPECT_TRUE(testing::reduction_close(gpu.dbias->values(), ref, c.weight_dtype,
                                           testing::f32_column_sum_error(dy, c.rows, c.cols, ref), "dbias"));
    }
  }
}

// Case c's backward (dweight and dbias asked for) after its forward, every output poisoned before
// each run: whether every run writes the same bytes.
bool backward_is_bitwise_repeatable(const Case& c, std::mt19937_64& rng) {
  Problem p(c, Device::cuda(0));
  fill_inputs(p, rng);
  p.forward(1e-5f);
  return testing::same_bytes_every_run(
      [&] {
        p.dx.poison();
        p.dweight->poison();
        p.dbias->poison();
        p.backward(false);
      },
      {&*p.dweight, &*p.dbias, &p.dx});
}

// ---- CPU reference -------------------------------------------------------------------------

TEST(NormCpu, ForwardNormalizesEachRow) {
  auto rng = testing::make_rng(1);
  for (Kind kind : {Kind::layer, Kind::rms}) {
    Case c{kind, DType::f32, DType::f32, 5, 300, false, false};
    Problem p(c, Device::cpu());
    fill_inputs(p, rng);
    p.forward(0.0f);
    const auto y = p.y.values();
    for (std::int64_t r = 0; r < c.rows; ++r) {
      double s = 0, s2 = 0;
      for (std::int64_t k = 0; k < c.cols; ++k) {
        s += y[r * c.cols + k];
        s2 += y[r * c.cols + k] * y[r * c.cols + k];
      }
      if (kind == Kind::layer) EXPECT_NEAR(s / c.cols, 0.0, 1e-6);
      EXPECT_NEAR(s2 / c.cols, 1.0, 1e-5);  // unit variance (LayerNorm) / unit mean square (RMSNorm)
    }
  }
}

// Finite differences of L = sum(y * dy) with respect to x, weight and bias.
TEST(NormCpu, GradientsMatchFiniteDifferences) {
  auto rng = testing::make_rng(2);
  for (Kind kind : {Kind::layer, Kind::rms}) {
    Case c{kind, DType::f32, DType::f32, 3, 13, true, true};
    SCOPED_TRACE(c.str());
    Problem p(c, Device::cpu());
    fill_inputs(p, rng);
    const float eps = 1e-3f;
    p.forward(eps);
    p.backward(false);
    const auto dy = p.dy.values();
    auto loss = [&](Problem& q) {
      q.forward(eps);
      const auto y = q.y.values();
      double l = 0;
      for (std::size_t i = 0; i < y.size(); ++i) l += y[i] * dy[i];
      return l;
    };
    auto fd = [&](Buffer& param, std::int64_t i) {
      const double h = 1e-2 * std::max(1.0, std::abs(param.values()[i]));
      return testing::central_difference(param, i, h, [&] { return loss(p); });
    };
    const auto dx = p.dx.values(), dw = p.dweight->values();
    for (std::int64_t i = 0; i < c.rows * c.cols; i += 5) EXPECT_NEAR(fd(p.x, i), dx[i], 2e-3) << "dx " << i;
    for (std::int64_t i = 0; i < c.cols; i += 3) EXPECT_NEAR(fd(*p.weight, i), dw[i], 2e-3) << "dw " << i;
    if (kind == Kind::layer) {
      const auto db = p.dbias->values();
      for (std::int64_t i = 0; i < c.cols; i += 3) EXPECT_NEAR(fd(*p.bias, i), db[i], 2e-3) << "db " << i;
    }
  }
}

TEST(NormCpu, FromOutputMatchesFromInput) {
  auto rng = testing::make_rng(3);
  for (Kind kind : {Kind::layer, Kind::rms}) {
    Case c{kind, DType::f32, DType::f32, 7, 64, true, true};
    Problem a(c, Device::cpu()), b(c, Device::cpu());
    fill_inputs(a, rng);
    copy_inputs(a, b);
    a.forward(1e-5f);
    b.forward(1e-5f);
    a.backward(false);
    b.backward(true);
    EXPECT_TRUE(close_to_reference(b.dx.values(), a.dx.values(), DType::f32, "dx from y"));
    EXPECT_TRUE(close_to_reference(b.dweight->values(), a.dweight->values(), DType::f32, "dw from y"));
  }
}

// ---- argument errors (CPU tensors: checks run before any backend) ----------------------------

TEST(NormErrors, EachBadArgumentIsNamed) {
  std::vector<float> xb(64 * 8), yb(64 * 8), w(8), stats(64);
  std::vector<double> xd(64 * 8);
  const Device cpu = Device::cpu();
  TensorView x(xb.data(), DType::f32, cpu, {64, 8}), y(yb.data(), DType::f32, cpu, {64, 8});
  TensorView weight(w.data(), DType::f32, cpu, {8});
  TensorView rstd(stats.data(), DType::f32, cpu, {64});

  // Shape: weight of the wrong length.
  TensorView short_weight(w.data(), DType::f32, cpu, {7});
  EXPECT_EQ(error_of([&] { rms_norm_forward(x, short_weight, 1e-5f, y, rstd); }),
            "fusekit.rms_norm_forward: argument 'weight': expected shape (8), got (7)");
  // Shape: y not like x.
  TensorView y_bad(yb.data(), DType::f32, cpu, {32, 8});
  EXPECT_NE(error_of([&] { rms_norm_forward(x, weight, 1e-5f, y_bad, rstd); }).find("argument 'y': expected shape (64, 8)"), std::string::npos);
  // Dtype: f64 input.
  TensorView x64(xd.data(), DType::f64, cpu, {64, 8});
  EXPECT_NE(error_of([&] { rms_norm_forward(x64, weight, 1e-5f, y, rstd); }).find("argument 'x': expected dtype f32, f16 or bf16, got f64"), std::string::npos);
  // Dtype: rstd not float32.
  TensorView rstd16(stats.data(), DType::f16, cpu, {64});
  EXPECT_NE(error_of([&] { rms_norm_forward(x, weight, 1e-5f, y, rstd16); }).find("argument 'rstd': expected dtype f32"), std::string::npos);
  // Stride: last dimension not contiguous.
  TensorView x_strided(xb.data(), DType::f32, cpu, {32, 8}, {16, 2});
  EXPECT_NE(error_of([&] { rms_norm_forward(x_strided, weight, 1e-5f, y_bad, rstd); }).find("argument 'x': expected a contiguous last dimension"), std::string::npos);
  // Stride: rows overlapping.
  TensorView x_overlap(xb.data(), DType::f32, cpu, {64, 8}, {4, 1});
  EXPECT_NE(error_of([&] { rms_norm_forward(x_overlap, weight, 1e-5f, y, rstd); }).find("row stride of at least N = 8"), std::string::npos);
  // Device mix: weight claims to be on a GPU.
  TensorView gpu_weight(w.data(), DType::f32, Device::cuda(0), {8});
  EXPECT_NE(error_of([&] { rms_norm_forward(x, gpu_weight, 1e-5f, y, rstd); }).find("argument 'weight': expected a tensor on cpu (where 'x' is), got a tensor on cuda:0"), std::string::npos);
  // Null data.
  TensorView x_null(nullptr, DType::f32, cpu, {64, 8});
  EXPECT_NE(error_of([&] { rms_norm_forward(x_null, weight, 1e-5f, y, rstd); }).find("argument 'x': expected a non-null data pointer"), std::string::npos);
  // N past the supported limit (the data is never touched: checks come first).
  TensorView x_huge(xb.data(), DType::f32, cpu, {1, kNormMaxCols + 1});
  TensorView y_huge(yb.data(), DType::f32, cpu, {1, kNormMaxCols + 1});
  EXPECT_NE(error_of([&] { rms_norm_forward(x_huge, std::nullopt, 1e-5f, y_huge, std::nullopt); }).find("expected a last dimension N in 1..65536, got N = 65537"), std::string::npos);
  // Rows past 2^31 - 1.
  TensorView x_rows(xb.data(), DType::f32, cpu, {std::int64_t(1) << 31, 8}, {8, 1});
  EXPECT_NE(error_of([&] { rms_norm_forward(x_rows, std::nullopt, 1e-5f, x_rows, std::nullopt); }).find("at most 2^31 - 1 rows"), std::string::npos);
  // eps negative.
  EXPECT_NE(error_of([&] { rms_norm_forward(x, weight, -1.0f, y, rstd); }).find("argument 'eps'"), std::string::npos);
  // Output over an input (in place is not supported: a silent wrong answer otherwise).
  EXPECT_EQ(error_of([&] { rms_norm_forward(x, weight, 1e-5f, x, rstd); }),
            "fusekit.rms_norm_forward: argument 'y': expected memory that does not overlap 'x', got a "
            "view sharing bytes with 'x'");
  // Backward: dweight without a weight.
  TensorView dw(w.data(), DType::f32, cpu, {8});
  EXPECT_NE(error_of([&] { rms_norm_backward(y, x, std::nullopt, rstd, y, dw, std::nullopt); }).find("argument 'dweight'"), std::string::npos);
  // Weight dtype neither x's nor f32.
  TensorView w16(w.data(), DType::bf16, cpu, {8});
  EXPECT_NE(error_of([&] { rms_norm_forward(x, w16, 1e-5f, y, rstd); }).find("argument 'weight': expected dtype f32 (as x) or f32, got bf16"), std::string::npos);
}

// ---- residual variants: CPU reference ------------------------------------------------------

// A residual problem and the plain problem of its rounded sum (x = the residual problem's sum),
// on the CPU, with the same weight, bias, dy.
Case with_residual(Case c, bool residual) {
  c.residual = residual;
  return c;
}

struct ResidualAndPlain {
  Problem res, plain;
  ResidualAndPlain(const Case& c, std::mt19937_64& rng, float eps)
      : res(with_residual(c, true), Device::cpu()), plain(with_residual(c, false), Device::cpu()) {
    fill_inputs(res, rng);
    copy_inputs(res, plain);
    res.forward(eps);
    plain.x.set_values(res.sum->values());
    plain.forward(eps);
  }
};

TEST(NormResidualCpu, ForwardIsThePlainNormOfTheRoundedSum) {
  auto rng = testing::make_rng(11);
  for (Kind kind : {Kind::layer, Kind::rms})
    for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
      Case c{kind, dt, dt, 9, 77, true, true, 3};
      SCOPED_TRACE(c.str());
      ResidualAndPlain p(c, rng, 1e-5f);
      // sum = x + residual rounded once to the dtype.
      const auto x = p.res.x.values(), r = p.res.residual->values(), sum = p.res.sum->values();
      for (std::size_t i = 0; i < sum.size(); ++i) ASSERT_EQ(sum[i], detail::round_to(dt, x[i] + r[i])) << i;
      EXPECT_TRUE(p.res.y.values() == p.plain.y.values());
      EXPECT_TRUE(p.res.rstd.values() == p.plain.rstd.values());
      if (kind == Kind::layer) EXPECT_TRUE(p.res.mean.values() == p.plain.mean.values());
      // Without sum the same y.
      const auto y = p.res.y.values();
      p.res.y.poison();
      p.res.sum->poison();
      p.res.forward(1e-5f, false);
      EXPECT_TRUE(p.res.y.values() == y);
      for (double v : p.res.sum->values()) ASSERT_TRUE(std::isnan(v)) << "sum written";
    }
}

// dx = the plain backward's dx at the sum + dsum; dweight, dbias exactly the plain backward's.
TEST(NormResidualCpu, BackwardIsThePlainBackwardPlusDsum) {
  auto rng = testing::make_rng(12);
  for (Kind kind : {Kind::layer, Kind::rms})
    for (bool with_dsum : {true, false}) {
      Case c{kind, DType::f32, DType::f32, 6, 40, true, true};
      c.with_dsum = with_dsum;
      SCOPED_TRACE(c.str());
      ResidualAndPlain p(c, rng, 1e-5f);
      p.res.backward(false);
      p.plain.backward(false);
      auto expected = p.plain.dx.values();
      if (with_dsum) {
        const auto dsum = p.res.dsum->values();
        for (std::size_t i = 0; i < expected.size(); ++i) expected[i] += dsum[i];
        EXPECT_TRUE(close_to_reference(p.res.dx.values(), expected, DType::f32, "dx"));
      } else {
        EXPECT_TRUE(p.res.dx.values() == expected);
      }
      EXPECT_TRUE(p.res.dweight->values() == p.plain.dweight->values());
      if (kind == Kind::layer) EXPECT_TRUE(p.res.dbias->values() == p.plain.dbias->values());
    }
}

// Finite differences of L = sum(y * dy) + sum(sum * dsum): dx is the gradient of x and of the
// residual alike.
TEST(NormResidualCpu, GradientsMatchFiniteDifferences) {
  auto rng = testing::make_rng(13);
  for (Kind kind : {Kind::layer, Kind::rms}) {
    Case c{kind, DType::f32, DType::f32, 3, 13, true, true};
    c.residual = true;
    SCOPED_TRACE(c.str());
    Problem p(c, Device::cpu());
    fill_inputs(p, rng);
    const float eps = 1e-3f;
    p.forward(eps);
    p.backward(false);
    const auto dy = p.dy.values(), dsum = p.dsum->values();
    auto loss = [&] {
      p.forward(eps);
      const auto y = p.y.values(), s = p.sum->values();
      double l = 0;
      for (std::size_t i = 0; i < y.size(); ++i) l += y[i] * dy[i] + s[i] * dsum[i];
      return l;
    };
    auto fd = [&](Buffer& param, std::int64_t i) {
      const double h = 1e-2 * std::max(1.0, std::abs(param.values()[i]));
      return testing::central_difference(param, i, h, loss);
    };
    const auto dx = p.dx.values(), dw = p.dweight->values();
    for (std::int64_t i = 0; i < c.rows * c.cols; i += 5) {
      EXPECT_NEAR(fd(p.x, i), dx[i], 2e-3) << "dx " << i;
      EXPECT_NEAR(fd(*p.residual, i), dx[i], 2e-3) << "dresidual " << i;
    }
    for (std::int64_t i = 0; i < c.cols; i += 3) EXPECT_NEAR(fd(*p.weight, i), dw[i], 2e-3) << "dw " << i;
    if (kind == Kind::layer) {
      const auto db = p.dbias->values();
      for (std::int64_t i = 0; i < c.cols; i += 3) EXPECT_NEAR(fd(*p.bias, i), db[i], 2e-3) << "db " << i;
    }
  }
}

// dx written over dsum (the same view) gives what a separate dx gets, on `device`.
void check_dx_over_dsum(Device device, Kind kind, DType dt, std::int64_t rows, std::int64_t cols,
                        std::uint64_t seed) {
  auto rng = testing::make_rng(seed);
  Case c{kind, dt, dt, rows, cols, true, true};
  c.residual = true;
  SCOPED_TRACE(c.str());
  Problem p(c, device);
  fill_inputs(p, rng);
  p.forward(1e-5f);
  p.backward(false);
  const auto dx = p.dx.values(), dw = p.dweight->values();
  const TensorView in_place = p.dsum->view();
  if (kind == Kind::layer)
    layer_norm_residual_backward(p.dy.view(), p.sum->view(), in_place, p.weight->view(), p.mean.view(),
                                 p.rstd.view(), in_place, p.dweight->view(), p.dbias->view(), Problem::opt(p.workspace));
  else
    rms_norm_residual_backward(p.dy.view(), p.sum->view(), in_place, p.weight->view(), p.rstd.view(), in_place,
                               p.dweight->view(), Problem::opt(p.workspace));
  EXPECT_TRUE(p.dsum->values() == dx);
  EXPECT_TRUE(p.dweight->values() == dw);
}

TEST(NormResidualCpu, DxMayBeDsumItself) {
  for (Kind kind : {Kind::layer, Kind::rms}) check_dx_over_dsum(Device::cpu(), kind, DType::bf16, 5, 48, 14);
}

// ---- residual variants: argument errors --------------------------------------------------------

TEST(NormResidualErrors, EachBadArgumentIsNamed) {
  using testing::expect_error;
  using testing::view;
  std::vector<float> x = testing::ramp(48), r = testing::ramp(48, 0.3f), y(48), s(64), rstd(6), mean(6);
  std::vector<float> dy = testing::ramp(48, -0.2f), dsum = testing::ramp(64, 0.05f), dx(64), w = testing::ramp(8, 0.5f);
  std::vector<double> r64(48);
  const TensorView xv = view(x, {6, 8}), rv = view(r, {6, 8}), yv = view(y, {6, 8}), sv = view(s, {6, 8});
  const TensorView wv = view(w, {8}), rstdv = view(rstd, {6}), meanv = view(mean, {6});
  auto rms_fwd = [&](const TensorView& res, const OptionalTensor& sum, const TensorView& out) {
    rms_norm_residual_forward(xv, res, wv, 1e-5f, out, sum, rstdv);
  };
  // Shapes and dtypes of residual and sum.
  expect_error([&] { rms_fwd(view(r, {8, 6}), sv, yv); }, ErrorKind::invalid_argument, "residual",
               "expected shape (6, 8) (as 'x'), got (8, 6)");
  expect_error([&] { rms_fwd(TensorView(r64.data(), DType::f64, Device::cpu(), {6, 8}), sv, yv); },
               ErrorKind::invalid_argument, "residual", "dtype");
  expect_error([&] { rms_fwd(rv, view(s, {6, 9}), yv); }, ErrorKind::invalid_argument, "sum",
               "expected shape (6, 8) (as 'x'), got (6, 9)");
  expect_error([&] { rms_fwd(rv, view(s, {48}), yv); }, ErrorKind::invalid_argument, "sum");
  expect_error([&] {
    rms_fwd(rv, TensorView(s.data(), DType::f32, Device::cuda(0), {6, 8}), yv);
  },
               ErrorKind::invalid_argument, "sum", "cuda:0");
  // Overlaps: sum over x or the residual (no in-place forward), y over sum.
  expect_error([&] { rms_fwd(rv, xv, yv); }, ErrorKind::invalid_argument, "sum",
               "expected memory that does not overlap 'x'");
  expect_error([&] { rms_fwd(rv, rv, yv); }, ErrorKind::invalid_argument, "sum",
               "expected memory that does not overlap 'residual'");
  expect_error([&] { rms_fwd(rv, sv, sv); }, ErrorKind::invalid_argument, "y", "overlap 'sum'");
  expect_error([&] {
    layer_norm_residual_forward(xv, rv, wv, std::nullopt, 1e-5f, yv, sv, view(s, {6}), rstdv);
  },
               ErrorKind::invalid_argument, "sum", "overlap 'mean'");
  // The same forward runs with valid arguments.
  rms_fwd(rv, sv, yv);
  layer_norm_residual_forward(xv, rv, wv, std::nullopt, 1e-5f, yv, sv, meanv, rstdv);

  // Backward: shapes of sum and dsum; dx over dsum partly, over sum.
  const TensorView dyv = view(dy, {6, 8}), dsv = view(dsum, {6, 8}), dxv = view(dx, {6, 8});
  auto rms_bwd = [&](const TensorView& sum, const OptionalTensor& ds, const OptionalTensor& out) {
    rms_norm_residual_backward(dyv, sum, ds, wv, rstdv, out, std::nullopt, std::nullopt);
  };
  expect_error([&] { rms_bwd(view(s, {6, 7}), dsv, dxv); }, ErrorKind::invalid_argument, "sum",
               "expected shape (6, 8) (as 'dy'), got (6, 7)");
  expect_error([&] { rms_bwd(sv, view(dsum, {8, 6}), dxv); }, ErrorKind::invalid_argument, "dsum",
               "expected shape (6, 8) (as 'dy'), got (8, 6)");
  expect_error([&] { rms_bwd(sv, TensorView(dsum.data(), DType::f16, Device::cpu(), {6, 8}), dxv); },
               ErrorKind::invalid_argument, "dsum", "dtype");
  const TensorView dsum_shifted(dsum.data() + 8, DType::f32, Device::cpu(), {6, 8});
  expect_error([&] { rms_bwd(sv, dsum_shifted, dsv); }, ErrorKind::invalid_argument, "dx",
               "expected memory that does not overlap 'dsum'");
  const TensorView dsum_strided(dsum.data(), DType::f32, Device::cpu(), {6, 8}, {10, 1});
  expect_error([&] { rms_bwd(sv, dsum_strided, dsv); }, ErrorKind::invalid_argument, "dx", "overlap 'dsum'");
  expect_error([&] { rms_bwd(sv, dsv, sv); }, ErrorKind::invalid_argument, "dx", "overlap 'sum'");
  expect_error([&] {
    rms_norm_residual_backward(dyv, sv, dsv, wv, rstdv, dxv, view(dsum, {8}), std::nullopt);
  },
               ErrorKind::invalid_argument, "dweight", "overlap 'dsum'");
  // dx exactly dsum is in place; dsum absent is zero.
  rms_bwd(sv, dsv, dsv);
  rms_bwd(sv, std::nullopt, dxv);
}

// ---- GPU ---------------------------------------------------------------------------------------

TEST(NormGpu, RandomizedGridMatchesCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(100);
  const std::int64_t cols_choices[] = {1, 2, 7, 8, 64, 100, 256, 768, 1000, 1024, 1536, 2048, 3000,
                                       4096, 5120, 8192, 12288, 16384, 20000, 32768, 65536};
  const std::int64_t rows_choices[] = {1, 2, 3, 17, 64, 333, 1024};
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  int cases = 0;
  for (std::int64_t cols : cols_choices) {
    for (int rep = 0; rep < 3; ++rep) {
      Case c;
      c.kind = (rng() % 2) ? Kind::layer : Kind::rms;
      c.dtype = dtypes[rng() % 3];
      c.weight_dtype = (rng() % 3 == 0) ? DType::f32 : c.dtype;
      c.rows = rows_choices[rng() % 7];
      if (cols >= 16384) c.rows = std::min<std::int64_t>(c.rows, 64);
      c.cols = cols;
      c.weight = rng() % 5 != 0;
      c.bias = rng() % 3 != 0;
      c.row_pad = (rng() % 4 == 0) ? 8 * (1 + rng() % 3) + (rng() % 2) : 0;
      check_gpu_against_cpu(c, 1000 + cases, rng() % 4 == 0);
      ++cases;
    }
  }
  EXPECT_EQ(cases, 63);
}

TEST(NormGpu, BenchmarkShapesMatchCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  // (4096, 16384), (32768, 2048), (8192, 12288): forward grids of several waves, where each row
  // asks L2 for the next wave's row (the randomized grid gets there only at its largest shapes);
  // (16384, 1024) the capped one-warp grid; (32768, 2048) the backward's 3-vector rows in
  // 384-thread blocks.
  const std::pair<std::int64_t, std::int64_t> shapes[] = {
      {16384, 1024}, {4096, 16384}, {32768, 2048}, {8192, 12288}};
  int salt = 0;
  for (auto [rows, cols] : shapes) {
    for (Kind kind : {Kind::layer, Kind::rms}) {
      Case c{kind, DType::bf16, DType::bf16, rows, cols, true, true};
      check_gpu_against_cpu(c, 5000 + salt++, false);
    }
  }
}

TEST(NormGpu, FromOutputVariant) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  for (Kind kind : {Kind::layer, Kind::rms})
    for (DType dt : {DType::bf16, DType::f32})
      for (std::int64_t cols : {512, 4096, 1001})
        check_gpu_against_cpu(Case{kind, dt, dt, 300, cols, true, true}, 6000 + salt++, true);
}

// Without dbias (RMSNorm, LayerNorm without a bias), rows that fill 4 vectors of each of up to
// 256 threads (N = 1024 and 8192 in 16-bit types, 512 and 4096 in f32) take the backward kernel
// without bounds tests; the rows 8 columns shorter or longer sit beside them on the tested path.
TEST(NormGpu, FullRowBackwardWithoutDbias) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  for (Kind kind : {Kind::layer, Kind::rms})
    for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
      const std::int64_t scale = dt == DType::f32 ? 2 : 1;  // vectors of 4 f32 values, not 8
      for (std::int64_t cols : {1024 / scale, 8192 / scale, 1024 / scale - 8, 8192 / scale + 8})
        for (bool from_output : {false, true})
          check_gpu_against_cpu(Case{kind, dt, dt, 333, cols, true, false}, 6500 + salt++, from_output);
    }
}

// Backward rows of the given lengths (in 16-byte vectors: 8 bf16 or 4 f32 values), bf16 and f32,
// LayerNorm with dbias and RMSNorm without, from x and from y.
void check_backward_row_lengths(std::initializer_list<std::int64_t> vector_counts, std::int64_t rows,
                                std::uint64_t seed) {
  for (DType dt : {DType::bf16, DType::f32}) {
    const std::int64_t per_vector = dt == DType::f32 ? 4 : 8;
    for (std::int64_t vectors : vector_counts)
      for (Kind kind : {Kind::layer, Kind::rms})
        for (bool from_output : {false, true})
          check_gpu_against_cpu(Case{kind, dt, dt, rows, vectors * per_vector, true, kind == Kind::layer}, seed++,
                                from_output);
  }
}

// The backward's vectors per thread, and whether g = dy * w stays in registers between its passes
// (keep_g), change with the row length, the source and dbias (norm_config.cpp's row tables):
// rows on both sides of each boundary.
TEST(NormGpu, BackwardRowLengthSpecializations) {
  FUSEKIT_REQUIRE_GPU();
  check_backward_row_lengths({256, 512, 513, 640, 641, 1024, 1025, 1280, 1281, 1536, 1537}, 200, 7100);
}

// Rows of at most 128 vectors take their own launch shapes: one warp per row in 512-thread
// blocks up to 32 vectors, in 256-thread blocks above, and LayerNorm with dbias from x on two warps
// per row at 97..128 vectors (2 per lane, the second partly out of the row below 128): each side
// of every boundary. The forward of these cases runs its 128-vector rows on two warps and the
// others on one (kForwardRows), so both sides of that boundary are checked too.
TEST(NormGpu, BackwardShortRowShapes) {
  FUSEKIT_REQUIRE_GPU();
  check_backward_row_lengths({1, 31, 32, 33, 64, 65, 96, 97, 100, 127, 128}, 300, 7300);
}

// LayerNorm's dweight and dbias at N = 16384 are pre-summed by clusters of blocks through
// distributed shared memory: from x and from y (with and without 1/w and b cached), weights in the
// input type or f32, and batches of 3 rows, where most of the grid's clusters have no row at all;
// N = 12288 beside it takes the plain kernel.
TEST(NormGpu, ClusterPreSummedGradients) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  for (std::int64_t cols : {12288, 16384})
    for (DType dt : {DType::bf16, DType::f16})
      for (DType wt : {dt, DType::f32})
        for (std::int64_t rows : {3, 333})
          for (bool from_output : {false, true})
            check_gpu_against_cpu(Case{Kind::layer, dt, wt, rows, cols, true, true}, 6800 + salt++, from_output);
}

// The override keys force launches that the tables do not choose for these shapes (a shallower
// ring, no clusters at N = 16384, other vectors per thread, smaller blocks): each still matches
// the reference, its workspace sized under the same overrides.
TEST(NormGpu, OverriddenLaunchesMatchCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  struct Cleared {
    ~Cleared() { detail::clear_overrides(); }
  } cleared;
  int salt = 0;
  for (const char* overrides : {"norm.backward.stages=2", "norm.backward.cluster=1", "norm.backward.vectors=2",
                                "norm.backward.vectors=4", "norm.backward.block=128", "norm.forward.vectors=1",
                                "norm.forward.vectors=3"}) {
    SCOPED_TRACE(overrides);
    detail::clear_overrides();
    detail::set_overrides(overrides);
    for (std::int64_t cols : {1024, 2048, 16384})
      for (bool from_output : {false, true})
        check_gpu_against_cpu(Case{Kind::layer, DType::bf16, DType::bf16, 300, cols, true, true}, 7600 + salt++,
                              from_output);
  }
}

TEST(NormGpu, BackwardIsBitwiseDeterministic) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(7);
  for (std::int64_t cols : {1024, 4096, 16384, 3001}) {
    Case c{Kind::layer, DType::bf16, DType::f32, 8192, cols, true, true};
    SCOPED_TRACE(c.str());
    EXPECT_TRUE(backward_is_bitwise_repeatable(c, rng));
  }
}

TEST(NormGpu, RowPaddingIsNeverWritten) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(8);
  Case c{Kind::layer, DType::bf16, DType::bf16, 100, 1024, true, true, 8};
  Problem p(c, Device::cuda(0));
  fill_inputs(p, rng);
  p.poison_outputs();
  p.forward(1e-5f);
  p.backward(false);
  for (const Buffer* b : {&p.y, &p.dx})
    EXPECT_EQ(testing::poisoned_padding(*b, c.rows, c.cols, c.row_pad), (c.rows - 1) * c.row_pad);
}

// Pointers off 16-byte alignment (every tensor starts `lead` elements past an aligned address)
// with odd row strides: the vector kernels cannot take them, and what runs instead must still
// match the reference and write nothing before a tensor or into its row padding.
TEST(NormGpu, UnalignedPointersAndOddRowStrides) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(9);
  const std::int64_t shapes[][3] = {{64, 1000, 3}, {33, 4096, 1}, {17, 777, 5}, {9, 20000, 7}};
  int cases = 0;
  for (const auto& shape : shapes) {
    for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
      for (std::int64_t lead : {1, 3}) {
        Case c{cases % 2 ? Kind::rms : Kind::layer, dtype, dtype, shape[0], shape[1], true, true, shape[2]};
        c.lead = lead;
        check_gpu_against_cpu(c, 9000 + cases, cases % 3 == 0);
        Problem p(c, Device::cuda(0));
        fill_inputs(p, rng);
        p.poison_outputs();
        p.forward(1e-5f);
        p.backward(false);
        for (const Buffer* b : {&p.y, &p.dx}) {
          EXPECT_EQ(testing::poisoned_padding(*b, c.rows, c.cols, c.row_pad), (c.rows - 1) * c.row_pad) << c.str();
          EXPECT_TRUE(b->lead_untouched()) << c.str();
        }
        if (p.dweight) EXPECT_TRUE(p.dweight->lead_untouched()) << c.str();
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 24);
}

TEST(NormGpu, WorkspaceTooSmallIsAnError) {
  FUSEKIT_REQUIRE_GPU();
  Case c{Kind::rms, DType::bf16, DType::bf16, 4096, 1024, true, false};
  Problem p(c, Device::cuda(0));
  Buffer tiny(DType::u8, Device::cuda(0), {16});
  try {
    rms_norm_backward(p.dy.view(), p.x.view(), p.weight->view(), p.rstd.view(), p.dx.view(),
                      p.dweight->view(), tiny.view());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("argument 'workspace'"), std::string::npos) << e.what();
  }
}

TEST(NormGpu, EmptyBatchGivesZeroGradients) {
  FUSEKIT_REQUIRE_GPU();
  Case c{Kind::layer, DType::bf16, DType::bf16, 0, 256, true, true};
  Problem p(c, Device::cuda(0));
  p.poison_outputs();
  p.forward(1e-5f);
  p.backward(false);
  for (double v : p.dweight->values()) ASSERT_EQ(v, 0.0);
  for (double v : p.dbias->values()) ASSERT_EQ(v, 0.0);
}

// ---- residual variants: GPU ----------------------------------------------------------------------

// The residual forward and backward over row lengths of every launch shape (one warp, two, up to
// 512 threads, the generic kernel past that and for N off the vector), every dtype pairing, row
// strides of their own per tensor, off-alignment pointers, sum absent, dsum absent.
TEST(NormResidualGpu, RandomizedGridMatchesCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(200);
  const std::int64_t cols_choices[] = {1, 7, 8, 100, 768, 1000, 1024, 1027, 2048, 4096, 5120, 8192, 12288, 16384,
                                       20000, 32768, 65536};
  const std::int64_t rows_choices[] = {1, 3, 17, 333, 1024};
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  int cases = 0;
  for (std::int64_t cols : cols_choices) {
    for (int rep = 0; rep < 4; ++rep) {
      Case c;
      c.residual = true;
      c.kind = rep % 2 ? Kind::rms : Kind::layer;
      c.dtype = dtypes[rng() % 3];
      c.weight_dtype = (rng() % 3 == 0) ? DType::f32 : c.dtype;
      c.rows = rows_choices[rng() % 5];
      if (cols >= 16384) c.rows = std::min<std::int64_t>(c.rows, 64);
      c.cols = cols;
      c.weight = rng() % 5 != 0;
      c.bias = rng() % 3 != 0;
      c.row_pad = (rng() % 3 == 0) ? 8 * (1 + rng() % 3) + (rng() % 2) : 0;
      c.lead = (rng() % 6 == 0) ? 1 : 0;
      c.sum_absent = rng() % 4 == 0;
      c.with_dsum = rng() % 4 != 0;
      check_gpu_against_cpu(c, 2000 + cases, false);
      ++cases;
    }
  }
  EXPECT_EQ(cases, 68);
}

// The benchmark shapes in bf16 (the register kernel's full rows and the backward's tuned shapes),
// with and without dsum.
TEST(NormResidualGpu, BenchmarkShapesMatchCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{16384, 768}, {16384, 1024}, {4096, 16384}, {32768, 2048}};
  int salt = 0;
  for (auto [rows, cols] : shapes)
    for (Kind kind : {Kind::layer, Kind::rms}) {
      Case c{kind, DType::bf16, DType::bf16, rows, cols, true, kind == Kind::layer};
      c.residual = true;
      c.with_dsum = salt % 2 == 0;
      check_gpu_against_cpu(c, 5500 + salt++, false);
    }
}

TEST(NormResidualGpu, BackwardIsBitwiseDeterministic) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(17);
  for (std::int64_t cols : {768, 4096, 16384, 3001}) {
    Case c{Kind::layer, DType::bf16, DType::f32, 8192, cols, true, true};
    c.residual = true;
    SCOPED_TRACE(c.str());
    EXPECT_TRUE(backward_is_bitwise_repeatable(c, rng));
  }
}

// dx over dsum on the row kernel (N = 1024, 4096) and the generic one (N = 1001).
TEST(NormResidualGpu, DxMayBeDsumItself) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  for (Kind kind : {Kind::layer, Kind::rms})
    for (std::int64_t cols : {1024, 4096, 1001})
      check_dx_over_dsum(Device::cuda(0), kind, DType::bf16, 300, cols, 300 + salt++);
}

// Row padding of y, sum and dx stays unwritten; nothing is written before an unaligned tensor.
TEST(NormResidualGpu, PaddingAndLeadAreNeverWritten) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(18);
  for (std::int64_t lead : {0, 1}) {
    Case c{Kind::layer, DType::bf16, DType::bf16, 100, 1024, true, true, 8};
    c.residual = true;
    c.lead = lead;
    SCOPED_TRACE(c.str());
    Problem p(c, Device::cuda(0));
    fill_inputs(p, rng);
    p.poison_outputs();
    p.forward(1e-5f);
    p.backward(false);
    for (const Buffer* b : {&p.y, &*p.sum, &p.dx}) {
      EXPECT_EQ(testing::poisoned_padding(*b, c.rows, c.cols, c.row_pad), (c.rows - 1) * c.row_pad);
      EXPECT_TRUE(b->lead_untouched());
    }
  }
}

// ---- rows whose N is not a multiple of the 16-byte vector ------------------------------------------

// The (x, weight) dtype pairings the kernels are compiled for.
constexpr std::pair<DType, DType> kTypePairings[] = {{DType::f32, DType::f32},
                                                     {DType::f16, DType::f16},
                                                     {DType::f16, DType::f32},
                                                     {DType::bf16, DType::bf16},
                                                     {DType::bf16, DType::f32}};

// A case whose row strides are multiples of 8 elements (vector_rows): any N takes the row kernels,
// N % 8 != 0 (N % 4 != 0 in f32) their masked last vector.
Case vector_rows_case(Kind kind, bool residual, int pairing, std::int64_t rows, std::int64_t cols) {
  Case c{kind, kTypePairings[pairing].first, kTypePairings[pairing].second, rows, cols, true, true};
  c.residual = residual;
  c.vector_rows = true;
  return c;
}

// Every N from 1 to 1024, plain and residual, on the vector path. The norm and the dtype pairing
// go round with (N + N / 8) % 10, so that each of the 10 (norm, pairing) combinations meets every
// N % 8 several times; from y on every third group of 8 N (plain), weight or bias absent, dsum or
// the sum absent, rows padded past the rounded stride now and then. Each case checks the row
// padding of y, the sum and dx unwritten. Eight blocks of 128 N, one test each, so that the
// sanitizer shards spread them.
class EveryRowLength : public ::testing::TestWithParam<int> {};

// N from 128 * block + 1 to 128 * (block + 1), plain and residual, the norm and pairing going
// round with (N + N / 8) % 10 and the variants with the salt. Rows with strides rounded to the
// vector (vector_rows, padded now and then) or contiguous (row stride N).
void check_every_row_length(int block, bool contiguous) {
  int salt = 256 * block;
  for (std::int64_t cols = 128 * block + 1; cols <= 128 * (block + 1); ++cols)
    for (bool residual : {false, true}) {
      const int combination = static_cast<int>((cols + cols / 8) % 10);
      const Kind kind = combination % 2 ? Kind::rms : Kind::layer;
      Case c = vector_rows_case(kind, residual, combination / 2, contiguous ? 3 + salt % 5 : 2 + salt % 3, cols);
      c.vector_rows = !contiguous;
      c.weight = salt % 7 != 3;
      c.bias = salt % 5 != 2;
      c.row_pad = !contiguous && salt % 4 == 1 ? 8 : 0;
      c.with_dsum = salt % 3 != 0;
      c.sum_absent = salt % 6 == 5;
      check_gpu_against_cpu(c, (contiguous ? 25000 : 20000) + salt, !residual && (cols / 8) % 3 == 1);
      ++salt;
    }
  EXPECT_EQ(salt, 256 * (block + 1));
}

TEST_P(EveryRowLength, UpTo1024) {
  FUSEKIT_REQUIRE_GPU();
  check_every_row_length(GetParam(), false);
}

INSTANTIATE_TEST_SUITE_P(NormTailGpu, EveryRowLength, ::testing::Range(0, 8));

// The same N from 1 to 1024 in contiguous tensors (row stride N): N % 8 != 0 (N % 4 in f32) takes
// the element kernels, the rest the row kernels (teams walking several rows:
// NormElementGpu.TeamsWalkSeveralRows).
class EveryContiguousRowLength : public ::testing::TestWithParam<int> {};

TEST_P(EveryContiguousRowLength, UpTo1024) {
  FUSEKIT_REQUIRE_GPU();
  check_every_row_length(GetParam(), true);
}

INSTANTIATE_TEST_SUITE_P(NormElementGpu, EveryContiguousRowLength, ::testing::Range(0, 8));

// Row lengths drawn up to 65536 (most of them N % 8 != 0), every norm, pairing and variant at
// random, rows for about a million elements (the f32 rows past 8192 and 16-bit rows past 16384
// take the generic kernel); then short partial rows over 4099 rows, so that every row group's ring
// slots are refilled (the partial vector's cp.async into a slot the group has left).
TEST(NormTailGpu, RandomRowLengthsUpTo65536) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(300);
  int salt = 0;
  auto run = [&](std::int64_t rows, std::int64_t cols) {
    Case c = vector_rows_case(rng() % 2 ? Kind::rms : Kind::layer, rng() % 2 == 0, static_cast<int>(rng() % 5), rows,
                              cols);
    c.weight = rng() % 6 != 0;
    c.bias = rng() % 4 != 0;
    c.row_pad = rng() % 4 == 0 ? 8 : 0;
    c.with_dsum = rng() % 4 != 0;
    c.sum_absent = rng() % 5 == 0;
    check_gpu_against_cpu(c, 21000 + salt++, !c.residual && rng() % 3 == 0);
  };
  for (int i = 0; i < 40; ++i) {
    std::int64_t cols = 1025 + static_cast<std::int64_t>(rng() % 64512);
    if (i % 4 != 0 && cols % 8 == 0) cols += 1 + static_cast<std::int64_t>(rng() % 7);
    run(std::max<std::int64_t>(2, (1 << 20) / cols), cols);
  }
  for (std::int64_t cols : {1, 7, 9, 63, 65, 100, 127, 129, 255, 257, 1001, 1023}) run(4099, cols);
  EXPECT_EQ(salt, 52);
}

// Gradients of partial-vector rows, bitwise the same run to run (plain and residual).
TEST(NormTailGpu, BackwardIsBitwiseDeterministic) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(301);
  for (std::int64_t cols : {1001, 3001, 12289})
    for (bool residual : {false, true}) {
      Case c = vector_rows_case(Kind::layer, residual, residual ? 4 : 3, 4096, cols);
      SCOPED_TRACE(c.str());
      EXPECT_TRUE(backward_is_bitwise_repeatable(c, rng));
    }
}

// The override keys on partial-vector rows: other vectors per thread, a shallower ring, smaller
// blocks; each still matches the reference.
TEST(NormTailGpu, OverriddenLaunchesMatchCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  struct Cleared {
    ~Cleared() { detail::clear_overrides(); }
  } cleared;
  int salt = 0;
  for (const char* overrides : {"norm.backward.stages=2", "norm.backward.vectors=1", "norm.backward.vectors=4",
                                "norm.backward.block=128", "norm.forward.vectors=1", "norm.forward.vectors=3"}) {
    SCOPED_TRACE(overrides);
    detail::clear_overrides();
    detail::set_overrides(overrides);
    for (std::int64_t cols : {1001, 2047, 5121})
      for (bool from_output : {false, true})
        check_gpu_against_cpu(vector_rows_case(Kind::layer, false, 3, 300, cols), 22000 + salt++, from_output);
  }
}

// dsum through the backward's ring (where it fits) and read from memory (forced, and past the
// ring's reach at N = 16384), both norms, whole and partial last vectors, dx over dsum too.
TEST(NormResidualGpu, DsumFromTheRingAndFromMemory) {
  FUSEKIT_REQUIRE_GPU();
  struct Cleared {
    ~Cleared() { detail::clear_overrides(); }
  } cleared;
  int salt = 0;
  for (const char* overrides : {"norm.backward.ring_dsum=on", "norm.backward.ring_dsum=off"}) {
    SCOPED_TRACE(overrides);
    detail::clear_overrides();
    detail::set_overrides(overrides);
    for (Kind kind : {Kind::layer, Kind::rms}) {
      for (std::int64_t cols : {1024, 2048, 5120, 8192, 16384}) {
        Case c{kind, DType::bf16, DType::bf16, 300, cols, true, kind == Kind::layer};
        c.residual = true;
        c.with_dsum = true;
        check_gpu_against_cpu(c, 23000 + salt++, false);
      }
      for (std::int64_t cols : {1001, 2049, 4095}) {
        Case c = vector_rows_case(kind, true, salt % 5, 300, cols);
        c.with_dsum = true;
        check_gpu_against_cpu(c, 23000 + salt++, false);
      }
      for (std::int64_t cols : {2048, 8192})
        check_dx_over_dsum(Device::cuda(0), kind, DType::bf16, 300, cols, 23000 + salt++);
    }
    // f32 rows of three vectors a thread with g kept, one row per row group: the dx pass reads
    // dsum from the ring where the row-group tree writes next (the shape racecheck watches).
    for (std::int64_t rows : {17, 333}) {
      Case c{Kind::rms, DType::f32, DType::f32, rows, 768, true, false};
      c.residual = true;
      c.with_dsum = true;
      check_gpu_against_cpu(c, 23000 + salt++, false);
    }
  }
}


// Contiguous rows whose length is not a multiple of 8 (row strides off the 16-byte vector) take
// the element kernels up to their limits (element_shape), the generic kernel past them. One N for
// every team size and elements per thread, at both ends of each; rows enough that every team walks
// several (short rows) or that every block takes rows (long ones). Norm, dtype pairing and
// variant go round with the index.
TEST(NormElementGpu, ContiguousRowsOfAnyLength) {
  FUSEKIT_REQUIRE_GPU();
  const std::int64_t lengths[] = {1, 3, 31, 33, 100, 129, 255, 257, 259, 511, 513, 777, 1001, 2047, 2049,
                                  4095, 4097, 6143, 8191, 8193, 12289, 16383, 16385};
  int salt = 0;
  for (std::int64_t cols : lengths) {
    for (bool residual : {false, true}) {
      const int k = salt;
      Case c{k % 2 ? Kind::rms : Kind::layer, kTypePairings[k % 5].first, kTypePairings[k % 5].second,
             std::max<std::int64_t>(3, std::min<std::int64_t>(20000, (3 << 20) / cols)), cols, true, true};
      c.residual = residual;
      c.weight = k % 7 != 3;
      c.bias = k % 5 != 2;
      c.with_dsum = k % 3 != 0;
      c.sum_absent = k % 6 == 5;
      check_gpu_against_cpu(c, 23000 + salt, !residual && k % 3 == 1);
      ++salt;
    }
  }
  EXPECT_EQ(salt, 46);
}

// Teams of several warps that walk several rows each (their reductions alternate scratch buffers
// across rows): small enough for compute-sanitizer's racecheck.
TEST(NormElementGpu, TeamsWalkSeveralRows) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  for (const auto& [rows, cols] : {std::pair<std::int64_t, std::int64_t>{6000, 1001}, {3000, 3001}})
    for (Kind kind : {Kind::layer, Kind::rms})
      for (bool residual : {false, true}) {
        Case c{kind, DType::bf16, DType::bf16, rows, cols, true, kind == Kind::layer};
        c.residual = residual;
        check_gpu_against_cpu(c, 24000 + salt++, false);
      }
  EXPECT_EQ(salt, 8);
}

// The element kernels' gradients are bitwise the same run to run: each team's column sums, the
// teams added in order into their block's partial row, the partial rows in order.
TEST(NormElementGpu, BackwardIsBitwiseDeterministic) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(24);
  for (std::int64_t cols : {259, 3001, 7999}) {
    for (bool residual : {false, true}) {
      Case c{Kind::layer, DType::bf16, DType::f32, 20000, cols, true, true};
      c.residual = residual;
      SCOPED_TRACE(c.str());
      EXPECT_TRUE(backward_is_bitwise_repeatable(c, rng));
    }
  }
}

}  // namespace
}  // namespace fusekit
