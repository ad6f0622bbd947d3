// Attention: the CPU reference's forward against a naive materialized softmax written
// independently here (masks, windows, bias broadcasting, dropout from the documented Philox
// mapping, variable lengths, GQA, strided layouts); its backward against central finite
// differences of L = sum(out * dout); variable lengths against separate runs; GQA against repeated
// k/v heads; fully masked rows, large logits, determinism; every argument error; and, for CUDA
// tensors, the checks and dtype refusals that come before any CUDA call (so they run without a
// GPU) plus the workspace sizes. The CUDA kernels themselves: test_attention_gpu.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "fusekit/attention.h"
#include "fusekit/error.h"
#include "fusekit/philox.h"
#include "tests/attention/attention_testing.h"
#include "tests/harness/gtest_helpers.h"

namespace fusekit {
namespace {

using testing::Buffer;
constexpr double kInf = std::numeric_limits<double>::infinity();

using testing::attn::lse_by_token;
using testing::attn::Problem;
using testing::attn::Spec;

// The documented dropout mapping, written out from philox::random4 (not via the library's helper).
double documented_dropout_factor(const AttentionConfig& c, std::uint64_t b, std::uint64_t h, std::uint64_t hq,
                                 std::uint64_t i, std::uint64_t j) {
  if (c.dropout_p == 0.0f) return 1.0;
  const std::uint64_t subsequence = ((b * hq + h) << 32) + c.offset;
  const philox::Words4 w = philox::random4(c.seed, subsequence, (i << 29) + j / 8);
  const std::uint32_t words[4] = {w.x, w.y, w.z, w.w};
  const std::uint32_t word = words[(j % 8) / 2];
  const std::uint32_t r16 = (j % 2) ? word >> 16 : word & 0xFFFFu;
  const double t = std::min(std::ceil(static_cast<double>(c.dropout_p) * 65536.0), 65535.0);
  return r16 >= t ? static_cast<double>(1.0f / (1.0f - c.dropout_p)) : 0.0;
}

// Naive materialized attention from the logical values: out (token, h, dv order) and lse.
struct Naive {
  std::vector<double> out, lse;
};

Naive naive_forward(const Problem& pr) {
  const Spec& s = pr.s;
  const auto q = pr.q->values(), k = pr.k->values(), v = pr.v->values();
  const std::vector<double> bias = pr.bias ? pr.bias->values() : std::vector<double>{};
  const double scale = s.cfg.scale ? *s.cfg.scale : 1.0 / std::sqrt(static_cast<double>(s.D));
  Naive n;
  n.out.assign(static_cast<std::size_t>(pr.tq * s.Hq * s.Dv), 0.0);
  n.lse.assign(static_cast<std::size_t>(pr.tq * s.Hq), -kInf);
  for (std::int64_t b = 0; b < pr.batch; ++b) {
    const std::int64_t sq = pr.lq[b], sk = pr.lk[b];
    for (std::int64_t h = 0; h < s.Hq; ++h) {
      const std::int64_t hk = h * s.Hkv / s.Hq;
      for (std::int64_t i = 0; i < sq; ++i) {
        std::vector<double> S(static_cast<std::size_t>(sk), -kInf);
        for (std::int64_t j = 0; j < sk; ++j) {
          const std::int64_t diag = s.cfg.mask == AttentionMask::causal_top_left ? i : i + sk - sq;
          bool visible = true;
          if (s.cfg.mask != AttentionMask::none && j > diag) visible = false;
          if (s.cfg.window_left >= 0 && j < diag - s.cfg.window_left) visible = false;
          if (s.cfg.window_right >= 0 && j > diag + s.cfg.window_right) visible = false;
          if (!visible) continue;
          double x = 0;
          for (std::int64_t d = 0; d < s.D; ++d)
            x += q[((pr.q0[b] + i) * s.Hq + h) * s.D + d] * k[((pr.k0[b] + j) * s.Hkv + hk) * s.D + d];
          S[j] = scale * x + (pr.bias ? bias[pr.bias_index(b, h, i, j)] : 0.0);
        }
        double m = -kInf;
        for (double x : S) m = std::max(m, x);
        const std::int64_t row = (pr.q0[b] + i) * s.Hq + h;
        if (m == -kInf) continue;
        double sum = 0;
        for (double x : S) sum += std::exp(x - m);
        n.lse[row] = m + std::log(sum);
        for (std::int64_t j = 0; j < sk; ++j) {
          const double w = std::exp(S[j] - m) / sum * documented_dropout_factor(s.cfg, b, h, s.Hq, i, j);
          for (std::int64_t d = 0; d < s.Dv; ++d) n.out[row * s.Dv + d] += w * v[((pr.k0[b] + j) * s.Hkv + hk) * s.Dv + d];
        }
      }
    }
  }
  return n;
}

void expect_lse_matches(const std::vector<double>& got, const std::vector<double>& ref, const std::string& what) {
  std::vector<double> g, r;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (ref[i] == -kInf) {
      EXPECT_EQ(got[i], -kInf) << what << " lse row " << i << " is fully masked";
    } else {
      g.push_back(got[i]), r.push_back(ref[i]);
    }
  }
  if (!r.empty()) EXPECT_TRUE(testing::close_to_reference(g, r, DType::f32, what + " lse"));
}

void check_forward(const Spec& spec, std::uint64_t salt) {
  auto rng = testing::make_rng(salt);
  Problem pr(spec);
  pr.fill(rng);
  pr.forward();
  const Naive n = naive_forward(pr);
  // out is in (token, h, dv) logical order for both layouts only when not bhsd: values() is
  // logical over the (B, S, H, Dv) shape either way.
  const auto out = pr.out->values();
  for (double x : out) ASSERT_TRUE(std::isfinite(x)) << spec.str();
  if (spec.dtype == DType::f64) {
    const testing::ErrorStats e = testing::compare(out, n.out);
    EXPECT_LE(e.max_abs, 1e-12) << spec.str();
  } else {
    EXPECT_TRUE(testing::close_to_reference(out, n.out, spec.dtype, "out " + spec.str()));
  }
  expect_lse_matches(lse_by_token(pr), n.lse, spec.str());
}

// Central differences of L = sum(out * dout) with respect to every logical element of `x`.
std::vector<double> finite_differences(Problem& pr, Buffer& x, double step) {
  auto values = x.values();
  std::vector<double> g(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    const double keep = values[i];
    values[i] = keep + step;
    x.set_values(values);
    const double up = pr.loss();
    values[i] = keep - step;
    x.set_values(values);
    const double down = pr.loss();
    values[i] = keep;
    x.set_values(values);
    g[i] = (up - down) / (2 * step);
  }
  return g;
}

void expect_gradient(const std::vector<double>& got, const std::vector<double>& fd, const std::string& what) {
  const testing::ErrorStats e = testing::compare(got, fd);
  double norm = 0;
  for (double x : fd) norm += x * x;
  EXPECT_EQ(e.non_finite, 0) << what;
  // The backward recomputes P from the float32 lse: relative error ~1e-7 of P.
  if (norm > 1e-20) EXPECT_LE(e.rel_l2, 2e-6) << what << " (max_abs " << e.max_abs << ")";
  else EXPECT_LE(e.max_abs, 1e-9) << what;
}

void check_backward_fd(const Spec& spec, std::uint64_t salt) {
  ASSERT_EQ(spec.dtype, DType::f64);
  auto rng = testing::make_rng(salt);
  Problem pr(spec);
  pr.fill(rng);
  pr.forward();
  pr.backward();
  const double step = 1e-5;
  expect_gradient(pr.dq->values(), finite_differences(pr, *pr.q, step), "dq " + spec.str());
  expect_gradient(pr.dk->values(), finite_differences(pr, *pr.k, step), "dk " + spec.str());
  expect_gradient(pr.dv->values(), finite_differences(pr, *pr.v, step), "dv " + spec.str());
  if (pr.bias) expect_gradient(pr.dbias->values(), finite_differences(pr, *pr.bias, step), "dbias " + spec.str());
}

Spec base(AttentionMask mask = AttentionMask::none) {
  Spec s;
  s.cfg.mask = mask;
  return s;
}

// ---- forward against the naive reference --------------------------------------------------

TEST(AttentionCpu, ForwardMatchesNaive) {
  std::vector<Spec> specs;
  for (AttentionMask m : {AttentionMask::none, AttentionMask::causal_top_left, AttentionMask::causal_bottom_right})
    for (auto [sq, sk] : {std::pair{5, 7}, {7, 5}, {1, 9}, {6, 1}}) {
      Spec s = base(m);
      s.Sq = sq, s.Sk = sk;
      specs.push_back(s);
    }
  {
    Spec s = base();
    s.cfg.window_left = 2, s.cfg.window_right = 1;
    specs.push_back(s);
    s.cfg.mask = AttentionMask::causal_top_left, s.cfg.window_right = -1;
    specs.push_back(s);
    s.cfg.mask = AttentionMask::causal_bottom_right, s.Sq = 9, s.Sk = 4;
    specs.push_back(s);
  }
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    Spec s = base(AttentionMask::causal_bottom_right);
    s.dtype = dt, s.D = 16, s.Dv = 8, s.Sq = 13, s.Sk = 21, s.Hq = 4, s.Hkv = 2, s.bias = true;
    s.bias_dtype = dt == DType::f32 ? DType::bf16 : DType::f32;
    s.bhsd = dt == DType::f16;
    s.cfg.scale = 0.3f;
    specs.push_back(s);
  }
  {
    Spec s = base();
    s.bias = true;
    s.bias_full[0] = false, s.bias_full[2] = false;
    specs.push_back(s);
    s.bias_expand = true;
    specs.push_back(s);
    s.bias_full[1] = false, s.bias_full[0] = true, s.bias_dtype = DType::f16;
    specs.push_back(s);
  }
  {
    Spec s = base(AttentionMask::causal_top_left);
    s.cfg.dropout_p = 0.3f, s.cfg.seed = 1234567, s.cfg.offset = 77, s.bias = true, s.Sq = 11, s.Sk = 19;
    specs.push_back(s);
    s.Hq = 4, s.Hkv = 1, s.bhsd = true;
    specs.push_back(s);
  }
  {
    Spec s = base(AttentionMask::causal_bottom_right);
    s.seqlens_q = {3, 0, 6, 4}, s.seqlens_k = {5, 2, 6, 0};
    s.bias = true, s.cfg.dropout_p = 0.2f, s.cfg.seed = 99, s.Hq = 4, s.Hkv = 2;
    specs.push_back(s);
  }
  std::uint64_t salt = 100;
  for (const Spec& s : specs) check_forward(s, salt++);
}

