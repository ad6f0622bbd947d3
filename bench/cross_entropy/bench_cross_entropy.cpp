// Cross-entropy benchmarks: bf16 logits, int64 targets, reduction mean, no ignored rows. Bytes
// counted as each tensor that must move once: the forward reads the logits and the targets and
// writes lse; the backward reads the logits, the targets and lse and writes dlogits; the fused call
// (in place, the training step's usual form) reads the logits and the targets and writes dlogits
// and lse. Its second sweep over each row (from L2) is not counted: it is fusekit's overhead. The
// "copy" row moves the fused call's logits bytes with cudaMemcpy (read once, written once).
#include <cuda_runtime.h>

#include <random>
#include <vector>

#include "bench/cross_entropy/bench_cross_entropy.h"
#include "bench/harness/bench.h"
#include "fusekit/cross_entropy.h"

namespace fusekit::bench {

namespace {

struct Set {
  DeviceBuffer logits, dlogits;
};

}  // namespace

const std::vector<std::pair<std::int64_t, std::int64_t>>& cross_entropy_bench_shapes() {
  static const std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {
      {8192, 32000},  {8192, 50257},  {8192, 128256},  {8192, 151936},  {8192, 262144},
      {16384, 32000}, {16384, 50257}, {16384, 128256}, {16384, 151936}, {16384, 262144}};
  return shapes;
}

void bench_cross_entropy(Report& report) {
  const Device gpu = Device::cuda(0);
  const CrossEntropyConfig config;  // reduction mean, ignore_index -100
  for (auto [rows, cols] : selected_shapes(cross_entropy_bench_shapes())) {
    const auto [elems, bytes, ld, alloc] = bf16_row_tensors(rows, cols);
    (void)elems;
    const int rotations = rotations_for(alloc);
    std::vector<Set> sets(rotations);
    for (int r = 0; r < rotations; ++r) {
      sets[r] = {DeviceBuffer(alloc), DeviceBuffer(alloc)};
      sets[r].logits.fill_random_bf16(700 + r, 0.0f, 2.0f);
    }
    std::vector<std::int64_t> host_targets(rows);
    std::mt19937_64 rng(12345);
    for (auto& t : host_targets) t = static_cast<std::int64_t>(rng() % cols);
    DeviceBuffer targets(rows * sizeof(std::int64_t)), lse(rows * sizeof(float)), loss(sizeof(float)),
        dloss(sizeof(float));
    cuda_check(cudaMemcpy(targets.get(), host_targets.data(), targets.bytes(), cudaMemcpyHostToDevice), "targets");
    const float one = 1.0f;
    cuda_check(cudaMemcpy(dloss.get(), &one, sizeof one, cudaMemcpyHostToDevice), "dloss");
    const std::size_t ws_bytes = cross_entropy_workspace_size(rows, cols, config.reduction, gpu);
    DeviceBuffer ws(ws_bytes);

    auto logits = [&](const DeviceBuffer& b) { return TensorView(b.get(), DType::bf16, gpu, {rows, cols}, {ld, 1}); };
    const TensorView t(targets.get(), DType::i64, gpu, {rows}), l(loss.get(), DType::f32, gpu, {}),
        s(lse.get(), DType::f32, gpu, {rows}), g(dloss.get(), DType::f32, gpu, {}),
        w(ws.get(), DType::u8, gpu, {static_cast<std::int64_t>(ws_bytes)});
    const double per_row = 12.0 * rows;  // an int64 target and a float lse per row
    const std::string shape = padded_shape_label(rows, cols);

    const Timing tc = time_same_size_copy(
        bytes, rotations, [&](int r) { return sets[r].dlogits.get(); }, [&](int r) { return sets[r].logits.get(); });
    report.add({"cross_entropy", "fwd+bwd", shape, "copy", tc.median_us, 2.0 * bytes});
    const Timing tf = time_kernel([&](int r) { cross_entropy_forward(logits(sets[r].logits), t, config, l, s, w); },
                                  rotations);
    report.add({"cross_entropy", "fwd", shape, "fusekit", tf.median_us, bytes + per_row});
    const Timing tb = time_kernel(
        [&](int r) { cross_entropy_backward(g, logits(sets[r].logits), t, s, config, logits(sets[r].dlogits), w); },
        rotations);
    report.add({"cross_entropy", "bwd", shape, "fusekit", tb.median_us, 2.0 * bytes + per_row});
    // In place: each call overwrites its logits with their gradient, which the next call on that
    // buffer reads as logits (values of the same magnitude; the timing does not depend on them).
    const Timing tfb = time_kernel(
        [&](int r) {
          cross_entropy_forward_backward(logits(sets[r].logits), t, config, l, logits(sets[r].logits), s, w);
        },
        rotations);
    report.add({"cross_entropy", "fwd+bwd", shape, "fusekit", tfb.median_us, 2.0 * bytes + per_row});
    if (options().diagnostics) {  // the fused call writing a separate dlogits
      const Timing to = time_kernel(
          [&](int r) {
            cross_entropy_forward_backward(logits(sets[r].logits), t, config, l, logits(sets[r].dlogits), s, w);
          },
          rotations);
      report.add({"cross_entropy", "fwd+bwd-out-of-place", shape, "fusekit", to.median_us, 2.0 * bytes + per_row});
    }
  }
}

}  // namespace fusekit::bench
