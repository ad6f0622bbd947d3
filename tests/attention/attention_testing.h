// Attention test support shared by the CPU suite (test_attention.cpp), the GPU suite
// (test_attention_gpu.cpp) and `fusekit check attention`, no GoogleTest here: a problem
// description (Spec), every tensor of one problem on either device (Problem), laid out as the
// alignment rule of fusekit/attention.h asks (bias rows padded to 16 bytes, optional (B, H, S, D)
// memory layout, packed variable lengths), a GPU problem with its float64 CPU twin (Pair), the
// FlashAttention-style baseline (typical_forward / typical_backward) and the comparison rule.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/convert.h"
#include "fusekit/attention.h"
#include "tests/harness/harness.h"

namespace fusekit::testing::attn {

inline std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }
inline std::int64_t vec_elems(DType d) { return 16 / static_cast<std::int64_t>(dtype_size(d)); }

struct Spec {
  std::int64_t B = 2, Sq = 5, Sk = 7, Hq = 2, Hkv = 1, D = 4, Dv = 6;
  DType dtype = DType::f64;
  AttentionConfig cfg;
  bool bias = false;
  DType bias_dtype = DType::f64;
  bool bias_full[3] = {true, true, true};  // batch, heads, query dims materialized (else size 1)
  bool bias_expand = false;                // size-1 bias dims passed as full-size stride-0 views
  bool bhsd = false;                       // q, k, v, out stored (B, H, S, D) in memory
  std::vector<int> seqlens_q, seqlens_k;   // non-empty: variable lengths
  bool varlen() const { return !seqlens_q.empty(); }
  std::string str() const {
    std::string s = "B" + std::to_string(B) + " Sq" + std::to_string(Sq) + " Sk" + std::to_string(Sk) + " Hq" +
                    std::to_string(Hq) + " Hkv" + std::to_string(Hkv) + " D" + std::to_string(D) + " Dv" +
                    std::to_string(Dv) + " " + dtype_name(dtype) + " mask " + attention_mask_name(cfg.mask) +
                    " win(" + std::to_string(cfg.window_left) + "," + std::to_string(cfg.window_right) +
                    ") p=" + std::to_string(cfg.dropout_p);
    if (cfg.dropout_p > 0.0f) s += " seed " + std::to_string(cfg.seed) + " offset " + std::to_string(cfg.offset);
    if (cfg.scale) s += " scale " + std::to_string(*cfg.scale);
    if (bias)
      s += std::string(" bias ") + dtype_name(bias_dtype) + " [" + (bias_full[0] ? "B" : "1") +
           (bias_full[1] ? "H" : "1") + (bias_full[2] ? "S" : "1") + "]" + (bias_expand ? " expanded" : "");
    if (bhsd) s += " bhsd";
    if (varlen()) {
      s += " varlen q{";
      for (int x : seqlens_q) s += std::to_string(x) + ",";
      s += "} k{";
      for (int x : seqlens_k) s += std::to_string(x) + ",";
      s += "}";
    }
    return s;
  }
  AttentionShape shape() const {
    std::int64_t batch = B, maxq = Sq, maxk = Sk;
    if (varlen()) {
      batch = static_cast<std::int64_t>(seqlens_q.size());
      maxq = maxk = 0;
      for (std::size_t b = 0; b < seqlens_q.size(); ++b)
        maxq = std::max<std::int64_t>(maxq, seqlens_q[b]), maxk = std::max<std::int64_t>(maxk, seqlens_k[b]);
    }
    return AttentionShape{batch, maxq, maxk, Hq, Hkv, D, Dv, dtype, bias};
  }
};

// Every tensor of one problem, on one device. Buffers start poisoned (NaN).
struct Problem {
  Spec s;
  Device device;
  std::int64_t batch, maxq, maxk, tq, tk;
  std::vector<std::int64_t> q0, k0, lq, lk;  // per sequence: first token, length
  std::optional<Buffer> q, k, v, out, dout, dq, dk, dv, lse, bias, dbias, cu_q, cu_k, workspace;

