// FP8 RMSNorm benchmarks: e4m3 in and out, groups of 16 with bf16 scales, bf16 weight, on the
// issue's shapes. Bytes counted as the issue does: forward reads fp8 x and its scales twice and
// writes qy and qy_t once (2 * (1 + 2/16) + 1 + 1 = 4.25 bytes per element); backward reads x,
// its scales and bf16 dy once and writes bf16 dx once (1 + 2/16 + 2 + 2 = 5.125 bytes per
// element). rstd, the weight and its gradient are per row / per column and not counted.
#include <fmt/format.h>

#include <cstdlib>
#include <optional>
#include <vector>

#include "bench/fp8_norm/bench_fp8_norm.h"
#include "bench/harness/bench.h"
#include "fusekit/fp8_norm.h"

namespace fusekit::bench {

namespace {

constexpr int kGroup = 16;

struct Set {
  DeviceBuffer x, scales, qy, qy_t, rstd, dy, dx;
};

}  // namespace

const std::vector<std::pair<std::int64_t, std::int64_t>>& fp8_norm_bench_shapes() {
  static const std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {
      {16384, 4096}, {8192, 8192}, {32768, 2048}};
  return shapes;
}

void bench_fp8_norm(Report& report) {
  const Device gpu = Device::cuda(0);
  const std::int64_t pad = row_pad_elements();
  for (auto [rows, cols] : selected_shapes(fp8_norm_bench_shapes())) {
    const std::size_t elems = std::size_t(rows) * cols, groups = elems / kGroup;
    // Row strides of x, qy, dy and dx (elements); the scales and qy_t stay packed.
    const std::int64_t ld = cols + pad;
    const std::size_t padded = std::size_t(rows) * ld;
    // Working set of one call (the larger of the two directions): x, scales, dy, dx, qy, qy_t.
    const int rotations = rotations_for(padded * (1 + 2 + 2 + 1) + elems + groups * 2);
    std::vector<Set> sets(rotations);
    for (int r = 0; r < rotations; ++r) {
      sets[r] = {DeviceBuffer(padded), DeviceBuffer(groups * 2), DeviceBuffer(padded), DeviceBuffer(elems),
                 DeviceBuffer(rows * 4), DeviceBuffer(padded * 2), DeviceBuffer(padded * 2)};
      fill_fp8_norm_inputs(sets[r].x.get(), padded, sets[r].scales.get(), groups, 300 + r);
      sets[r].dy.fill_random_bf16(400 + r);
    }
    DeviceBuffer w(cols * 2), dw(cols * 2), y_scale(16);
    w.fill_random_bf16(9, 1.0f, 0.5f);
    const std::size_t fws = fp8_rms_norm_forward_workspace_size(rows, cols, gpu);
    const std::size_t bws = fp8_rms_norm_backward_workspace_size(rows, cols, gpu);
    DeviceBuffer fw(fws), bw(bws);
    const TensorView weight(w.get(), DType::bf16, gpu, {cols}), dweight(dw.get(), DType::bf16, gpu, {cols});
    const TensorView scale(y_scale.get(), DType::f32, gpu, {1});
    const TensorView fwork(fw.get(), DType::u8, gpu, {static_cast<std::int64_t>(fws)});
    const TensorView bwork(bw.get(), DType::u8, gpu, {static_cast<std::int64_t>(bws)});

    auto forward = [&](int r) {
      const Set& s = sets[r];
      fp8_rms_norm_forward(TensorView(s.x.get(), DType::f8e4m3, gpu, {rows, cols}, {ld, 1}),
                           TensorView(s.scales.get(), DType::bf16, gpu, {rows, cols / kGroup}), weight, 1e-5f,
                           TensorView(s.qy.get(), DType::f8e4m3, gpu, {rows, cols}, {ld, 1}),
                           TensorView(s.qy_t.get(), DType::f8e4m3, gpu, {cols, rows}), scale,
                           TensorView(s.rstd.get(), DType::f32, gpu, {rows}), std::nullopt, fwork, kGroup);
    };
    // with_dweight false: dx alone (a diagnostic; the dweight partial rows and their reduction
    // cost the difference).
    auto backward = [&](int r, bool with_dweight) {
      const Set& s = sets[r];
      fp8_rms_norm_backward(TensorView(s.dy.get(), DType::bf16, gpu, {rows, cols}, {ld, 1}),
                            TensorView(s.x.get(), DType::f8e4m3, gpu, {rows, cols}, {ld, 1}),
                            TensorView(s.scales.get(), DType::bf16, gpu, {rows, cols / kGroup}), weight,
                            TensorView(s.rstd.get(), DType::f32, gpu, {rows}),
                            TensorView(s.dx.get(), DType::bf16, gpu, {rows, cols}, {ld, 1}),
                            with_dweight ? OptionalTensor(dweight) : std::nullopt,
                            with_dweight ? OptionalTensor(bwork) : std::nullopt, kGroup);
    };
    for (int r = 0; r < rotations; ++r) forward(r);  // saved rstd for backward
    const std::string shape = padded_shape_label(rows, cols);
    const Timing tf = time_kernel(forward, rotations);
    report.add({"fp8_rms_norm", "fwd", shape, "fusekit", tf.median_us, 4.25 * elems});
    const Timing tb = time_kernel([&](int r) { backward(r, true); }, rotations);
    report.add({"fp8_rms_norm", "bwd", shape, "fusekit", tb.median_us, 5.125 * elems});
    if (options().diagnostics) {
      const Timing td = time_kernel([&](int r) { backward(r, false); }, rotations);
      report.add({"fp8_rms_norm", "bwd-dx", shape, "fusekit", td.median_us, 5.125 * elems});
    }
  }
}

}  // namespace fusekit::bench
