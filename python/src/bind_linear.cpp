// Linear + bias + activation bindings (fusekit/linear.h): one Python function per C++ entry point,
// same argument names and order; outputs and workspace are arrays the caller allocates.
#include <cstdint>

#include "bindings.h"
#include "fusekit/linear.h"

namespace fusekit::python {

namespace {

// N of a weight (N, K); 0 for a 0-d array (the op reports it).
std::int64_t out_features(const TensorView& weight) {
  return weight.ndim > 0 ? weight.shape[0] : 0;
}

// A weight (N, K) that is the transposed view of a row-major (K, N) matrix (Hugging Face's Conv1D
// keeps its weight so): linear reads it as it is, and its gradient is allocated the same way, so
// that the (K, N) parameter's gradient is a plain transpose. fusekit/torch/linear.py's
// _transposed is the same test.
bool transposed_view(const TensorView& w) {
  return w.ndim == 2 && w.shape[0] > 1 && w.strides[0] == 1 && w.strides[1] >= w.shape[0];
}

// The weight operand of the allocating entry points: a transposed view as it is, any other layout
// made contiguous.
TensorView weight_operand(OpCall& c, nb::handle weight) {
  const TensorView w = c.tensor(weight, "weight", Access::read);
  return transposed_view(w) ? w : c.contiguous(weight, "weight");
}

// The size query behind workspace='auto': `size` (linear_forward_workspace_size or
// linear_backward_workspace_size) for x (..., K) and weight (N, K).
template <typename SizeFn>
auto linear_workspace(SizeFn size, const TensorView& x, const TensorView& weight, Activation act) {
  return [size, &x, &weight, act]() -> std::size_t {
    const auto [rows, k] = rows_cols(x);
    return size(rows, out_features(weight), k, x.dtype, act, x.device);
  };
}

// Binds the workspace query `size` under its C++ name `op`.
template <typename SizeFn>
void def_workspace_size(nb::module_& m, const char* op, SizeFn size, const char* doc) {
  using nb::arg;
  m.def(
      op,
      [op, size](nb::handle m_arg, nb::handle n_arg, nb::handle k_arg, nb::handle dtype,
                 nb::handle activation, nb::handle device) {
        const ScalarArgs c(op);
        const std::int64_t m_rows = c.i64(m_arg, "m"), n = c.i64(n_arg, "n"), k = c.i64(k_arg, "k");
        const DType t = c.dtype(dtype, "dtype");
        const Activation act = c.activation(activation);
        return size(m_rows, n, k, t, act, c.device(device, "device"));
      },
      arg("m").none(), arg("n").none(), arg("k").none(), arg("dtype").none(),
      arg("activation").none(), arg("device").none(), doc);
}

}  // namespace

void bind_linear(nb::module_& m) {
  using nb::arg;
  const auto none = nb::none();

  def_workspace_size(m, "linear_forward_workspace_size", linear_forward_workspace_size,
                     "Bytes of u8 scratch memory linear_forward needs (0 on the CPU). device: "
                     "'cpu', 'cuda', 'cuda:N'.");
  def_workspace_size(m, "linear_backward_workspace_size", linear_backward_workspace_size,
                     "Bytes of u8 scratch memory linear_backward needs (0 on the CPU).");

  m.def(
      "linear_forward",
      [](nb::handle x, nb::handle weight, nb::handle bias, nb::handle activation, nb::handle y,
         nb::handle pre_activation, nb::handle workspace, nb::handle stream) {
        OpCall c("linear_forward");
        const Activation act = c.activation(activation);
        const TensorView xv = c.tensor(x, "x", Access::read);
        const TensorView wv = c.tensor(weight, "weight", Access::read);
        const OptionalTensor bv = c.optional(bias, "bias", Access::read);
        const TensorView yv = c.tensor(y, "y", Access::write);
        const OptionalTensor pv = c.optional(pre_activation, "pre_activation", Access::write);
        const OptionalTensor wsv =
            c.workspace(workspace, linear_workspace(linear_forward_workspace_size, xv, wv, act));
        c.run(stream, [&](Stream s) { linear_forward(xv, wv, bv, act, yv, pv, wsv, s); });
      },
      arg("x").none(), arg("weight").none(), arg("bias").none(), arg("activation").none(),
      arg("y").none(), arg("pre_activation").none() = none, arg("workspace").none() = none,
      arg("stream").none() = none,
      "y = act(x W^T + b); optionally also pre_activation = x W^T + b (needed by the backward for "
      "every activation but none).");

  // The forward allocating y (and pre_activation when asked for) through x's framework (see
  // OpCall::new_array), arrays of any layout made contiguous (OpCall::contiguous).
  m.def(
      "_linear_forward_alloc",
      [](nb::handle x, nb::handle weight, nb::handle bias, nb::handle activation,
         nb::handle save_pre_activation_arg) {
        OpCall c("linear_forward");
        const Activation act = c.activation(activation);
        const bool save_pre_activation = c.flag(save_pre_activation_arg, "save_pre_activation");
        const TensorView xv = c.contiguous(x, "x");
        const TensorView wv = weight_operand(c, weight);
        const OptionalTensor bv = c.optional_contiguous(bias, "bias");
        const std::int64_t n = out_features(wv);
        TensorView yv;
        OptionalTensor pv;
        nb::object y = c.new_array(OpCall::spec_like(xv, xv.dtype, n), &yv);
        nb::object pre =
            c.new_optional(save_pre_activation, OpCall::spec_like(xv, xv.dtype, n), &pv);
        const OptionalTensor wsv =
            c.auto_workspace(linear_workspace(linear_forward_workspace_size, xv, wv, act));
        c.run(nb::none(), [&](Stream s) { linear_forward(xv, wv, bv, act, yv, pv, wsv, s); });
        return nb::make_tuple(y, pre);
      },
      arg("x").none(), arg("weight").none(), arg("bias").none(), arg("activation").none(),
      arg("save_pre_activation").none(),
      "linear_forward allocating its outputs and workspace through the framework of x (PyTorch "
      ">= 2.10); returns (y, pre_activation or None).");

  // The backward counterpart: (dx, dweight, dbias), each allocated when asked for, else None.
  m.def(
      "_linear_backward_alloc",
      [](nb::handle dout, nb::handle x, nb::handle weight, nb::handle pre_activation,
         nb::handle activation, nb::handle need_dx_arg, nb::handle need_dweight_arg,
         nb::handle need_dbias_arg) {
        OpCall c("linear_backward");
        const Activation act = c.activation(activation);
        const bool need_dx = c.flag(need_dx_arg, "need_dx");
        const bool need_dweight = c.flag(need_dweight_arg, "need_dweight");
        const bool need_dbias = c.flag(need_dbias_arg, "need_dbias");
        const TensorView dov = c.contiguous(dout, "dout");
        const TensorView xv = c.contiguous(x, "x");
        const TensorView wv = weight_operand(c, weight);
        const OptionalTensor pv = c.optional_contiguous(pre_activation, "pre_activation");
        const std::int64_t n = out_features(wv);
        const std::int64_t k = rows_cols(xv).second;
        OptionalTensor dxv, dwv, dbv;
        nb::object dx = c.new_optional(need_dx, OpCall::spec_like(xv, xv.dtype, k), &dxv);
        OpCall::ArraySpec dweight_spec = OpCall::spec_like(wv, wv.dtype, rows_cols(wv).second);
        dweight_spec.transposed = transposed_view(wv);
        nb::object dweight = c.new_optional(need_dweight, dweight_spec, &dwv);
        nb::object dbias = c.new_optional(need_dbias, OpCall::spec(xv.dtype, {n}), &dbv);
        const OptionalTensor wsv =
            c.auto_workspace(linear_workspace(linear_backward_workspace_size, xv, wv, act));
        c.run(nb::none(), [&](Stream s) {
          linear_backward(dov, xv, wv, pv, act, dxv, dwv, dbv, wsv, s);
        });
        return nb::make_tuple(dx, dweight, dbias);
      },
      arg("dout").none(), arg("x").none(), arg("weight").none(), arg("pre_activation").none(),
      arg("activation").none(), arg("need_dx").none(), arg("need_dweight").none(),
      arg("need_dbias").none(),
      "linear_backward allocating the gradients asked for and the workspace through the framework "
      "of x; returns (dx, dweight, dbias), None where not asked for.");

  m.def(
      "linear_backward",
      [](nb::handle dout, nb::handle x, nb::handle weight, nb::handle pre_activation,
         nb::handle activation, nb::handle dx, nb::handle dweight, nb::handle dbias,
         nb::handle workspace, nb::handle stream) {
        OpCall c("linear_backward");
        const Activation act = c.activation(activation);
        const TensorView dov = c.tensor(dout, "dout", Access::read);
        const TensorView xv = c.tensor(x, "x", Access::read);
        const TensorView wv = c.tensor(weight, "weight", Access::read);
        const OptionalTensor pv = c.optional(pre_activation, "pre_activation", Access::read);
        const OptionalTensor dxv = c.optional(dx, "dx", Access::write);
        const OptionalTensor dwv = c.optional(dweight, "dweight", Access::write);
        const OptionalTensor dbv = c.optional(dbias, "dbias", Access::write);
        const OptionalTensor wsv =
            c.workspace(workspace, linear_workspace(linear_backward_workspace_size, xv, wv, act));
        c.run(stream, [&](Stream s) {
          linear_backward(dov, xv, wv, pv, act, dxv, dwv, dbv, wsv, s);
        });
      },
      arg("dout").none(), arg("x").none(), arg("weight").none(), arg("pre_activation").none(),
      arg("activation").none(), arg("dx").none() = none, arg("dweight").none() = none,
      arg("dbias").none() = none, arg("workspace").none() = none, arg("stream").none() = none,
      "Any subset of dx, dweight, dbias; dz = dout * act'(pre_activation).");
}

}  // namespace fusekit::python
