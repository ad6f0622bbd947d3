// Optimizer ops: the CPU reference against PyTorch's AdamW written out in the test (closed forms
// and a few steps of known values), the global norm against its definition, non-finite values,
// the launch plan, the argument errors, and the CUDA kernels against the CPU reference over
// several steps of tensors of odd sizes, mixed gradient and copy dtypes, clipping on and off,
// misaligned views and lists longer than one launch (poisoned copies, bitwise-deterministic norm).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "core/convert.h"
#include "fusekit/error.h"
#include "fusekit/optim.h"
#include "optim/optim_plan.h"
#include "tests/harness/error_testing.h"
#include "tests/harness/gtest_helpers.h"

namespace fusekit {
namespace {

using testing::Buffer;
using testing::close_to_reference;
using testing::expect_error;

// ---- PyTorch's AdamW, written out independently in double --------------------------------------

struct Hyper {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
};

// torch.optim.AdamW's single-tensor step on one element (step is 1-based).
void pytorch_adamw(double& p, double& m, double& v, double g, const Hyper& h, std::int64_t step) {
  p *= 1.0 - h.lr * h.weight_decay;
  m += (g - m) * (1.0 - h.beta1);  // exp_avg.lerp_(grad, 1 - beta1)
  v = v * h.beta2 + (1.0 - h.beta2) * g * g;
  const double bias_correction1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
  const double denom = std::sqrt(v) / std::sqrt(bias_correction2) + h.eps;
  p -= h.lr / bias_correction1 * m / denom;
}

AdamWConfig config_of(const Hyper& h, std::int64_t step, float max_grad_norm = 0.0f) {
  AdamWConfig c;
  c.lr = static_cast<float>(h.lr);
  c.beta1 = static_cast<float>(h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.eps = static_cast<float>(h.eps);
  c.weight_decay = static_cast<float>(h.weight_decay);
  c.step = step;
  c.max_grad_norm = max_grad_norm;
  return c;
}

TensorView cpu_view(std::vector<float>& v) {
  return TensorView(v.data(), DType::f32, Device::cpu(), {static_cast<std::int64_t>(v.size())});
}

// Relative closeness at float32 storage: a few float32 ulps of the value.
void expect_near_f32(double got, double want, const std::string& what) {
  EXPECT_NEAR(got, want, 4e-7 * std::abs(want) + 1e-12) << what;
}

TEST(OptimCpu, FirstStepIsTheSignStepOfTheClosedForm) {
  // Step 1 from zero moments: m_hat = g and v_hat = g^2, so p1 = p0 (1 - lr wd) - lr g / (|g| + eps).
  std::vector<float> p = {0.5f, -1.25f, 2.0f, 0.0f}, g = {0.1f, -0.3f, 0.05f, 1e-3f};
  std::vector<float> m(4, 0.0f), v(4, 0.0f);
  const Hyper h{1e-2, 0.9, 0.999, 1e-8, 0.1};
  const std::vector<float> p0 = p;
  TensorView pv = cpu_view(p), gv = cpu_view(g), mv = cpu_view(m), vv = cpu_view(v);
  adamw_step({&pv, 1}, {&gv, 1}, {&mv, 1}, {&vv, 1}, {}, config_of(h, 1), std::nullopt);
  for (std::size_t i = 0; i < 4; ++i) {
    const double gi = g[i];
    const double want = p0[i] * (1.0 - h.lr * h.weight_decay) - h.lr * gi / (std::abs(gi) + h.eps);
    expect_near_f32(p[i], want, "param " + std::to_string(i));
    expect_near_f32(m[i], (1.0 - h.beta1) * gi, "exp_avg " + std::to_string(i));
    expect_near_f32(v[i], (1.0 - h.beta2) * gi * gi, "exp_avg_sq " + std::to_string(i));
  }
}

TEST(OptimCpu, StepsMatchPyTorchsAdamWWithAndWithoutClipping) {
  for (const float max_grad_norm : {0.0f, 0.05f, 100.0f}) {
    SCOPED_TRACE("max_grad_norm " + std::to_string(max_grad_norm));
    std::vector<float> p = {0.5f, -1.25f, 2.0f}, q = {0.75f, -0.0625f};
    std::vector<float> pm(3, 0.0f), pv(3, 0.0f), qm(2, 0.0f), qv(2, 0.0f);
    std::vector<double> ref = {0.5, -1.25, 2.0, 0.75, -0.0625}, ref_m(5, 0.0), ref_v(5, 0.0);
    const Hyper h{3e-2, 0.8, 0.95, 1e-6, 0.05};
    for (std::int64_t step = 1; step <= 4; ++step) {
      std::vector<float> gp = {0.1f * step, -0.3f, 0.05f}, gq = {0.2f, -0.01f * step};
      const std::vector<float> all_g = {gp[0], gp[1], gp[2], gq[0], gq[1]};
      double norm = 0.0;
      for (float x : all_g) norm += static_cast<double>(x) * x;
      norm = std::sqrt(norm);
      const double scale = max_grad_norm > 0 ? std::min(1.0, max_grad_norm / (norm + 1e-6)) : 1.0;
      for (std::size_t i = 0; i < 5; ++i) pytorch_adamw(ref[i], ref_m[i], ref_v[i], all_g[i] * scale, h, step);

      std::vector<TensorView> params = {cpu_view(p), cpu_view(q)}, grads = {cpu_view(gp), cpu_view(gq)};
      std::vector<TensorView> m = {cpu_view(pm), cpu_view(qm)}, v = {cpu_view(pv), cpu_view(qv)};
      float norm_value = -1.0f;
      const TensorView norm_view(&norm_value, DType::f32, Device::cpu(), {1});
      global_norm(grads, norm_view, std::nullopt);
      expect_near_f32(norm_value, norm, "global norm");
      OptionalTensor grad_norm;
      if (max_grad_norm > 0) grad_norm = norm_view;
      adamw_step(params, grads, m, v, {}, config_of(h, step, max_grad_norm), grad_norm);
      const std::vector<double> got = {p[0], p[1], p[2], q[0], q[1]};
      const std::vector<double> got_m = {pm[0], pm[1], pm[2], qm[0], qm[1]};
      for (std::size_t i = 0; i < 5; ++i) {
        // The reference keeps float64 state; the op stores float32: a few ulps per step.
        EXPECT_NEAR(got[i], ref[i], 2e-6 * std::abs(ref[i])) << "step " << step << " param " << i;
        EXPECT_NEAR(got_m[i], ref_m[i], 2e-6 * std::abs(ref_m[i]) + 1e-9) << "step " << step << " exp_avg " << i;
      }
    }
  }
}

TEST(OptimCpu, ParamCopiesAreTheUpdatedMasterRounded) {
  std::vector<float> p = {0.3f, -1.7f, 3.14159f}, g = {0.5f, 0.25f, -2.0f}, m = {0.01f, 0.02f, -0.03f};
  std::vector<float> v = {1e-4f, 2e-4f, 3e-4f};
  std::vector<std::uint16_t> copy(3, 0xFFFF);
  TensorView pv = cpu_view(p), gv = cpu_view(g), mv = cpu_view(m), vv = cpu_view(v);
  const TensorView cv(copy.data(), DType::bf16, Device::cpu(), {3});
  adamw_step({&pv, 1}, {&gv, 1}, {&mv, 1}, {&vv, 1}, {&cv, 1}, config_of(Hyper{}, 7), std::nullopt);
  for (std::size_t i = 0; i < 3; ++i)
    EXPECT_EQ(detail::load_as_double(copy.data(), DType::bf16, static_cast<std::int64_t>(i)),
              detail::round_to(DType::bf16, p[i])) << i;
}

TEST(OptimCpu, GlobalNormFollowsTheDefinitionOverMixedDtypes) {
  auto rng = testing::make_rng(1);
  std::vector<Buffer> buffers;
  const std::vector<std::pair<std::int64_t, DType>> specs = {
      {1, DType::f32}, {7, DType::bf16}, {0, DType::f32}, {1003, DType::f16}, {70000, DType::f32}};
  for (const auto& [n, dtype] : specs) {
    buffers.emplace_back(dtype, Device::cpu(), std::vector<std::int64_t>{n});
    buffers.back().fill_normal(rng);
  }
  double sum = 0.0;
  std::vector<TensorView> views;
  for (const Buffer& b : buffers) {
    views.push_back(b.view());
    for (double x : b.values()) sum += x * x;
  }
  float norm = -1.0f;
  global_norm(views, TensorView(&norm, DType::f32, Device::cpu(), {1}), std::nullopt);
  expect_near_f32(norm, std::sqrt(sum), "global norm");

  global_norm({}, TensorView(&norm, DType::f32, Device::cpu(), {}), std::nullopt);  // 0-d norm
  EXPECT_EQ(norm, 0.0f);
  EXPECT_EQ(global_norm_workspace_size(views, Device::cpu()), 0u);
}

// A NaN or infinite gradient propagates as in PyTorch; nothing is skipped.
TEST(OptimCpu, NonFiniteGradientsPropagate) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (const bool clip : {false, true})
    for (const float bad : {nan, inf}) {
      SCOPED_TRACE(std::string(clip ? "clipped " : "") + (std::isnan(bad) ? "nan" : "inf"));
      std::vector<float> p = {1.0f, 2.0f, 3.0f}, g = {0.1f, bad, 0.2f}, m = {0.1f, 0.1f, 0.1f};
      std::vector<float> v = {0.01f, 0.01f, 0.01f};
      TensorView pv = cpu_view(p), gv = cpu_view(g), mv = cpu_view(m), vv = cpu_view(v);
      float norm = 0.0f;
      const TensorView norm_view(&norm, DType::f32, Device::cpu(), {1});
      global_norm({&gv, 1}, norm_view, std::nullopt);
      EXPECT_EQ(std::isnan(norm), std::isnan(bad));
      OptionalTensor grad_norm;
      if (clip) grad_norm = norm_view;
      adamw_step({&pv, 1}, {&gv, 1}, {&mv, 1}, {&vv, 1}, {}, config_of(Hyper{}, 2, clip ? 1.0f : 0.0f), grad_norm);
      EXPECT_FALSE(std::isfinite(p[1]));
      // Clipping by a NaN norm makes every gradient NaN; by an infinite one, the finite ones 0
      // (the parameter still moves with the old momentum).
      const bool all_bad = clip && std::isnan(bad);
      EXPECT_EQ(std::isnan(p[0]), all_bad);
      EXPECT_EQ(std::isnan(p[2]), all_bad);
      if (clip && !std::isnan(bad)) EXPECT_FLOAT_EQ(m[0], 0.9f * 0.1f);
    }
}

TEST(OptimCpu, EmptyListsAndEmptyTensorsAreFine) {
  adamw_step({}, {}, {}, {}, {}, AdamWConfig{}, std::nullopt);
  std::vector<float> none;
  TensorView e(none.data(), DType::f32, Device::cpu(), {0, 5});
  adamw_step({&e, 1}, {&e, 1}, {&e, 1}, {&e, 1}, {&e, 1}, AdamWConfig{}, std::nullopt);
}

// ---- the launch plan ----------------------------------------------------------------------------

TEST(OptimPlan, EveryTensorOnceGroupedByKeyWithinLimits) {
  auto rng = testing::make_rng(2);
  for (int trial = 0; trial < 20; ++trial) {
    const int count = static_cast<int>(rng() % 300);
    const int max_tensors = 1 + static_cast<int>(rng() % 60);
    std::vector<int> keys;
    std::vector<std::int64_t> numels;
    for (int i = 0; i < count; ++i) {
      keys.push_back(static_cast<int>(rng() % 3));
      const std::int64_t kind = static_cast<std::int64_t>(rng() % 4);
      numels.push_back(kind == 0 ? 0 : kind == 1 ? 1 + static_cast<std::int64_t>(rng() % 100)
                                                 : static_cast<std::int64_t>(rng() % 200000));
    }
    const auto launches = optim::plan_launches(keys, numels, max_tensors);
    std::vector<int> seen(static_cast<std::size_t>(count), 0);
    std::int64_t chunks_before = 0;
    for (const optim::PlannedLaunch& l : launches) {
      ASSERT_FALSE(l.tensors.empty());
      EXPECT_LE(static_cast<int>(l.tensors.size()), max_tensors);
      EXPECT_EQ(l.first_chunk, chunks_before);
      std::int64_t chunks = 0;
      int previous = -1;
      for (int t : l.tensors) {
        EXPECT_EQ(keys[static_cast<std::size_t>(t)], l.key);
        EXPECT_GT(t, previous);  // list order inside a launch
        previous = t;
        ++seen[static_cast<std::size_t>(t)];
        chunks += optim::chunk_count(numels[static_cast<std::size_t>(t)]);
      }
      EXPECT_EQ(l.chunks, chunks);
      chunks_before += chunks;
    }
    for (int i = 0; i < count; ++i) EXPECT_EQ(seen[static_cast<std::size_t>(i)], numels[static_cast<std::size_t>(i)] > 0 ? 1 : 0) << i;
    EXPECT_EQ(chunks_before, optim::norm_partial_count(numels));
  }
}

TEST(OptimPlan, WorkspaceIsOneFloatPerChunk) {
  std::vector<float> storage(1);
  const auto make = [&](std::int64_t n) { return TensorView(storage.data(), DType::bf16, Device::cuda(0), {n}); };
  const std::vector<TensorView> t = {make(1), make(optim::kChunkElements), make(optim::kChunkElements + 1), make(0)};
  EXPECT_EQ(global_norm_workspace_size(t, Device::cuda(0)), 4u * sizeof(float));
  EXPECT_EQ(global_norm_workspace_size(t, Device::cpu()), 0u);
  EXPECT_EQ(global_norm_workspace_size({}, Device::cuda(0)), 0u);
}

// ---- argument errors ----------------------------------------------------------------------------

// Two parameters (3 and (2, 2) elements) and their state, all float32 on the CPU.
struct Lists {
  std::vector<float> p0 = testing::ramp(3), p1 = testing::ramp(4), g0 = testing::ramp(3), g1 = testing::ramp(4);
  std::vector<float> m0 = testing::ramp(3), m1 = testing::ramp(4), v0 = testing::ramp(3), v1 = testing::ramp(4);
  std::vector<float> c0 = testing::ramp(3), c1 = testing::ramp(4), norm = {1.0f};
  std::vector<TensorView> params = {cpu_view(p0), testing::view(p1, {2, 2})};
  std::vector<TensorView> grads = {cpu_view(g0), testing::view(g1, {2, 2})};
  std::vector<TensorView> exp_avg = {cpu_view(m0), testing::view(m1, {2, 2})};
  std::vector<TensorView> exp_avg_sq = {cpu_view(v0), testing::view(v1, {2, 2})};
  std::vector<TensorView> copies = {cpu_view(c0), testing::view(c1, {2, 2})};
  AdamWConfig config;
  OptionalTensor grad_norm;

