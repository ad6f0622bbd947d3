// Public entry points of the embedding family: argument checks, then dispatch on where the
// tensors live (CPU reference or CUDA kernels).
#include <climits>
#include <cstdint>
#include <string>

#include "core/convert.h"
#include "core/device_info.h"
#include "core/validate.h"
#include "embedding/embedding_params.h"
#include "fusekit/embedding.h"
#include "fusekit/runtime.h"

namespace fusekit {

using detail::arg;
using detail::ArgCheck;
using detail::RowLayout;

namespace {

// f32/f16/bf16 everywhere; f64 only on the CPU, where it makes the reference exact.
void check_float_dtype(const ArgCheck& check, const TensorView& t, const char* name, Device device) {
  if (device.is_cuda()) {
    if (t.dtype == DType::f64)
      check.fail(name, "dtype f32, f16 or bf16 on a CUDA device (f64 runs on the CPU reference only)",
                 "f64");
    check.dtype_in(t, name, {DType::f32, DType::f16, DType::bf16});
  } else {
    check.dtype_in(t, name, {DType::f32, DType::f16, DType::bf16, DType::f64});
  }
}

// tokens: (..., T), i32 or i64, contiguous, at most 2^31 - 1 of them, with room for the C of
// out's last dimension. Returns T.
std::int64_t check_tokens(const ArgCheck& check, const TensorView& tokens) {
  check.dtype_in(tokens, "tokens", {DType::i32, DType::i64});
  if (tokens.ndim < 1 || tokens.ndim > kMaxDims - 1)
    check.fail("tokens", "1.." + std::to_string(kMaxDims - 1) + " dimensions (..., T)",
               std::to_string(tokens.ndim) + " dimensions");
  check.contiguous_numel(tokens, "tokens", tokens.numel());
  if (tokens.numel() > INT_MAX)
    check.fail("tokens", "at most 2^31 - 1 tokens", std::to_string(tokens.numel()) + " tokens");
  check.element_aligned(tokens, "tokens");
  return tokens.size(-1);
}

// A (rows, C) table (weight, position_weight and their gradients): 2-D, the last dimension
// contiguous, one row stride. `cols` is the C it must have (-1: any C in 1..kEmbeddingMaxDim).
RowLayout check_table(const ArgCheck& check, const TensorView& t, const char* name, std::int64_t cols) {
  if (t.ndim != 2)
    check.fail(name, "a 2-dimensional tensor (rows, C)", "shape " + t.shape_string());
  const RowLayout l = check.rows(t, name);
  if (cols >= 0 && l.cols != cols)
    check.fail(name, "shape (rows, " + std::to_string(cols) + ")", "shape " + t.shape_string());
  if (l.cols < 1 || l.cols > kEmbeddingMaxDim)
    check.fail(name, "an embedding dimension C in 1.." + std::to_string(kEmbeddingMaxDim),
               "C = " + std::to_string(l.cols));
  if (l.rows > INT_MAX)
    check.fail(name, "at most 2^31 - 1 rows", std::to_string(l.rows) + " rows");
  check.element_aligned(t, name);
  return l;
}

// out / dout: tokens' shape followed by C, laid out as rows with one row stride.
RowLayout check_token_rows(const ArgCheck& check, const TensorView& t, const char* name,
                           const TensorView& tokens, std::int64_t cols) {
  bool same = t.ndim == tokens.ndim + 1 && t.size(-1) == cols;
  for (int d = 0; same && d < tokens.ndim; ++d) same = t.shape[d] == tokens.shape[d];
  if (!same) {
    std::string want = tokens.shape_string();
    want = want.substr(0, want.size() - 1) + (tokens.ndim > 0 ? ", " : "") + std::to_string(cols) + ")";
    check.fail(name, "shape " + want + " (tokens' shape, then C)", "shape " + t.shape_string());
  }
  const RowLayout l = check.rows(t, name);
  check.element_aligned(t, name);
  return l;
}

// The CPU backend refuses a token outside [0, V) (the GPU marks it instead: reading the tokens
// back would cost a synchronization).
void check_token_values(const ArgCheck& check, const void* ids, DType dtype, std::int64_t n,
                        std::int64_t vocab) {
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t t = dtype == DType::i32 ? static_cast<const std::int32_t*>(ids)[i]
                                               : static_cast<const std::int64_t*>(ids)[i];
    if (t < 0 || t >= vocab)
      check.fail("tokens", "token ids in [0, " + std::to_string(vocab) + ")",
                 "token " + std::to_string(t) + " at position " + std::to_string(i));
  }
}

}  // namespace

