// FP8 RMSNorm test support shared by the GoogleTest suite and `fusekit check` (no GoogleTest
// here): problems on either device, input generation (zero rows, huge and tiny scales,
// saturated and subnormal fp8 codes), an independent float64 RMSNorm, and comparisons of
// quantized outputs in units of the format's ulp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/convert.h"
#include "fp8_norm/fp8_norm_math.h"
#include "fusekit/fp8_norm.h"
#include "tests/harness/harness.h"

namespace fusekit::testing::fp8 {

struct Case {
  std::int64_t rows = 1, cols = 16;
  int group = 16;
  DType x_dtype = DType::f8e4m3;
  DType q_dtype = DType::f8e4m3;
  DType scale_dtype = DType::bf16;
  DType weight_dtype = DType::bf16;
  bool with_y = true;
  float eps = 1e-5f;
  // Extra elements between rows (row stride = row length + pad).
  std::int64_t x_pad = 0, scale_pad = 0, qy_pad = 0, qyt_pad = 0, y_pad = 0, dy_pad = 0, dx_pad = 0;
  // Elements before every tensor's first: pointers off 16-byte alignment.
  std::int64_t lead = 0;

  std::int64_t groups() const { return cols / group; }
  std::string str() const {
    std::string s = "(" + std::to_string(rows) + ", " + std::to_string(cols) + ") G=" + std::to_string(group) +
                    " x:" + dtype_name(x_dtype) + " q:" + dtype_name(q_dtype) + " s:" + dtype_name(scale_dtype) +
                    " w:" + dtype_name(weight_dtype) + (with_y ? " +y" : "");
    if (x_pad || scale_pad || qy_pad || qyt_pad || y_pad || dy_pad || dx_pad)
      s += " pads " + std::to_string(x_pad) + "/" + std::to_string(scale_pad) + "/" + std::to_string(qy_pad) +
           "/" + std::to_string(qyt_pad) + "/" + std::to_string(y_pad) + "/" + std::to_string(dy_pad) + "/" +
           std::to_string(dx_pad);
    if (lead) s += " lead " + std::to_string(lead);
    return s;
  }
};

// All tensors of one forward + backward problem on one device.
struct Problem {
  Case c;
  Device device;
  Buffer x, scales, weight, qy, qy_t, y_scale, rstd, dy, dx, dweight;
  std::optional<Buffer> y, forward_ws, backward_ws;

  Problem(const Case& c_, Device d)
      : c(c_), device(d),
        x(c.x_dtype, d, {c.rows, c.cols}, {c.cols + c.x_pad, 1}, c.lead),
        scales(c.scale_dtype, d, {c.rows, c.groups()}, {c.groups() + c.scale_pad, 1}, c.lead),
        weight(c.weight_dtype, d, {c.cols}, {}, c.lead),
        qy(c.q_dtype, d, {c.rows, c.cols}, {c.cols + c.qy_pad, 1}, c.lead),
        qy_t(c.q_dtype, d, {c.cols, c.rows}, {c.rows + c.qyt_pad, 1}, c.lead),
        y_scale(DType::f32, d, {1}),
        rstd(DType::f32, d, {c.rows}),
        dy(DType::bf16, d, {c.rows, c.cols}, {c.cols + c.dy_pad, 1}, c.lead),
        dx(DType::bf16, d, {c.rows, c.cols}, {c.cols + c.dx_pad, 1}, c.lead),
        dweight(c.weight_dtype, d, {c.cols}, {}, c.lead) {
    if (c.with_y)
      y.emplace(DType::bf16, d, std::vector<std::int64_t>{c.rows, c.cols},
                std::vector<std::int64_t>{c.cols + c.y_pad, 1}, c.lead);
    const std::size_t fw = fp8_rms_norm_forward_workspace_size(c.rows, c.cols, d);
    if (fw > 0) forward_ws.emplace(DType::u8, d, std::vector<std::int64_t>{static_cast<std::int64_t>(fw)});
    const std::size_t bw = fp8_rms_norm_backward_workspace_size(c.rows, c.cols, d);
    if (bw > 0) backward_ws.emplace(DType::u8, d, std::vector<std::int64_t>{static_cast<std::int64_t>(bw)});
  }