  void step() { adamw_step(params, grads, exp_avg, exp_avg_sq, copies, config, grad_norm); }
};

void expect_step_error(const std::function<void(Lists&)>& spoil, const std::string& argument,
                       const std::string& text = "") {
  Lists l;
  spoil(l);
  expect_error([&] { l.step(); }, ErrorKind::invalid_argument, argument, text);
}

TEST(OptimErrors, AdamWEachBadArgumentIsNamed) {
  Lists ok;
  ok.step();  // the unspoiled lists pass
  expect_step_error([](Lists& l) { l.grads.pop_back(); }, "grads", "2 tensors");
  expect_step_error([](Lists& l) { l.exp_avg.pop_back(); }, "exp_avg");
  expect_step_error([](Lists& l) { l.exp_avg_sq.push_back(l.exp_avg_sq[0]); }, "exp_avg_sq");
  expect_step_error([](Lists& l) { l.copies.pop_back(); }, "param_copies", "none or 2");
  expect_step_error([](Lists& l) { l.params[1].dtype = DType::bf16; }, "params[1]", "f32");
  expect_step_error([](Lists& l) { l.grads[0].dtype = DType::i32; }, "grads[0]", "f32, f16 or bf16");
  expect_step_error([](Lists& l) { l.exp_avg[0].dtype = DType::f16; }, "exp_avg[0]", "f32");
  expect_step_error([](Lists& l) { l.exp_avg_sq[1].dtype = DType::bf16; }, "exp_avg_sq[1]", "f32");
  expect_step_error([](Lists& l) { l.copies[1].dtype = DType::f8e4m3; }, "param_copies[1]", "f32, f16 or bf16");
  expect_step_error([](Lists& l) { l.grads[1] = testing::view(l.g1, {4}); }, "grads[1]", "(2, 2)");
  expect_step_error([](Lists& l) { l.exp_avg[1] = testing::view(l.m1, {1, 4}); }, "exp_avg[1]", "(2, 2)");
  expect_step_error([](Lists& l) { l.copies[0] = testing::view(l.c0, {2}); }, "param_copies[0]", "(3)");
  expect_step_error([](Lists& l) { l.grads[1] = TensorView(l.g1.data(), DType::f32, Device::cpu(), {2, 2}, {1, 2}); },
                    "grads[1]", "contiguous");
  expect_step_error([](Lists& l) { l.params[0].data = nullptr; }, "params[0]", "non-null");
  expect_step_error([](Lists& l) { l.exp_avg[1].device = Device::cuda(0); }, "exp_avg[1]", "cpu");
  // Overlaps: state with state, state with a gradient; gradients may alias each other.
  expect_step_error([](Lists& l) { l.exp_avg[0] = l.params[0]; }, "params[0]", "exp_avg[0]");
  expect_step_error([](Lists& l) { l.grads[1] = testing::view(l.v1, {2, 2}); }, "exp_avg_sq[1]", "grads[1]");
  expect_step_error([](Lists& l) { l.copies[1] = TensorView(l.p1.data() + 1, DType::f32, Device::cpu(), {2, 2}); },
                    "params[1]", "param_copies[1]");
  {
    Lists l;
    std::vector<float> shared = testing::ramp(4);  // one gradient buffer read by both
    l.grads[0] = TensorView(shared.data(), DType::f32, Device::cpu(), {3});
    l.grads[1] = testing::view(shared, {2, 2});
    l.step();
  }
  // The config.
  expect_step_error([](Lists& l) { l.config.lr = -1e-3f; }, "lr", ">= 0");
  expect_step_error([](Lists& l) { l.config.lr = std::numeric_limits<float>::infinity(); }, "lr", "finite");
  expect_step_error([](Lists& l) { l.config.beta1 = 1.0f; }, "beta1", "[0, 1)");
  expect_step_error([](Lists& l) { l.config.beta2 = -0.5f; }, "beta2", "[0, 1)");
  expect_step_error([](Lists& l) { l.config.beta1 = std::numeric_limits<float>::quiet_NaN(); }, "beta1", "[0, 1)");
  expect_step_error([](Lists& l) { l.config.eps = 0.0f; }, "eps", "> 0");
  expect_step_error([](Lists& l) { l.config.weight_decay = -0.1f; }, "weight_decay", ">= 0");
  expect_step_error([](Lists& l) { l.config.step = 0; }, "step", ">= 1");
  expect_step_error([](Lists& l) { l.config.max_grad_norm = -1.0f; }, "max_grad_norm", ">= 0");
  expect_step_error([](Lists& l) { l.config.max_grad_norm = std::numeric_limits<float>::infinity(); },
                    "max_grad_norm", "finite");
  expect_step_error([](Lists& l) { l.config.max_grad_norm = 1.0f; }, "grad_norm", "max_grad_norm > 0");
  expect_step_error([](Lists& l) { l.grad_norm = testing::view(l.norm, {1}); }, "grad_norm", "no clipping");
  expect_step_error([](Lists& l) {
    l.config.max_grad_norm = 1.0f;
    l.grad_norm = TensorView(l.norm.data(), DType::f16, Device::cpu(), {1});
  }, "grad_norm", "f32");
  expect_step_error([](Lists& l) {
    l.config.max_grad_norm = 1.0f;
    l.grad_norm = testing::view(l.g0, {3});
  }, "grad_norm", "1 elements");
}

TEST(OptimErrors, GlobalNormEachBadArgumentIsNamed) {
  std::vector<float> a = testing::ramp(5), b = testing::ramp(6), out = {0.0f, 0.0f};
  std::vector<TensorView> tensors = {cpu_view(a), testing::view(b, {2, 3})};
  const TensorView norm = testing::view(out, {1});
  global_norm(tensors, norm, std::nullopt);
  const auto fails = [&](std::vector<TensorView> t, TensorView n, const std::string& argument, const std::string& text) {
    expect_error([&] { global_norm(t, n, std::nullopt); }, ErrorKind::invalid_argument, argument, text);
  };
  std::vector<TensorView> bad = tensors;
  bad[1].dtype = DType::i32;
  fails(bad, norm, "tensors[1]", "f32, f16 or bf16");
  bad = tensors;
  bad[1] = TensorView(b.data(), DType::f32, Device::cpu(), {2, 3}, {1, 2});
  fails(bad, norm, "tensors[1]", "contiguous");
  bad = tensors;
  bad[0].device = Device::cuda(0);
  fails(bad, norm, "tensors[1]", "cuda");
  fails(tensors, testing::view(out, {2}), "norm", "1 elements");
  fails(tensors, TensorView(out.data(), DType::f64, Device::cpu(), {1}), "norm", "f32");
  fails(tensors, TensorView(a.data() + 2, DType::f32, Device::cpu(), {1}), "norm", "tensors[0]");
  const std::vector<TensorView> bytes = {TensorView(a.data(), DType::u8, Device::cpu(), {5})};
  expect_error([&] { global_norm_workspace_size(bytes, Device::cpu()); }, ErrorKind::invalid_argument,
               "tensors[0]", "f32, f16 or bf16");
}

// ---- GPU against the CPU reference --------------------------------------------------------------

struct Spec {
  std::vector<std::int64_t> shape;
  DType grad = DType::f32;
  DType copy = DType::bf16;
  std::int64_t lead = 0;  // elements before the view (a lead of 1 misaligns it)
};

// One backend's tensors: params, grads, moments and (when `copies`) the low-precision copies.
struct State {
  std::vector<Buffer> p, g, m, v, c;
  Buffer norm;
  std::optional<Buffer> workspace;

