// Attention test support shared by the CPU suite (test_attention.cpp) and the GPU suite
// (test_attention_gpu.cpp), no GoogleTest here: a problem description (Spec) and every tensor of
// one problem on either device (Problem), laid out as the alignment rule of fusekit/attention.h
// asks (bias rows padded to 16 bytes, optional (B, H, S, D) memory layout, packed variable
// lengths).
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

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

}  // namespace fusekit::testing::attn