  static OptionalTensor opt(const std::optional<Buffer>& b) { return b ? OptionalTensor(b->view()) : std::nullopt; }

  void forward() {
    fp8_rms_norm_forward(x.view(), scales.view(), weight.view(), c.eps, qy.view(), qy_t.view(),
                         y_scale.view(), rstd.view(), opt(y), opt(forward_ws), c.group);
  }
  void backward(bool want_dx = true, bool want_dweight = true) {
    fp8_rms_norm_backward(dy.view(), x.view(), scales.view(), weight.view(), rstd.view(),
                          want_dx ? OptionalTensor(dx.view()) : std::nullopt,
                          want_dweight ? OptionalTensor(dweight.view()) : std::nullopt,
                          opt(backward_ws), c.group);
  }
  void poison_outputs() {
    for (Buffer* b : {&qy, &qy_t, &y_scale, &rstd, &dx, &dweight}) b->poison();
    if (y) y->poison();
  }
};

inline double fp8_max_finite(DType d) { return d == DType::f8e4m3 ? 448.0 : 57344.0; }

// Kinds of rows fill_inputs mixes in.
struct FillOptions {
  bool special_rows = true;   // zero rows, rows with huge / tiny scales, zero-scale groups
  double magnitude = 1.0;     // multiplies every scale (whole-tensor huge / tiny tests)
  double weight_mean = 1.0, weight_std = 0.5;
};

// Random fp8 codes and scales that exercise the formats: ordinary values, +-max, zeros and
// subnormals; per row either ordinary scales spanning a few decades, all-zero values, scales
// 1e25 times larger or 1e-25 times smaller; a few groups with scale zero.
inline void fill_inputs(Problem& p, std::mt19937_64& rng, const FillOptions& o = {}) {
  const Case& c = p.c;
  const double qmax = fp8_max_finite(c.x_dtype);
  std::vector<double> xv(c.rows * c.cols), sv(c.rows * c.groups());
  testing::parallel_fill(c.rows, rng, [&](std::int64_t r, std::mt19937_64& row_rng) {
    std::normal_distribution<double> n01(0.0, 1.0);
    double base = o.magnitude * 4.0 / qmax * std::exp(1.5 * n01(row_rng));
    const int kind = o.special_rows ? static_cast<int>(row_rng() % 16) : 15;
    if (kind == 1) base *= 1e25;
    if (kind == 2) base *= 1e-25;
    for (std::int64_t g = 0; g < c.groups(); ++g) {
      double s = base * std::exp(0.5 * n01(row_rng));
      if (o.special_rows && row_rng() % 32 == 0) s = 0.0;
      sv[r * c.groups() + g] = s;
    }
    for (std::int64_t k = 0; k < c.cols; ++k) {
      double v;
      switch (row_rng() % 64) {
        case 0: v = qmax; break;
        case 1: v = -qmax; break;
        case 2: v = 0.0; break;
        case 3: v = n01(row_rng) * std::ldexp(1.0, c.x_dtype == DType::f8e4m3 ? -8 : -15); break;  // subnormal
        default: v = n01(row_rng) * qmax / 4.0;
      }
      xv[r * c.cols + k] = (kind == 0) ? 0.0 : v;
    }
  });  // each row from its own generator stream
  p.x.set_values(xv);  // rounds to the fp8 format (nearest even, saturating)
  p.scales.set_values(sv);
  std::normal_distribution<double> wd(o.weight_mean, o.weight_std);
  std::vector<double> wv(c.cols);
  for (auto& w : wv) w = (rng() % 50 == 0) ? 0.0 : wd(rng);
  p.weight.set_values(wv);
  p.dy.fill_normal(rng);
}

inline void copy_inputs(const Problem& from, Problem& to) {
  to.x.set_values(from.x.values());
  to.scales.set_values(from.scales.values());
  to.weight.set_values(from.weight.values());
  to.dy.set_values(from.dy.values());
}

// ---- raw codes ---------------------------------------------------------------------------------

// Element bytes of a (rows, cols) buffer of 1- or 2-byte elements with the given row stride, as
// unsigned integers (fp8 codes / bf16 bit patterns).
inline std::vector<std::uint32_t> element_bits(const Buffer& b, std::int64_t rows, std::int64_t cols,
                                               std::int64_t row_stride) {
  const auto raw = b.raw_bytes();
  const std::size_t size = dtype_size(b.dtype());
  std::vector<std::uint32_t> out(rows * cols);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t k = 0; k < cols; ++k) {
      const std::size_t off = static_cast<std::size_t>(r * row_stride + k) * size;
      std::uint32_t v = 0;
      for (std::size_t i = 0; i < size; ++i) v |= std::uint32_t(raw[off + i]) << (8 * i);
      out[r * cols + k] = v;
    }
  return out;
}

