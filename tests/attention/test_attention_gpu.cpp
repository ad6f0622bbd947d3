// Attention CUDA kernels (bf16, f16) against the float64 CPU reference run on the same inputs:
// a randomized grid (fresh seed per run, see tests/harness) over batch, lengths (1 and lengths
// that are not multiples of the tiles included), GQA/MQA, head dims up to 256 with D != Dv, masks,
// windows, bias broadcasting with dbias (the direct and the reduction path), dropout, variable
// lengths with empty sequences, the (B, H, S, D) layout; plus focused tests: every head-dim
// bucket, masks and windows at edge lengths, each bias broadcast pattern, the dropout mask bit for
// bit, fully masked rows, large logits, packed QKV strides, bitwise determinism, every subset of
// gradients in both modes, a long causal sequence, and the workspace check.
//
// Tolerance (the harness rule, as for the other families): the error (relative L2) of each output
// must stay within twice the larger of two baselines, with the dtype's accumulation floor:
//  * the float64 reference merely rounded to the output's dtype (testing::rounding_error);
//  * the error of a FlashAttention-style evaluation simulated here in float64: P (and P * Z for
//    dV) and dS rounded to the dtype before their matrix products, float64 sums, output rounded.
//    Every 16-bit tensor-core attention rounds these operands (PyTorch's bf16 math path rounds
//    even more), so this is the least error such an implementation has, as the norm tests' float32
//    reduction baseline is for a reduction. It matters where a few roundings dominate (one or two
//    keys or rows): there the kernel's error is that same rounding realization, which may exceed
//    twice the output rounding by chance. On large problems both baselines are about equal.
// dq, dk and dbias are differences of larger terms when dS = P (dP Z - delta) cancels (Sk = 1
// makes dS a pure rounding residual): as in close_to_reference's scale_floor, their error is
// measured against max(||ref||, 0.1 ||terms||), ||terms|| the quadrature norm of the products
// scale * P (|dP Z| + |delta|) * |k| (resp. |q|, and P (|dP Z| + |delta|) for dbias).
// The backward of both sides starts from the same saved tensors (the reference's out rounded to
// the GPU dtype, and its lse), so that it tests the backward alone. lse (float32) is held to the
// float32 bar; a fully masked row must give exactly -inf. A float32 dbias has the simulated
// baseline of the op's dtype (dS rounded to it, then reduced). Outputs are poisoned (NaN bytes)
// before every run, so an unwritten element fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "fusekit/attention.h"
#include "core/overrides.h"
#include "fusekit/error.h"
#include "tests/attention/attention_testing.h"
#include "tests/harness/gtest_helpers.h"

