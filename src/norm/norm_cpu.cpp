// CPU reference for LayerNorm and RMSNorm: plain loops, float64 accumulation, OpenMP over rows.
// It is the ground truth the CUDA kernels are tested against, and the CPU backend of the ops.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/convert.h"
#include "norm/norm_params.h"

namespace fusekit::norm {

using detail::load_as_double;
using detail::store_from_double;

void forward_cpu(const ForwardParams& p) {
  const std::int64_t n = p.cols;
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < p.rows; ++r) {
    const std::int64_t xo = r * p.x_row_stride, yo = r * p.y_row_stride;
    // The row normalized: x, or x + residual rounded to the dtype (what the backward gets as sum).
    std::vector<double> v(n);
    for (std::int64_t c = 0; c < n; ++c) {
      v[c] = load_as_double(p.x, p.dtype, xo + c);
      if (p.residual)
        v[c] = detail::round_to(p.dtype, v[c] + load_as_double(p.residual, p.dtype, r * p.residual_row_stride + c));
    }
    if (p.sum)
      for (std::int64_t c = 0; c < n; ++c) store_from_double(p.sum, p.dtype, r * p.sum_row_stride + c, v[c]);
    double mean = 0.0;
    if (p.kind == Kind::layer_norm) {
      for (std::int64_t c = 0; c < n; ++c) mean += v[c];
      mean /= static_cast<double>(n);
    }
    double sq = 0.0;
    for (std::int64_t c = 0; c < n; ++c) {
      const double d = v[c] - mean;
      sq += d * d;
    }
    const double rstd = 1.0 / std::sqrt(sq / static_cast<double>(n) + static_cast<double>(p.eps));
    for (std::int64_t c = 0; c < n; ++c) {
      double y = (v[c] - mean) * rstd;
      if (p.weight) y *= load_as_double(p.weight, p.weight_dtype, c);
      if (p.bias) y += load_as_double(p.bias, p.weight_dtype, c);
      store_from_double(p.y, p.dtype, yo + c, y);
    }
    if (p.mean) p.mean[r] = static_cast<float>(mean);
    if (p.rstd) p.rstd[r] = static_cast<float>(rstd);
  }
}

// x_hat for one element: from x with the saved statistics, or from y by undoing the affine map.
static double normalized_input(const BackwardParams& p, std::int64_t r, std::int64_t c) {
  const double in = load_as_double(p.input, p.dtype, r * p.input_row_stride + c);
  if (p.from_output) {
    const double b = p.bias ? load_as_double(p.bias, p.weight_dtype, c) : 0.0;
    const double w = p.weight ? load_as_double(p.weight, p.weight_dtype, c) : 1.0;
    return (in - b) / w;
  }
  const double mean = (p.kind == Kind::layer_norm) ? p.mean[r] : 0.0;
  return (in - mean) * static_cast<double>(p.rstd[r]);
}

void backward_cpu(const BackwardParams& p) {
  const std::int64_t n = p.cols;
  if (p.dx) {
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < p.rows; ++r) {
      // dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)), g = dy * weight; RMSNorm drops mean(g).
      double sum_g = 0.0, sum_gx = 0.0;
      for (std::int64_t c = 0; c < n; ++c) {
        const double w = p.weight ? load_as_double(p.weight, p.weight_dtype, c) : 1.0;
        const double g = load_as_double(p.dy, p.dtype, r * p.dy_row_stride + c) * w;
        sum_g += g;
        sum_gx += g * normalized_input(p, r, c);
      }
      const double mean_g = (p.kind == Kind::layer_norm) ? sum_g / n : 0.0;
      const double mean_gx = sum_gx / n;
      const double rstd = p.rstd[r];
      for (std::int64_t c = 0; c < n; ++c) {
        const double w = p.weight ? load_as_double(p.weight, p.weight_dtype, c) : 1.0;
        const double g = load_as_double(p.dy, p.dtype, r * p.dy_row_stride + c) * w;
        double dx = rstd * (g - mean_g - normalized_input(p, r, c) * mean_gx);
        if (p.dsum) dx += load_as_double(p.dsum, p.dtype, r * p.dsum_row_stride + c);
        store_from_double(p.dx, p.dtype, r * p.dx_row_stride + c, dx);
      }
    }
  }
  if (p.dweight || p.dbias) {
    // Column sums over rows. Each thread owns a block of whole columns and walks the rows in
    // order (row-major friendly), so the summation order is fixed whatever the thread count.
    constexpr std::int64_t kColumnBlock = 256;
    const std::int64_t blocks = (n + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static)
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::int64_t c0 = b * kColumnBlock, c1 = std::min(n, c0 + kColumnBlock);
      std::vector<double> dw(c1 - c0, 0.0), db(c1 - c0, 0.0);
      for (std::int64_t r = 0; r < p.rows; ++r) {
        for (std::int64_t c = c0; c < c1; ++c) {
          const double dy = load_as_double(p.dy, p.dtype, r * p.dy_row_stride + c);
          if (p.dweight) dw[c - c0] += dy * normalized_input(p, r, c);
          db[c - c0] += dy;
        }
      }
      for (std::int64_t c = c0; c < c1; ++c) {
        if (p.dweight) store_from_double(p.dweight, p.weight_dtype, c, dw[c - c0]);
        if (p.dbias) store_from_double(p.dbias, p.weight_dtype, c, db[c - c0]);
      }
    }
  }
}

}  // namespace fusekit::norm