inline std::vector<std::uint32_t> float_bits(const std::vector<double>& v) {
  std::vector<std::uint32_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    const float f = static_cast<float>(v[i]);
    std::memcpy(&out[i], &f, 4);
  }
  return out;
}

enum class Format { f8e4m3, f8e5m2, bf16, f32 };

inline Format format_of(DType d) {
  switch (d) {
    case DType::f8e4m3: return Format::f8e4m3;
    case DType::f8e5m2: return Format::f8e5m2;
    case DType::bf16: return Format::bf16;
    default: return Format::f32;
  }
}

// Position of a sign-magnitude code on the number line (adjacent finite values differ by 1;
// +0 and -0 coincide). Sets *finite to false for inf and NaN codes.
inline std::int64_t ordinal(Format f, std::uint32_t code, bool* finite) {
  std::uint32_t sign_bit = 0, mag = 0;
  bool fin = true;
  switch (f) {
    case Format::f8e4m3: sign_bit = 0x80; mag = code & 0x7F; fin = mag != 0x7F; break;
    case Format::f8e5m2: sign_bit = 0x80; mag = code & 0x7F; fin = mag <= 0x7B; break;
    case Format::bf16: sign_bit = 0x8000; mag = code & 0x7FFF; fin = mag < 0x7F80; break;
    case Format::f32: sign_bit = 0x80000000u; mag = code & 0x7FFFFFFFu; fin = mag < 0x7F800000u; break;
  }
  if (finite) *finite = fin;
  return (code & sign_bit) ? -std::int64_t(mag) : std::int64_t(mag);
}

struct CodeDiff {
  std::int64_t count = 0;       // elements compared
  std::int64_t mismatches = 0;  // elements whose codes differ
  std::int64_t worst_ulps = 0;  // largest distance in ulps among finite pairs
  std::int64_t non_finite = 0;  // non-finite codes in `got` where `ref` is finite
  bool ok(std::int64_t max_ulps = 1) const { return non_finite == 0 && worst_ulps <= max_ulps; }
  CodeDiff& operator+=(const CodeDiff& o) {
    count += o.count;
    mismatches += o.mismatches;
    worst_ulps = std::max(worst_ulps, o.worst_ulps);
    non_finite += o.non_finite;
    return *this;
  }
  std::string str() const {
    return std::to_string(mismatches) + " of " + std::to_string(count) + " differ, worst " +
           std::to_string(worst_ulps) + " ulp, non-finite " + std::to_string(non_finite);
  }
};

inline CodeDiff compare_codes(Format f, const std::vector<std::uint32_t>& got,
                              const std::vector<std::uint32_t>& ref) {
  CodeDiff d;
  d.count = static_cast<std::int64_t>(ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i) {
    bool got_finite = true, ref_finite = true;
    const std::int64_t a = ordinal(f, got[i], &got_finite), b = ordinal(f, ref[i], &ref_finite);
    if (got[i] == ref[i] || (a == 0 && b == 0 && got_finite && ref_finite)) continue;
    ++d.mismatches;
    if (!got_finite && ref_finite) {
      ++d.non_finite;
    } else if (got_finite && ref_finite) {
      d.worst_ulps = std::max(d.worst_ulps, std::abs(a - b));
    } else if (got_finite != ref_finite) {
      d.worst_ulps = std::max<std::int64_t>(d.worst_ulps, 1 << 30);
    }
  }
  return d;
}

// qy's codes transposed to (N, M) order equal qy_t's codes.
inline bool transpose_consistent(const std::vector<std::uint32_t>& qy, const std::vector<std::uint32_t>& qy_t,
                                 std::int64_t rows, std::int64_t cols) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t k = 0; k < cols; ++k)
      if (qy[r * cols + k] != qy_t[k * rows + r]) return false;
  return true;
}

