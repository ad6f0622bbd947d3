// Attention's guards (CPU backend; the same argument checks run before the GPU path): scratch sizes
// that cannot be allocated, windows near the int64 limit, outputs that overlap themselves, a bias
// holding +inf or NaN, and the workspace queries' argument ranges.
#include <gtest/gtest.h>

#include <sys/resource.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "fusekit/attention.h"
#include "fusekit/error.h"
#include "tests/harness/error_testing.h"

namespace fusekit {
namespace {

using testing::expect_error;
using testing::view;

constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();

// A small f32 problem (B = 1, H = 1, D = Dv = 4) with random q, k, v and dout.
struct Small {
  std::int64_t sq, sk;
  std::vector<float> q, k, v, out, lse, dout, dq, dk, dv;
  Small(std::int64_t sq_, std::int64_t sk_) : sq(sq_), sk(sk_) {
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    auto fill = [&](std::vector<float>& b, std::int64_t n) {
      b.resize(static_cast<std::size_t>(n));
      for (float& x : b) x = u(rng);
    };
    fill(q, sq * 4), fill(k, sk * 4), fill(v, sk * 4), fill(dout, sq * 4);
    out.assign(static_cast<std::size_t>(sq * 4), 0.0f);
    lse.assign(static_cast<std::size_t>(sq), 0.0f);
    dq.assign(q.size(), 0.0f), dk.assign(k.size(), 0.0f), dv.assign(v.size(), 0.0f);
  }
  TensorView Q() { return view(q, {1, sq, 1, 4}); }
  TensorView K() { return view(k, {1, sk, 1, 4}); }
  TensorView V() { return view(v, {1, sk, 1, 4}); }
  TensorView Out() { return view(out, {1, sq, 1, 4}); }
  TensorView Lse() { return view(lse, {1, 1, sq}); }
  TensorView Dout() { return view(dout, {1, sq, 1, 4}); }
  void forward(const AttentionConfig& cfg, const OptionalTensor& bias = std::nullopt) {
    attention_forward(Q(), K(), V(), bias, cfg, Out(), Lse());
  }
  void backward(const AttentionConfig& cfg) {
    attention_backward(Dout(), Q(), K(), V(), Out(), Lse(), std::nullopt, cfg, view(dq, {1, sq, 1, 4}),
                       view(dk, {1, sk, 1, 4}), view(dv, {1, sk, 1, 4}), std::nullopt);
  }
};

TEST(AttentionHardening, ScratchBeyondTheAddressSpaceIsRefusedBeforeAnyWork) {
  // k and v: 2^60 keys broadcast from one row (stride 0), so no memory backs them; the scores of
  // the one query would take 2^63 bytes.
  std::vector<float> q(4, 0.5f), kv(4, 0.25f), out(4), lse(1), dq(4);
  const std::int64_t sk = std::int64_t{1} << 60;
  const TensorView k(kv.data(), DType::f32, Device::cpu(), {1, sk, 1, 4}, {0, 0, 0, 1});
  const TensorView Q = view(q, {1, 1, 1, 4}), O = view(out, {1, 1, 1, 4}), L = view(lse, {1, 1, 1});
  expect_error([&] { attention_forward(Q, k, k, std::nullopt, {}, O, L); }, ErrorKind::invalid_argument, "k",
               "1 x 1152921504606846976 x 8");
  expect_error(
      [&] {
        attention_backward(Q, Q, k, k, O, L, std::nullopt, {}, view(dq, {1, 1, 1, 4}), std::nullopt, std::nullopt,
                           std::nullopt);
      },
      ErrorKind::invalid_argument, "k", "1 x 1152921504606846976 x 8");
}

// Lowers the address-space limit to what the process uses plus `headroom` bytes while alive.
class AddressSpaceLimit {
 public:
  explicit AddressSpaceLimit(std::int64_t headroom) {
    if (getrlimit(RLIMIT_AS, &saved_) != 0) return;
    long pages = 0;
    if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
      std::fclose(f);
    }
    if (pages <= 0) return;
    rlimit lowered = saved_;
    lowered.rlim_cur = static_cast<rlim_t>(pages) * 4096 + static_cast<rlim_t>(headroom);
    if (saved_.rlim_cur != RLIM_INFINITY && saved_.rlim_cur < lowered.rlim_cur) return;
    active_ = setrlimit(RLIMIT_AS, &lowered) == 0;
  }
  ~AddressSpaceLimit() {
    if (active_) setrlimit(RLIMIT_AS, &saved_);
  }
  bool active() const { return active_; }

