// Cross-entropy: the CPU reference against its closed form and against finite differences, the
// CUDA kernels against the CPU reference over a randomized grid (every dtype, both target types,
// every option, ignored rows, in place, padded and misaligned rows, forced cluster sizes, the
// largest vocabulary), bitwise determinism, invalid targets on the GPU, and argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "core/overrides.h"
#include "fusekit/cross_entropy.h"
#include "fusekit/error.h"
#include "tests/harness/error_testing.h"
#include "tests/harness/gtest_helpers.h"

namespace fusekit {
namespace {

using testing::Buffer;
using testing::close_to_reference;
using testing::error_of;

constexpr LossReduction kReductions[] = {LossReduction::none, LossReduction::mean, LossReduction::sum};

struct Case {
  DType dtype = DType::bf16;
  DType target_dtype = DType::i64;
  std::int64_t rows = 1, cols = 1;
  std::int64_t logits_pad = 0;   // extra elements between rows of the logits
  std::int64_t dlogits_pad = 0;  // and of dlogits (a separate buffer)
  bool in_place = false;         // dlogits is the logits
  double ignored = 0.0;          // fraction of rows whose target is ignore_index
  double logit_scale = 2.0;      // logits ~ N(0, logit_scale)
  CrossEntropyConfig config;
  std::string str() const {
    return std::string(dtype_name(dtype)) + "/" + dtype_name(target_dtype) + " (" + std::to_string(rows) + ", " +
           std::to_string(cols) + ") " + loss_reduction_name(config.reduction) + " s=" +
           std::to_string(config.label_smoothing) + " z=" + std::to_string(config.z_loss) + " ignore " +
           std::to_string(config.ignore_index) + " (" + std::to_string(ignored) + ")" +
           (in_place ? " in place" : "") + (logits_pad ? " pad " + std::to_string(logits_pad) : "") +
           (dlogits_pad ? " dpad " + std::to_string(dlogits_pad) : "");
  }
  std::int64_t loss_values() const { return config.reduction == LossReduction::none ? rows : 1; }
};

// All tensors of one problem on one device.
struct Problem {
  Case c;
  Device device;
  Buffer logits, targets, loss, lse, dloss;
  std::optional<Buffer> dlogits_buffer, workspace;

  Problem(const Case& c_, Device d)
      : c(c_), device(d), logits(c.dtype, d, {c.rows, c.cols}, {c.cols + c.logits_pad, 1}),
        targets(c.target_dtype, d, {c.rows}), loss(DType::f32, d, {c.loss_values()}), lse(DType::f32, d, {c.rows}),
        dloss(DType::f32, d, {c.loss_values()}) {
    if (!c.in_place) dlogits_buffer.emplace(c.dtype, d, std::vector<std::int64_t>{c.rows, c.cols},
                                            std::vector<std::int64_t>{c.cols + c.dlogits_pad, 1});
    const std::size_t ws = cross_entropy_workspace_size(c.rows, c.cols, c.config.reduction, d);
    if (ws > 0) workspace.emplace(DType::u8, d, std::vector<std::int64_t>{static_cast<std::int64_t>(ws)});
  }

  TensorView dlogits() const { return c.in_place ? logits.view() : dlogits_buffer->view(); }
  const Buffer& dlogits_values_buffer() const { return c.in_place ? logits : *dlogits_buffer; }
  OptionalTensor ws() const { return workspace ? OptionalTensor(workspace->view()) : std::nullopt; }