// ---- float64 truth -------------------------------------------------------------------------------

// RMSNorm of the exactly dequantized input, all in float64 (independent of the library).
inline std::vector<double> rms_norm_f64(const Problem& p, std::vector<double>* rstd_out = nullptr) {
  const Case& c = p.c;
  const auto xv = p.x.values(), sv = p.scales.values(), wv = p.weight.values();
  std::vector<double> y(c.rows * c.cols);
  if (rstd_out) rstd_out->assign(c.rows, 0.0);
  for (std::int64_t r = 0; r < c.rows; ++r) {
    double ss = 0.0;
    for (std::int64_t k = 0; k < c.cols; ++k) {
      const double v = xv[r * c.cols + k] * sv[r * c.groups() + k / c.group];
      ss += v * v;
    }
    const double rstd = 1.0 / std::sqrt(ss / c.cols + c.eps);
    if (rstd_out) (*rstd_out)[r] = rstd;
    for (std::int64_t k = 0; k < c.cols; ++k)
      y[r * c.cols + k] = xv[r * c.cols + k] * sv[r * c.groups() + k / c.group] * rstd * wv[k];
  }
  return y;
}

// Spacing of the fp8 format's values around magnitude a (subnormal spacing below the smallest
// normal).
inline double fp8_ulp(DType d, double a) {
  const bool e4m3 = d == DType::f8e4m3;
  const int mantissa_bits = e4m3 ? 3 : 2, min_exp = e4m3 ? -6 : -14;
  const int e = a > 0 ? std::max(min_exp, std::ilogb(a)) : min_exp;
  return std::ldexp(1.0, e - mantissa_bits);
}

// Does qy * s stay within fp8 rounding of the float64 RMSNorm? Per element the bound is half an
// fp8 ulp of y64 / s (times s), plus 2^-19 |y64| for the float32 evaluation of y, s and 1/s.
struct DequantCheck {
  std::int64_t violations = 0;
  double worst_ratio = 0.0;  // max |qy s - y64| / bound
  double rel_l2 = 0.0;       // ||qy s - y64|| / ||y64||
  double fp8_baseline = 0.0; // the same for y64 / s merely rounded to fp8, times s
  std::string str() const {
    return "violations " + std::to_string(violations) + ", worst error/bound " + std::to_string(worst_ratio) +
           ", rel_l2 " + std::to_string(rel_l2) + " (fp8 rounding alone " + std::to_string(fp8_baseline) + ")";
  }
};

inline DequantCheck check_dequantized(const std::vector<double>& qy_values, double s,
                                      const std::vector<double>& y64, DType q_dtype) {
  DequantCheck d;
  double num = 0, den = 0, base = 0;
  for (std::size_t i = 0; i < y64.size(); ++i) {
    const double got = qy_values[i] * s, ref = y64[i];
    const double bound = 0.5 * s * fp8_ulp(q_dtype, std::abs(ref) / s) + std::ldexp(std::abs(ref), -19);
    const double err = std::abs(got - ref);
    if (!(err <= bound)) ++d.violations;
    d.worst_ratio = std::max(d.worst_ratio, std::isfinite(err) ? err / bound : 1e300);
    num += err * err;
    den += ref * ref;
    const double rounded = detail::round_to(q_dtype, ref / s) * s;
    base += (rounded - ref) * (rounded - ref);
  }
  d.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  d.fp8_baseline = den > 0 ? std::sqrt(base / den) : std::sqrt(base);
  return d;
}

// ---- gradients ---------------------------------------------------------------------------------

// Central differences of L = sum(y64 * dy) (the float64 RMSNorm) with respect to the dequantized
// input (every `stride`-th element) and the weight; the backward's dx and dweight are exactly
// these gradients.
struct FiniteDifferences {
  std::vector<std::int64_t> x_index;
  std::vector<double> dx, dw;
};