namespace fusekit {
namespace {

using testing::Buffer;
using testing::attn::dbias_bar_dtype;
using testing::attn::lse_by_token;
using testing::attn::Pair;
using testing::attn::Problem;
using testing::attn::Spec;
using testing::attn::typical_backward;
using testing::attn::typical_forward;
using testing::attn::TypicalBackward;
constexpr double kInf = std::numeric_limits<double>::infinity();

::testing::AssertionResult lse_close(const Problem& gpu, const Problem& cpu, const std::string& what) {
  const testing::attn::Comparison c = testing::attn::compare_lse(gpu, cpu, what);
  if (!c.pass) return ::testing::AssertionFailure() << c.message;
  return ::testing::AssertionSuccess() << c.message;
}

// `got` against `ref` with the rule above (attention_testing.h's compare_to_reference).
::testing::AssertionResult close_to(const std::vector<double>& got, const std::vector<double>& ref, DType dtype,
                                    const std::vector<double>& typical, const std::string& what,
                                    double scale_floor = 0.0) {
  const testing::attn::Comparison c = testing::attn::compare_to_reference(got, ref, dtype, typical, what, scale_floor);
  if (!c.pass) return ::testing::AssertionFailure() << c.message;
  return ::testing::AssertionSuccess() << c.message;
}

struct Want {
  bool dq = true, dk = true, dv = true, dbias = true;
};

void expect_gradients(const Pair& p, const TypicalBackward& t, const Want& w, const std::string& tag) {
  const Spec& s = p.gpu.s;
  if (w.dq) EXPECT_TRUE(close_to(p.gpu.dq->values(), p.cpu.dq->values(), s.dtype, t.dq, "dq " + tag, t.dq_terms));
  if (w.dk) EXPECT_TRUE(close_to(p.gpu.dk->values(), p.cpu.dk->values(), s.dtype, t.dk, "dk " + tag, t.dk_terms));
  if (w.dv) EXPECT_TRUE(close_to(p.gpu.dv->values(), p.cpu.dv->values(), s.dtype, t.dv, "dv " + tag));
  if (w.dbias && s.bias)
    EXPECT_TRUE(close_to(p.gpu.dbias->values(), p.cpu.dbias->values(), dbias_bar_dtype(s), t.dbias, "dbias " + tag,
                         t.dbias_terms));
}

void expect_forward(const Pair& p) {
  EXPECT_TRUE(close_to(p.gpu.out->values(), p.cpu.out->values(), p.gpu.s.dtype, typical_forward(p.cpu, p.gpu.s.dtype),
                       "out"));
  EXPECT_TRUE(lse_close(p.gpu, p.cpu, "lse"));
}

// Forward, then the backward in both modes, each against the reference.
void check_case(const Spec& spec, std::uint64_t salt, double qk_std = 1.0) {
  SCOPED_TRACE(spec.str());
  auto rng = testing::make_rng(salt);
  Pair p(spec);
  p.fill(rng, qk_std);
  p.forward();
  expect_forward(p);

  p.share_saved_tensors();
  p.cpu.backward(true, true, true, spec.bias, true);
  const TypicalBackward typical = typical_backward(p.cpu, spec.dtype, dbias_bar_dtype(spec));
  for (bool deterministic : {true, false}) {
    p.gpu.poison_gradients();
    p.gpu.backward(true, true, true, spec.bias, deterministic);
    expect_gradients(p, typical, Want{}, deterministic ? "(deterministic)" : "(atomic dq)");
  }
}

// ---- the randomized grid ------------------------------------------------------------------------

template <typename T>
T pick(std::mt19937_64& rng, std::initializer_list<T> options) {
  return *(options.begin() + static_cast<std::ptrdiff_t>(rng() % options.size()));
}

Spec random_spec(std::mt19937_64& rng) {
  Spec s;
  s.dtype = rng() % 2 ? DType::bf16 : DType::f16;
  s.B = 1 + static_cast<std::int64_t>(rng() % 3);
  s.Hkv = 1 + static_cast<std::int64_t>(rng() % 2);
  s.Hq = s.Hkv * pick<std::int64_t>(rng, {1, 1, 2, 3});  // MHA, GQA, MQA when Hkv = 1
  s.D = pick<std::int64_t>(rng, {8, 16, 32, 40, 64, 64, 72, 96, 128, 128, 136, 192, 256});
  s.Dv = rng() % 3 == 0 ? pick<std::int64_t>(rng, {8, 24, 64, 80, 128, 256}) : s.D;
  s.Sq = pick<std::int64_t>(rng, {1, 2, 7, 33, 63, 64, 65, 100, 129, 190});
  s.Sk = rng() % 3 == 0 ? s.Sq : pick<std::int64_t>(rng, {1, 3, 17, 31, 64, 65, 97, 128, 150, 201});
  // Keep the float64 reference quick: ~3e7 multiply-adds per pass at most.
  while (s.B * s.Hq * s.Sq * s.Sk * (s.D + s.Dv) > 30'000'000 && s.Sq > 1) s.Sq = (s.Sq + 1) / 2;
  s.cfg.mask = pick(rng, {AttentionMask::none, AttentionMask::causal_top_left, AttentionMask::causal_bottom_right});
  if (rng() % 4 == 0) s.cfg.window_left = static_cast<std::int64_t>(rng() % (s.Sk + 4));
  if (rng() % 5 == 0) s.cfg.window_right = static_cast<std::int64_t>(rng() % (s.Sk + 4));
  if (rng() % 3 == 0) {
    s.cfg.dropout_p = pick(rng, {0.1f, 0.3f, 0.6f});
    s.cfg.seed = rng();
    s.cfg.offset = rng() % (std::uint64_t{1} << 32);
  }
  if (rng() % 4 == 0) s.cfg.scale = pick(rng, {0.05f, 0.3f, 1.0f});
  if (rng() % 2 == 0) {
    s.bias = true;
    s.bias_dtype = pick(rng, {DType::f32, DType::f16, DType::bf16});
    for (bool& f : s.bias_full) f = rng() % 2 == 0;
    s.bias_expand = rng() % 4 == 0;
  }
  if (rng() % 4 == 0) {
    s.seqlens_q.clear();
    s.seqlens_k.clear();
    for (std::int64_t b = 0; b < s.B + 1; ++b) {
      s.seqlens_q.push_back(rng() % 5 == 0 ? 0 : static_cast<int>(1 + rng() % static_cast<std::uint64_t>(s.Sq)));
      s.seqlens_k.push_back(rng() % 5 == 0 ? 0 : static_cast<int>(1 + rng() % static_cast<std::uint64_t>(s.Sk)));
    }
  } else {
    s.bhsd = rng() % 3 == 0;
  }
  return s;
}

constexpr int kRandomCases = 40;

TEST(AttentionGpu, RandomizedAgainstReference) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(1000);
  const int n = kRandomCases;
  for (int c = 0; c < n; ++c) {
    const Spec spec = random_spec(rng);
    try {
      check_case(spec, 1001 + static_cast<std::uint64_t>(c));
    } catch (const std::exception& e) {  // name the case (SCOPED_TRACE does not cover an exception)
      ADD_FAILURE() << "case " << c << " " << spec.str() << " threw: " << e.what();
    }
  }
}

// ---- focused tests ------------------------------------------------------------------------------

TEST(AttentionGpu, HeadDimBuckets) {
  FUSEKIT_REQUIRE_GPU();
  const std::pair<std::int64_t, std::int64_t> dims[] = {{8, 8},    {64, 64},  {72, 72},  {128, 128}, {136, 136},
                                                        {256, 256}, {64, 256}, {256, 32}, {40, 120},  {192, 8}};
  std::uint64_t salt = 1100;
  for (auto [d, dv] : dims) {
    Spec s;
    s.dtype = salt % 2 ? DType::f16 : DType::bf16;
    s.B = 1, s.Hq = 2, s.Hkv = 1, s.Sq = 77, s.Sk = 93, s.D = d, s.Dv = dv;
    s.cfg.mask = salt % 3 == 0 ? AttentionMask::causal_top_left : AttentionMask::none;
    check_case(s, salt++);
  }
}

TEST(AttentionGpu, MasksWindowsAndEdgeLengths) {
  FUSEKIT_REQUIRE_GPU();
  struct W {
    std::int64_t left, right;
  };
  const W windows[] = {{-1, -1}, {16, -1}, {-1, 5}, {3, 0}, {0, 0}, {40, 200}};
  std::uint64_t salt = 1200;
  for (AttentionMask m : {AttentionMask::none, AttentionMask::causal_top_left, AttentionMask::causal_bottom_right})
    for (auto [sq, sk] : {std::pair{1, 1}, {1, 130}, {130, 1}, {63, 130}, {130, 63}, {65, 65}})
      for (const W& w : windows) {
        if ((salt++ % 3) != 0) continue;  // a third of the product, a different third for each mask
        Spec s;
        s.dtype = salt % 2 ? DType::bf16 : DType::f16;
        s.B = 2, s.Hq = 2, s.Hkv = 2, s.Sq = sq, s.Sk = sk, s.D = 32, s.Dv = 48;
        s.cfg.mask = m;
        s.cfg.window_left = w.left, s.cfg.window_right = w.right;
        s.bias = salt % 4 == 0, s.bias_dtype = DType::bf16;
        check_case(s, salt);
      }
}

TEST(AttentionGpu, BiasBroadcastAndDbias) {
  FUSEKIT_REQUIRE_GPU();
  std::uint64_t salt = 1300;
  for (int pattern = 0; pattern < 8; ++pattern)
    for (bool expand : {false, true}) {
      if (expand && pattern == 7) continue;  // nothing to expand
      Spec s;
      s.dtype = pattern % 2 ? DType::f16 : DType::bf16;
      s.B = 2, s.Hq = 4, s.Hkv = 2, s.Sq = 70, s.Sk = 90, s.D = 64, s.Dv = 32;
      s.cfg.mask = pattern % 3 == 0 ? AttentionMask::causal_bottom_right : AttentionMask::none;
      s.bias = true;
      const DType bias_dtypes[] = {DType::f32, DType::f16, DType::bf16};
      s.bias_dtype = bias_dtypes[salt % 3];
      for (int d = 0; d < 3; ++d) s.bias_full[d] = (pattern >> d) & 1;
      s.bias_expand = expand;
      check_case(s, salt++);
    }
}

// The mma.sync kernels at the head dims the Hopper kernels take on sm_90 (D = Dv = 64, 128),
// forced by the "attention.path" override: a causal mask, GQA, dropout, a bias in the input
// dtype with dbias, both backward modes.
TEST(AttentionGpu, MmaPathAtHopperHeadDims) {
  FUSEKIT_REQUIRE_GPU();
  struct PathGuard {
    PathGuard() { detail::set_override("attention.path", "mma"); }
    ~PathGuard() { detail::set_override("attention.path", ""); }
  } guard;
  std::uint64_t salt = 1250;
  for (const std::int64_t d : {64, 128})
    for (int variant = 0; variant < 4; ++variant) {
      Spec s;
      s.dtype = variant % 2 ? DType::f16 : DType::bf16;
      s.B = 2, s.Hq = 4, s.Hkv = 2, s.Sq = 150, s.Sk = 190, s.D = d, s.Dv = d;
      s.cfg.mask = variant == 1 ? AttentionMask::causal_bottom_right : AttentionMask::none;
      s.cfg.dropout_p = variant == 2 ? 0.2f : 0.0f;
      s.cfg.seed = 7, s.cfg.offset = 3;
      s.bias = variant == 3, s.bias_dtype = s.dtype;
      check_case(s, salt++);
    }
}

// One-hot values: out[i, j] = P[i, j] * Z[i, j] exposes the mask of every visible element. Two
// shapes: D = 32 runs the mma.sync kernels everywhere; D = Dv = 128 the Hopper kernels on sm_90
// (three query blocks; their key blocks at other offsets are covered by HopperKernelShapes).
void expect_dropout_mask_bit_identical(std::int64_t sq, std::int64_t sk, std::int64_t d, std::int64_t dv,
                                       std::uint64_t salt) {
  Spec s;
  s.dtype = DType::bf16;
  s.B = 2, s.Hq = 3, s.Hkv = 1, s.Sq = sq, s.Sk = sk, s.D = d, s.Dv = dv;
  SCOPED_TRACE(s.str());
  s.cfg.dropout_p = 0.37f, s.cfg.seed = 0x0123456789ABCDEFull, s.cfg.offset = 0xFFFFFFF0u;
  Problem gpu(s, Device::cuda(0));
  auto rng = testing::make_rng(salt);
  gpu.fill(rng, 0.5);
  std::vector<double> onehot(static_cast<std::size_t>(s.B * s.Sk * s.Hkv * s.Dv), 0.0);
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t j = 0; j < s.Sk; ++j) onehot[((b * s.Sk + j) * s.Hkv) * s.Dv + j] = 1.0;
  gpu.v->set_values(onehot);
  gpu.forward();
  const auto out = gpu.out->values();
  const std::uint32_t t = dropout_keep_threshold(s.cfg.dropout_p);
  std::int64_t mismatches = 0, kept = 0;
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t i = 0; i < s.Sq; ++i)
      for (std::int64_t h = 0; h < s.Hq; ++h)
        for (std::int64_t j = 0; j < s.Sk; ++j) {
          const bool keep = attention_dropout_keeps(s.cfg.seed, s.cfg.offset, b, h, s.Hq, i, j, t);
          const double o = out[((b * s.Sq + i) * s.Hq + h) * s.Dv + j];
          mismatches += keep != (o != 0.0);
          kept += keep;
        }
  EXPECT_EQ(mismatches, 0) << "of " << s.B * s.Sq * s.Hq * s.Sk << " elements";
  EXPECT_NEAR(static_cast<double>(kept) / (s.B * s.Sq * s.Hq * s.Sk), 1.0 - s.cfg.dropout_p, 0.02);
  // And the whole op against the reference with that config (forward and every gradient).
  if (d == 32) s.bias = true, s.bias_dtype = DType::f32, s.bias_full[0] = false;
  check_case(s, salt + 1);
}

