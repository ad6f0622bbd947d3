// Bias + activation + dropout benchmarks: bf16, p = 0.1, gelu_tanh and relu, forward and
// backward. Bytes counted as the issue asks, each tensor that must move once: forward reads x and
// the bias and writes y; backward reads dy, x and the bias and writes dx and dbias. The dbias
// partial rows (a few MB of scratch) are not counted: they are fusekit's overhead.
#include <fmt/format.h>

#include <cstdlib>
#include <utility>
#include <vector>

#include "bench/bias_act_dropout/bench_bias_act_dropout.h"
#include "bench/harness/bench.h"
#include "fusekit/bias_act_dropout.h"

namespace fusekit::bench {

namespace {

struct Set {
  DeviceBuffer x, y, dy, dx;
};

}  // namespace

const std::vector<std::pair<std::int64_t, std::int64_t>>& dropout_bench_shapes() {
  static const std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {
      {16384, 4096}, {8192, 16384}, {32768, 1024}, {16384, 5120}};
  return shapes;
}

void bench_dropout(Report& report) {
  const Device gpu = Device::cuda(0);
  constexpr float kP = 0.1f;
  for (auto [rows, cols] : selected_shapes(dropout_bench_shapes())) {
    const auto [elems, bytes, ld, alloc] = bf16_row_tensors(rows, cols);  // x, y, dy, dx
    const int rotations = rotations_for(2 * alloc);
    std::vector<Set> sets(rotations);
    for (int r = 0; r < rotations; ++r) {
      sets[r] = {DeviceBuffer(alloc), DeviceBuffer(alloc), DeviceBuffer(alloc), DeviceBuffer(alloc)};
      sets[r].x.fill_random_bf16(300 + r);
      sets[r].dy.fill_random_bf16(400 + r);
    }
    DeviceBuffer b(cols * 2), db(cols * 2);
    b.fill_random_bf16(9, 0.0f, 0.5f);
    const std::size_t ws_bytes = bias_act_dropout_backward_workspace_size(rows, cols, DType::bf16, gpu);
    DeviceBuffer ws(ws_bytes);
    const TensorView workspace(ws.get(), DType::u8, gpu, {static_cast<std::int64_t>(ws_bytes)});
    auto t2 = [&](const DeviceBuffer& buf) { return TensorView(buf.get(), DType::bf16, gpu, {rows, cols}, {ld, 1}); };
    auto vec = [&](const DeviceBuffer& buf) { return TensorView(buf.get(), DType::bf16, gpu, {cols}); };

    // The forward's bytes as one memcpy (impl "copy").
    const Timing tc = time_same_size_copy(
        bytes, rotations, [&](int r) { return sets[r].y.get(); }, [&](int r) { return sets[r].x.get(); });
    report.add({"bias_act_dropout", "fwd", padded_shape_label(rows, cols), "copy", tc.median_us,
                2.0 * bytes});
    // --diagnostics: forwards that leave out parts of the work (no activation; no
    // dropout, p = 0, which skips the Philox calls), to see what each part of the relu forward
    // costs against the same-size copy.
    if (options().diagnostics) {
      const std::pair<const char*, BiasActDropoutConfig> parts[] = {
          {"fwd-none", {Activation::none, 0.0f, kP, 0x5eed, 17}},
          {"fwd-p0", {Activation::relu, 0.0f, 0.0f, 0x5eed, 17}},
          {"fwd-none-p0", {Activation::none, 0.0f, 0.0f, 0x5eed, 17}}};
      for (const auto& [label, config] : parts) {
        const Timing t = time_kernel(
            [&](int r) { bias_act_dropout_forward(t2(sets[r].x), vec(b), config, t2(sets[r].y)); }, rotations);
        report.add({"bias_act_dropout", label, padded_shape_label(rows, cols), "fusekit", t.median_us,
                    4.0 * elems + 2.0 * cols});
      }
    }
    for (Activation act : {Activation::gelu_tanh, Activation::relu}) {
      const BiasActDropoutConfig config{act, 0.0f, kP, 0x5eed, 17};
      const std::string shape = padded_shape_label(rows, cols) + " " + activation_name(act);
      const Timing tf = time_kernel(
          [&](int r) { bias_act_dropout_forward(t2(sets[r].x), vec(b), config, t2(sets[r].y)); }, rotations);
      report.add({"bias_act_dropout", "fwd", shape, "fusekit", tf.median_us,
                  4.0 * elems + 2.0 * cols});
      const Timing tb = time_kernel(
          [&](int r) {
            bias_act_dropout_backward(t2(sets[r].dy), t2(sets[r].x), vec(b), config, t2(sets[r].dx), vec(db),
                                      workspace);
          },
          rotations);
      report.add({"bias_act_dropout", "bwd", shape, "fusekit", tb.median_us,
                  6.0 * elems + 4.0 * cols});
    }
  }
}

}  // namespace fusekit::bench
