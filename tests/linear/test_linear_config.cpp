// The launch choices of the linear family (linear_config.h), on the CPU: what the benchmark shapes
// get on H100- and H200-like devices, the route boundaries, and properties over a grid of shapes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "linear/linear_config.h"

namespace fusekit {
namespace {

using linear::BackwardPath;
using linear::ForwardPath;

detail::DeviceInfo device(int sm_count, double dram_bytes_per_sm_clock) {
  detail::DeviceInfo d;
  d.sm_count = sm_count;
  d.dram_bytes_per_sm_clock = dram_bytes_per_sm_clock;
  return d;
}
const detail::DeviceInfo kH100 = device(132, 12.83);
const detail::DeviceInfo kH200 = device(132, 18.42);
const detail::DeviceInfo kH100Pcie = device(114, 12.0);

constexpr Activation kActivations[] = {Activation::none,      Activation::relu,         Activation::gelu_erf,
                                       Activation::gelu_tanh, Activation::squared_relu, Activation::silu};

linear::ForwardProblem forward(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype, Activation act,
                               bool bias = true, bool pre = false, bool aligned = true) {
  linear::ForwardProblem p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.dtype = dtype;
  p.activation = act;
  p.bias = bias;
  p.pre = pre;
  p.pre_fits_aux = pre && aligned;
  p.cutlass_ok = aligned && dtype != DType::f32 && n % 8 == 0 && k % 8 == 0;
  return p;
}

linear::BackwardProblem backward(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype, Activation act,
                                 bool dx = true, bool dw = true, bool aligned = true) {
  linear::BackwardProblem p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.dtype = dtype;
  p.activation = act;
  p.dx = dx;
  p.dw = dw;
  p.dbias = true;
  p.dz_in_dgrad_aligned = aligned && n % 8 == 0 && k % 8 == 0;
  return p;
}

// The problem of a call from its parameters: a column-major W rules out the kernels that read W
// row-major (the fused forward, the dz-in-dgrad backward), whatever its alignment.
TEST(LinearConfig, ColumnMajorWeightTakesTheCublasltPaths) {
  alignas(16) static std::uint16_t buffer[64];
  linear::ForwardParams f;
  f.m = 256;
  f.n = 768;
  f.k = 2304;
  f.x = f.w = f.bias = buffer;
  f.y = buffer;
  f.ldx = f.k;
  f.ldw = f.k;
  f.ldy = f.n;
  EXPECT_TRUE(linear::forward_problem(f).cutlass_ok);
  f.w_col_major = true;
  f.ldw = f.n;
  EXPECT_FALSE(linear::forward_problem(f).cutlass_ok);
  EXPECT_EQ(linear::choose_forward_path(linear::forward_problem(f), ForwardPath::cutlass_fused),
            ForwardPath::cublaslt_epilogue);

  linear::BackwardParams b;
  b.m = 4096;
  b.n = 4096;
  b.k = 4096;
  b.activation = Activation::gelu_tanh;
  b.dout = b.x = b.w = b.pre = buffer;
  b.dx = b.dw = buffer;
  b.lddout = b.ldpre = b.n;
  b.ldx = b.lddx = b.ldw = b.lddw = b.k;
  EXPECT_TRUE(linear::backward_problem(b).dz_in_dgrad_aligned);
  EXPECT_EQ(linear::choose_backward(linear::backward_problem(b), kH200).path, BackwardPath::dz_in_dgrad);
  b.w_col_major = true;
  b.ldw = b.n;
  EXPECT_FALSE(linear::backward_problem(b).dz_in_dgrad_aligned);
  EXPECT_EQ(linear::choose_backward(linear::backward_problem(b), kH200, BackwardPath::dz_in_dgrad).path,
            BackwardPath::separate_dz);
}

TEST(LinearConfig, CublasltEpilogueTable) {
  using lt = linear::lt::Epilogue;
  EXPECT_EQ(linear::cublaslt_epilogue(forward(64, 64, 64, DType::bf16, Activation::none, false)), lt::none);
  EXPECT_EQ(linear::cublaslt_epilogue(forward(64, 64, 64, DType::bf16, Activation::none)), lt::bias);
  EXPECT_EQ(linear::cublaslt_epilogue(forward(64, 64, 64, DType::bf16, Activation::relu)), lt::relu_bias);
  EXPECT_EQ(linear::cublaslt_epilogue(forward(64, 64, 64, DType::bf16, Activation::gelu_tanh, false)), lt::gelu);
  EXPECT_EQ(linear::cublaslt_epilogue(forward(64, 64, 64, DType::bf16, Activation::gelu_tanh, true, true)),
            lt::gelu_aux_bias);
  // relu's aux is a bit-mask, not the pre-activation; the aux needs aligned rows.
  EXPECT_FALSE(linear::cublaslt_epilogue(forward(64, 64, 64, DType::bf16, Activation::relu, true, true)));
  EXPECT_FALSE(linear::cublaslt_epilogue(forward(64, 64, 64, DType::bf16, Activation::gelu_tanh, true, true, false)));
  for (Activation a : {Activation::gelu_erf, Activation::squared_relu, Activation::silu})
    EXPECT_FALSE(linear::cublaslt_epilogue(forward(64, 64, 64, DType::bf16, a)));
}

TEST(LinearConfig, BenchmarkShapesForward) {
  // (M, N, K) of the linear benchmark; the choice does not depend on the device.
  const std::int64_t shapes[][3] = {{8192, 16384, 4096}, {8191, 12296, 4096}, {16384, 8192, 8192}, {8192, 4096, 16384}};
  for (const auto& s : shapes) {
    const std::int64_t m = s[0], n = s[1], k = s[2];
    EXPECT_EQ(linear::choose_forward_path(forward(m, n, k, DType::bf16, Activation::none)), ForwardPath::cublaslt_epilogue);
    EXPECT_EQ(linear::choose_forward_path(forward(m, n, k, DType::bf16, Activation::relu)), ForwardPath::cublaslt_epilogue);
    EXPECT_EQ(linear::choose_forward_path(forward(m, n, k, DType::bf16, Activation::gelu_tanh)), ForwardPath::cutlass_fused);
    EXPECT_EQ(linear::choose_forward_path(forward(m, n, k, DType::bf16, Activation::silu)), ForwardPath::cutlass_fused);
    EXPECT_EQ(linear::choose_forward_path(forward(m, n, k, DType::f16, Activation::gelu_erf, true, true)),
              ForwardPath::cutlass_fused);
    // Timed: the paths that compute the same forward, the rule's choice first.
    EXPECT_TRUE(linear::timed_problem(m, n, k, true));
    EXPECT_FALSE(linear::timed_problem(m, n, k, false));
    EXPECT_TRUE(linear::forward_candidates(forward(m, n, k, DType::bf16, Activation::relu), ForwardPath::cublaslt_epilogue).empty());
    EXPECT_EQ(linear::forward_candidates(forward(m, n, k, DType::bf16, Activation::silu), ForwardPath::cutlass_fused),
              (std::vector<ForwardPath>{ForwardPath::cutlass_fused, ForwardPath::unfused}));
    EXPECT_EQ(linear::forward_candidates(forward(m, n, k, DType::bf16, Activation::gelu_tanh), ForwardPath::cutlass_fused),
              (std::vector<ForwardPath>{ForwardPath::cutlass_fused, ForwardPath::cublaslt_epilogue, ForwardPath::unfused}));
  }
  // f32: only the exact epilogues are fused, nothing is timed.
  EXPECT_EQ(linear::choose_forward_path(forward(4096, 4096, 4096, DType::f32, Activation::relu)), ForwardPath::cublaslt_epilogue);
  EXPECT_EQ(linear::choose_forward_path(forward(4096, 4096, 4096, DType::f32, Activation::gelu_tanh)), ForwardPath::unfused);
  EXPECT_TRUE(linear::forward_candidates(forward(4096, 4096, 4096, DType::f32, Activation::silu), ForwardPath::unfused).empty());
  // Misaligned 16-bit: what cuBLASLt can fuse, else unfused.
  EXPECT_EQ(linear::choose_forward_path(forward(1000, 1001, 999, DType::bf16, Activation::silu)), ForwardPath::unfused);
  EXPECT_EQ(linear::choose_forward_path(forward(1000, 1001, 999, DType::bf16, Activation::gelu_tanh)),
            ForwardPath::cublaslt_epilogue);
  // Problems under 2^30 flops are never timed.
  EXPECT_FALSE(linear::timed_problem(512, 512, 512, true));
  EXPECT_TRUE(linear::timed_problem(512, 512, 2048, true));  // exactly 2^30
}

TEST(LinearConfig, ForcedForwardPathWhereItCanServe) {
  const linear::ForwardProblem silu = forward(256, 256, 256, DType::bf16, Activation::silu);
  EXPECT_EQ(linear::choose_forward_path(silu, ForwardPath::unfused), ForwardPath::unfused);
  EXPECT_EQ(linear::choose_forward_path(silu, ForwardPath::cutlass_fused), ForwardPath::cutlass_fused);
  // cuBLASLt has no silu epilogue: the automatic choice.
  EXPECT_EQ(linear::choose_forward_path(silu, ForwardPath::cublaslt_epilogue), ForwardPath::cutlass_fused);
  const linear::ForwardProblem f32 = forward(256, 256, 256, DType::f32, Activation::relu);
  EXPECT_EQ(linear::choose_forward_path(f32, ForwardPath::cutlass_fused), ForwardPath::cublaslt_epilogue);
}

TEST(LinearConfig, BenchmarkShapesBackward) {
  for (const detail::DeviceInfo& d : {kH100, kH200}) {
    // 4096 <= K <= 6144 and at least 2^36 flops: dz inside the dx GEMM, the first wave's rows formed first
    // (K = 4096: 16 tiles per row, 132 / 16 = 8 blocks of 128 rows).
    linear::BackwardPlan plan = linear::choose_backward(backward(8192, 16384, 4096, DType::bf16, Activation::gelu_tanh), d);
    EXPECT_EQ(plan.path, BackwardPath::dz_in_dgrad);
    EXPECT_EQ(plan.first_rows, 1024);
    plan = linear::choose_backward(backward(8191, 12296, 4096, DType::bf16, Activation::relu), d);
    EXPECT_EQ(plan.path, BackwardPath::dz_in_dgrad);
    EXPECT_EQ(plan.first_rows, 1024);
    // K > 6144: the separate pass.
    EXPECT_EQ(linear::choose_backward(backward(16384, 8192, 8192, DType::bf16, Activation::relu), d).path,
              BackwardPath::separate_dz);
    EXPECT_EQ(linear::choose_backward(backward(8192, 4096, 16384, DType::bf16, Activation::relu), d).path,
              BackwardPath::separate_dz);
    // K < 4096: the separate pass (GPT-2 124M's and a 1B Llama's MLP up projections).
    EXPECT_EQ(linear::choose_backward(backward(16384, 3072, 768, DType::bf16, Activation::gelu_tanh), d).path,
              BackwardPath::separate_dz);
    EXPECT_EQ(linear::choose_backward(backward(16384, 8192, 2048, DType::bf16, Activation::gelu_tanh), d).path,
              BackwardPath::separate_dz);
    // The routing test's shapes (LinearGpu.BackwardRouting).
    EXPECT_EQ(linear::choose_backward(backward(2048, 4096, 4096, DType::bf16, Activation::gelu_tanh), d).path,
              BackwardPath::dz_in_dgrad);
    EXPECT_EQ(linear::choose_backward(backward(4096, 4096, 2048, DType::bf16, Activation::gelu_tanh), d).path,
              BackwardPath::separate_dz);
    EXPECT_EQ(linear::choose_backward(backward(2048, 2048, 8192, DType::bf16, Activation::gelu_tanh), d).path,
              BackwardPath::separate_dz);
    EXPECT_EQ(linear::choose_backward(backward(1024, 1024, 1024, DType::bf16, Activation::gelu_tanh), d).path,
              BackwardPath::separate_dz);
    // Without dx, in f32, misaligned: the separate pass; without an activation: no dz.
    EXPECT_EQ(linear::choose_backward(backward(8192, 16384, 4096, DType::bf16, Activation::relu, false), d).path,
              BackwardPath::separate_dz);
    EXPECT_EQ(linear::choose_backward(backward(8192, 16384, 4096, DType::f32, Activation::relu), d).path,
              BackwardPath::separate_dz);
    EXPECT_EQ(linear::choose_backward(backward(8192, 16384, 4096, DType::bf16, Activation::relu, true, true, false), d).path,
              BackwardPath::separate_dz);
    EXPECT_EQ(linear::choose_backward(backward(8192, 16384, 4096, DType::bf16, Activation::none), d).path,
              BackwardPath::no_dz);
    EXPECT_EQ(linear::choose_backward(backward(8192, 16384, 4096, DType::bf16, Activation::relu, false, false), d).path,
              BackwardPath::no_dz);
  }
  // Fewer SMs, fewer rows formed first (114 / 16 = 7 blocks).
  EXPECT_EQ(linear::choose_backward(backward(8192, 16384, 4096, DType::bf16, Activation::relu), kH100Pcie).first_rows, 896);
}

TEST(LinearConfig, DzRouteBoundaries) {
  const auto path = [](std::int64_t m, std::int64_t n, std::int64_t k) {
    return linear::choose_backward(backward(m, n, k, DType::bf16, Activation::silu), kH100).path;
  };
  EXPECT_EQ(path(4096, 4096, 6144), BackwardPath::dz_in_dgrad);
  EXPECT_EQ(path(4096, 4096, 6152), BackwardPath::separate_dz);
  EXPECT_EQ(path(4096, 4096, 4096), BackwardPath::dz_in_dgrad);
  EXPECT_EQ(path(4096, 4096, 4088), BackwardPath::separate_dz);  // K just under 4096
  EXPECT_EQ(path(2048, 4096, 4096), BackwardPath::dz_in_dgrad);  // exactly 2^36
  EXPECT_EQ(path(2048, 4088, 4096), BackwardPath::separate_dz);  // just under
  // The table's last row catches everything.
  EXPECT_EQ(std::end(linear::kDzRoutes)[-1].max_k, INT64_MAX);
  EXPECT_EQ(std::end(linear::kDzRoutes)[-1].min_flops, 0.0);
}

TEST(LinearConfig, ForcedBackwardRouteAndFirstRows) {
  const linear::BackwardProblem small = backward(512, 512, 512, DType::bf16, Activation::relu);
  linear::BackwardPlan plan = linear::choose_backward(small, kH100, BackwardPath::dz_in_dgrad);
  EXPECT_EQ(plan.path, BackwardPath::dz_in_dgrad);
  EXPECT_EQ(plan.first_rows, 512);  // 132 / 2 tiles per row = 66 blocks, capped at M
  plan = linear::choose_backward(small, kH100, BackwardPath::dz_in_dgrad, 0);
  EXPECT_EQ(plan.first_rows, 0);
  plan = linear::choose_backward(small, kH100, BackwardPath::dz_in_dgrad, 300);
  EXPECT_EQ(plan.first_rows, 256);  // rounded down to 128
  EXPECT_EQ(linear::choose_backward(backward(8192, 16384, 4096, DType::bf16, Activation::relu), kH100,
                                    BackwardPath::separate_dz)
                .path,
            BackwardPath::separate_dz);
  // A forced route the kernel cannot serve falls back.
  EXPECT_EQ(linear::choose_backward(backward(512, 512, 512, DType::f32, Activation::relu), kH100,
                                    BackwardPath::dz_in_dgrad)
                .path,
            BackwardPath::separate_dz);
}

TEST(LinearConfig, ChoicesAreServableOverAGrid) {
  const std::int64_t dims[] = {1, 7, 8, 64, 100, 1000, 1024, 4096, 8191, 12296, 16384};
  int checked = 0;
  for (std::int64_t m : dims)
    for (std::int64_t n : dims)
      for (std::int64_t k : dims)
        for (DType dtype : {DType::f32, DType::f16, DType::bf16})
          for (Activation act : kActivations)
            for (bool pre : {false, true}) {
              const linear::ForwardProblem p = forward(m, n, k, dtype, act, true, pre, (m + n) % 3 != 0);
              const ForwardPath path = linear::choose_forward_path(p);
              if (path == ForwardPath::cublaslt_epilogue) ASSERT_TRUE(linear::cublaslt_epilogue(p).has_value());
              if (path == ForwardPath::cutlass_fused) ASSERT_TRUE(p.cutlass_ok);
              const std::vector<ForwardPath> c = linear::forward_candidates(p, path);
              if (!c.empty()) ASSERT_EQ(c.front(), path);
              for (ForwardPath q : c) {
                if (q == ForwardPath::cublaslt_epilogue) ASSERT_TRUE(linear::cublaslt_epilogue(p).has_value());
                if (q == ForwardPath::cutlass_fused) ASSERT_TRUE(p.cutlass_ok);
              }
              for (const detail::DeviceInfo& d : {kH100, kH200, kH100Pcie}) {
                const linear::BackwardPlan plan = linear::choose_backward(backward(m, n, k, dtype, act), d);
                if (plan.path == BackwardPath::dz_in_dgrad) {
                  ASSERT_TRUE(linear::dz_in_dgrad_eligible(backward(m, n, k, dtype, act)));
                  ASSERT_EQ(plan.first_rows % 128, 0);
                  ASSERT_LE(plan.first_rows, m);
                }
              }
              ++checked;
            }
  EXPECT_GT(checked, 0);
}

TEST(LinearConfig, ElementwiseGeometryCoversEveryColumn) {
  const std::int64_t dims[] = {1, 2, 7, 8, 100, 2048, 4104, 12296, 16384, 65536, 1 << 20};
  for (int sms : {132, 114, 1})
    for (std::int64_t m : dims)
      for (std::int64_t n : dims)
        for (int vec : {1, 4, 8}) {
          SCOPED_TRACE(std::to_string(m) + " x " + std::to_string(n) + " vec " + std::to_string(vec));
          const linear::ElementwiseGrid g = linear::elementwise_grid(m, n, vec, sms);
          ASSERT_GE(g.gx * linear::kElementwiseThreads * vec, n);
          ASSERT_GE(g.gy, 1);
          ASSERT_LE(g.gy, std::min<std::int64_t>(m, 65535));
          const int threads = linear::dz_pass_threads(n, vec, g.gx);
          ASSERT_EQ(threads % 32, 0);
          ASSERT_LE(threads, linear::kElementwiseThreads);
          ASSERT_GE(std::int64_t(threads) * g.gx * vec, n);
          const int slots = linear::dbias_slots(m, n);
          ASSERT_GE(slots, 1);
          ASSERT_LE(slots, std::min<std::int64_t>(m, 65535));
        }
  // The dbias order does not depend on the GPU: ~1024 blocks for a row of up to 2048 elements.
  EXPECT_EQ(linear::dbias_slots(8192, 2048), 1024);
  EXPECT_EQ(linear::dbias_slots(8192, 16384), 128);
  EXPECT_EQ(linear::dbias_slots(5, 4104), 5);
}

// ---- gated forward ----------------------------------------------------------------------------

// The epilogue kernel takes exactly the 16-bit, interleaved, aligned, non-empty problems; the
// alignment facts come from the views (gated_forward_problem).
TEST(GatedLinearConfig, EpilogueWhereItServes) {
  using linear::GatedForwardPath;
  alignas(16) static unsigned char buf[1024];
  linear::GatedForwardParams p;
  p.m = 100;
  p.f = 64;
  p.k = 128;
  p.dtype = DType::bf16;
  p.layout = GatedLayout::interleaved;
  p.x = buf;
  p.w = buf;
  p.y = buf;
  p.ldx = 128;
  p.ldw = 128;
  p.ldy = 64;
  EXPECT_EQ(linear::choose_gated_forward_path(linear::gated_forward_problem(p)), GatedForwardPath::epilogue);
  const auto path_with = [&](auto change) {
    linear::GatedForwardParams q = p;
    change(q);
    return linear::choose_gated_forward_path(linear::gated_forward_problem(q));
  };
  using P = linear::GatedForwardParams;
  EXPECT_EQ(path_with([](P& q) { q.dtype = DType::f16; }), GatedForwardPath::epilogue);
  EXPECT_EQ(path_with([](P& q) { q.pre = buf + 16; q.ldpre = 136; }), GatedForwardPath::epilogue);
  EXPECT_EQ(path_with([](P& q) { q.y = buf + 8; q.ldy = 68; }), GatedForwardPath::epilogue);
  EXPECT_EQ(path_with([](P& q) { q.dtype = DType::f32; }), GatedForwardPath::gemm_then_gated);
  EXPECT_EQ(path_with([](P& q) { q.layout = GatedLayout::halves; }), GatedForwardPath::gemm_then_gated);
  EXPECT_EQ(path_with([](P& q) { q.w_col_major = true; }), GatedForwardPath::gemm_then_gated);
  EXPECT_EQ(path_with([](P& q) { q.f = 66; }), GatedForwardPath::gemm_then_gated);
  EXPECT_EQ(path_with([](P& q) { q.k = 124; }), GatedForwardPath::gemm_then_gated);
  EXPECT_EQ(path_with([](P& q) { q.ldx = 132; }), GatedForwardPath::gemm_then_gated);
  EXPECT_EQ(path_with([](P& q) { q.x = buf + 8; }), GatedForwardPath::gemm_then_gated);
  EXPECT_EQ(path_with([](P& q) { q.ldy = 66; }), GatedForwardPath::gemm_then_gated);
  EXPECT_EQ(path_with([](P& q) { q.y = buf + 4; }), GatedForwardPath::gemm_then_gated);
  EXPECT_EQ(path_with([](P& q) { q.pre = buf; q.ldpre = 132; }), GatedForwardPath::gemm_then_gated);
  EXPECT_EQ(path_with([](P& q) { q.pre = buf + 8; q.ldpre = 128; }), GatedForwardPath::gemm_then_gated);
  EXPECT_EQ(path_with([](P& q) { q.bias = buf + 2; }), GatedForwardPath::gemm_then_gated);
  EXPECT_EQ(path_with([](P& q) { q.k = 0; }), GatedForwardPath::gemm_then_gated);
  EXPECT_EQ(path_with([](P& q) { q.m = 0; }), GatedForwardPath::trivial);
  EXPECT_EQ(path_with([](P& q) { q.f = 0; }), GatedForwardPath::trivial);
  // A forced separate path is always taken; a forced epilogue only where it serves.
  const auto problem = linear::gated_forward_problem(p);
  EXPECT_EQ(linear::choose_gated_forward_path(problem, GatedForwardPath::gemm_then_gated),
            GatedForwardPath::gemm_then_gated);
  linear::GatedForwardParams halves = p;
  halves.layout = GatedLayout::halves;
  EXPECT_EQ(linear::choose_gated_forward_path(linear::gated_forward_problem(halves), GatedForwardPath::epilogue),
            GatedForwardPath::gemm_then_gated);
}

// A gated backward forms dpre in the dx GEMM with gate and up interleaved only, and reads dy
// (2F / 2 columns) in 8-byte vectors: a dy row stride that is a multiple of 4 suffices.
TEST(GatedLinearConfig, DpreInDgradEligibility) {
  alignas(16) static unsigned char buf[1024];
  linear::BackwardParams p;
  p.m = 4096;
  p.n = 648;
  p.k = 256;
  p.dtype = DType::bf16;
  p.activation = Activation::silu;
  p.gated = true;
  p.dout = buf;
  p.lddout = 324;
  p.pre = buf;
  p.ldpre = 648;
  p.w = buf;
  p.ldw = 256;
  p.dx = buf;
  p.lddx = 256;
  EXPECT_TRUE(linear::dz_in_dgrad_eligible(linear::backward_problem(p)));
  linear::BackwardParams q = p;
  q.gated_layout = GatedLayout::halves;
  EXPECT_FALSE(linear::dz_in_dgrad_eligible(linear::backward_problem(q)));
  q = p;
  q.lddout = 326;
  EXPECT_FALSE(linear::dz_in_dgrad_eligible(linear::backward_problem(q)));
  q = p;
  q.dout = buf + 4;
  EXPECT_FALSE(linear::dz_in_dgrad_eligible(linear::backward_problem(q)));
  q = p;
  q.dout = buf + 8;
  EXPECT_TRUE(linear::dz_in_dgrad_eligible(linear::backward_problem(q)));
  q.gated = false;  // the plain backward reads dout in 16-byte vectors
  q.lddout = 648;
  EXPECT_FALSE(linear::dz_in_dgrad_eligible(linear::backward_problem(q)));
}

}  // namespace
}  // namespace fusekit