TEST(AttentionGpu, DropoutMaskIsBitIdentical) {
  FUSEKIT_REQUIRE_GPU();
  expect_dropout_mask_bit_identical(50, 64, 32, 64, 1400);
  expect_dropout_mask_bit_identical(300, 128, 128, 128, 1410);
}

TEST(AttentionGpu, VarlenWithEmptySequences) {
  FUSEKIT_REQUIRE_GPU();
  Spec s;
  s.dtype = DType::bf16;
  s.Hq = 4, s.Hkv = 2, s.D = 64, s.Dv = 64;
  s.seqlens_q = {0, 37, 70, 5, 1};
  s.seqlens_k = {20, 0, 90, 64, 1};
  s.bias = true, s.bias_dtype = DType::bf16;  // (B, H, maxq, maxk) padded: the direct dbias path
  s.cfg.dropout_p = 0.2f, s.cfg.seed = 77, s.cfg.offset = 5;
  std::uint64_t salt = 1500;
  for (AttentionMask m : {AttentionMask::none, AttentionMask::causal_bottom_right, AttentionMask::causal_top_left}) {
    s.cfg.mask = m;
    check_case(s, salt++);
  }
  s.bias_full[1] = false, s.bias_dtype = DType::f32;  // (B, 1, maxq, maxk): reduced over heads
  check_case(s, salt++);
  s.bias_full[0] = false, s.bias_full[2] = false;  // (1, 1, 1, maxk): reduced over everything
  check_case(s, salt++);
}

