// Public entry points of the normalization family: argument checks, then dispatch on where the
// tensors live (CPU reference or CUDA kernels).
#include <climits>
#include <string>

#include "core/convert.h"
#include "core/device_info.h"
#include "core/validate.h"
#include "fusekit/norm.h"
#include "fusekit/runtime.h"
#include "norm/norm_params.h"

namespace fusekit {

using detail::arg;
using detail::kFloatDtypes;
using detail::ArgCheck;
using detail::RowLayout;
using detail::same_view;

namespace {

// Weight-like vectors (weight, bias and their gradients): length N, x's dtype or f32, and one
// dtype for all of them.
void check_weight_like(const ArgCheck& check, const TensorView& t, const char* name,
                       std::int64_t cols, DType x_dtype, DType* weight_dtype,
                       const char** weight_name) {
  check.vector(t, name, cols);
  if (*weight_name == nullptr) {
    if (t.dtype != x_dtype && t.dtype != DType::f32)
      check.fail(name, std::string("dtype ") + dtype_name(x_dtype) + " (as x) or f32",
                 dtype_name(t.dtype));
    *weight_dtype = t.dtype;
    *weight_name = name;
  } else if (t.dtype != *weight_dtype) {
    check.fail(name, std::string("dtype ") + dtype_name(*weight_dtype) + " (as '" + *weight_name + "')",
               dtype_name(t.dtype));
  }
}

// The *_from_output backwards divide by the weight (x_hat = (y - bias) / weight): a zero element
// would give NaN in dx and dweight. A CPU weight is read here; on the GPU the check would cost a
// device-to-host copy (a synchronization) per call, so there it is a documented precondition.
void check_weight_nonzero(const ArgCheck& check, const TensorView& w) {
  if (w.device.is_cuda()) return;
  for (std::int64_t c = 0; c < w.shape[0]; ++c)
    if (detail::load_as_double(w.data, w.dtype, c * w.strides[0]) == 0.0)
      check.fail("weight", "non-zero elements (the backward from y divides by the weight)",
                 "weight[" + std::to_string(c) + "] = 0");
}

void prepare_cuda(const char* op, Device device) {
  require_supported_gpu(op, device.index);
}

// `residual` given: the residual forward (the rows normalized are round(x + residual), written to
// `sum` when given).
void run_forward(const char* op, norm::Kind kind, const TensorView& x, const OptionalTensor& residual,
                 const OptionalTensor& weight, const OptionalTensor& bias, float eps,
                 const TensorView& y, const OptionalTensor& sum, const OptionalTensor& mean,
                 const OptionalTensor& rstd, Stream stream) {
  ArgCheck check(op);
  const Device device = check.same_device(
      {arg("x", x), arg("residual", residual), arg("weight", weight), arg("bias", bias), arg("y", y),
       arg("sum", sum), arg("mean", mean), arg("rstd", rstd)});
  const RowLayout xl = check.leading_rows(x, "x", kFloatDtypes, kNormMaxCols);
  const RowLayout yl = check.rows_and_dtype_as(y, "y", x, xl, "x");
  check.eps(eps, false);

  norm::ForwardParams p;
  p.kind = kind;
  p.rows = xl.rows;
  p.cols = xl.cols;
  p.dtype = x.dtype;
  p.weight_dtype = x.dtype;
  if (residual) {
    const RowLayout rl = check.rows_and_dtype_as(*residual, "residual", x, xl, "x");
    p.residual = residual->data;
    p.residual_row_stride = rl.row_stride;
  }
  if (sum) {
    const RowLayout sl = check.rows_and_dtype_as(*sum, "sum", x, xl, "x");
    p.sum = sum->data;
    p.sum_row_stride = sl.row_stride;
  }
  const char* weight_name = nullptr;
  if (weight) {
    check_weight_like(check, *weight, "weight", xl.cols, x.dtype, &p.weight_dtype, &weight_name);
    p.weight = weight->data;
  }
  if (bias) {
    check_weight_like(check, *bias, "bias", xl.cols, x.dtype, &p.weight_dtype, &weight_name);
    p.bias = bias->data;
  }
  if (mean) {
    check.dtype_is(*mean, "mean", DType::f32, "statistics are float32");
    check.contiguous_numel(*mean, "mean", xl.rows);
    p.mean = mean->data_as<float>();
  }
  if (rstd) {
    check.dtype_is(*rstd, "rstd", DType::f32, "statistics are float32");
    check.contiguous_numel(*rstd, "rstd", xl.rows);
    p.rstd = rstd->data_as<float>();
  }
  p.x = x.data;
  p.x_row_stride = xl.row_stride;
  p.y = y.data;
  p.y_row_stride = yl.row_stride;
  p.eps = eps;
  check.no_overlap({arg("y", y), arg("sum", sum), arg("mean", mean), arg("rstd", rstd)},
                   {arg("x", x), arg("residual", residual), arg("weight", weight), arg("bias", bias)});
  if (device.is_cuda()) {
    prepare_cuda(op, device);
    norm::forward_cuda(p, device.index, stream);
  } else {
    norm::forward_cpu(p);
  }
}

struct BackwardArgs {
  norm::Kind kind;
  bool from_output;
  const TensorView* dy;
  const TensorView* input;  // x or y
  const OptionalTensor* weight;
  const OptionalTensor* bias;  // from_output LayerNorm only
  const TensorView* mean;      // LayerNorm from x only
  const TensorView* rstd;
  const OptionalTensor* dsum;  // residual backward only
  const OptionalTensor* dx;
  const OptionalTensor* dweight;
  const OptionalTensor* dbias;
  const OptionalTensor* workspace;
};

void run_backward(const char* op, const BackwardArgs& a, Stream stream) {
  ArgCheck check(op);
  static const OptionalTensor kNone;
  const char* input_name = a.from_output ? "y" : a.dsum ? "sum" : "x";
  const OptionalTensor& dsum = a.dsum ? *a.dsum : kNone;
  const OptionalTensor mean = a.mean ? OptionalTensor(*a.mean) : kNone;
  const Device device = check.same_device(
      {arg("dy", *a.dy), arg(input_name, *a.input), arg("weight", *a.weight),
       arg("bias", a.bias ? *a.bias : kNone), arg("mean", mean), arg("rstd", *a.rstd),
       arg("dsum", dsum), arg("dx", *a.dx), arg("dweight", *a.dweight), arg("dbias", *a.dbias),
       arg("workspace", *a.workspace)});
  const RowLayout dyl = check.leading_rows(*a.dy, "dy", kFloatDtypes, kNormMaxCols);
  const RowLayout inl = check.rows_and_dtype_as(*a.input, input_name, *a.dy, dyl, "dy");

  norm::BackwardParams p;
  p.kind = a.kind;
  p.from_output = a.from_output;
  p.rows = dyl.rows;
  p.cols = dyl.cols;
  p.dtype = a.dy->dtype;
  p.weight_dtype = a.dy->dtype;
  const char* weight_name = nullptr;
  if (*a.weight) {
    check_weight_like(check, **a.weight, "weight", dyl.cols, p.dtype, &p.weight_dtype, &weight_name);
    if (a.from_output) check_weight_nonzero(check, **a.weight);
    p.weight = (*a.weight)->data;
  }
  if (a.bias && *a.bias) {
    check_weight_like(check, **a.bias, "bias", dyl.cols, p.dtype, &p.weight_dtype, &weight_name);
    p.bias = (*a.bias)->data;
  }
  if (a.mean) {
    check.dtype_is(*a.mean, "mean", DType::f32, "statistics are float32");
    check.contiguous_numel(*a.mean, "mean", dyl.rows);
    p.mean = a.mean->data_as<const float>();
  }
  check.dtype_is(*a.rstd, "rstd", DType::f32, "statistics are float32");
  check.contiguous_numel(*a.rstd, "rstd", dyl.rows);
  p.rstd = a.rstd->data_as<const float>();
  if (dsum) {
    const RowLayout dsl = check.rows_and_dtype_as(*dsum, "dsum", *a.dy, dyl, "dy");
    p.dsum = dsum->data;
    p.dsum_row_stride = dsl.row_stride;
  }
  if (*a.dx) {
    const RowLayout dxl = check.rows_and_dtype_as(**a.dx, "dx", *a.dy, dyl, "dy");
    p.dx = (*a.dx)->data;
    p.dx_row_stride = dxl.row_stride;
  }
  if (*a.dweight) {
    if (!*a.weight) check.fail("dweight", "no dweight (the norm was called without a weight)", "a tensor");
    check_weight_like(check, **a.dweight, "dweight", dyl.cols, p.dtype, &p.weight_dtype, &weight_name);
    p.dweight = (*a.dweight)->data;
  }
  if (*a.dbias) {
    check_weight_like(check, **a.dbias, "dbias", dyl.cols, p.dtype, &p.weight_dtype, &weight_name);
    p.dbias = (*a.dbias)->data;
  }
  p.dy = a.dy->data;
  p.dy_row_stride = dyl.row_stride;
  p.input = a.input->data;
  p.input_row_stride = inl.row_stride;

  // dx may be exactly dsum (in place); no other overlap.
  const bool dx_over_dsum = dsum && *a.dx && same_view(**a.dx, *dsum);
  check.no_overlap({arg("dx", *a.dx), arg("dweight", *a.dweight), arg("dbias", *a.dbias),
                    arg("workspace", *a.workspace)},
                   {arg("dy", *a.dy), arg(input_name, *a.input), arg("weight", *a.weight),
                    arg("bias", a.bias ? *a.bias : kNone), arg("mean", mean), arg("rstd", *a.rstd)});
  check.no_overlap({arg("dx", dx_over_dsum ? kNone : *a.dx), arg("dweight", *a.dweight),
                    arg("dbias", *a.dbias), arg("workspace", *a.workspace)},
                   {arg("dsum", dsum)});
  if (device.is_cuda()) {
    prepare_cuda(op, device);
    const std::size_t need =
        (p.dweight || p.dbias) ? norm::backward_workspace_cuda(p.rows, p.cols, p.dtype, device.index) : 0;
    if (need > 0) {
      const detail::Workspace ws =
          check.workspace(*a.workspace, need, "norm_backward_workspace_size", 16);
      p.workspace = ws.data;
      p.workspace_bytes = ws.bytes;
    }
    norm::backward_cuda(p, device.index, stream);
  } else {
    norm::backward_cpu(p);
  }
}

}  // namespace

void layer_norm_forward(const TensorView& x, const OptionalTensor& weight,
                        const OptionalTensor& bias, float eps, const TensorView& y,
                        const OptionalTensor& mean, const OptionalTensor& rstd, Stream stream) {
  run_forward("layer_norm_forward", norm::Kind::layer_norm, x, std::nullopt, weight, bias, eps, y,
              std::nullopt, mean, rstd, stream);
}

void rms_norm_forward(const TensorView& x, const OptionalTensor& weight, float eps,
                      const TensorView& y, const OptionalTensor& rstd, Stream stream) {
  run_forward("rms_norm_forward", norm::Kind::rms_norm, x, std::nullopt, weight, std::nullopt, eps,
              y, std::nullopt, std::nullopt, rstd, stream);
}

void layer_norm_residual_forward(const TensorView& x, const TensorView& residual,
                                 const OptionalTensor& weight, const OptionalTensor& bias,
                                 float eps, const TensorView& y, const OptionalTensor& sum,
                                 const OptionalTensor& mean, const OptionalTensor& rstd,
                                 Stream stream) {
  run_forward("layer_norm_residual_forward", norm::Kind::layer_norm, x, residual, weight, bias, eps,
              y, sum, mean, rstd, stream);
}

void rms_norm_residual_forward(const TensorView& x, const TensorView& residual,
                               const OptionalTensor& weight, float eps, const TensorView& y,
                               const OptionalTensor& sum, const OptionalTensor& rstd,
                               Stream stream) {
  run_forward("rms_norm_residual_forward", norm::Kind::rms_norm, x, residual, weight, std::nullopt,
              eps, y, sum, std::nullopt, rstd, stream);
}

std::size_t norm_backward_workspace_size(std::int64_t rows, std::int64_t cols, DType dtype,
                                         Device device) {
  const ArgCheck check("norm_backward_workspace_size");
  check.size_in(rows, "rows", 0, INT_MAX);
  check.size_in(cols, "cols", 0, kNormMaxCols);
  check.dtype_arg_in(dtype, "dtype", kFloatDtypes);
  if (!device.is_cuda() || rows == 0 || cols == 0) return 0;
  // A device that is not there is the caller's error: say so before any CUDA call fails on it.
  detail::device_info("norm_backward_workspace_size", device.index);
  return norm::backward_workspace_cuda(rows, cols, dtype, device.index);
}

void layer_norm_backward(const TensorView& dy, const TensorView& x, const OptionalTensor& weight,
                         const TensorView& mean, const TensorView& rstd, const OptionalTensor& dx,
                         const OptionalTensor& dweight, const OptionalTensor& dbias,
                         const OptionalTensor& workspace, Stream stream) {
  run_backward("layer_norm_backward",
               {norm::Kind::layer_norm, false, &dy, &x, &weight, nullptr, &mean, &rstd, nullptr, &dx,
                &dweight, &dbias, &workspace},
               stream);
}

void layer_norm_backward_from_output(const TensorView& dy, const TensorView& y,
                                     const OptionalTensor& weight, const OptionalTensor& bias,
                                     const TensorView& rstd, const OptionalTensor& dx,
                                     const OptionalTensor& dweight, const OptionalTensor& dbias,
                                     const OptionalTensor& workspace, Stream stream) {
  run_backward("layer_norm_backward_from_output",
               {norm::Kind::layer_norm, true, &dy, &y, &weight, &bias, nullptr, &rstd, nullptr, &dx,
                &dweight, &dbias, &workspace},
               stream);
}

void rms_norm_backward(const TensorView& dy, const TensorView& x, const OptionalTensor& weight,
                       const TensorView& rstd, const OptionalTensor& dx,
                       const OptionalTensor& dweight, const OptionalTensor& workspace,
                       Stream stream) {
  static const OptionalTensor kNone;
  run_backward("rms_norm_backward",
               {norm::Kind::rms_norm, false, &dy, &x, &weight, nullptr, nullptr, &rstd, nullptr, &dx,
                &dweight, &kNone, &workspace},
               stream);
}

void rms_norm_backward_from_output(const TensorView& dy, const TensorView& y,
                                   const OptionalTensor& weight, const TensorView& rstd,
                                   const OptionalTensor& dx, const OptionalTensor& dweight,
                                   const OptionalTensor& workspace, Stream stream) {
  static const OptionalTensor kNone;
  run_backward("rms_norm_backward_from_output",
               {norm::Kind::rms_norm, true, &dy, &y, &weight, nullptr, nullptr, &rstd, nullptr, &dx,
                &dweight, &kNone, &workspace},
               stream);
}

void layer_norm_residual_backward(const TensorView& dy, const TensorView& sum,
                                  const OptionalTensor& dsum, const OptionalTensor& weight,
                                  const TensorView& mean, const TensorView& rstd,
                                  const OptionalTensor& dx, const OptionalTensor& dweight,
                                  const OptionalTensor& dbias, const OptionalTensor& workspace,
                                  Stream stream) {
  run_backward("layer_norm_residual_backward",
               {norm::Kind::layer_norm, false, &dy, &sum, &weight, nullptr, &mean, &rstd, &dsum, &dx,
                &dweight, &dbias, &workspace},
               stream);
}

void rms_norm_residual_backward(const TensorView& dy, const TensorView& sum,
                                const OptionalTensor& dsum, const OptionalTensor& weight,
                                const TensorView& rstd, const OptionalTensor& dx,
                                const OptionalTensor& dweight, const OptionalTensor& workspace,
                                Stream stream) {
  static const OptionalTensor kNone;
  run_backward("rms_norm_residual_backward",
               {norm::Kind::rms_norm, false, &dy, &sum, &weight, nullptr, nullptr, &rstd, &dsum, &dx,
                &dweight, &kNone, &workspace},
               stream);
}

}  // namespace fusekit