inline FiniteDifferences finite_differences(const Problem& p, std::int64_t stride) {
  const Case& c = p.c;
  const auto xv = p.x.values(), sv = p.scales.values(), wv0 = p.weight.values(), dyv = p.dy.values();
  std::vector<double> xd(c.rows * c.cols);
  for (std::int64_t r = 0; r < c.rows; ++r)
    for (std::int64_t k = 0; k < c.cols; ++k) xd[r * c.cols + k] = xv[r * c.cols + k] * sv[r * c.groups() + k / c.group];
  auto loss = [&](const std::vector<double>& xs, const std::vector<double>& w) {
    double l = 0.0;
    for (std::int64_t r = 0; r < c.rows; ++r) {
      double ss = 0.0;
      for (std::int64_t k = 0; k < c.cols; ++k) ss += xs[r * c.cols + k] * xs[r * c.cols + k];
      const double rstd = 1.0 / std::sqrt(ss / c.cols + c.eps);
      for (std::int64_t k = 0; k < c.cols; ++k) l += xs[r * c.cols + k] * rstd * w[k] * dyv[r * c.cols + k];
    }
    return l;
  };
  FiniteDifferences fd;
  for (std::int64_t i = 0; i < c.rows * c.cols; i += stride) {
    auto xs = xd;
    const double h = 1e-5 * std::max(1.0, std::abs(xd[i]));
    xs[i] = xd[i] + h;
    const double lp = loss(xs, wv0);
    xs[i] = xd[i] - h;
    const double lm = loss(xs, wv0);
    fd.x_index.push_back(i);
    fd.dx.push_back((lp - lm) / (2 * h));
  }
  for (std::int64_t k = 0; k < c.cols; ++k) {
    auto w = wv0;
    const double h = 1e-5 * std::max(1.0, std::abs(wv0[k]));
    w[k] = wv0[k] + h;
    const double lp = loss(xd, w);
    w[k] = wv0[k] - h;
    const double lm = loss(xd, w);
    fd.dw.push_back((lp - lm) / (2 * h));
  }
  return fd;
}

// The float32 baseline of the weight gradient: testing::f32_column_sum_error (harness.h).
using testing::f32_column_sum_error;

// Terms dy * x_hat of the weight gradient (x_hat from the saved rstd), for the baseline above.
inline std::vector<double> dweight_terms(const Problem& p) {
  const Case& c = p.c;
  const auto xv = p.x.values(), sv = p.scales.values(), dyv = p.dy.values(), rs = p.rstd.values();
  std::vector<double> t(c.rows * c.cols);
  for (std::int64_t r = 0; r < c.rows; ++r)
    for (std::int64_t k = 0; k < c.cols; ++k)
      t[r * c.cols + k] = dyv[r * c.cols + k] * xv[r * c.cols + k] * sv[r * c.groups() + k / c.group] * rs[r];
  return t;
}

// ||rstd * dy * w||: the size of the terms dx is a difference of (for its cancellation floor).
inline double dx_term_norm(const Problem& p) {
  const Case& c = p.c;
  const auto dyv = p.dy.values(), wv = p.weight.values(), rs = p.rstd.values();
  double s = 0.0;
  for (std::int64_t r = 0; r < c.rows; ++r)
    for (std::int64_t k = 0; k < c.cols; ++k) s += std::pow(dyv[r * c.cols + k] * wv[k] * rs[r], 2);
  return std::sqrt(s);
}

// ---- GPU against the CPU reference ---------------------------------------------------------------

// max |y| as the forward defines it (fp8_norm_math.h, float32 throughout) from the inputs and the
// given rstd. The GPU's max is this function of the GPU's rstd.
inline float amax_from_rstd(const Problem& p, const std::vector<double>& rstd) {
  const Case& c = p.c;
  const auto xv = p.x.values(), sv = p.scales.values(), wv = p.weight.values();
  float amax = 0.0f;
  for (std::int64_t r = 0; r < c.rows; ++r)
    for (std::int64_t k = 0; k < c.cols; ++k) {
      const float xd = fp8_norm::dequantize(static_cast<float>(xv[r * c.cols + k]),
                                            static_cast<float>(sv[r * c.groups() + k / c.group]));
      const float y = fp8_norm::normalized(fp8_norm::weighted(xd, static_cast<float>(wv[k])),
                                           static_cast<float>(rstd[r]));
      amax = std::max(amax, std::fabs(y));  // as the reference: NaN leaves amax as it is
    }
  return amax;
}