// Twice: a float32 bias with the deterministic backward (the mma.sync kernels), and a bias in the
// input dtype with the atomic-dQ backward (on sm_90 the Hopper kernels, dbias from the dS tiles).
TEST(AttentionGpu, FullyMaskedRowsAreZeroAndFinite) {
  FUSEKIT_REQUIRE_GPU();
  for (const bool hopper : {false, true}) {
    Spec s;
    s.dtype = DType::f16;
    s.B = 2, s.Hq = 2, s.Hkv = 1, s.Sq = 100, s.Sk = 40, s.D = 64, s.Dv = 64;
    s.cfg.mask = AttentionMask::causal_bottom_right;  // rows i < 60 see no key
    s.bias = true, s.bias_dtype = hopper ? DType::f16 : DType::f32;
    SCOPED_TRACE(s.str());
    Pair p(s);
    auto rng = testing::make_rng(1600);
    p.fill(rng);
    auto bv = p.gpu.bias->values();  // row 80 of (b 1, h 0): -inf bias on every key
    for (std::int64_t j = 0; j < s.Sk; ++j) bv[p.gpu.bias_index(1, 0, 80, j)] = -kInf;
    p.gpu.bias->set_values(bv);
    p.sync_inputs();
    p.forward();
    expect_forward(p);
    p.share_saved_tensors();
    p.cpu.backward();
    p.gpu.poison_gradients();
    p.gpu.backward(true, true, true, true, !hopper);
    expect_gradients(p, typical_backward(p.cpu, s.dtype, dbias_bar_dtype(s)), Want{}, "");
    const auto out = p.gpu.out->values(), lse = p.gpu.lse->values(), dq = p.gpu.dq->values();
    const auto db = p.gpu.dbias->values();
    for (const auto* vals : {&out, &dq, &db})
      for (double x : *vals) ASSERT_FALSE(std::isnan(x));
    for (double x : p.gpu.dk->values()) ASSERT_TRUE(std::isfinite(x));
    for (double x : p.gpu.dv->values()) ASSERT_TRUE(std::isfinite(x));
    for (std::int64_t b = 0; b < s.B; ++b)
      for (std::int64_t h = 0; h < s.Hq; ++h)
        for (std::int64_t i = 0; i < s.Sq; ++i) {
          const bool masked = i < s.Sq - s.Sk || (b == 1 && h == 0 && i == 80);
          EXPECT_EQ(lse[(b * s.Hq + h) * s.Sq + i] == -kInf, masked) << b << " " << h << " " << i;
          if (!masked) continue;
          for (std::int64_t d = 0; d < s.D; ++d) {
            EXPECT_EQ(out[((b * s.Sq + i) * s.Hq + h) * s.Dv + d], 0.0);
            EXPECT_EQ(dq[((b * s.Sq + i) * s.Hq + h) * s.D + d], 0.0);
          }
          for (std::int64_t j = 0; j < s.Sk; ++j) EXPECT_EQ(db[p.gpu.bias_index(b, h, i, j)], 0.0);
        }
  }
}

TEST(AttentionGpu, LargeLogits) {
  FUSEKIT_REQUIRE_GPU();
  // q, k of standard deviation 12 with D = 64: logits of order 150, far past exp's float range.
  Spec s;
  s.dtype = DType::bf16;
  s.B = 1, s.Hq = 2, s.Hkv = 2, s.Sq = 90, s.Sk = 90, s.D = 64, s.Dv = 64;
  s.cfg.mask = AttentionMask::causal_top_left;
  check_case(s, 1700, 12.0);
  s.dtype = DType::f16;
  s.cfg.mask = AttentionMask::none;
  check_case(s, 1701, 12.0);
}

