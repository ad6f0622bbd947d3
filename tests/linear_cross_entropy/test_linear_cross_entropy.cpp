// linear_cross_entropy: the CPU reference against its definition written out in the test (logits,
// cross_entropy's formulas, then the three products) and against finite differences; the GPU
// path against the float64 reference (every dtype, several chunks forced, ignored rows, label
// smoothing, z-loss, with and without a bias, padded rows, every reduction), bitwise determinism,
// and argument errors.
//
// The GPU's tolerance: the chunked path stores the logits and their gradient in h's dtype, as the
// unfused layer (linear_forward, then cross_entropy, then linear_backward) does. Its outputs are
// compared with the float64 reference under twice the error of that unfused computation rounded
// the same way (each stored tensor rounded to its dtype, everything else exact), floored by the
// harness's tolerance of the output dtype, by a float32 sum of the products' length, and for the
// gradients by the float32 rounding of the logits' gradient where its terms cancel.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "core/convert.h"
#include "core/overrides.h"
#include "fusekit/cross_entropy.h"
#include "fusekit/error.h"
#include "fusekit/linear_cross_entropy.h"
#include "tests/harness/error_testing.h"
#include "tests/harness/gtest_helpers.h"

namespace fusekit {
namespace {

using testing::Buffer;

struct Case {
  DType dtype = DType::bf16;
  DType target_dtype = DType::i64;
  DType dweight_dtype = DType::f32;
  DType dbias_dtype = DType::f32;
  std::int64_t tokens = 1, vocab = 1, hidden = 1;
  std::int64_t h_pad = 0, w_pad = 0, dh_pad = 0, dw_pad = 0;  // extra elements per row
  bool bias = true;
  bool gradients = true;
  double ignored = 0.0;
  std::int64_t chunk = 0;  // forced rows per chunk on the GPU (0: the config's)
  CrossEntropyConfig config;

  std::string str() const {
    return std::string(dtype_name(dtype)) + "/" + dtype_name(target_dtype) + " dW " + dtype_name(dweight_dtype) +
           " db " + dtype_name(dbias_dtype) + " T " + std::to_string(tokens) + " V " + std::to_string(vocab) +
           " H " + std::to_string(hidden) + " " + loss_reduction_name(config.reduction) +
           " s=" + std::to_string(config.label_smoothing) + " z=" + std::to_string(config.z_loss) +
           " ignore " + std::to_string(config.ignore_index) + " (" + std::to_string(ignored) + ")" +
           (bias ? " bias" : "") + (gradients ? "" : " loss only") +
           (chunk ? " chunk " + std::to_string(chunk) : "") +
           (h_pad || w_pad || dh_pad || dw_pad ? " padded" : "");
  }
  std::int64_t loss_values() const { return config.reduction == LossReduction::none ? tokens : 1; }
};

// Inputs as float64 values already rounded to the case's dtype (both devices see the same ones).
struct Inputs {
  std::vector<double> h, w, b, targets;
};

std::vector<double> rounded(DType dtype, std::vector<double> v) {
  for (double& x : v) x = detail::round_to(dtype, x);
  return v;
}

Inputs random_inputs(const Case& c, std::mt19937_64& rng) {
  Inputs in;
  std::normal_distribution<double> n(0.0, 1.0);
  in.h.resize(c.tokens * c.hidden);
  in.w.resize(c.vocab * c.hidden);
  in.b.resize(c.vocab);
  for (double& v : in.h) v = n(rng);
  const double w_scale = 1.5 / std::sqrt(static_cast<double>(c.hidden));  // logits ~ N(0, 1.5^2)
  for (double& v : in.w) v = w_scale * n(rng);
  for (double& v : in.b) v = 0.5 * n(rng);
  in.h = rounded(c.dtype, in.h);
  in.w = rounded(c.dtype, in.w);
  in.b = rounded(c.dtype, in.b);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  in.targets.resize(c.tokens);
  for (auto& t : in.targets)
    t = u(rng) < c.ignored ? static_cast<double>(c.config.ignore_index) : static_cast<double>(rng() % c.vocab);
  if (c.tokens > 0 && c.ignored < 1.0) in.targets[0] = c.config.ignore_index == 0 ? double(c.vocab - 1) : 0.0;
  return in;
}

struct Outputs {
  std::vector<double> loss, dh, dw, db;
};

// One problem's tensors on one device, in `dtype` (c.dtype, or f64 for the reference: then every
// output is float64 too).
struct Problem {
  Case c;
  Device device;
  DType dtype;
  Buffer h, w, b, targets, loss, dh, dw, db;
  std::optional<Buffer> workspace;

  Problem(const Case& c_, Device d, DType dt)
      : c(c_), device(d), dtype(dt), h(dt, d, {c.tokens, c.hidden}, {c.hidden + c.h_pad, 1}),
        w(dt, d, {c.vocab, c.hidden}, {c.hidden + c.w_pad, 1}), b(dt, d, {c.vocab}),
        targets(c.target_dtype, d, {c.tokens}), loss(DType::f32, d, {c.loss_values()}),
        dh(dt, d, {c.tokens, c.hidden}, {c.hidden + c.dh_pad, 1}),
        dw(dt == DType::f64 ? dt : c.dweight_dtype, d, {c.vocab, c.hidden}, {c.hidden + c.dw_pad, 1}),
        db(dt == DType::f64 ? dt : c.dbias_dtype, d, {c.vocab}) {
    const std::size_t ws = linear_cross_entropy_workspace_size(c.tokens, c.vocab, c.hidden, dt, dw.dtype(),
                                                               c.bias, c.config, d);
    if (ws > 0) workspace.emplace(DType::u8, d, std::vector<std::int64_t>{static_cast<std::int64_t>(ws)});
  }

