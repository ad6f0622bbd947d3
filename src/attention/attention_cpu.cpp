// Float64 CPU reference of attention forward and backward, with every feature of
// fusekit/attention.h. One (batch, head) slice at a time, parallel over slices with OpenMP. The
// backward recomputes P from the saved float32 lse, as the kernels will.
//
// Scratch memory: each slice holds its Sq x Sk scores (and q, k, v rows) in float64. Their sizes
// are computed with checked arithmetic before the parallel region (sizes beyond 2^63 - 1 bytes are
// refused), and a failed allocation becomes an Error naming the op and the bytes asked for, carried
// out of the OpenMP region (an exception escaping one would end the process).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention/attention_params.h"
#include "core/checked_math.h"
#include "core/convert.h"
#include "fusekit/attention.h"
#include "fusekit/error.h"

namespace fusekit::attention {
namespace {

using detail::load_as_double;
using detail::store_from_double;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// A float64 scratch vector of `count` elements, count * 8 checked to fit by check_scratch. A failed
// allocation becomes Error(unsupported) naming the op and the bytes.
std::vector<double> scratch(const char* op, std::int64_t count, double fill = 0.0) {
  try {
    return std::vector<double>(static_cast<std::size_t>(count), fill);
  } catch (const std::bad_alloc&) {
  } catch (const std::length_error&) {
  }
  throw Error(ErrorKind::unsupported, op,
              "could not allocate " + std::to_string(count * 8) +
                  " bytes of float64 scratch memory for the CPU reference (" + std::to_string(count) +
                  " doubles)");
}

// The per-slice scratch of the longest sequences: refused (Error naming the op, the argument and
// the sizes) when a buffer would exceed 2^63 - 1 bytes, before any allocation.
void check_scratch(const char* op, const Problem& p) {
  detail::size_product(op, "k", "the float64 scores of one (batch, head) slice (seqlen_q x seqlen_k x 8 bytes)",
                       {p.seqlen_q, p.seqlen_k, 8});
  const std::int64_t d = std::max(p.head_dim, p.head_dim_v);
  detail::size_product(op, "q", "the float64 rows of q, out and dout of one slice (seqlen_q x head_dim x 8 bytes)",
                       {p.seqlen_q, d, 8});
  detail::size_product(op, "k", "the float64 rows of k and v of one slice (seqlen_k x head_dim x 8 bytes)",
                       {p.seqlen_k, d, 8});
}

// Runs slices in an OpenMP region and keeps the first exception one of them throws; the region's
// caller rethrows it outside (rethrow()). After a failure the remaining slices are skipped.
class SliceErrors {
 public:
  template <typename F>
  void run(F&& slice) {
    if (failed_.load(std::memory_order_relaxed)) return;
    try {
      slice();
    } catch (...) {
#pragma omp critical(fusekit_attention_cpu_error)
      if (!first_) first_ = std::current_exception();
      failed_.store(true, std::memory_order_relaxed);
    }
  }
  void rethrow() const {
    if (first_) std::rethrow_exception(first_);
  }

 private:
  std::atomic<bool> failed_{false};
  std::exception_ptr first_;
};

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
std::vector<double> load_rows(const char* name, const Operand& op, DType dtype, std::int64_t b, std::int64_t s0,
                              std::int64_t rows, std::int64_t h, std::int64_t dim, bool varlen) {
  std::vector<double> m = scratch(name, rows * dim);
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
std::vector<double> scores(const char* name, const Problem& p, const Seq& s, std::int64_t b, std::int64_t h,
                           const std::vector<double>& q, const std::vector<double>& k) {
  std::vector<double> S = scratch(name, s.sq * s.sk, kNegInf);
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
  const char* op = "attention_forward";
  check_scratch(op, p);
  const std::int64_t group = p.heads_q / p.heads_kv;
  const DropoutRule drop(p);
  SliceErrors errors;
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t h = 0; h < p.heads_q; ++h) {
      errors.run([&] {
        const Seq s = sequence(p, b);
        const std::int64_t hk = h / group;
        const auto q = load_rows(op, p.q, p.dtype, b, s.q0, s.sq, h, p.head_dim, p.varlen);
        const auto k = load_rows(op, p.k, p.dtype, b, s.k0, s.sk, hk, p.head_dim, p.varlen);
        const auto v = load_rows(op, p.v, p.dtype, b, s.k0, s.sk, hk, p.head_dim_v, p.varlen);
        const auto S = scores(op, p, s, b, h, q, k);
        std::vector<double> out = scratch(op, s.sq * p.head_dim_v);
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
      });
    }
  }
  errors.rethrow();
}

void backward_cpu(const BackwardProblem& p) {
  const char* op = "attention_backward";
  check_scratch(op, p);
  const std::int64_t group = p.heads_q / p.heads_kv;
  const DropoutRule drop(p);
  const bool want_dbias = p.dbias.data != nullptr;
  // dS of every (b, h) slice, kept when dbias is wanted so that the reduction over broadcast
  // dimensions runs afterwards in a fixed order (deterministic, no races). Offsets per batch.
  std::vector<std::int64_t> ds_offset(want_dbias ? static_cast<std::size_t>(p.batch + 1) : 1, 0);
  for (std::int64_t b = 0; b < p.batch && want_dbias; ++b) {
    const Seq s = sequence(p, b);
    const std::optional<std::int64_t> slice = detail::checked_product({p.heads_q, s.sq, s.sk});
    const std::optional<std::int64_t> end = slice ? detail::checked_add(ds_offset[b], *slice) : std::nullopt;
    if (!end || !detail::checked_mul(*end, 8)) {  // the bound by the longest sequences then overflows too
      detail::size_product(op, "dbias", "the float64 dS of every (batch, head) slice, kept for dbias",
                           {p.batch, p.heads_q, p.seqlen_q, p.seqlen_k, 8});
      throw Error(ErrorKind::invalid_argument, op, "dbias", "a dS of at most 2^63 - 1 bytes", "more");
    }
    ds_offset[b + 1] = *end;
  }
  std::vector<double> ds_all = scratch(op, want_dbias ? ds_offset[p.batch] : 0);

  SliceErrors errors;
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t hk = 0; hk < p.heads_kv; ++hk) {
      errors.run([&] {
        const Seq s = sequence(p, b);
        const std::int64_t D = p.head_dim, Dv = p.head_dim_v;
        const auto k = load_rows(op, p.k, p.dtype, b, s.k0, s.sk, hk, D, p.varlen);
        const auto v = load_rows(op, p.v, p.dtype, b, s.k0, s.sk, hk, Dv, p.varlen);
        std::vector<double> dk = scratch(op, s.sk * D), dv = scratch(op, s.sk * Dv);
        for (std::int64_t h = hk * group; h < (hk + 1) * group; ++h) {
          const auto q = load_rows(op, p.q, p.dtype, b, s.q0, s.sq, h, D, p.varlen);
          const auto o = load_rows(op, p.out, p.dtype, b, s.q0, s.sq, h, Dv, p.varlen);
          const auto dout = load_rows(op, p.dout, p.dtype, b, s.q0, s.sq, h, Dv, p.varlen);
          const auto S = scores(op, p, s, b, h, q, k);
          std::vector<double> dq = scratch(op, s.sq * D);
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
      });
    }
  }
  errors.rethrow();

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
        errors.run([&] {
          std::vector<double> acc = scratch(op, db.shape[3]);
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
        });
      }
    }
  }
  errors.rethrow();
}

}  // namespace fusekit::attention