// ---- backward against finite differences ---------------------------------------------------

TEST(AttentionCpu, BackwardMatchesFiniteDifferences) {
  std::vector<Spec> specs;
  {
    Spec s = base();
    s.bias = true;  // full bias, GQA 2:1
    specs.push_back(s);
  }
  for (AttentionMask m : {AttentionMask::causal_top_left, AttentionMask::causal_bottom_right}) {
    Spec s = base(m);
    s.bias = true, s.bias_full[0] = false, s.bias_full[2] = false;  // (1, H, 1, Sk)
    specs.push_back(s);
    s.Sq = 7, s.Sk = 4, s.bias_full[0] = true, s.bias_full[1] = false, s.bias_full[2] = true;  // masked rows
    s.bias_dtype = DType::f64;
    specs.push_back(s);
  }
  {
    Spec s = base();
    s.cfg.window_left = 2, s.cfg.window_right = 1, s.Hq = 3, s.Hkv = 3, s.bhsd = true;
    specs.push_back(s);
    s.cfg.mask = AttentionMask::causal_top_left, s.cfg.window_right = -1;
    specs.push_back(s);
  }
  {
    Spec s = base(AttentionMask::causal_bottom_right);
    s.cfg.dropout_p = 0.3f, s.cfg.seed = 42, s.cfg.offset = 3;
    s.bias = true, s.bias_full[0] = false, s.bias_expand = true;  // expanded stride-0 batch dim
    specs.push_back(s);
  }
  {
    Spec s = base(AttentionMask::causal_top_left);
    s.seqlens_q = {3, 5, 0}, s.seqlens_k = {4, 2, 3}, s.Hq = 2, s.Hkv = 1;
    s.bias = true, s.bias_full[1] = false, s.cfg.dropout_p = 0.25f, s.cfg.seed = 5, s.cfg.window_left = 2;
    specs.push_back(s);
  }
  std::uint64_t salt = 200;
  for (const Spec& s : specs) check_backward_fd(s, salt++);
}

