// Linear + bias + activation bindings (fusekit/linear.h): one Python function per C++ entry point,
// same argument names and order; outputs and workspace are arrays the caller allocates. The gated
// linear's GatedLinearConfig is flattened into its fields: activation in the config's argument
// position, layout (which has a default) after the outputs and workspace.
#include <cstdint>
#include <string_view>

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

// Which gradients an allocating backward was asked for (need_dx, need_dweight, need_dbias).
struct Needed {
  bool dx, dweight, dbias;
};
Needed needed_gradients(const OpCall& c, nb::handle dx, nb::handle dweight, nb::handle dbias) {
  return {c.flag(dx, "need_dx"), c.flag(dweight, "need_dweight"), c.flag(dbias, "need_dbias")};
}

// The gradients an allocating backward returns, allocated through x's framework where asked for:
// dx like x, dweight in the weight's layout (a transposed view's gradient transposed too), dbias
// (N); None elsewhere.
struct Gradients {
  nb::object dx, dweight, dbias;
  OptionalTensor dxv, dwv, dbv;
  nb::tuple arrays() const { return nb::make_tuple(dx, dweight, dbias); }
};
Gradients allocate_gradients(OpCall& c, const Needed& needed, const TensorView& x, const TensorView& weight) {
  Gradients g;
  g.dx = c.new_optional(needed.dx, OpCall::spec_like(x, x.dtype, rows_cols(x).second), &g.dxv);
  OpCall::ArraySpec dweight_spec = OpCall::spec_like(weight, weight.dtype, rows_cols(weight).second);
  dweight_spec.transposed = transposed_view(weight);
  g.dweight = c.new_optional(needed.dweight, dweight_spec, &g.dwv);
  g.dbias = c.new_optional(needed.dbias, OpCall::spec(x.dtype, {out_features(weight)}), &g.dbv);
  return g;
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

// F of a gated weight (2F, K); an odd row count is the op's error.
std::int64_t gated_features(const TensorView& weight) { return out_features(weight) / 2; }

// The config from its flattened arguments, converted before the arrays (a mistyped scalar is
// reported first).
GatedLinearConfig gated_config(const ScalarArgs& c, nb::handle activation, nb::handle layout) {
  GatedLinearConfig config;
  config.activation = c.activation(activation);
  config.layout = gated_layout_arg(c, layout);
  return config;
}

// Runs `call`, a gated_linear entry point. The C++ op names a bad config field "config.activation"
// or "config.layout"; here they are the arguments `activation` and `layout`, and the error names
// the argument the caller passed.
template <typename Call>
auto naming_config_arguments(Call&& call) -> decltype(call()) {
  try {
    return call();
  } catch (const Error& e) {
    constexpr std::string_view prefix = "config.";
    if (e.argument().rfind(prefix, 0) != 0) throw;
    throw Error(e.kind(), e.op(), e.argument().substr(prefix.size()), e.expected(), e.got());
  }
}

// The size queries behind workspace='auto' for x (..., K) and weight (2F, K).
auto gated_forward_workspace(const TensorView& x, const TensorView& weight, const GatedLinearConfig& config,
                             bool keeps_pre) {
  return [&x, &weight, config, keeps_pre]() -> std::size_t {
    const auto [rows, k] = rows_cols(x);
    return gated_linear_forward_workspace_size(rows, gated_features(weight), k, x.dtype, config, keeps_pre,
                                               x.device);
  };
}

auto gated_backward_workspace(const TensorView& x, const TensorView& weight, const GatedLinearConfig& config) {
  return [&x, &weight, config]() -> std::size_t {
    const auto [rows, k] = rows_cols(x);
    return gated_linear_backward_workspace_size(rows, gated_features(weight), k, x.dtype, config, x.device);
  };
}

void bind_gated_linear(nb::module_& m) {
  using nb::arg;
  const auto none = nb::none();
  const auto interleaved = nb::str("interleaved");

  m.def(
      "gated_linear_forward_workspace_size",
      [](nb::handle m_arg, nb::handle f_arg, nb::handle k_arg, nb::handle dtype, nb::handle activation,
         nb::handle keeps_pre_arg, nb::handle device, nb::handle layout) {
        const ScalarArgs c("gated_linear_forward_workspace_size");
        const std::int64_t m_rows = c.i64(m_arg, "m"), f = c.i64(f_arg, "f"), k = c.i64(k_arg, "k");
        const DType t = c.dtype(dtype, "dtype");
        const GatedLinearConfig config = gated_config(c, activation, layout);
        const bool keeps_pre = c.flag(keeps_pre_arg, "keeps_pre");
        const Device d = c.device(device, "device");
        return naming_config_arguments(
            [&] { return gated_linear_forward_workspace_size(m_rows, f, k, t, config, keeps_pre, d); });
      },
      arg("m").none(), arg("f").none(), arg("k").none(), arg("dtype").none(), arg("activation").none(),
      arg("keeps_pre").none(), arg("device").none(), arg("layout").none() = interleaved,
      "Bytes of u8 scratch memory gated_linear_forward needs (0 on the CPU); keeps_pre: the call passes "
      "pre_activation. device: 'cpu', 'cuda', 'cuda:N'.");

  m.def(
      "gated_linear_backward_workspace_size",
      [](nb::handle m_arg, nb::handle f_arg, nb::handle k_arg, nb::handle dtype, nb::handle activation,
         nb::handle device, nb::handle layout) {
        const ScalarArgs c("gated_linear_backward_workspace_size");
        const std::int64_t m_rows = c.i64(m_arg, "m"), f = c.i64(f_arg, "f"), k = c.i64(k_arg, "k");
        const DType t = c.dtype(dtype, "dtype");
        const GatedLinearConfig config = gated_config(c, activation, layout);
        const Device d = c.device(device, "device");
        return naming_config_arguments(
            [&] { return gated_linear_backward_workspace_size(m_rows, f, k, t, config, d); });
      },
      arg("m").none(), arg("f").none(), arg("k").none(), arg("dtype").none(), arg("activation").none(),
      arg("device").none(), arg("layout").none() = interleaved,
      "Bytes of u8 scratch memory gated_linear_backward needs (0 on the CPU).");

  m.def(
      "gated_linear_forward",
      [](nb::handle x, nb::handle weight, nb::handle bias, nb::handle activation, nb::handle y,
         nb::handle pre_activation, nb::handle workspace, nb::handle layout, nb::handle stream) {
        OpCall c("gated_linear_forward");
        const GatedLinearConfig config = gated_config(c, activation, layout);
        const TensorView xv = c.tensor(x, "x", Access::read);
        const TensorView wv = c.tensor(weight, "weight", Access::read);
        const OptionalTensor bv = c.optional(bias, "bias", Access::read);
        const TensorView yv = c.tensor(y, "y", Access::write);
        const OptionalTensor pv = c.optional(pre_activation, "pre_activation", Access::write);
        const OptionalTensor wsv =
            c.workspace(workspace, gated_forward_workspace(xv, wv, config, pv.has_value()));
        c.run(stream, [&](Stream s) {
          naming_config_arguments([&] { gated_linear_forward(xv, wv, bv, config, yv, pv, wsv, s); });
        });
      },
      arg("x").none(), arg("weight").none(), arg("bias").none(), arg("activation").none(), arg("y").none(),
      arg("pre_activation").none() = none, arg("workspace").none() = none, arg("layout").none() = interleaved,
      arg("stream").none() = none,
      "y (..., F) = act(gate) * up with [gate, up] = x W^T + b, weight (2F, K) and bias (2F) ordered as "
      "layout orders pre's columns ('interleaved': gate j at 2j, up j at 2j + 1; 'halves': [gate | up]); "
      "optionally also pre_activation (..., 2F) = x W^T + b, the backward's input. activation: 'silu', "
      "'gelu_tanh', 'gelu_erf' or 'relu' (or fusekit.Activation).");

  m.def(
      "gated_linear_backward",
      [](nb::handle dy, nb::handle x, nb::handle weight, nb::handle pre_activation, nb::handle activation,
         nb::handle dx, nb::handle dweight, nb::handle dbias, nb::handle workspace, nb::handle layout,
         nb::handle stream) {
        OpCall c("gated_linear_backward");
        const GatedLinearConfig config = gated_config(c, activation, layout);
        const TensorView dyv = c.tensor(dy, "dy", Access::read);
        const TensorView xv = c.tensor(x, "x", Access::read);
        const TensorView wv = c.tensor(weight, "weight", Access::read);
        const TensorView pv = c.tensor(pre_activation, "pre_activation", Access::read);
        const OptionalTensor dxv = c.optional(dx, "dx", Access::write);
        const OptionalTensor dwv = c.optional(dweight, "dweight", Access::write);
        const OptionalTensor dbv = c.optional(dbias, "dbias", Access::write);
        const OptionalTensor wsv = c.workspace(workspace, gated_backward_workspace(xv, wv, config));
        c.run(stream, [&](Stream s) {
          naming_config_arguments(
              [&] { gated_linear_backward(dyv, xv, wv, pv, config, dxv, dwv, dbv, wsv, s); });
        });
      },
      arg("dy").none(), arg("x").none(), arg("weight").none(), arg("pre_activation").none(),
      arg("activation").none(), arg("dx").none() = none, arg("dweight").none() = none,
      arg("dbias").none() = none, arg("workspace").none() = none, arg("layout").none() = interleaved,
      arg("stream").none() = none,
      "Any subset of dx, dweight, dbias from dy (..., F) and the forward's pre_activation (..., 2F): "
      "dpre = [dy * up * act'(gate), dy * act(gate)] in the layout, dx = dpre W, dW = dpre^T x.");

  // fusekit.torch's calls: the same ops with the outputs (and workspace) allocated through x's
  // framework, arguments of any layout made contiguous but for a transposed weight (as linear's).
  m.def(
      "_gated_linear_forward_alloc",
      [](nb::handle x, nb::handle weight, nb::handle bias, nb::handle activation, nb::handle layout,
         nb::handle save_pre_activation_arg) {
        OpCall c("gated_linear_forward");
        const GatedLinearConfig config = gated_config(c, activation, layout);
        const bool save_pre_activation = c.flag(save_pre_activation_arg, "save_pre_activation");
        const TensorView xv = c.contiguous(x, "x");
        const TensorView wv = weight_operand(c, weight);
        const OptionalTensor bv = c.optional_contiguous(bias, "bias");
        const std::int64_t f = gated_features(wv);
        TensorView yv;
        OptionalTensor pv;
        nb::object y = c.new_array(OpCall::spec_like(xv, xv.dtype, f), &yv);
        nb::object pre = c.new_optional(save_pre_activation, OpCall::spec_like(xv, xv.dtype, 2 * f), &pv);
        const OptionalTensor wsv =
            c.auto_workspace(gated_forward_workspace(xv, wv, config, save_pre_activation));
        c.run(nb::none(), [&](Stream s) {
          naming_config_arguments([&] { gated_linear_forward(xv, wv, bv, config, yv, pv, wsv, s); });
        });
        return nb::make_tuple(y, pre);
      },
      arg("x").none(), arg("weight").none(), arg("bias").none(), arg("activation").none(), arg("layout").none(),
      arg("save_pre_activation").none(),
      "gated_linear_forward allocating its outputs and workspace through the framework of x (PyTorch "
      ">= 2.10); returns (y, pre_activation or None).");

  m.def(
      "_gated_linear_backward_alloc",
      [](nb::handle dy, nb::handle x, nb::handle weight, nb::handle pre_activation, nb::handle activation,
         nb::handle layout, nb::handle need_dx_arg, nb::handle need_dweight_arg, nb::handle need_dbias_arg) {
        OpCall c("gated_linear_backward");
        const GatedLinearConfig config = gated_config(c, activation, layout);
        const Needed needed = needed_gradients(c, need_dx_arg, need_dweight_arg, need_dbias_arg);
        const TensorView dyv = c.contiguous(dy, "dy");
        const TensorView xv = c.contiguous(x, "x");
        const TensorView wv = weight_operand(c, weight);
        const TensorView pv = c.contiguous(pre_activation, "pre_activation");
        Gradients g = allocate_gradients(c, needed, xv, wv);
        const OptionalTensor wsv = c.auto_workspace(gated_backward_workspace(xv, wv, config));
        c.run(nb::none(), [&](Stream s) {
          naming_config_arguments(
              [&] { gated_linear_backward(dyv, xv, wv, pv, config, g.dxv, g.dwv, g.dbv, wsv, s); });
        });
        return g.arrays();
      },
      arg("dy").none(), arg("x").none(), arg("weight").none(), arg("pre_activation").none(),
      arg("activation").none(), arg("layout").none(), arg("need_dx").none(), arg("need_dweight").none(),
      arg("need_dbias").none(),
      "gated_linear_backward allocating the gradients asked for and the workspace through the framework "
      "of x; returns (dx, dweight, dbias), None where not asked for.");
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
        const Needed needed = needed_gradients(c, need_dx_arg, need_dweight_arg, need_dbias_arg);
        const TensorView dov = c.contiguous(dout, "dout");
        const TensorView xv = c.contiguous(x, "x");
        const TensorView wv = weight_operand(c, weight);
        const OptionalTensor pv = c.optional_contiguous(pre_activation, "pre_activation");
        Gradients g = allocate_gradients(c, needed, xv, wv);
        const OptionalTensor wsv =
            c.auto_workspace(linear_workspace(linear_backward_workspace_size, xv, wv, act));
        c.run(nb::none(), [&](Stream s) {
          linear_backward(dov, xv, wv, pv, act, g.dxv, g.dwv, g.dbv, wsv, s);
        });
        return g.arrays();
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

  def_workspace_size(m, "linear_backward_through_input_activation_workspace_size",
                     linear_backward_through_input_activation_workspace_size,
                     "Bytes of u8 scratch memory linear_backward_through_input_activation needs (0 on the CPU).");

  m.def(
      "linear_backward_through_input_activation",
      [](nb::handle dout, nb::handle x, nb::handle weight, nb::handle pre_activation, nb::handle activation,
         nb::handle x_pre_activation, nb::handle x_activation, nb::handle dx_pre_activation,
         nb::handle dx_pre_activation_sum, nb::handle dweight, nb::handle dbias, nb::handle workspace,
         nb::handle stream) {
        OpCall c("linear_backward_through_input_activation");
        const Activation act = c.activation(activation);
        const Activation x_act = c.activation(x_activation, "x_activation");
        const TensorView dov = c.tensor(dout, "dout", Access::read);
        const TensorView xv = c.tensor(x, "x", Access::read);
        const TensorView wv = c.tensor(weight, "weight", Access::read);
        const OptionalTensor pv = c.optional(pre_activation, "pre_activation", Access::read);
        const TensorView xpv = c.tensor(x_pre_activation, "x_pre_activation", Access::read);
        const TensorView dxpv = c.tensor(dx_pre_activation, "dx_pre_activation", Access::write);
        const OptionalTensor sv = c.optional(dx_pre_activation_sum, "dx_pre_activation_sum", Access::write);
        const OptionalTensor dwv = c.optional(dweight, "dweight", Access::write);
        const OptionalTensor dbv = c.optional(dbias, "dbias", Access::write);
        const OptionalTensor wsv = c.workspace(
            workspace, linear_workspace(linear_backward_through_input_activation_workspace_size, xv, wv, act));
        c.run(stream, [&](Stream s) {
          linear_backward_through_input_activation(dov, xv, wv, pv, act, xpv, x_act, dxpv, sv, dwv, dbv, wsv, s);
        });
      },
      arg("dout").none(), arg("x").none(), arg("weight").none(), arg("pre_activation").none(),
      arg("activation").none(), arg("x_pre_activation").none(), arg("x_activation").none(),
      arg("dx_pre_activation").none(), arg("dx_pre_activation_sum").none() = none, arg("dweight").none() = none,
      arg("dbias").none() = none, arg("workspace").none() = none, arg("stream").none() = none,
      "For x = x_activation(x_pre_activation): dx_pre_activation = (dz W) * x_activation'(x_pre_activation) "
      "in place of dx, its column sums (the previous layer's dbias), and any of dweight, dbias.");

  bind_gated_linear(m);
}

}  // namespace fusekit::python