  void set_inputs(const Inputs& in) {
    h.set_values(in.h);
    w.set_values(in.w);
    b.set_values(in.b);
    targets.set_values(in.targets);
  }
  void poison_outputs() {
    loss.poison();
    dh.poison();
    dw.poison();
    db.poison();
  }
  void run() {
    const bool g = c.gradients;
    linear_cross_entropy(h.view(), w.view(), c.bias ? OptionalTensor(b.view()) : std::nullopt, targets.view(),
                         c.config, loss.view(), g ? OptionalTensor(dh.view()) : std::nullopt,
                         g ? OptionalTensor(dw.view()) : std::nullopt,
                         g && c.bias ? OptionalTensor(db.view()) : std::nullopt,
                         workspace ? OptionalTensor(workspace->view()) : std::nullopt);
  }
  Outputs outputs() const {
    Outputs o;
    o.loss = loss.values();
    if (c.gradients) {
      o.dh = dh.values();
      o.dw = dw.values();
      if (c.bias) o.db = db.values();
    }
    return o;
  }
};

// An override key set for the scope of a test.
class ScopedOverride {
 public:
  ScopedOverride(const char* key, const std::string& value) : key_(key) { detail::set_override(key, value); }
  ~ScopedOverride() { detail::set_override(key_, ""); }

