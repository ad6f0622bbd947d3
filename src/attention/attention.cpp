// Public entry points of the attention family: argument checks (shapes, dtypes, the alignment
// rule of fusekit/attention.h, variable lengths, config), then dispatch on where the tensors live:
// the float64 CPU reference, or the CUDA kernels (f16 / bf16; other dtypes are refused with
// ErrorKind::unsupported after the argument checks and before any CUDA call).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "attention/attention_params.h"
#include "core/checked_math.h"
#include "core/convert.h"
#include "core/format.h"
#include "core/validate.h"
#include "fusekit/attention.h"
#include "fusekit/error.h"
#include "fusekit/runtime.h"

namespace fusekit {

using detail::arg;
using detail::ArgCheck;

const char* attention_mask_name(AttentionMask mask) {
  switch (mask) {
    case AttentionMask::none: return "none";
    case AttentionMask::causal_top_left: return "causal_top_left";
    case AttentionMask::causal_bottom_right: return "causal_bottom_right";
  }
  return "?";
}

namespace {

constexpr std::initializer_list<DType> kQkvDtypes = {DType::f16, DType::bf16, DType::f32, DType::f64};
constexpr std::initializer_list<DType> kBiasDtypes = {DType::f16, DType::bf16, DType::f32, DType::f64};

std::string str(std::int64_t v) { return std::to_string(v); }

// "(a, b, c)", built by appending (GCC 12 warns falsely on chains of "(" + std::string).
std::string tuple(std::initializer_list<std::int64_t> values) {
  std::string s = "(";
  for (std::int64_t v : values) {
    if (s.size() > 1) s += ", ";
    s += std::to_string(v);
  }
  s += ")";
  return s;
}

// Elements per 16 bytes: the vector width the future kernels load with.
std::int64_t vector_elems(DType dtype) { return 16 / static_cast<std::int64_t>(dtype_size(dtype)); }

void check_aligned_pointer(const ArgCheck& check, const TensorView& t, const char* name) {
  if (reinterpret_cast<std::uintptr_t>(t.data) % 16 != 0)
    check.fail(name, "a 16-byte aligned data pointer", "a pointer misaligned by " +
                                                           str(reinterpret_cast<std::uintptr_t>(t.data) % 16) +
                                                           " bytes");
}

// q, k, v, out and their gradients: (B, S, H, Dh) or, with variable lengths, (T, H, Dh).
struct Dims {
  std::int64_t b = 1, s = 0, h = 0, d = 0;
};

Dims operand_dims(const ArgCheck& check, const TensorView& t, const char* name, bool varlen) {
  const int want = varlen ? 3 : 4;
  if (t.ndim != want)
    check.fail(name, varlen ? "3 dimensions (tokens, heads, head_dim) with variable lengths"
                            : "4 dimensions (batch, seq, heads, head_dim)",
               str(t.ndim) + " dimensions, shape " + t.shape_string());
  Dims dims;
  if (varlen) {
    dims.s = t.shape[0], dims.h = t.shape[1], dims.d = t.shape[2];
  } else {
    dims.b = t.shape[0], dims.s = t.shape[1], dims.h = t.shape[2], dims.d = t.shape[3];
  }
  return dims;
}

attention::Operand operand_layout(const ArgCheck& check, const TensorView& t, const char* name,
                                  bool varlen) {
  check.has_data(t, name);
  const std::int64_t e = vector_elems(t.dtype);
  const std::int64_t head_dim = t.size(-1);
  if (head_dim < 1 || head_dim > kAttentionMaxHeadDim)
    check.fail(name, "a head dim in 1.." + str(kAttentionMaxHeadDim), str(head_dim));
  if (head_dim % e != 0)
    check.fail(name, "a head dim that is a multiple of " + str(e) + " (16 bytes of " +
                         dtype_name(t.dtype) + ")",
               str(head_dim));
  if (t.stride(-1) != 1)
    check.fail(name, "a contiguous head dim (stride 1)", "strides " + t.strides_string());
  for (int d = 0; d < t.ndim - 1 && t.numel() > 0; ++d) {
    if (t.strides[d] < 0) check.fail(name, "non-negative strides", "strides " + t.strides_string());
    if (t.shape[d] > 1 && t.strides[d] % e != 0)
      check.fail(name, "strides that are multiples of " + str(e) + " elements (16 bytes)",
                 "strides " + t.strides_string());
  }
  check_aligned_pointer(check, t, name);
  attention::Operand op;
  op.data = t.data;
  if (varlen) {
    op.s_stride = t.strides[0], op.h_stride = t.strides[1];
  } else {
    op.b_stride = t.strides[0], op.s_stride = t.strides[1], op.h_stride = t.strides[2];
  }
  return op;
}

// An operand that must have exactly the given dims and `like`'s dtype.
attention::Operand same_as(const ArgCheck& check, const TensorView& t, const char* name,
                           const Dims& want, const TensorView& like, const char* like_name,
                           bool varlen) {
  check.dtype_is(t, name, like.dtype, (std::string("as '") + like_name + "'").c_str());
  const Dims got = operand_dims(check, t, name, varlen);
  if (got.b != want.b || got.s != want.s || got.h != want.h || got.d != want.d) {
    const std::string shape = varlen ? tuple({want.s, want.h, want.d}) : tuple({want.b, want.s, want.h, want.d});
    check.fail(name, "shape " + shape, t.shape_string());
  }
  return operand_layout(check, t, name, varlen);
}

void check_config(const ArgCheck& check, const AttentionConfig& c) {
  if (!(c.dropout_p >= 0.0f && c.dropout_p < 1.0f))
    check.fail("dropout_p", "a probability in [0, 1)", std::to_string(c.dropout_p));
  if (c.offset >= (std::uint64_t{1} << 32))
    check.fail("offset", "a Philox offset below 2^32", std::to_string(c.offset));
  if (c.scale && !std::isfinite(*c.scale))
    check.fail("scale", "a finite scale (or none for 1/sqrt(D))", std::to_string(*c.scale));
  if (c.window_left < -1) check.fail("window_left", "-1 (unbounded) or >= 0", str(c.window_left));
  if (c.window_right < -1) check.fail("window_right", "-1 (unbounded) or >= 0", str(c.window_right));
  if (c.mask != AttentionMask::none && c.mask != AttentionMask::causal_top_left &&
      c.mask != AttentionMask::causal_bottom_right)
    check.fail("mask", "none, causal_top_left or causal_bottom_right", str(static_cast<int>(c.mask)));
}

// Checks a cumulative-length vector's form; its values only where the host can read them.
const std::int32_t* check_cu_seqlens(const ArgCheck& check, const TensorView& t, const char* name,
                                     std::int64_t batch_plus_one, std::int64_t total,
                                     std::int64_t max_len, const char* max_name) {
  check.dtype_is(t, name, DType::i32, "cumulative lengths are int32");
  if (t.ndim != 1 || t.shape[0] != batch_plus_one || t.shape[0] < 1)
    check.fail(name, batch_plus_one >= 1 ? "shape " + tuple({batch_plus_one}) + " (batch + 1, as 'cu_seqlens_q')"
                                         : "at least one element (batch + 1)",
               t.shape_string());
  check.contiguous_numel(t, name, t.shape[0]);
  if (max_len < 0) check.fail(max_name, "a non-negative length", str(max_len));
  const auto* cu = t.data_as<const std::int32_t>();
  if (t.device.is_cuda()) return cu;  // reading would synchronize; the kernels trust (and clamp) them
  if (cu[0] != 0) check.fail(name, "a first element of 0", str(cu[0]));
  for (std::int64_t b = 0; b + 1 < t.shape[0]; ++b) {
    const std::int64_t len = std::int64_t{cu[b + 1]} - cu[b];
    if (len < 0)
      check.fail(name, "non-decreasing cumulative lengths",
                 "element " + str(b + 1) + " = " + str(cu[b + 1]) + " after " + str(cu[b]));
    if (len > max_len)
      check.fail(name, std::string("sequence lengths of at most ") + max_name + " = " + str(max_len),
                 "sequence " + str(b) + " of length " + str(len));
  }
  if (cu[t.shape[0] - 1] != total)
    check.fail(name, "a last element equal to the packed token count " + str(total),
               str(cu[t.shape[0] - 1]));
  return cu;
}

// bias (is_grad false) or dbias (is_grad true), indexed (b, h, i, j).
attention::BiasOperand bias_layout(const ArgCheck& check, const TensorView& t, const char* name,
                                   const attention::Problem& p, bool is_grad) {
  check.dtype_in(t, name, kBiasDtypes);
  check.has_data(t, name);
  if (t.ndim != 4)
    check.fail(name, "4 dimensions (batch, heads, query, key)", "shape " + t.shape_string());
  const std::int64_t e = vector_elems(t.dtype);
  const std::int64_t full[3] = {p.batch, p.heads_q, p.seqlen_q};
  const char* dim_names[3] = {"batch", "heads", "query"};
  attention::BiasOperand op;
  op.data = t.data;
  op.dtype = t.dtype;
  std::int64_t strides[3];
  for (int d = 0; d < 3; ++d) {
    const std::int64_t n = t.shape[d];
    // With variable lengths the query dim is padded: anything >= the longest sequence works.
    const bool full_ok = (d == 2 && p.varlen) ? n >= full[d] : n == full[d];
    if (n != 1 && !full_ok)
      check.fail(name, std::string("a ") + dim_names[d] + " dim of 1 (broadcast) or " +
                           (d == 2 && p.varlen ? "at least " : "") + str(full[d]),
                 "shape " + t.shape_string());
    strides[d] = n == 1 ? 0 : t.strides[d];
    op.shape[d] = n;
    if (t.numel() == 0) continue;  // nothing is read or written: strides do not matter
    if (strides[d] < 0) check.fail(name, "non-negative strides", "strides " + t.strides_string());
    if (is_grad && n > 1 && strides[d] == 0)
      check.fail(name, std::string("a materialized ") + dim_names[d] +
                           " dim (size 1 to reduce over it; a stride-0 expanded gradient would be "
                           "written concurrently)",
                 "shape " + t.shape_string() + " with strides " + t.strides_string());
    if (strides[d] % e != 0)
      check.fail(name, "strides that are 0 or multiples of " + str(e) + " elements (16 bytes)",
                 "strides " + t.strides_string());
  }
  const std::int64_t keys = t.shape[3];
  if (p.varlen ? keys < p.seqlen_k : keys != p.seqlen_k)
    check.fail(name, std::string("a key dim ") + (p.varlen ? "of at least max_seqlen_k = " : "of ") +
                         str(p.seqlen_k),
               "shape " + t.shape_string());
  if (keys > 1 && t.strides[3] != 1)
    check.fail(name, "a contiguous key dim (stride 1)", "strides " + t.strides_string());
  check_aligned_pointer(check, t, name);
  op.shape[3] = keys;
  op.b_stride = strides[0], op.h_stride = strides[1], op.i_stride = strides[2];
  return op;
}

// A bias on the CPU is read here: +inf or NaN would make out and lse NaN (the softmax of +inf), so
// they are refused; -inf is a mask. On the GPU a scan would cost a pass over the bias: there the
// rule is a documented precondition (fusekit/attention.h).
void check_bias_values(const ArgCheck& check, const TensorView& t) {
  if (t.device.is_cuda() || t.numel() == 0) return;
  for (std::int64_t b = 0; b < t.shape[0]; ++b)
    for (std::int64_t h = 0; h < t.shape[1]; ++h)
      for (std::int64_t i = 0; i < t.shape[2]; ++i)
        for (std::int64_t j = 0; j < t.shape[3]; ++j) {
          const std::int64_t off = b * t.strides[0] + h * t.strides[1] + i * t.strides[2] + j * t.strides[3];
          const double x = detail::load_as_double(t.data, t.dtype, off);
          if (std::isnan(x) || x == std::numeric_limits<double>::infinity())
            check.fail("bias", "finite values or -inf (a mask)",
                       detail::format_float(x) + " at " + tuple({b, h, i, j}));
        }
}

void check_lse(const ArgCheck& check, const TensorView& lse, const attention::Problem& p) {
  check.dtype_is(lse, "lse", DType::f32, "the log-sum-exp is float32");
  const bool ok = p.varlen ? lse.ndim == 2 && lse.shape[0] == p.heads_q && lse.shape[1] == p.total_q
                           : lse.ndim == 3 && lse.shape[0] == p.batch && lse.shape[1] == p.heads_q &&
                                 lse.shape[2] == p.seqlen_q;
  if (!ok)
    check.fail("lse",
               p.varlen ? "shape " + tuple({p.heads_q, p.total_q}) + " (heads, tokens)"
                        : "shape " + tuple({p.batch, p.heads_q, p.seqlen_q}) + " (batch, heads, seq)",
               lse.shape_string());
  check.contiguous_numel(lse, "lse", lse.numel());
  check_aligned_pointer(check, lse, "lse");
}

// The checks forward and backward share: q, k, v, out, lse, bias, varlen, config.
attention::Problem check_common(const ArgCheck& check, const TensorView& q, const TensorView& k,
                                const TensorView& v, const TensorView& out, const TensorView& lse,
                                const OptionalTensor& bias, const AttentionConfig& config,
                                const std::optional<AttentionVarlen>& varlen) {
  check_config(check, config);
  attention::Problem p;
  p.varlen = varlen.has_value();
  check.dtype_in(q, "q", kQkvDtypes);
  const Dims qd = operand_dims(check, q, "q", p.varlen);
  check.dtype_is(k, "k", q.dtype, "as 'q'");
  const Dims kd = operand_dims(check, k, "k", p.varlen);
  check.dtype_is(v, "v", q.dtype, "as 'q'");
  const Dims vd = operand_dims(check, v, "v", p.varlen);
  if (kd.b != qd.b) check.fail("k", "batch " + str(qd.b) + " (as 'q')", "shape " + k.shape_string());
  if (kd.d != qd.d) check.fail("k", "head dim " + str(qd.d) + " (as 'q')", "shape " + k.shape_string());
  if (vd.b != kd.b || vd.s != kd.s || vd.h != kd.h)
    check.fail("v", "batch, sequence and heads " + tuple({kd.b, kd.s, kd.h}) + " as 'k'",
               "shape " + v.shape_string());
  if (kd.h < 1 || qd.h % kd.h != 0)
    check.fail("k", "a head count that divides q's " + str(qd.h) + " heads (GQA/MQA)",
               str(kd.h) + " heads");
  p.q = operand_layout(check, q, "q", p.varlen);
  p.k = operand_layout(check, k, "k", p.varlen);
  p.v = operand_layout(check, v, "v", p.varlen);
  p.out = same_as(check, out, "out", {qd.b, qd.s, qd.h, vd.d}, q, "q", p.varlen);
  p.dtype = q.dtype;
  p.heads_q = qd.h, p.heads_kv = kd.h, p.head_dim = qd.d, p.head_dim_v = vd.d;
  if (p.varlen) {
    p.batch = varlen->cu_seqlens_q.ndim == 1 ? varlen->cu_seqlens_q.shape[0] - 1 : 0;
    p.seqlen_q = varlen->max_seqlen_q, p.seqlen_k = varlen->max_seqlen_k;
    p.total_q = qd.s;
    p.total_k = kd.s;
    p.cu_seqlens_q = check_cu_seqlens(check, varlen->cu_seqlens_q, "cu_seqlens_q", p.batch + 1, qd.s,
                                      varlen->max_seqlen_q, "max_seqlen_q");
    p.cu_seqlens_k = check_cu_seqlens(check, varlen->cu_seqlens_k, "cu_seqlens_k", p.batch + 1, kd.s,
                                      varlen->max_seqlen_k, "max_seqlen_k");
  } else {
    p.batch = qd.b, p.seqlen_q = qd.s, p.seqlen_k = kd.s;
    p.total_q = qd.b * qd.s;
    p.total_k = kd.b * kd.s;
  }
  check_lse(check, lse, p);
  p.lse = lse.data_as<float>();
  if (bias) {
    p.bias = bias_layout(check, *bias, "bias", p, false);
    check_bias_values(check, *bias);
  }
  p.scale = config.scale ? static_cast<double>(*config.scale) : 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  p.mask = config.mask;
  // A window of Sq + Sk keys or more bounds nothing (fusekit/attention.h): it becomes -1 here, so
  // that no backend forms i + d +- window near the int64 limit.
  const std::optional<std::int64_t> unbounded = detail::checked_add(p.seqlen_q, p.seqlen_k);
  auto window = [&](std::int64_t w) { return unbounded && w >= *unbounded ? -1 : w; };
  p.window_left = window(config.window_left), p.window_right = window(config.window_right);
  p.dropout_p = config.dropout_p, p.seed = config.seed, p.offset = config.offset;
  return p;
}

// The CUDA kernels take f16 and bf16 (float32 accumulation); f32 and f64 are the CPU
// reference's. Checked before any CUDA call.
void require_gpu_dtype(const char* op, DType dtype) {
  if (dtype != DType::f16 && dtype != DType::bf16)
    throw Error(ErrorKind::unsupported, op,
                std::string("the CUDA attention kernels take f16 and bf16 q/k/v (float32 accumulation); ") +
                    dtype_name(dtype) + " attention runs on the CPU reference only (use CPU tensors)");
}

void require_gpu_bias_dtype(const char* op, const char* name, const attention::BiasOperand& b) {
  if (b.data != nullptr && b.dtype == DType::f64)
    throw Error(ErrorKind::unsupported, op,
                std::string("the CUDA attention kernels take an f16, bf16 or f32 '") + name +
                    "'; f64 runs on the CPU reference only");
}

// The size queries' arguments, all fields of the argument 'shape' (the message names the field):
// every size non-negative, head dims within the kernels' limit and a q/k/v dtype; then a valid
// config, and workspace products that fit in 2^63 - 1 bytes.
void check_shape(const ArgCheck& check, const AttentionShape& s, const AttentionConfig& config) {
  constexpr std::int64_t kAny = std::numeric_limits<std::int64_t>::max();
  const struct {
    const char* name;
    std::int64_t value, max;
  } sizes[] = {{"batch", s.batch, kAny},       {"seqlen_q", s.seqlen_q, kAny},
               {"seqlen_k", s.seqlen_k, kAny}, {"heads_q", s.heads_q, kAny},
               {"heads_kv", s.heads_kv, kAny}, {"head_dim", s.head_dim, kAttentionMaxHeadDim},
               {"head_dim_v", s.head_dim_v, kAttentionMaxHeadDim}};
  for (const auto& z : sizes)
    if (z.value < 0 || z.value > z.max)
      check.fail("shape", std::string(z.name) + (z.max == kAny ? " >= 0" : " in 0.." + str(z.max)),
                 std::string(z.name) + " = " + str(z.value));
  bool known = false;
  for (DType d : kQkvDtypes) known = known || s.dtype == d;
  if (!known)
    check.fail("shape", "dtype " + detail::dtype_list(kQkvDtypes),
               dtype_size(s.dtype) ? std::string(dtype_name(s.dtype))
                                   : "dtype code " + str(static_cast<int>(s.dtype)));
  check_config(check, config);
  // The GPU backward's delta (B x Sq x Hq floats) and dq accumulator (times D): products the CUDA
  // size function forms, each refused here before it could wrap.
  detail::size_product(check.op(), "shape", "the float32 dq accumulator (batch x seqlen_q x heads_q x head_dim x 4 bytes)",
                       {s.batch, s.seqlen_q, s.heads_q, std::max<std::int64_t>(s.head_dim, 1), 4});
}

OptionalTensor varlen_arg(const std::optional<AttentionVarlen>& varlen, bool q) {
  if (!varlen) return std::nullopt;
  return q ? varlen->cu_seqlens_q : varlen->cu_seqlens_k;
}

}  // namespace

std::size_t attention_forward_workspace_size(const AttentionShape& shape, const AttentionConfig& config,
                                             Device device) {
  const char* op = "attention_forward_workspace_size";
  check_shape(ArgCheck(op), shape, config);
  if (!device.is_cuda()) return 0;
  require_gpu_dtype(op, shape.dtype);
  return attention::forward_workspace_cuda(shape.batch, shape.seqlen_q, shape.heads_q, shape.head_dim);
}

std::size_t attention_backward_workspace_size(const AttentionShape& shape, const AttentionConfig& config,
                                              bool deterministic, Device device) {
  const char* op = "attention_backward_workspace_size";
  check_shape(ArgCheck(op), shape, config);
  if (!device.is_cuda()) return 0;
  require_gpu_dtype(op, shape.dtype);
  return attention::backward_workspace_cuda(shape.batch, shape.seqlen_q, shape.heads_q, shape.head_dim,
                                            deterministic);
}

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                       const OptionalTensor& bias, const AttentionConfig& config,
                       const TensorView& out, const TensorView& lse,
                       const std::optional<AttentionVarlen>& varlen,
                       const OptionalTensor& workspace, Stream stream) {
  const char* op = "attention_forward";
  ArgCheck check(op);
  const Device device = check.same_device(
      {arg("q", q), arg("k", k), arg("v", v), arg("bias", bias), arg("out", out), arg("lse", lse),
       arg("cu_seqlens_q", varlen_arg(varlen, true)), arg("cu_seqlens_k", varlen_arg(varlen, false)),
       arg("workspace", workspace)});
  const attention::Problem p = check_common(check, q, k, v, out, lse, bias, config, varlen);
  // Exact for q / k / v heads packed in one buffer (their views interleave, their bytes do not).
  check.no_overlap({arg("out", out), arg("lse", lse), arg("workspace", workspace)},
                   {arg("q", q), arg("k", k), arg("v", v), arg("bias", bias),
                    arg("cu_seqlens_q", varlen_arg(varlen, true)), arg("cu_seqlens_k", varlen_arg(varlen, false))});
  if (device.is_cuda()) {
    require_gpu_dtype(op, p.dtype);
    require_gpu_bias_dtype(op, "bias", p.bias);
    require_supported_gpu(op, device.index);
    attention::forward_cuda(p, device.index, stream);
  } else {
    attention::forward_cpu(p);
  }
}

void attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& out, const TensorView& lse,
                        const OptionalTensor& bias, const AttentionConfig& config,
                        const OptionalTensor& dq, const OptionalTensor& dk,
                        const OptionalTensor& dv, const OptionalTensor& dbias,
                        const std::optional<AttentionVarlen>& varlen, bool deterministic,
                        const OptionalTensor& workspace, Stream stream) {
  const char* op = "attention_backward";
  ArgCheck check(op);
  const Device device = check.same_device(
      {arg("dout", dout), arg("q", q), arg("k", k), arg("v", v), arg("out", out), arg("lse", lse),
       arg("bias", bias), arg("dq", dq), arg("dk", dk), arg("dv", dv), arg("dbias", dbias),
       arg("cu_seqlens_q", varlen_arg(varlen, true)), arg("cu_seqlens_k", varlen_arg(varlen, false)),
       arg("workspace", workspace)});
  attention::BackwardProblem p;
  static_cast<attention::Problem&>(p) = check_common(check, q, k, v, out, lse, bias, config, varlen);
  const bool vl = p.varlen;
  const Dims qd = operand_dims(check, q, "q", vl), kd = operand_dims(check, k, "k", vl),
             vd = operand_dims(check, v, "v", vl), od = operand_dims(check, out, "out", vl);
  p.dout = same_as(check, dout, "dout", od, q, "q", vl);
  if (dq) p.dq = same_as(check, *dq, "dq", qd, q, "q", vl);
  if (dk) p.dk = same_as(check, *dk, "dk", kd, q, "q", vl);
  if (dv) p.dv = same_as(check, *dv, "dv", vd, q, "q", vl);
  if (dbias) {
    if (!bias) check.fail("dbias", "no dbias (the attention was called without a bias)", "a tensor");
    p.dbias = bias_layout(check, *dbias, "dbias", p, true);
    // dbias has the bias's shape, except that a dimension the bias broadcasts through stride 0
    // may (and, being written, must) be 1 in dbias: the gradient is summed over it. That includes
    // an expanded dimension of size 0 (e.g. every query length 0): the sum is empty, dbias is 0.
    for (int d = 0; d < 4; ++d) {
      const bool broadcast = d < 3 && p.bias.shape[d] != 1 &&
                             (d == 0 ? p.bias.b_stride : d == 1 ? p.bias.h_stride : p.bias.i_stride) == 0;
      if (p.dbias.shape[d] != p.bias.shape[d] && !(broadcast && p.dbias.shape[d] == 1))
        check.fail("dbias",
                   "shape " + bias->shape_string() + " (as 'bias'; 1 where the bias has stride 0)",
                   dbias->shape_string());
    }
  }
  // Exact for dq / dk / dv packed in one buffer, as q / k / v may be.
  check.no_overlap({arg("dq", dq), arg("dk", dk), arg("dv", dv), arg("dbias", dbias), arg("workspace", workspace)},
                   {arg("dout", dout), arg("q", q), arg("k", k), arg("v", v), arg("out", out), arg("lse", lse),
                    arg("bias", bias), arg("cu_seqlens_q", varlen_arg(varlen, true)),
                    arg("cu_seqlens_k", varlen_arg(varlen, false))});
  p.deterministic = deterministic;
  if (!device.is_cuda()) {
    attention::backward_cpu(p);
    return;
  }
  require_gpu_dtype(op, p.dtype);
  require_gpu_bias_dtype(op, "bias", p.bias);
  require_gpu_bias_dtype(op, "dbias", p.dbias);
  const bool any_output = p.dq.data || p.dk.data || p.dv.data || p.dbias.data;
  const std::size_t need =
      any_output ? attention::backward_workspace_cuda(p.batch, p.seqlen_q, p.heads_q, p.head_dim, deterministic) : 0;
  if (need > 0) {
    const std::string expected =
        "a u8 tensor of at least " + std::to_string(need) + " bytes (attention_backward_workspace_size)";
    if (!workspace) check.fail("workspace", expected, "none");
    const TensorView& ws = *workspace;
    check.has_data(ws, "workspace");
    if (ws.dtype != DType::u8 || static_cast<std::size_t>(ws.numel()) < need || !ws.is_contiguous())
      check.fail("workspace", expected, std::string(dtype_name(ws.dtype)) + " tensor of shape " + ws.shape_string());
    check_aligned_pointer(check, ws, "workspace");
    p.workspace = ws.data;
    p.workspace_bytes = static_cast<std::size_t>(ws.numel());
  }
  require_supported_gpu(op, device.index);
  attention::backward_cuda(p, device.index, stream);
}

}  // namespace fusekit
