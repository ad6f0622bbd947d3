// The error bar for the linear family's GPU outputs (shared by the tests and `fusekit check`).
//
// Reference: the CPU backend run in float64 on the same input values (exact up to float64).
// Baseline: what PyTorch's eager F.linear + activation computes in the same dtype, emulated on the
// CPU: products accumulated in float32 in index order, the bias added in float32, the linear
// output rounded to the dtype (PyTorch stores it), the activation (or, backward, dout * act'(pre))
// evaluated in float32 on that and rounded again; dbias a float32 sum over rows.
// A GPU output passes when its relative L2 error against the reference is at most twice the
// baseline's (and at least the reference merely rounded to the dtype: no implementation that
// stores the dtype can beat that), and it has no NaN/Inf where the reference is finite.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/activation.h"
#include "core/convert.h"
#include "fusekit/activation.h"
#include "fusekit/tensor.h"
#include "tests/harness/harness.h"

namespace fusekit::testing::linear {

using MathF = detail::ActivationMath<float>;

inline float round_f(DType dtype, float v) { return static_cast<float>(detail::round_to(dtype, v)); }

struct ForwardBaseline {
  std::vector<double> y, pre;
};

// x (m, k), w (n, k), bias (n) or empty: dense row-major values (already representable in dtype).
inline ForwardBaseline forward_baseline(const std::vector<double>& x, const std::vector<double>& w,
                                        const std::vector<double>& bias, std::int64_t m,
                                        std::int64_t n, std::int64_t k, Activation act,
                                        DType dtype) {
  ForwardBaseline out;
  out.y.resize(static_cast<std::size_t>(m * n));
  out.pre.resize(static_cast<std::size_t>(m * n));
  const std::vector<float> xf(x.begin(), x.end()), wf(w.begin(), w.end());
#pragma omp parallel for schedule(dynamic, 4)
  for (std::int64_t r = 0; r < m; ++r) {
    for (std::int64_t c = 0; c < n; ++c) {
      float acc = 0.0f;
      for (std::int64_t i = 0; i < k; ++i) acc += xf[r * k + i] * wf[c * k + i];
      if (!bias.empty()) acc += static_cast<float>(bias[c]);
      const float pre = round_f(dtype, acc);
      out.pre[r * n + c] = pre;
      out.y[r * n + c] = round_f(dtype, MathF::forward(act, pre, 0.0f));
    }
  }
  return out;
}

struct BackwardBaseline {
  std::vector<double> dx, dw, dbias;
};

inline BackwardBaseline backward_baseline(const std::vector<double>& dout,
                                          const std::vector<double>& pre,
                                          const std::vector<double>& x,
                                          const std::vector<double>& w, std::int64_t m,
                                          std::int64_t n, std::int64_t k, Activation act,
                                          DType dtype) {
  std::vector<float> dz(static_cast<std::size_t>(m * n));
  for (std::int64_t i = 0; i < m * n; ++i) {
    const float g = static_cast<float>(dout[i]);
    dz[i] = act == Activation::none ? g
                                    : round_f(dtype, g * MathF::derivative(act, static_cast<float>(pre[i]), 0.0f));
  }
  const std::vector<float> xf(x.begin(), x.end()), wf(w.begin(), w.end());
  BackwardBaseline out;
  out.dx.resize(static_cast<std::size_t>(m * k));
  out.dw.resize(static_cast<std::size_t>(n * k));
  out.dbias.resize(static_cast<std::size_t>(n));
#pragma omp parallel for schedule(dynamic, 4)
  for (std::int64_t r = 0; r < m; ++r) {
    for (std::int64_t i = 0; i < k; ++i) {
      float acc = 0.0f;
      for (std::int64_t c = 0; c < n; ++c) acc += dz[r * n + c] * wf[c * k + i];
      out.dx[r * k + i] = round_f(dtype, acc);
    }
  }
#pragma omp parallel for schedule(dynamic, 4)
  for (std::int64_t c = 0; c < n; ++c) {
    std::vector<float> acc(static_cast<std::size_t>(k), 0.0f);
    float db = 0.0f;
    for (std::int64_t r = 0; r < m; ++r) {
      const float g = dz[r * n + c];
      db += g;
      for (std::int64_t i = 0; i < k; ++i) acc[i] += g * xf[r * k + i];
    }
    for (std::int64_t i = 0; i < k; ++i) out.dw[c * k + i] = round_f(dtype, acc[i]);
    out.dbias[c] = round_f(dtype, db);
  }
  return out;
}

struct Verdict {
  bool pass = false;
  double error = 0, tolerance = 0, baseline = 0;
  std::int64_t non_finite = 0;
  std::string message;
};

// `sources`: how many independently rounded values the output's error flows from, when fewer
// than its elements (0: the elements themselves). Every backward output is computed from the m x n
// values of dz = dout * act'(pre): with n = 1 and m = 3, a 1536-element dx is three dz values
// times the weights, and its relative error is that of three values.
inline Verdict judge(const std::vector<double>& got, const std::vector<double>& ref,
                     const std::vector<double>& baseline, DType dtype, const std::string& what,
                     std::int64_t sources = 0) {
  Verdict v;
  const ErrorStats s = compare(got, ref);
  v.error = s.rel_l2;
  v.non_finite = s.non_finite;
  v.baseline = compare(baseline, ref).rel_l2;
  v.tolerance = 2.0 * std::max(v.baseline, rounding_error(dtype, ref));
  // A relative L2 error over a handful of values is a noisy statistic: two implementations that
  // each round correctly can differ by more than 2x on 3 or 24 values (a float32 erff within 2
  // ulp against glibc's, on three dz values, drew 2.4x). Below 1024 values the bar does not drop
  // under one unit roundoff of the dtype (float32: the accumulation floor).
  const std::int64_t values = static_cast<std::int64_t>(ref.size());
  if ((sources > 0 ? std::min(sources, values) : values) < 1024) {
    const double unit_roundoff = dtype == DType::f16 ? 0x1p-11 : dtype == DType::bf16 ? 0x1p-8 : 0.0;
    v.tolerance = std::max(v.tolerance, 2.0 * std::max(unit_roundoff, accumulation_floor(dtype)));
  }
  v.pass = got.size() == ref.size() && s.non_finite == 0 && s.rel_l2 <= v.tolerance;
  v.message = what + " [" + dtype_name(dtype) + "]: rel_l2 " + std::to_string(v.error) +
              " (tolerance " + std::to_string(v.tolerance) + " = 2 x max(float32 baseline " +
              std::to_string(v.baseline) + ", rounding " + std::to_string(rounding_error(dtype, ref)) +
              ")), non-finite " + std::to_string(s.non_finite) + " of " + std::to_string(s.count);
  return v;
}

}  // namespace fusekit::testing::linear
