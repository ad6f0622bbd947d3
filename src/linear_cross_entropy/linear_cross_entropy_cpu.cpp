// CPU reference for linear_cross_entropy: everything in float64, straight from the definition
// (logits, row statistics, loss, the gradient of the logits, then dh, dW and db), one block of
// rows at a time so that memory stays bounded. OpenMP runs over rows (logits, dh) and over classes
// (dW, db, summed in row order), so the results do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/convert.h"
#include "linear_cross_entropy/linear_cross_entropy_params.h"

namespace fusekit::lxent {

using detail::load_as_double;
using detail::store_from_double;

namespace {

constexpr std::int64_t kBlockRows = 64;

std::int64_t target_of(const Params& p, std::int64_t r) {
  return static_cast<std::int64_t>(load_as_double(p.targets, p.target_dtype, r));
}

}  // namespace

void run_cpu(const Params& p) {
  const std::int64_t T = p.tokens, V = p.vocab, H = p.hidden;
  std::int64_t counted = 0;
  for (std::int64_t r = 0; r < T; ++r) counted += target_of(p, r) != p.ignore_index;
  double g = 1.0;
  if (p.reduction == LossReduction::mean) g = counted > 0 ? 1.0 / static_cast<double>(counted) : 0.0;
  const double s = p.label_smoothing, z = p.z_loss;

  // The weight and bias once in float64.
  std::vector<double> w(static_cast<std::size_t>(V * H)), b(static_cast<std::size_t>(V), 0.0);
#pragma omp parallel for schedule(static)
  for (std::int64_t v = 0; v < V; ++v)
    for (std::int64_t k = 0; k < H; ++k) w[v * H + k] = load_as_double(p.weight, p.dtype, v * p.ldw + k);
  if (p.bias)
    for (std::int64_t v = 0; v < V; ++v) b[v] = load_as_double(p.bias, p.dtype, v);

  std::vector<double> losses(static_cast<std::size_t>(T));
  std::vector<double> dw(p.dweight ? static_cast<std::size_t>(V * H) : 0, 0.0);
  std::vector<double> db(p.dbias ? static_cast<std::size_t>(V) : 0, 0.0);
  std::vector<double> hb(static_cast<std::size_t>(kBlockRows * H)), dx(static_cast<std::size_t>(kBlockRows * V));

  for (std::int64_t r0 = 0; r0 < T; r0 += kBlockRows) {
    const std::int64_t rows = std::min(kBlockRows, T - r0);
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < rows; ++i) {
      const std::int64_t r = r0 + i;
      double* hr = &hb[i * H];
      for (std::int64_t k = 0; k < H; ++k) hr[k] = load_as_double(p.h, p.dtype, r * p.ldh + k);
      double* x = &dx[i * V];
      double m = -std::numeric_limits<double>::infinity(), sum_x = 0.0;
      for (std::int64_t v = 0; v < V; ++v) {
        double acc = b[v];
        const double* wv = &w[v * H];
        for (std::int64_t k = 0; k < H; ++k) acc += hr[k] * wv[k];
        x[v] = acc;
        m = std::max(m, acc);
        sum_x += acc;
      }
      double se = 0.0;
      for (std::int64_t v = 0; v < V; ++v) se += std::exp(x[v] - m);
      const double lse = m + std::log(se);
      const std::int64_t t = target_of(p, r);
      const bool ignored = t == p.ignore_index;
      losses[r] = ignored ? 0.0
                          : lse - (1.0 - s) * x[t] - s / static_cast<double>(V) * sum_x + z * lse * lse;
      // The logits' gradient, in place of the logits.
      for (std::int64_t v = 0; v < V; ++v) {
        double d = 0.0;
        if (!ignored) {
          d = std::exp(x[v] - lse) * (1.0 + 2.0 * z * lse) - s / static_cast<double>(V);
          if (v == t) d -= 1.0 - s;
          d *= g;
        }
        x[v] = d;
      }
      if (p.dh) {
        std::vector<double> acc(static_cast<std::size_t>(H), 0.0);
        for (std::int64_t v = 0; v < V; ++v) {
          const double* wv = &w[v * H];
          for (std::int64_t k = 0; k < H; ++k) acc[k] += x[v] * wv[k];
        }
        for (std::int64_t k = 0; k < H; ++k) store_from_double(p.dh, p.dtype, r * p.lddh + k, acc[k]);
      }
    }
    if (p.dweight || p.dbias) {
#pragma omp parallel for schedule(static)
      for (std::int64_t v = 0; v < V; ++v)
        for (std::int64_t i = 0; i < rows; ++i) {
          const double d = dx[i * V + v];
          if (p.dbias) db[v] += d;
          if (p.dweight) {
            double* dwv = &dw[v * H];
            const double* hr = &hb[i * H];
            for (std::int64_t k = 0; k < H; ++k) dwv[k] += d * hr[k];
          }
        }
    }
  }

  if (p.dweight)
    for (std::int64_t v = 0; v < V; ++v)
      for (std::int64_t k = 0; k < H; ++k) store_from_double(p.dweight, p.dweight_dtype, v * p.lddw + k, dw[v * H + k]);
  if (p.dbias)
    for (std::int64_t v = 0; v < V; ++v) store_from_double(p.dbias, p.dbias_dtype, v, db[v]);

  if (p.reduction == LossReduction::none) {
    for (std::int64_t r = 0; r < T; ++r) p.loss[r] = static_cast<float>(losses[r]);
    return;
  }
  double total = 0.0;
  for (std::int64_t r = 0; r < T; ++r) total += losses[r];
  if (p.reduction == LossReduction::mean) total = counted > 0 ? total / static_cast<double>(counted) : 0.0;
  p.loss[0] = static_cast<float>(total);
}

}  // namespace fusekit::lxent