  Buffer operand(std::int64_t S, std::int64_t H, std::int64_t Dh) const {
    if (s.varlen()) return Buffer(s.dtype, device, {S, H, Dh});
    if (s.bhsd) return Buffer(s.dtype, device, {s.B, S, H, Dh}, {H * S * Dh, Dh, S * Dh, 1});
    return Buffer(s.dtype, device, {s.B, S, H, Dh});
  }

  explicit Problem(const Spec& spec, Device dev = Device::cpu()) : s(spec), device(dev) {
    if (s.varlen()) {
      batch = static_cast<std::int64_t>(s.seqlens_q.size());
      tq = tk = maxq = maxk = 0;
      for (std::int64_t b = 0; b < batch; ++b) {
        q0.push_back(tq), k0.push_back(tk), lq.push_back(s.seqlens_q[b]), lk.push_back(s.seqlens_k[b]);
        tq += s.seqlens_q[b], tk += s.seqlens_k[b];
        maxq = std::max<std::int64_t>(maxq, s.seqlens_q[b]), maxk = std::max<std::int64_t>(maxk, s.seqlens_k[b]);
      }
      cu_q.emplace(DType::i32, device, std::vector<std::int64_t>{batch + 1});
      cu_k.emplace(DType::i32, device, std::vector<std::int64_t>{batch + 1});
      std::vector<double> cq{0}, ck{0};
      for (std::int64_t b = 0; b < batch; ++b) cq.push_back(cq.back() + lq[b]), ck.push_back(ck.back() + lk[b]);
      cu_q->set_values(cq), cu_k->set_values(ck);
    } else {
      batch = s.B, maxq = s.Sq, maxk = s.Sk, tq = s.B * s.Sq, tk = s.B * s.Sk;
      for (std::int64_t b = 0; b < batch; ++b)
        q0.push_back(b * s.Sq), k0.push_back(b * s.Sk), lq.push_back(s.Sq), lk.push_back(s.Sk);
    }
    const std::int64_t Sq = s.varlen() ? tq : s.Sq, Sk = s.varlen() ? tk : s.Sk;
    q.emplace(operand(Sq, s.Hq, s.D));
    k.emplace(operand(Sk, s.Hkv, s.D));
    v.emplace(operand(Sk, s.Hkv, s.Dv));
    out.emplace(operand(Sq, s.Hq, s.Dv));
    dout.emplace(operand(Sq, s.Hq, s.Dv));
    dq.emplace(operand(Sq, s.Hq, s.D));
    dk.emplace(operand(Sk, s.Hkv, s.D));
    dv.emplace(operand(Sk, s.Hkv, s.Dv));
    lse.emplace(DType::f32, device,
                s.varlen() ? std::vector<std::int64_t>{s.Hq, tq} : std::vector<std::int64_t>{s.B, s.Hq, s.Sq});
    if (s.bias) {
      // Stored compactly with the key dim padded to 16 bytes (the alignment rule).
      const std::int64_t nb = s.bias_full[0] ? batch : 1, nh = s.bias_full[1] ? s.Hq : 1,
                         ni = s.bias_full[2] ? maxq : 1, kp = round_up(maxk, vec_elems(s.bias_dtype));
      const std::vector<std::int64_t> shape{nb, nh, ni, maxk}, strides{nh * ni * kp, ni * kp, kp, 1};
      bias.emplace(s.bias_dtype, device, shape, strides);
      dbias.emplace(s.bias_dtype, device, shape, strides);
    }
    if (device.is_cuda()) {
      // The non-deterministic size, which covers the deterministic one.
      const std::size_t bytes = attention_backward_workspace_size(s.shape(), s.cfg, false, device);
      if (bytes > 0) workspace.emplace(DType::u8, device, std::vector<std::int64_t>{static_cast<std::int64_t>(bytes)});
    }
  }

  std::int64_t bias_index(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
    const std::int64_t nh = s.bias_full[1] ? s.Hq : 1, ni = s.bias_full[2] ? maxq : 1;
    return (((s.bias_full[0] ? b : 0) * nh + (s.bias_full[1] ? h : 0)) * ni + (s.bias_full[2] ? i : 0)) * maxk + j;
  }