TEST(AttentionGpu, PackedQkvLayout) {
  FUSEKIT_REQUIRE_GPU();
  // q, k, v as views into one (B, S, 3, H, D) tensor (a fused QKV projection's output), out and
  // dout in (B, H, S, D) memory, dq/dk/dv into one packed gradient tensor.
  const std::int64_t B = 2, S = 75, H = 4, D = 64;
  const DType dt = DType::bf16;
  const Device gpu = Device::cuda(0);
  Buffer qkv(dt, gpu, {B, S, 3, H, D}), dqkv(dt, gpu, {B, S, 3, H, D});
  Buffer out(dt, gpu, {B, S, H, D}, {H * S * D, D, S * D, 1}), dout(dt, gpu, {B, S, H, D}, {H * S * D, D, S * D, 1});
  Buffer lse(DType::f32, gpu, {B, H, S});
  auto rng = testing::make_rng(1800);
  qkv.fill_normal(rng);
  dout.fill_normal(rng);
  auto part = [&](const Buffer& buf, int which) {
    TensorView t = buf.view();
    return TensorView(static_cast<char*>(t.data) + which * H * D * dtype_size(dt), dt, gpu, {B, S, H, D},
                      {S * 3 * H * D, 3 * H * D, D, 1});
  };
  AttentionConfig cfg;
  cfg.mask = AttentionMask::causal_top_left;
  cfg.dropout_p = 0.1f, cfg.seed = 9;
  const AttentionShape shape{B, S, S, H, H, D, D, dt, false};
  Buffer ws(DType::u8, gpu, {static_cast<std::int64_t>(attention_backward_workspace_size(shape, cfg, true, gpu))});
  attention_forward(part(qkv, 0), part(qkv, 1), part(qkv, 2), std::nullopt, cfg, out.view(), lse.view());
  attention_backward(dout.view(), part(qkv, 0), part(qkv, 1), part(qkv, 2), out.view(), lse.view(), std::nullopt, cfg,
                     part(dqkv, 0), part(dqkv, 1), part(dqkv, 2), std::nullopt, std::nullopt, true, ws.view());

  // The reference: contiguous float64 tensors with the same values.
  Spec rs;
  rs.dtype = DType::f64, rs.B = B, rs.Sq = S, rs.Sk = S, rs.Hq = H, rs.Hkv = H, rs.D = D, rs.Dv = D, rs.cfg = cfg;
  Problem ref(rs);
  const auto all = qkv.values(), grads = dqkv.values();
  auto slice = [&](const std::vector<double>& v, int which) {
    std::vector<double> r;
    for (std::int64_t bs = 0; bs < B * S; ++bs)
      for (std::int64_t x = 0; x < H * D; ++x) r.push_back(v[(bs * 3 + which) * H * D + x]);
    return r;
  };
  ref.q->set_values(slice(all, 0)), ref.k->set_values(slice(all, 1)), ref.v->set_values(slice(all, 2));
  ref.dout->set_values(dout.values());
  ref.forward();
  EXPECT_TRUE(close_to(out.values(), ref.out->values(), dt, typical_forward(ref, dt), "out (packed qkv)"));
  // Backward from the same saved tensors: the reference takes the GPU's out and lse.
  ref.out->set_values(out.values());
  ref.lse->set_values(lse.values());
  ref.backward();
  const TypicalBackward t = typical_backward(ref, dt, dt);
  EXPECT_TRUE(close_to(slice(grads, 0), ref.dq->values(), dt, t.dq, "dq (packed)", t.dq_terms));
  EXPECT_TRUE(close_to(slice(grads, 1), ref.dk->values(), dt, t.dk, "dk (packed)", t.dk_terms));
  EXPECT_TRUE(close_to(slice(grads, 2), ref.dv->values(), dt, t.dv, "dv (packed)"));
}

TEST(AttentionGpu, DeterministicBackwardIsBitwiseReproducible) {
  FUSEKIT_REQUIRE_GPU();
  for (int variant = 0; variant < 3; ++variant) {
    Spec s;
    s.dtype = DType::bf16;
    s.B = 2, s.Hq = 6, s.Hkv = 2, s.Sq = 150, s.Sk = 170, s.D = 64, s.Dv = 64;
    s.cfg.mask = AttentionMask::causal_bottom_right;
    s.cfg.dropout_p = 0.15f, s.cfg.seed = 11;
    s.bias = variant < 2, s.bias_dtype = DType::f32;  // variant 2: no bias (the Hopper kernels on sm_90)
    if (variant == 1) s.bias_full[0] = false, s.bias_full[1] = false;  // dbias reduced over batch and heads
    SCOPED_TRACE(s.str());
    Problem gpu(s, Device::cuda(0));
    auto rng = testing::make_rng(1900 + static_cast<std::uint64_t>(variant));
    gpu.fill(rng);
    gpu.forward();
    auto bytes = [&] {
      return std::vector<std::vector<unsigned char>>{gpu.dq->raw_bytes(), gpu.dk->raw_bytes(), gpu.dv->raw_bytes(),
                                                     s.bias ? gpu.dbias->raw_bytes() : std::vector<unsigned char>{}};
    };
    gpu.backward(true, true, true, s.bias, true);
    const auto first = bytes();
    for (int run = 0; run < 2; ++run) {
      gpu.poison_gradients();
      gpu.backward(true, true, true, s.bias, true);
      EXPECT_TRUE(bytes() == first) << "deterministic run " << run + 1 << " differs";
    }
    // dk, dv and dbias are reduced in a fixed order in the atomic-dq mode too.
    gpu.poison_gradients();
    gpu.backward(true, true, true, s.bias, false);
    const auto atomic = bytes();
    EXPECT_TRUE(atomic[1] == first[1] && atomic[2] == first[2] && atomic[3] == first[3]);
  }
}