  void forward() { cross_entropy_forward(logits.view(), targets.view(), c.config, loss.view(), lse.view(), ws()); }
  void backward() {
    cross_entropy_backward(dloss.view(), logits.view(), targets.view(), lse.view(), c.config, dlogits(), ws());
  }
  void fused() {
    cross_entropy_forward_backward(logits.view(), targets.view(), c.config, loss.view(), dlogits(), lse.view(), ws());
  }
  void poison_outputs() {
    loss.poison();
    lse.poison();
    if (dlogits_buffer) dlogits_buffer->poison();
  }
};

// Targets uniform over the classes, a fraction `ignored` of the rows set to ignore_index; unless
// every row is to be ignored, row 0 counts (a class other than ignore_index where there is one).
std::vector<double> random_targets(const Case& c, std::mt19937_64& rng) {
  std::vector<double> t(c.rows);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (auto& v : t)
    v = u(rng) < c.ignored ? static_cast<double>(c.config.ignore_index) : static_cast<double>(rng() % c.cols);
  if (c.rows > 0 && c.ignored < 1.0) t[0] = c.config.ignore_index == 0 ? static_cast<double>(c.cols - 1) : 0.0;
  return t;
}

struct Inputs {
  std::vector<double> logits, targets, dloss;
};

Inputs random_inputs(const Case& c, std::mt19937_64& rng) {
  Inputs in;
  Buffer scratch(DType::f64, Device::cpu(), {c.rows, c.cols});
  scratch.fill_normal(rng, 0.0, c.logit_scale);
  in.logits = scratch.values();
  in.targets = random_targets(c, rng);
  std::normal_distribution<double> n(0.0, 1.0);
  in.dloss.resize(c.loss_values());
  for (auto& v : in.dloss) v = c.config.reduction == LossReduction::none ? n(rng) : 1.0 + std::abs(n(rng));
  return in;
}

void set_inputs(Problem& p, const Inputs& in) {
  p.logits.set_values(in.logits);
  p.targets.set_values(in.targets);
  p.dloss.set_values(in.dloss);
}

// The three calls' results. The backward runs from `backward_lse` (the same values on both
// devices), the logits restored before every call (in place overwrites them).
struct Results {
  std::vector<double> loss, lse, dlogits_backward, fused_loss, fused_lse, fused_dlogits;
};

Results run_all(Problem& p, const Inputs& in, const std::vector<double>* backward_lse) {
  Results r;
  set_inputs(p, in);
  p.poison_outputs();
  p.forward();
  r.loss = p.loss.values();
  r.lse = p.lse.values();
  p.poison_outputs();
  p.lse.set_values(backward_lse ? *backward_lse : r.lse);
  p.backward();
  r.dlogits_backward = p.dlogits_values_buffer().values();
  p.logits.set_values(in.logits);
  p.poison_outputs();
  p.fused();
  r.fused_loss = p.loss.values();
  r.fused_lse = p.lse.values();
  r.fused_dlogits = p.dlogits_values_buffer().values();
  return r;
}

// The norm of the gradient's terms g * softmax and g at the target: at least sqrt(sum g_r^2) over
// the rows not ignored (the floor for the cancellation at the target, as the tolerance rule allows).
double gradient_terms_norm(const Case& c, const Inputs& in, bool fused) {
  std::int64_t counted = 0;
  for (double t : in.targets) counted += t != static_cast<double>(c.config.ignore_index);
  double sum = 0.0;
  for (std::int64_t r = 0; r < c.rows; ++r) {
    if (in.targets[r] == static_cast<double>(c.config.ignore_index)) continue;
    double g = fused ? 1.0 : in.dloss[c.config.reduction == LossReduction::none ? r : 0];
    if (c.config.reduction == LossReduction::mean) g /= static_cast<double>(std::max<std::int64_t>(1, counted));
    sum += g * g;
  }
  return std::sqrt(sum);
}

// The norm of the loss's largest terms, lse, reduced as the loss is (over the rows not ignored):
// the floor for the cancellation in lse - x_t (V = 1: the loss is z lse^2 or 0).
double loss_terms_norm(const Case& c, const Inputs& in, const std::vector<double>& lse) {
  double squares = 0.0, magnitudes = 0.0;
  std::int64_t counted = 0;
  for (std::int64_t r = 0; r < c.rows; ++r) {
    if (in.targets[r] == static_cast<double>(c.config.ignore_index)) continue;
    squares += lse[r] * lse[r];
    magnitudes += std::abs(lse[r]);
    ++counted;
  }
  switch (c.config.reduction) {
    case LossReduction::none: return std::sqrt(squares);
    case LossReduction::sum: return magnitudes;
    case LossReduction::mean: return counted > 0 ? magnitudes / static_cast<double>(counted) : 0.0;
  }
  return 0.0;
}

void expect_results_close(const Case& c, const Inputs& in, const Results& gpu, const Results& cpu) {
  const double loss_floor = loss_terms_norm(c, in, cpu.lse);
  EXPECT_TRUE(close_to_reference(gpu.loss, cpu.loss, DType::f32, "loss", loss_floor));
  EXPECT_TRUE(close_to_reference(gpu.lse, cpu.lse, DType::f32, "lse"));
  EXPECT_TRUE(close_to_reference(gpu.dlogits_backward, cpu.dlogits_backward, c.dtype, "dlogits (backward)",
                                 gradient_terms_norm(c, in, false)));
  EXPECT_TRUE(close_to_reference(gpu.fused_loss, cpu.fused_loss, DType::f32, "loss (fused)", loss_floor));
  EXPECT_TRUE(close_to_reference(gpu.fused_lse, cpu.fused_lse, DType::f32, "lse (fused)"));
  EXPECT_TRUE(close_to_reference(gpu.fused_dlogits, cpu.fused_dlogits, c.dtype, "dlogits (fused)",
                                 gradient_terms_norm(c, in, true)));
}

void check_gpu_against_cpu(const Case& c, std::uint64_t salt) {
  SCOPED_TRACE(c.str());
  auto rng = testing::make_rng(salt);
  const Inputs in = random_inputs(c, rng);
  Problem cpu(c, Device::cpu()), gpu(c, Device::cuda(0));
  const Results ref = run_all(cpu, in, nullptr);
  const Results got = run_all(gpu, in, &ref.lse);
  expect_results_close(c, in, got, ref);
}

// An override key set for the scope of a test.
class ScopedOverride {
 public:
  ScopedOverride(const char* key, const std::string& value) : key_(key) { detail::set_override(key, value); }
  ~ScopedOverride() { detail::set_override(key_, ""); }