// ---- variable lengths against separate runs ------------------------------------------------

TEST(AttentionCpu, VarlenMatchesSeparateSequences) {
  Spec vs = base(AttentionMask::causal_bottom_right);
  vs.seqlens_q = {4, 7, 1}, vs.seqlens_k = {6, 3, 5};
  vs.Hq = 4, vs.Hkv = 2, vs.D = 6, vs.Dv = 4, vs.bias = true, vs.cfg.window_left = 3;
  auto rng = testing::make_rng(300);
  Problem pv(vs);
  pv.fill(rng);
  pv.forward();
  pv.backward();
  const auto q = pv.q->values(), k = pv.k->values(), v = pv.v->values(), dout = pv.dout->values();
  const auto bias = pv.bias->values(), dbias = pv.dbias->values();
  const auto out = pv.out->values(), dq = pv.dq->values(), dk = pv.dk->values(), dv = pv.dv->values();
  const auto lse = lse_by_token(pv);
  const std::int64_t H = vs.Hq, Hk = vs.Hkv;
  auto slice = [](const std::vector<double>& a, std::int64_t from, std::int64_t n) {
    return std::vector<double>(a.begin() + from, a.begin() + from + n);
  };
  for (std::int64_t b = 0; b < pv.batch; ++b) {
    Spec ds = vs;
    ds.seqlens_q.clear(), ds.seqlens_k.clear();
    ds.B = 1, ds.Sq = pv.lq[b], ds.Sk = pv.lk[b];
    Problem pd(ds);
    pd.q->set_values(slice(q, pv.q0[b] * H * vs.D, ds.Sq * H * vs.D));
    pd.k->set_values(slice(k, pv.k0[b] * Hk * vs.D, ds.Sk * Hk * vs.D));
    pd.v->set_values(slice(v, pv.k0[b] * Hk * vs.Dv, ds.Sk * Hk * vs.Dv));
    pd.dout->set_values(slice(dout, pv.q0[b] * H * vs.Dv, ds.Sq * H * vs.Dv));
    std::vector<double> bb;
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < ds.Sq; ++i)
        for (std::int64_t j = 0; j < ds.Sk; ++j) bb.push_back(bias[pv.bias_index(b, h, i, j)]);
    pd.bias->set_values(bb);
    pd.forward();
    pd.backward();
    const std::string tag = "sequence " + std::to_string(b);
    EXPECT_EQ(pd.out->values(), slice(out, pv.q0[b] * H * vs.Dv, ds.Sq * H * vs.Dv)) << tag;
    EXPECT_EQ(lse_by_token(pd), slice(lse, pv.q0[b] * H, ds.Sq * H)) << tag;
    EXPECT_EQ(pd.dq->values(), slice(dq, pv.q0[b] * H * vs.D, ds.Sq * H * vs.D)) << tag;
    EXPECT_EQ(pd.dk->values(), slice(dk, pv.k0[b] * Hk * vs.D, ds.Sk * Hk * vs.D)) << tag;
    EXPECT_EQ(pd.dv->values(), slice(dv, pv.k0[b] * Hk * vs.Dv, ds.Sk * Hk * vs.Dv)) << tag;
    const auto db = pd.dbias->values();
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < pv.maxq; ++i)
        for (std::int64_t j = 0; j < pv.maxk; ++j) {
          const double got = dbias[pv.bias_index(b, h, i, j)];
          if (i < ds.Sq && j < ds.Sk) EXPECT_EQ(got, db[(h * ds.Sq + i) * ds.Sk + j]) << tag;
          else EXPECT_EQ(got, 0.0) << tag << " padding (" << h << ", " << i << ", " << j << ")";
        }
  }
}

// ---- GQA against repeated k/v heads ----------------------------------------------------------

TEST(AttentionCpu, GqaMatchesRepeatedHeads) {
  Spec g = base(AttentionMask::causal_top_left);
  g.Hq = 6, g.Hkv = 2, g.Sq = 6, g.Sk = 9, g.bias = true, g.bias_full[1] = false;
  g.cfg.dropout_p = 0.2f, g.cfg.seed = 7;
  Spec r = g;
  r.Hkv = 6;
  auto rng = testing::make_rng(400);
  Problem pg(g), pr(r);
  pg.fill(rng);
  pr.q->set_values(pg.q->values()), pr.dout->set_values(pg.dout->values()), pr.bias->set_values(pg.bias->values());
  const std::int64_t group = g.Hq / g.Hkv;
  auto repeat = [&](const std::vector<double>& a, std::int64_t rows, std::int64_t dim) {
    std::vector<double> o;
    for (std::int64_t t = 0; t < rows; ++t)
      for (std::int64_t h = 0; h < r.Hkv; ++h)
        for (std::int64_t d = 0; d < dim; ++d) o.push_back(a[(t * g.Hkv + h / group) * dim + d]);
    return o;
  };
  pr.k->set_values(repeat(pg.k->values(), g.B * g.Sk, g.D));
  pr.v->set_values(repeat(pg.v->values(), g.B * g.Sk, g.Dv));
  for (Problem* p : {&pg, &pr}) p->forward(), p->backward();
  EXPECT_EQ(pg.out->values(), pr.out->values());
  EXPECT_EQ(pg.lse->values(), pr.lse->values());
  EXPECT_EQ(pg.dq->values(), pr.dq->values());
  EXPECT_EQ(pg.dbias->values(), pr.dbias->values());
  for (auto [gb, rb, dim] : {std::tuple{&*pg.dk, &*pr.dk, g.D}, {&*pg.dv, &*pr.dv, g.Dv}}) {
    const auto rep = rb->values();
    std::vector<double> summed(static_cast<std::size_t>(g.B * g.Sk * g.Hkv * dim), 0.0);
    for (std::int64_t t = 0; t < g.B * g.Sk; ++t)
      for (std::int64_t h = 0; h < r.Hkv; ++h)
        for (std::int64_t d = 0; d < dim; ++d) summed[(t * g.Hkv + h / group) * dim + d] += rep[(t * r.Hkv + h) * dim + d];
    const testing::ErrorStats e = testing::compare(gb->values(), summed);
    EXPECT_LE(e.rel_l2, 1e-14);
  }
}