 private:
  rlimit saved_{};
  bool active_ = false;
};

TEST(AttentionHardening, FailedScratchAllocationIsAnErrorNotAnAbort) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "sanitizers reserve address space up front: RLIMIT_AS cannot be lowered";
#endif
  // S = 2^16: one slice's float64 scores take 2^35 bytes (32 GiB). q, k, v broadcast one row.
  const std::int64_t s = std::int64_t{1} << 16;
  std::vector<float> row(4, 0.5f), out(static_cast<std::size_t>(s * 4)), lse(static_cast<std::size_t>(s)),
      dq(static_cast<std::size_t>(s * 4));
  const TensorView qkv(row.data(), DType::f32, Device::cpu(), {1, s, 1, 4}, {0, 0, 0, 1});
  const TensorView O = view(out, {1, s, 1, 4}), L = view(lse, {1, 1, s});
  {
    AddressSpaceLimit limit(std::int64_t{2} << 30);
    if (!limit.active()) GTEST_SKIP() << "RLIMIT_AS cannot be lowered here";
    expect_error([&] { attention_forward(qkv, qkv, qkv, std::nullopt, {}, O, L); }, ErrorKind::unsupported, "",
                 "could not allocate 34359738368 bytes");
    expect_error(
        [&] {
          attention_backward(qkv, qkv, qkv, qkv, O, L, std::nullopt, {}, view(dq, {1, s, 1, 4}), std::nullopt,
                             std::nullopt, std::nullopt);
        },
        ErrorKind::unsupported, "", "could not allocate 34359738368 bytes");
  }
  // The process is still usable.
  Small p(3, 5);
  p.forward({});
  for (float x : p.lse) EXPECT_TRUE(std::isfinite(x));
}

TEST(AttentionHardening, WindowsNearTheInt64LimitAreUnbounded) {
  for (AttentionMask mask : {AttentionMask::none, AttentionMask::causal_top_left, AttentionMask::causal_bottom_right}) {
    Small ref(5, 7);
    AttentionConfig unbounded;
    unbounded.mask = mask;
    ref.forward(unbounded);
    ref.backward(unbounded);
    for (std::int64_t w : {kMax, kMax - 1, std::int64_t{1} << 62, std::int64_t{1} << 32, std::int64_t{12}}) {
      for (int side = 0; side < 3; ++side) {
        Small p(5, 7);
        AttentionConfig cfg = unbounded;
        if (side != 1) cfg.window_right = w;
        if (side != 0) cfg.window_left = w;
        p.forward(cfg);
        p.backward(cfg);
        const std::string what = "mask " + std::string(attention_mask_name(mask)) + " window " + std::to_string(w) +
                                 " side " + std::to_string(side);
        EXPECT_EQ(p.lse, ref.lse) << what;
        EXPECT_EQ(p.out, ref.out) << what;
        EXPECT_EQ(p.dq, ref.dq) << what;
        EXPECT_EQ(p.dk, ref.dk) << what;
        EXPECT_EQ(p.dv, ref.dv) << what;
        for (float x : p.lse) EXPECT_TRUE(std::isfinite(x)) << what;
      }
    }
  }
  // Small windows still bound: (0, 0) without a causal mask sees one key per query.
  Small narrow(5, 7), full(5, 7);
  AttentionConfig cfg;
  cfg.window_left = 0;
  cfg.window_right = 0;
  narrow.forward(cfg);
  full.forward({});
  EXPECT_NE(narrow.out, full.out);
}

