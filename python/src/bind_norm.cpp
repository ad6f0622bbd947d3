// LayerNorm / RMSNorm bindings: one Python function per C++ entry point of fusekit/norm.h, same
// argument names and order; outputs and workspace are arrays the caller allocates.
#include "bindings.h"
#include "fusekit/norm.h"

namespace fusekit::python {

namespace {

// The arrays every layer_norm_forward binding starts with, converted in the C++ argument order.
struct LayerNormForwardArrays {
  TensorView x;
  OptionalTensor weight, bias;
  TensorView y;
};

LayerNormForwardArrays layer_norm_forward_arrays(OpCall& c, nb::handle x, nb::handle weight,
                                                 nb::handle bias, nb::handle y) {
  // A braced list is evaluated left to right: the arrays are converted in argument order.
  return {c.tensor(x, "x", Access::read), c.optional(weight, "weight", Access::read),
          c.optional(bias, "bias", Access::read), c.tensor(y, "y", Access::write)};
}

// The optional gradients of a norm backward and its workspace. `input` (x, or y for the
// *_from_output variants) gives the workspace query its (rows, cols); only dweight/dbias need
// scratch memory. RMSNorm has no dbias: it passes no handle, which converts to an empty one.
struct NormGrads {
  OptionalTensor dx, dweight, dbias, workspace;
};

NormGrads norm_grads(OpCall& c, const TensorView& input, nb::handle dx, nb::handle dweight,
                     nb::handle dbias, nb::handle workspace) {
  NormGrads g;
  g.dx = c.optional(dx, "dx", Access::write);
  g.dweight = c.optional(dweight, "dweight", Access::write);
  g.dbias = c.optional(dbias, "dbias", Access::write);
  const bool param_grads = g.dweight || g.dbias;
  g.workspace = c.workspace(workspace, [&]() -> std::size_t {
    if (!param_grads) return 0;
    const auto [rows, cols] = rows_cols(input);
    return norm_backward_workspace_size(rows, cols, input.dtype, input.device);
  });
  return g;
}

// Binds rms_norm_backward or rms_norm_backward_from_output (`backward`, Python name `op`): the
// same arguments but for the input the gradient is computed from, x or the forward's output y
// (`input_name`).
template <typename Backward>
void def_rms_norm_backward(nb::module_& m, const char* op, Backward backward,
                           const char* input_name, const char* doc) {
  using nb::arg;
  const auto none = nb::none();
  m.def(
      op,
      [op, backward, input_name](nb::handle dy, nb::handle input, nb::handle weight,
                                 nb::handle rstd, nb::handle dx, nb::handle dweight,
                                 nb::handle workspace, nb::handle stream) {
        OpCall c(op);
        const TensorView dyv = c.tensor(dy, "dy", Access::read);
        const TensorView iv = c.tensor(input, input_name, Access::read);
        const OptionalTensor wv = c.optional(weight, "weight", Access::read);
        const TensorView rv = c.tensor(rstd, "rstd", Access::read);
        const NormGrads g = norm_grads(c, iv, dx, dweight, nb::handle(), workspace);
        c.run(stream,
              [&](Stream s) { backward(dyv, iv, wv, rv, g.dx, g.dweight, g.workspace, s); });
      },
      arg("dy").none(), arg(input_name).none(), arg("weight").none(), arg("rstd").none(),
      arg("dx").none() = none, arg("dweight").none() = none, arg("workspace").none() = none,
      arg("stream").none() = none, doc);
}

}  // namespace

void bind_norm(nb::module_& m) {
  using nb::arg;
  const auto none = nb::none();

  m.def(
      "layer_norm_forward",
      [](nb::handle x, nb::handle weight, nb::handle bias, nb::handle eps_arg, nb::handle y,
         nb::handle mean, nb::handle rstd, nb::handle stream) {
        OpCall c("layer_norm_forward");
        const float eps = c.f32(eps_arg, "eps");
        const LayerNormForwardArrays a = layer_norm_forward_arrays(c, x, weight, bias, y);
        const OptionalTensor mv = c.optional(mean, "mean", Access::write);
        const OptionalTensor rv = c.optional(rstd, "rstd", Access::write);
        c.run(stream,
              [&](Stream s) { layer_norm_forward(a.x, a.weight, a.bias, eps, a.y, mv, rv, s); });
      },
      arg("x").none(), arg("weight").none(), arg("bias").none(), arg("eps").none(), arg("y").none(),
      arg("mean").none() = none, arg("rstd").none() = none, arg("stream").none() = none,
      "y = (x - mean) * rstd * weight + bias over the last dimension; optionally saves the "
      "float32 row statistics mean and rstd for the backward.");

  m.def(
      "_layer_norm_forward_alloc",
      [](nb::handle x, nb::handle weight, nb::handle bias, nb::handle eps_arg, nb::handle y,
         nb::handle stream) {
        OpCall c("layer_norm_forward");
        const float eps = c.f32(eps_arg, "eps");
        c.check_stream(stream);
        const LayerNormForwardArrays a = layer_norm_forward_arrays(c, x, weight, bias, y);
        const std::int64_t rows = rows_cols(a.x).first;
        // One allocation for both statistics: they live and die together.
        const OpCall::ArraySpec specs[2] = {OpCall::spec(DType::f32, {rows}, true),
                                            OpCall::spec(DType::f32, {rows}, true)};
        nb::object stats[2];
        TensorView views[2];
        c.new_arrays(2, specs, stats, views);
        c.run(stream, [&](Stream s) {
          layer_norm_forward(a.x, a.weight, a.bias, eps, a.y, views[0], views[1], s);
        });
        return nb::make_tuple(stats[0], stats[1]);
      },
      arg("x").none(), arg("weight").none(), arg("bias").none(), arg("eps").none(), arg("y").none(),
      arg("stream").none() = none,
      "layer_norm_forward allocating mean and rstd through the framework of x (PyTorch >= 2.10); "
      "returns (mean, rstd) as opaque capsules that layer_norm_backward accepts.");

  m.def(
      "_rms_norm_forward_alloc",
      [](nb::handle x, nb::handle weight, nb::handle eps_arg, nb::handle y, nb::handle stream) {
        OpCall c("rms_norm_forward");
        const float eps = c.f32(eps_arg, "eps");
        c.check_stream(stream);
        const TensorView xv = c.tensor(x, "x", Access::read);
        const OptionalTensor wv = c.optional(weight, "weight", Access::read);
        const TensorView yv = c.tensor(y, "y", Access::write);
        TensorView rv;
        nb::object made = c.new_f32_capsule(rows_cols(xv).first, &rv);
        c.run(stream, [&](Stream s) { rms_norm_forward(xv, wv, eps, yv, rv, s); });
        return made;
      },
      arg("x").none(), arg("weight").none(), arg("eps").none(), arg("y").none(),
      arg("stream").none() = none,
      "rms_norm_forward allocating rstd through the framework of x (PyTorch >= 2.10); returns it "
      "as an opaque capsule that rms_norm_backward accepts.");

  m.def(
      "rms_norm_forward",
      [](nb::handle x, nb::handle weight, nb::handle eps_arg, nb::handle y, nb::handle rstd,
         nb::handle stream) {
        OpCall c("rms_norm_forward");
        const float eps = c.f32(eps_arg, "eps");
        const TensorView xv = c.tensor(x, "x", Access::read);
        const OptionalTensor wv = c.optional(weight, "weight", Access::read);
        const TensorView yv = c.tensor(y, "y", Access::write);
        const OptionalTensor rv = c.optional(rstd, "rstd", Access::write);
        c.run(stream, [&](Stream s) { rms_norm_forward(xv, wv, eps, yv, rv, s); });
      },
      arg("x").none(), arg("weight").none(), arg("eps").none(), arg("y").none(), arg("rstd").none() = none,
      arg("stream").none() = none,
      "y = x * rstd * weight over the last dimension; optionally saves the float32 rstd.");

  m.def(
      "norm_backward_workspace_size",
      [](nb::handle rows, nb::handle cols, nb::handle dtype, nb::handle device) {
        const ScalarArgs c("norm_backward_workspace_size");
        const std::int64_t r = c.i64(rows, "rows"), n = c.i64(cols, "cols");
        const DType t = c.dtype(dtype, "dtype");
        return norm_backward_workspace_size(r, n, t, c.device(device, "device"));
      },
      arg("rows").none(), arg("cols").none(), arg("dtype").none(), arg("device").none(),
      "Bytes of u8 scratch memory the backward needs (0 on the CPU). device: 'cpu', 'cuda', "
      "'cuda:N'.");

  m.def(
      "layer_norm_backward",
      [](nb::handle dy, nb::handle x, nb::handle weight, nb::handle mean, nb::handle rstd,
         nb::handle dx, nb::handle dweight, nb::handle dbias, nb::handle workspace,
         nb::handle stream) {
        OpCall c("layer_norm_backward");
        const TensorView dyv = c.tensor(dy, "dy", Access::read);
        const TensorView xv = c.tensor(x, "x", Access::read);
        const TensorView mv = c.tensor(mean, "mean", Access::read);
        const TensorView rv = c.tensor(rstd, "rstd", Access::read);
        const OptionalTensor wv = c.optional(weight, "weight", Access::read);
        const NormGrads g = norm_grads(c, xv, dx, dweight, dbias, workspace);
        c.run(stream, [&](Stream s) {
          layer_norm_backward(dyv, xv, wv, mv, rv, g.dx, g.dweight, g.dbias, g.workspace, s);
        });
      },
      arg("dy").none(), arg("x").none(), arg("weight").none(), arg("mean").none(), arg("rstd").none(),
      arg("dx").none() = none, arg("dweight").none() = none, arg("dbias").none() = none,
      arg("workspace").none() = none, arg("stream").none() = none,
      "Any subset of dx, dweight, dbias from the saved mean and rstd.");

  m.def(
      "layer_norm_backward_from_output",
      [](nb::handle dy, nb::handle y, nb::handle weight, nb::handle bias, nb::handle rstd,
         nb::handle dx, nb::handle dweight, nb::handle dbias, nb::handle workspace,
         nb::handle stream) {
        OpCall c("layer_norm_backward_from_output");
        const TensorView dyv = c.tensor(dy, "dy", Access::read);
        const TensorView yv = c.tensor(y, "y", Access::read);
        const OptionalTensor wv = c.optional(weight, "weight", Access::read);
        const OptionalTensor bv = c.optional(bias, "bias", Access::read);
        const TensorView rv = c.tensor(rstd, "rstd", Access::read);
        const NormGrads g = norm_grads(c, yv, dx, dweight, dbias, workspace);
        c.run(stream, [&](Stream s) {
          layer_norm_backward_from_output(dyv, yv, wv, bv, rv, g.dx, g.dweight, g.dbias,
                                          g.workspace, s);
        });
      },
      arg("dy").none(), arg("y").none(), arg("weight").none(), arg("bias").none(), arg("rstd").none(),
      arg("dx").none() = none, arg("dweight").none() = none, arg("dbias").none() = none,
      arg("workspace").none() = none, arg("stream").none() = none,
      "The LayerNorm backward recomputing the normalized input from the output y.");

  m.def(
      "layer_norm_residual_forward",
      [](nb::handle x, nb::handle residual, nb::handle weight, nb::handle bias, nb::handle eps_arg,
         nb::handle y, nb::handle sum, nb::handle mean, nb::handle rstd, nb::handle stream) {
        OpCall c("layer_norm_residual_forward");
        const float eps = c.f32(eps_arg, "eps");
        const TensorView xv = c.tensor(x, "x", Access::read);
        const TensorView resv = c.tensor(residual, "residual", Access::read);
        const OptionalTensor wv = c.optional(weight, "weight", Access::read);
        const OptionalTensor bv = c.optional(bias, "bias", Access::read);
        const TensorView yv = c.tensor(y, "y", Access::write);
        const OptionalTensor sv = c.optional(sum, "sum", Access::write);
        const OptionalTensor mv = c.optional(mean, "mean", Access::write);
        const OptionalTensor rv = c.optional(rstd, "rstd", Access::write);
        c.run(stream, [&](Stream s) { layer_norm_residual_forward(xv, resv, wv, bv, eps, yv, sv, mv, rv, s); });
      },
      arg("x").none(), arg("residual").none(), arg("weight").none(), arg("bias").none(), arg("eps").none(),
      arg("y").none(), arg("sum").none() = none, arg("mean").none() = none, arg("rstd").none() = none,
      arg("stream").none() = none,
      "sum = x + residual (rounded to x's dtype; written when given) and y = layer_norm(sum) in one "
      "pass; optionally saves the float32 mean and rstd for the backward.");

  m.def(
      "rms_norm_residual_forward",
      [](nb::handle x, nb::handle residual, nb::handle weight, nb::handle eps_arg, nb::handle y,
         nb::handle sum, nb::handle rstd, nb::handle stream) {
        OpCall c("rms_norm_residual_forward");
        const float eps = c.f32(eps_arg, "eps");
        const TensorView xv = c.tensor(x, "x", Access::read);
        const TensorView resv = c.tensor(residual, "residual", Access::read);
        const OptionalTensor wv = c.optional(weight, "weight", Access::read);
        const TensorView yv = c.tensor(y, "y", Access::write);
        const OptionalTensor sv = c.optional(sum, "sum", Access::write);
        const OptionalTensor rv = c.optional(rstd, "rstd", Access::write);
        c.run(stream, [&](Stream s) { rms_norm_residual_forward(xv, resv, wv, eps, yv, sv, rv, s); });
      },
      arg("x").none(), arg("residual").none(), arg("weight").none(), arg("eps").none(), arg("y").none(),
      arg("sum").none() = none, arg("rstd").none() = none, arg("stream").none() = none,
      "sum = x + residual (rounded to x's dtype; written when given) and y = rms_norm(sum) in one "
      "pass; optionally saves the float32 rstd.");

  m.def(
      "layer_norm_residual_backward",
      [](nb::handle dy, nb::handle sum, nb::handle dsum, nb::handle weight, nb::handle mean,
         nb::handle rstd, nb::handle dx, nb::handle dweight, nb::handle dbias, nb::handle workspace,
         nb::handle stream) {
        OpCall c("layer_norm_residual_backward");
        const TensorView dyv = c.tensor(dy, "dy", Access::read);
        const TensorView sv = c.tensor(sum, "sum", Access::read);
        const OptionalTensor dsv = c.optional(dsum, "dsum", Access::read);
        const OptionalTensor wv = c.optional(weight, "weight", Access::read);
        const TensorView mv = c.tensor(mean, "mean", Access::read);
        const TensorView rv = c.tensor(rstd, "rstd", Access::read);
        const NormGrads g = norm_grads(c, sv, dx, dweight, dbias, workspace);
        c.run(stream, [&](Stream s) {
          layer_norm_residual_backward(dyv, sv, dsv, wv, mv, rv, g.dx, g.dweight, g.dbias, g.workspace, s);
        });
      },
      arg("dy").none(), arg("sum").none(), arg("dsum").none(), arg("weight").none(), arg("mean").none(),
      arg("rstd").none(), arg("dx").none() = none, arg("dweight").none() = none, arg("dbias").none() = none,
      arg("workspace").none() = none, arg("stream").none() = none,
      "dx = the LayerNorm backward at sum + dsum (the gradient of both x and residual; dsum may "
      "be None, or dx itself), and any of dweight, dbias.");

  m.def(
      "rms_norm_residual_backward",
      [](nb::handle dy, nb::handle sum, nb::handle dsum, nb::handle weight, nb::handle rstd,
         nb::handle dx, nb::handle dweight, nb::handle workspace, nb::handle stream) {
        OpCall c("rms_norm_residual_backward");
        const TensorView dyv = c.tensor(dy, "dy", Access::read);
        const TensorView sv = c.tensor(sum, "sum", Access::read);
        const OptionalTensor dsv = c.optional(dsum, "dsum", Access::read);
        const OptionalTensor wv = c.optional(weight, "weight", Access::read);
        const TensorView rv = c.tensor(rstd, "rstd", Access::read);
        const NormGrads g = norm_grads(c, sv, dx, dweight, nb::handle(), workspace);
        c.run(stream, [&](Stream s) {
          rms_norm_residual_backward(dyv, sv, dsv, wv, rv, g.dx, g.dweight, g.workspace, s);
        });
      },
      arg("dy").none(), arg("sum").none(), arg("dsum").none(), arg("weight").none(), arg("rstd").none(),
      arg("dx").none() = none, arg("dweight").none() = none, arg("workspace").none() = none,
      arg("stream").none() = none,
      "dx = the RMSNorm backward at sum + dsum (the gradient of both x and residual; dsum may be "
      "None, or dx itself), and dweight.");

  def_rms_norm_backward(m, "rms_norm_backward", rms_norm_backward, "x",
                        "Any subset of dx, dweight from the saved rstd.");
  def_rms_norm_backward(m, "rms_norm_backward_from_output", rms_norm_backward_from_output, "y",
                        "The RMSNorm backward recomputing the normalized input from the output y.");
}

}  // namespace fusekit::python
