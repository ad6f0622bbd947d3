// Attention kernel routing (src/attention/attention_config.h) on the CPU: which calls the Hopper
// kernels take on H100- and H200-like devices and which stay on the mma.sync kernels, the
// mma.sync head-dim buckets, the Hopper dK / dV kernel's CTA groups, the backward's modes, and
// the "attention.path" override.
#include <gtest/gtest.h>

#include <climits>
#include <cstdint>
#include <vector>

#include "attention/attention_config.h"
#include "core/overrides.h"
#include "fusekit/error.h"
#include "tests/harness/devices.h"

namespace fusekit::attention {
namespace {

detail::DeviceInfo h100() { return testing::h100_device(); }
detail::DeviceInfo h200() { return testing::h200_device(); }
detail::DeviceInfo a100() { return testing::a100_device(); }


std::vector<detail::DeviceInfo> hoppers() { return {h100(), h200()}; }

// A contiguous (B, S, H, D) operand.
Operand contiguous(std::int64_t seqlen, std::int64_t heads, std::int64_t d) {
  Operand op;
  op.data = reinterpret_cast<void*>(std::uintptr_t{0x10000});
  op.h_stride = d, op.s_stride = heads * d, op.b_stride = seqlen * heads * d;
  return op;
}

BackwardProblem problem(std::int64_t batch, std::int64_t seqlen, std::int64_t heads_q, std::int64_t heads_kv,
                        std::int64_t d, DType dtype = DType::bf16) {
  BackwardProblem p;
  p.batch = batch, p.heads_q = heads_q, p.heads_kv = heads_kv, p.head_dim = d, p.head_dim_v = d;
  p.seqlen_q = p.seqlen_k = seqlen;
  p.total_q = p.total_k = batch * seqlen;
  p.dtype = dtype;
  p.scale = 0.125;
  p.q = p.out = p.dout = p.dq = contiguous(seqlen, heads_q, d);
  p.k = p.v = p.dk = p.dv = contiguous(seqlen, heads_kv, d);
  return p;
}

// A (B, Hq, Sq, Sk) bias in `dtype`, dims of extent 1 broadcast (stride 0).
BiasOperand bias(const Problem& p, DType dtype, std::int64_t b, std::int64_t h, std::int64_t i) {
  BiasOperand x;
  x.data = reinterpret_cast<void*>(std::uintptr_t{0x20000});
  x.dtype = dtype;
  x.shape[0] = b, x.shape[1] = h, x.shape[2] = i, x.shape[3] = p.seqlen_k;
  x.i_stride = i > 1 ? p.seqlen_k : 0;
  x.h_stride = h > 1 ? i * p.seqlen_k : 0;
  x.b_stride = b > 1 ? h * i * p.seqlen_k : 0;
  return x;
}

TEST(AttentionConfig, HeadDimBuckets) {
  for (std::int64_t d = 1; d <= 256; ++d)
    for (std::int64_t dv = 1; dv <= 256; dv += 7) {
      const int bucket = head_dim_bucket(d, dv);
      EXPECT_TRUE(bucket == 64 || bucket == 128 || bucket == 256);
      EXPECT_GE(bucket, std::max(d, dv));
      EXPECT_TRUE(bucket == 64 || bucket / 2 < std::max(d, dv)) << d << " " << dv;  // the smallest that fits
    }
}

TEST(AttentionConfig, ForwardOnHopper) {
  for (const detail::DeviceInfo& device : hoppers()) {
    for (const DType dtype : {DType::bf16, DType::f16})
      for (const std::int64_t d : {64, 128}) {
        const ForwardConfig c = choose_forward(problem(2, 1024, 16, 16, d, dtype), device);
        EXPECT_EQ(c.path, KernelPath::sm90) << device.name << " D " << d;
      }
    // GQA, one token, one query
    EXPECT_EQ(choose_forward(problem(1, 1, 32, 8, 128), device).path, KernelPath::sm90);
    // head dims the Hopper kernels have no instantiation for
    for (const std::int64_t d : {32, 96, 256}) {
      const ForwardConfig c = choose_forward(problem(2, 1024, 16, 16, d), device);
      EXPECT_EQ(c.path, KernelPath::mma) << d;
      EXPECT_EQ(c.bucket, head_dim_bucket(d, d));
    }
    BackwardProblem p = problem(2, 1024, 16, 16, 128);
    p.head_dim_v = 64;
    EXPECT_EQ(choose_forward(p, device).path, KernelPath::mma);
    EXPECT_EQ(choose_forward(p, device).bucket, 128);
    p = problem(2, 1024, 16, 16, 128);
    p.scale = 0.0;  // bias-only logits
    EXPECT_EQ(choose_forward(p, device).path, KernelPath::mma);
    p = problem(2, 1024, 16, 16, 128);
    p.k.h_stride = 0;  // one key head broadcast over heads: TMA cannot step by 0
    p.v.h_stride = 0;
    EXPECT_EQ(choose_forward(p, device).path, KernelPath::mma);
    p = problem(2, 1024, 16, 16, 128);
    p.varlen = true, p.batch = 2, p.total_q = 0;  // every query sequence empty
    EXPECT_EQ(choose_forward(p, device).path, KernelPath::mma);
  }
}

TEST(AttentionConfig, ForwardBias) {
  for (const detail::DeviceInfo& device : hoppers()) {
    BackwardProblem p = problem(2, 1024, 16, 16, 64);
    p.bias = bias(p, DType::bf16, 2, 16, 1024);
    EXPECT_EQ(choose_forward(p, device).path, KernelPath::sm90);
    p.bias = bias(p, DType::bf16, 1, 1, 1024);  // broadcast batch and heads: coordinate 0
    EXPECT_EQ(choose_forward(p, device).path, KernelPath::sm90);
    p.bias = bias(p, DType::bf16, 2, 16, 1);  // broadcast query dim: TMA cannot repeat a row
    EXPECT_EQ(choose_forward(p, device).path, KernelPath::mma);
    p.bias = bias(p, DType::f32, 2, 16, 1024);  // not the input dtype
    EXPECT_EQ(choose_forward(p, device).path, KernelPath::mma);
    p.bias = bias(p, DType::bf16, 2, 16, 1024);
    p.varlen = true;
    EXPECT_EQ(choose_forward(p, device).path, KernelPath::mma);
  }
}

TEST(AttentionConfig, OtherDevicesTakeMma) {
  EXPECT_EQ(choose_forward(problem(2, 1024, 16, 16, 128), a100()).path, KernelPath::mma);
  EXPECT_EQ(choose_backward(problem(2, 1024, 16, 16, 128), a100()).dkdv, DkdvKernel::mma);
}

TEST(AttentionConfig, PathChoice) {
  const BackwardProblem p = problem(2, 1024, 16, 16, 128);
  for (const detail::DeviceInfo& device : hoppers()) {
    EXPECT_EQ(choose_forward(p, device, PathChoice::mma).path, KernelPath::mma);
    EXPECT_EQ(choose_forward(p, device, PathChoice::mma).bucket, 128);
    EXPECT_EQ(choose_forward(p, device, PathChoice::sm90).path, KernelPath::sm90);
    EXPECT_EQ(choose_backward(p, device, PathChoice::mma).dkdv, DkdvKernel::mma);
    EXPECT_EQ(choose_backward(p, device, PathChoice::sm90).dkdv, DkdvKernel::sm90);
  }
  try {
    choose_forward(p, a100(), PathChoice::sm90);
    FAIL() << "forced sm90 on an sm_80 device";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::unsupported);
  }
  EXPECT_THROW(choose_backward(problem(2, 1024, 16, 16, 256), h100(), PathChoice::sm90), Error);
}

TEST(AttentionConfig, PathOverrideKeyRegistered) {
  detail::set_override(kPathOverrideKey, "mma");
  EXPECT_EQ(detail::override_value(kPathOverrideKey).value_or(""), "mma");
  detail::set_override(kPathOverrideKey, "");
  EXPECT_FALSE(detail::override_value(kPathOverrideKey).has_value());
}

TEST(AttentionConfig, BackwardModes) {
  for (const detail::DeviceInfo& device : hoppers()) {
    BackwardProblem p = problem(4, 2048, 16, 4, 128);
    BackwardConfig c = choose_backward(p, device);
    EXPECT_EQ(c.dkdv, DkdvKernel::sm90);
    EXPECT_TRUE(c.atomic_dq);
    EXPECT_EQ(c.cta_group, 1);  // no mask
    p.deterministic = true;
    c = choose_backward(p, device);
    EXPECT_EQ(c.dkdv, DkdvKernel::sm90);
    EXPECT_FALSE(c.atomic_dq);

    // a bias needs the atomic-dQ mode on the Hopper kernel
    p = problem(2, 1024, 16, 16, 128);
    p.bias = bias(p, DType::bf16, 2, 16, 1024);
    EXPECT_EQ(choose_backward(p, device).dkdv, DkdvKernel::sm90);
    p.deterministic = true;
    EXPECT_EQ(choose_backward(p, device).dkdv, DkdvKernel::mma);
    p.deterministic = false;
    p.dq.data = nullptr;
    EXPECT_EQ(choose_backward(p, device).dkdv, DkdvKernel::mma);

    // dropout with a bias fits the Hopper kernel's registers at D = 128, not at D = 64
    for (const std::int64_t d : {64, 128}) {
      p = problem(2, 1024, 16, 16, d);
      p.bias = bias(p, DType::bf16, 2, 16, 1024);
      p.dropout_p = 0.1f;
      EXPECT_EQ(choose_backward(p, device).dkdv, d == 128 ? DkdvKernel::sm90 : DkdvKernel::mma) << d;
    }

    // dbias: written from the dS tiles when nothing is reduced, else dbias_kernel
    p = problem(2, 1024, 16, 16, 128);
    p.bias = bias(p, DType::bf16, 2, 16, 1024);
    p.dbias = bias(p, DType::bf16, 2, 16, 1024);
    c = choose_backward(p, device);
    EXPECT_EQ(c.dkdv, DkdvKernel::sm90);
    EXPECT_FALSE(c.dbias_reduce);
    p.dbias = bias(p, DType::bf16, 1, 16, 1024);
    c = choose_backward(p, device);
    EXPECT_EQ(c.dkdv, DkdvKernel::mma);  // dbias_on_tma refuses a reduced dbias
    EXPECT_TRUE(c.dbias_reduce);
    // only a reduced dbias wanted: no dK / dV kernel at all; only a direct one: the mma.sync one
    p.dq.data = p.dk.data = p.dv.data = nullptr;
    c = choose_backward(p, device);
    EXPECT_EQ(c.dkdv, DkdvKernel::none);
    EXPECT_TRUE(c.dbias_reduce);
    p.dbias = bias(p, DType::bf16, 2, 16, 1024);
    c = choose_backward(p, device);
    EXPECT_EQ(c.dkdv, DkdvKernel::mma);
    EXPECT_FALSE(c.dbias_reduce);
  }
}

TEST(AttentionConfig, CtaGroups) {
  // causal: (kv head, batch) pairs whose Q and dO fit in 16 MB, 8 to 16 of them, else 1
  struct Row {
    std::int64_t seqlen, heads_q, heads_kv, d;
    int group;
  };
  const Row rows[] = {
      {1024, 16, 16, 128, 16},  // 512 KB per pair: 32 fit, capped at 16
      {4096, 16, 16, 128, 8},   // 2 MB: 8
      {4096, 16, 16, 64, 16},   // 1 MB: 16
      {8192, 16, 16, 128, 1},   // 4 MB: 4 fit, fewer than 8
      {2048, 32, 8, 128, 1},    // GQA 4: 4 MB per pair, 4 fit
      {16384, 16, 16, 64, 1},
  };
  for (const detail::DeviceInfo& device : hoppers())
    for (const Row& r : rows) {
      BackwardProblem p = problem(4, r.seqlen, r.heads_q, r.heads_kv, r.d);
      EXPECT_EQ(choose_backward(p, device).cta_group, 1) << "no mask";
      p.mask = AttentionMask::causal_bottom_right;
      const BackwardConfig c = choose_backward(p, device);
      EXPECT_EQ(c.dkdv, DkdvKernel::sm90);
      EXPECT_EQ(c.cta_group, r.group) << r.seqlen << " " << r.d;
      EXPECT_GE(c.cta_group, 1);
      EXPECT_LE(c.cta_group, 16);
    }
}

TEST(AttentionConfig, Sm90GridBound) {
  // one CTA per (128 keys, kv head, batch) must stay an int
  BackwardProblem p = problem(65535, 1 << 20, 64, 64, 128);
  EXPECT_GT((p.seqlen_k + kSm90BackwardKeyBlock - 1) / kSm90BackwardKeyBlock * p.heads_kv * p.batch,
            std::int64_t{INT_MAX});
  EXPECT_EQ(choose_backward(p, h100()).dkdv, DkdvKernel::mma);
  EXPECT_EQ(choose_forward(p, h100()).path, KernelPath::sm90);
}

}  // namespace
}  // namespace fusekit::attention