 private:
  const char* key_;
};

Outputs run_on(const Case& c, Device d, DType dtype, const Inputs& in) {
  std::optional<ScopedOverride> forced;
  if (c.chunk > 0) forced.emplace("linear_cross_entropy.chunk_tokens", std::to_string(c.chunk));
  Problem p(c, d, dtype);
  p.set_inputs(in);
  p.poison_outputs();
  p.run();
  return p.outputs();
}

// ---- the unfused computation, written out in float64 -----------------------------------------

struct RowTerms {
  std::vector<double> lse;  // per row
  double counted = 0.0;
};

// logits (T, V) = h W^T + b, each rounded to `logits_dtype` (f64: exact).
std::vector<double> logits_of(const Case& c, const Inputs& in, DType logits_dtype) {
  std::vector<double> x(c.tokens * c.vocab);
  for (std::int64_t r = 0; r < c.tokens; ++r)
    for (std::int64_t v = 0; v < c.vocab; ++v) {
      double acc = c.bias ? in.b[v] : 0.0;
      for (std::int64_t k = 0; k < c.hidden; ++k) acc += in.h[r * c.hidden + k] * in.w[v * c.hidden + k];
      x[r * c.vocab + v] = detail::round_to(logits_dtype, acc);
    }
  return x;
}

// The loss and the logits' gradient from the logits by cross_entropy's definition
// (fusekit/cross_entropy.h), in float64; lse per row alongside.
struct CrossEntropyResult {
  std::vector<double> loss, dx, lse;
};

CrossEntropyResult cross_entropy_of(const Case& c, const Inputs& in, const std::vector<double>& x) {
  const std::int64_t T = c.tokens, V = c.vocab;
  const double s = c.config.label_smoothing, z = c.config.z_loss;
  CrossEntropyResult res;
  res.dx.assign(T * V, 0.0);
  res.lse.assign(T, 0.0);
  std::vector<double> rows(T, 0.0);
  double counted = 0.0;
  for (std::int64_t r = 0; r < T; ++r) counted += in.targets[r] != static_cast<double>(c.config.ignore_index);
  double g = 1.0;
  if (c.config.reduction == LossReduction::mean) g = counted > 0 ? 1.0 / counted : 0.0;
  for (std::int64_t r = 0; r < T; ++r) {
    const double* xr = &x[r * V];
    const double m = *std::max_element(xr, xr + V);
    double se = 0.0, sum = 0.0;
    for (std::int64_t v = 0; v < V; ++v) {
      se += std::exp(xr[v] - m);
      sum += xr[v];
    }
    const double lse = m + std::log(se);
    res.lse[r] = lse;
    const auto t = static_cast<std::int64_t>(in.targets[r]);
    if (t == c.config.ignore_index) continue;
    rows[r] = lse - (1.0 - s) * xr[t] - s / static_cast<double>(V) * sum + z * lse * lse;
    for (std::int64_t v = 0; v < V; ++v) {
      double d = std::exp(xr[v] - lse) * (1.0 + 2.0 * z * lse) - s / static_cast<double>(V);
      if (v == t) d -= 1.0 - s;
      res.dx[r * V + v] = g * d;
    }
  }
  if (c.config.reduction == LossReduction::none) {
    res.loss = rounded(DType::f32, rows);
  } else {
    double total = 0.0;
    for (double v : rows) total += v;
    if (c.config.reduction == LossReduction::mean) total = counted > 0 ? total / counted : 0.0;
    res.loss = {detail::round_to(DType::f32, total)};
  }
  return res;
}

// dh = dx W, dW = dx^T h, db = column sums of dx, in float64, rounded to the given dtypes.
void products(const Case& c, const Inputs& in, const std::vector<double>& dx, DType dh_dtype, DType dw_dtype,
              DType db_dtype, Outputs& o) {
  const std::int64_t T = c.tokens, V = c.vocab, H = c.hidden;
  o.dh.assign(T * H, 0.0);
  o.dw.assign(V * H, 0.0);
  o.db.assign(c.bias ? V : 0, 0.0);
  for (std::int64_t r = 0; r < T; ++r)
    for (std::int64_t v = 0; v < V; ++v) {
      const double d = dx[r * V + v];
      for (std::int64_t k = 0; k < H; ++k) {
        o.dh[r * H + k] += d * in.w[v * H + k];
        o.dw[v * H + k] += d * in.h[r * H + k];
      }
      if (c.bias) o.db[v] += d;
    }
  o.dh = rounded(dh_dtype, o.dh);
  o.dw = rounded(dw_dtype, o.dw);
  o.db = rounded(db_dtype, o.db);
}

// The unfused layer with every stored tensor rounded: logits and dx in c.dtype, the gradients in
// their dtypes; the loss from the rounded logits.
Outputs unfused_rounded(const Case& c, const Inputs& in) {
  const std::vector<double> x = logits_of(c, in, c.dtype);
  const CrossEntropyResult ce = cross_entropy_of(c, in, x);
  Outputs o;
  o.loss = rounded(DType::f32, ce.loss);
  if (c.gradients) {
    products(c, in, rounded(c.dtype, ce.dx), c.dtype, c.dweight_dtype, c.dbias_dtype, o);
    if (!c.bias) o.db.clear();
  }
  return o;
}

double norm(const std::vector<double>& v) {
  double s = 0.0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}

double distance(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) s += (a[i] - b[i]) * (a[i] - b[i]);
  return std::sqrt(s);
}

// got against the float64 reference under the rule in the file comment. `terms`: the length of the
// float32 sums forming each value; `scale_floor`: the norm of the terms an output cancels (the
// error is measured relative to max(||ref||, 0.1 scale_floor)).
::testing::AssertionResult pipeline_close(const std::vector<double>& got, const std::vector<double>& ref,
                                          const std::vector<double>& unfused, DType dtype, const std::string& what,
                                          std::int64_t terms, double scale_floor = 0.0, double envelope = 0.0) {
  if (got.size() != ref.size()) return ::testing::AssertionFailure() << what << ": size " << got.size();
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!std::isfinite(got[i]) && std::isfinite(ref[i]))
      return ::testing::AssertionFailure() << what << ": non-finite value " << got[i] << " at " << i;
  const double denominator = std::max({norm(ref), 0.1 * scale_floor, std::numeric_limits<double>::min()});
  const double error = distance(got, ref) / denominator;
  const double unfused_error = distance(unfused, ref) / denominator;
  const double bound = std::max({testing::tolerance(dtype, ref), 2.0 * unfused_error, 2.0 * envelope / denominator,
                                 2.0 * std::sqrt(static_cast<double>(std::max<std::int64_t>(terms, 1))) * 0x1p-24});
  if (error <= bound) return ::testing::AssertionSuccess();
  ::testing::AssertionResult failure = ::testing::AssertionFailure();
  failure << what << ": relative error " << error << " above " << bound << " (unfused rounded: " << unfused_error << ")";
  if (got.size() <= 4)  // a reduced loss: the values themselves say more than their distance
    for (std::size_t i = 0; i < got.size(); ++i)
      failure << std::setprecision(10) << "; [" << i << "] got " << got[i] << " ref " << ref[i] << " unfused " << unfused[i];
  return failure;
}

// A reduced loss is one number whose unfused rounding errors cancel by chance: twice that
// realization is no bar (a correct kernel whose logits round differently fails it about one run
// in six). Its envelope is the sum of the unfused per-row errors, reduced as the loss is (no
// cancellation assumed); a wrong row still exceeds it by orders of magnitude.
double reduced_loss_envelope(const Case& c, const Inputs& in) {
  if (c.config.reduction == LossReduction::none) return 0.0;
  Case rows = c;
  rows.config.reduction = LossReduction::none;
  const std::vector<double> unfused = cross_entropy_of(rows, in, logits_of(rows, in, c.dtype)).loss;
  const std::vector<double> exact = cross_entropy_of(rows, in, logits_of(rows, in, DType::f64)).loss;
  double sum = 0.0, counted = 0.0;
  for (std::int64_t r = 0; r < c.tokens; ++r) {
    sum += std::abs(unfused[r] - exact[r]);
    counted += in.targets[r] != static_cast<double>(c.config.ignore_index);
  }
  if (c.config.reduction == LossReduction::mean) return counted > 0 ? sum / counted : 0.0;
  return sum;
}

// The norm of the loss's largest terms (lse of the counted rows, reduced as the loss is).
double loss_floor(const Case& c, const Inputs& in, const std::vector<double>& lse) {
  double squares = 0.0, magnitudes = 0.0, counted = 0.0;
  for (std::int64_t r = 0; r < c.tokens; ++r) {
    if (in.targets[r] == static_cast<double>(c.config.ignore_index)) continue;
    squares += lse[r] * lse[r];
    magnitudes += std::abs(lse[r]);
    counted += 1.0;
  }
  if (c.config.reduction == LossReduction::none) return std::sqrt(squares);
  if (c.config.reduction == LossReduction::sum) return magnitudes;
  return counted > 0 ? magnitudes / counted : 0.0;
}