struct ForwardComparison {
  CodeDiff qy, qy_t, y, rstd, scale;
  bool transpose_ok = true;  // the GPU's qy_t is exactly its qy transposed
  // The GPU quantized with another multiplier (fp8_max / max |y|) than the CPU. y_scale differing
  // says so, but y_scale agreeing does not rule it out: max |y| / fp8_max is not one-to-one (two
  // maxima an ulp apart can give one y_scale and two multipliers), so when a row's rstd differs,
  // the multiplier is recomputed from the GPU's rstd.
  bool multiplier_differs = false;
  // Differences in rows whose rstd agrees (with the multiplier agreeing too, there must be none:
  // the rest of the arithmetic is the same float32 sequence on both sides).
  std::int64_t qy_diff_in_exact_rows = 0, y_diff_in_exact_rows = 0;
  DequantCheck dequant;  // the GPU's qy * s against the float64 RMSNorm
};

inline std::int64_t differences_outside(const std::vector<std::uint32_t>& a, const std::vector<std::uint32_t>& b,
                                        const std::vector<bool>& row_differs, std::int64_t cols) {
  std::int64_t n = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i] && !row_differs[i / cols]) ++n;
  return n;
}

// Runs the forward on both problems (same inputs) and compares every output.
inline ForwardComparison compare_forward(Problem& cpu, Problem& gpu) {
  const Case& c = cpu.c;
  cpu.forward();
  gpu.poison_outputs();
  gpu.forward();
  ForwardComparison out;
  const Format qf = format_of(c.q_dtype);
  const auto q_cpu = element_bits(cpu.qy, c.rows, c.cols, c.cols + c.qy_pad);
  const auto q_gpu = element_bits(gpu.qy, c.rows, c.cols, c.cols + c.qy_pad);
  const auto t_cpu = element_bits(cpu.qy_t, c.cols, c.rows, c.rows + c.qyt_pad);
  const auto t_gpu = element_bits(gpu.qy_t, c.cols, c.rows, c.rows + c.qyt_pad);
  out.qy = compare_codes(qf, q_gpu, q_cpu);
  out.qy_t = compare_codes(qf, t_gpu, t_cpu);
  out.transpose_ok = transpose_consistent(q_gpu, t_gpu, c.rows, c.cols);
  const auto r_gpu = float_bits(gpu.rstd.values()), r_cpu = float_bits(cpu.rstd.values());
  out.rstd = compare_codes(Format::f32, r_gpu, r_cpu);
  out.scale = compare_codes(Format::f32, float_bits(gpu.y_scale.values()), float_bits(cpu.y_scale.values()));
  out.multiplier_differs = out.scale.mismatches > 0;
  if (!out.multiplier_differs && out.rstd.mismatches > 0) {
    const float max_finite = fp8_norm::fp8_max(c.q_dtype == DType::f8e4m3);
    out.multiplier_differs = fp8_norm::quant_multiplier(amax_from_rstd(cpu, gpu.rstd.values()), max_finite) !=
                             fp8_norm::quant_multiplier(amax_from_rstd(cpu, cpu.rstd.values()), max_finite);
    if (out.multiplier_differs)
      std::printf("[fp8_norm] %s: y_scale agrees, the multiplier does not (rstd of the max row differs)\n",
                  c.str().c_str());
  }
  std::vector<bool> row_differs(c.rows);
  for (std::int64_t r = 0; r < c.rows; ++r) row_differs[r] = r_gpu[r] != r_cpu[r] || out.multiplier_differs;
  out.qy_diff_in_exact_rows = differences_outside(q_gpu, q_cpu, row_differs, c.cols);
  if (c.with_y) {
    const auto y_gpu = element_bits(*gpu.y, c.rows, c.cols, c.cols + c.y_pad);
    const auto y_cpu = element_bits(*cpu.y, c.rows, c.cols, c.cols + c.y_pad);
    out.y = compare_codes(Format::bf16, y_gpu, y_cpu);
    out.y_diff_in_exact_rows = differences_outside(y_gpu, y_cpu, row_differs, c.cols);
  }
  out.dequant = check_dequantized(gpu.qy.values(), gpu.y_scale.values()[0], rms_norm_f64(cpu), c.q_dtype);
  return out;
}

}  // namespace fusekit::testing::fp8
