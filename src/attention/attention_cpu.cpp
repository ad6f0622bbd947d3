// Float64 CPU reference of attention forward and backward, with every feature of
// fusekit/attention.h. One (batch, head) slice at a time, parallel over slices with OpenMP. The
// backward recomputes P from the saved float32 lse, as the kernels will.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "attention/attention_params.h"
#include "core/convert.h"
#include "fusekit/attention.h"

namespace fusekit::attention {
namespace {

using detail::load_as_double;
using detail::store_from_double;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Where sequence b starts in the packed token dimension, and its lengths.
struct Seq {
  std::int64_t q0 = 0, k0 = 0, sq = 0, sk = 0;
};

Seq sequence(const Problem& p, std::int64_t b) {
  if (!p.varlen) return {0, 0, p.seqlen_q, p.seqlen_k};
  return {p.cu_seqlens_q[b], p.cu_seqlens_k[b], std::int64_t{p.cu_seqlens_q[b + 1]} - p.cu_seqlens_q[b],
          std::int64_t{p.cu_seqlens_k[b + 1]} - p.cu_seqlens_k[b]};
}

// The visible key range [lo, hi) of query i (empty when lo >= hi).
void visible_keys(const Problem& p, const Seq& s, std::int64_t i, std::int64_t* lo, std::int64_t* hi) {
  const std::int64_t d = p.mask == AttentionMask::causal_top_left ? 0 : s.sk - s.sq;
  std::int64_t first = 0, last = s.sk - 1;  // inclusive
  if (p.mask != AttentionMask::none) last = std::min(last, i + d);
  if (p.window_right >= 0) last = std::min(last, i + d + p.window_right);
  if (p.window_left >= 0) first = std::max(first, i + d - p.window_left);
  *lo = first;
  *hi = std::max(first, last + 1);
}

// Loads an (S, H, Dh) slice of one batch/head into a dense double matrix.
std::vector<double> load_rows(const Operand& op, DType dtype, std::int64_t b, std::int64_t s0,
                              std::int64_t rows, std::int64_t h, std::int64_t dim, bool varlen) {
  std::vector<double> m(static_cast<std::size_t>(rows * dim));
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t base = op.offset(varlen ? 0 : b, s0 + r, h);
    for (std::int64_t c = 0; c < dim; ++c) m[r * dim + c] = load_as_double(op.data, dtype, base + c);
  }
  return m;
}

void store_rows(const Operand& op, DType dtype, std::int64_t b, std::int64_t s0, std::int64_t rows,
                std::int64_t h, std::int64_t dim, bool varlen, const std::vector<double>& m) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t base = op.offset(varlen ? 0 : b, s0 + r, h);
    for (std::int64_t c = 0; c < dim; ++c) store_from_double(op.data, dtype, base + c, m[r * dim + c]);
  }
}

double dot(const double* a, const double* b, std::int64_t n) {
  double s = 0.0;
  for (std::int64_t c = 0; c < n; ++c) s += a[c] * b[c];
  return s;
}

std::int64_t lse_index(const Problem& p, const Seq& s, std::int64_t b, std::int64_t h, std::int64_t i) {
  return p.varlen ? h * p.total_q + s.q0 + i : (b * p.heads_q + h) * p.seqlen_q + i;
}

// The dropout factor Z of element (b, h, i, j): 0 or 1 / (1 - p) (in float32, as documented).
struct DropoutRule {
  bool active = false;
  std::uint32_t threshold = 0;
  double keep_scale = 1.0;
  explicit DropoutRule(const Problem& p) {
    active = p.dropout_p > 0.0f;
    threshold = dropout_keep_threshold(p.dropout_p);
    keep_scale = static_cast<double>(1.0f / (1.0f - p.dropout_p));
  }
  double factor(const Problem& p, std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
    if (!active) return 1.0;
    return attention_dropout_keeps(p.seed, p.offset, b, h, p.heads_q, i, j, threshold) ? keep_scale : 0.0;
  }
};

