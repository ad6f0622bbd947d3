// FP8 RMSNorm bindings (fusekit/fp8_norm.h): one Python function per C++ entry point, same
// argument names and order; outputs and workspace are arrays the caller allocates. FP8 arrays come
// from any framework's float8_e4m3fn / float8_e5m2 (NumPy: ml_dtypes).
#include <nanobind/stl/string.h>

#include <cstdint>
#include <string>

#include "bindings.h"
#include "fusekit/fp8_norm.h"

namespace fusekit::python {

void bind_fp8_norm(nb::module_& m) {
  using nb::arg;
  const auto none = nb::none();
  m.attr("FP8_NORM_DEFAULT_GROUP_SIZE") = kFp8NormDefaultGroupSize;
  m.attr("FP8_NORM_MAX_COLS") = kFp8NormMaxCols;
  m.attr("FP8_NORM_AMAX_FLOOR") = kFp8NormAmaxFloor;

  m.def(
      "fp8_rms_norm_forward_workspace_size",
      [](std::int64_t rows, std::int64_t cols, const std::string& device) {
        return fp8_rms_norm_forward_workspace_size(
            rows, cols, device_arg(device, "fp8_rms_norm_forward_workspace_size"));
      },
      arg("rows"), arg("cols"), arg("device"),
      "Bytes of u8 scratch memory the forward needs (0 on the CPU).");

  m.def(
      "fp8_rms_norm_backward_workspace_size",
      [](std::int64_t rows, std::int64_t cols, const std::string& device) {
        return fp8_rms_norm_backward_workspace_size(
            rows, cols, device_arg(device, "fp8_rms_norm_backward_workspace_size"));
      },
      arg("rows"), arg("cols"), arg("device"),
      "Bytes of u8 scratch memory the backward needs (0 on the CPU).");

  m.def(
      "fp8_rms_norm_forward",
      [](nb::handle x, nb::handle x_scales, nb::handle weight, float eps, nb::handle qy,
         nb::handle qy_t, nb::handle y_scale, nb::handle rstd, nb::handle y, nb::handle workspace,
         int group_size, nb::handle stream) {
        OpCall c("fp8_rms_norm_forward");
        const TensorView xv = c.tensor(x, "x", Access::read);
        const TensorView sv = c.tensor(x_scales, "x_scales", Access::read);
        const TensorView wv = c.tensor(weight, "weight", Access::read);
        const TensorView qv = c.tensor(qy, "qy", Access::write);
        const TensorView qtv = c.tensor(qy_t, "qy_t", Access::write);
        const TensorView ysv = c.tensor(y_scale, "y_scale", Access::write);
        const TensorView rv = c.tensor(rstd, "rstd", Access::write);
        const OptionalTensor yv = c.optional(y, "y", Access::write);
        const OptionalTensor wsv = c.workspace(workspace, [&]() -> std::size_t {
          const auto [rows, cols] = rows_cols(xv);
          return fp8_rms_norm_forward_workspace_size(rows, cols, xv.device);
        });
        c.run(stream, [&](Stream s) {
          fp8_rms_norm_forward(xv, sv, wv, eps, qv, qtv, ysv, rv, yv, wsv, group_size, s);
        });
      },
      arg("x").none(), arg("x_scales").none(), arg("weight").none(), arg("eps"), arg("qy").none(),
      arg("qy_t").none(), arg("y_scale").none(), arg("rstd").none(), arg("y").none() = none,
      arg("workspace").none() = none, arg("group_size") = kFp8NormDefaultGroupSize,
      arg("stream").none() = none,
      "RMSNorm of the group-scaled FP8 input x into the per-tensor-scaled FP8 qy, its transpose "
      "qy_t, the scale y_scale, the float32 rstd and optionally the bf16 y.");

  // fusekit.torch's eager path: the forward with rstd allocated through x's framework (PyTorch
  // >= 2.10) and returned as an opaque capsule that fp8_rms_norm_backward accepts as rstd; the
  // workspace likewise.
  m.def(
      "_fp8_rms_norm_forward_stats",
      [](nb::handle x, nb::handle x_scales, nb::handle weight, float eps, nb::handle qy,
         nb::handle qy_t, nb::handle y_scale, nb::handle y, int group_size) {
        OpCall c("fp8_rms_norm_forward");
        const TensorView xv = c.tensor(x, "x", Access::read);
        const TensorView sv = c.tensor(x_scales, "x_scales", Access::read);
        const TensorView wv = c.tensor(weight, "weight", Access::read);
        const TensorView qv = c.tensor(qy, "qy", Access::write);
        const TensorView qtv = c.tensor(qy_t, "qy_t", Access::write);
        const TensorView ysv = c.tensor(y_scale, "y_scale", Access::write);
        const OptionalTensor yv = c.optional(y, "y", Access::write);
        TensorView rv;
        nb::object rstd = c.new_f32_capsule(rows_cols(xv).first, &rv);
        const OptionalTensor wsv = c.workspace(nb::str("auto"), [&]() -> std::size_t {
          const auto [rows, cols] = rows_cols(xv);
          return fp8_rms_norm_forward_workspace_size(rows, cols, xv.device);
        });
        c.run(nb::none(), [&](Stream s) {
          fp8_rms_norm_forward(xv, sv, wv, eps, qv, qtv, ysv, rv, yv, wsv, group_size, s);
        });
        return rstd;
      },
      arg("x").none(), arg("x_scales").none(), arg("weight").none(), arg("eps"), arg("qy").none(),
      arg("qy_t").none(), arg("y_scale").none(), arg("y").none(), arg("group_size"),
      "fp8_rms_norm_forward for fusekit.torch's eager path; returns rstd as an opaque capsule.");

  m.def(
      "fp8_rms_norm_backward",
      [](nb::handle dy, nb::handle x, nb::handle x_scales, nb::handle weight, nb::handle rstd,
         nb::handle dx, nb::handle dweight, nb::handle workspace, int group_size,
         nb::handle stream) {
        OpCall c("fp8_rms_norm_backward");
        const TensorView dyv = c.tensor(dy, "dy", Access::read);
        const TensorView xv = c.tensor(x, "x", Access::read);
        const TensorView sv = c.tensor(x_scales, "x_scales", Access::read);
        const TensorView wv = c.tensor(weight, "weight", Access::read);
        const TensorView rv = c.tensor(rstd, "rstd", Access::read);
        const OptionalTensor dxv = c.optional(dx, "dx", Access::write);
        const OptionalTensor dwv = c.optional(dweight, "dweight", Access::write);
        const OptionalTensor wsv = c.workspace(workspace, [&]() -> std::size_t {
          const auto [rows, cols] = rows_cols(xv);
          return fp8_rms_norm_backward_workspace_size(rows, cols, xv.device);
        });
        c.run(stream, [&](Stream s) {
          fp8_rms_norm_backward(dyv, xv, sv, wv, rv, dxv, dwv, wsv, group_size, s);
        });
      },
      arg("dy").none(), arg("x").none(), arg("x_scales").none(), arg("weight").none(),
      arg("rstd").none(), arg("dx").none() = none, arg("dweight").none() = none,
      arg("workspace").none() = none, arg("group_size") = kFp8NormDefaultGroupSize,
      arg("stream").none() = none,
      "Any subset of the bf16 dx and dweight (weight's dtype) from the saved rstd.");
}

}  // namespace fusekit::python