// The logits' gradient is formed in float32 (p (1 + 2 z lse) - s/V - (1 - s) at the target), and
// where p is near its target those terms cancel: the result keeps their float32 rounding, not its
// own relative precision (one class: p = 1 and the gradient is the z-loss term alone). The bound
// on that rounding, two ulps of each term, carried through the three products in magnitudes.
Outputs gradient_rounding_envelope(const Case& c, const Inputs& in, const CrossEntropyResult& exact) {
  const std::int64_t T = c.tokens, V = c.vocab;
  const double s = c.config.label_smoothing, z = c.config.z_loss;
  double counted = 0.0;
  for (std::int64_t r = 0; r < T; ++r) counted += in.targets[r] != static_cast<double>(c.config.ignore_index);
  const double g = c.config.reduction == LossReduction::mean ? (counted > 0 ? 1.0 / counted : 0.0) : 1.0;
  const std::vector<double> x = logits_of(c, in, DType::f64);
  std::vector<double> e(T * V, 0.0);
  for (std::int64_t r = 0; r < T; ++r) {
    const auto t = static_cast<std::int64_t>(in.targets[r]);
    if (t == c.config.ignore_index) continue;
    const double lse = exact.lse[r];
    for (std::int64_t v = 0; v < V; ++v) {
      const double p = std::exp(x[r * V + v] - lse);
      const double terms = p * (1.0 + 2.0 * z * std::abs(lse)) + s / static_cast<double>(V) + (v == t ? 1.0 - s : 0.0);
      e[r * V + v] = g * 0x1p-23 * terms;
    }
  }
  Inputs magnitudes = in;
  for (double& v : magnitudes.h) v = std::abs(v);
  for (double& v : magnitudes.w) v = std::abs(v);
  Outputs o;
  products(c, magnitudes, e, DType::f64, DType::f64, DType::f64, o);
  return o;
}

void check_gpu_against_reference(const Case& c, std::uint64_t salt) {
  SCOPED_TRACE(c.str());
  auto rng = testing::make_rng(salt);
  const Inputs in = random_inputs(c, rng);
  const Outputs ref = run_on(c, Device::cpu(), DType::f64, in);
  const Outputs got = run_on(c, Device::cuda(0), c.dtype, in);
  const Outputs unfused = unfused_rounded(c, in);
  const CrossEntropyResult exact = cross_entropy_of(c, in, logits_of(c, in, DType::f64));
  EXPECT_TRUE(pipeline_close(got.loss, ref.loss, unfused.loss, DType::f32, "loss", c.vocab,
                             loss_floor(c, in, exact.lse), reduced_loss_envelope(c, in)));
  if (!c.gradients) return;
  const Outputs envelope = gradient_rounding_envelope(c, in, exact);
  EXPECT_TRUE(pipeline_close(got.dh, ref.dh, unfused.dh, c.dtype, "dh", c.vocab, 0.0, norm(envelope.dh)));
  EXPECT_TRUE(pipeline_close(got.dw, ref.dw, unfused.dw, c.dweight_dtype, "dweight", c.tokens, 0.0,
                             norm(envelope.dw)));
  if (c.bias)
    EXPECT_TRUE(pipeline_close(got.db, ref.db, unfused.db, c.dbias_dtype, "dbias", c.tokens, 0.0, norm(envelope.db)));
}

constexpr LossReduction kReductions[] = {LossReduction::mean, LossReduction::sum, LossReduction::none};

// ---- CPU reference -------------------------------------------------------------------------

// The reference against its definition: the logits, cross_entropy's formulas on them, and the
// three products, written out.
TEST(LinearCrossEntropyCpu, MatchesTheComposition) {
  auto rng = testing::make_rng(1);
  int salt = 0;
  for (LossReduction reduction : kReductions)
    for (bool bias : {false, true}) {
      Case c;
      c.dtype = DType::f64;
      c.tokens = 70;  // more than one of the reference's row blocks
      c.vocab = 11;
      c.hidden = 5;
      c.h_pad = 3;
      c.w_pad = 1;
      c.dh_pad = 2;
      c.dw_pad = 4;
      c.bias = bias;
      c.ignored = 0.2;
      c.config = {salt++ % 2 ? 3 : -100, 0.1f, 1e-3f, reduction};
      SCOPED_TRACE(c.str());
      const Inputs in = random_inputs(c, rng);
      const Outputs got = run_on(c, Device::cpu(), DType::f64, in);
      const CrossEntropyResult ce = cross_entropy_of(c, in, logits_of(c, in, DType::f64));
      Outputs want;
      products(c, in, ce.dx, DType::f64, DType::f64, DType::f64, want);
      ASSERT_EQ(got.loss.size(), ce.loss.size());
      for (std::size_t i = 0; i < got.loss.size(); ++i)
        EXPECT_NEAR(got.loss[i], ce.loss[i], 1e-6 * std::max(1.0, std::abs(ce.loss[i]))) << i;
      auto expect_near_all = [](const std::vector<double>& a, const std::vector<double>& b, const char* what) {
        ASSERT_EQ(a.size(), b.size()) << what;
        for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-12 * std::max(1.0, std::abs(b[i]))) << what << " " << i;
      };
      expect_near_all(got.dh, want.dh, "dh");
      expect_near_all(got.dw, want.dw, "dweight");
      if (bias) expect_near_all(got.db, want.db, "dbias");
    }
}

