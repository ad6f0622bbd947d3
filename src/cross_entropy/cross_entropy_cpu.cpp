// CPU reference for cross-entropy: plain loops in float64, OpenMP over rows. It is the ground truth
// the CUDA kernels are tested against, and the CPU backend of the ops. The row losses are reduced
// in row order, so the result does not depend on the thread count.
#include <cmath>
#include <limits>
#include <vector>

#include "core/convert.h"
#include "cross_entropy/cross_entropy_params.h"

namespace fusekit::cross_entropy {

using detail::load_as_double;
using detail::store_from_double;

namespace {

struct RowStats {
  double lse = 0.0;
  double sum = 0.0;  // sum of the logits (label smoothing)
};

RowStats row_stats(const Params& p, std::int64_t r) {
  const std::int64_t base = r * p.logits_row_stride;
  double m = -std::numeric_limits<double>::infinity(), sum = 0.0;
  for (std::int64_t j = 0; j < p.cols; ++j) {
    const double x = load_as_double(p.logits, p.dtype, base + j);
    m = std::max(m, x);
    sum += x;
  }
  double s = 0.0;
  for (std::int64_t j = 0; j < p.cols; ++j) {
    const double x = load_as_double(p.logits, p.dtype, base + j);
    s += m == -std::numeric_limits<double>::infinity() ? 0.0 : std::exp(x - m);
  }
  return {m + std::log(s), sum};
}

std::int64_t target_of(const Params& p, std::int64_t r) {
  return static_cast<std::int64_t>(load_as_double(p.targets, p.target_dtype, r));
}

// Rows not ignored (the targets are known valid: the entry point checked them).
std::int64_t counted_rows(const Params& p) {
  std::int64_t n = 0;
  for (std::int64_t r = 0; r < p.rows; ++r) n += target_of(p, r) != p.ignore_index;
  return n;
}

// The gradient scale of row r: dloss (per row or one), divided by N for the mean; 1 (and 1 / N)
// in the fused call.
double gradient_scale(const Params& p, std::int64_t r, std::int64_t counted) {
  double g = 1.0;
  if (p.pass == Pass::backward) g = p.dloss[p.reduction == LossReduction::none ? r : 0];
  if (p.reduction == LossReduction::mean) g = counted > 0 ? g / static_cast<double>(counted) : 0.0;
  return g;
}

// Row r's gradient into dlogits from its lse: every logit read before any is written (in place).
void write_gradient_row(const Params& p, std::int64_t r, double lse, double g, std::vector<double>& row) {
  const std::int64_t t = target_of(p, r);
  const std::int64_t out = r * p.dlogits_row_stride;
  if (t == p.ignore_index) {
    for (std::int64_t j = 0; j < p.cols; ++j) store_from_double(p.dlogits, p.dtype, out + j, 0.0);
    return;
  }
  const double s = p.label_smoothing, z = p.z_loss;
  const std::int64_t in = r * p.logits_row_stride;
  for (std::int64_t j = 0; j < p.cols; ++j) row[j] = load_as_double(p.logits, p.dtype, in + j);
  for (std::int64_t j = 0; j < p.cols; ++j) {
    const double softmax = std::exp(row[j] - lse);
    double d = softmax * (1.0 + 2.0 * z * lse) - s / static_cast<double>(p.cols);
    if (j == t) d -= 1.0 - s;
    store_from_double(p.dlogits, p.dtype, out + j, g * d);
  }
}

}  // namespace

void run_cpu(const Params& p) {
  const std::int64_t counted = p.reduction == LossReduction::mean ? counted_rows(p) : 0;
  if (p.pass == Pass::backward) {
#pragma omp parallel
    {
      std::vector<double> row(static_cast<std::size_t>(p.cols));
#pragma omp for schedule(static)
      for (std::int64_t r = 0; r < p.rows; ++r)
        write_gradient_row(p, r, static_cast<double>(p.lse[r]), gradient_scale(p, r, counted), row);
    }
    return;
  }

  // Forward (and fused): row losses, lse, and in the fused call the gradient from the exact lse.
  std::vector<double> losses(static_cast<std::size_t>(p.rows));
  const double s = p.label_smoothing, z = p.z_loss;
#pragma omp parallel
  {
    std::vector<double> row(p.pass == Pass::forward_backward ? static_cast<std::size_t>(p.cols) : 0);
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < p.rows; ++r) {
      const std::int64_t t = target_of(p, r);
      const RowStats st = row_stats(p, r);
      double loss = 0.0;
      if (t != p.ignore_index) {
        const double xt = load_as_double(p.logits, p.dtype, r * p.logits_row_stride + t);
        loss = st.lse - (1.0 - s) * xt - s / static_cast<double>(p.cols) * st.sum + z * st.lse * st.lse;
      }
      losses[r] = loss;
      if (p.lse) p.lse[r] = static_cast<float>(st.lse);
      if (p.pass == Pass::forward_backward) write_gradient_row(p, r, st.lse, gradient_scale(p, r, counted), row);
    }
  }
  if (p.reduction == LossReduction::none) {
    for (std::int64_t r = 0; r < p.rows; ++r) p.loss[r] = static_cast<float>(losses[r]);
    return;
  }
  double total = 0.0;
  for (std::int64_t r = 0; r < p.rows; ++r) total += losses[r];
  if (p.reduction == LossReduction::mean) total = counted > 0 ? total / static_cast<double>(counted) : 0.0;
  p.loss[0] = static_cast<float>(total);
}

}  // namespace fusekit::cross_entropy