  State(const std::vector<Spec>& specs, bool copies, Device device)
      : norm(DType::f32, device, {1}) {
    for (const Spec& s : specs) {
      p.emplace_back(DType::f32, device, s.shape, std::vector<std::int64_t>{}, s.lead);
      g.emplace_back(s.grad, device, s.shape, std::vector<std::int64_t>{}, s.lead);
      m.emplace_back(DType::f32, device, s.shape, std::vector<std::int64_t>{}, s.lead);
      v.emplace_back(DType::f32, device, s.shape, std::vector<std::int64_t>{}, s.lead);
      if (copies) c.emplace_back(s.copy, device, s.shape, std::vector<std::int64_t>{}, s.lead);
    }
    const std::size_t ws = global_norm_workspace_size(views(g), device);
    if (ws > 0) workspace.emplace(DType::u8, device, std::vector<std::int64_t>{static_cast<std::int64_t>(ws)});
  }

  static std::vector<TensorView> views(const std::vector<Buffer>& list) {
    std::vector<TensorView> out;
    for (const Buffer& b : list) out.push_back(b.view());
    return out;
  }
  OptionalTensor workspace_view() const { return workspace ? OptionalTensor(workspace->view()) : std::nullopt; }

  void compute_norm() {
    norm.poison();
    global_norm(views(g), norm.view(), workspace_view());
  }
  void step(const AdamWConfig& config) {
    for (Buffer& b : c) b.poison();
    OptionalTensor grad_norm;
    if (config.max_grad_norm > 0) {
      compute_norm();
      grad_norm = norm.view();
    }
    adamw_step(views(p), views(g), views(m), views(v), views(c), config, grad_norm);
  }
};

double l2(const std::vector<double>& x) {
  double s = 0.0;
  for (double e : x) s += e * e;
  return std::sqrt(s);
}

// Fresh random values, the same on both backends: params N(0, 1), grads N(0, 0.5) in their dtype,
// exp_avg N(0, 0.1), exp_avg_sq the square of N(0, 0.1).
void randomize(std::mt19937_64& rng, State& a, State& b) {
  for (std::size_t i = 0; i < a.p.size(); ++i) {
    a.p[i].fill_normal(rng);
    b.p[i].set_values(a.p[i].values());
    a.m[i].fill_normal(rng, 0.0, 0.1);
    b.m[i].set_values(a.m[i].values());
    a.v[i].fill_normal(rng, 0.0, 0.1);
    std::vector<double> v = a.v[i].values();
    for (double& x : v) x *= x;
    a.v[i].set_values(v);
    b.v[i].set_values(v);
  }
  for (std::size_t i = 0; i < a.g.size(); ++i) {
    a.g[i].fill_normal(rng, 0.0, 0.5);
    b.g[i].set_values(a.g[i].values());
  }
}

// `steps` AdamW steps on the GPU and on the CPU reference from the same random state (new
// gradients each step), every output compared after every step.
void check_steps(const std::vector<Spec>& specs, bool copies, const Hyper& h, double clip_factor,
                 std::uint64_t salt) {
  auto rng = testing::make_rng(salt);
  State cpu(specs, copies, Device::cpu()), gpu(specs, copies, Device::cuda(0));
  randomize(rng, cpu, gpu);
  for (std::int64_t step = 1; step <= 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step > 1)
      for (std::size_t i = 0; i < specs.size(); ++i) {
        cpu.g[i].fill_normal(rng, 0.0, 0.5);
        gpu.g[i].set_values(cpu.g[i].values());
      }
    // clip_factor > 0: max_grad_norm = clip_factor x the gradients' norm (< 1: clipping active).
    float max_grad_norm = 0.0f;
    if (clip_factor > 0) {
      cpu.compute_norm();
      max_grad_norm = static_cast<float>(clip_factor * cpu.norm.values()[0]);
    }
    std::vector<std::vector<double>> before_p, before_m, before_v, grads;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      before_p.push_back(cpu.p[i].values());
      before_m.push_back(cpu.m[i].values());
      before_v.push_back(cpu.v[i].values());
      grads.push_back(cpu.g[i].values());
    }
    const AdamWConfig config = config_of(h, step, max_grad_norm);
    cpu.step(config);
    gpu.step(config);
    if (clip_factor > 0)
      EXPECT_TRUE(close_to_reference(gpu.norm.values(), cpu.norm.values(), DType::f32, "grad norm"));
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const std::string at = "[" + std::to_string(i) + "]";
      // Differences of larger terms (a moment decaying against a new gradient, a parameter moving
      // by its update) are measured against those terms (close_to_reference's scale floor).
      std::vector<double> g2 = grads[i];
      for (double& x : g2) x *= x;
      const double p_terms = l2(before_p[i]);
      EXPECT_TRUE(close_to_reference(gpu.p[i].values(), cpu.p[i].values(), DType::f32, "params" + at, p_terms));
      EXPECT_TRUE(close_to_reference(gpu.m[i].values(), cpu.m[i].values(), DType::f32, "exp_avg" + at,
                                     l2(before_m[i]) + l2(grads[i])));
      EXPECT_TRUE(close_to_reference(gpu.v[i].values(), cpu.v[i].values(), DType::f32, "exp_avg_sq" + at,
                                     l2(before_v[i]) + l2(g2)));
      if (copies) {
        EXPECT_TRUE(close_to_reference(gpu.c[i].values(), cpu.c[i].values(), specs[i].copy, "param_copies" + at, p_terms));
        EXPECT_TRUE(gpu.c[i].lead_untouched()) << "param_copies" << at;
      }
      EXPECT_TRUE(gpu.p[i].lead_untouched()) << "params" << at;
    }
  }
}