TEST(AttentionGpu, EveryGradientSubset) {
  FUSEKIT_REQUIRE_GPU();
  for (int variant = 0; variant < 2; ++variant) {
    Spec s;
    s.dtype = DType::f16;
    s.B = 2, s.Hq = 4, s.Hkv = 1, s.Sq = 66, s.Sk = 80, s.D = 32, s.Dv = 64;
    s.cfg.mask = AttentionMask::causal_top_left;
    s.bias = true, s.bias_dtype = DType::bf16;
    s.bias_full[0] = variant == 0;  // variant 0: direct dbias; 1: reduced over the batch
    SCOPED_TRACE(s.str());
    Pair p(s);
    auto rng = testing::make_rng(2000 + static_cast<std::uint64_t>(variant));
    p.fill(rng);
    p.forward();
    p.share_saved_tensors();
    p.cpu.backward();
    const TypicalBackward typical = typical_backward(p.cpu, s.dtype, dbias_bar_dtype(s));
    const std::vector<unsigned char> poison_dq = [&] {
      p.gpu.dq->poison();
      return p.gpu.dq->raw_bytes();
    }();
    for (int mask = 1; mask < 16; ++mask)
      for (bool deterministic : {true, false}) {
        const Want w{(mask & 1) != 0, (mask & 2) != 0, (mask & 4) != 0, (mask & 8) != 0};
        p.gpu.poison_gradients();
        p.gpu.backward(w.dq, w.dk, w.dv, w.dbias, deterministic);
        const std::string tag = "subset " + std::to_string(mask) + (deterministic ? " det" : " atomic");
        expect_gradients(p, typical, w, tag);
        if (!w.dq) EXPECT_TRUE(p.gpu.dq->raw_bytes() == poison_dq) << tag << ": dq written though not asked for";
      }
  }
}

TEST(AttentionGpu, LongCausalSequence) {
  FUSEKIT_REQUIRE_GPU();
  Spec s;
  s.dtype = DType::bf16;
  s.B = 1, s.Hq = 2, s.Hkv = 1, s.Sq = 700, s.Sk = 700, s.D = 64, s.Dv = 64;
  s.cfg.mask = AttentionMask::causal_bottom_right;
  check_case(s, 2100);
  s.cfg.window_left = 100, s.cfg.window_right = 20, s.cfg.mask = AttentionMask::none;
  s.dtype = DType::f16;
  check_case(s, 2101);
}

// A problem for the Hopper kernels (D = Dv = 64 or 128): B = 2, the dtype alternating with the
// salt, dropout (if any) with a seed and offset derived from it.
struct HopperShape {
  std::int64_t d, sq, sk, hq, hkv;
  AttentionMask mask;
  std::int64_t wl, wr;
  float dropout_p;
};

Spec hopper_spec(const HopperShape& c, std::uint64_t salt) {
  Spec s;
  s.dtype = salt % 2 ? DType::f16 : DType::bf16;
  s.B = 2, s.Hq = c.hq, s.Hkv = c.hkv, s.D = c.d, s.Dv = c.d, s.Sq = c.sq, s.Sk = c.sk;
  s.cfg.mask = c.mask;
  s.cfg.window_left = c.wl, s.cfg.window_right = c.wr;
  if (c.dropout_p > 0.0f) s.cfg.dropout_p = c.dropout_p, s.cfg.seed = 0xD00D + salt, s.cfg.offset = salt * 977;
  return s;
}

// The Hopper kernels (wgmma + TMA; f16 / bf16, D = Dv = 64 or 128) take every call they can on
// an sm_90 GPU. Their cases here without a bias (HopperBias has those): several 128-row query blocks and 128-key
// blocks with ragged ends, every mask and window kind, grouped-query heads, the (B, H, S, D)
// layout and variable lengths (queries of one sequence next to another's tokens in the tile).
TEST(AttentionGpu, HopperKernelShapes) {
  FUSEKIT_REQUIRE_GPU();
  struct Case {
    HopperShape shape;
    bool bhsd, varlen;
  };
  const Case cases[] = {
      {{128, 257, 300, 2, 1, AttentionMask::none, -1, -1, 0.0f}, false, false},
      {{64, 300, 257, 4, 2, AttentionMask::causal_top_left, -1, -1, 0.0f}, false, false},
      {{128, 200, 390, 2, 2, AttentionMask::causal_bottom_right, -1, -1, 0.0f}, true, false},
      {{64, 390, 390, 3, 1, AttentionMask::none, 130, 7, 0.0f}, false, false},
      {{128, 129, 129, 2, 1, AttentionMask::causal_top_left, 40, -1, 0.0f}, true, false},
      {{64, 0, 0, 4, 2, AttentionMask::causal_bottom_right, -1, -1, 0.0f}, false, true},
      {{128, 0, 0, 2, 1, AttentionMask::none, -1, -1, 0.0f}, false, true},
      // dropout: several query and key blocks, GQA, masks, variable lengths
      {{128, 300, 270, 4, 2, AttentionMask::none, -1, -1, 0.2f}, false, false},
      {{64, 270, 300, 2, 1, AttentionMask::causal_bottom_right, -1, -1, 0.1f}, true, false},
      {{64, 0, 0, 2, 2, AttentionMask::causal_top_left, 100, -1, 0.3f}, false, true},
      {{128, 0, 0, 3, 1, AttentionMask::none, -1, -1, 0.1f}, false, true},
  };
  std::uint64_t salt = 2300;
  for (const Case& c : cases) {
    Spec s = hopper_spec(c.shape, salt);
    s.bhsd = c.bhsd;
    if (c.varlen) {
      s.seqlens_q = {130, 1, 0, 255, 64};
      s.seqlens_k = {200, 70, 3, 129, 0};
      s.B = 5, s.Sq = 255, s.Sk = 200;
    }
    check_case(s, salt++);
  }
}