 private:
  const char* key_;
};

// ---- CPU reference -------------------------------------------------------------------------

double logsumexp(const std::vector<double>& x) {
  const double m = *std::max_element(x.begin(), x.end());
  double s = 0.0;
  for (double v : x) s += std::exp(v - m);
  return m + std::log(s);
}

TEST(CrossEntropyCpu, ForwardFollowsTheDefinition) {
  auto rng = testing::make_rng(1);
  for (LossReduction reduction : kReductions) {
    Case c;
    c.dtype = DType::f32;
    c.rows = 9;
    c.cols = 13;
    c.logits_pad = 3;
    c.ignored = 0.3;
    c.config = {5, 0.2f, 1e-3f, reduction};  // ignore_index 5 is also a class: those rows are ignored
    SCOPED_TRACE(c.str());
    const Inputs in = random_inputs(c, rng);
    Problem p(c, Device::cpu());
    set_inputs(p, in);
    p.forward();
    const auto loss = p.loss.values(), lse = p.lse.values();
    double total = 0.0;
    std::int64_t counted = 0;
    std::vector<double> rows(c.rows);
    for (std::int64_t r = 0; r < c.rows; ++r) {
      const std::vector<double> x(in.logits.begin() + r * c.cols, in.logits.begin() + (r + 1) * c.cols);
      const double l = logsumexp(x);
      EXPECT_NEAR(lse[r], l, 1e-6 * std::abs(l));
      const auto t = static_cast<std::int64_t>(in.targets[r]);
      if (t == c.config.ignore_index) continue;
      // (1 - s) * -log p_t + s * mean_j(-log p_j) + z lse^2
      double smooth = 0.0;
      for (double v : x) smooth += l - v;
      const double s = c.config.label_smoothing, z = c.config.z_loss;
      rows[r] = (1.0 - s) * (l - x[t]) + s * smooth / static_cast<double>(c.cols) + z * l * l;
      total += rows[r];
      ++counted;
    }
    ASSERT_GT(counted, 0);
    if (reduction == LossReduction::none) {
      for (std::int64_t r = 0; r < c.rows; ++r) EXPECT_NEAR(loss[r], rows[r], 1e-6 * std::max(1.0, rows[r]));
    } else {
      const double expected = reduction == LossReduction::sum ? total : total / static_cast<double>(counted);
      EXPECT_NEAR(loss[0], expected, 1e-6 * expected);
    }
  }
}

// d/dlogits of sum(dloss * loss) by central differences, against the backward; the fused call's
// gradient (of the loss itself) against the backward's scaled by dloss.
TEST(CrossEntropyCpu, GradientsMatchFiniteDifferences) {
  auto rng = testing::make_rng(2);
  int salt = 0;
  for (LossReduction reduction : kReductions)
    for (float smoothing : {0.0f, 0.3f})
      for (float z : {0.0f, 0.05f}) {
        Case c;
        c.dtype = DType::f32;
        c.rows = 5;
        c.cols = 6;
        c.ignored = salt++ % 2 == 0 ? 0.0 : 0.3;
        c.logit_scale = 1.0;
        c.config = {-100, smoothing, z, reduction};
        SCOPED_TRACE(c.str());
        const Inputs in = random_inputs(c, rng);
        Problem p(c, Device::cpu());
        set_inputs(p, in);
        p.forward();
        p.backward();
        const auto dlogits = p.dlogits_values_buffer().values();
        auto objective = [&] {
          p.forward();
          const auto loss = p.loss.values();
          double l = 0.0;
          for (std::size_t i = 0; i < loss.size(); ++i) l += loss[i] * in.dloss[i];
          return l;
        };
        int nonzero = 0;
        for (std::int64_t i = 0; i < c.rows * c.cols; ++i) {
          const double fd = testing::central_difference(p.logits, i, 1e-2, objective);
          EXPECT_NEAR(dlogits[i], fd, 2e-3 * std::max(1.0, std::abs(fd))) << "element " << i;
          nonzero += dlogits[i] != 0.0;
        }
        EXPECT_GT(nonzero, 0);
        Problem q(c, Device::cpu());
        set_inputs(q, in);
        q.fused();
        const auto fused = q.dlogits_values_buffer().values();
        for (std::int64_t r = 0; r < c.rows; ++r)
          for (std::int64_t j = 0; j < c.cols; ++j) {
            const double g = in.dloss[reduction == LossReduction::none ? r : 0];
            EXPECT_NEAR(fused[r * c.cols + j] * g, dlogits[r * c.cols + j], 2e-6 * std::max(1.0, std::abs(g)))
                << r << ", " << j;
          }
      }
}

TEST(CrossEntropyCpu, AllIgnoredBatchHasZeroLossAndGradient) {
  for (LossReduction reduction : kReductions) {
    Case c;
    c.dtype = DType::f32;
    c.rows = 4;
    c.cols = 10;
    c.ignored = 1.0;
    c.config.reduction = reduction;
    auto rng = testing::make_rng(4);
    const Inputs in = random_inputs(c, rng);
    Problem p(c, Device::cpu());
    set_inputs(p, in);
    p.fused();
    for (double v : p.loss.values()) EXPECT_EQ(v, 0.0);
    for (double v : p.dlogits_values_buffer().values()) EXPECT_EQ(v, 0.0);
    for (double v : p.lse.values()) EXPECT_TRUE(std::isfinite(v));  // lse of every row, ignored or not
    p.backward();
    for (double v : p.dlogits_values_buffer().values()) EXPECT_EQ(v, 0.0);
  }
  // No rows at all: the mean and the sum are 0.
  for (LossReduction reduction : {LossReduction::mean, LossReduction::sum}) {
    Case c;
    c.rows = 0;
    c.cols = 8;
    c.config.reduction = reduction;
    Problem p(c, Device::cpu());
    p.loss.poison();
    p.forward();
    EXPECT_EQ(p.loss.values()[0], 0.0);
  }
}

TEST(CrossEntropyCpu, InPlaceGivesTheSameGradient) {
  auto rng = testing::make_rng(5);
  for (LossReduction reduction : kReductions) {
    Case c;
    c.dtype = DType::bf16;
    c.rows = 6;
    c.cols = 33;
    c.logits_pad = 7;
    c.ignored = 0.2;
    c.config = {-100, 0.1f, 1e-4f, reduction};
    Case in_place = c;
    in_place.in_place = true;
    const Inputs in = random_inputs(c, rng);
    Problem a(c, Device::cpu()), b(in_place, Device::cpu());
    const Results ra = run_all(a, in, nullptr), rb = run_all(b, in, &ra.lse);
    EXPECT_EQ(ra.fused_dlogits, rb.fused_dlogits);
    EXPECT_EQ(ra.dlogits_backward, rb.dlogits_backward);
    EXPECT_EQ(ra.fused_loss, rb.fused_loss);
  }
}

// ---- argument errors (CPU tensors: checks run before any backend) ----------------------------

TEST(CrossEntropyErrors, EachBadArgumentIsNamed) {
  const Device cpu = Device::cpu();
  std::vector<float> xb(4 * 8, 0.5f), db(4 * 8), lb(4), sb(4), gb(4, 1.0f);
  std::vector<std::int64_t> tb = {1, 2, -100, 7};
  TensorView x(xb.data(), DType::f32, cpu, {4, 8}), dx(db.data(), DType::f32, cpu, {4, 8});
  TensorView t(tb.data(), DType::i64, cpu, {4});
  TensorView loss_rows(lb.data(), DType::f32, cpu, {4}), loss1(lb.data(), DType::f32, cpu, {});
  TensorView lse(sb.data(), DType::f32, cpu, {4}), dloss1(gb.data(), DType::f32, cpu, {1});
  const CrossEntropyConfig mean;  // ignore_index -100, reduction mean
  const std::string fwd = "fusekit.cross_entropy_forward: ", bwd = "fusekit.cross_entropy_backward: ",
                    fused = "fusekit.cross_entropy_forward_backward: ";

  // The valid calls, in place included.
  EXPECT_EQ(error_of([&] { cross_entropy_forward(x, t, mean, loss1, lse); }), "no error");
  EXPECT_EQ(error_of([&] { cross_entropy_backward(dloss1, x, t, lse, mean, dx); }), "no error");
  EXPECT_EQ(error_of([&] { cross_entropy_forward_backward(x, t, mean, loss1, x, lse); }), "no error");

  // Options.
  for (float s : {1.0f, -0.1f, std::nanf("")}) {
    CrossEntropyConfig bad = mean;
    bad.label_smoothing = s;
    EXPECT_NE(error_of([&] { cross_entropy_forward(x, t, bad, loss1); })
                  .find(fwd + "argument 'label_smoothing': expected a label smoothing in [0, 1), got "),
              std::string::npos);
  }
  for (float z : {-1e-4f, INFINITY, std::nanf("")}) {
    CrossEntropyConfig bad = mean;
    bad.z_loss = z;
    EXPECT_NE(error_of([&] { cross_entropy_backward(dloss1, x, t, lse, bad, dx); })
                  .find(bwd + "argument 'z_loss': expected a finite z-loss coefficient >= 0"),
              std::string::npos);
  }
  CrossEntropyConfig bad_reduction = mean;
  bad_reduction.reduction = static_cast<LossReduction>(7);
  EXPECT_EQ(error_of([&] { cross_entropy_forward(x, t, bad_reduction, loss1); }),
            fwd + "argument 'reduction': expected one of none, mean, sum, got value 7");

  // logits: dtype, a vocabulary past the limit, a strided last dimension.
  std::vector<double> x64(32);
  EXPECT_EQ(error_of([&] { cross_entropy_forward(TensorView(x64.data(), DType::f64, cpu, {4, 8}), t, mean, loss1); }),
            fwd + "argument 'logits': expected dtype f32, f16 or bf16, got f64");
  EXPECT_EQ(error_of([&] {
              cross_entropy_forward(TensorView(xb.data(), DType::f32, cpu, {1, kCrossEntropyMaxClasses + 1}),
                                    TensorView(tb.data(), DType::i64, cpu, {1}), mean, loss1);
            }),
            fwd + "argument 'logits': expected a last dimension N in 1..262144, got N = 262145");
  EXPECT_NE(error_of([&] { cross_entropy_forward(TensorView(xb.data(), DType::f32, cpu, {4, 4}, {8, 2}), t, mean, loss1); })
                .find("argument 'logits': expected a contiguous last dimension"),
            std::string::npos);

  // targets: dtype and count.
  EXPECT_EQ(error_of([&] { cross_entropy_forward(x, TensorView(sb.data(), DType::f32, cpu, {4}), mean, loss1); }),
            fwd + "argument 'targets': expected dtype i32 or i64, got f32");
  EXPECT_EQ(error_of([&] { cross_entropy_forward(x, TensorView(tb.data(), DType::i64, cpu, {3}), mean, loss1); }),
            fwd + "argument 'targets': expected 4 elements, got 3 (shape (3))");
  // A target outside [0, V) that is not ignore_index (8 here, V = 8): the CPU refuses it.
  std::vector<std::int64_t> bad_targets = {1, 2, 8, 0};
  EXPECT_EQ(error_of([&] { cross_entropy_forward(x, TensorView(bad_targets.data(), DType::i64, cpu, {4}), mean, loss1); }),
            fwd + "argument 'targets': expected class indices in [0, 8) or ignore_index (-100), got target 8 at row 2");
  std::vector<std::int32_t> negative = {1, -1, 0, 0};
  EXPECT_NE(error_of([&] {
              cross_entropy_forward_backward(x, TensorView(negative.data(), DType::i32, cpu, {4}), mean, loss1, dx);
            }).find(fused + "argument 'targets': expected class indices in [0, 8) or ignore_index (-100), got target -1 at row 1"),
            std::string::npos);

  // loss / dloss: one value for mean and sum, T for none; float32.
  CrossEntropyConfig none = mean;
  none.reduction = LossReduction::none;
  EXPECT_EQ(error_of([&] { cross_entropy_forward(x, t, mean, loss_rows); }),
            fwd + "argument 'loss': expected 1 elements, got 4 (shape (4))");
  EXPECT_EQ(error_of([&] { cross_entropy_forward(x, t, none, loss1); }),
            fwd + "argument 'loss': expected 4 elements, got 1 (shape ())");
  EXPECT_EQ(error_of([&] { cross_entropy_forward(x, t, none, TensorView(tb.data(), DType::i64, cpu, {4})); }),
            fwd + "argument 'loss': expected dtype f32 (float32 losses), got i64");
  EXPECT_EQ(error_of([&] { cross_entropy_backward(loss_rows, x, t, lse, mean, dx); }),
            bwd + "argument 'dloss': expected 1 elements, got 4 (shape (4))");
  EXPECT_EQ(error_of([&] { cross_entropy_backward(dloss1, x, t, lse, none, dx); }),
            bwd + "argument 'dloss': expected 4 elements, got 1 (shape (1))");
  // lse: T float32 values.
  EXPECT_EQ(error_of([&] { cross_entropy_forward(x, t, mean, loss1, TensorView(sb.data(), DType::f32, cpu, {3})); }),
            fwd + "argument 'lse': expected 4 elements, got 3 (shape (3))");
  EXPECT_EQ(error_of([&] { cross_entropy_backward(dloss1, x, t, TensorView(sb.data(), DType::f32, cpu, {2}), mean, dx); }),
            bwd + "argument 'lse': expected 4 elements, got 2 (shape (2))");
  // dlogits: the logits' shape and dtype.
  EXPECT_EQ(error_of([&] { cross_entropy_backward(dloss1, x, t, lse, mean, TensorView(db.data(), DType::f32, cpu, {8, 4})); }),
            bwd + "argument 'dlogits': expected shape (4, 8) (as 'logits'), got (8, 4)");
  EXPECT_EQ(error_of([&] {
              cross_entropy_forward_backward(x, t, mean, loss1, TensorView(db.data(), DType::bf16, cpu, {4, 8}));
            }),
            fused + "argument 'dlogits': expected dtype f32 (as 'logits'), got bf16");

  // Overlaps: dlogits over the logits other than exactly (one row off), loss over the logits,
  // lse over loss.
  std::vector<float> big(5 * 8, 0.5f);
  TensorView rows_0_3(big.data(), DType::f32, cpu, {4, 8}), rows_1_4(big.data() + 8, DType::f32, cpu, {4, 8});
  EXPECT_EQ(error_of([&] { cross_entropy_forward_backward(rows_0_3, t, mean, loss1, rows_1_4); }),
            fused + "argument 'dlogits': expected memory that does not overlap 'logits', got a view sharing bytes "
                    "with 'logits'");
  EXPECT_EQ(error_of([&] { cross_entropy_forward(x, t, mean, TensorView(xb.data(), DType::f32, cpu, {})); }),
            fwd + "argument 'loss': expected memory that does not overlap 'logits', got a view sharing bytes with "
                  "'logits'");
  EXPECT_EQ(error_of([&] { cross_entropy_forward(x, t, none, loss_rows, loss_rows); }),
            fwd + "argument 'loss': expected memory that does not overlap 'lse', got a view sharing bytes with 'lse'");
  // Devices: the targets claim a GPU while the logits are on the CPU (only metadata is read).
  EXPECT_EQ(error_of([&] { cross_entropy_forward(x, TensorView(tb.data(), DType::i64, Device::cuda(0), {4}), mean, loss1); }),
            fwd + "argument 'targets': expected a tensor on cpu (where 'logits' is), got a tensor on cuda:0");
}

TEST(CrossEntropyErrors, WorkspaceQueryChecksItsArguments) {
  EXPECT_EQ(cross_entropy_workspace_size(8192, 128256, LossReduction::mean, Device::cpu()), 0u);
  for (Device device : {Device::cpu(), Device::cuda(0)}) {  // refused before any CUDA call
    testing::expect_error([&] { cross_entropy_workspace_size(-1, 64, LossReduction::sum, device); },
                          ErrorKind::invalid_argument, "rows", "got -1");
    testing::expect_error([&] { cross_entropy_workspace_size(64, 0, LossReduction::sum, device); },
                          ErrorKind::invalid_argument, "classes", "got 0");
    testing::expect_error([&] { cross_entropy_workspace_size(64, kCrossEntropyMaxClasses + 1, LossReduction::sum, device); },
                          ErrorKind::invalid_argument, "classes");
    testing::expect_error([&] { cross_entropy_workspace_size(64, 64, static_cast<LossReduction>(9), device); },
                          ErrorKind::invalid_argument, "reduction");
  }
  // Metadata only: the GPU size needs no GPU. Reduction none needs nothing; mean and sum the row
  // losses and the scale slot.
  EXPECT_EQ(cross_entropy_workspace_size(1000, 32000, LossReduction::none, Device::cuda(0)), 0u);
  EXPECT_GE(cross_entropy_workspace_size(1000, 32000, LossReduction::mean, Device::cuda(0)), 1000u * 4);
  EXPECT_EQ(cross_entropy_workspace_size(0, 32000, LossReduction::mean, Device::cuda(0)), 0u);
}

// ---- GPU ---------------------------------------------------------------------------------------

TEST(CrossEntropyGpu, RandomizedGridMatchesCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(100);
  // Multiples of 8 and not (the scalar head and tail), one vector and less, a cluster's worth.
  const std::int64_t cols_choices[] = {1, 2, 7, 8, 13, 100, 1000, 1001, 4096, 5003, 32000, 50257};
  const std::int64_t rows_choices[] = {1, 2, 3, 17, 64, 300};
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  int cases = 0;
  for (std::int64_t cols : cols_choices)
    for (LossReduction reduction : kReductions)
      for (int k = 0; k < 2; ++k) {
        Case c;
        c.dtype = dtypes[rng() % 3];
        c.target_dtype = rng() % 2 ? DType::i32 : DType::i64;
        c.rows = rows_choices[rng() % 6];
        c.cols = cols;
        c.in_place = rng() % 3 == 0;
        c.logits_pad = rng() % 3 == 0 ? 1 + rng() % 9 : 0;
        c.dlogits_pad = !c.in_place && rng() % 3 == 0 ? c.logits_pad + 8 * (rng() % 2) : c.logits_pad;
        c.ignored = k == 0 ? 0.0 : 0.25;
        c.config = {rng() % 4 == 0 ? static_cast<std::int64_t>(rng() % cols) : -100,
                    rng() % 2 ? 0.1f : 0.0f, rng() % 2 ? 1e-3f : 0.0f, reduction};
        check_gpu_against_cpu(c, 1000 + cases++);
      }
  EXPECT_EQ(cases, 12 * 3 * 2);
}

// Every cluster size and block width on rows that leave some blocks with nothing to do (V = 7 over
// 8 blocks) and rows whose slices straddle the scalar head and tail; the backward's chunks alike.
TEST(CrossEntropyGpu, ForcedLaunchShapesMatchCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  for (const char* cluster : {"1", "2", "4", "8"})
    for (const char* threads : {"64", "128", "256"})
      for (std::int64_t cols : {7, 1001, 20003}) {
        ScopedOverride c_override("cross_entropy.cluster", cluster), t_override("cross_entropy.threads", threads),
            chunk_override("cross_entropy.backward.chunks", cluster);
        Case c;
        c.dtype = salt % 2 ? DType::bf16 : DType::f32;
        c.rows = 5;
        c.cols = cols;
        c.logits_pad = salt % 3;
        c.dlogits_pad = c.logits_pad;
        c.ignored = 0.2;
        c.in_place = salt % 4 == 1;
        c.config = {-100, 0.05f, 1e-4f, kReductions[salt % 3]};
        check_gpu_against_cpu(c, 2000 + salt++);
      }
}

// The staged kernel (the row in shared memory), forced on rows that also take it by default and on
// small batches that would not: every dtype, rows with a scalar head and tail, rows of one piece
// or less, in place, padded rows, dlogits misaligned against the logits (every element a scalar),
// every block width, rows up to the largest that fits, and longer rows whose rest streams past
// shared memory.
TEST(CrossEntropyGpu, StagedKernelMatchesCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(7100);
  ScopedOverride staged("cross_entropy.staged", "on");
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  int salt = 0;
  for (std::int64_t cols : {1, 3, 8, 29, 1001, 4096, 20003, 32000, 50257, 60001, 128256, 151936})
    for (const char* threads : {"", "64", "256"}) {
      ScopedOverride t_override("cross_entropy.threads", threads);
      Case c;
      c.dtype = dtypes[salt % 3];
      c.target_dtype = salt % 2 ? DType::i32 : DType::i64;
      c.rows = 1 + static_cast<std::int64_t>(rng() % (cols > 50257 ? 40 : 300));
      c.cols = cols;
      c.in_place = salt % 3 == 0;
      c.logits_pad = salt % 4 == 1 ? 1 + static_cast<std::int64_t>(rng() % 9) : 0;
      c.dlogits_pad = !c.in_place && salt % 5 == 2 ? c.logits_pad + 3 : c.logits_pad;
      c.ignored = salt % 2 ? 0.2 : 0.0;
      c.config = {-100, salt % 3 == 1 ? 0.1f : 0.0f, salt % 4 == 2 ? 1e-3f : 0.0f, kReductions[salt % 3]};
      check_gpu_against_cpu(c, 7000 + salt++);
    }
  EXPECT_EQ(salt, 12 * 3);
}

TEST(CrossEntropyGpu, LargestVocabularyMatchesCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  for (DType dtype : {DType::bf16, DType::f32, DType::f16})
    for (std::int64_t cols : {kCrossEntropyMaxClasses, std::int64_t{128256}, std::int64_t{151936}}) {
      Case c;
      c.dtype = dtype;
      c.rows = 24;
      c.cols = cols;
      c.ignored = 0.1;
      c.in_place = salt % 2 == 0;
      c.config = {-100, salt % 2 ? 0.1f : 0.0f, 1e-4f, kReductions[salt % 3]};
      check_gpu_against_cpu(c, 3000 + salt++);
    }
}

// A training step's shape: many rows (the grid is several waves), each kind of vocabulary.
TEST(CrossEntropyGpu, BenchmarkLikeShapesMatchCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  for (std::int64_t cols : {32000, 50257, 128256}) {
    Case c;
    c.dtype = DType::bf16;
    c.rows = 512;
    c.cols = cols;
    c.in_place = true;
    c.ignored = 0.05;
    c.config = {-100, 0.0f, 0.0f, LossReduction::mean};
    check_gpu_against_cpu(c, 4000 + salt++);
  }
}

// dlogits whose rows sit at another offset from a 16-byte boundary than the logits' rows: every
// element goes through the scalar path.
TEST(CrossEntropyGpu, MisalignedDlogitsTakeTheScalarPath) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  for (DType dtype : {DType::bf16, DType::f32})
    for (std::int64_t dpad : {1, 3}) {
      Case c;
      c.dtype = dtype;
      c.rows = 33;
      c.cols = 4096;
      c.dlogits_pad = dpad;
      c.config = {-100, 0.1f, 0.0f, LossReduction::sum};
      check_gpu_against_cpu(c, 5000 + salt++);
    }
}

TEST(CrossEntropyGpu, AllIgnoredBatchHasZeroLossAndGradient) {
  FUSEKIT_REQUIRE_GPU();
  for (LossReduction reduction : kReductions) {
    Case c;
    c.rows = 40;
    c.cols = 3001;
    c.ignored = 1.0;
    c.config.reduction = reduction;
    auto rng = testing::make_rng(6);
    const Inputs in = random_inputs(c, rng);
    Problem p(c, Device::cuda(0));
    set_inputs(p, in);
    p.poison_outputs();
    p.fused();
    for (double v : p.loss.values()) EXPECT_EQ(v, 0.0);
    for (double v : p.dlogits_values_buffer().values()) ASSERT_EQ(v, 0.0);
    p.dlogits_buffer->poison();
    p.backward();
    for (double v : p.dlogits_values_buffer().values()) ASSERT_EQ(v, 0.0);
    p.poison_outputs();
    p.forward();
    for (double v : p.loss.values()) EXPECT_EQ(v, 0.0);
  }
}

TEST(CrossEntropyGpu, EmptyBatch) {
  FUSEKIT_REQUIRE_GPU();
  for (LossReduction reduction : {LossReduction::mean, LossReduction::sum}) {
    Case c;
    c.rows = 0;
    c.cols = 512;
    c.config.reduction = reduction;
    Problem p(c, Device::cuda(0));
    p.loss.poison();
    p.fused();
    EXPECT_EQ(p.loss.values()[0], 0.0);
    p.loss.poison();
    p.forward();
    EXPECT_EQ(p.loss.values()[0], 0.0);
    p.backward();
  }
}

// A target outside [0, V) that is not ignore_index: no error on the GPU (that would need a
// synchronization), but a NaN loss for its row, a NaN mean, and a NaN gradient row.
TEST(CrossEntropyGpu, InvalidTargetGivesNaN) {
  FUSEKIT_REQUIRE_GPU();
  for (LossReduction reduction : kReductions)
    for (std::int64_t bad : {std::int64_t{5000}, std::int64_t{-3}}) {
      Case c;
      c.rows = 6;
      c.cols = 5000;
      c.config.reduction = reduction;
      auto rng = testing::make_rng(7);
      Inputs in = random_inputs(c, rng);
      in.targets[2] = static_cast<double>(bad);
      Problem p(c, Device::cuda(0));
      set_inputs(p, in);
      p.poison_outputs();
      p.fused();
      const auto loss = p.loss.values(), lse = p.lse.values(), dlogits = p.dlogits_values_buffer().values();
      for (std::int64_t r = 0; r < c.rows; ++r) {
        EXPECT_TRUE(std::isfinite(lse[r])) << r;
        if (reduction == LossReduction::none) {
          EXPECT_EQ(std::isnan(loss[r]), r == 2) << r;
        }
        for (std::int64_t j = 0; j < c.cols; j += 97) EXPECT_EQ(std::isnan(dlogits[r * c.cols + j]), r == 2) << r;
      }
      if (reduction != LossReduction::none) {
        EXPECT_TRUE(std::isnan(loss[0]));
      }
    }
}

TEST(CrossEntropyGpu, ResultsAreBitwiseDeterministic) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  for (std::int64_t cols : {50257, 262144})
    for (LossReduction reduction : kReductions) {
      Case c;
      c.dtype = DType::bf16;
      c.rows = cols > 100000 ? 64 : 2048;
      c.cols = cols;
      c.ignored = 0.1;
      c.config = {-100, 0.1f, 1e-4f, reduction};
      SCOPED_TRACE(c.str());
      auto rng = testing::make_rng(8 + salt++);
      const Inputs in = random_inputs(c, rng);
      Problem p(c, Device::cuda(0));
      set_inputs(p, in);
      EXPECT_TRUE(testing::same_bytes_every_run(
          [&] {
            p.poison_outputs();
            p.fused();
          },
          {&p.loss, &p.lse, &*p.dlogits_buffer}));
      EXPECT_TRUE(testing::same_bytes_every_run(
          [&] {
            p.poison_outputs();
            p.forward();
          },
          {&p.loss, &p.lse}));
    }
}