  OptionalTensor bias_view() const {
    if (!bias) return std::nullopt;
    TensorView t = bias->view();
    if (s.bias_expand) {
      const std::int64_t full[3] = {batch, s.Hq, maxq};
      for (int d = 0; d < 3; ++d)
        if (t.shape[d] == 1) t.shape[d] = full[d], t.strides[d] = 0;
    }
    return t;
  }
  std::optional<AttentionVarlen> varlen() const {
    if (!s.varlen()) return std::nullopt;
    return AttentionVarlen{cu_q->view(), cu_k->view(), maxq, maxk};
  }
  OptionalTensor workspace_view() const {
    return workspace ? OptionalTensor(workspace->view()) : std::nullopt;
  }

  void fill(std::mt19937_64& rng, double qk_std = 1.0) {
    q->fill_normal(rng, 0.0, qk_std);
    k->fill_normal(rng, 0.0, qk_std);
    v->fill_normal(rng);
    dout->fill_normal(rng);
    if (bias) bias->fill_normal(rng);
  }
  void forward() {
    attention_forward(q->view(), k->view(), v->view(), bias_view(), s.cfg, out->view(), lse->view(), varlen());
  }
  // Any subset of the gradients (dbias only where the problem has a bias).
  void backward(bool want_dq, bool want_dk, bool want_dv, bool want_dbias, bool deterministic) {
    auto opt = [](bool want, const std::optional<Buffer>& b) {
      return want && b ? OptionalTensor(b->view()) : std::nullopt;
    };
    attention_backward(dout->view(), q->view(), k->view(), v->view(), out->view(), lse->view(), bias_view(),
                       s.cfg, opt(want_dq, dq), opt(want_dk, dk), opt(want_dv, dv), opt(want_dbias, dbias),
                       varlen(), deterministic, workspace_view());
  }
  void backward(bool with_dbias = true) { backward(true, true, true, with_dbias, true); }
  void poison_gradients() {
    for (auto* b : {&dq, &dk, &dv, &dbias})
      if (*b) (*b)->poison();
  }
  double loss() {
    forward();
    const auto o = out->values(), g = dout->values();
    double l = 0;
    for (std::size_t i = 0; i < o.size(); ++i) l += o[i] * g[i];
    return l;
  }
};

// lse from the buffer, reordered to (token, h).
inline std::vector<double> lse_by_token(const Problem& pr) {
  const auto l = pr.lse->values();
  std::vector<double> r(l.size());
  for (std::int64_t t = 0; t < pr.tq; ++t)
    for (std::int64_t h = 0; h < pr.s.Hq; ++h) {
      const std::int64_t b = pr.s.varlen() ? 0 : t / pr.s.Sq, i = pr.s.varlen() ? t : t % pr.s.Sq;
      r[t * pr.s.Hq + h] = pr.s.varlen() ? l[h * pr.tq + t] : l[(b * pr.s.Hq + h) * pr.s.Sq + i];
    }
  return r;
}

// ---- a GPU problem and its float64 CPU twin -----------------------------------------------------

inline Spec reference_spec(const Spec& s) {
  Spec r = s;
  r.dtype = DType::f64;
  r.bias_dtype = DType::f64;
  return r;
}

// The GPU problem and its float64 CPU twin holding the same (rounded) input values.
struct Pair {
  Problem gpu, cpu;
  explicit Pair(const Spec& s) : gpu(s, Device::cuda(0)), cpu(reference_spec(s)) {}
  void fill(std::mt19937_64& rng, double qk_std = 1.0) {
    gpu.fill(rng, qk_std);
    sync_inputs();
  }
  // Copies the GPU problem's inputs (already rounded to their dtypes) into the reference.
  void sync_inputs() {
    cpu.q->set_values(gpu.q->values());
    cpu.k->set_values(gpu.k->values());
    cpu.v->set_values(gpu.v->values());
    cpu.dout->set_values(gpu.dout->values());
    if (gpu.bias) cpu.bias->set_values(gpu.bias->values());
  }
  void forward() {
    cpu.forward();
    gpu.out->poison();
    gpu.lse->poison();
    gpu.forward();
  }
  // Both backwards start from the reference's saved tensors: out rounded to the GPU dtype, lse.
  void share_saved_tensors() {
    gpu.out->set_values(cpu.out->values());
    cpu.out->set_values(gpu.out->values());
    gpu.lse->set_values(cpu.lse->values());
  }
};

