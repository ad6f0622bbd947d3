// CLI entry for the linear family: `fusekit check linear` runs a few representative problems on
// the GPU against the float64 CPU reference with the test suite's rule (error at most twice that
// of a float32-accumulating computation in the same dtype, tests/linear/linear_baseline.h); on
// the CPU it checks the reference's gradients against central differences. bench runs
// bench/linear.
#include <fmt/format.h>

#include <cmath>
#include <optional>

#include "bench/linear/bench_linear.h"
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

}  // namespace

void add_linear_ops(std::vector<OpEntry>& ops) {
  ops.push_back({"linear",
                 "y = act(x W^T + b), forward/backward (dx, dW, dbias); none, relu, gelu_erf, "
                 "gelu_tanh, squared_relu, silu",
                 "f16, bf16 (f32 slower path; f64 CPU only)", {"cpu", "cuda"},
                 [](Device d) { return check_linear(d); },
                 [](bench::Report& r, const std::string& only) { bench::bench_linear(r, only); }});
}

}  // namespace fusekit::cli