// Raw scores S (masked entries -inf) of one (b, h) slice: sq x sk, row-major.
std::vector<double> scores(const Problem& p, const Seq& s, std::int64_t b, std::int64_t h,
                           const std::vector<double>& q, const std::vector<double>& k) {
  std::vector<double> S(static_cast<std::size_t>(s.sq * s.sk), kNegInf);
  for (std::int64_t i = 0; i < s.sq; ++i) {
    std::int64_t lo, hi;
    visible_keys(p, s, i, &lo, &hi);
    for (std::int64_t j = lo; j < hi; ++j) {
      double x = p.scale * dot(&q[i * p.head_dim], &k[j * p.head_dim], p.head_dim);
      if (p.bias.data) x += load_as_double(p.bias.data, p.bias.dtype, p.bias.offset(b, h, i, j));
      S[i * s.sk + j] = x;
    }
  }
  return S;
}

}  // namespace

void forward_cpu(const Problem& p) {
  const std::int64_t group = p.heads_q / p.heads_kv;
  const DropoutRule drop(p);
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t h = 0; h < p.heads_q; ++h) {
      const Seq s = sequence(p, b);
      const std::int64_t hk = h / group;
      const auto q = load_rows(p.q, p.dtype, b, s.q0, s.sq, h, p.head_dim, p.varlen);
      const auto k = load_rows(p.k, p.dtype, b, s.k0, s.sk, hk, p.head_dim, p.varlen);
      const auto v = load_rows(p.v, p.dtype, b, s.k0, s.sk, hk, p.head_dim_v, p.varlen);
      const auto S = scores(p, s, b, h, q, k);
      std::vector<double> out(static_cast<std::size_t>(s.sq * p.head_dim_v), 0.0);
      for (std::int64_t i = 0; i < s.sq; ++i) {
        const double* row = &S[i * s.sk];
        double m = kNegInf;
        for (std::int64_t j = 0; j < s.sk; ++j) m = std::max(m, row[j]);
        double lse = kNegInf;
        if (m != kNegInf) {  // otherwise every key is masked: out stays 0, lse = -inf
          double sum = 0.0;
          for (std::int64_t j = 0; j < s.sk; ++j) sum += std::exp(row[j] - m);
          lse = m + std::log(sum);
          for (std::int64_t j = 0; j < s.sk; ++j) {
            if (row[j] == kNegInf) continue;
            const double w = std::exp(row[j] - lse) * drop.factor(p, b, h, i, j);
            if (w == 0.0) continue;
            for (std::int64_t c = 0; c < p.head_dim_v; ++c) out[i * p.head_dim_v + c] += w * v[j * p.head_dim_v + c];
          }
        }
        p.lse[lse_index(p, s, b, h, i)] = static_cast<float>(lse);
      }
      store_rows(p.out, p.dtype, b, s.q0, s.sq, h, p.head_dim_v, p.varlen, out);
    }
  }
}

void backward_cpu(const BackwardProblem& p) {
  const std::int64_t group = p.heads_q / p.heads_kv;
  const DropoutRule drop(p);
  const bool want_dbias = p.dbias.data != nullptr;
  // dS of every (b, h) slice, kept when dbias is wanted so that the reduction over broadcast
  // dimensions runs afterwards in a fixed order (deterministic, no races). Offsets per batch.
  std::vector<std::int64_t> ds_offset(static_cast<std::size_t>(p.batch + 1), 0);
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const Seq s = sequence(p, b);
    ds_offset[b + 1] = ds_offset[b] + p.heads_q * s.sq * s.sk;
  }
  std::vector<double> ds_all(want_dbias ? static_cast<std::size_t>(ds_offset[p.batch]) : 0);