// d loss / d h, W, b by central differences (none: of the sum of the row losses).
TEST(LinearCrossEntropyCpu, GradientsMatchFiniteDifferences) {
  auto rng = testing::make_rng(2);
  for (LossReduction reduction : kReductions)
    for (float smoothing : {0.0f, 0.25f})
      for (float z : {0.0f, 0.05f}) {
        Case c;
        c.dtype = DType::f64;
        c.tokens = 5;
        c.vocab = 6;
        c.hidden = 4;
        c.ignored = 0.3;
        c.config = {-100, smoothing, z, reduction};
        SCOPED_TRACE(c.str());
        const Inputs in = random_inputs(c, rng);
        Problem p(c, Device::cpu(), DType::f64);
        p.set_inputs(in);
        p.run();
        const Outputs grads = p.outputs();
        Case loss_only = c;
        loss_only.gradients = false;
        Problem q(loss_only, Device::cpu(), DType::f64);
        q.set_inputs(in);
        auto objective = [&] {
          q.run();
          double l = 0.0;
          for (double v : q.loss.values()) l += v;
          return l;
        };
        auto check = [&](Buffer& param, const std::vector<double>& grad, const char* what) {
          int nonzero = 0;
          for (std::int64_t i = 0; i < param.numel(); ++i) {
            // The loss is float32: a step of 1e-2 keeps its rounding below the bound.
            const double fd = testing::central_difference(param, i, 1e-2, objective);
            EXPECT_NEAR(grad[i], fd, 2e-3 * std::max(1.0, std::abs(fd))) << what << " " << i;
            nonzero += grad[i] != 0.0;
          }
          EXPECT_GT(nonzero, 0) << what;
        };
        check(q.h, grads.dh, "dh");
        check(q.w, grads.dw, "dweight");
        check(q.b, grads.db, "dbias");
      }
}

// The validation call gives the training call's loss; an all-ignored batch and an empty one have
// loss 0 and zero gradients.
TEST(LinearCrossEntropyCpu, LossOnlyCallAndEmptyBatches) {
  auto rng = testing::make_rng(3);
  for (LossReduction reduction : kReductions) {
    Case c;
    c.dtype = DType::f64;
    c.tokens = 9;
    c.vocab = 13;
    c.hidden = 6;
    c.config.reduction = reduction;
    const Inputs in = random_inputs(c, rng);
    const Outputs full = run_on(c, Device::cpu(), DType::f64, in);
    Case loss_only = c;
    loss_only.gradients = false;
    EXPECT_EQ(run_on(loss_only, Device::cpu(), DType::f64, in).loss, full.loss);

    Case ignored = c;
    ignored.ignored = 1.0;
    const Outputs none = run_on(ignored, Device::cpu(), DType::f64, random_inputs(ignored, rng));
    for (const auto* v : {&none.loss, &none.dh, &none.dw, &none.db})
      for (double x : *v) EXPECT_EQ(x, 0.0);

    Case empty = c;
    empty.tokens = 0;
    const Outputs nothing = run_on(empty, Device::cpu(), DType::f64, random_inputs(empty, rng));
    for (const auto* v : {&nothing.loss, &nothing.dw, &nothing.db})
      for (double x : *v) EXPECT_EQ(x, 0.0);
  }
}

// On the CPU every dtype is computed in float64 and rounded once: bf16 inputs give the float64
// results of the same (rounded) inputs, rounded.
TEST(LinearCrossEntropyCpu, LowPrecisionIsTheRoundedReference) {
  auto rng = testing::make_rng(4);
  Case c;
  c.dtype = DType::bf16;
  c.dweight_dtype = DType::bf16;
  c.dbias_dtype = DType::f32;
  c.target_dtype = DType::i32;
  c.tokens = 17;
  c.vocab = 23;
  c.hidden = 8;
  c.config = {-100, 0.1f, 1e-4f, LossReduction::mean};
  const Inputs in = random_inputs(c, rng);
  const Outputs ref = run_on(c, Device::cpu(), DType::f64, in);
  const Outputs got = run_on(c, Device::cpu(), DType::bf16, in);
  EXPECT_EQ(got.loss, ref.loss);
  EXPECT_EQ(got.dh, rounded(DType::bf16, ref.dh));
  EXPECT_EQ(got.dw, rounded(DType::bf16, ref.dw));
  EXPECT_EQ(got.db, rounded(DType::f32, ref.db));
}