// ---- dropout mask, edge cases, determinism ----------------------------------------------------

TEST(AttentionCpu, DropoutMaskHelperMatchesDocumentedMapping) {
  AttentionConfig c;
  c.dropout_p = 0.37f, c.seed = 0x123456789ABCDEFull, c.offset = 0xFFFFFFF0u;
  const std::uint32_t t = dropout_keep_threshold(c.dropout_p);
  std::int64_t kept = 0, total = 0;
  for (std::uint64_t b : {0ull, 3ull})
    for (std::uint64_t h : {0ull, 5ull})
      for (std::uint64_t i : {0ull, 1ull, 1000000ull})
        for (std::uint64_t j = 0; j < 4096; ++j) {
          const bool keep = attention_dropout_keeps(c.seed, c.offset, b, h, 8, i, j, t);
          ASSERT_EQ(keep, documented_dropout_factor(c, b, h, 8, i, j) != 0.0) << b << h << i << j;
          kept += keep, ++total;
        }
  EXPECT_NEAR(static_cast<double>(kept) / total, 1.0 - c.dropout_p, 0.01);
  // Distinct (b, h) streams and offsets give different masks.
  int same_bh = 0, same_offset = 0;
  for (std::uint64_t j = 0; j < 512; ++j) {
    same_bh += attention_dropout_keeps(1, 0, 0, 1, 2, 0, j, t) == attention_dropout_keeps(1, 0, 1, 0, 3, 0, j, t);
    same_offset += attention_dropout_keeps(1, 0, 0, 0, 2, 0, j, t) == attention_dropout_keeps(1, 1, 0, 0, 2, 0, j, t);
  }
  EXPECT_LT(same_bh, 400);
  EXPECT_LT(same_offset, 400);
}

TEST(AttentionCpu, FullyMaskedRowsGiveZerosAndNoNan) {
  Spec s = base(AttentionMask::causal_bottom_right);
  s.dtype = DType::f32, s.Sq = 9, s.Sk = 4, s.D = 8, s.Dv = 8, s.bias = true, s.bias_dtype = DType::f32;
  auto rng = testing::make_rng(500);
  Problem pr(s);
  pr.fill(rng);
  // Also mask row 7 of (b 1, h 0) entirely through the bias.
  auto bv = pr.bias->values();
  for (std::int64_t j = 0; j < s.Sk; ++j) bv[pr.bias_index(1, 0, 7, j)] = -kInf;
  pr.bias->set_values(bv);
  pr.forward();
  pr.backward();
  const auto out = pr.out->values(), lse = pr.lse->values(), dq = pr.dq->values(), db = pr.dbias->values();
  for (auto* vals : {&out, &dq, &db})
    for (double x : *vals) ASSERT_FALSE(std::isnan(x));
  for (double x : pr.dk->values()) ASSERT_TRUE(std::isfinite(x));
  for (double x : pr.dv->values()) ASSERT_TRUE(std::isfinite(x));
  auto row_masked = [&](std::int64_t b, std::int64_t h, std::int64_t i) {
    return i < s.Sq - s.Sk || (b == 1 && h == 0 && i == 7);
  };
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < s.Hq; ++h)
      for (std::int64_t i = 0; i < s.Sq; ++i) {
        const bool masked = row_masked(b, h, i);
        EXPECT_EQ(lse[(b * s.Hq + h) * s.Sq + i] == -kInf, masked) << b << " " << h << " " << i;
        for (std::int64_t d = 0; d < s.D; ++d) {
          const std::int64_t at = ((b * s.Sq + i) * s.Hq + h) * s.D + d;
          if (masked) {
            EXPECT_EQ(out[at], 0.0);
            EXPECT_EQ(dq[at], 0.0);
          } else {
            EXPECT_NE(out[at], 0.0);
          }
        }
        if (masked)
          for (std::int64_t j = 0; j < s.Sk; ++j) EXPECT_EQ(db[pr.bias_index(b, h, i, j)], 0.0);
      }
  check_forward(s, 501);  // and the unmasked rows agree with the naive reference
}

TEST(AttentionCpu, VarlenEmptySequences) {
  Spec s = base();
  s.seqlens_q = {0, 3, 2}, s.seqlens_k = {4, 0, 3};
  auto rng = testing::make_rng(510);
  Problem pr(s);
  pr.fill(rng);
  pr.forward();
  pr.backward();
  const auto out = pr.out->values(), lse = lse_by_token(pr), dq = pr.dq->values();
  for (std::int64_t t = 0; t < 3; ++t)  // sequence 1: no keys
    for (std::int64_t h = 0; h < s.Hq; ++h) {
      EXPECT_EQ(lse[t * s.Hq + h], -kInf);
      for (std::int64_t d = 0; d < s.Dv; ++d) EXPECT_EQ(out[(t * s.Hq + h) * s.Dv + d], 0.0);
      for (std::int64_t d = 0; d < s.D; ++d) EXPECT_EQ(dq[(t * s.Hq + h) * s.D + d], 0.0);
    }
  for (double x : pr.dk->values()) EXPECT_TRUE(std::isfinite(x));
  // Sequence 0 has keys but no queries: its dk and dv are 0.
  const auto dk = pr.dk->values();
  for (std::int64_t i = 0; i < 4 * s.Hkv * s.D; ++i) EXPECT_EQ(dk[i], 0.0);
}

TEST(AttentionCpu, EmptyShapes) {
  {  // no keys at all: every row is fully masked
    Spec s = base();
    s.Sk = 0, s.bias = true;
    auto rng = testing::make_rng(515);
    Problem pr(s);
    pr.fill(rng);
    pr.forward();
    pr.backward();
    for (double x : pr.out->values()) EXPECT_EQ(x, 0.0);
    for (double x : pr.lse->values()) EXPECT_EQ(x, -kInf);
    for (double x : pr.dq->values()) EXPECT_EQ(x, 0.0);
  }
  {  // no batch: nothing to do, and no error
    Spec s = base(AttentionMask::causal_top_left);
    s.B = 0;
    Problem pr(s);
    EXPECT_NO_THROW(pr.forward());
    EXPECT_NO_THROW(pr.backward());
  }
}

