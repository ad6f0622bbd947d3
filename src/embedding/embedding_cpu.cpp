// CPU reference for the embeddings: plain loops in float64, OpenMP over rows. It is the ground
// truth the CUDA kernels are tested against, and the CPU backend of the ops. Every sum runs in a
// fixed order (tokens in index order, sequences in order), so the result does not depend on the
// thread count.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "core/convert.h"
#include "embedding/embedding_params.h"

namespace fusekit::embedding {

using detail::load_as_double;
using detail::store_from_double;

namespace {

// Token i (the entry point checked that it is in [0, V)).
std::int64_t token_at(const void* ids, DType dtype, std::int64_t i) {
  return dtype == DType::i32 ? static_cast<const std::int32_t*>(ids)[i]
                             : static_cast<const std::int64_t*>(ids)[i];
}

// Row `row` of a (rows, C) gradient: sum[c] (+ the old value when accumulating), rounded once.
void store_gradient_row(void* grad, DType dtype, std::int64_t row_stride, std::int64_t row,
                        const std::vector<double>& sum, bool accumulate) {
  const std::int64_t base = row * row_stride;
  for (std::size_t c = 0; c < sum.size(); ++c) {
    const auto at = base + static_cast<std::int64_t>(c);
    const double old = accumulate ? load_as_double(grad, dtype, at) : 0.0;
    store_from_double(grad, dtype, at, sum[c] + old);
  }
}

}  // namespace

void forward_cpu(const ForwardParams& p) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < p.tokens; ++i) {
    const std::int64_t token = token_at(p.token_ids, p.token_dtype, i);
    const std::int64_t w = token * p.weight_row_stride;
    const std::int64_t pos = (i % p.positions) * p.position_row_stride;
    const std::int64_t o = i * p.out_row_stride;
    for (std::int64_t c = 0; c < p.dim; ++c) {
      double v = load_as_double(p.weight, p.dtype, w + c);
      if (p.position_weight) v += load_as_double(p.position_weight, p.dtype, pos + c);
      store_from_double(p.out, p.dtype, o + c, v);
    }
  }
}

void backward_cpu(const BackwardParams& p) {
  // dweight: the token positions grouped by token, each group in index order (a stable sort).
  std::vector<std::int64_t> order(static_cast<std::size_t>(p.tokens));
  std::iota(order.begin(), order.end(), std::int64_t{0});
  std::vector<std::int64_t> token(order.size());
  for (std::int64_t i = 0; i < p.tokens; ++i) token[i] = token_at(p.token_ids, p.token_dtype, i);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::int64_t a, std::int64_t b) { return token[a] < token[b]; });
  // first[v] .. first[v + 1]: the positions of token v in `order`.
  std::vector<std::int64_t> first(static_cast<std::size_t>(p.vocab) + 1, 0);
  for (std::int64_t i = 0; i < p.tokens; ++i) ++first[token[i] + 1];
  for (std::int64_t v = 0; v < p.vocab; ++v) first[v + 1] += first[v];

#pragma omp parallel
  {
    std::vector<double> sum(static_cast<std::size_t>(p.dim));
#pragma omp for schedule(static)
    for (std::int64_t v = 0; v < p.vocab; ++v) {
      if (first[v] == first[v + 1] && p.accumulate) continue;  // nothing to add
      std::fill(sum.begin(), sum.end(), 0.0);
      for (std::int64_t k = first[v]; k < first[v + 1]; ++k) {
        const std::int64_t row = order[k] * p.dout_row_stride;
        for (std::int64_t c = 0; c < p.dim; ++c) sum[c] += load_as_double(p.dout, p.dtype, row + c);
      }
      store_gradient_row(p.dweight, p.dweight_dtype, p.dweight_row_stride, v, sum, p.accumulate);
    }
  }

  if (!p.dposition_weight) return;
  const std::int64_t sequences = p.positions > 0 ? p.tokens / p.positions : 0;
#pragma omp parallel
  {
    std::vector<double> sum(static_cast<std::size_t>(p.dim));
#pragma omp for schedule(static)
    for (std::int64_t t = 0; t < p.position_rows; ++t) {
      if (t >= p.positions && p.accumulate) continue;  // rows past T get no gradient
      std::fill(sum.begin(), sum.end(), 0.0);
      for (std::int64_t b = 0; t < p.positions && b < sequences; ++b) {
        const std::int64_t row = (b * p.positions + t) * p.dout_row_stride;
        for (std::int64_t c = 0; c < p.dim; ++c) sum[c] += load_as_double(p.dout, p.dtype, row + c);
      }
      store_gradient_row(p.dposition_weight, p.dposition_dtype, p.dposition_row_stride, t, sum,
                         p.accumulate);
    }
  }
}

}  // namespace fusekit::embedding