TEST(LinearCrossEntropyCpu, SizeQueries) {
  const CrossEntropyConfig config;
  EXPECT_EQ(linear_cross_entropy_workspace_size(8192, 50257, 768, DType::bf16, DType::bf16, true, config,
                                                Device::cpu()),
            0u);
  EXPECT_EQ(linear_cross_entropy_chunk_tokens(8192, 50257, 768, DType::bf16, Device::cpu()), 0);
  using testing::expect_error;
  expect_error([&] { linear_cross_entropy_workspace_size(8, 0, 4, DType::bf16, DType::f32, false, config, Device::cpu()); },
               ErrorKind::invalid_argument, "vocab");
  expect_error([&] {
    linear_cross_entropy_workspace_size(8, kCrossEntropyMaxClasses + 1, 4, DType::bf16, DType::f32, false, config,
                                        Device::cpu());
  }, ErrorKind::invalid_argument, "vocab");
  expect_error([&] { linear_cross_entropy_workspace_size(-1, 5, 4, DType::bf16, DType::f32, false, config, Device::cpu()); },
               ErrorKind::invalid_argument, "tokens");
  expect_error([&] { linear_cross_entropy_workspace_size(8, 5, 0, DType::bf16, DType::f32, false, config, Device::cpu()); },
               ErrorKind::invalid_argument, "hidden");
  expect_error([&] { linear_cross_entropy_workspace_size(8, 5, 4, DType::bf16, DType::f16, false, config, Device::cpu()); },
               ErrorKind::invalid_argument, "dweight_dtype", "f32 or dtype (bf16)");
  expect_error([&] { linear_cross_entropy_workspace_size(8, 5, 4, DType::i32, DType::f32, false, config, Device::cpu()); },
               ErrorKind::invalid_argument, "dtype");
  CrossEntropyConfig bad;
  bad.label_smoothing = 1.0f;
  expect_error([&] { linear_cross_entropy_workspace_size(8, 5, 4, DType::bf16, DType::f32, false, bad, Device::cpu()); },
               ErrorKind::invalid_argument, "label_smoothing");
}

TEST(LinearCrossEntropyCpu, ArgumentErrors) {
  using testing::expect_error;
  const Device cpu = Device::cpu();
  Buffer h(DType::f32, cpu, {4, 3}), w(DType::f32, cpu, {5, 3}), b(DType::f32, cpu, {5}),
      targets(DType::i64, cpu, {4}), loss(DType::f32, cpu, {1}), dh(DType::f32, cpu, {4, 3}),
      dw(DType::f32, cpu, {5, 3}), db(DType::f32, cpu, {5});
  h.set_values({0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2});
  w.set_values(std::vector<double>(15, 0.1));
  b.set_values(std::vector<double>(5, 0.0));
  targets.set_values({0, 1, 2, 3});
  const CrossEntropyConfig config;
  auto call = [&](const TensorView& hv, const TensorView& wv, const OptionalTensor& bv, const TensorView& tv,
                  const CrossEntropyConfig& cfg, const TensorView& lv, const OptionalTensor& dhv,
                  const OptionalTensor& dwv, const OptionalTensor& dbv) {
    return [=] { linear_cross_entropy(hv, wv, bv, tv, cfg, lv, dhv, dwv, dbv); };
  };
  // The arguments work as given.
  EXPECT_EQ(testing::error_of(call(h.view(), w.view(), b.view(), targets.view(), config, loss.view(), dh.view(),
                                   dw.view(), db.view())),
            "no error");

  Buffer w_wide(DType::f32, cpu, {5, 4}), w_f16(DType::f16, cpu, {5, 3}), w_3d(DType::f32, cpu, {1, 5, 3});
  expect_error(call(h.view(), w_wide.view(), b.view(), targets.view(), config, loss.view(), dh.view(), dw.view(),
                    db.view()),
               ErrorKind::invalid_argument, "weight", "shape (V, 3)");
  expect_error(call(h.view(), w_f16.view(), b.view(), targets.view(), config, loss.view(), dh.view(), dw.view(),
                    db.view()),
               ErrorKind::invalid_argument, "weight");
  expect_error(call(h.view(), w_3d.view(), b.view(), targets.view(), config, loss.view(), dh.view(), dw.view(),
                    db.view()),
               ErrorKind::invalid_argument, "weight", "2-D");
  Buffer b_short(DType::f32, cpu, {4});
  expect_error(call(h.view(), w.view(), b_short.view(), targets.view(), config, loss.view(), dh.view(), dw.view(),
                    std::nullopt),
               ErrorKind::invalid_argument, "bias");
  Buffer t_short(DType::i64, cpu, {3}), t_f32(DType::f32, cpu, {4});
  expect_error(call(h.view(), w.view(), b.view(), t_short.view(), config, loss.view(), dh.view(), dw.view(),
                    db.view()),
               ErrorKind::invalid_argument, "targets");
  expect_error(call(h.view(), w.view(), b.view(), t_f32.view(), config, loss.view(), dh.view(), dw.view(), db.view()),
               ErrorKind::invalid_argument, "targets");
  Buffer loss4(DType::f32, cpu, {4});
  expect_error(call(h.view(), w.view(), b.view(), targets.view(), config, loss4.view(), dh.view(), dw.view(),
                    db.view()),
               ErrorKind::invalid_argument, "loss");
  CrossEntropyConfig none = config;
  none.reduction = LossReduction::none;
  expect_error(call(h.view(), w.view(), b.view(), targets.view(), none, loss.view(), dh.view(), dw.view(), db.view()),
               ErrorKind::invalid_argument, "loss");
  Buffer dh_bad(DType::f32, cpu, {4, 4}), dh_f16(DType::f16, cpu, {4, 3});
  expect_error(call(h.view(), w.view(), b.view(), targets.view(), config, loss.view(), dh_bad.view(), dw.view(),
                    db.view()),
               ErrorKind::invalid_argument, "dh");
  expect_error(call(h.view(), w.view(), b.view(), targets.view(), config, loss.view(), dh_f16.view(), dw.view(),
                    db.view()),
               ErrorKind::invalid_argument, "dh");
  Buffer dw_f16(DType::f16, cpu, {5, 3}), dw_bad(DType::f32, cpu, {3, 5});
  expect_error(call(h.view(), w.view(), b.view(), targets.view(), config, loss.view(), dh.view(), dw_f16.view(),
                    db.view()),
               ErrorKind::invalid_argument, "dweight", "f32 or h's dtype (f32)");
  expect_error(call(h.view(), w.view(), b.view(), targets.view(), config, loss.view(), dh.view(), dw_bad.view(),
                    db.view()),
               ErrorKind::invalid_argument, "dweight", "shape (5, 3)");
  expect_error(call(h.view(), w.view(), std::nullopt, targets.view(), config, loss.view(), dh.view(), dw.view(),
                    db.view()),
               ErrorKind::invalid_argument, "dbias", "without a bias");
  CrossEntropyConfig smoothing = config;
  smoothing.label_smoothing = -0.1f;
  expect_error(call(h.view(), w.view(), b.view(), targets.view(), smoothing, loss.view(), dh.view(), dw.view(),
                    db.view()),
               ErrorKind::invalid_argument, "label_smoothing");
  CrossEntropyConfig z = config;
  z.z_loss = std::numeric_limits<float>::infinity();
  expect_error(call(h.view(), w.view(), b.view(), targets.view(), z, loss.view(), dh.view(), dw.view(), db.view()),
               ErrorKind::invalid_argument, "z_loss");
  // dh written over h.
  expect_error(call(h.view(), w.view(), b.view(), targets.view(), config, loss.view(), h.view(), dw.view(), db.view()),
               ErrorKind::invalid_argument, "dh", "overlap");
  // A target that is neither a class nor ignore_index (the CPU refuses it).
  targets.set_values({0, 1, 5, 3});
  expect_error(call(h.view(), w.view(), b.view(), targets.view(), config, loss.view(), dh.view(), dw.view(),
                    db.view()),
               ErrorKind::invalid_argument, "targets", "target 5 at row 2");
}