TEST(CrossEntropyGpu, RowPaddingIsNeverWritten) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(9);
  for (std::int64_t pad : {8, 5}) {
    Case c;
    c.rows = 50;
    c.cols = 1000;
    c.dlogits_pad = pad;
    c.ignored = 0.2;
    const Inputs in = random_inputs(c, rng);
    Problem p(c, Device::cuda(0));
    set_inputs(p, in);
    p.poison_outputs();
    p.fused();
    EXPECT_EQ(testing::poisoned_padding(*p.dlogits_buffer, c.rows, c.cols, pad), (c.rows - 1) * pad);
    p.poison_outputs();
    p.backward();
    EXPECT_EQ(testing::poisoned_padding(*p.dlogits_buffer, c.rows, c.cols, pad), (c.rows - 1) * pad);
  }
}

TEST(CrossEntropyGpu, WorkspaceMissingOrTooSmallIsAnError) {
  FUSEKIT_REQUIRE_GPU();
  Case c;
  c.rows = 4096;
  c.cols = 1024;
  Problem p(c, Device::cuda(0));
  Buffer tiny(DType::u8, Device::cuda(0), {16});
  for (const OptionalTensor& ws : {OptionalTensor(tiny.view()), OptionalTensor()}) {
    const std::string e = error_of([&] {
      cross_entropy_forward_backward(p.logits.view(), p.targets.view(), c.config, p.loss.view(), p.dlogits(),
                                     std::nullopt, ws);
    });
    EXPECT_NE(e.find("argument 'workspace': expected a contiguous u8 tensor of at least"), std::string::npos) << e;
    EXPECT_NE(e.find("cross_entropy_workspace_size"), std::string::npos) << e;
  }
  // Reduction none needs none; the backward of a sum needs none either.
  CrossEntropyConfig none = c.config;
  none.reduction = LossReduction::none;
  Buffer rows_loss(DType::f32, Device::cuda(0), {c.rows});
  Buffer targets(DType::i64, Device::cuda(0), {c.rows});
  targets.set_values(std::vector<double>(c.rows, 3.0));
  EXPECT_EQ(error_of([&] { cross_entropy_forward(p.logits.view(), targets.view(), none, rows_loss.view()); }),
            "no error");
}

}  // namespace
}  // namespace fusekit
