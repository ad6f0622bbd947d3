// CLI entry for the gated activations: `fusekit check` compares representative problems (each input
// form, every activation) against the CPU reference with the test suite's tolerance rule; on the CPU
// it checks the reference's dgate and dup against central differences. bench runs bench/gated_act.
#include <fmt/format.h>

#include <string>
#include <tuple>
#include <vector>

#include "bench/gated_act/bench_gated_act.h"
#include "fusekit/gated_act.h"
#include "tests/harness/harness.h"
#include "tools/cli/ops.h"

namespace fusekit::cli {
namespace {

using testing::Buffer;
constexpr const char* kOp = "gated_act";

CheckLine line(Device device, const std::string& what, const std::vector<double>& got,
               const std::vector<double>& ref, DType dtype) {
  return compared_line(kOp, device, what, got, ref, dtype);
}

// The CPU reference's gradients against central differences of sum(y * dy).
std::vector<CheckLine> check_cpu() {
  auto rng = testing::make_rng(50);
  const Device cpu = Device::cpu();
  const std::int64_t rows = 3, cols = 16;
  const GatedActConfig config{Activation::silu, GatedLayout::halves, false};
  Buffer gate(DType::f32, cpu, {rows, cols}), up(DType::f32, cpu, {rows, cols}), y(DType::f32, cpu, {rows, cols}),
      dy(DType::f32, cpu, {rows, cols}), dgate(DType::f32, cpu, {rows, cols}), dup(DType::f32, cpu, {rows, cols});
  gate.fill_normal(rng, 0.0, 1.5);
  up.fill_normal(rng);
  dy.fill_normal(rng);
  gated_act_backward_separate(dy.view(), gate.view(), up.view(), config, dgate.view(), dup.view());
  std::vector<CheckLine> out;
  for (auto [param, grad, name] : {std::tuple{&gate, &dgate, "dgate"}, std::tuple{&up, &dup, "dup"}}) {
    const std::vector<double> fd = finite_difference_gradient(
        *param, y, dy, 1e-2, [&] { gated_act_forward_separate(gate.view(), up.view(), config, y.view()); });
    const testing::ErrorStats s = testing::compare(grad->values(), fd);
    out.push_back({kOp, "cpu", std::string(name) + " vs finite differences", s.rel_l2, 1e-3, s.rel_l2 <= 1e-3});
  }
  return out;
}

std::vector<CheckLine> check_gpu(Device device) {
  std::vector<CheckLine> out;
  auto rng = testing::make_rng(51);
  const std::int64_t rows = 512;
  for (DType dt : {DType::bf16, DType::f32})
    for (std::int64_t cols : {1024, 5632, 1000})
      for (Activation act : {Activation::silu, Activation::gelu_tanh, Activation::gelu_erf, Activation::relu})
        for (GatedLayout layout : {GatedLayout::halves, GatedLayout::interleaved}) {
          const GatedActConfig config{act, layout, false};
          // 0 gate_up, 1 y, 2 dy, 3 dgate_up on each device.
          std::vector<Buffer> cpu, gpu;
          for (Device d : {Device::cpu(), device}) {
            auto& v = d.is_cuda() ? gpu : cpu;
            v.emplace_back(dt, d, std::vector<std::int64_t>{rows, 2 * cols});
            v.emplace_back(dt, d, std::vector<std::int64_t>{rows, cols});
            v.emplace_back(dt, d, std::vector<std::int64_t>{rows, cols});
            v.emplace_back(dt, d, std::vector<std::int64_t>{rows, 2 * cols});
          }
          cpu[0].fill_normal(rng, 0.0, 1.5);
          cpu[2].fill_normal(rng);
          for (int i : {0, 2}) gpu[i].set_values(cpu[i].values());
          for (auto* v : {&cpu, &gpu}) {
            auto& b = *v;
            gated_act_forward(b[0].view(), config, b[1].view());
            gated_act_backward(b[2].view(), b[0].view(), config, b[3].view());
          }
          const std::string tag = fmt::format("{} {} {} ({}, {})", activation_name(act), gated_layout_name(layout),
                                              dtype_name(dt), rows, cols);
          out.push_back(line(device, "y " + tag, gpu[1].values(), cpu[1].values(), dt));
          out.push_back(line(device, "dgate_up " + tag, gpu[3].values(), cpu[3].values(), dt));
        }
  return out;
}

}  // namespace

void add_gated_act_ops(std::vector<OpEntry>& ops) {
  ops.push_back({kOp,
                 "y = act(gate) * up (SwiGLU, GeGLU, ReGLU) fwd/bwd in one pass each; gate and up as one (M, 2F) "
                 "tensor (halves or interleaved) or two tensors; in-place backward",
                 "f32, f16, bf16", {"cpu", "cuda"},
                 [](Device d) { return d.is_cuda() ? check_gpu(d) : check_cpu(); },
                 [](bench::Report& r, const std::string&) { bench::bench_gated_act(r); }});
}

}  // namespace fusekit::cli