// The Hopper kernels with a bias in the input dtype: the forward, and the atomic-dQ backward with
// dbias written from the dS tiles by TMA (or not wanted): tails in both dims, key rows that are
// not a multiple of 8 keys (padded), masks, a window, GQA, dropout, and bias dims broadcast or
// expanded (TMA reads them at coordinate 0; their dbias needs a reduction, which the mma.sync
// kernels do). Every case also runs with dbias not wanted.
TEST(AttentionGpu, HopperBias) {
  FUSEKIT_REQUIRE_GPU();
  struct Case {
    HopperShape shape;
    bool full_batch, full_heads, expand;
  };
  const Case cases[] = {
      {{128, 257, 300, 2, 1, AttentionMask::none, -1, -1, 0.0f}, true, true, false},
      {{64, 300, 257, 4, 2, AttentionMask::causal_top_left, -1, -1, 0.0f}, true, true, false},
      {{128, 200, 390, 2, 2, AttentionMask::causal_bottom_right, -1, -1, 0.1f}, true, true, false},
      {{64, 390, 390, 3, 1, AttentionMask::none, 130, 7, 0.0f}, true, true, false},
      {{128, 129, 136, 4, 2, AttentionMask::none, -1, -1, 0.0f}, false, true, false},
      {{64, 190, 256, 2, 1, AttentionMask::causal_bottom_right, -1, -1, 0.2f}, true, false, true},
      {{128, 1, 77, 2, 1, AttentionMask::none, -1, -1, 0.0f}, true, true, false},
  };
  std::uint64_t salt = 2500;
  for (const Case& c : cases) {
    Spec s = hopper_spec(c.shape, salt);
    s.bias = true, s.bias_dtype = s.dtype;
    s.bias_full[0] = c.full_batch, s.bias_full[1] = c.full_heads, s.bias_full[2] = true;
    s.bias_expand = c.expand;
    SCOPED_TRACE(s.str());
    auto rng = testing::make_rng(salt++);
    Pair p(s);
    p.fill(rng);
    p.forward();
    expect_forward(p);
    p.share_saved_tensors();
    p.cpu.backward(true, true, true, true, true);
    const TypicalBackward typical = typical_backward(p.cpu, s.dtype, dbias_bar_dtype(s));
    for (const bool want_dbias : {true, false}) {
      p.gpu.poison_gradients();
      p.gpu.backward(true, true, true, want_dbias, false);
      expect_gradients(p, typical, Want{true, true, true, want_dbias}, want_dbias ? "(with dbias)" : "(no dbias)");
    }
  }
}

// Variable lengths where every query or every key sequence is empty: nothing for the Hopper
// kernels' TMA descriptors to describe (an extent of 0 is invalid), so these calls take the
// mma.sync kernels; the outputs are still defined (out 0, lse -inf, gradients 0).
TEST(AttentionGpu, VarlenWithNoTokensOnOneSide) {
  FUSEKIT_REQUIRE_GPU();
  std::uint64_t salt = 2400;
  for (const bool no_keys : {true, false})
    for (const std::int64_t d : {64, 128}) {
      Spec s;
      s.dtype = DType::bf16;
      s.Hq = 2, s.Hkv = 2, s.D = d, s.Dv = d;
      s.seqlens_q = no_keys ? std::vector<int>{5, 0, 9} : std::vector<int>{0, 0, 0};
      s.seqlens_k = no_keys ? std::vector<int>{0, 0, 0} : std::vector<int>{7, 0, 3};
      s.B = 3, s.Sq = 9, s.Sk = 7;
      check_case(s, salt++);
    }
}

// Views TMA cannot describe as given: a dim of extent 1 whose stride is not a multiple of 16
// bytes (the argument checks skip the strides of such dims), and k / v broadcast over the kv
// heads (head stride 0). The first runs the Hopper kernels with a substituted stride and must
// give the very bits of the contiguous call; the second takes the mma.sync kernels and must agree
// with the same heads materialized (the Hopper kernels) within twice the bf16 bar.
// One forward and backward of a single-batch bf16 problem (q, k, v and dout of shape (1, S, H, D))
// into fresh, poisoned outputs (out, dq, dk and dv with `strides`); the values of out, lse, dq,
// dk and dv.
std::vector<std::vector<double>> forward_backward(const Buffer& q, const Buffer& k, const Buffer& v,
                                                  const Buffer& dout, const AttentionConfig& cfg, bool deterministic,
                                                  const std::vector<std::int64_t>& strides) {
  const TensorView qv = q.view();
  const std::int64_t S = qv.shape[1], H = qv.shape[2], D = qv.shape[3];
  const DType dt = qv.dtype;
  const Device gpu = qv.device;
  const AttentionShape shape{1, S, S, H, H, D, D, dt, false};
  std::vector<Buffer> o;  // out, lse, dq, dk, dv
  o.emplace_back(dt, gpu, std::vector<std::int64_t>{1, S, H, D}, strides);
  o.emplace_back(DType::f32, gpu, std::vector<std::int64_t>{1, H, S});
  for (int i = 0; i < 3; ++i) o.emplace_back(dt, gpu, std::vector<std::int64_t>{1, S, H, D}, strides);
  for (Buffer& b : o) b.poison();
  Buffer ws(DType::u8, gpu,
            {static_cast<std::int64_t>(attention_backward_workspace_size(shape, cfg, deterministic, gpu))});
  attention_forward(q.view(), k.view(), v.view(), std::nullopt, cfg, o[0].view(), o[1].view());
  attention_backward(dout.view(), q.view(), k.view(), v.view(), o[0].view(), o[1].view(), std::nullopt, cfg,
                     o[2].view(), o[3].view(), o[4].view(), std::nullopt, std::nullopt, deterministic, ws.view());
  std::vector<std::vector<double>> r;
  for (const Buffer& b : o) r.push_back(b.values());
  return r;
}

