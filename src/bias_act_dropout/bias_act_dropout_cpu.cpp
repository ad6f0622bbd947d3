// CPU reference for bias + activation + dropout: plain loops in float64, OpenMP over rows, the
// mask from the same dropout_keeps() definition the kernels implement. It is the ground truth the
// CUDA kernels are tested against, and the CPU backend of the ops.
#include <algorithm>
#include <vector>

#include "core/activation.h"
#include "core/convert.h"
#include "bias_act_dropout/bias_act_dropout_params.h"
#include "fusekit/bias_act_dropout.h"

namespace fusekit::bias_act_dropout {

using detail::load_as_double;
using detail::store_from_double;
using Math = detail::ActivationMath<double>;

namespace {

// The mask along a row (dropout_keeps() of fusekit/dropout.h), with one Philox call per group of
// eight linear indices rather than per element.
class MaskCursor {
 public:
  explicit MaskCursor(const Scalars& s) : s_(s) {}
  // 1 / (1 - p) for a kept element, 0 for a dropped one; 1 when p = 0.
  double factor(std::uint64_t index) {
    if (!s_.dropout()) return 1.0;
    const std::uint64_t group = index / 8;
    if (group != group_) {
      words_ = philox::random4(s_.seed, s_.offset, group);
      group_ = group;
    }
    return dropout_random16_of_group(words_, index) >= s_.keep_threshold
               ? 1.0 / (1.0 - static_cast<double>(s_.p))
               : 0.0;
  }

 private:
  const Scalars& s_;
  std::uint64_t group_ = ~std::uint64_t(0);
  philox::Words4 words_{};
};

double bias_at(const void* bias, DType dtype, std::int64_t c) {
  return bias ? load_as_double(bias, dtype, c) : 0.0;
}

// dx of one element, exact: dy * mask factor * act'(x + b).
double grad_at(const BackwardParams& p, MaskCursor& mask, std::int64_t r, std::int64_t c) {
  const double h = load_as_double(p.x, p.dtype, r * p.x_row_stride + c) + bias_at(p.bias, p.bias_dtype, c);
  const double f = mask.factor(static_cast<std::uint64_t>(r * p.cols + c));
  if (f == 0.0) return 0.0;
  const double dy = load_as_double(p.dy, p.dtype, r * p.dy_row_stride + c);
  return dy * f * Math::derivative(p.s.activation, h, p.s.slope);
}

}  // namespace

void forward_cpu(const ForwardParams& p) {
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < p.rows; ++r) {
    MaskCursor mask(p.s);
    for (std::int64_t c = 0; c < p.cols; ++c) {
      const double h = load_as_double(p.x, p.dtype, r * p.x_row_stride + c) + bias_at(p.bias, p.bias_dtype, c);
      const double f = mask.factor(static_cast<std::uint64_t>(r * p.cols + c));
      const double y = f == 0.0 ? 0.0 : Math::forward(p.s.activation, h, p.s.slope) * f;
      store_from_double(p.y, p.dtype, r * p.y_row_stride + c, y);
      if (p.pre_activation) store_from_double(p.pre_activation, p.dtype, r * p.pre_activation_row_stride + c, h);
    }
  }
}

void backward_cpu(const BackwardParams& p) {
  if (p.dx) {
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < p.rows; ++r) {
      MaskCursor mask(p.s);
      for (std::int64_t c = 0; c < p.cols; ++c)
        store_from_double(p.dx, p.dtype, r * p.dx_row_stride + c, grad_at(p, mask, r, c));
    }
  }
  if (p.dbias) {
    // Column sums over rows. Each thread owns a block of whole columns and walks the rows in
    // order, so the summation order is fixed whatever the thread count.
    constexpr std::int64_t kColumnBlock = 256;
    const std::int64_t blocks = (p.cols + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static)
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::int64_t c0 = b * kColumnBlock, c1 = std::min(p.cols, c0 + kColumnBlock);
      std::vector<double> sums(c1 - c0, 0.0);
      for (std::int64_t r = 0; r < p.rows; ++r) {
        MaskCursor mask(p.s);
        for (std::int64_t c = c0; c < c1; ++c) sums[c - c0] += grad_at(p, mask, r, c);
      }
      for (std::int64_t c = c0; c < c1; ++c) store_from_double(p.dbias, p.dbias_dtype, c, sums[c - c0]);
    }
  }
}

}  // namespace fusekit::bias_act_dropout