TEST(AttentionCpu, ExpandedBiasOverAnEmptyDim) {
  // Every query length 0 (max_seqlen_q = 0) with a bias expanded over heads and queries: dbias
  // keeps size 1 there and gets the empty sum, 0.
  Spec s = base();
  s.seqlens_q = {0, 0}, s.seqlens_k = {5, 3};
  s.bias = true, s.bias_full[1] = false, s.bias_full[2] = false, s.bias_expand = true;
  auto rng = testing::make_rng(512);
  Problem pr(s);
  pr.fill(rng);
  ASSERT_EQ(pr.bias_view()->shape[2], 0);
  EXPECT_NO_THROW(pr.forward());
  EXPECT_NO_THROW(pr.backward());
  for (double x : pr.dbias->values()) EXPECT_EQ(x, 0.0);
  for (double x : pr.dk->values()) EXPECT_EQ(x, 0.0);
}

TEST(AttentionCpu, LargeLogitsStayFinite) {
  Spec s = base(AttentionMask::causal_top_left);
  s.dtype = DType::f32, s.D = 8, s.Dv = 8, s.Sq = 6, s.Sk = 6;
  auto rng = testing::make_rng(520);
  Problem pr(s);
  pr.fill(rng, 30.0);  // logits of order 30 * 30 * sqrt(8) / sqrt(8) ~ 1e3: exp overflows unless shifted
  pr.forward();
  pr.backward();
  for (auto* b : {&*pr.out, &*pr.lse, &*pr.dq, &*pr.dk, &*pr.dv})
    for (double x : b->values()) ASSERT_TRUE(std::isfinite(x));
  const Naive n = naive_forward(pr);
  EXPECT_TRUE(testing::close_to_reference(pr.out->values(), n.out, DType::f32, "out, large logits"));
  expect_lse_matches(lse_by_token(pr), n.lse, "large logits");
}

TEST(AttentionCpu, BackwardIsDeterministic) {
  Spec s = base(AttentionMask::causal_bottom_right);
  s.dtype = DType::bf16, s.D = 8, s.Dv = 8, s.Hq = 4, s.Hkv = 2, s.bias = true, s.bias_full[0] = false;
  s.bias_dtype = DType::f32, s.cfg.dropout_p = 0.1f, s.cfg.seed = 3, s.Sq = 12, s.Sk = 17;
  auto rng = testing::make_rng(530);
  Problem pr(s);
  pr.fill(rng);
  pr.forward();
  pr.backward();
  const auto a = {pr.dq->raw_bytes(), pr.dk->raw_bytes(), pr.dv->raw_bytes(), pr.dbias->raw_bytes()};
  pr.backward();
  const auto b = {pr.dq->raw_bytes(), pr.dk->raw_bytes(), pr.dv->raw_bytes(), pr.dbias->raw_bytes()};
  EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin()));
}

// ---- argument errors ---------------------------------------------------------------------------

void expect_error(const std::function<void()>& f, ErrorKind kind, const std::string& argument,
                  const std::string& what) {
  try {
    f();
    ADD_FAILURE() << what << ": no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << what << ": " << e.what();
    EXPECT_EQ(e.argument(), argument) << what << ": " << e.what();
  }
}

