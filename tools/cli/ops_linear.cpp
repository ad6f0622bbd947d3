// CLI entry for the linear family: `fusekit check linear` runs a few representative problems on
// the GPU against the float64 CPU reference with the test suite's rule (error at most twice that
// of a float32-accumulating computation in the same dtype, tests/linear/linear_baseline.h); on
// the CPU it checks the reference's gradients against central differences. bench runs
// bench/linear.
#include <fmt/format.h>

#include <cmath>
#include <optional>

#include "bench/linear/bench_linear.h"
#include "core/activation.h"
#include "fusekit/linear.h"
#include "tests/harness/harness.h"
#include "tests/linear/linear_baseline.h"
#include "tools/cli/ops.h"

namespace fusekit::cli {
namespace {

using testing::Buffer;
namespace lb = testing::linear;

constexpr Activation kActivations[] = {Activation::none,      Activation::relu,
                                       Activation::gelu_erf,  Activation::gelu_tanh,
                                       Activation::squared_relu, Activation::silu};

CheckLine line(Device device, const std::string& what, const lb::Verdict& v) {
  return {"linear", device.is_cuda() ? "cuda" : "cpu", what, v.error, v.tolerance, v.pass};
}

// CPU: dx, dW, dbias of the float64 reference against central differences of sum(y * dout).
std::vector<CheckLine> check_cpu() {
  std::vector<CheckLine> out;
  auto rng = testing::make_rng(40);
  const Device cpu = Device::cpu();
  const std::int64_t m = 3, n = 4, k = 5;
  for (Activation act : kActivations) {
    Buffer x(DType::f64, cpu, {m, k}), w(DType::f64, cpu, {n, k}), b(DType::f64, cpu, {n});
    Buffer y(DType::f64, cpu, {m, n}), pre(DType::f64, cpu, {m, n}), dout(DType::f64, cpu, {m, n});
    Buffer dx(DType::f64, cpu, {m, k}), dw(DType::f64, cpu, {n, k}), db(DType::f64, cpu, {n});
    x.fill_normal(rng, 0.3, 1.0);
    w.fill_normal(rng, 0.0, 0.5);
    b.fill_normal(rng);
    dout.fill_normal(rng);
    linear_forward(x.view(), w.view(), b.view(), act, y.view(), pre.view(), std::nullopt);
    linear_backward(dout.view(), x.view(), w.view(), pre.view(), act, dx.view(), dw.view(), db.view(),
                    std::nullopt);
    auto fd_of = [&](Buffer& param) {
      return finite_difference_gradient(param, y, dout, 1e-6, [&] {
        linear_forward(x.view(), w.view(), b.view(), act, y.view(), std::nullopt, std::nullopt);
      });
    };
    const std::pair<const char*, std::pair<Buffer*, Buffer*>> grads[] = {
        {"dx", {&x, &dx}}, {"dW", {&w, &dw}}, {"dbias", {&b, &db}}};
    for (const auto& [name, pair] : grads) {
      const testing::ErrorStats s = testing::compare(pair.second->values(), fd_of(*pair.first));
      out.push_back({"linear", "cpu", fmt::format("{} {} vs finite diff.", name, activation_name(act)),
                     s.rel_l2, 1e-6, s.non_finite == 0 && s.rel_l2 <= 1e-6});
    }
  }
  return out;
}

std::vector<double> normal(std::mt19937_64& rng, std::int64_t count, double stddev, DType dtype) {
  std::normal_distribution<double> d(0.0, stddev);
  std::vector<double> v(static_cast<std::size_t>(count));
  for (auto& e : v) e = detail::round_to(dtype, d(rng));
  return v;
}

// GPU: forward (saving the pre-activation) and backward of one problem vs the float64 reference.
void check_gpu_problem(std::vector<CheckLine>& out, Device gpu, DType dt, Activation act,
                       std::int64_t m, std::int64_t n, std::int64_t k, std::mt19937_64& rng) {
  const Device cpu = Device::cpu();
  const auto xv = normal(rng, m * k, 1.0, dt), wv = normal(rng, n * k, 1.0 / std::sqrt(double(k)), dt);
  const auto bv = normal(rng, n, 0.5, dt), gv = normal(rng, m * n, 1.0, dt);
  // Float64 reference on the CPU.
  Buffer x64(DType::f64, cpu, {m, k}), w64(DType::f64, cpu, {n, k}), b64(DType::f64, cpu, {n});
  Buffer y64(DType::f64, cpu, {m, n}), p64(DType::f64, cpu, {m, n}), g64(DType::f64, cpu, {m, n});
  Buffer dx64(DType::f64, cpu, {m, k}), dw64(DType::f64, cpu, {n, k}), db64(DType::f64, cpu, {n});
  x64.set_values(xv);
  w64.set_values(wv);
  b64.set_values(bv);
  g64.set_values(gv);
  linear_forward(x64.view(), w64.view(), b64.view(), act, y64.view(), p64.view(), std::nullopt);
  // GPU in the dtype.
  Buffer x(dt, gpu, {m, k}), w(dt, gpu, {n, k}), b(dt, gpu, {n}), y(dt, gpu, {m, n}), pre(dt, gpu, {m, n});
  Buffer g(dt, gpu, {m, n}), dx(dt, gpu, {m, k}), dw(dt, gpu, {n, k}), db(dt, gpu, {n});
  x.set_values(xv);
  w.set_values(wv);
  b.set_values(bv);
  g.set_values(gv);
  Buffer wsf(DType::u8, gpu, {static_cast<std::int64_t>(linear_forward_workspace_size(m, n, k, dt, act, gpu))});
  Buffer wsb(DType::u8, gpu, {static_cast<std::int64_t>(linear_backward_workspace_size(m, n, k, dt, act, gpu))});
  linear_forward(x.view(), w.view(), b.view(), act, y.view(), pre.view(), wsf.view());
  linear_backward(g.view(), x.view(), w.view(), pre.view(), act, dx.view(), dw.view(), db.view(), wsb.view());
  // Backward reference from the GPU's own (rounded) pre-activation, as backward is given it.
  const auto pv = pre.values();
  p64.set_values(pv);
  linear_backward(g64.view(), x64.view(), w64.view(), p64.view(), act, dx64.view(), dw64.view(),
                  db64.view(), std::nullopt);
  const auto fb = lb::forward_baseline(xv, wv, bv, m, n, k, act, dt);
  const auto bb = lb::backward_baseline(gv, pv, xv, wv, m, n, k, act, dt);
  const std::string tag = fmt::format("{} {} ({},{},{})", activation_name(act), dtype_name(dt), m, k, n);
  out.push_back(line(gpu, "y " + tag, lb::judge(y.values(), y64.values(), fb.y, dt, "y")));
  out.push_back(line(gpu, "dx " + tag, lb::judge(dx.values(), dx64.values(), bb.dx, dt, "dx", m * n)));
  out.push_back(line(gpu, "dW " + tag, lb::judge(dw.values(), dw64.values(), bb.dw, dt, "dW", m * n)));
  out.push_back(line(gpu, "dbias " + tag, lb::judge(db.values(), db64.values(), bb.dbias, dt, "dbias", m * n)));
}

std::vector<CheckLine> check_linear(Device device) {
  if (!device.is_cuda()) return check_cpu();
  std::vector<CheckLine> out;
  auto rng = testing::make_rng(41);
  for (Activation act : kActivations) {
    check_gpu_problem(out, device, DType::bf16, act, 512, 768, 1024, rng);  // aligned: fused paths
    check_gpu_problem(out, device, DType::bf16, act, 333, 1001, 136, rng);  // odd N: unfused path
  }
  check_gpu_problem(out, device, DType::f16, Activation::silu, 256, 512, 384, rng);
  check_gpu_problem(out, device, DType::f32, Activation::gelu_erf, 128, 96, 200, rng);
  return out;
}

// ---- gated_linear ----------------------------------------------------------------------------

std::vector<CheckLine> check_gated_cpu() {
  std::vector<CheckLine> out;
  auto rng = testing::make_rng(42);
  const Device cpu = Device::cpu();
  const std::int64_t m = 3, f = 4, k = 5;
  for (GatedLayout layout : {GatedLayout::interleaved, GatedLayout::halves}) {
    const GatedLinearConfig config{Activation::silu, layout};
    Buffer x(DType::f64, cpu, {m, k}), w(DType::f64, cpu, {2 * f, k}), b(DType::f64, cpu, {2 * f});
    Buffer y(DType::f64, cpu, {m, f}), pre(DType::f64, cpu, {m, 2 * f}), dy(DType::f64, cpu, {m, f});
    Buffer dx(DType::f64, cpu, {m, k}), dw(DType::f64, cpu, {2 * f, k}), db(DType::f64, cpu, {2 * f});
    x.fill_normal(rng, 0.3, 1.0);
    w.fill_normal(rng, 0.0, 0.5);
    b.fill_normal(rng);
    dy.fill_normal(rng);
    gated_linear_forward(x.view(), w.view(), b.view(), config, y.view(), pre.view(), std::nullopt);
    gated_linear_backward(dy.view(), x.view(), w.view(), pre.view(), config, dx.view(), dw.view(), db.view(),
                          std::nullopt);
    const std::pair<const char*, std::pair<Buffer*, Buffer*>> grads[] = {
        {"dx", {&x, &dx}}, {"dW", {&w, &dw}}, {"dbias", {&b, &db}}};
    for (const auto& [name, pair] : grads) {
      const auto fd = finite_difference_gradient(*pair.first, y, dy, 1e-6, [&] {
        gated_linear_forward(x.view(), w.view(), b.view(), config, y.view(), std::nullopt, std::nullopt);
      });
      const testing::ErrorStats s = testing::compare(pair.second->values(), fd);
      out.push_back({"gated_linear", "cpu", fmt::format("{} silu {} vs finite diff.", name, gated_layout_name(layout)),
                     s.rel_l2, 1e-6, s.non_finite == 0 && s.rel_l2 <= 1e-6});
    }
  }
  return out;
}

// GPU: forward (saving pre) and backward of one problem vs the float64 reference; the baseline is
// PyTorch eager's F.linear then the gated activation, in the dtype.
void check_gated_problem(std::vector<CheckLine>& out, Device gpu, DType dt, GatedLayout layout, std::int64_t m,
                         std::int64_t f, std::int64_t k, std::mt19937_64& rng) {
  const Device cpu = Device::cpu();
  const GatedLinearConfig config{Activation::silu, layout};
  const std::int64_t n = 2 * f;
  const auto xv = normal(rng, m * k, 1.0, dt), wv = normal(rng, n * k, 1.0 / std::sqrt(double(k)), dt);
  const auto gv = normal(rng, m * f, 1.0, dt);
  Buffer x64(DType::f64, cpu, {m, k}), w64(DType::f64, cpu, {n, k}), y64(DType::f64, cpu, {m, f});
  Buffer p64(DType::f64, cpu, {m, n}), g64(DType::f64, cpu, {m, f}), dx64(DType::f64, cpu, {m, k});
  Buffer dw64(DType::f64, cpu, {n, k});
  x64.set_values(xv);
  w64.set_values(wv);
  g64.set_values(gv);
  gated_linear_forward(x64.view(), w64.view(), std::nullopt, config, y64.view(), p64.view(), std::nullopt);
  Buffer x(dt, gpu, {m, k}), w(dt, gpu, {n, k}), y(dt, gpu, {m, f}), pre(dt, gpu, {m, n}), g(dt, gpu, {m, f});
  Buffer dx(dt, gpu, {m, k}), dw(dt, gpu, {n, k});
  x.set_values(xv);
  w.set_values(wv);
  g.set_values(gv);
  Buffer wsf(DType::u8, gpu, {static_cast<std::int64_t>(gated_linear_forward_workspace_size(m, f, k, dt, config, true, gpu))});
  Buffer wsb(DType::u8, gpu, {static_cast<std::int64_t>(gated_linear_backward_workspace_size(m, f, k, dt, config, gpu))});
  gated_linear_forward(x.view(), w.view(), std::nullopt, config, y.view(), pre.view(), wsf.view());
  gated_linear_backward(g.view(), x.view(), w.view(), pre.view(), config, dx.view(), dw.view(), std::nullopt, wsb.view());
  const auto pv = pre.values();
  p64.set_values(pv);
  gated_linear_backward(g64.view(), x64.view(), w64.view(), p64.view(), config, dx64.view(), dw64.view(), std::nullopt,
                        std::nullopt);
  // Baselines: pre rounded from a float32 GEMM, y in float32 from it; dpre in float32, rounded.
  const auto fb = lb::forward_baseline(xv, wv, {}, m, n, k, Activation::none, dt);
  using MathF = detail::ActivationMath<float>;
  const auto gate = [&](std::int64_t j) { return layout == GatedLayout::interleaved ? 2 * j : j; };
  const auto up = [&](std::int64_t j) { return layout == GatedLayout::interleaved ? 2 * j + 1 : f + j; };
  std::vector<double> yb(static_cast<std::size_t>(m * f)), dpre(static_cast<std::size_t>(m * n));
  for (std::int64_t r = 0; r < m; ++r)
    for (std::int64_t j = 0; j < f; ++j) {
      const float gf = float(fb.pre[r * n + gate(j)]), uf = float(fb.pre[r * n + up(j)]);
      yb[r * f + j] = lb::round_f(dt, MathF::forward(Activation::silu, gf, 0.0f) * uf);
      const float gp = float(pv[r * n + gate(j)]), up_v = float(pv[r * n + up(j)]), d = float(gv[r * f + j]);
      dpre[r * n + gate(j)] = lb::round_f(dt, d * up_v * MathF::derivative(Activation::silu, gp, 0.0f));
      dpre[r * n + up(j)] = lb::round_f(dt, d * MathF::forward(Activation::silu, gp, 0.0f));
    }
  const auto bb = lb::backward_baseline(dpre, {}, xv, wv, m, n, k, Activation::none, dt);
  const std::string tag = fmt::format("silu {} {} ({},{},{})", gated_layout_name(layout), dtype_name(dt), m, k, f);
  const auto gl = [&](const std::string& what, const lb::Verdict& v) {
    return CheckLine{"gated_linear", "cuda", what, v.error, v.tolerance, v.pass};
  };
  out.push_back(gl("y " + tag, lb::judge(y.values(), y64.values(), yb, dt, "y")));
  out.push_back(gl("dx " + tag, lb::judge(dx.values(), dx64.values(), bb.dx, dt, "dx", m * n)));
  out.push_back(gl("dW " + tag, lb::judge(dw.values(), dw64.values(), bb.dw, dt, "dW", m * n)));
}

std::vector<CheckLine> check_gated_linear(Device device) {
  if (!device.is_cuda()) return check_gated_cpu();
  std::vector<CheckLine> out;
  auto rng = testing::make_rng(43);
  check_gated_problem(out, device, DType::bf16, GatedLayout::interleaved, 512, 704, 1024, rng);  // epilogue
  check_gated_problem(out, device, DType::bf16, GatedLayout::halves, 333, 250, 136, rng);        // separate
  return out;
}

}  // namespace

void add_linear_ops(std::vector<OpEntry>& ops) {
  ops.push_back({"gated_linear",
                 "y = act(gate) * up with [gate, up] = x W^T + b in one GEMM, forward/backward (dx, dW, "
                 "dbias); silu, gelu_tanh, gelu_erf, relu; W rows interleaved or in halves",
                 "f16, bf16 (f32 slower path; f64 CPU only)", {"cpu", "cuda"},
                 [](Device d) { return check_gated_linear(d); },
                 [](bench::Report& r, const std::string& only) { bench::bench_gated_linear(r, only); }});
  ops.push_back({"linear",
                 "y = act(x W^T + b), forward/backward (dx, dW, dbias); none, relu, gelu_erf, "
                 "gelu_tanh, squared_relu, silu",
                 "f16, bf16 (f32 slower path; f64 CPU only)", {"cpu", "cuda"},
                 [](Device d) { return check_linear(d); },
                 [](bench::Report& r, const std::string& only) { bench::bench_linear(r, only); }});
}

}  // namespace fusekit::cli
