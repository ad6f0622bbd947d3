// FP8 RMSNorm bindings (fusekit/fp8_norm.h): one Python function per C++ entry point, same
// argument names and order; outputs and workspace are arrays the caller allocates. FP8 arrays come
// from any framework's float8_e4m3fn / float8_e5m2 (NumPy: ml_dtypes).
#include <cstdint>
#include <string>

#include "bindings.h"
#include "fusekit/fp8_norm.h"

namespace fusekit::python {

namespace {

// The size query behind workspace='auto': `size` (fp8_rms_norm_forward_workspace_size or
// fp8_rms_norm_backward_workspace_size) for x's (rows, cols).
template <typename SizeFn>
auto fp8_norm_workspace(SizeFn size, const TensorView& x) {
  return [size, &x]() -> std::size_t {
    const auto [rows, cols] = rows_cols(x);
    return size(rows, cols, x.device);
  };
}

// Binds the workspace query `size` under its C++ name `op`.
template <typename SizeFn>
void def_workspace_size(nb::module_& m, const char* op, SizeFn size, const char* doc) {
  using nb::arg;
  m.def(
      op,
      [op, size](nb::handle rows, nb::handle cols, nb::handle device) {
        const ScalarArgs c(op);
        const std::int64_t r = c.i64(rows, "rows"), n = c.i64(cols, "cols");
        return size(r, n, c.device(device, "device"));
      },
      arg("rows").none(), arg("cols").none(), arg("device").none(), doc);
}

}  // namespace

void bind_fp8_norm(nb::module_& m) {
  using nb::arg;
  const auto none = nb::none();
  m.attr("FP8_NORM_DEFAULT_GROUP_SIZE") = kFp8NormDefaultGroupSize;
  m.attr("FP8_NORM_MAX_COLS") = kFp8NormMaxCols;
  m.attr("FP8_NORM_AMAX_FLOOR") = kFp8NormAmaxFloor;

  def_workspace_size(m, "fp8_rms_norm_forward_workspace_size", fp8_rms_norm_forward_workspace_size,
                     "Bytes of u8 scratch memory the forward needs (0 on the CPU).");
  def_workspace_size(m, "fp8_rms_norm_backward_workspace_size",
                     fp8_rms_norm_backward_workspace_size,
                     "Bytes of u8 scratch memory the backward needs (0 on the CPU).");

  m.def(
      "fp8_rms_norm_forward",
      [](nb::handle x, nb::handle x_scales, nb::handle weight, nb::handle eps_arg, nb::handle qy,
         nb::handle qy_t, nb::handle y_scale, nb::handle rstd, nb::handle y, nb::handle workspace,
         nb::handle group_size_arg, nb::handle stream) {
        OpCall c("fp8_rms_norm_forward");
        const float eps = c.f32(eps_arg, "eps");
        const int group_size = c.i32(group_size_arg, "group_size");
        const TensorView xv = c.tensor(x, "x", Access::read);
        const TensorView sv = c.tensor(x_scales, "x_scales", Access::read);
        const TensorView wv = c.tensor(weight, "weight", Access::read);
        const TensorView qv = c.tensor(qy, "qy", Access::write);
        const TensorView qtv = c.tensor(qy_t, "qy_t", Access::write);
        const TensorView ysv = c.tensor(y_scale, "y_scale", Access::write);
        const TensorView rv = c.tensor(rstd, "rstd", Access::write);
        const OptionalTensor yv = c.optional(y, "y", Access::write);
        const OptionalTensor wsv =
            c.workspace(workspace, fp8_norm_workspace(fp8_rms_norm_forward_workspace_size, xv));
        c.run(stream, [&](Stream s) {
          fp8_rms_norm_forward(xv, sv, wv, eps, qv, qtv, ysv, rv, yv, wsv, group_size, s);
        });
      },
      arg("x").none(), arg("x_scales").none(), arg("weight").none(), arg("eps").none(),
      arg("qy").none(), arg("qy_t").none(), arg("y_scale").none(), arg("rstd").none(),
      arg("y").none() = none, arg("workspace").none() = none,
      arg("group_size").none() = kFp8NormDefaultGroupSize,
      arg("stream").none() = none,
      "RMSNorm of the group-scaled FP8 input x into the per-tensor-scaled FP8 qy, its transpose "
      "qy_t, the scale y_scale, the float32 rstd and optionally the bf16 y.");

  // The forward with every output and the workspace allocated through x's framework (see
  // OpCall::new_arrays); rstd is a float32 tensor when rstd_tensor, else an opaque capsule
  // (cheaper; fp8_rms_norm_backward and _fp8_rms_norm_backward_alloc accept either).
  m.def(
      "_fp8_rms_norm_forward_alloc",
      [](nb::handle x, nb::handle x_scales, nb::handle weight, nb::handle eps_arg,
         nb::handle group_size_arg, nb::handle qy_dtype_arg, nb::handle rstd_tensor_arg) {
        OpCall c("fp8_rms_norm_forward");
        const float eps = c.f32(eps_arg, "eps");
        const int group_size = c.i32(group_size_arg, "group_size");
        const DType qy_dtype = c.dtype(qy_dtype_arg, "qy_dtype");
        const bool rstd_tensor = c.flag(rstd_tensor_arg, "rstd_tensor");
        const TensorView xv = c.tensor(x, "x", Access::read);
        const TensorView sv = c.tensor(x_scales, "x_scales", Access::read);
        const TensorView wv = c.contiguous(weight, "weight");
        const auto [rows, cols] = rows_cols(xv);
        // Two allocations: the activations (y, qy, qy_t), which the next layer consumes, and the
        // small arrays kept longer (y_scale, rstd for the backward) with the workspace.
        const OpCall::ArraySpec activations[3] = {
            OpCall::spec_like(xv, DType::bf16, cols), OpCall::spec_like(xv, qy_dtype, cols),
            OpCall::spec(qy_dtype, {cols, rows})};
        nb::object outs[3];  // y, qy, qy_t
        TensorView views[3];
        c.new_arrays(3, activations, outs, views);
        std::size_t ws_bytes = 0;
        try {
          ws_bytes = fp8_rms_norm_forward_workspace_size(rows, cols, xv.device);
        } catch (const Error&) {  // the op reports the bad argument itself
        }
        const OpCall::ArraySpec stats[2] = {OpCall::spec(DType::f32, {1}),
                                            OpCall::spec(DType::f32, {rows}, !rstd_tensor)};
        nb::object small[2];  // y_scale, rstd
        TensorView stat_views[2];
        OptionalTensor wsv;
        c.new_arrays(2, stats, small, stat_views, ws_bytes, &wsv);
        c.run(nb::none(), [&](Stream s) {
          fp8_rms_norm_forward(xv, sv, wv, eps, views[1], views[2], stat_views[0], stat_views[1],
                               views[0], wsv, group_size, s);
        });
        return nb::make_tuple(outs[0], outs[1], outs[2], small[0], small[1]);
      },
      arg("x").none(), arg("x_scales").none(), arg("weight").none(), arg("eps").none(),
      arg("group_size").none(), arg("qy_dtype").none(), arg("rstd_tensor").none() = false,
      "fp8_rms_norm_forward allocating every output and the workspace through the framework of x "
      "(PyTorch >= 2.10); returns (y, qy, qy_t, y_scale, rstd).");

  // The backward counterpart: dx (bf16, x's shape) and dweight (weight's dtype) allocated here
  // when asked for; None in their place otherwise.
  m.def(
      "_fp8_rms_norm_backward_alloc",
      [](nb::handle dy, nb::handle x, nb::handle x_scales, nb::handle weight, nb::handle rstd,
         nb::handle group_size_arg, nb::handle need_dx_arg, nb::handle need_dweight_arg) {
        OpCall c("fp8_rms_norm_backward");
        const int group_size = c.i32(group_size_arg, "group_size");
        const bool need_dx = c.flag(need_dx_arg, "need_dx");
        const bool need_dweight = c.flag(need_dweight_arg, "need_dweight");
        const TensorView dyv = c.contiguous(dy, "dy");
        const TensorView xv = c.tensor(x, "x", Access::read);
        const TensorView sv = c.tensor(x_scales, "x_scales", Access::read);
        const TensorView wv = c.contiguous(weight, "weight");
        const TensorView rv = c.tensor(rstd, "rstd", Access::read);
        const std::int64_t cols = rows_cols(xv).second;
        OptionalTensor dxv, dwv;
        nb::object dx = c.new_optional(need_dx, OpCall::spec_like(xv, DType::bf16, cols), &dxv);
        nb::object dweight =
            c.new_optional(need_dweight, OpCall::spec_like(wv, wv.dtype, rows_cols(wv).second), &dwv);
        const OptionalTensor wsv =
            c.auto_workspace(fp8_norm_workspace(fp8_rms_norm_backward_workspace_size, xv));
        c.run(nb::none(), [&](Stream s) {
          fp8_rms_norm_backward(dyv, xv, sv, wv, rv, dxv, dwv, wsv, group_size, s);
        });
        return nb::make_tuple(dx, dweight);
      },
      arg("dy").none(), arg("x").none(), arg("x_scales").none(), arg("weight").none(),
      arg("rstd").none(), arg("group_size").none(), arg("need_dx").none(),
      arg("need_dweight").none(),
      "fp8_rms_norm_backward allocating the gradients asked for and the workspace through the "
      "framework of x; returns (dx, dweight), None where not asked for.");

  m.def(
      "fp8_rms_norm_backward",
      [](nb::handle dy, nb::handle x, nb::handle x_scales, nb::handle weight, nb::handle rstd,
         nb::handle dx, nb::handle dweight, nb::handle workspace, nb::handle group_size_arg,
         nb::handle stream) {
        OpCall c("fp8_rms_norm_backward");
        const int group_size = c.i32(group_size_arg, "group_size");
        const TensorView dyv = c.tensor(dy, "dy", Access::read);
        const TensorView xv = c.tensor(x, "x", Access::read);
        const TensorView sv = c.tensor(x_scales, "x_scales", Access::read);
        const TensorView wv = c.tensor(weight, "weight", Access::read);
        const TensorView rv = c.tensor(rstd, "rstd", Access::read);
        const OptionalTensor dxv = c.optional(dx, "dx", Access::write);
        const OptionalTensor dwv = c.optional(dweight, "dweight", Access::write);
        const OptionalTensor wsv =
            c.workspace(workspace, fp8_norm_workspace(fp8_rms_norm_backward_workspace_size, xv));
        c.run(stream, [&](Stream s) {
          fp8_rms_norm_backward(dyv, xv, sv, wv, rv, dxv, dwv, wsv, group_size, s);
        });
      },
      arg("dy").none(), arg("x").none(), arg("x_scales").none(), arg("weight").none(),
      arg("rstd").none(), arg("dx").none() = none, arg("dweight").none() = none,
      arg("workspace").none() = none, arg("group_size").none() = kFp8NormDefaultGroupSize,
      arg("stream").none() = none,
      "Any subset of the bf16 dx and dweight (weight's dtype) from the saved rstd.");
}

}  // namespace fusekit::python
