// Public entry points of the gated-activation family: argument checks, then dispatch on where the
// tensors live (CPU reference or CUDA kernels).
#include <string>

#include "core/validate.h"
#include "fusekit/gated_act.h"
#include "fusekit/runtime.h"
#include "gated_act/gated_act_params.h"

namespace fusekit {

using detail::arg;
using detail::ArgCheck;
using detail::kFloatDtypes;
using detail::same_view;
using detail::RowLayout;

namespace {

// F: the kernels index columns with 32-bit integers, and the one-tensor form has 2F of them.
constexpr std::int64_t kMaxCols = (std::int64_t{1} << 30) - 1;

void check_activation(const ArgCheck& check, Activation a) {
  const char* gates = "silu (SwiGLU), gelu_tanh or gelu_erf (GeGLU), or relu (ReGLU)";
  switch (a) {
    case Activation::silu:
    case Activation::gelu_tanh:
    case Activation::gelu_erf:
    case Activation::relu: return;
    case Activation::none:
    case Activation::squared_relu:
    case Activation::leaky_relu: check.fail("activation", gates, activation_name(a));
  }
  check.fail("activation", gates, "activation code " + std::to_string(static_cast<int>(a)));
}

void check_layout(const ArgCheck& check, GatedLayout layout) {
  if (layout != GatedLayout::halves && layout != GatedLayout::interleaved)
    check.fail("layout", "halves or interleaved", "layout code " + std::to_string(static_cast<int>(layout)));
}

// The one-tensor form's input: (..., 2F) rows of an even length; returns its layout (cols = 2F).
RowLayout check_gate_up(const ArgCheck& check, const TensorView& gate_up) {
  const RowLayout l = check.leading_rows(gate_up, "gate_up", kFloatDtypes, 2 * kMaxCols);
  if (l.cols % 2 != 0)
    check.fail("gate_up", "an even last dimension 2F (F columns of gate, F of up)",
               "last dimension " + std::to_string(l.cols));
  return l;
}

// y or dy of the one-tensor form: gate_up's dtype and leading dimensions, F = cols columns.
RowLayout check_half_rows(const ArgCheck& check, const TensorView& t, const char* name, const TensorView& gate_up,
                          std::int64_t cols) {
  check.dtype_is(t, name, gate_up.dtype, "as 'gate_up'");
  TensorView expected = gate_up;
  expected.shape[expected.ndim - 1] = cols;
  bool same = t.ndim == expected.ndim;
  for (int d = 0; same && d < t.ndim; ++d) same = t.shape[d] == expected.shape[d];
  if (!same)
    check.fail(name, "shape " + expected.shape_string() + " (gate_up's leading dimensions, F = " +
                         std::to_string(cols) + " columns)",
               t.shape_string());
  return check.rows(t, name);
}

// `input` as an argument of the overlap check of its own gradient: left out where the gradient may
// be written over it (in-place backward, exactly its view).
OptionalTensor unless_aliased(const TensorView& input, const OptionalTensor& grad, bool in_place) {
  if (in_place && grad && same_view(*grad, input)) return std::nullopt;
  return input;
}

// Fills the input description of the one-tensor form.
gated_act::GateUp<const void*> gate_up_inputs(const TensorView& gate_up, const RowLayout& gl, GatedLayout layout) {
  gated_act::GateUp<const void*> in;
  in.gate = gate_up.data;
  in.gate_row_stride = gl.row_stride;
  if (layout == GatedLayout::halves) {
    in.up = static_cast<const char*>(gate_up.data) + gl.cols / 2 * dtype_size(gate_up.dtype);
    in.up_row_stride = gl.row_stride;
  }
  return in;
}

void run_forward(const ArgCheck& check, Device device, const gated_act::ForwardParams& p, Stream stream) {
  if (p.rows == 0) return;
  if (device.is_cuda()) {
    require_supported_gpu(check.op(), device.index);
    gated_act::forward_cuda(check.op(), p, device.index, stream);
  } else {
    gated_act::forward_cpu(p);
  }
}

void run_backward(const ArgCheck& check, Device device, const gated_act::BackwardParams& p, Stream stream) {
  if (p.rows == 0 || (!p.grad.gate && !p.grad.up)) return;
  if (device.is_cuda()) {
    require_supported_gpu(check.op(), device.index);
    gated_act::backward_cuda(check.op(), p, device.index, stream);
  } else {
    gated_act::backward_cpu(p);
  }
}

}  // namespace

const char* gated_layout_name(GatedLayout layout) {
  switch (layout) {
    case GatedLayout::halves: return "halves";
    case GatedLayout::interleaved: return "interleaved";
  }
  return "unknown";
}

void gated_act_forward(const TensorView& gate_up, const GatedActConfig& config, const TensorView& y, Stream stream) {
  ArgCheck check("gated_act_forward");
  const Device device = check.same_device({arg("gate_up", gate_up), arg("y", y)});
  check_activation(check, config.activation);
  check_layout(check, config.layout);
  const RowLayout gl = check_gate_up(check, gate_up);
  const std::int64_t cols = gl.cols / 2;
  const RowLayout yl = check_half_rows(check, y, "y", gate_up, cols);
  check.no_overlap({arg("y", y)}, {arg("gate_up", gate_up)});

  gated_act::ForwardParams p;
  p.rows = gl.rows;
  p.cols = cols;
  p.dtype = gate_up.dtype;
  p.activation = config.activation;
  p.interleaved = config.layout == GatedLayout::interleaved;
  p.in = gate_up_inputs(gate_up, gl, config.layout);
  p.y = y.data;
  p.y_row_stride = yl.row_stride;
  run_forward(check, device, p, stream);
}

void gated_act_backward(const TensorView& dy, const TensorView& gate_up, const GatedActConfig& config,
                        const TensorView& dgate_up, Stream stream) {
  ArgCheck check("gated_act_backward");
  const Device device =
      check.same_device({arg("dy", dy), arg("gate_up", gate_up), arg("dgate_up", dgate_up)});
  check_activation(check, config.activation);
  check_layout(check, config.layout);
  const RowLayout gl = check_gate_up(check, gate_up);
  const std::int64_t cols = gl.cols / 2;
  const RowLayout dyl = check_half_rows(check, dy, "dy", gate_up, cols);
  const RowLayout dgl = check.rows_and_dtype_as(dgate_up, "dgate_up", gate_up, gl, "gate_up");
  check.no_overlap({arg("dgate_up", dgate_up)},
                   {arg("dy", dy), arg("gate_up", unless_aliased(gate_up, dgate_up, config.in_place_backward))});

  gated_act::BackwardParams p;
  p.rows = gl.rows;
  p.cols = cols;
  p.dtype = gate_up.dtype;
  p.activation = config.activation;
  p.interleaved = config.layout == GatedLayout::interleaved;
  p.dy = dy.data;
  p.dy_row_stride = dyl.row_stride;
  p.in = gate_up_inputs(gate_up, gl, config.layout);
  const gated_act::GateUp<const void*> out = gate_up_inputs(dgate_up, dgl, config.layout);
  p.grad.gate = const_cast<void*>(out.gate);
  p.grad.up = const_cast<void*>(out.up);
  p.grad.gate_row_stride = out.gate_row_stride;
  p.grad.up_row_stride = out.up_row_stride;
  run_backward(check, device, p, stream);
}

void gated_act_forward_separate(const TensorView& gate, const TensorView& up, const GatedActConfig& config,
                                const TensorView& y, Stream stream) {
  ArgCheck check("gated_act_forward_separate");
  const Device device = check.same_device({arg("gate", gate), arg("up", up), arg("y", y)});
  check_activation(check, config.activation);
  const RowLayout gl = check.leading_rows(gate, "gate", kFloatDtypes, kMaxCols);
  const RowLayout ul = check.rows_and_dtype_as(up, "up", gate, gl, "gate");
  const RowLayout yl = check.rows_and_dtype_as(y, "y", gate, gl, "gate");
  check.no_overlap({arg("y", y)}, {arg("gate", gate), arg("up", up)});

  gated_act::ForwardParams p;
  p.rows = gl.rows;
  p.cols = gl.cols;
  p.dtype = gate.dtype;
  p.activation = config.activation;
  p.in.gate = gate.data;
  p.in.gate_row_stride = gl.row_stride;
  p.in.up = up.data;
  p.in.up_row_stride = ul.row_stride;
  p.y = y.data;
  p.y_row_stride = yl.row_stride;
  run_forward(check, device, p, stream);
}

void gated_act_backward_separate(const TensorView& dy, const TensorView& gate, const TensorView& up,
                                 const GatedActConfig& config, const OptionalTensor& dgate,
                                 const OptionalTensor& dup, Stream stream) {
  ArgCheck check("gated_act_backward_separate");
  const Device device = check.same_device({arg("dy", dy), arg("gate", gate), arg("up", up),
                                           arg("dgate", dgate), arg("dup", dup)});
  check_activation(check, config.activation);
  const RowLayout gl = check.leading_rows(gate, "gate", kFloatDtypes, kMaxCols);
  const RowLayout ul = check.rows_and_dtype_as(up, "up", gate, gl, "gate");
  const RowLayout dyl = check.rows_and_dtype_as(dy, "dy", gate, gl, "gate");

  gated_act::BackwardParams p;
  if (dgate) {
    const RowLayout l = check.rows_and_dtype_as(*dgate, "dgate", gate, gl, "gate");
    p.grad.gate = dgate->data;
    p.grad.gate_row_stride = l.row_stride;
  }
  if (dup) {
    const RowLayout l = check.rows_and_dtype_as(*dup, "dup", gate, gl, "gate");
    p.grad.up = dup->data;
    p.grad.up_row_stride = l.row_stride;
  }
  // Each gradient apart from dy and from each other; apart from the inputs except, in place, its own.
  const bool in_place = config.in_place_backward;
  check.no_overlap({arg("dgate", dgate), arg("dup", dup)}, {arg("dy", dy)});
  check.no_overlap({arg("dgate", dgate)}, {arg("gate", unless_aliased(gate, dgate, in_place)), arg("up", up)});
  check.no_overlap({arg("dup", dup)}, {arg("gate", gate), arg("up", unless_aliased(up, dup, in_place))});

  p.rows = gl.rows;
  p.cols = gl.cols;
  p.dtype = gate.dtype;
  p.activation = config.activation;
  p.dy = dy.data;
  p.dy_row_stride = dyl.row_stride;
  p.in.gate = gate.data;
  p.in.gate_row_stride = gl.row_stride;
  p.in.up = up.data;
  p.in.up_row_stride = ul.row_stride;
  run_backward(check, device, p, stream);
}

}  // namespace fusekit
