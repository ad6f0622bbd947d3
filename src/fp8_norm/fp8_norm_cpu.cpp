// CPU reference for FP8 RMSNorm: plain loops, OpenMP over rows. The statistics and the whole
// backward are in float64; the forward's outputs follow the float32 definition shared with the
// kernels (fp8_norm_math.h), and fp8/bf16 encoding goes through the CUDA toolkit's own
// host-callable conversions (core/convert.h), so that the quantized outputs are reproducible
// bit for bit.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/convert.h"
#include "fp8_norm/fp8_norm_math.h"
#include "fp8_norm/fp8_norm_params.h"

namespace fusekit::fp8_norm {

using detail::load_as_double;
using detail::store_from_double;

namespace {

float load_float(const void* base, DType dtype, std::int64_t index) {
  return static_cast<float>(load_as_double(base, dtype, index));
}

// Dequantized element (r, c) of x, as the forward and backward both define it.
template <typename Params>
float dequantized(const Params& p, std::int64_t r, std::int64_t c) {
  const float q = load_float(p.x, p.x_dtype, r * p.x_row_stride + c);
  const float s = load_float(p.scales, p.scale_dtype, r * p.scale_row_stride + (c >> p.log2_group));
  return dequantize(q, s);
}

// The exact sum of (q * scale)^2 over a row, up to float64 rounding.
template <typename Params>
double row_sum_squares(const Params& p, std::int64_t r) {
  double ss = 0.0;
  for (std::int64_t c = 0; c < p.cols; ++c) {
    const double q = load_as_double(p.x, p.x_dtype, r * p.x_row_stride + c);
    const double s = load_as_double(p.scales, p.scale_dtype, r * p.scale_row_stride + (c >> p.log2_group));
    const double v = q * s;  // exact: at most 4 + 24 significant bits
    ss += v * v;
  }
  return ss;
}

}  // namespace

void forward_cpu(const ForwardParams& p) {
  const std::int64_t n = p.cols;
  std::vector<float> weight(n);
  for (std::int64_t c = 0; c < n; ++c) weight[c] = load_float(p.weight, p.weight_dtype, c);

  float amax = 0.0f;
#pragma omp parallel for schedule(static) reduction(max : amax)
  for (std::int64_t r = 0; r < p.rows; ++r) {
    const float rstd = rstd_from_sum_squares(row_sum_squares(p, r), n, p.eps);
    p.rstd[r] = rstd;
    for (std::int64_t c = 0; c < n; ++c) {
      const float y = normalized(weighted(dequantized(p, r, c), weight[c]), rstd);
      amax = std::max(amax, std::fabs(y));  // std::max keeps amax when y is NaN
    }
  }

  const float max_finite = fp8_max(p.q_dtype == DType::f8e4m3);
  *p.y_scale = tensor_scale(amax, max_finite);
  const float multiplier = quant_multiplier(amax, max_finite);
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < p.rows; ++r) {
    const float rstd = p.rstd[r];
    for (std::int64_t c = 0; c < n; ++c) {
      const float q = load_float(p.x, p.x_dtype, r * p.x_row_stride + c);
      const float scale = load_float(p.scales, p.scale_dtype, r * p.scale_row_stride + (c >> p.log2_group));
      // store_from_double rounds double -> float (exact here) -> fp8 with saturation.
      const double scaled = quant_value(q, weight[c], quant_factor(scale, rstd, multiplier));
      store_from_double(p.qy, p.q_dtype, r * p.qy_row_stride + c, scaled);
      store_from_double(p.qy_t, p.q_dtype, c * p.qy_t_row_stride + r, scaled);
      if (p.y) {
        const float y = normalized(weighted(dequantize(q, scale), weight[c]), rstd);
        store_from_double(p.y, DType::bf16, r * p.y_row_stride + c, y);
      }
    }
  }
}

void backward_cpu(const BackwardParams& p) {
  const std::int64_t n = p.cols;
  std::vector<double> weight(n);
  for (std::int64_t c = 0; c < n; ++c) weight[c] = load_as_double(p.weight, p.weight_dtype, c);
  auto x_hat = [&](std::int64_t r, std::int64_t c) {
    return static_cast<double>(dequantized(p, r, c)) * static_cast<double>(p.rstd[r]);
  };
  auto dy_at = [&](std::int64_t r, std::int64_t c) {
    return load_as_double(p.dy, DType::bf16, r * p.dy_row_stride + c);
  };
  if (p.dx) {
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < p.rows; ++r) {
      // dx = rstd * (g - x_hat * mean(g * x_hat)), g = dy * w.
      double sum_gx = 0.0;
      for (std::int64_t c = 0; c < n; ++c) sum_gx += dy_at(r, c) * weight[c] * x_hat(r, c);
      const double mean_gx = sum_gx / static_cast<double>(n);
      const double rstd = p.rstd[r];
      for (std::int64_t c = 0; c < n; ++c) {
        const double dx = rstd * (dy_at(r, c) * weight[c] - x_hat(r, c) * mean_gx);
        store_from_double(p.dx, DType::bf16, r * p.dx_row_stride + c, dx);
      }
    }
  }
  if (p.dweight) {
    // Column sums over rows in row order; each thread owns whole column blocks, so the order of
    // summation does not depend on the thread count.
    constexpr std::int64_t kColumnBlock = 256;
    const std::int64_t blocks = (n + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static)
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::int64_t c0 = b * kColumnBlock, c1 = std::min(n, c0 + kColumnBlock);
      std::vector<double> dw(c1 - c0, 0.0);
      for (std::int64_t r = 0; r < p.rows; ++r)
        for (std::int64_t c = c0; c < c1; ++c) dw[c - c0] += dy_at(r, c) * x_hat(r, c);
      for (std::int64_t c = c0; c < c1; ++c) store_from_double(p.dweight, p.weight_dtype, c, dw[c - c0]);
    }
  }
}

}  // namespace fusekit::fp8_norm