// ---- GPU against the reference ---------------------------------------------------------------

TEST(LinearCrossEntropyGpu, MatchesTheReference) {
  FUSEKIT_REQUIRE_GPU();
  std::uint64_t salt = 100;
  for (DType dtype : {DType::bf16, DType::f16, DType::f32})
    for (LossReduction reduction : kReductions) {
      // f16 stores dx = g (...) with g = 1 / N for the mean: the header's caveat; the sum has g = 1.
      Case c;
      c.dtype = dtype;
      c.tokens = 300;
      c.vocab = 1000;
      c.hidden = 64;
      c.chunk = 128;  // 128, 128, 44
      c.ignored = 0.1;
      c.config = {-100, 0.0f, 0.0f, reduction};
      c.dweight_dtype = DType::f32;
      c.dbias_dtype = dtype;
      check_gpu_against_reference(c, salt++);
      c.dweight_dtype = dtype;  // through the float32 accumulator
      c.dbias_dtype = DType::f32;
      c.config = {7, 0.1f, 1e-3f, reduction};  // ignore_index 7 is a class
      c.target_dtype = DType::i32;
      check_gpu_against_reference(c, salt++);
    }
}

TEST(LinearCrossEntropyGpu, ShapesChunksAndLayouts) {
  FUSEKIT_REQUIRE_GPU();
  std::uint64_t salt = 200;
  struct Shape {
    std::int64_t t, v, h, chunk;
  };
  // Odd V (the chunk's padded row stride), H not a multiple of 8, one row, one class, one chunk of
  // everything, many chunks, a short last chunk; a chunk of rows long and many enough for
  // cross_entropy's staged kernel (rows of 32 to 108 KB, two per SM).
  for (const Shape& s : {Shape{1, 7, 8, 0}, Shape{37, 1, 16, 0}, Shape{64, 3001, 130, 0}, Shape{257, 3001, 96, 64},
                         Shape{512, 2048, 256, 100}, Shape{1000, 501, 40, 1000}, Shape{129, 50, 24, 1},
                         Shape{300, 20011, 40, 300}})
    for (bool bias : {false, true}) {
      Case c;
      c.dtype = DType::bf16;
      c.tokens = s.t;
      c.vocab = s.v;
      c.hidden = s.h;
      c.chunk = s.chunk;
      c.bias = bias;
      c.h_pad = 8;
      c.w_pad = bias ? 0 : 16;
      c.dh_pad = 3;
      c.dw_pad = bias ? 5 : 0;
      c.dweight_dtype = bias ? DType::bf16 : DType::f32;
      c.ignored = 0.25;
      c.config = {-100, 0.05f, 1e-4f, LossReduction::mean};
      check_gpu_against_reference(c, salt++);
    }
}