TEST(AttentionHardening, OutputsThatOverlapThemselvesAreRefused) {
  Small p(5, 7);
  std::vector<float> row(4);
  auto expanded = [&](std::int64_t s) {
    return TensorView(row.data(), DType::f32, Device::cpu(), {1, s, 1, 4}, {0, 0, 0, 1});
  };
  expect_error([&] { attention_forward(p.Q(), p.K(), p.V(), std::nullopt, {}, expanded(5), p.Lse()); },
               ErrorKind::invalid_argument, "out", "elements do not overlap");
  p.forward({});
  auto backward = [&](const OptionalTensor& dq, const OptionalTensor& dk, const OptionalTensor& dv) {
    attention_backward(p.Dout(), p.Q(), p.K(), p.V(), p.Out(), p.Lse(), std::nullopt, {}, dq, dk, dv, std::nullopt);
  };
  expect_error([&] { backward(expanded(5), std::nullopt, std::nullopt); }, ErrorKind::invalid_argument, "dq");
  expect_error([&] { backward(std::nullopt, expanded(7), std::nullopt); }, ErrorKind::invalid_argument, "dk");
  expect_error([&] { backward(std::nullopt, std::nullopt, expanded(7)); }, ErrorKind::invalid_argument, "dv");
  // Expanded inputs stay valid.
  EXPECT_NO_THROW(attention_forward(expanded(5), p.K(), p.V(), std::nullopt, {}, p.Out(), p.Lse()));
}

TEST(AttentionHardening, BiasHoldingPlusInfOrNanIsRefusedOnTheCpu) {
  const double inf = std::numeric_limits<double>::infinity();
  for (double bad : {inf, std::nan("")}) {
    Small p(5, 7);
    std::vector<float> bias(5 * 8, 0.0f);  // key rows padded to 8 (a multiple of 4 f32)
    bias[1 * 8 + 2] = static_cast<float>(bad);
    const TensorView b(bias.data(), DType::f32, Device::cpu(), {1, 1, 5, 7}, {40, 40, 8, 1});
    expect_error([&] { p.forward({}, b); }, ErrorKind::invalid_argument, "bias", "at (0, 0, 1, 2)");
  }
  // -inf is a mask: accepted, and a row masked entirely gives lse = -inf, out = 0.
  Small p(5, 7);
  std::vector<float> bias(5 * 8, 0.0f);
  for (int j = 0; j < 7; ++j) bias[2 * 8 + j] = -std::numeric_limits<float>::infinity();
  const TensorView b(bias.data(), DType::f32, Device::cpu(), {1, 1, 5, 7}, {40, 40, 8, 1});
  p.forward({}, b);
  EXPECT_EQ(p.lse[2], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isfinite(p.lse[1]));
}

TEST(AttentionHardening, WorkspaceQueriesCheckEveryArgument) {
  const AttentionConfig cfg;
  AttentionShape ok{2, 128, 128, 4, 2, 64, 64, DType::bf16, false};
  EXPECT_EQ(attention_backward_workspace_size(ok, cfg, false, Device::cpu()), 0u);
  EXPECT_EQ(attention_forward_workspace_size(ok, cfg, Device::cpu()), 0u);
  for (Device device : {Device::cpu(), Device::cuda(0)}) {  // refused before any CUDA call
    AttentionShape huge = ok;
    huge.batch = std::int64_t{1} << 40, huge.seqlen_q = 1024, huge.heads_q = 16, huge.head_dim = 128;
    expect_error([&] { attention_backward_workspace_size(huge, cfg, false, device); }, ErrorKind::invalid_argument,
                 "shape", "1099511627776 x 1024 x 16 x 128 x 4");
    expect_error([&] { attention_forward_workspace_size(huge, cfg, device); }, ErrorKind::invalid_argument, "shape");
    AttentionShape negative = ok;
    negative.seqlen_k = -1;
    expect_error([&] { attention_backward_workspace_size(negative, cfg, true, device); },
                 ErrorKind::invalid_argument, "shape", "got seqlen_k = -1");
    AttentionShape wide = ok;
    wide.head_dim_v = 512;
    expect_error([&] { attention_forward_workspace_size(wide, cfg, device); }, ErrorKind::invalid_argument,
                 "shape", "expected head_dim_v in 0..256, got head_dim_v = 512");
    AttentionShape bad_dtype = ok;
    bad_dtype.dtype = DType::u8;
    expect_error([&] { attention_forward_workspace_size(bad_dtype, cfg, device); }, ErrorKind::invalid_argument,
                 "shape", "got u8");
    AttentionConfig bad_cfg;
    bad_cfg.window_left = -2;
    expect_error([&] { attention_backward_workspace_size(ok, bad_cfg, false, device); },
                 ErrorKind::invalid_argument, "window_left");
  }
}

}  // namespace
}  // namespace fusekit