TEST(AttentionCpu, BadArgumentsAreRefused) {
  Spec s = base();
  s.dtype = DType::f32, s.B = 1, s.Sq = 8, s.Sk = 8, s.Hq = 2, s.Hkv = 2, s.D = 8, s.Dv = 8, s.bias = true;
  s.bias_dtype = DType::f32;
  Problem pr(s);
  auto rng = testing::make_rng(600);
  pr.fill(rng);
  const Device cpu = Device::cpu();
  const TensorView q = pr.q->view(), k = pr.k->view(), v = pr.v->view(), out = pr.out->view(),
                   lse = pr.lse->view(), bias = pr.bias->view(), dbias = pr.dbias->view(), dout = pr.dout->view(),
                   dq = pr.dq->view(), dk = pr.dk->view(), dv = pr.dv->view();
  using B = Buffer;
  using Shape = std::vector<std::int64_t>;
  auto buf = [&](DType dt, Shape shape, Shape strides = {}) { return B(dt, cpu, shape, strides); };
  const AttentionConfig cfg;
  struct Fwd {
    TensorView q, k, v;
    OptionalTensor bias;
    AttentionConfig cfg;
    TensorView out, lse;
    std::optional<AttentionVarlen> varlen;
  };
  const Fwd good{q, k, v, bias, cfg, out, lse, std::nullopt};
  auto fwd_error = [&](Fwd f, const std::string& argument, const std::string& what) {
    expect_error([&] { attention_forward(f.q, f.k, f.v, f.bias, f.cfg, f.out, f.lse, f.varlen); },
                 ErrorKind::invalid_argument, argument, what);
  };
  // The valid call works, so each failure below is the one change it makes.
  EXPECT_NO_THROW(attention_forward(q, k, v, bias, cfg, out, lse));
  EXPECT_NO_THROW(attention_backward(dout, q, k, v, out, lse, bias, cfg, dq, dk, dv, dbias));

  {  // mismatched dtypes and shapes
    B k16 = buf(DType::f16, {1, 8, 2, 8}), k4 = buf(DType::f32, {1, 8, 2, 4}), v7 = buf(DType::f32, {1, 7, 2, 8}),
      o4 = buf(DType::f32, {1, 8, 2, 16}), q3 = buf(DType::f32, {8, 2, 8}), qi = buf(DType::i32, {1, 8, 2, 8});
    Fwd f = good; f.k = k16.view(); fwd_error(f, "k", "k dtype");
    f = good; f.k = k4.view(); fwd_error(f, "k", "k head dim");
    f = good; f.v = v7.view(); fwd_error(f, "v", "v length");
    f = good; f.out = o4.view(); fwd_error(f, "out", "out shape");
    f = good; f.q = q3.view(); fwd_error(f, "q", "3-D q without varlen");
    f = good; f.q = qi.view(); fwd_error(f, "q", "q dtype");
  }
  {  // Hq not a multiple of Hkv
    B k3 = buf(DType::f32, {1, 8, 3, 8}), v3 = buf(DType::f32, {1, 8, 3, 8});
    Fwd f = good; f.k = k3.view(), f.v = v3.view(); fwd_error(f, "k", "Hq % Hkv");
  }
  {  // head dims: too large, not a multiple of 16 bytes
    B qb = buf(DType::f32, {1, 8, 2, 264}), kb = buf(DType::f32, {1, 8, 2, 264});
    Fwd f = good; f.q = qb.view(), f.k = kb.view(); fwd_error(f, "q", "head dim 264");
    B q6 = buf(DType::f32, {1, 8, 2, 6}), k6 = buf(DType::f32, {1, 8, 2, 6});
    f = good; f.q = q6.view(), f.k = k6.view(); fwd_error(f, "q", "head dim 6 (f32)");
    B v260 = buf(DType::f32, {1, 8, 2, 260}), o260 = buf(DType::f32, {1, 8, 2, 260});
    f = good; f.v = v260.view(), f.out = o260.view(); fwd_error(f, "v", "Dv 260");
  }
  {  // alignment: pointer, stride, non-unit head-dim stride
    Fwd f = good; f.q.data = static_cast<char*>(q.data) + 4; fwd_error(f, "q", "misaligned pointer");
    B qs = buf(DType::f32, {1, 8, 2, 8}, {160, 20, 10, 1});
    f = good; f.q = qs.view(); fwd_error(f, "q", "misaligned head stride");
    B ks = buf(DType::f32, {1, 8, 2, 8}, {256, 32, 16, 2});
    f = good; f.k = ks.view(); fwd_error(f, "k", "strided head dim");
    f = good; f.v.strides[0] = -f.v.strides[0]; fwd_error(f, "v", "negative stride");
  }
  {  // lse
    B l16 = buf(DType::f16, {1, 2, 8}), lt = buf(DType::f32, {1, 8, 2});
    Fwd f = good; f.lse = l16.view(); fwd_error(f, "lse", "lse dtype");
    f = good; f.lse = lt.view(); fwd_error(f, "lse", "lse shape");
  }
  {  // bias of the wrong shape, stride, alignment or dtype
    B b3 = buf(DType::f32, {1, 3, 8, 8}), b7 = buf(DType::f32, {1, 2, 8, 7}), bq = buf(DType::f32, {1, 2, 4, 8}),
      bs = buf(DType::f32, {1, 2, 8, 8}, {144, 72, 9, 1}), bt = buf(DType::f32, {2, 8, 8}),
      bi = buf(DType::i32, {1, 2, 8, 8}), bk = buf(DType::f32, {1, 2, 8, 8}, {256, 128, 16, 2});
    Fwd f = good; f.bias = b3.view(); fwd_error(f, "bias", "bias heads 3");
    f = good; f.bias = b7.view(); fwd_error(f, "bias", "bias keys 7");
    f = good; f.bias = bq.view(); fwd_error(f, "bias", "bias queries 4 (neither 1 nor 8)");
    f = good; f.bias = bs.view(); fwd_error(f, "bias", "bias row stride 9");
    f = good; f.bias = bt.view(); fwd_error(f, "bias", "3-D bias");
    f = good; f.bias = bi.view(); fwd_error(f, "bias", "bias dtype");
    f = good; f.bias = bk.view(); fwd_error(f, "bias", "strided bias keys");
    TensorView mis = bias; mis.data = static_cast<char*>(bias.data) + 8;
    f = good; f.bias = mis; fwd_error(f, "bias", "misaligned bias");
  }
  {  // config: p outside [0, 1), offset, window, scale
    for (float p : {1.0f, -0.1f, std::nanf("")}) {
      Fwd f = good; f.cfg.dropout_p = p; fwd_error(f, "dropout_p", "p = " + std::to_string(p));
    }
    Fwd f = good; f.cfg.offset = std::uint64_t{1} << 32; fwd_error(f, "offset", "offset 2^32");
    f = good; f.cfg.window_left = -2; fwd_error(f, "window_left", "window_left -2");
    f = good; f.cfg.window_right = -5; fwd_error(f, "window_right", "window_right -5");
    f = good; f.cfg.scale = std::numeric_limits<float>::infinity(); fwd_error(f, "scale", "infinite scale");
  }
  {  // device mix
    Fwd f = good; f.out.device = Device::cuda(0); fwd_error(f, "out", "out on another device");
    f = good; f.bias->device = Device::cuda(0); fwd_error(f, "bias", "bias on another device");
  }
  {  // variable lengths
    B qv = buf(DType::f32, {8, 2, 8}), kv = buf(DType::f32, {8, 2, 8}), vv = buf(DType::f32, {8, 2, 8}),
      ov = buf(DType::f32, {8, 2, 8}), lv = buf(DType::f32, {2, 8});
    B cq = buf(DType::i32, {3}), ck = buf(DType::i32, {3}), c64 = buf(DType::i64, {3}), c2 = buf(DType::i32, {2});
    qv.fill_normal(rng), kv.fill_normal(rng), vv.fill_normal(rng);
    ck.set_values({0, 5, 8});
    c64.set_values({0, 3, 8});
    c2.set_values({0, 8});
    Fwd f{qv.view(), kv.view(), vv.view(), std::nullopt, cfg, ov.view(), lv.view(),
          AttentionVarlen{cq.view(), ck.view(), 5, 5}};
    cq.set_values({0, 3, 8});
    EXPECT_NO_THROW(attention_forward(f.q, f.k, f.v, f.bias, f.cfg, f.out, f.lse, f.varlen));
    cq.set_values({0, 9, 8});
    f.varlen->max_seqlen_q = 16;
    try {
      attention_forward(f.q, f.k, f.v, f.bias, f.cfg, f.out, f.lse, f.varlen);
      ADD_FAILURE() << "decreasing cu_seqlens_q accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "cu_seqlens_q");
      EXPECT_NE(std::string(e.what()).find("non-decreasing"), std::string::npos) << e.what();
    }
    f.varlen->max_seqlen_q = 5;
    cq.set_values({1, 3, 8}); fwd_error(f, "cu_seqlens_q", "first element 1");
    cq.set_values({0, 3, 7}); fwd_error(f, "cu_seqlens_q", "last element 7 of 8 tokens");
    cq.set_values({0, 2, 8}); fwd_error(f, "cu_seqlens_q", "length 6 > max_seqlen_q 5");
    cq.set_values({0, 3, 8});
    Fwd g = f; g.varlen->cu_seqlens_k = c2.view(); fwd_error(g, "cu_seqlens_k", "cu_seqlens_k of 2 elements");
    g = f; g.varlen->cu_seqlens_q = c64.view(); fwd_error(g, "cu_seqlens_q", "int64 cu_seqlens_q");
    g = f; g.varlen->max_seqlen_k = -1; fwd_error(g, "max_seqlen_k", "negative max_seqlen_k");
    g = f; g.q = q; fwd_error(g, "q", "4-D q with varlen");
    B lb = buf(DType::f32, {1, 2, 8}); g = f; g.lse = lb.view(); fwd_error(g, "lse", "dense lse with varlen");
    B bvb = buf(DType::f32, {2, 2, 4, 8});  // query dim 4 < max_seqlen_q 5
    g = f; g.bias = bvb.view(); fwd_error(g, "bias", "varlen bias shorter than max_seqlen_q");
  }
  {  // backward-only arguments
    const auto bwd = [&](TensorView dout2, OptionalTensor bias2, OptionalTensor dq2, OptionalTensor dbias2) {
      return [=] { attention_backward(dout2, q, k, v, out, lse, bias2, cfg, dq2, dk, dv, dbias2); };
    };
    B d4 = buf(DType::f32, {1, 8, 2, 16}), dq16 = buf(DType::f16, {1, 8, 2, 8}), db1 = buf(DType::f32, {1, 1, 8, 8});
    expect_error(bwd(d4.view(), bias, dq, dbias), ErrorKind::invalid_argument, "dout", "dout shape");
    expect_error(bwd(dout, bias, dq16.view(), dbias), ErrorKind::invalid_argument, "dq", "dq dtype");
    expect_error(bwd(dout, std::nullopt, dq, dbias), ErrorKind::invalid_argument, "dbias", "dbias without bias");
    TensorView expanded = dbias;
    expanded.strides[1] = 0;
    expect_error(bwd(dout, bias, dq, expanded), ErrorKind::invalid_argument, "dbias", "stride-0 dbias");
    expect_error(bwd(dout, bias, dq, db1.view()), ErrorKind::invalid_argument, "dbias",
                 "dbias reduced over a dim the bias materializes");
    db1.fill_normal(rng);  // read as a bias below: finite values (NaN and +inf are refused on the CPU)
    TensorView bias_expanded = db1.view();
    bias_expanded.shape[1] = 2, bias_expanded.strides[1] = 0;
    B db1b = buf(DType::f32, {1, 1, 8, 8});
    EXPECT_NO_THROW(bwd(dout, bias_expanded, dq, db1b.view())());
  }
}