TEST(LinearCrossEntropyGpu, LossOnlyAndIgnoredBatches) {
  FUSEKIT_REQUIRE_GPU();
  std::uint64_t salt = 300;
  for (LossReduction reduction : kReductions) {
    Case c;
    c.tokens = 200;
    c.vocab = 777;
    c.hidden = 32;
    c.chunk = 64;
    c.gradients = false;
    c.config.reduction = reduction;
    check_gpu_against_reference(c, salt++);
    // Every row ignored: loss 0 and zero gradients.
    c.gradients = true;
    c.ignored = 1.0;
    auto rng = testing::make_rng(salt++);
    const Outputs o = run_on(c, Device::cuda(0), c.dtype, random_inputs(c, rng));
    for (const auto* v : {&o.loss, &o.dh, &o.dw, &o.db})
      for (double x : *v) EXPECT_EQ(x, 0.0) << c.str();
    // No rows at all.
    c.tokens = 0;
    c.ignored = 0.0;
    const Outputs e = run_on(c, Device::cuda(0), c.dtype, random_inputs(c, rng));
    for (const auto* v : {&e.loss, &e.dw, &e.db})
      for (double x : *v) EXPECT_EQ(x, 0.0) << c.str();
  }
}

// The loss-only call and the call with gradients run the same logits GEMMs and row statistics:
// their losses agree bitwise for every reduction and chunking.
TEST(LinearCrossEntropyGpu, LossOnlyEqualsTheLossWithGradients) {
  FUSEKIT_REQUIRE_GPU();
  std::uint64_t salt = 350;
  for (LossReduction reduction : kReductions)
    for (std::int64_t chunk : {std::int64_t{0}, std::int64_t{64}}) {
      Case c;
      c.tokens = 200;
      c.vocab = 777;
      c.hidden = 32;
      c.chunk = chunk;
      c.config.reduction = reduction;
      SCOPED_TRACE(c.str());
      auto rng = testing::make_rng(salt++);
      const Inputs in = random_inputs(c, rng);
      const Outputs with_gradients = run_on(c, Device::cuda(0), c.dtype, in);
      c.gradients = false;
      const Outputs loss_only = run_on(c, Device::cuda(0), c.dtype, in);
      ASSERT_EQ(loss_only.loss.size(), with_gradients.loss.size());
      for (std::size_t i = 0; i < loss_only.loss.size(); ++i)
        EXPECT_EQ(loss_only.loss[i], with_gradients.loss[i]) << "loss " << i;
    }
}

// A target outside [0, V) that is not ignore_index: NaN in its row loss, so in the mean.
TEST(LinearCrossEntropyGpu, InvalidTargetIsNaN) {
  FUSEKIT_REQUIRE_GPU();
  Case c;
  c.tokens = 16;
  c.vocab = 40;
  c.hidden = 16;
  auto rng = testing::make_rng(400);
  Inputs in = random_inputs(c, rng);
  in.targets[3] = 40;
  const Outputs o = run_on(c, Device::cuda(0), c.dtype, in);
  EXPECT_TRUE(std::isnan(o.loss[0]));
}

TEST(LinearCrossEntropyGpu, Deterministic) {
  FUSEKIT_REQUIRE_GPU();
  for (DType dweight_dtype : {DType::f32, DType::bf16}) {
    Case c;
    c.tokens = 1000;
    c.vocab = 4099;
    c.hidden = 256;
    c.ignored = 0.1;
    c.dweight_dtype = dweight_dtype;
    c.config = {-100, 0.1f, 1e-4f, LossReduction::mean};
    SCOPED_TRACE(c.str());
    ScopedOverride forced("linear_cross_entropy.chunk_tokens", "256");
    auto rng = testing::make_rng(500);
    Problem p(c, Device::cuda(0), c.dtype);
    p.set_inputs(random_inputs(c, rng));
    EXPECT_TRUE(testing::same_bytes_every_run(
        [&] {
          p.poison_outputs();
          p.run();
        },
        {&p.loss, &p.dh, &p.dw, &p.db}));
  }
}

TEST(LinearCrossEntropyGpu, WorkspaceErrors) {
  FUSEKIT_REQUIRE_GPU();
  using testing::expect_error;
  Case c;
  c.tokens = 8;
  c.vocab = 16;
  c.hidden = 8;
  Problem p(c, Device::cuda(0), c.dtype);
  ASSERT_TRUE(p.workspace.has_value());
  expect_error([&] {
    linear_cross_entropy(p.h.view(), p.w.view(), p.b.view(), p.targets.view(), c.config, p.loss.view(), p.dh.view(),
                         p.dw.view(), p.db.view(), std::nullopt);
  }, ErrorKind::invalid_argument, "workspace", "linear_cross_entropy_workspace_size");
  Buffer small(DType::u8, Device::cuda(0), {1024});
  expect_error([&] {
    linear_cross_entropy(p.h.view(), p.w.view(), p.b.view(), p.targets.view(), c.config, p.loss.view(), p.dh.view(),
                         p.dw.view(), p.db.view(), small.view());
  }, ErrorKind::invalid_argument, "workspace");
  Buffer h64(DType::f64, Device::cuda(0), {8, 8});
  expect_error([&] {
    linear_cross_entropy(h64.view(), p.w.view(), p.b.view(), p.targets.view(), c.config, p.loss.view(), std::nullopt,
                         std::nullopt, std::nullopt, p.workspace->view());
  }, ErrorKind::invalid_argument, "h", "CUDA device");
  // The chunk query agrees with the workspace: the forced chunk is what both see.
  ScopedOverride forced("linear_cross_entropy.chunk_tokens", "3");
  EXPECT_EQ(linear_cross_entropy_chunk_tokens(8, 16, 8, DType::bf16, Device::cuda(0)), 3);
}

}  // namespace
}  // namespace fusekit