// ---- the FlashAttention-style baseline ------------------------------------------------------------

inline double round_to(DType dtype, double x) { return detail::round_to(dtype, x); }

// Everything the simulation needs from a float64 reference problem, with index helpers.
struct Values {
  const Problem& pr;
  const Spec& s;
  std::vector<double> q, k, v, dout, out, bias, lse;
  double scale;
  explicit Values(const Problem& p) : pr(p), s(p.s) {
    q = p.q->values(), k = p.k->values(), v = p.v->values(), dout = p.dout->values(), out = p.out->values();
    if (p.bias) bias = p.bias->values();
    lse = lse_by_token(p);
    scale = s.cfg.scale ? *s.cfg.scale : 1.0 / std::sqrt(static_cast<double>(s.D));
  }
  std::int64_t qrow(std::int64_t b, std::int64_t i, std::int64_t h) const { return (pr.q0[b] + i) * s.Hq + h; }
  std::int64_t krow(std::int64_t b, std::int64_t j, std::int64_t hk) const { return (pr.k0[b] + j) * s.Hkv + hk; }
  bool visible(std::int64_t b, std::int64_t i, std::int64_t j) const {
    const std::int64_t sq = pr.lq[b], sk = pr.lk[b];
    const std::int64_t diag = s.cfg.mask == AttentionMask::causal_top_left ? i : i + sk - sq;
    if (s.cfg.mask != AttentionMask::none && j > diag) return false;
    if (s.cfg.window_left >= 0 && j < diag - s.cfg.window_left) return false;
    if (s.cfg.window_right >= 0 && j > diag + s.cfg.window_right) return false;
    return true;
  }
  // S[i, j] (-inf where masked).
  double score(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
    if (!visible(b, i, j)) return -std::numeric_limits<double>::infinity();
    const std::int64_t hk = h / (s.Hq / s.Hkv);
    double x = 0;
    for (std::int64_t d = 0; d < s.D; ++d) x += q[qrow(b, i, h) * s.D + d] * k[krow(b, j, hk) * s.D + d];
    return scale * x + (pr.bias ? bias[pr.bias_index(b, h, i, j)] : 0.0);
  }
  double dropout(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
    if (s.cfg.dropout_p == 0.0f) return 1.0;
    const bool keep = attention_dropout_keeps(s.cfg.seed, s.cfg.offset, b, h, s.Hq, i, j,
                                              dropout_keep_threshold(s.cfg.dropout_p));
    return keep ? static_cast<double>(1.0f / (1.0f - s.cfg.dropout_p)) : 0.0;
  }
};

// The forward with P~ = exp(S - rowmax) rounded to `dtype` before P V; out rounded.
inline std::vector<double> typical_forward(const Problem& ref, DType dtype) {
  const Values x(ref);
  const Spec& s = ref.s;
  std::vector<double> out(x.out.size(), 0.0);
  for (std::int64_t b = 0; b < ref.batch; ++b)
    for (std::int64_t h = 0; h < s.Hq; ++h)
      for (std::int64_t i = 0; i < ref.lq[b]; ++i) {
        std::vector<double> S(static_cast<std::size_t>(ref.lk[b]));
        double m = -std::numeric_limits<double>::infinity();
        for (std::int64_t j = 0; j < ref.lk[b]; ++j) m = std::max(m, S[j] = x.score(b, h, i, j));
        if (m == -std::numeric_limits<double>::infinity()) continue;
        double l = 0;
        for (double sj : S) l += std::exp(sj - m);
        const std::int64_t hk = h / (s.Hq / s.Hkv);
        for (std::int64_t j = 0; j < ref.lk[b]; ++j) {
          const double w = round_to(dtype, std::exp(S[j] - m)) * x.dropout(b, h, i, j) / l;
          if (w == 0.0) continue;
          for (std::int64_t d = 0; d < s.Dv; ++d) out[x.qrow(b, i, h) * s.Dv + d] += w * x.v[x.krow(b, j, hk) * s.Dv + d];
        }
      }
  for (double& o : out) o = round_to(dtype, o);
  return out;
}

