// CLI entry for the optimizer family: `fusekit check` compares global_norm and a few adamw_step
// steps (mixed gradient dtypes, bf16 copies, clipping) against the CPU reference with the test
// suite's tolerance rule; on the CPU it checks the reference's first step against its closed form.
// bench runs bench/optim.
#include <fmt/format.h>

#include <cmath>
#include <optional>
#include <vector>

#include "bench/optim/bench_optim.h"
#include "fusekit/optim.h"
#include "tests/harness/harness.h"
#include "tools/cli/ops.h"

namespace fusekit::cli {
namespace {

using testing::Buffer;
constexpr const char* kOp = "optim";

// Step 1 from zero moments: p1 = p0 (1 - lr wd) - lr g / (|g| + eps).
std::vector<CheckLine> check_cpu() {
  auto rng = testing::make_rng(70);
  const Device cpu = Device::cpu();
  const std::int64_t n = 1000;
  Buffer p(DType::f32, cpu, {n}), g(DType::f32, cpu, {n}), m(DType::f32, cpu, {n}), v(DType::f32, cpu, {n});
  p.fill_normal(rng);
  g.fill_normal(rng);
  m.set_values(std::vector<double>(n, 0.0));
  v.set_values(std::vector<double>(n, 0.0));
  AdamWConfig config;
  config.lr = 1e-2f;
  config.weight_decay = 0.1f;
  const std::vector<double> p0 = p.values(), g0 = g.values();
  std::vector<double> want(p0.size());
  for (std::size_t i = 0; i < want.size(); ++i)
    want[i] = p0[i] * (1.0 - double(config.lr) * double(config.weight_decay)) -
              double(config.lr) * g0[i] / (std::abs(g0[i]) + double(config.eps));
  const TensorView pv = p.view(), gv = g.view(), mv = m.view(), vv = v.view();
  adamw_step({&pv, 1}, {&gv, 1}, {&mv, 1}, {&vv, 1}, {}, config, std::nullopt);
  return {compared_line(kOp, cpu, "adamw_step first step vs closed form", p.values(), want, DType::f32)};
}

std::vector<CheckLine> check_gpu(Device device) {
  struct Spec {
    std::int64_t numel;
    DType grad;
  };
  const std::vector<Spec> specs = {{1, DType::f32}, {7, DType::bf16}, {1000003, DType::bf16},
                                   {50000, DType::f16}, {16389, DType::f32}};
  auto rng = testing::make_rng(71);
  std::vector<std::vector<double>> p0, g0, m0, v0;
  for (const Spec& s : specs) {
    Buffer b(DType::f32, Device::cpu(), {s.numel});
    b.fill_normal(rng);
    p0.push_back(b.values());
    Buffer g(s.grad, Device::cpu(), {s.numel});
    g.fill_normal(rng, 0.0, 0.5);
    g0.push_back(g.values());
    b.fill_normal(rng, 0.0, 0.1);
    m0.push_back(b.values());
    b.fill_normal(rng, 0.0, 0.1);
    std::vector<double> sq = b.values();
    for (double& x : sq) x *= x;
    v0.push_back(sq);
  }
  struct Outputs {
    std::vector<std::vector<double>> p, c;
    std::vector<double> norm;
  };
  auto run = [&](Device d) {
    std::vector<Buffer> p, g, m, v, c;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      p.emplace_back(DType::f32, d, std::vector<std::int64_t>{specs[i].numel});
      g.emplace_back(specs[i].grad, d, std::vector<std::int64_t>{specs[i].numel});
      m.emplace_back(DType::f32, d, std::vector<std::int64_t>{specs[i].numel});
      v.emplace_back(DType::f32, d, std::vector<std::int64_t>{specs[i].numel});
      c.emplace_back(DType::bf16, d, std::vector<std::int64_t>{specs[i].numel});
      p[i].set_values(p0[i]);
      g[i].set_values(g0[i]);
      m[i].set_values(m0[i]);
      v[i].set_values(v0[i]);
      c[i].poison();
    }
    auto views = [](const std::vector<Buffer>& list) {
      std::vector<TensorView> out;
      for (const Buffer& b : list) out.push_back(b.view());
      return out;
    };
    Buffer norm(DType::f32, d, {1});
    norm.poison();
    const std::size_t ws_bytes = global_norm_workspace_size(views(g), d);
    std::optional<Buffer> ws;
    if (ws_bytes > 0) ws.emplace(DType::u8, d, std::vector<std::int64_t>{static_cast<std::int64_t>(ws_bytes)});
    global_norm(views(g), norm.view(), ws ? OptionalTensor(ws->view()) : std::nullopt);
    AdamWConfig config;
    config.weight_decay = 0.1f;
    config.max_grad_norm = 100.0f;  // about a fifth of the norm (~500): clipping active
    for (std::int64_t step = 1; step <= 3; ++step) {
      config.step = step;
      adamw_step(views(p), views(g), views(m), views(v), views(c), config, norm.view());
    }
    Outputs out;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      out.p.push_back(p[i].values());
      out.c.push_back(c[i].values());
    }
    out.norm = norm.values();
    return out;
  };
  const Outputs ref = run(Device::cpu()), got = run(device);
  std::vector<CheckLine> out = {compared_line(kOp, device, "global_norm (5 tensors, mixed dtypes)", got.norm, ref.norm,
                                              DType::f32)};
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const std::string tag = fmt::format("[{}] ({}, {} grads)", i, specs[i].numel, dtype_name(specs[i].grad));
    out.push_back(compared_line(kOp, device, "adamw_step x3 params" + tag, got.p[i], ref.p[i], DType::f32));
    out.push_back(compared_line(kOp, device, "adamw_step x3 bf16 copies" + tag, got.c[i], ref.c[i], DType::bf16));
  }
  return out;
}

}  // namespace

void add_optim_ops(std::vector<OpEntry>& ops) {
  ops.push_back({kOp,
                 "optimizer: global_norm (deterministic L2 norm over a tensor list, result in device memory) and "
                 "adamw_step (multi-tensor AdamW, clipping by the device norm, low-precision param copies)",
                 "params and moments f32; grads f32, f16, bf16; copies f32, f16, bf16", {"cpu", "cuda"},
                 [](Device d) { return d.is_cuda() ? check_gpu(d) : check_cpu(); },
                 [](bench::Report& r, const std::string&) { bench::bench_optim(r); }});
}

}  // namespace fusekit::cli