// Odd sizes, one of each gradient dtype, copies of each dtype, a shape with a zero, misaligned views.
std::vector<Spec> odd_sizes() {
  return {{{1}, DType::f32, DType::bf16},
          {{7}, DType::bf16, DType::f16},
          {{1000003}, DType::bf16, DType::bf16},
          {{3, 0}, DType::f16, DType::f32},
          {{64, 771}, DType::f16, DType::bf16},
          {{16384 * 2 + 5}, DType::f32, DType::f32, 1},
          {{4096}, DType::bf16, DType::bf16, 3},
          {{33}, DType::f32, DType::f16}};
}

TEST(OptimGpu, AdamWMatchesCpuReferenceOverSteps) {
  FUSEKIT_REQUIRE_GPU();
  std::uint64_t salt = 100;
  for (const bool copies : {false, true})
    for (const double weight_decay : {0.0, 0.1})
      for (const double clip_factor : {0.0, 0.25, 4.0}) {
        SCOPED_TRACE(std::string(copies ? "copies" : "no copies") + ", weight_decay " + std::to_string(weight_decay) +
                     ", clip factor " + std::to_string(clip_factor));
        Hyper h;
        h.lr = 2e-3;
        h.weight_decay = weight_decay;
        check_steps(odd_sizes(), copies, h, clip_factor, salt++);
      }
}