// The backward from the reference's saved out and lse with P Z and dS rounded to `dtype` before
// their products (dS also before the dbias reduction), outputs rounded; and the cancellation
// floors (quadrature norms of the terms of dq, dk, dbias).
struct TypicalBackward {
  std::vector<double> dq, dk, dv, dbias;
  double dq_terms = 0, dk_terms = 0, dbias_terms = 0;
};

inline TypicalBackward typical_backward(const Problem& ref, DType dtype, DType dbias_dtype) {
  const Values x(ref);
  const Spec& s = ref.s;
  TypicalBackward t;
  t.dq.assign(x.q.size(), 0.0), t.dk.assign(x.k.size(), 0.0), t.dv.assign(x.v.size(), 0.0);
  if (ref.dbias) t.dbias.assign(static_cast<std::size_t>(ref.dbias->numel()), 0.0);
  for (std::int64_t b = 0; b < ref.batch; ++b)
    for (std::int64_t h = 0; h < s.Hq; ++h) {
      const std::int64_t hk = h / (s.Hq / s.Hkv);
      for (std::int64_t i = 0; i < ref.lq[b]; ++i) {
        const std::int64_t qr = x.qrow(b, i, h);
        const double lse = x.lse[qr];
        if (lse == -std::numeric_limits<double>::infinity()) continue;
        double delta = 0;
        for (std::int64_t d = 0; d < s.Dv; ++d) delta += x.dout[qr * s.Dv + d] * x.out[qr * s.Dv + d];
        for (std::int64_t j = 0; j < ref.lk[b]; ++j) {
          const double S = x.score(b, h, i, j);
          if (S == -std::numeric_limits<double>::infinity()) continue;
          const std::int64_t kr = x.krow(b, j, hk);
          const double P = std::exp(S - lse), z = x.dropout(b, h, i, j);
          double dp = 0;
          for (std::int64_t d = 0; d < s.Dv; ++d) dp += x.dout[qr * s.Dv + d] * x.v[kr * s.Dv + d];
          const double ds = P * (dp * z - delta), mag = P * (std::abs(dp * z) + std::abs(delta));
          const double pz = round_to(dtype, P * z), dsr = round_to(dtype, ds);
          for (std::int64_t d = 0; d < s.Dv; ++d) t.dv[kr * s.Dv + d] += pz * x.dout[qr * s.Dv + d];
          for (std::int64_t d = 0; d < s.D; ++d) {
            const double kd = x.k[kr * s.D + d], qd = x.q[qr * s.D + d];
            t.dq[qr * s.D + d] += x.scale * dsr * kd;
            t.dk[kr * s.D + d] += x.scale * dsr * qd;
            t.dq_terms += std::pow(x.scale * mag * kd, 2);
            t.dk_terms += std::pow(x.scale * mag * qd, 2);
          }
          if (ref.dbias) {
            t.dbias[ref.bias_index(b, h, i, j)] += dsr;
            t.dbias_terms += mag * mag;
          }
        }
      }
    }
  for (double& g : t.dq) g = round_to(dtype, g);
  for (double& g : t.dk) g = round_to(dtype, g);
  for (double& g : t.dv) g = round_to(dtype, g);
  for (double& g : t.dbias) g = round_to(dbias_dtype, g);
  t.dq_terms = std::sqrt(t.dq_terms), t.dk_terms = std::sqrt(t.dk_terms), t.dbias_terms = std::sqrt(t.dbias_terms);
  return t;
}

// ---- comparison with the float64 reference ---------------------------------------------------

struct Comparison {
  ErrorStats stats;  // rel_l2 already measured against the scale floor, if any
  double tolerance = 0, rounding = 0, typical = 0;
  bool pass = false;
  std::string message;
};

