// Public entry points of the bias + activation + dropout family: argument checks, then dispatch
// on where the tensors live (CPU reference or CUDA kernels).
#include <climits>
#include <cmath>
#include <string>

#include "core/format.h"
#include "core/validate.h"
#include "bias_act_dropout/bias_act_dropout_params.h"
#include "fusekit/bias_act_dropout.h"
#include "fusekit/runtime.h"

namespace fusekit {

using detail::arg;
using detail::kFloatDtypes;
using detail::ArgCheck;
using detail::RowLayout;

namespace {

// Columns are indexed with 32-bit block coordinates on the GPU; rows by ArgCheck::row_limits.
constexpr std::int64_t kMaxCols = INT_MAX;

// p, activation and slope; fills the scalars both backends read.
bias_act_dropout::Scalars check_config(const ArgCheck& check, const BiasActDropoutConfig& c) {
  if (!(c.p >= 0.0f && c.p < 1.0f))
    check.fail("p", "a drop probability in [0, 1)", detail::format_float(c.p));
  switch (c.activation) {
    case Activation::none: case Activation::relu: case Activation::gelu_erf:
    case Activation::gelu_tanh: case Activation::squared_relu: case Activation::leaky_relu:
    case Activation::silu:
      break;
    default:
      check.fail("activation", "one of none, relu, gelu_erf, gelu_tanh, squared_relu, leaky_relu, silu",
                 "value " + std::to_string(static_cast<int>(c.activation)));
  }
  if (c.activation == Activation::leaky_relu && !std::isfinite(c.slope))
    check.fail("slope", "a finite leaky_relu slope", detail::format_float(c.slope));
  bias_act_dropout::Scalars s;
  s.activation = c.activation;
  s.slope = c.activation == Activation::leaky_relu ? c.slope : 0.0f;
  s.p = c.p;
  s.keep_threshold = dropout_keep_threshold(c.p);
  s.keep_threshold2 = s.keep_threshold | (s.keep_threshold << 16);
  s.keep = 1.0f - c.p;
  s.scale = 1.0f / s.keep;
  s.set_seed(c.seed);
  s.offset = c.offset;
  return s;
}

// bias / dbias: length N, x's dtype or f32.
void check_bias_like(const ArgCheck& check, const TensorView& t, const char* name,
                     std::int64_t cols, DType x_dtype) {
  check.vector(t, name, cols);
  if (t.dtype != x_dtype && t.dtype != DType::f32)
    check.fail(name, std::string("dtype ") + dtype_name(x_dtype) + " (as x) or f32",
               dtype_name(t.dtype));
}

// The fields both directions share: the config's scalars, the size and dtype of the tensor they
// lead with (x forward, dy backward), and the optional bias (without one, bias_dtype is that
// dtype).
template <typename Params>
void set_shared_fields(const ArgCheck& check, const BiasActDropoutConfig& config,
                       const TensorView& lead, const RowLayout& layout, const OptionalTensor& bias,
                       Params& p) {
  p.s = check_config(check, config);
  p.rows = layout.rows;
  p.cols = layout.cols;
  p.dtype = lead.dtype;
  p.bias_dtype = lead.dtype;
  if (bias) {
    check_bias_like(check, *bias, "bias", layout.cols, lead.dtype);
    p.bias = bias->data;
    p.bias_dtype = bias->dtype;
  }
}

}  // namespace

void bias_act_dropout_forward(const TensorView& x, const OptionalTensor& bias,
                              const BiasActDropoutConfig& config, const TensorView& y,
                              const OptionalTensor& pre_activation, Stream stream) {
  ArgCheck check("bias_act_dropout_forward");
  const Device device = check.same_device(
      {arg("x", x), arg("bias", bias), arg("y", y), arg("pre_activation", pre_activation)});
  const RowLayout xl = check.leading_rows(x, "x", kFloatDtypes, kMaxCols);
  const RowLayout yl = check.rows_and_dtype_as(y, "y", x, xl, "x");

  bias_act_dropout::ForwardParams p;
  set_shared_fields(check, config, x, xl, bias, p);
  if (pre_activation) {
    const RowLayout hl = check.rows_and_dtype_as(*pre_activation, "pre_activation", x, xl, "x");
    p.pre_activation = pre_activation->data;
    p.pre_activation_row_stride = hl.row_stride;
  }
  p.x = x.data;
  p.x_row_stride = xl.row_stride;
  p.y = y.data;
  p.y_row_stride = yl.row_stride;
  check.no_overlap({arg("y", y), arg("pre_activation", pre_activation)}, {arg("x", x), arg("bias", bias)});
  if (p.rows == 0) return;
  if (device.is_cuda()) {
    require_supported_gpu(check.op(), device.index);
    bias_act_dropout::forward_cuda(p, device.index, stream);
  } else {
    bias_act_dropout::forward_cpu(p);
  }
}

std::size_t bias_act_dropout_backward_workspace_size(std::int64_t rows, std::int64_t cols,
                                                     DType dtype, Device device) {
  const ArgCheck check("bias_act_dropout_backward_workspace_size");
  check.size_in(rows, "rows", 0, INT_MAX);
  check.size_in(cols, "cols", 0, kMaxCols);
  check.dtype_arg_in(dtype, "dtype", kFloatDtypes);
  if (!device.is_cuda() || rows == 0 || cols == 0) return 0;
  return bias_act_dropout::backward_workspace_cuda(rows, cols, dtype, device.index);
}

void bias_act_dropout_backward(const TensorView& dy, const TensorView& x,
                               const OptionalTensor& bias, const BiasActDropoutConfig& config,
                               const OptionalTensor& dx, const OptionalTensor& dbias,
                               const OptionalTensor& workspace, Stream stream) {
  ArgCheck check("bias_act_dropout_backward");
  const Device device = check.same_device({arg("dy", dy), arg("x", x), arg("bias", bias),
                                           arg("dx", dx), arg("dbias", dbias),
                                           arg("workspace", workspace)});
  const RowLayout dyl = check.leading_rows(dy, "dy", kFloatDtypes, kMaxCols);
  const RowLayout xl = check.rows_and_dtype_as(x, "x", dy, dyl, "dy");

  bias_act_dropout::BackwardParams p;
  set_shared_fields(check, config, dy, dyl, bias, p);
  p.dbias_dtype = dy.dtype;
  if (dx) {
    const RowLayout dxl = check.rows_and_dtype_as(*dx, "dx", dy, dyl, "dy");
    p.dx = dx->data;
    p.dx_row_stride = dxl.row_stride;
  }
  if (dbias) {
    check_bias_like(check, *dbias, "dbias", dyl.cols, dy.dtype);
    p.dbias = dbias->data;
    p.dbias_dtype = dbias->dtype;
  }
  p.dy = dy.data;
  p.dy_row_stride = dyl.row_stride;
  p.x = x.data;
  p.x_row_stride = xl.row_stride;
  check.no_overlap({arg("dx", dx), arg("dbias", dbias), arg("workspace", workspace)},
                   {arg("dy", dy), arg("x", x), arg("bias", bias)});
  if (!p.dx && !p.dbias) return;  // nothing requested

  if (device.is_cuda()) {
    require_supported_gpu(check.op(), device.index);
    if (p.dbias && p.rows > 0) {
      const std::size_t need = bias_act_dropout::backward_workspace_cuda(p.rows, p.cols, p.dtype, device.index);
      const detail::Workspace ws =
          check.workspace(workspace, need, "bias_act_dropout_backward_workspace_size", 16);
      p.workspace = ws.data;
      p.workspace_bytes = ws.bytes;
    }
    bias_act_dropout::backward_cuda(p, device.index, stream);
  } else {
    bias_act_dropout::backward_cpu(p);
  }
}

}  // namespace fusekit
