// Optimizer benchmarks over GPT-2 small's 148 parameter tensors (124M elements). Bytes counted as
// each tensor that must move once: global_norm reads the gradients; adamw_step reads params,
// grads, exp_avg, exp_avg_sq and writes params, exp_avg, exp_avg_sq and (where given) the copies.
// The "copy" rows move the same byte count with cudaMemcpy (half read, half written).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bench/harness/bench.h"
#include "bench/optim/bench_optim.h"
#include "fusekit/optim.h"

namespace fusekit::bench {

namespace {

constexpr std::int64_t kAlign = 256;  // bytes between tensors in one allocation

std::int64_t numel_of(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (std::int64_t s : shape) n *= s;
  return n;
}

// One list of tensors of `dtype` carved out of one allocation.
struct TensorList {
  DeviceBuffer storage;
  std::vector<TensorView> views;

  TensorList(const std::vector<std::vector<std::int64_t>>& shapes, DType dtype, std::uint64_t seed, float mean) {
    const auto size = static_cast<std::int64_t>(dtype_size(dtype));
    std::vector<std::int64_t> offsets;
    std::int64_t bytes = 0;
    for (const auto& shape : shapes) {
      offsets.push_back(bytes);
      bytes += (numel_of(shape) * size + kAlign - 1) / kAlign * kAlign;
    }
    storage = DeviceBuffer(static_cast<std::size_t>(bytes));
    if (dtype == DType::f32) storage.fill_random_f32(seed, mean, 0.1f);
    else storage.fill_random_bf16(seed, mean, 0.1f);
    const Device gpu = Device::cuda(0);
    for (std::size_t i = 0; i < shapes.size(); ++i)
      views.push_back(TensorView::from_arrays(static_cast<char*>(storage.get()) + offsets[i], dtype, gpu,
                                              static_cast<int>(shapes[i].size()), shapes[i].data(), nullptr));
  }
};

// One optimizer state: params, grads of each dtype the rows use, moments and bf16 copies.
struct State {
  TensorList params, grads_bf16, grads_f32, exp_avg, exp_avg_sq, copies;
  State(const std::vector<std::vector<std::int64_t>>& shapes, std::uint64_t seed)
      : params(shapes, DType::f32, seed, 0.0f), grads_bf16(shapes, DType::bf16, seed + 1, 0.0f),
        grads_f32(shapes, DType::f32, seed + 2, 0.0f), exp_avg(shapes, DType::f32, seed + 3, 0.0f),
        exp_avg_sq(shapes, DType::f32, seed + 4, 1.0f),  // mean 1, stddev 0.1: positive
        copies(shapes, DType::bf16, seed + 5, 0.0f) {}
};

}  // namespace

std::vector<std::vector<std::int64_t>> gpt2_small_parameter_shapes() {
  const std::int64_t vocab = 50257, positions = 1024, c = 768, layers = 12;
  std::vector<std::vector<std::int64_t>> shapes = {{vocab, c}, {positions, c}};
  for (std::int64_t l = 0; l < layers; ++l) {
    const std::vector<std::vector<std::int64_t>> block = {
        {c}, {c},                 // ln_1
        {3 * c, c}, {3 * c},      // attention qkv
        {c, c}, {c},              // attention projection
        {c}, {c},                 // ln_2
        {4 * c, c}, {4 * c},      // MLP up
        {c, 4 * c}, {c}};         // MLP down
    shapes.insert(shapes.end(), block.begin(), block.end());
  }
  shapes.push_back({c});  // ln_f
  shapes.push_back({c});
  return shapes;
}

void bench_optim(Report& report) {
  const Device gpu = Device::cuda(0);
  const auto shapes = gpt2_small_parameter_shapes();
  std::int64_t n = 0;
  for (const auto& s : shapes) n += numel_of(s);
  const std::string label = "gpt2-124M (" + std::to_string(shapes.size()) + " tensors)";
  const double elems = static_cast<double>(n);
  const std::size_t state_bytes = static_cast<std::size_t>(n) * (4 + 2 + 4 + 4 + 4 + 2);
  const int rotations = rotations_for(state_bytes);
  std::vector<State> states;
  for (int r = 0; r < rotations; ++r) states.emplace_back(shapes, 800 + 10 * static_cast<std::uint64_t>(r));

  DeviceBuffer norm(sizeof(float));
  const TensorView norm_view(norm.get(), DType::f32, gpu, {1});
  const std::size_t ws_bytes = global_norm_workspace_size(states[0].grads_bf16.views, gpu);
  DeviceBuffer ws(ws_bytes);
  const TensorView ws_view(ws.get(), DType::u8, gpu, {static_cast<std::int64_t>(ws_bytes)});

  // The copy ceiling at the rows' byte counts: two buffers copied back and forth.
  const std::size_t adamw_bytes = static_cast<std::size_t>(n) * 28;  // bf16 grads and copies; f32 grads, none
  DeviceBuffer copy_a(adamw_bytes / 2), copy_b(adamw_bytes / 2);
  auto copy_row = [&](const char* op, const char* direction, std::size_t bytes) {
    const Timing t = time_same_size_copy(
        bytes / 2, 2, [&](int r) { return r ? copy_a.get() : copy_b.get(); },
        [&](int r) { return r ? copy_b.get() : copy_a.get(); });
    report.add({op, direction, label, "copy", t.median_us, static_cast<double>(bytes)});
  };

  copy_row("global_norm", "bf16", static_cast<std::size_t>(n) * 2);
  const Timing tn = time_kernel([&](int r) { global_norm(states[r].grads_bf16.views, norm_view, ws_view); }, rotations);
  report.add({"global_norm", "bf16", label, "fusekit", tn.median_us, 2.0 * elems});

  copy_row("adamw_step", "bf16 grads, bf16 copies", adamw_bytes);
  AdamWConfig config;
  config.weight_decay = 0.1f;
  config.step = 10;
  const Timing ta = time_kernel(
      [&](int r) {
        const State& s = states[r];
        adamw_step(s.params.views, s.grads_bf16.views, s.exp_avg.views, s.exp_avg_sq.views, s.copies.views, config,
                   std::nullopt);
      },
      rotations);
  report.add({"adamw_step", "bf16 grads, bf16 copies", label, "fusekit", ta.median_us, 28.0 * elems});
  const Timing tf = time_kernel(
      [&](int r) {
        const State& s = states[r];
        adamw_step(s.params.views, s.grads_f32.views, s.exp_avg.views, s.exp_avg_sq.views, {}, config, std::nullopt);
      },
      rotations);
  report.add({"adamw_step", "f32 grads", label, "fusekit", tf.median_us, 28.0 * elems});
  // Clipping: the norm, then the step reading it (the training step's pair), timed together.
  AdamWConfig clipped = config;
  clipped.max_grad_norm = 1.0f;
  const Timing tc = time_kernel(
      [&](int r) {
        const State& s = states[r];
        global_norm(s.grads_bf16.views, norm_view, ws_view);
        adamw_step(s.params.views, s.grads_bf16.views, s.exp_avg.views, s.exp_avg_sq.views, s.copies.views, clipped,
                   norm_view);
      },
      rotations);
  report.add({"adamw_step", "global_norm + clipped step", label, "fusekit", tc.median_us, 30.0 * elems});
}

}  // namespace fusekit::bench
