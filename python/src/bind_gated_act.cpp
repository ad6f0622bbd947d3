// Gated-activation bindings (fusekit/gated_act.h). GatedActConfig is flattened into its fields:
// activation in the C++ argument position, layout and in_place_backward (which have defaults) after
// the outputs; outputs are arrays the caller allocates. The private *_alloc bindings are
// fusekit.torch's: they allocate the outputs through the caller's framework (bindings.h).
#include <cstdint>

#include "bindings.h"
#include "fusekit/gated_act.h"

namespace fusekit::python {

namespace {

constexpr GatedLayout kLayouts[] = {GatedLayout::halves, GatedLayout::interleaved};

}  // namespace

GatedLayout gated_layout_arg(const ScalarArgs& c, nb::handle value) {
  return c.option(value, "layout", "fusekit.GatedLayout", kLayouts, gated_layout_name);
}

namespace {

// The configs from their flattened arguments, converted before the arrays (a mistyped scalar is
// reported first, as PyTorch's argument parser checks every type first). `layout` is a
// fusekit.GatedLayout or its name.
GatedActConfig make_config(const ScalarArgs& c, nb::handle activation, nb::handle layout) {
  GatedActConfig config;
  config.activation = c.activation(activation);
  config.layout = gated_layout_arg(c, layout);
  return config;
}

// The two-tensor form's config (no layout).
GatedActConfig separate_config(const ScalarArgs& c, nb::handle activation) {
  GatedActConfig config;
  config.activation = c.activation(activation);
  return config;
}

// Whether the ops take `t` as it is: the last dimension contiguous and the leading ones flattening
// into one row stride of at least the row length (ArgCheck::rows).
bool takes_rows(const TensorView& t) {
  if (t.ndim < 1) return true;  // the op's own error
  const std::int64_t cols = t.shape[t.ndim - 1];
  if (cols > 1 && t.strides[t.ndim - 1] != 1) return false;
  for (int d = t.ndim - 3; d >= 0; --d)
    if (t.shape[d] > 1 && t.strides[d] != t.strides[d + 1] * t.shape[d + 1]) return false;
  std::int64_t rows = 1;
  for (int d = 0; d < t.ndim - 1; ++d) rows *= t.shape[d];
  return rows <= 1 || t.ndim < 2 || t.strides[t.ndim - 2] >= cols;
}

// fusekit.torch's inputs: as they are where the ops take their layout (e.g. the halves of a
// gate_up.chunk(2, -1)), else made contiguous.
TensorView rows_input(OpCall& c, nb::handle obj, const char* name) {
  const TensorView t = c.tensor(obj, name, Access::read);
  return takes_rows(t) ? t : c.contiguous(obj, name);
}

}  // namespace

void bind_gated_act(nb::module_& m) {
  using nb::arg;
  const auto none = nb::none();
  const auto halves = nb::str("halves");

  auto e = nb::enum_<GatedLayout>(m, "GatedLayout",
                                  "Where gate and up sit in a (..., 2F) gate_up tensor: halves ([gate | up]) "
                                  "or interleaved (gate j at column 2j, up j at 2j + 1).");
  for (GatedLayout l : kLayouts) e.value(gated_layout_name(l), l);

  m.def(
      "gated_act_forward",
      [](nb::handle gate_up, nb::handle activation, nb::handle y, nb::handle layout, nb::handle stream) {
        OpCall c("gated_act_forward");
        const GatedActConfig config = make_config(c, activation, layout);
        const TensorView gv = c.tensor(gate_up, "gate_up", Access::read);
        const TensorView yv = c.tensor(y, "y", Access::write);
        c.run(stream, [&](Stream s) { gated_act_forward(gv, config, yv, s); });
      },
      arg("gate_up").none(), arg("activation").none(), arg("y").none(), arg("layout").none() = halves,
      arg("stream").none() = none,
      "y = act(gate) * up from one (..., 2F) array gate_up (layout 'halves': [gate | up]; "
      "'interleaved': gate j at column 2j, up j at 2j + 1). activation: 'silu', 'gelu_tanh', "
      "'gelu_erf' or 'relu' (or fusekit.Activation).");

  m.def(
      "gated_act_backward",
      [](nb::handle dy, nb::handle gate_up, nb::handle activation, nb::handle dgate_up, nb::handle layout,
         nb::handle in_place_backward, nb::handle stream) {
        OpCall c("gated_act_backward");
        GatedActConfig config = make_config(c, activation, layout);
        config.in_place_backward = c.flag(in_place_backward, "in_place_backward");
        const TensorView dyv = c.tensor(dy, "dy", Access::read);
        const TensorView gv = c.tensor(gate_up, "gate_up", Access::read);
        const TensorView dgv = c.tensor(dgate_up, "dgate_up", Access::write);
        c.run(stream, [&](Stream s) { gated_act_backward(dyv, gv, config, dgv, s); });
      },
      arg("dy").none(), arg("gate_up").none(), arg("activation").none(), arg("dgate_up").none(),
      arg("layout").none() = halves, arg("in_place_backward").none() = false, arg("stream").none() = none,
      "dgate_up = [dy * up * act'(gate), dy * act(gate)] in gate_up's layout. "
      "in_place_backward=True lets dgate_up be gate_up itself.");

  m.def(
      "gated_act_forward_separate",
      [](nb::handle gate, nb::handle up, nb::handle activation, nb::handle y, nb::handle stream) {
        OpCall c("gated_act_forward_separate");
        const GatedActConfig config = separate_config(c, activation);
        const TensorView gv = c.tensor(gate, "gate", Access::read);
        const TensorView uv = c.tensor(up, "up", Access::read);
        const TensorView yv = c.tensor(y, "y", Access::write);
        c.run(stream, [&](Stream s) { gated_act_forward_separate(gv, uv, config, yv, s); });
      },
      arg("gate").none(), arg("up").none(), arg("activation").none(), arg("y").none(),
      arg("stream").none() = none, "y = act(gate) * up from two (..., F) arrays.");

  m.def(
      "gated_act_backward_separate",
      [](nb::handle dy, nb::handle gate, nb::handle up, nb::handle activation, nb::handle dgate, nb::handle dup,
         nb::handle in_place_backward, nb::handle stream) {
        OpCall c("gated_act_backward_separate");
        GatedActConfig config = separate_config(c, activation);
        config.in_place_backward = c.flag(in_place_backward, "in_place_backward");
        const TensorView dyv = c.tensor(dy, "dy", Access::read);
        const TensorView gv = c.tensor(gate, "gate", Access::read);
        const TensorView uv = c.tensor(up, "up", Access::read);
        const OptionalTensor dgv = c.optional(dgate, "dgate", Access::write);
        const OptionalTensor duv = c.optional(dup, "dup", Access::write);
        c.run(stream, [&](Stream s) { gated_act_backward_separate(dyv, gv, uv, config, dgv, duv, s); });
      },
      arg("dy").none(), arg("gate").none(), arg("up").none(), arg("activation").none(),
      arg("dgate").none() = none, arg("dup").none() = none, arg("in_place_backward").none() = false,
      arg("stream").none() = none,
      "dgate = dy * up * act'(gate), dup = dy * act(gate) (each optional). in_place_backward=True "
      "lets dgate be gate itself and dup be up itself.");

  // fusekit.torch's calls: the same ops with the outputs allocated through the inputs' framework.
  m.def(
      "_gated_act_forward_alloc",
      [](nb::handle gate_up, nb::handle activation, nb::handle layout) {
        OpCall c("gated_act_forward");
        const GatedActConfig config = make_config(c, activation, layout);
        const TensorView gv = rows_input(c, gate_up, "gate_up");
        TensorView yv;
        nb::object y = c.new_array(OpCall::spec_like(gv, gv.dtype, rows_cols(gv).second / 2), &yv);
        c.run(nb::none(), [&](Stream s) { gated_act_forward(gv, config, yv, s); });
        return y;
      },
      arg("gate_up").none(), arg("activation").none(), arg("layout").none(),
      "gated_act_forward allocating y through gate_up's framework (PyTorch >= 2.10).");

  m.def(
      "_gated_act_backward_alloc",
      [](nb::handle dy, nb::handle gate_up, nb::handle activation, nb::handle layout) {
        OpCall c("gated_act_backward");
        const GatedActConfig config = make_config(c, activation, layout);
        const TensorView dyv = rows_input(c, dy, "dy");
        const TensorView gv = rows_input(c, gate_up, "gate_up");
        TensorView dgv;
        nb::object dgate_up = c.new_array(OpCall::spec_like(gv, gv.dtype, rows_cols(gv).second), &dgv);
        c.run(nb::none(), [&](Stream s) { gated_act_backward(dyv, gv, config, dgv, s); });
        return dgate_up;
      },
      arg("dy").none(), arg("gate_up").none(), arg("activation").none(), arg("layout").none(),
      "gated_act_backward allocating dgate_up through gate_up's framework (PyTorch >= 2.10).");

  m.def(
      "_gated_act_forward_separate_alloc",
      [](nb::handle gate, nb::handle up, nb::handle activation) {
        OpCall c("gated_act_forward_separate");
        const GatedActConfig config = separate_config(c, activation);
        const TensorView gv = rows_input(c, gate, "gate");
        const TensorView uv = rows_input(c, up, "up");
        TensorView yv;
        nb::object y = c.new_array(OpCall::spec_like(gv, gv.dtype, rows_cols(gv).second), &yv);
        c.run(nb::none(), [&](Stream s) { gated_act_forward_separate(gv, uv, config, yv, s); });
        return y;
      },
      arg("gate").none(), arg("up").none(), arg("activation").none(),
      "gated_act_forward_separate allocating y through gate's framework (PyTorch >= 2.10).");

  m.def(
      "_gated_act_backward_separate_alloc",
      [](nb::handle dy, nb::handle gate, nb::handle up, nb::handle activation, nb::handle need_dgate_arg,
         nb::handle need_dup_arg) {
        OpCall c("gated_act_backward_separate");
        const GatedActConfig config = separate_config(c, activation);
        const bool need_dgate = c.flag(need_dgate_arg, "need_dgate");
        const bool need_dup = c.flag(need_dup_arg, "need_dup");
        const TensorView dyv = rows_input(c, dy, "dy");
        const TensorView gv = rows_input(c, gate, "gate");
        const TensorView uv = rows_input(c, up, "up");
        const std::int64_t cols = rows_cols(gv).second;
        OptionalTensor dgv, duv;
        nb::object dgate = c.new_optional(need_dgate, OpCall::spec_like(gv, gv.dtype, cols), &dgv);
        nb::object dup = c.new_optional(need_dup, OpCall::spec_like(gv, gv.dtype, cols), &duv);
        c.run(nb::none(), [&](Stream s) { gated_act_backward_separate(dyv, gv, uv, config, dgv, duv, s); });
        return nb::make_tuple(dgate, dup);
      },
      arg("dy").none(), arg("gate").none(), arg("up").none(), arg("activation").none(), arg("need_dgate").none(),
      arg("need_dup").none(),
      "gated_act_backward_separate allocating dgate and dup (each when asked for, else None) through "
      "gate's framework (PyTorch >= 2.10).");
}

}  // namespace fusekit::python
