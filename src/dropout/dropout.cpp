// Public entry points of the bias + activation + dropout family: argument checks, then dispatch
// on where the tensors live (CPU reference or CUDA kernels).
#include <climits>
#include <cmath>
#include <string>

#include "core/format.h"
#include "core/validate.h"
#include "dropout/dropout_params.h"
#include "fusekit/dropout.h"
#include "fusekit/runtime.h"

namespace fusekit {

using detail::arg;
using detail::ArgCheck;
using detail::RowLayout;

namespace {

constexpr std::initializer_list<DType> kActivationDtypes = {DType::f32, DType::f16, DType::bf16};
// Columns are indexed with 32-bit block coordinates on the GPU; rows by ArgCheck::row_limits.
constexpr std::int64_t kMaxCols = INT_MAX;

// p, activation and slope; fills the scalars both backends read.
dropout::Scalars check_config(const ArgCheck& check, const BiasActDropoutConfig& c) {
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
  dropout::Scalars s;
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

// A tensor shaped and typed like `ref` (its own row stride allowed).
RowLayout check_like(const ArgCheck& check, const TensorView& t, const char* name,
                     const RowLayout& ref, const TensorView& ref_view, const char* ref_name) {
  check.dtype_is(t, name, ref_view.dtype, (std::string("as '") + ref_name + "'").c_str());
  const RowLayout l = check.rows(t, name);
  if (l.rows != ref.rows || l.cols != ref.cols)
    check.fail(name, "shape " + ref_view.shape_string() + " (as '" + ref_name + "')",
               t.shape_string());
  return l;
}

}  // namespace

void bias_act_dropout_forward(const TensorView& x, const OptionalTensor& bias,
                              const BiasActDropoutConfig& config, const TensorView& y,
                              const OptionalTensor& pre_activation, Stream stream) {
  ArgCheck check("bias_act_dropout_forward");
  const Device device = check.same_device(
      {arg("x", x), arg("bias", bias), arg("y", y), arg("pre_activation", pre_activation)});
  check.dtype_in(x, "x", kActivationDtypes);
  const RowLayout xl = check.rows(x, "x");
  check.row_limits(xl, "x", kMaxCols);
  const RowLayout yl = check_like(check, y, "y", xl, x, "x");

  dropout::ForwardParams p;
  p.s = check_config(check, config);
  p.rows = xl.rows;
  p.cols = xl.cols;
  p.dtype = x.dtype;
  p.bias_dtype = x.dtype;
  if (bias) {
    check_bias_like(check, *bias, "bias", xl.cols, x.dtype);
    p.bias = bias->data;
    p.bias_dtype = bias->dtype;
  }
  if (pre_activation) {
    const RowLayout hl = check_like(check, *pre_activation, "pre_activation", xl, x, "x");
    p.pre_activation = pre_activation->data;
    p.pre_activation_row_stride = hl.row_stride;
  }
  p.x = x.data;
  p.x_row_stride = xl.row_stride;
  p.y = y.data;
  p.y_row_stride = yl.row_stride;
  if (p.rows == 0) return;
  if (device.is_cuda()) {
    require_supported_gpu(check.op(), device.index);
    dropout::forward_cuda(p, device.index, stream);
  } else {
    dropout::forward_cpu(p);
  }
}

std::size_t bias_act_dropout_backward_workspace_size(std::int64_t rows, std::int64_t cols,
                                                     DType dtype, Device device) {
  if (!device.is_cuda() || rows <= 0 || cols <= 0) return 0;
  return dropout::backward_workspace_cuda(rows, cols, dtype, device.index);
}

void bias_act_dropout_backward(const TensorView& dy, const TensorView& x,
                               const OptionalTensor& bias, const BiasActDropoutConfig& config,
                               const OptionalTensor& dx, const OptionalTensor& dbias,
                               const OptionalTensor& workspace, Stream stream) {
  ArgCheck check("bias_act_dropout_backward");
  const Device device = check.same_device({arg("dy", dy), arg("x", x), arg("bias", bias),
                                           arg("dx", dx), arg("dbias", dbias),
                                           arg("workspace", workspace)});
  check.dtype_in(dy, "dy", kActivationDtypes);
  const RowLayout dyl = check.rows(dy, "dy");
  check.row_limits(dyl, "dy", kMaxCols);
  const RowLayout xl = check_like(check, x, "x", dyl, dy, "dy");

  dropout::BackwardParams p;
  p.s = check_config(check, config);
  p.rows = dyl.rows;
  p.cols = dyl.cols;
  p.dtype = dy.dtype;
  p.bias_dtype = dy.dtype;
  p.dbias_dtype = dy.dtype;
  if (bias) {
    check_bias_like(check, *bias, "bias", dyl.cols, dy.dtype);
    p.bias = bias->data;
    p.bias_dtype = bias->dtype;
  }
  if (dx) {
    const RowLayout dxl = check_like(check, *dx, "dx", dyl, dy, "dy");
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
  if (!p.dx && !p.dbias) return;  // nothing requested

  if (device.is_cuda()) {
    require_supported_gpu(check.op(), device.index);
    if (p.dbias && p.rows > 0) {
      const std::size_t need = dropout::backward_workspace_cuda(p.rows, p.cols, p.dtype, device.index);
      const std::string expected = "a contiguous u8 tensor of at least " + std::to_string(need) +
                                   " bytes (bias_act_dropout_backward_workspace_size)";
      if (!workspace) check.fail("workspace", expected, "none");
      const TensorView& ws = *workspace;
      check.has_data(ws, "workspace");
      if (ws.dtype != DType::u8 || static_cast<std::size_t>(ws.numel()) < need || !ws.is_contiguous())
        check.fail("workspace", expected,
                   std::string(dtype_name(ws.dtype)) + " tensor of shape " + ws.shape_string());
      if (reinterpret_cast<std::uintptr_t>(ws.data) % 16 != 0)
        check.fail("workspace", "a 16-byte aligned pointer", "a misaligned pointer");
      p.workspace = ws.data;
      p.workspace_bytes = static_cast<std::size_t>(ws.numel());
    }
    dropout::backward_cuda(p, device.index, stream);
  } else {
    dropout::backward_cpu(p);
  }
}

}  // namespace fusekit
