// Public entry points of the linear_cross_entropy family: argument checks, then dispatch on where
// the tensors live (the float64 CPU reference, or the chunked GPU path).
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "core/convert.h"
#include "core/device_info.h"
#include "core/format.h"
#include "core/validate.h"
#include "cross_entropy/cross_entropy_params.h"
#include "fusekit/linear_cross_entropy.h"
#include "fusekit/runtime.h"
#include "linear_cross_entropy/linear_cross_entropy_config.h"
#include "linear_cross_entropy/linear_cross_entropy_params.h"

namespace fusekit {

using detail::arg;
using detail::ArgCheck;
using detail::RowLayout;
using lxent::Params;

namespace {

constexpr std::int64_t kMaxExtent = INT_MAX;

void check_config(const ArgCheck& check, const CrossEntropyConfig& c, Params& p) {
  cross_entropy::check_options(check, c);
  p.ignore_index = c.ignore_index;
  p.label_smoothing = c.label_smoothing;
  p.z_loss = c.z_loss;
  p.reduction = c.reduction;
}

// f32 / f16 / bf16 on a GPU; f64 too on the CPU (the reference's exact inputs).
void check_dtype_arg(const ArgCheck& check, DType d, const char* name, bool cuda) {
  if (cuda && d == DType::f64)
    check.fail(name, "dtype f32, f16 or bf16 on a CUDA device (f64 runs on the CPU reference only)", "f64");
  check.dtype_arg_in(d, name, {DType::f32, DType::f16, DType::bf16, DType::f64});
}

// dweight / dbias: float32 or h's dtype.
void check_gradient_dtype(const ArgCheck& check, const TensorView& t, const char* name, DType h_dtype) {
  if (t.dtype != DType::f32 && t.dtype != h_dtype)
    check.fail(name, std::string("dtype f32 or h's dtype (") + dtype_name(h_dtype) + ")", dtype_name(t.dtype));
}

void check_extent(const ArgCheck& check, const char* name, const char* what, std::int64_t v, std::int64_t lo,
                  std::int64_t hi) {
  if (v < lo || v > hi)
    check.fail(name, std::string(what) + " in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]",
               std::string(what) + " = " + std::to_string(v));
}

// A (rows, cols) matrix: exactly two dimensions, the last contiguous.
RowLayout check_matrix_2d(const ArgCheck& check, const TensorView& t, const char* name, std::int64_t rows,
                          std::int64_t cols) {
  const std::string expected = "shape (" + std::to_string(rows) + ", " + std::to_string(cols) + ")";
  if (t.ndim != 2 || t.shape[0] != rows || t.shape[1] != cols) check.fail(name, expected, t.shape_string());
  const RowLayout l = check.rows(t, name);
  check.element_aligned(t, name);
  return l;
}

// The CPU backend refuses a target that is neither ignore_index nor a class (the GPU marks the
// row NaN instead: reading the targets back would cost a synchronization).
void check_target_values(const ArgCheck& check, const Params& p) {
  for (std::int64_t r = 0; r < p.tokens; ++r) {
    const auto t = static_cast<std::int64_t>(detail::load_as_double(p.targets, p.target_dtype, r));
    if (t != p.ignore_index && (t < 0 || t >= p.vocab))
      check.fail("targets",
                 "class indices in [0, " + std::to_string(p.vocab) + ") or ignore_index (" +
                     std::to_string(p.ignore_index) + ")",
                 "target " + std::to_string(t) + " at row " + std::to_string(r));
  }
}

lxent::Problem problem_of(std::int64_t tokens, std::int64_t vocab, std::int64_t hidden, DType dtype) {
  lxent::Problem pr;
  pr.tokens = tokens;
  pr.vocab = vocab;
  pr.hidden = hidden;
  pr.element_bytes = static_cast<int>(dtype_size(dtype));
  return pr;
}

std::int64_t chunk_on(const char* op, std::int64_t tokens, std::int64_t vocab, std::int64_t hidden, DType dtype,
                      Device device) {
  if (!device.is_cuda()) return 0;
  return lxent::chunk_with_overrides(problem_of(tokens, vocab, hidden, dtype),
                                                    detail::device_info(op, device.index));
}

// The size queries' arguments, on every device.
void check_size_query(const ArgCheck& check, std::int64_t tokens, std::int64_t vocab, std::int64_t hidden,
                      DType dtype, Device device) {
  check.size_in(tokens, "tokens", 0, kMaxExtent);
  check.size_in(vocab, "vocab", 1, kCrossEntropyMaxClasses);
  check.size_in(hidden, "hidden", 1, kMaxExtent);
  check_dtype_arg(check, dtype, "dtype", device.is_cuda());
}

}  // namespace

std::int64_t linear_cross_entropy_chunk_tokens(std::int64_t tokens, std::int64_t vocab, std::int64_t hidden,
                                               DType dtype, Device device) {
  const ArgCheck check("linear_cross_entropy_chunk_tokens");
  check_size_query(check, tokens, vocab, hidden, dtype, device);
  return chunk_on(check.op(), tokens, vocab, hidden, dtype, device);
}

std::size_t linear_cross_entropy_workspace_size(std::int64_t tokens, std::int64_t vocab, std::int64_t hidden,
                                                DType dtype, DType dweight_dtype, bool has_bias,
                                                const CrossEntropyConfig& config, Device device) {
  const ArgCheck check("linear_cross_entropy_workspace_size");
  check_size_query(check, tokens, vocab, hidden, dtype, device);
  if (dweight_dtype != DType::f32 && dweight_dtype != dtype)
    check.fail("dweight_dtype", std::string("f32 or dtype (") + dtype_name(dtype) + ")", dtype_name(dweight_dtype));
  Params unused;
  check_config(check, config, unused);
  if (!device.is_cuda()) return 0;
  const std::int64_t chunk = chunk_on(check.op(), tokens, vocab, hidden, dtype, device);
  return lxent::workspace_layout(tokens, vocab, hidden, chunk, dtype, dweight_dtype, has_bias,
                                                config.reduction)
      .total;
}

void linear_cross_entropy(const TensorView& h, const TensorView& weight, const OptionalTensor& bias,
                          const TensorView& targets, const CrossEntropyConfig& config, const TensorView& loss,
                          const OptionalTensor& dh, const OptionalTensor& dweight, const OptionalTensor& dbias,
                          const OptionalTensor& workspace, Stream stream) {
  ArgCheck check("linear_cross_entropy");
  const Device device = check.same_device({arg("h", h), arg("weight", weight), arg("bias", bias),
                                           arg("targets", targets), arg("loss", loss), arg("dh", dh),
                                           arg("dweight", dweight), arg("dbias", dbias),
                                           arg("workspace", workspace)});
  Params p;
  check_config(check, config, p);

  // h (T, H)
  if (device.is_cuda() && h.dtype == DType::f64)
    check.fail("h", "dtype f32, f16 or bf16 on a CUDA device (f64 runs on the CPU reference only)", "f64");
  check.dtype_in(h, "h", {DType::f32, DType::f16, DType::bf16, DType::f64});
  const RowLayout hl = check.rows(h, "h");
  check.element_aligned(h, "h");
  check_extent(check, "h", "rows T", hl.rows, 0, kMaxExtent);
  check_extent(check, "h", "last dimension H", hl.cols, 1, kMaxExtent);
  p.tokens = hl.rows;
  p.hidden = hl.cols;
  p.dtype = h.dtype;
  p.h = h.data;
  p.ldh = std::max(hl.row_stride, hl.cols);

  // weight (V, H)
  if (weight.ndim != 2) check.fail("weight", "a 2-D tensor (V, H)", "shape " + weight.shape_string());
  check.dtype_is(weight, "weight", h.dtype, "as 'h'");
  if (weight.shape[1] != p.hidden)
    check.fail("weight", "shape (V, " + std::to_string(p.hidden) + ") (H = h's last dimension)",
               weight.shape_string());
  check_extent(check, "weight", "rows V", weight.shape[0], 1, kCrossEntropyMaxClasses);
  p.vocab = weight.shape[0];
  const RowLayout wl = check_matrix_2d(check, weight, "weight", p.vocab, p.hidden);
  p.weight = weight.data;
  p.ldw = std::max(wl.row_stride, wl.cols);

  if (bias) {
    check.dtype_is(*bias, "bias", h.dtype, "as 'h'");
    check.vector(*bias, "bias", p.vocab);
    check.element_aligned(*bias, "bias");
    p.bias = bias->data;
  }

  check.dtype_in(targets, "targets", {DType::i32, DType::i64});
  check.contiguous_numel(targets, "targets", p.tokens);
  p.targets = targets.data;
  p.target_dtype = targets.dtype;

  check.dtype_is(loss, "loss", DType::f32, "float32 losses");
  check.contiguous_numel(loss, "loss", p.reduction == LossReduction::none ? p.tokens : 1);
  p.loss = static_cast<float*>(loss.data);

  if (dh) {
    const RowLayout l = check.rows_and_dtype_as(*dh, "dh", h, hl, "h");
    check.element_aligned(*dh, "dh");
    p.dh = dh->data;
    p.lddh = std::max(l.row_stride, l.cols);
  }
  if (dweight) {
    check_gradient_dtype(check, *dweight, "dweight", h.dtype);
    const RowLayout l = check_matrix_2d(check, *dweight, "dweight", p.vocab, p.hidden);
    p.dweight = dweight->data;
    p.lddw = std::max(l.row_stride, l.cols);
    p.dweight_dtype = dweight->dtype;
  }
  if (dbias) {
    if (!bias) check.fail("dbias", "no dbias without a bias (the layer has no b)", "a dbias tensor");
    check_gradient_dtype(check, *dbias, "dbias", h.dtype);
    check.vector(*dbias, "dbias", p.vocab);
    check.element_aligned(*dbias, "dbias");
    p.dbias = dbias->data;
    p.dbias_dtype = dbias->dtype;
  }

  check.no_overlap({arg("loss", loss), arg("dh", dh), arg("dweight", dweight), arg("dbias", dbias),
                    arg("workspace", workspace)},
                   {arg("h", h), arg("weight", weight), arg("bias", bias), arg("targets", targets)});

  if (device.is_cuda()) {
    require_supported_gpu(check.op(), device.index);
    const std::int64_t chunk = chunk_on(check.op(), p.tokens, p.vocab, p.hidden, p.dtype, device);
    const std::size_t need =
        lxent::workspace_layout(p.tokens, p.vocab, p.hidden, chunk, p.dtype,
                                               p.dweight ? p.dweight_dtype : DType::f32, p.dbias != nullptr,
                                               p.reduction)
            .total;
    const detail::Workspace ws = check.workspace(workspace, need, "linear_cross_entropy_workspace_size", 256);
    p.workspace = ws.data;
    p.workspace_bytes = ws.bytes;
    lxent::run_cuda(p, chunk, device.index, stream);
  } else {
    check_target_values(check, p);
    lxent::run_cpu(p);
  }
}

}  // namespace fusekit