// Outputs that share a byte with an input or another output are refused; views that only
// interleave (q / k / v heads packed in one buffer, dq / dk / dv likewise) are not. The buffers
// pad each batch entry by one token, so that the exact test has two levels of blocks to resolve.
TEST(AttentionCpu, OverlappingOutputsAreRefused) {
  const std::int64_t B = 2, S = 8, H = 2, D = 8, row = 3 * H * D, batch = (S + 1) * row;
  const DType dt = DType::f32;
  const Device cpu = Device::cpu();
  Buffer qkv(dt, cpu, {B * batch}), dqkv(dt, cpu, {B * batch}), out(dt, cpu, {B, S, H, D}),
      dout(dt, cpu, {B, S, H, D}), lse(DType::f32, cpu, {B, H, S});
  auto rng = testing::make_rng(610);
  qkv.fill_normal(rng), dout.fill_normal(rng), dqkv.fill_normal(rng);
  // Head block `which` (0 q, 1 k, 2 v) of every token, moved by `shift` elements.
  auto part = [&](const Buffer& buf, int which, std::int64_t shift = 0) {
    return TensorView(static_cast<float*>(buf.view().data) + which * H * D + shift, dt, cpu, {B, S, H, D},
                      {batch, row, D, 1});
  };
  const TensorView q = part(qkv, 0), k = part(qkv, 1), v = part(qkv, 2);
  const TensorView dq = part(dqkv, 0), dk = part(dqkv, 1), dv = part(dqkv, 2);
  const TensorView ov = out.view(), lv = lse.view(), dov = dout.view();
  const AttentionConfig cfg;
  EXPECT_NO_THROW(attention_forward(q, k, v, std::nullopt, cfg, ov, lv));
  EXPECT_NO_THROW(attention_backward(dov, q, k, v, ov, lv, std::nullopt, cfg, dq, dk, dv, std::nullopt));
  auto fwd = [&](TensorView o, TensorView l) {
    return [=] { attention_forward(q, k, v, std::nullopt, cfg, o, l); };
  };
  auto bwd = [&](TensorView g_q, TensorView g_k, TensorView g_v) {
    return [=] { attention_backward(dov, q, k, v, ov, lv, std::nullopt, cfg, g_q, g_k, g_v, std::nullopt); };
  };
  TensorView out_on_v = ov;
  out_on_v.data = v.data, out_on_v.strides[0] = batch, out_on_v.strides[1] = row, out_on_v.strides[2] = D;
  expect_error(fwd(out_on_v, lv), ErrorKind::invalid_argument, "out", "out written over v");
  TensorView lse_in_out = lv;
  lse_in_out.data = static_cast<float*>(ov.data) + 16;
  expect_error(fwd(ov, lse_in_out), ErrorKind::invalid_argument, "out", "lse inside out");
  expect_error(bwd(dq, dq, dv), ErrorKind::invalid_argument, "dq", "dk the same view as dq");
  // dk moved 4 elements down: its first 4 elements per token are dq's last 4.
  expect_error(bwd(dq, part(dqkv, 1, -4), dv), ErrorKind::invalid_argument, "dq", "dk reaching into dq");
  // dv moved 4 elements up: its last 4 elements per token are the next token's first dq elements.
  expect_error(bwd(dq, dk, part(dqkv, 2, 4)), ErrorKind::invalid_argument, "dq", "dv reaching into the next token");
  // dq moved one head block up lands exactly on dk.
  expect_error(bwd(part(dqkv, 0, H * D), dk, dv), ErrorKind::invalid_argument, "dq", "dq moved onto dk");
  expect_error(bwd(dq, dk, dov), ErrorKind::invalid_argument, "dv", "dv written over dout");
  // dq moved one token down (into the padding token at the end of each batch entry) shares a span
  // with dk and dv but no byte: accepted.
  EXPECT_NO_THROW(bwd(part(dqkv, 0, row), dk, dv)());
}

