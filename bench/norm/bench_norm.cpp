// LayerNorm / RMSNorm benchmarks: bf16, forward and backward, on the shapes plus two
// with N not a power of two. Bytes counted as in shared/anchors: forward reads x and writes y
// (2 x 2 bytes per element), backward reads dy and x and writes dx (3 x 2 bytes per element).
// The residual variants move two more row tensors each way: the forward reads x and residual and
// writes y and sum, the backward reads dy, sum and dsum and writes dx (4 x 2 bytes per element).
#include <fmt/format.h>

#include <cstdlib>
#include <stdexcept>
#include <optional>
#include <vector>

#include "bench/harness/bench.h"
#include "bench/norm/bench_norm.h"
#include "fusekit/norm.h"

namespace fusekit::bench {

namespace {

struct Set {
  DeviceBuffer x, y, dy, dx, mean, rstd;
  DeviceBuffer residual, sum, dsum;  // the residual variants only
};

}  // namespace

const std::vector<std::pair<std::int64_t, std::int64_t>>& norm_bench_shapes() {
  static const std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {
      {16384, 1024}, {16384, 4096}, {8192, 8192}, {4096, 16384}, {32768, 2048},
      {16384, 5120}, {8192, 12288}};
  return shapes;
}

void bench_norm(Report& report, const std::string& only) {
  const Device gpu = Device::cuda(0);
  const std::vector<std::pair<std::int64_t, std::int64_t>> shapes = selected_shapes(norm_bench_shapes());
  // layer_norm, rms_norm, then their residual variants.
  for (int variant = 0; variant < 4; ++variant) {
    const bool residual = variant >= 2, rms = variant % 2 == 1;
    const std::string op = std::string(rms ? "rms_norm" : "layer_norm") + (residual ? "_residual" : "");
    if (!only.empty() && only != op && only != "norm") continue;
    for (auto [rows, cols] : shapes) {
      RowTensors layout = bf16_row_tensors(rows, cols);  // x, y, dy, dx
      if (cols % 8 != 0) {
        // N off the 16-byte vector (--shapes): rows 16-byte aligned (stride rounded up to 8
        // elements), which the row kernels' masked last vector needs; packed rows of such N start
        // misaligned and take the generic kernels.
        layout.ld = (layout.ld + 7) / 8 * 8;
        layout.alloc = std::size_t(rows) * layout.ld * 2;
      }
      const auto [elems, bytes, ld, alloc] = layout;
      // Row tensors the forward moves (x, y; residual, sum) and the backward (dy, x, dx; sum, dsum).
      const int fwd_tensors = residual ? 4 : 2, bwd_tensors = residual ? 4 : 3;
      const int rotations = rotations_for(fwd_tensors * alloc);
      std::vector<Set> sets(rotations);
      for (int r = 0; r < rotations; ++r) {
        for (DeviceBuffer* b : {&sets[r].x, &sets[r].y, &sets[r].dy, &sets[r].dx}) *b = DeviceBuffer(alloc);
        sets[r].mean = DeviceBuffer(rows * 4);
        sets[r].rstd = DeviceBuffer(rows * 4);
        sets[r].x.fill_random_bf16(100 + r, 0.3f, 2.0f);
        sets[r].dy.fill_random_bf16(200 + r);
        if (residual) {
          sets[r].residual = DeviceBuffer(alloc);
          sets[r].sum = DeviceBuffer(alloc);
          sets[r].dsum = DeviceBuffer(alloc);
          sets[r].residual.fill_random_bf16(300 + r);
          sets[r].dsum.fill_random_bf16(400 + r);
        }
      }
      DeviceBuffer w(cols * 2), b(cols * 2), dw(cols * 2), db(cols * 2);
      w.fill_random_bf16(7, 1.0f, 0.5f);
      b.fill_random_bf16(8);
      const std::size_t ws_bytes = norm_backward_workspace_size(rows, cols, DType::bf16, gpu);
      DeviceBuffer ws(ws_bytes);
      auto t2 = [&](const DeviceBuffer& buf) {
        return TensorView(buf.get(), DType::bf16, gpu, {rows, cols}, {ld, 1});
      };
      auto vec = [&](const DeviceBuffer& buf) { return TensorView(buf.get(), DType::bf16, gpu, {cols}); };
      auto stat = [&](const DeviceBuffer& buf) { return TensorView(buf.get(), DType::f32, gpu, {rows}); };
      const TensorView workspace(ws.get(), DType::u8, gpu, {static_cast<std::int64_t>(ws_bytes)});

      auto forward = [&](int r) {
        Set& s = sets[r];
        if (residual) {
          if (rms) rms_norm_residual_forward(t2(s.x), t2(s.residual), vec(w), 1e-5f, t2(s.y), t2(s.sum), stat(s.rstd));
          else layer_norm_residual_forward(t2(s.x), t2(s.residual), vec(w), vec(b), 1e-5f, t2(s.y), t2(s.sum),
                                           stat(s.mean), stat(s.rstd));
        } else if (rms) {
          rms_norm_forward(t2(s.x), vec(w), 1e-5f, t2(s.y), stat(s.rstd));
        } else {
          layer_norm_forward(t2(s.x), vec(w), vec(b), 1e-5f, t2(s.y), stat(s.mean), stat(s.rstd));
        }
      };
      // want_dw: dweight/dbias too (the diagnostics' dx-only row passes false).
      auto backward_of = [&](int r, bool want_dw) {
        Set& s = sets[r];
        const OptionalTensor dwv = want_dw ? OptionalTensor(vec(dw)) : std::nullopt;
        const OptionalTensor dbv = want_dw ? OptionalTensor(vec(db)) : std::nullopt;
        const OptionalTensor wsv = want_dw ? OptionalTensor(workspace) : std::nullopt;
        if (residual) {
          if (rms) rms_norm_residual_backward(t2(s.dy), t2(s.sum), t2(s.dsum), vec(w), stat(s.rstd), t2(s.dx), dwv, wsv);
          else layer_norm_residual_backward(t2(s.dy), t2(s.sum), t2(s.dsum), vec(w), stat(s.mean), stat(s.rstd),
                                            t2(s.dx), dwv, dbv, wsv);
        } else if (rms) {
          rms_norm_backward(t2(s.dy), t2(s.x), vec(w), stat(s.rstd), t2(s.dx), dwv, wsv);
        } else {
          layer_norm_backward(t2(s.dy), t2(s.x), vec(w), stat(s.mean), stat(s.rstd), t2(s.dx), dwv, dbv, wsv);
        }
      };
      auto backward = [&](int r) { backward_of(r, true); };
      for (int r = 0; r < rotations; ++r) forward(r);  // saved statistics (and sum) for backward
      const std::string shape = padded_shape_label(rows, cols);
      if (!rms && !residual) {  // the forward's bytes as one memcpy (once per shape for both norms)
        const Timing tc = time_same_size_copy(
            bytes, rotations, [&](int r) { return sets[r].y.get(); }, [&](int r) { return sets[r].x.get(); });
        report.add({"norm", "fwd", shape, "copy", tc.median_us, 2.0 * bytes});
      }
      const double fwd_bytes = 2.0 * fwd_tensors * elems, bwd_bytes = 2.0 * bwd_tensors * elems;
      const Timing tf = time_kernel(forward, rotations);
      report.add({op, "fwd", shape, "fusekit", tf.median_us, fwd_bytes});
      const Timing tb = time_kernel(backward, rotations);
      report.add({op, "bwd", shape, "fusekit", tb.median_us, bwd_bytes});
      if (options().diagnostics) {
        // dx alone: the cost of the dweight/dbias partial sums is the difference.
        const Timing td = time_kernel([&](int r) { backward_of(r, false); }, rotations);
        report.add({op, "bwd-dx", shape, "fusekit", td.median_us, bwd_bytes});
      }
    }
  }
}

}  // namespace fusekit::bench