TEST(AttentionGpu, ViewsTmaCannotDescribe) {
  FUSEKIT_REQUIRE_GPU();
  const std::int64_t S = 150, H = 2, D = 128;
  const DType dt = DType::bf16;
  const Device gpu = Device::cuda(0);
  AttentionConfig cfg;
  cfg.mask = AttentionMask::causal_bottom_right;
  auto rng = testing::make_rng(2500);
  Buffer q(dt, gpu, {1, S, H, D}), k(dt, gpu, {1, S, H, D}), v(dt, gpu, {1, S, H, D}), dout(dt, gpu, {1, S, H, D});
  for (Buffer* b : {&q, &k, &v, &dout}) b->fill_normal(rng);
  using Results = std::vector<std::vector<double>>;  // out, lse, dq, dk, dv
  auto run = [&](const Buffer& q_, const Buffer& k_, const Buffer& v_) {
    return forward_backward(q_, k_, v_, dout, cfg, true, {S * H * D, H * D, D, 1});
  };
  const Results contiguous = run(q, k, v);

  // batch stride 3 elements (6 bytes) on the extent-1 batch dim of q, k and v
  auto odd_batch_stride = [&](const Buffer& from) {
    Buffer b(dt, gpu, {1, S, H, D}, {3, H * D, D, 1});
    b.set_values(from.values());
    return b;
  };
  const Buffer qo = odd_batch_stride(q), ko = odd_batch_stride(k), vo = odd_batch_stride(v);
  EXPECT_TRUE(run(qo, ko, vo) == contiguous) << "a batch stride of 3 elements changed the results";

  // k and v broadcast over the kv heads
  Buffer kb(dt, gpu, {1, S, H, D}, {S * D, D, 0, 1}), vb(dt, gpu, {1, S, H, D}, {S * D, D, 0, 1});
  kb.fill_normal(rng), vb.fill_normal(rng);
  Buffer kc(dt, gpu, {1, S, H, D}), vc(dt, gpu, {1, S, H, D});
  kc.set_values(kb.values()), vc.set_values(vb.values());
  const Results broadcast = run(q, kb, vb), materialized = run(q, kc, vc);
  const char* names[] = {"out", "lse", "dq", "dk", "dv"};
  for (int i = 0; i < 5; ++i) {
    const DType bar = i == 1 ? DType::f32 : dt;
    const testing::ErrorStats e = testing::compare(broadcast[i], materialized[i]);
    EXPECT_EQ(e.non_finite, 0) << names[i];
    EXPECT_LE(e.rel_l2, 2.0 * testing::tolerance(bar, materialized[i])) << names[i];
  }
}

TEST(AttentionGpu, OutputStridesNotOn16Bytes) {
  FUSEKIT_REQUIRE_GPU();
  // The Hopper kernels stage out (D = 128), dK and dV in shared memory and store 16-byte pieces
  // of rows when every stride of the output is a multiple of 16 bytes; otherwise (the API allows
  // any stride on a dim of extent 1: here a batch stride of 3 elements) they store the
  // accumulators' 4-byte pairs directly. Both paths do the same arithmetic: out, lse, dk and dv
  // bitwise equal.
  for (const std::int64_t D : {64, 128}) {
    const std::int64_t S = 200, H = 2;
    const DType dt = DType::bf16;
    const Device gpu = Device::cuda(0);
    AttentionConfig cfg;
    cfg.mask = AttentionMask::causal_top_left;
    auto rng = testing::make_rng(2600 + D);
    Buffer q(dt, gpu, {1, S, H, D}), k(dt, gpu, {1, S, H, D}), v(dt, gpu, {1, S, H, D}), dout(dt, gpu, {1, S, H, D});
    for (Buffer* b : {&q, &k, &v, &dout}) b->fill_normal(rng);
    const auto aligned = forward_backward(q, k, v, dout, cfg, false, {S * H * D, H * D, D, 1});
    const auto odd = forward_backward(q, k, v, dout, cfg, false, {3, H * D, D, 1});
    const char* names[] = {"out", "lse", "dq", "dk", "dv"};
    for (int i : {0, 1, 3, 4}) EXPECT_TRUE(odd[i] == aligned[i]) << names[i] << " at D = " << D;
    // dq comes through float32 atomics: equal up to the order of the additions
    const testing::ErrorStats e = testing::compare(odd[2], aligned[2]);
    EXPECT_EQ(e.non_finite, 0) << "dq at D = " << D;
    EXPECT_LE(e.rel_l2, testing::tolerance(dt, aligned[2])) << "dq at D = " << D;
  }
}

TEST(AttentionGpu, WorkspaceIsChecked) {
  FUSEKIT_REQUIRE_GPU();
  Spec s;
  s.dtype = DType::bf16, s.B = 1, s.Sq = 16, s.Sk = 16, s.Hq = 2, s.Hkv = 2, s.D = 64, s.Dv = 64;
  Problem gpu(s, Device::cuda(0));
  auto rng = testing::make_rng(2200);
  gpu.fill(rng);
  gpu.forward();
  Buffer small(DType::u8, Device::cuda(0), {16});
  try {
    attention_backward(gpu.dout->view(), gpu.q->view(), gpu.k->view(), gpu.v->view(), gpu.out->view(),
                       gpu.lse->view(), std::nullopt, s.cfg, gpu.dq->view(), gpu.dk->view(), gpu.dv->view(),
                       std::nullopt, std::nullopt, true, small.view());
    ADD_FAILURE() << "a 16-byte workspace was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::invalid_argument) << e.what();
    EXPECT_EQ(e.argument(), "workspace") << e.what();
  }
  // Nothing requested: no workspace needed, nothing written.
  EXPECT_NO_THROW(attention_backward(gpu.dout->view(), gpu.q->view(), gpu.k->view(), gpu.v->view(), gpu.out->view(),
                                     gpu.lse->view(), std::nullopt, s.cfg, std::nullopt, std::nullopt, std::nullopt,
                                     std::nullopt));
}

}  // namespace
}  // namespace fusekit
