// Public entry points of the linear family: argument checks, then dispatch on where the tensors
// live (CPU reference or CUDA).
#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "core/validate.h"
#include "fusekit/linear.h"
#include "fusekit/runtime.h"
#include "linear/linear_params.h"

namespace fusekit {

using detail::arg;
using detail::ArgCheck;
using detail::RowLayout;

namespace {

constexpr std::int64_t kMaxExtent = INT_MAX;  // the CUTLASS kernel's problem shape is int

void check_activation(const ArgCheck& check, Activation a, const char* name = "activation") {
  switch (a) {
    case Activation::none:
    case Activation::relu:
    case Activation::gelu_erf:
    case Activation::gelu_tanh:
    case Activation::squared_relu:
    case Activation::silu: return;
    case Activation::leaky_relu:
      check.fail(name,
                 "none, relu, gelu_erf, gelu_tanh, squared_relu or silu (leaky_relu's slope is "
                 "not a parameter of the linear ops)",
                 "leaky_relu");
  }
  check.fail(name, "none, relu, gelu_erf, gelu_tanh, squared_relu or silu",
             "activation code " + std::to_string(static_cast<int>(a)));
}

// f32/f16/bf16 everywhere; f64 only on the CPU, where it makes the reference exact (the tests'
// float64 ground truth).
void check_input_dtype(const ArgCheck& check, const TensorView& x, Device device) {
  if (device.is_cuda()) {
    if (x.dtype == DType::f64)
      check.fail("x", "dtype f32, f16 or bf16 on a CUDA device (f64 runs on the CPU reference only)",
                 "f64");
    check.dtype_in(x, "x", {DType::f32, DType::f16, DType::bf16});
  } else {
    check.dtype_in(x, "x", {DType::f32, DType::f16, DType::bf16, DType::f64});
  }
}

void check_extent(const ArgCheck& check, const char* name, const char* what, std::int64_t v) {
  if (v > kMaxExtent)
    check.fail(name, std::string(what) + " at most 2^31 - 1", std::string(what) + " = " + std::to_string(v));
}

// "(d0, ..., dn-2, last)": the shape `like` has, with its last dimension replaced.
std::string shape_with_last(const TensorView& like, std::int64_t last) {
  std::string s = "(";
  for (int d = 0; d + 1 < like.ndim; ++d) s += std::to_string(like.shape[d]) + ", ";
  return s + std::to_string(last) + ")";
}

// A matrix argument with exactly `like`'s shape except for its last dimension, `cols` (the
// leading dimensions flattened into `rows`), in `dtype`.
RowLayout check_matrix(const ArgCheck& check, const TensorView& t, const char* name,
                       std::int64_t rows, std::int64_t cols, DType dtype, const TensorView& like,
                       const char* dtype_source) {
  check.dtype_is(t, name, dtype, (std::string("as '") + dtype_source + "'").c_str());
  bool same = t.ndim == like.ndim && t.ndim >= 1 && t.shape[t.ndim - 1] == cols;
  for (int d = 0; same && d + 1 < t.ndim; ++d) same = t.shape[d] == like.shape[d];
  const std::string expected_shape = shape_with_last(like, cols);
  if (!same)
    check.fail(name, "shape " + expected_shape + " (" + std::to_string(rows) + " rows of " +
                         std::to_string(cols) + ")",
               t.shape_string());
  const RowLayout l = check.rows(t, name);
  if (l.rows != rows || l.cols != cols)
    check.fail(name, "shape " + expected_shape + " (" + std::to_string(rows) + " rows of " +
                         std::to_string(cols) + ")",
               t.shape_string());
  check.element_aligned(t, name);
  return l;
}

// A weight (or its gradient): (N, K), stored either way round. Row-major (strides (ld, 1), the
// nn.Linear layout) or column-major (strides (1, ld), ld >= N: the transpose of a row-major
// (K, N) matrix, as GPT-2's Conv1D keeps its weight), which the GEMMs read transposed instead of
// the caller copying it. A dimension of one element takes its stride as row-major does.
struct WeightLayout {
  std::int64_t rows = 0, cols = 0, ld = 0;
  bool col_major = false;
};

WeightLayout check_weight(const ArgCheck& check, const TensorView& w, const char* name) {
  if (w.ndim != 2) check.fail(name, "a 2-D tensor (N, K)", "shape " + w.shape_string());
  check.has_data(w, name);
  WeightLayout l;
  l.rows = w.shape[0];
  l.cols = w.shape[1];
  if (l.cols <= 1 || w.strides[1] == 1) {
    const RowLayout r = check.rows(w, name);
    l.ld = r.row_stride;
    return l;
  }
  if (l.rows > 1 && w.strides[0] != 1)
    check.fail(name,
               "rows or columns contiguous: strides (ld, 1) with ld >= K (the nn.Linear layout) or (1, ld) "
               "with ld >= N (the transpose of a row-major (K, N) matrix)",
               "strides " + w.strides_string());
  if (w.strides[1] < std::max<std::int64_t>(l.rows, 1))
    check.fail(name, "a column stride of at least N = " + std::to_string(l.rows) + " (columns contiguous)",
               "column stride " + std::to_string(w.strides[1]));
  l.ld = w.strides[1];
  l.col_major = true;
  return l;
}

void* checked_workspace(const ArgCheck& check, const OptionalTensor& workspace, std::size_t need,
                        const char* size_function, std::size_t* bytes) {
  *bytes = 0;
  if (need == 0) return nullptr;
  const std::string expected = "a u8 tensor of at least " + std::to_string(need) + " bytes (" +
                               size_function + ")";
  if (!workspace) check.fail("workspace", expected, "none");
  const TensorView& ws = *workspace;
  check.has_data(ws, "workspace");
  if (ws.dtype != DType::u8 || static_cast<std::size_t>(ws.numel()) < need || !ws.is_contiguous())
    check.fail("workspace", expected,
               std::string(dtype_name(ws.dtype)) + " tensor of shape " + ws.shape_string());
  if (reinterpret_cast<std::uintptr_t>(ws.data) % 256 != 0)
    check.fail("workspace", "a 256-byte aligned pointer", "a pointer " +
                                std::to_string(reinterpret_cast<std::uintptr_t>(ws.data) % 256) +
                                " bytes past a 256-byte boundary");
  *bytes = static_cast<std::size_t>(ws.numel());
  return ws.data;
}

// x (M, K) or (..., K) and weight (N, K): the checks forward and backward share, and the GEMM
// sizes they imply.
struct GemmOperands {
  RowLayout x;
  WeightLayout weight;
  std::int64_t m = 0, n = 0, k = 0;
};

GemmOperands check_gemm_operands(const ArgCheck& check, const TensorView& x,
                                 const TensorView& weight, Device device) {
  GemmOperands g;
  check_input_dtype(check, x, device);
  g.x = check.rows(x, "x");
  check.element_aligned(x, "x");
  check.dtype_is(weight, "weight", x.dtype, "as 'x'");
  g.weight = check_weight(check, weight, "weight");
  if (g.weight.cols != g.x.cols)
    check.fail("weight", "shape (N, " + std::to_string(g.x.cols) + ") (K = x's last dimension)",
               weight.shape_string());
  check.element_aligned(weight, "weight");
  g.m = g.x.rows;
  g.n = g.weight.rows;
  g.k = g.x.cols;
  check_extent(check, "x", "rows M", g.m);
  check_extent(check, "x", "last dimension K", g.k);
  check_extent(check, "weight", "rows N", g.n);
  return g;
}

// The fields forward and backward share: the GEMM sizes, dtype, activation and the x, W operands.
template <typename Params>
void set_gemm_operands(Params& p, const GemmOperands& g, const TensorView& x,
                       const TensorView& weight, Activation activation) {
  p.m = g.m;
  p.n = g.n;
  p.k = g.k;
  p.dtype = x.dtype;
  p.activation = activation;
  p.x = x.data;
  p.ldx = g.x.row_stride;
  p.w = weight.data;
  p.ldw = g.weight.ld;
  p.w_col_major = g.weight.col_major;
}

// bias and dbias: a vector of N elements in x's dtype.
void check_bias_vector(const ArgCheck& check, const TensorView& t, const char* name,
                       std::int64_t n, DType x_dtype) {
  check.dtype_is(t, name, x_dtype, "as 'x'");
  check.vector(t, name, n);
  check.element_aligned(t, name);
}

// The saved pre-activation, which both directions take optionally: (M, N) like the output.
template <typename Params>
void set_pre_activation(const ArgCheck& check, const OptionalTensor& pre_activation,
                        const GemmOperands& g, const TensorView& x, Params& p) {
  if (!pre_activation) return;
  const RowLayout l = check_matrix(check, *pre_activation, "pre_activation", g.m, g.n, x.dtype, x, "x");
  p.pre = pre_activation->data;
  p.ldpre = l.row_stride;
}

// A backward's inputs besides the GEMM operands: dout (M, N) and the saved pre-activation, which
// every activation other than none needs.
void set_backward_inputs(const ArgCheck& check, const GemmOperands& g, const TensorView& dout, const TensorView& x,
                         const TensorView& weight, const OptionalTensor& pre_activation, Activation activation,
                         linear::BackwardParams& p) {
  set_gemm_operands(p, g, x, weight, activation);
  const RowLayout gl = check_matrix(check, dout, "dout", g.m, g.n, x.dtype, x, "x");
  p.dout = dout.data;
  p.lddout = gl.row_stride;
  set_pre_activation(check, pre_activation, g, x, p);
  if (!pre_activation && activation != Activation::none) {
    check.fail("pre_activation",
               std::string("the saved pre-activation (required for activation ") + activation_name(activation) +
                   ")",
               "none");
  }
}

// The gradients a backward computes, each optional: dx like x, dweight (N, K) in either of W's
// layouts, dbias (N).
void set_backward_outputs(const ArgCheck& check, const GemmOperands& g, const TensorView& x, const OptionalTensor& dx,
                          const OptionalTensor& dweight, const OptionalTensor& dbias, linear::BackwardParams& p) {
  if (dx) {
    const RowLayout l = check_matrix(check, *dx, "dx", g.m, g.k, x.dtype, x, "x");
    p.dx = dx->data;
    p.lddx = l.row_stride;
  }
  if (dweight) {
    check.dtype_is(*dweight, "dweight", x.dtype, "as 'x'");
    const WeightLayout l = check_weight(check, *dweight, "dweight");
    if (l.rows != g.n || l.cols != g.k)
      check.fail("dweight", "shape (" + std::to_string(g.n) + ", " + std::to_string(g.k) + ") (as 'weight')",
                 dweight->shape_string());
    check.element_aligned(*dweight, "dweight");
    p.dw = dweight->data;
    p.lddw = l.ld;
    p.dw_col_major = l.col_major;
  }
  if (dbias) {
    check_bias_vector(check, *dbias, "dbias", g.n, x.dtype);
    p.dbias = dbias->data;
  }
}

void run_backward(const ArgCheck& check, Device device, linear::BackwardParams& p, const OptionalTensor& workspace,
                  Stream stream, const char* size_function) {
  if (device.is_cuda()) {
    require_supported_gpu(check.op(), device.index);
    const std::size_t need =
        p.through_input_activation
            ? linear::backward_through_input_activation_workspace_cuda(p.m, p.n, p.k, p.dtype, p.activation)
            : linear::backward_workspace_cuda(p.m, p.n, p.k, p.dtype, p.activation);
    p.workspace = checked_workspace(check, workspace, need, size_function, &p.workspace_bytes);
    linear::backward_cuda(p, device.index, stream);
  } else {
    linear::backward_cpu(p);
  }
}

// The size queries' arguments, on every device: M, N, K in 0..2^31 - 1 (the ops' limits), a dtype
// and an activation the ops take, and an (M, N) matrix of `dtype` whose bytes, row length rounded
// up to 8 as the backward's dz scratch is, fit in 2^62 bytes: then no product or sum the CUDA size
// functions form can wrap (the other scratch terms are each far smaller than dz).
void check_size_query(const ArgCheck& check, std::int64_t m, std::int64_t n, std::int64_t k,
                      DType dtype, Activation activation) {
  check.size_in(m, "m", 0, kMaxExtent);
  check.size_in(n, "n", 0, kMaxExtent);
  check.size_in(k, "k", 0, kMaxExtent);
  check.dtype_arg_in(dtype, "dtype", {DType::f32, DType::f16, DType::bf16, DType::f64});
  check_activation(check, activation);
  detail::size_product(check.op(), "m",
                       "M x (N rounded up to 8) x 16 bytes (a bound on the backward's scratch)",
                       {m, (n + 7) / 8 * 8, 16});
}

}  // namespace

std::size_t linear_forward_workspace_size(std::int64_t m, std::int64_t n, std::int64_t k,
                                          DType dtype, Activation activation, Device device) {
  check_size_query(ArgCheck("linear_forward_workspace_size"), m, n, k, dtype, activation);
  if (!device.is_cuda()) return 0;
  return linear::forward_workspace_cuda(m, n, k, dtype, activation);
}

std::size_t linear_backward_workspace_size(std::int64_t m, std::int64_t n, std::int64_t k,
                                           DType dtype, Activation activation, Device device) {
  check_size_query(ArgCheck("linear_backward_workspace_size"), m, n, k, dtype, activation);
  if (!device.is_cuda()) return 0;
  return linear::backward_workspace_cuda(m, n, k, dtype, activation);
}

void linear_forward(const TensorView& x, const TensorView& weight, const OptionalTensor& bias,
                    Activation activation, const TensorView& y,
                    const OptionalTensor& pre_activation, const OptionalTensor& workspace,
                    Stream stream) {
  ArgCheck check("linear_forward");
  const Device device = check.same_device({arg("x", x), arg("weight", weight), arg("bias", bias),
                                           arg("y", y), arg("pre_activation", pre_activation),
                                           arg("workspace", workspace)});
  check_activation(check, activation);
  const GemmOperands g = check_gemm_operands(check, x, weight, device);
  const std::int64_t m = g.m, n = g.n, k = g.k;

  linear::ForwardParams p;
  set_gemm_operands(p, g, x, weight, activation);
  if (bias) {
    check_bias_vector(check, *bias, "bias", n, x.dtype);
    p.bias = bias->data;
  }
  const RowLayout yl = check_matrix(check, y, "y", m, n, x.dtype, x, "x");
  p.y = y.data;
  p.ldy = yl.row_stride;
  set_pre_activation(check, pre_activation, g, x, p);
  check.no_overlap({arg("y", y), arg("pre_activation", pre_activation), arg("workspace", workspace)},
                   {arg("x", x), arg("weight", weight), arg("bias", bias)});
  if (device.is_cuda()) {
    require_supported_gpu("linear_forward", device.index);
    p.workspace = checked_workspace(check, workspace,
                                    linear::forward_workspace_cuda(m, n, k, x.dtype, activation),
                                    "linear_forward_workspace_size", &p.workspace_bytes);
    linear::forward_cuda(p, device.index, stream);
  } else {
    linear::forward_cpu(p);
  }
}

void linear_backward(const TensorView& dout, const TensorView& x, const TensorView& weight,
                     const OptionalTensor& pre_activation, Activation activation,
                     const OptionalTensor& dx, const OptionalTensor& dweight,
                     const OptionalTensor& dbias, const OptionalTensor& workspace, Stream stream) {
  ArgCheck check("linear_backward");
  const Device device = check.same_device(
      {arg("dout", dout), arg("x", x), arg("weight", weight), arg("pre_activation", pre_activation),
       arg("dx", dx), arg("dweight", dweight), arg("dbias", dbias), arg("workspace", workspace)});
  check_activation(check, activation);
  const GemmOperands g = check_gemm_operands(check, x, weight, device);

  linear::BackwardParams p;
  set_backward_inputs(check, g, dout, x, weight, pre_activation, activation, p);
  set_backward_outputs(check, g, x, dx, dweight, dbias, p);
  check.no_overlap({arg("dx", dx), arg("dweight", dweight), arg("dbias", dbias), arg("workspace", workspace)},
                   {arg("dout", dout), arg("x", x), arg("weight", weight),
                    arg("pre_activation", pre_activation)});
  run_backward(check, device, p, workspace, stream, "linear_backward_workspace_size");
}

std::size_t linear_backward_through_input_activation_workspace_size(std::int64_t m, std::int64_t n, std::int64_t k,
                                                                    DType dtype, Activation activation,
                                                                    Device device) {
  check_size_query(ArgCheck("linear_backward_through_input_activation_workspace_size"), m, n, k, dtype, activation);
  // dx's scratch is (M, K rounded up to 8): bounded as the dz scratch is.
  detail::size_product("linear_backward_through_input_activation_workspace_size", "m",
                       "M x (K rounded up to 8) x 16 bytes (a bound on the scratch)", {m, (k + 7) / 8 * 8, 16});
  if (!device.is_cuda()) return 0;
  return linear::backward_through_input_activation_workspace_cuda(m, n, k, dtype, activation);
}

void linear_backward_through_input_activation(const TensorView& dout, const TensorView& x, const TensorView& weight,
                                              const OptionalTensor& pre_activation, Activation activation,
                                              const TensorView& x_pre_activation, Activation x_activation,
                                              const TensorView& dx_pre_activation,
                                              const OptionalTensor& dx_pre_activation_sum,
                                              const OptionalTensor& dweight, const OptionalTensor& dbias,
                                              const OptionalTensor& workspace, Stream stream) {
  ArgCheck check("linear_backward_through_input_activation");
  const Device device = check.same_device(
      {arg("dout", dout), arg("x", x), arg("weight", weight), arg("pre_activation", pre_activation),
       arg("x_pre_activation", x_pre_activation), arg("dx_pre_activation", dx_pre_activation),
       arg("dx_pre_activation_sum", dx_pre_activation_sum), arg("dweight", dweight), arg("dbias", dbias),
       arg("workspace", workspace)});
  check_activation(check, activation);
  check_activation(check, x_activation, "x_activation");
  if (x_activation == Activation::none)
    check.fail("x_activation", "an activation other than none (with none, call linear_backward)", "none");
  const GemmOperands g = check_gemm_operands(check, x, weight, device);

  linear::BackwardParams p;
  set_backward_inputs(check, g, dout, x, weight, pre_activation, activation, p);
  const RowLayout xl = check_matrix(check, x_pre_activation, "x_pre_activation", g.m, g.k, x.dtype, x, "x");
  p.through_input_activation = true;
  p.x_activation = x_activation;
  p.x_pre = x_pre_activation.data;
  p.ldx_pre = xl.row_stride;
  set_backward_outputs(check, g, x, dx_pre_activation, dweight, dbias, p);
  if (dx_pre_activation_sum) {
    check_bias_vector(check, *dx_pre_activation_sum, "dx_pre_activation_sum", g.k, x.dtype);
    p.dx_sum = dx_pre_activation_sum->data;
  }
  check.no_overlap({arg("dx_pre_activation", dx_pre_activation), arg("dx_pre_activation_sum", dx_pre_activation_sum),
                    arg("dweight", dweight), arg("dbias", dbias), arg("workspace", workspace)},
                   {arg("dout", dout), arg("x", x), arg("weight", weight), arg("pre_activation", pre_activation),
                    arg("x_pre_activation", x_pre_activation)});
  run_backward(check, device, p, workspace, stream, "linear_backward_through_input_activation_workspace_size");
}

// ---- gated linear ------------------------------------------------------------------------------

namespace {

void check_gated_config(const ArgCheck& check, const GatedLinearConfig& config) {
  switch (config.activation) {
    case Activation::silu:
    case Activation::gelu_tanh:
    case Activation::gelu_erf:
    case Activation::relu: break;
    default:
      check.fail("config.activation", "silu, gelu_tanh, gelu_erf or relu (the gates of SwiGLU, GeGLU, ReGLU)",
                 activation_name(config.activation));
  }
  if (config.layout != GatedLayout::halves && config.layout != GatedLayout::interleaved)
    check.fail("config.layout", "halves or interleaved",
               "layout code " + std::to_string(static_cast<int>(config.layout)));
}

// x and weight (2F, K): the GEMM operands, with F = half of weight's rows.
GemmOperands check_gated_operands(const ArgCheck& check, const TensorView& x, const TensorView& weight,
                                  Device device) {
  const GemmOperands g = check_gemm_operands(check, x, weight, device);
  if (g.n % 2 != 0)
    check.fail("weight", "an even number of rows 2F (the F gate rows and the F up rows)",
               "shape " + weight.shape_string());
  return g;
}

void check_gated_size_query(const ArgCheck& check, std::int64_t m, std::int64_t f, std::int64_t k, DType dtype,
                            const GatedLinearConfig& config) {
  check.size_in(f, "f", 0, kMaxExtent / 2);
  check_size_query(check, m, 2 * f, k, dtype, Activation::none);
  check_gated_config(check, config);
}

}  // namespace

std::size_t gated_linear_forward_workspace_size(std::int64_t m, std::int64_t f, std::int64_t k, DType dtype,
                                                const GatedLinearConfig& config, bool keeps_pre, Device device) {
  check_gated_size_query(ArgCheck("gated_linear_forward_workspace_size"), m, f, k, dtype, config);
  if (!device.is_cuda()) return 0;
  return linear::gated_forward_workspace_cuda(m, f, k, dtype, config.layout, keeps_pre);
}

std::size_t gated_linear_backward_workspace_size(std::int64_t m, std::int64_t f, std::int64_t k, DType dtype,
                                                 const GatedLinearConfig& config, Device device) {
  check_gated_size_query(ArgCheck("gated_linear_backward_workspace_size"), m, f, k, dtype, config);
  if (!device.is_cuda()) return 0;
  return linear::backward_workspace_cuda(m, 2 * f, k, dtype, config.activation);
}

void gated_linear_forward(const TensorView& x, const TensorView& weight, const OptionalTensor& bias,
                          const GatedLinearConfig& config, const TensorView& y,
                          const OptionalTensor& pre_activation, const OptionalTensor& workspace, Stream stream) {
  ArgCheck check("gated_linear_forward");
  const Device device = check.same_device({arg("x", x), arg("weight", weight), arg("bias", bias), arg("y", y),
                                           arg("pre_activation", pre_activation), arg("workspace", workspace)});
  check_gated_config(check, config);
  const GemmOperands g = check_gated_operands(check, x, weight, device);
  const std::int64_t m = g.m, f = g.n / 2, k = g.k;

  linear::GatedForwardParams p;
  p.m = m;
  p.f = f;
  p.k = k;
  p.dtype = x.dtype;
  p.activation = config.activation;
  p.layout = config.layout;
  p.x = x.data;
  p.ldx = g.x.row_stride;
  p.w = weight.data;
  p.ldw = g.weight.ld;
  p.w_col_major = g.weight.col_major;
  if (bias) {
    check_bias_vector(check, *bias, "bias", 2 * f, x.dtype);
    p.bias = bias->data;
  }
  const RowLayout yl = check_matrix(check, y, "y", m, f, x.dtype, x, "x");
  p.y = y.data;
  p.ldy = yl.row_stride;
  if (pre_activation) {
    const RowLayout l = check_matrix(check, *pre_activation, "pre_activation", m, 2 * f, x.dtype, x, "x");
    p.pre = pre_activation->data;
    p.ldpre = l.row_stride;
  }
  check.no_overlap({arg("y", y), arg("pre_activation", pre_activation), arg("workspace", workspace)},
                   {arg("x", x), arg("weight", weight), arg("bias", bias)});
  if (device.is_cuda()) {
    require_supported_gpu("gated_linear_forward", device.index);
    p.workspace = checked_workspace(
        check, workspace, linear::gated_forward_workspace_cuda(m, f, k, x.dtype, config.layout, p.pre != nullptr),
        "gated_linear_forward_workspace_size", &p.workspace_bytes);
    linear::gated_forward_cuda(p, device.index, stream);
  } else {
    linear::gated_forward_cpu(p);
  }
}

void gated_linear_backward(const TensorView& dy, const TensorView& x, const TensorView& weight,
                           const TensorView& pre_activation, const GatedLinearConfig& config,
                           const OptionalTensor& dx, const OptionalTensor& dweight, const OptionalTensor& dbias,
                           const OptionalTensor& workspace, Stream stream) {
  ArgCheck check("gated_linear_backward");
  const Device device = check.same_device(
      {arg("dy", dy), arg("x", x), arg("weight", weight), arg("pre_activation", pre_activation), arg("dx", dx),
       arg("dweight", dweight), arg("dbias", dbias), arg("workspace", workspace)});
  check_gated_config(check, config);
  const GemmOperands g = check_gated_operands(check, x, weight, device);

  // The linear backward with dz formed by the gated formula from dy and the (gate, up) pairs.
  linear::BackwardParams p;
  set_gemm_operands(p, g, x, weight, config.activation);
  p.gated = true;
  p.gated_layout = config.layout;
  const RowLayout dyl = check_matrix(check, dy, "dy", g.m, g.n / 2, x.dtype, x, "x");
  p.dout = dy.data;
  p.lddout = dyl.row_stride;
  const RowLayout pl = check_matrix(check, pre_activation, "pre_activation", g.m, g.n, x.dtype, x, "x");
  p.pre = pre_activation.data;
  p.ldpre = pl.row_stride;
  set_backward_outputs(check, g, x, dx, dweight, dbias, p);
  check.no_overlap({arg("dx", dx), arg("dweight", dweight), arg("dbias", dbias), arg("workspace", workspace)},
                   {arg("dy", dy), arg("x", x), arg("weight", weight), arg("pre_activation", pre_activation)});
  run_backward(check, device, p, workspace, stream, "gated_linear_backward_workspace_size");
}

}  // namespace fusekit