void embedding_forward(const TensorView& tokens, const TensorView& weight,
                       const OptionalTensor& position_weight, const TensorView& out, Stream stream) {
  const ArgCheck check("embedding_forward");
  const Device device = check.same_device({arg("tokens", tokens), arg("weight", weight),
                                           arg("position_weight", position_weight), arg("out", out)});
  embedding::ForwardParams p;
  p.positions = check_tokens(check, tokens);
  p.tokens = tokens.numel();
  p.token_dtype = tokens.dtype;
  p.token_ids = tokens.data;

  check_float_dtype(check, weight, "weight", device);
  const RowLayout wl = check_table(check, weight, "weight", -1);
  if (wl.rows < 1) check.fail("weight", "a vocabulary of at least 1 row", "shape " + weight.shape_string());
  p.vocab = wl.rows;
  p.dim = wl.cols;
  p.dtype = weight.dtype;
  p.weight = weight.data;
  p.weight_row_stride = wl.row_stride;

  if (position_weight) {
    check.dtype_is(*position_weight, "position_weight", weight.dtype, "as 'weight'");
    const RowLayout pl = check_table(check, *position_weight, "position_weight", p.dim);
    if (pl.rows < p.positions)
      check.fail("position_weight", "at least T = " + std::to_string(p.positions) + " rows (P >= T)",
                 "shape " + position_weight->shape_string());
    p.position_weight = position_weight->data;
    p.position_row_stride = pl.row_stride;
  }

  check.dtype_is(out, "out", weight.dtype, "as 'weight'");
  const RowLayout ol = check_token_rows(check, out, "out", tokens, p.dim);
  p.out = out.data;
  p.out_row_stride = ol.row_stride;
  check.no_overlap({arg("out", out)}, {arg("tokens", tokens), arg("weight", weight),
                                       arg("position_weight", position_weight)});
  if (device.is_cuda()) {
    require_supported_gpu(check.op(), device.index);
    embedding::forward_cuda(p, device.index, stream);
  } else {
    check_token_values(check, p.token_ids, p.token_dtype, p.tokens, p.vocab);
    embedding::forward_cpu(p);
  }
}

std::size_t embedding_backward_workspace_size(std::int64_t tokens, std::int64_t vocab,
                                              std::int64_t dim, Device device) {
  const ArgCheck check("embedding_backward_workspace_size");
  check.size_in(tokens, "tokens", 0, INT_MAX);
  check.size_in(vocab, "vocab", 1, kEmbeddingMaxVocab);
  check.size_in(dim, "dim", 1, kEmbeddingMaxDim);
  if (!device.is_cuda() || tokens == 0) return 0;
  // A device that is not there is the caller's error: say so before any CUDA call fails on it.
  detail::device_info(check.op(), device.index);
  return embedding::backward_workspace_bytes_cuda(tokens, vocab, dim, device.index);
}

void embedding_backward(const TensorView& dout, const TensorView& tokens, const TensorView& dweight,
                        const OptionalTensor& dposition_weight, bool accumulate,
                        const OptionalTensor& workspace, Stream stream) {
  const ArgCheck check("embedding_backward");
  const Device device = check.same_device({arg("dout", dout), arg("tokens", tokens),
                                           arg("dweight", dweight),
                                           arg("dposition_weight", dposition_weight),
                                           arg("workspace", workspace)});
  embedding::BackwardParams p;
  p.accumulate = accumulate;
  p.positions = check_tokens(check, tokens);
  p.tokens = tokens.numel();
  p.token_dtype = tokens.dtype;
  p.token_ids = tokens.data;

  check_float_dtype(check, dout, "dout", device);
  if (dout.ndim < 1) check.fail("dout", "shape (..., T, C)", "a 0-dimensional tensor");
  p.dim = dout.size(-1);
  if (p.dim < 1 || p.dim > kEmbeddingMaxDim)
    check.fail("dout", "an embedding dimension C in 1.." + std::to_string(kEmbeddingMaxDim),
               "C = " + std::to_string(p.dim));
  const RowLayout dl = check_token_rows(check, dout, "dout", tokens, p.dim);
  p.dtype = dout.dtype;
  p.dout = dout.data;
  p.dout_row_stride = dl.row_stride;

  const std::string grad_dtypes = std::string(dtype_name(dout.dtype)) + " (as 'dout')" +
                                  (dout.dtype == DType::f32 ? "" : " or f32");
  if (dweight.dtype != dout.dtype && dweight.dtype != DType::f32)
    check.fail("dweight", "dtype " + grad_dtypes, dtype_name(dweight.dtype));
  const RowLayout wl = check_table(check, dweight, "dweight", p.dim);
  if (wl.rows < 1) check.fail("dweight", "a vocabulary of at least 1 row", "shape " + dweight.shape_string());
  p.vocab = wl.rows;
  p.dweight = dweight.data;
  p.dweight_dtype = dweight.dtype;
  p.dweight_row_stride = wl.row_stride;

  if (dposition_weight) {
    if (dposition_weight->dtype != dout.dtype && dposition_weight->dtype != DType::f32)
      check.fail("dposition_weight", "dtype " + grad_dtypes, dtype_name(dposition_weight->dtype));
    const RowLayout pl = check_table(check, *dposition_weight, "dposition_weight", p.dim);
    if (pl.rows < p.positions)
      check.fail("dposition_weight", "at least T = " + std::to_string(p.positions) + " rows (P >= T)",
                 "shape " + dposition_weight->shape_string());
    p.position_rows = pl.rows;
    p.dposition_weight = dposition_weight->data;
    p.dposition_dtype = dposition_weight->dtype;
    p.dposition_row_stride = pl.row_stride;
  }
  check.no_overlap({arg("dweight", dweight), arg("dposition_weight", dposition_weight),
                    arg("workspace", workspace)},
                   {arg("dout", dout), arg("tokens", tokens)});

  if (device.is_cuda()) {
    require_supported_gpu(check.op(), device.index);
    const std::size_t need = embedding::backward_workspace_bytes_cuda(p.tokens, p.vocab, p.dim, device.index);
    if (need > 0) {
      const detail::Workspace ws =
          check.workspace(workspace, need, "embedding_backward_workspace_size", 16);
      p.workspace = ws.data;
      p.workspace_bytes = ws.bytes;
    }
    embedding::backward_cuda(p, device.index, stream);
  } else {
    check_token_values(check, p.token_ids, p.token_dtype, p.tokens, p.vocab);
    embedding::backward_cpu(p);
  }
}

}  // namespace fusekit