TEST(OptimGpu, ListsLongerThanOneLaunchMatchCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  std::vector<Spec> specs;
  const DType grads[] = {DType::f32, DType::bf16, DType::f16};
  for (int i = 0; i < 150; ++i)
    specs.push_back({{1 + (i * 7919) % 40000}, grads[i % 3], i % 2 ? DType::bf16 : DType::f16, i % 5 == 0 ? 1 : 0});
  Hyper h;
  h.lr = 1e-2;
  h.beta1 = 0.0;  // edge of the range: no momentum
  h.weight_decay = 0.01;
  check_steps(specs, true, h, 0.5, 200);
}

TEST(OptimGpu, GlobalNormMatchesCpuAndIsBitwiseDeterministic) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(300);
  std::vector<Spec> specs = odd_sizes();
  for (int i = 0; i < 130; ++i) specs.push_back({{1 + (i * 104729) % 70000}, i % 2 ? DType::bf16 : DType::f32});
  State cpu(specs, false, Device::cpu()), gpu(specs, false, Device::cuda(0));
  randomize(rng, cpu, gpu);
  cpu.compute_norm();
  gpu.compute_norm();
  EXPECT_TRUE(close_to_reference(gpu.norm.values(), cpu.norm.values(), DType::f32, "global norm"));
  EXPECT_TRUE(testing::same_bytes_every_run([&] { gpu.compute_norm(); }, {&gpu.norm}));
}