#pragma omp parallel for collapse(2) schedule(dynamic)
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t hk = 0; hk < p.heads_kv; ++hk) {
      const Seq s = sequence(p, b);
      const std::int64_t D = p.head_dim, Dv = p.head_dim_v;
      const auto k = load_rows(p.k, p.dtype, b, s.k0, s.sk, hk, D, p.varlen);
      const auto v = load_rows(p.v, p.dtype, b, s.k0, s.sk, hk, Dv, p.varlen);
      std::vector<double> dk(static_cast<std::size_t>(s.sk * D), 0.0), dv(static_cast<std::size_t>(s.sk * Dv), 0.0);
      for (std::int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        const auto q = load_rows(p.q, p.dtype, b, s.q0, s.sq, h, D, p.varlen);
        const auto o = load_rows(p.out, p.dtype, b, s.q0, s.sq, h, Dv, p.varlen);
        const auto dout = load_rows(p.dout, p.dtype, b, s.q0, s.sq, h, Dv, p.varlen);
        const auto S = scores(p, s, b, h, q, k);
        std::vector<double> dq(static_cast<std::size_t>(s.sq * D), 0.0);
        for (std::int64_t i = 0; i < s.sq; ++i) {
          const double lse = p.lse[lse_index(p, s, b, h, i)];
          const double delta = dot(&dout[i * Dv], &o[i * Dv], Dv);  // rowsum(dO * O)
          for (std::int64_t j = 0; j < s.sk; ++j) {
            const double x = S[i * s.sk + j];
            double ds = 0.0;
            // A fully masked row has lse = -inf: it contributes nothing (never exp(-inf + inf)).
            if (x != kNegInf && lse != kNegInf) {
              const double P = std::exp(x - lse);
              const double z = drop.factor(p, b, h, i, j);
              const double dp = z * dot(&dout[i * Dv], &v[j * Dv], Dv);
              ds = P * (dp - delta);
              if (P * z != 0.0)
                for (std::int64_t c = 0; c < Dv; ++c) dv[j * Dv + c] += P * z * dout[i * Dv + c];
              for (std::int64_t c = 0; c < D; ++c) {
                dq[i * D + c] += p.scale * ds * k[j * D + c];
                dk[j * D + c] += p.scale * ds * q[i * D + c];
              }
            }
            if (want_dbias) ds_all[ds_offset[b] + (h * s.sq + i) * s.sk + j] = ds;
          }
        }
        if (p.dq.data) store_rows(p.dq, p.dtype, b, s.q0, s.sq, h, D, p.varlen, dq);
      }
      if (p.dk.data) store_rows(p.dk, p.dtype, b, s.k0, s.sk, hk, D, p.varlen, dk);
      if (p.dv.data) store_rows(p.dv, p.dtype, b, s.k0, s.sk, hk, Dv, p.varlen, dv);
    }
  }

  if (!want_dbias) return;
  // dbias[b', h', i', j] = sum of dS over the (b, h, i) that map to it; elements no (b, h, i, j)
  // maps to (variable-length padding) get 0. Parallel over dbias rows, fixed order inside.
  const BiasOperand& db = p.dbias;
  const bool bcast_b = db.shape[0] == 1 && p.batch > 1, bcast_h = db.shape[1] == 1 && p.heads_q > 1;
  const bool bcast_i = db.shape[2] == 1;
#pragma omp parallel for collapse(3) schedule(dynamic)
  for (std::int64_t bb = 0; bb < db.shape[0]; ++bb) {
    for (std::int64_t hh = 0; hh < db.shape[1]; ++hh) {
      for (std::int64_t ii = 0; ii < db.shape[2]; ++ii) {
        std::vector<double> acc(static_cast<std::size_t>(db.shape[3]), 0.0);
        const std::int64_t b_end = bcast_b ? p.batch : std::min(bb + 1, p.batch);
        for (std::int64_t b = bcast_b ? 0 : bb; b < b_end; ++b) {
          const Seq s = sequence(p, b);
          const std::int64_t h_end = bcast_h ? p.heads_q : std::min(hh + 1, p.heads_q);
          for (std::int64_t h = bcast_h ? 0 : hh; h < h_end; ++h) {
            const std::int64_t i_begin = bcast_i ? 0 : ii, i_end = bcast_i ? s.sq : std::min(ii + 1, s.sq);
            for (std::int64_t i = i_begin; i < i_end; ++i)
              for (std::int64_t j = 0; j < s.sk; ++j) acc[j] += ds_all[ds_offset[b] + (h * s.sq + i) * s.sk + j];
          }
        }
        for (std::int64_t j = 0; j < db.shape[3]; ++j)
          store_from_double(db.data, db.dtype, db.offset(bb, hh, ii, j), acc[j]);
      }
    }
  }
}

}  // namespace fusekit::attention