TEST(AttentionCpu, CudaChecksComeBeforeAnyCudaCall) {
  // Views of GPU addresses that are never dereferenced: the argument checks and the dtype
  // refusals run before any CUDA call, so this runs without a GPU. Each tensor gets its own
  // address, 16 MiB apart, so that the overlap check passes them (a tensor passed twice, e.g. k as
  // v, is an input read twice: allowed).
  std::uintptr_t next_fake = 0;
  auto fake_at = [&next_fake] { return reinterpret_cast<void*>((++next_fake) << 24); };
  const Device gpu = Device::cuda(0);
  auto check_unsupported = [](const std::function<void()>& f, const std::string& what, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << what << ": no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::unsupported) << what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << what << ": " << e.what();
    }
  };
  AttentionConfig cfg;
  cfg.mask = AttentionMask::causal_bottom_right;
  {  // f32 (and f64) q/k/v: the CPU reference's dtypes only
    const TensorView q(fake_at(), DType::f32, gpu, {2, 16, 4, 64}), k(fake_at(), DType::f32, gpu, {2, 32, 2, 64}),
        v(fake_at(), DType::f32, gpu, {2, 32, 2, 64}), out(fake_at(), DType::f32, gpu, {2, 16, 4, 64}),
        lse(fake_at(), DType::f32, gpu, {2, 4, 16});
    check_unsupported([&] { attention_forward(q, k, v, std::nullopt, cfg, out, lse); }, "f32 forward", "f16 and bf16");
    const TensorView dq(fake_at(), DType::f32, gpu, {2, 16, 4, 64}), dk(fake_at(), DType::f32, gpu, {2, 32, 2, 64}),
        dv(fake_at(), DType::f32, gpu, {2, 32, 2, 64});
    check_unsupported([&] { attention_backward(out, q, k, v, out, lse, std::nullopt, cfg, dq, dk, dv, std::nullopt); },
                      "f32 backward", "f16 and bf16");
    const TensorView q64(fake_at(), DType::f64, gpu, {2, 16, 4, 64}), k64(fake_at(), DType::f64, gpu, {2, 32, 2, 64}),
        o64(fake_at(), DType::f64, gpu, {2, 16, 4, 64});
    check_unsupported([&] { attention_forward(q64, k64, k64, std::nullopt, cfg, o64, lse); }, "f64 forward",
                      "CPU reference");
  }
  const TensorView q(fake_at(), DType::bf16, gpu, {2, 16, 4, 64}), k(fake_at(), DType::bf16, gpu, {2, 32, 2, 64}),
      v(fake_at(), DType::bf16, gpu, {2, 32, 2, 64}), out(fake_at(), DType::bf16, gpu, {2, 16, 4, 64}),
      lse(fake_at(), DType::f32, gpu, {2, 4, 16});
  {  // an f64 bias
    const TensorView b64(fake_at(), DType::f64, gpu, {1, 4, 16, 32});
    check_unsupported([&] { attention_forward(q, k, v, b64, cfg, out, lse); }, "f64 bias", "f64");
  }
  // Workspace sizes: pure functions of the shape (no CUDA call): delta (B * Sq * Hq floats) plus,
  // unless deterministic, the float32 dq accumulator (times D), each rounded up to 256 bytes.
  AttentionShape shape{2, 16, 32, 4, 2, 64, 64, DType::bf16, false};
  EXPECT_EQ(attention_forward_workspace_size(shape, cfg, gpu), 0u);
  EXPECT_EQ(attention_backward_workspace_size(shape, cfg, true, gpu), 512u);
  EXPECT_EQ(attention_backward_workspace_size(shape, cfg, false, gpu), 512u + 2u * 16 * 4 * 64 * 4);
  shape.seqlen_q = 3;  // 24 floats: 96 bytes, rounded to 256
  EXPECT_EQ(attention_backward_workspace_size(shape, cfg, true, gpu), 256u);
  EXPECT_EQ(attention_backward_workspace_size(shape, cfg, true, Device::cpu()), 0u);
  shape.dtype = DType::f32;
  check_unsupported([&] { attention_backward_workspace_size(shape, cfg, true, gpu); }, "f32 workspace", "f16 and bf16");
  EXPECT_EQ(attention_backward_workspace_size(shape, cfg, true, Device::cpu()), 0u);
  // Bad arguments are still reported as such on CUDA tensors, before any CUDA call.
  const TensorView k3(fake_at(), DType::bf16, gpu, {2, 32, 3, 64});
  expect_error([&] { attention_forward(q, k3, k3, std::nullopt, cfg, out, lse); }, ErrorKind::invalid_argument, "k",
               "Hq % Hkv on CUDA");
  const TensorView qv(fake_at(), DType::bf16, gpu, {32, 4, 64}), kv(fake_at(), DType::bf16, gpu, {64, 2, 64}),
      ov(fake_at(), DType::bf16, gpu, {32, 4, 64}), lv(fake_at(), DType::f32, gpu, {4, 32}), cu(fake_at(), DType::i32, gpu, {3}),
      cu64(fake_at(), DType::i64, gpu, {3});
  expect_error([&] { attention_forward(qv, kv, kv, std::nullopt, cfg, ov, lv, AttentionVarlen{cu64, cu, 16, 32}); },
               ErrorKind::invalid_argument, "cu_seqlens_q", "int64 cu_seqlens on CUDA (values are not read)");
}

}  // namespace
}  // namespace fusekit