TEST(OptimGpu, EmptyListGivesZeroNorm) {
  FUSEKIT_REQUIRE_GPU();
  Buffer norm(DType::f32, Device::cuda(0), {1});
  norm.poison();
  global_norm({}, norm.view(), std::nullopt);
  EXPECT_EQ(norm.values()[0], 0.0);
  adamw_step({}, {}, {}, {}, {}, AdamWConfig{}, std::nullopt);
}

TEST(OptimGpu, NonFiniteGradientsPropagateAsOnTheCpu) {
  FUSEKIT_REQUIRE_GPU();
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  for (const double clip_factor : {0.0, 1.0})
    for (const double bad : {nan, inf}) {
      SCOPED_TRACE(std::string(clip_factor > 0 ? "clipped " : "") + (std::isnan(bad) ? "nan" : "inf"));
      const std::vector<Spec> specs = {{{5000}, DType::bf16}, {{3}, DType::f32}};
      auto rng = testing::make_rng(400);
      State cpu(specs, true, Device::cpu()), gpu(specs, true, Device::cuda(0));
      randomize(rng, cpu, gpu);
      std::vector<double> g = cpu.g[0].values();
      g[1234] = bad;
      cpu.g[0].set_values(g);
      gpu.g[0].set_values(g);
      const AdamWConfig config = config_of(Hyper{}, 3, static_cast<float>(clip_factor));
      cpu.step(config);
      gpu.step(config);
      for (std::size_t i = 0; i < specs.size(); ++i) {
        const std::vector<double> want = cpu.p[i].values(), got = gpu.p[i].values();
        for (std::size_t k = 0; k < want.size(); ++k)
          ASSERT_EQ(std::isfinite(got[k]), std::isfinite(want[k])) << "params[" << i << "] element " << k;
      }
    }
}

}  // namespace
}  // namespace fusekit