// `got` against `ref`: no non-finite values, and rel_l2 (measured against max(||ref||,
// 0.1 scale_floor) where scale_floor is the norm of the terms an output is a difference of)
// within 2 x max(rounding baseline, the FlashAttention-style evaluation's error (`typical`),
// accumulation floor). See test_attention_gpu.cpp for why each part is there.
inline Comparison compare_to_reference(const std::vector<double>& got, const std::vector<double>& ref, DType dtype,
                                       const std::vector<double>& typical, const std::string& what,
                                       double scale_floor = 0.0) {
  Comparison c;
  if (got.size() != ref.size() || typical.size() != ref.size()) {
    c.message = what + ": size " + std::to_string(got.size()) + " vs reference " + std::to_string(ref.size());
    return c;
  }
  c.stats = compare(got, ref);
  c.typical = compare(typical, ref).rel_l2;
  double ref_norm = 0.0;
  for (double r : ref) ref_norm += r * r;
  ref_norm = std::sqrt(ref_norm);
  if (scale_floor > 0.0 && ref_norm < 0.1 * scale_floor) {
    const double f = ref_norm / (0.1 * scale_floor);
    c.stats.rel_l2 *= f, c.typical *= f;
  }
  c.rounding = rounding_error(dtype, ref);
  c.tolerance = 2.0 * std::max({c.rounding, c.typical, accumulation_floor(dtype)});
  c.pass = c.stats.non_finite == 0 && c.stats.rel_l2 <= c.tolerance;
  c.message = what + " [" + dtype_name(dtype) + "]: rel_l2 " + std::to_string(c.stats.rel_l2) + " (tolerance " +
              std::to_string(c.tolerance) + ", rounding baseline " + std::to_string(c.rounding) +
              ", FlashAttention-style baseline " + std::to_string(c.typical) + "), max_abs " +
              std::to_string(c.stats.max_abs) + ", non-finite " + std::to_string(c.stats.non_finite) + " of " +
              std::to_string(c.stats.count);
  return c;
}

// lse: rows the reference masks fully must be exactly -inf; the rest within the float32 bar,
// relative to max(|lse|, 1) in the L2 sense (the reference norm floored at sqrt(n)). lse is a
// logarithm: an absolute error e in it is a relative error e in every probability exp(s - lse),
// whatever lse's size. Where a row's logits cancel to an lse near 0 (one visible key whose score
// and bias nearly cancel), the float32 rounding of those logits is all there is, and a plain
// relative error would divide it by that near-zero value (seen: 2.5e-5 on a lone row).
inline Comparison compare_lse(const Problem& got, const Problem& ref, const std::string& what) {
  const auto g = lse_by_token(got), r = lse_by_token(ref);
  std::vector<double> gv, rv;
  std::int64_t masked_mismatch = 0;
  for (std::size_t i = 0; i < r.size(); ++i) {
    if (r[i] == -std::numeric_limits<double>::infinity()) {
      masked_mismatch += g[i] != r[i];
    } else {
      gv.push_back(g[i]);
      rv.push_back(r[i]);
    }
  }
  Comparison c;
  c.stats = compare(gv, rv);
  double ref_norm2 = 0.0;
  for (double x : rv) ref_norm2 += x * x;
  const double ref_norm = std::sqrt(ref_norm2), floor_norm = std::sqrt(static_cast<double>(rv.size()));
  if (ref_norm < floor_norm) {  // compare() gives the absolute norm when the reference is all 0
    const double abs_l2 = ref_norm > 0.0 ? c.stats.rel_l2 * ref_norm : c.stats.rel_l2;
    c.stats.rel_l2 = abs_l2 / floor_norm;
  }
  c.rounding = rounding_error(DType::f32, rv);
  c.tolerance = tolerance(DType::f32, rv);
  c.pass = masked_mismatch == 0 && c.stats.non_finite == 0 && c.stats.rel_l2 <= c.tolerance;
  c.message = what + ": rel_l2 " + std::to_string(c.stats.rel_l2) + " (tolerance " + std::to_string(c.tolerance) +
              "), fully masked rows without -inf: " + std::to_string(masked_mismatch) + ", non-finite " +
              std::to_string(c.stats.non_finite);
  return c;
}

// The dtype whose bar a dbias is held to: its own, or the op's for a float32 dbias (dS rounded to
// the op's dtype, then reduced, is what a typical implementation gets).
inline DType dbias_bar_dtype(const Spec& s) { return s.bias_dtype == DType::f32 ? s.dtype : s.bias_dtype; }


}  // namespace fusekit::testing::attn
