// Public entry points of FP8 RMSNorm: argument checks, then dispatch on where the tensors live
// (CPU reference or CUDA kernels).
#include <climits>
#include <cmath>
#include <string>

#include "core/validate.h"
#include "fp8_norm/fp8_norm_params.h"
#include "fusekit/fp8_norm.h"
#include "fusekit/runtime.h"

namespace fusekit {

using detail::arg;
using detail::ArgCheck;
using detail::RowLayout;

namespace {

constexpr std::initializer_list<DType> kFp8Dtypes = {DType::f8e4m3, DType::f8e5m2};
constexpr std::initializer_list<DType> kScaleDtypes = {DType::bf16, DType::f32};
constexpr std::initializer_list<DType> kWeightDtypes = {DType::bf16, DType::f32};

std::string shape2(std::int64_t a, std::int64_t b) {
  std::string s = "(";  // appended piecewise: GCC 12 misreports "(" + std::string (-Wrestrict)
  s += std::to_string(a);
  s += ", ";
  s += std::to_string(b);
  s += ")";
  return s;
}

// group_size: a power of two that divides N. Returns log2(group_size).
int check_group(const ArgCheck& check, int group_size, std::int64_t cols) {
  if (group_size < 1 || (group_size & (group_size - 1)) != 0)
    check.fail("group_size", "a power of two >= 1", std::to_string(group_size));
  if (cols % group_size != 0)
    check.fail("x", "a last dimension N that is a multiple of group_size = " + std::to_string(group_size),
               "N = " + std::to_string(cols));
  int log2 = 0;
  while ((1 << log2) < group_size) ++log2;
  return log2;
}

// x (M rows of N fp8 values) and its scales (M rows of N / group_size values).
struct InputLayout {
  RowLayout x, scales;
  int log2_group = 0;
};

InputLayout check_input(const ArgCheck& check, const TensorView& x, const TensorView& x_scales,
                        int group_size, const RowLayout* expect_rows, const char* expect_name,
                        const TensorView* expect_view) {
  InputLayout in;
  in.x = check.leading_rows(x, "x", kFp8Dtypes, kFp8NormMaxCols);
  if (expect_rows) check.rows_as(x, "x", *expect_view, *expect_rows, expect_name);
  in.log2_group = check_group(check, group_size, in.x.cols);
  check.dtype_in(x_scales, "x_scales", kScaleDtypes);
  in.scales = check.rows(x_scales, "x_scales");
  const std::int64_t groups = in.x.cols / group_size;
  if (in.scales.rows != in.x.rows || in.scales.cols != groups)
    check.fail("x_scales",
               "M x (N / group_size) = " + std::to_string(in.x.rows) + " x " + std::to_string(groups) +
                   " values (x is " + x.shape_string() + ", group_size " + std::to_string(group_size) + ")",
               "shape " + x_scales.shape_string());
  return in;
}

// The fields forward and backward share: sizes, grouping, and the x, x_scales and weight inputs.
template <typename Params>
void set_inputs(Params& p, const InputLayout& in, const TensorView& x, const TensorView& x_scales,
                const TensorView& weight, int group_size) {
  p.rows = in.x.rows;
  p.cols = in.x.cols;
  p.group_size = group_size;
  p.log2_group = in.log2_group;
  p.x_dtype = x.dtype;
  p.scale_dtype = x_scales.dtype;
  p.weight_dtype = weight.dtype;
  p.x = x.data;
  p.x_row_stride = in.x.row_stride;
  p.scales = x_scales.data;
  p.scale_row_stride = in.scales.row_stride;
  p.weight = weight.data;
}

// The workspace, where the CUDA backend needs one.
template <typename Params>
void set_workspace(const ArgCheck& check, const OptionalTensor& workspace, std::size_t need,
                   const char* size_function, Params& p) {
  if (need == 0) return;
  const detail::Workspace ws = check.workspace(workspace, need, size_function, 16);
  p.workspace = ws.data;
  p.workspace_bytes = ws.bytes;
}

// The size queries' arguments: the ops' limits (rows up to 2^31 - 1, N up to kFp8NormMaxCols).
void check_size_query(const ArgCheck& check, std::int64_t rows, std::int64_t cols) {
  check.size_in(rows, "rows", 0, INT_MAX);
  check.size_in(cols, "cols", 0, kFp8NormMaxCols);
}

}  // namespace

std::size_t fp8_rms_norm_forward_workspace_size(std::int64_t rows, std::int64_t cols,
                                                Device device) {
  check_size_query(ArgCheck("fp8_rms_norm_forward_workspace_size"), rows, cols);
  if (!device.is_cuda() || rows == 0 || cols == 0) return 0;
  return fp8_norm::forward_workspace_cuda(rows, cols, device.index);
}

std::size_t fp8_rms_norm_backward_workspace_size(std::int64_t rows, std::int64_t cols,
                                                 Device device) {
  check_size_query(ArgCheck("fp8_rms_norm_backward_workspace_size"), rows, cols);
  if (!device.is_cuda() || rows == 0 || cols == 0) return 0;
  return fp8_norm::backward_workspace_cuda(rows, cols, device.index);
}

void fp8_rms_norm_forward(const TensorView& x, const TensorView& x_scales,
                          const TensorView& weight, float eps, const TensorView& qy,
                          const TensorView& qy_t, const TensorView& y_scale,
                          const TensorView& rstd, const OptionalTensor& y,
                          const OptionalTensor& workspace, int group_size, Stream stream) {
  ArgCheck check("fp8_rms_norm_forward");
  const Device device = check.same_device(
      {arg("x", x), arg("x_scales", x_scales), arg("weight", weight), arg("qy", qy),
       arg("qy_t", qy_t), arg("y_scale", y_scale), arg("rstd", rstd), arg("y", y),
       arg("workspace", workspace)});
  const InputLayout in = check_input(check, x, x_scales, group_size, nullptr, nullptr, nullptr);
  const std::int64_t rows = in.x.rows, cols = in.x.cols;

  check.dtype_in(weight, "weight", kWeightDtypes);
  check.vector(weight, "weight", cols);
  check.eps(eps, true);

  check.dtype_in(qy, "qy", kFp8Dtypes);
  const RowLayout ql = check.rows_as(qy, "qy", x, in.x, "x");
  check.dtype_is(qy_t, "qy_t", qy.dtype, "as 'qy'");
  if (qy_t.ndim != 2 || qy_t.shape[0] != cols || qy_t.shape[1] != rows)
    check.fail("qy_t", "shape " + shape2(cols, rows) + " (N, M): qy transposed", qy_t.shape_string());
  const RowLayout tl = check.rows(qy_t, "qy_t");
  check.dtype_is(y_scale, "y_scale", DType::f32, "the per-tensor scale is float32");
  check.contiguous_numel(y_scale, "y_scale", 1);
  check.dtype_is(rstd, "rstd", DType::f32, "statistics are float32");
  check.contiguous_numel(rstd, "rstd", rows);

  fp8_norm::ForwardParams p;
  if (y) {
    check.dtype_is(*y, "y", DType::bf16, "the unquantized output is bf16");
    const RowLayout yl = check.rows_as(*y, "y", x, in.x, "x");
    p.y = y->data;
    p.y_row_stride = yl.row_stride;
  }
  set_inputs(p, in, x, x_scales, weight, group_size);
  p.q_dtype = qy.dtype;
  p.eps = eps;
  p.qy = qy.data;
  p.qy_row_stride = ql.row_stride;
  p.qy_t = qy_t.data;
  p.qy_t_row_stride = tl.row_stride;
  p.y_scale = y_scale.data_as<float>();
  p.rstd = rstd.data_as<float>();
  check.no_overlap({arg("qy", qy), arg("qy_t", qy_t), arg("y_scale", y_scale), arg("rstd", rstd),
                    arg("y", y), arg("workspace", workspace)},
                   {arg("x", x), arg("x_scales", x_scales), arg("weight", weight)});

  if (device.is_cuda()) {
    require_supported_gpu(check.op(), device.index);
    set_workspace(check, workspace, fp8_norm::forward_workspace_cuda(rows, cols, device.index),
                  "fp8_rms_norm_forward_workspace_size", p);
    fp8_norm::forward_cuda(p, device.index, stream);
  } else {
    fp8_norm::forward_cpu(p);
  }
}

void fp8_rms_norm_backward(const TensorView& dy, const TensorView& x, const TensorView& x_scales,
                           const TensorView& weight, const TensorView& rstd,
                           const OptionalTensor& dx, const OptionalTensor& dweight,
                           const OptionalTensor& workspace, int group_size, Stream stream) {
  ArgCheck check("fp8_rms_norm_backward");
  const Device device = check.same_device(
      {arg("dy", dy), arg("x", x), arg("x_scales", x_scales), arg("weight", weight),
       arg("rstd", rstd), arg("dx", dx), arg("dweight", dweight), arg("workspace", workspace)});
  check.dtype_is(dy, "dy", DType::bf16, "the gradients are bf16");
  const RowLayout dyl = check.rows(dy, "dy");
  check.row_limits(dyl, "dy", kFp8NormMaxCols);
  const InputLayout in = check_input(check, x, x_scales, group_size, &dyl, "dy", &dy);
  const std::int64_t rows = dyl.rows, cols = dyl.cols;
  check.dtype_in(weight, "weight", kWeightDtypes);
  check.vector(weight, "weight", cols);
  check.dtype_is(rstd, "rstd", DType::f32, "statistics are float32");
  check.contiguous_numel(rstd, "rstd", rows);

  fp8_norm::BackwardParams p;
  if (dx) {
    check.dtype_is(*dx, "dx", DType::bf16, "the gradients are bf16");
    const RowLayout l = check.rows_as(*dx, "dx", dy, dyl, "dy");
    p.dx = dx->data;
    p.dx_row_stride = l.row_stride;
  }
  if (dweight) {
    check.dtype_is(*dweight, "dweight", weight.dtype, "as 'weight'");
    check.vector(*dweight, "dweight", cols);
    p.dweight = dweight->data;
  }
  set_inputs(p, in, x, x_scales, weight, group_size);
  p.dy = dy.data;
  p.dy_row_stride = dyl.row_stride;
  p.rstd = rstd.data_as<const float>();
  check.no_overlap({arg("dx", dx), arg("dweight", dweight), arg("workspace", workspace)},
                   {arg("dy", dy), arg("x", x), arg("x_scales", x_scales), arg("weight", weight),
                    arg("rstd", rstd)});

  if (device.is_cuda()) {
    require_supported_gpu(check.op(), device.index);
    if (p.dweight)
      set_workspace(check, workspace, fp8_norm::backward_workspace_cuda(rows, cols, device.index),
                    "fp8_rms_norm_backward_workspace_size", p);
    fp8_norm::backward_cuda(p, device.index, stream);
  } else {
    fp8_norm::backward_cpu(p);
  }
}

}  // namespace fusekit
