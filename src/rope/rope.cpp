// Public entry points of the rotary-embedding family: argument checks, then dispatch on where the
// tensors live (CPU reference or CUDA kernels).
#include <climits>
#include <cmath>
#include <string>

#include "core/format.h"
#include "core/validate.h"
#include "fusekit/rope.h"
#include "fusekit/runtime.h"
#include "rope/rope_math.h"
#include "rope/rope_params.h"

namespace fusekit {

using detail::arg;
using detail::ArgCheck;
using detail::kFloatDtypes;
using detail::same_view;

const char* rope_style_name(RopeStyle style) {
  switch (style) {
    case RopeStyle::rotate_half: return "rotate_half";
    case RopeStyle::interleaved: return "interleaved";
  }
  return "unknown";
}

namespace {

// Tokens are indexed with 32-bit block and shared-memory coordinates on the GPU.
constexpr std::int64_t kMaxTokens = INT_MAX;

std::string str(std::int64_t v) { return std::to_string(v); }

// (B, S, H, D) of a 4-D operand, or (1, T, H, D) of a 3-D (packed) one.
struct Dims {
  std::int64_t b = 1, s = 0, h = 0, d = 0;
};

Dims dims_of(const ArgCheck& check, const TensorView& t, const char* name) {
  if (t.ndim != 3 && t.ndim != 4)
    check.fail(name, "4 dimensions (batch, seq, heads, head_dim) or 3 (tokens, heads, head_dim)",
               str(t.ndim) + " dimensions, shape " + t.shape_string());
  Dims d;
  if (t.ndim == 4) d.b = t.shape[0];
  d.s = t.size(-3), d.h = t.size(-2), d.d = t.size(-1);
  return d;
}

// Any strides, the head dim contiguous.
rope::Operand operand_of(const ArgCheck& check, const TensorView& t, const char* name) {
  check.has_data(t, name);
  if (t.size(-1) > 1 && t.stride(-1) != 1)
    check.fail(name, "a contiguous head dim (stride 1)", "strides " + t.strides_string());
  rope::Operand op;
  op.data = t.data;
  op.b_stride = t.ndim == 4 ? t.strides[0] : 0;
  op.s_stride = t.stride(-3), op.h_stride = t.stride(-2);
  return op;
}

// `t` with exactly `like`'s dimensions and dtype.
void same_shape_and_dtype(const ArgCheck& check, const TensorView& t, const char* name,
                          const TensorView& like, const char* like_name) {
  check.dtype_is(t, name, like.dtype, (std::string("as '") + like_name + "'").c_str());
  bool same = t.ndim == like.ndim;
  for (int d = 0; same && d < t.ndim; ++d) same = t.shape[d] == like.shape[d];
  if (!same)
    check.fail(name, "shape " + like.shape_string() + " (as '" + like_name + "')", t.shape_string());
}

bool finite_positive(float v) { return std::isfinite(v) && v > 0.0f; }

// style, rotary_dim against the head dim D (already in 2..kRopeMaxHeadDim), and the scalars;
// returns r.
std::int64_t check_config(const ArgCheck& check, const RopeConfig& c, std::int64_t head_dim) {
  if (c.style != RopeStyle::rotate_half && c.style != RopeStyle::interleaved)
    check.fail("style", "rotate_half or interleaved", "value " + str(static_cast<int>(c.style)));
  const std::int64_t r = c.rotary_dim == 0 ? head_dim : c.rotary_dim;
  if (r < 2 || r > head_dim || r % 2 != 0)
    check.fail("rotary_dim",
               "an even rotary dim in 2..head_dim = " + str(head_dim) + " (0: the whole head dim)",
               c.rotary_dim == 0 ? "0, i.e. the head dim " + str(head_dim) : str(c.rotary_dim));
  if (!finite_positive(c.theta))
    check.fail("theta", "a finite base > 0", detail::format_float(c.theta));
  if (!finite_positive(c.linear_scaling))
    check.fail("linear_scaling", "a finite factor > 0", detail::format_float(c.linear_scaling));
  if (!std::isfinite(c.attention_scaling))
    check.fail("attention_scaling", "a finite factor", detail::format_float(c.attention_scaling));
  return r;
}

// position_ids: int32 / int64, (B, S) or (1, S) with 4-D q, (T) with 3-D q; any strides.
void check_positions(const ArgCheck& check, const TensorView& t, const TensorView& q, const Dims& qd,
                     rope::Params& p) {
  check.dtype_in(t, "position_ids", {DType::i32, DType::i64});
  check.has_data(t, "position_ids");
  if (q.ndim == 4) {
    if (t.ndim != 2 || (t.shape[0] != qd.b && t.shape[0] != 1) || t.shape[1] != qd.s)
      check.fail("position_ids", "shape (" + str(qd.b) + ", " + str(qd.s) + ") or (1, " + str(qd.s) + ") (q's batch and sequence)",
                 t.shape_string());
    p.pos_b_stride = t.shape[0] == 1 ? 0 : t.strides[0];
    p.pos_s_stride = t.strides[1];
  } else {
    if (t.ndim != 1 || t.shape[0] != qd.s)
      check.fail("position_ids", "shape (" + str(qd.s) + ") (q's tokens)", t.shape_string());
    p.pos_b_stride = 0;
    p.pos_s_stride = t.strides[0];
  }
  p.positions = t.data;
  p.position_dtype = t.dtype;
}

// The angle source (RopeTables) and the theta table.
void check_tables(const ArgCheck& check, const RopeTables& tables, const RopeConfig& config,
                  std::int64_t rotary_dim, rope::Params& p) {
  const std::int64_t half = rotary_dim / 2;
  if (tables.cos.has_value() != tables.sin.has_value())
    check.fail(tables.cos ? "sin" : "cos", std::string("a table since '") + (tables.cos ? "cos" : "sin") + "' is given",
               "none");
  if (tables.inv_freq && tables.cos)
    check.fail("inv_freq", "no inv_freq table when cos and sin are given (one angle source)", "a tensor");
  const bool table = tables.inv_freq || tables.cos;
  if (table && config.linear_scaling != 1.0f)
    check.fail("linear_scaling", "1 with an inv_freq or cos / sin table (fold the scaling into the table)",
               detail::format_float(config.linear_scaling));
  if (tables.inv_freq) {
    check.dtype_is(*tables.inv_freq, "inv_freq", DType::f32, "the angles' float32 frequencies");
    check.vector(*tables.inv_freq, "inv_freq", half);
    p.source = rope::AngleSource::inv_freq;
    p.inv_freq_table = tables.inv_freq->data_as<const float>();
  } else if (tables.cos) {
    const TensorView& c = *tables.cos;
    const TensorView& s = *tables.sin;
    for (const auto& [t, name] : {std::pair{&c, "cos"}, std::pair{&s, "sin"}}) {
      check.dtype_is(*t, name, DType::f32, "float32 tables");
      check.has_data(*t, name);
      if (t->ndim != 2 || t->shape[1] != half || t->shape[0] < 1)
        check.fail(name, "shape (P, " + str(half) + ") with P >= 1 positions (rotary_dim / 2 columns)", t->shape_string());
      if (half > 1 && t->strides[1] != 1)
        check.fail(name, "a contiguous last dim (stride 1)", "strides " + t->strides_string());
    }
    if (s.shape[0] != c.shape[0])
      check.fail("sin", "shape " + c.shape_string() + " (as 'cos')", s.shape_string());
    p.source = rope::AngleSource::cos_sin;
    p.cos_table = c.data_as<const float>();
    p.sin_table = s.data_as<const float>();
    p.cos_row_stride = c.shape[0] > 1 ? c.strides[0] : half;
    p.sin_row_stride = s.shape[0] > 1 ? s.strides[0] : half;
    p.table_rows = c.shape[0];
  } else {
    p.source = rope::AngleSource::theta;
    rope::inv_freq_from_theta(config.theta, config.linear_scaling, rotary_dim, p.inv_freq);
  }
}

// On the CPU every position is read here: with cos / sin tables each must be a row of the tables.
void check_table_positions(const ArgCheck& check, const rope::Params& p) {
  const std::int64_t rows = p.table_rows;
  auto at = [&](std::int64_t b, std::int64_t s) -> std::int64_t {
    const std::int64_t i = b * p.pos_b_stride + s * p.pos_s_stride;
    return p.position_dtype == DType::i32 ? static_cast<const std::int32_t*>(p.positions)[i]
                                          : static_cast<const std::int64_t*>(p.positions)[i];
  };
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t s = 0; s < p.seqlen; ++s) {
      const std::int64_t pos = p.positions ? at(b, s) : s;
      if (pos < 0 || pos >= rows)
        check.fail(p.positions ? "position_ids" : "cos",
                   p.positions ? "positions in [0, " + str(rows) + ") (the rows of cos and sin)"
                               : "at least " + str(p.seqlen) + " rows (one per sequence position)",
                   p.positions ? str(pos) + " at (" + str(b) + ", " + str(s) + ")" : str(rows) + " rows");
    }
}

// The checks and the parameters both directions share. `lead` is q (forward) or dq_out
// (backward), `out` q_out or dq; `k`/`k_out` likewise.
rope::Params check_call(const ArgCheck& check, const char* lead_name, const TensorView& lead,
                        const char* k_name, const OptionalTensor& k, const OptionalTensor& position_ids,
                        const RopeConfig& config, const char* out_name, const TensorView& out,
                        const char* k_out_name, const OptionalTensor& k_out, const RopeTables& tables) {
  const Device device = check.same_device({arg(lead_name, lead), arg(k_name, k), arg("position_ids", position_ids),
                                           arg(out_name, out), arg(k_out_name, k_out),
                                           arg("inv_freq", tables.inv_freq), arg("cos", tables.cos),
                                           arg("sin", tables.sin)});
  (void)device;
  check.dtype_in(lead, lead_name, kFloatDtypes);
  const Dims qd = dims_of(check, lead, lead_name);
  rope::Params p;
  p.dtype = lead.dtype;
  p.style = config.style;
  // A head-dim problem is reported against the lead tensor, before rotary_dim is read.
  if (qd.d < 2 || qd.d > kRopeMaxHeadDim)
    check.fail(lead_name, "a head dim in 2.." + str(kRopeMaxHeadDim), str(qd.d));
  p.rotary_dim = check_config(check, config, qd.d);
  p.head_dim = qd.d;
  p.batch = qd.b, p.seqlen = qd.s, p.heads_q = qd.h;
  p.attention_scaling = config.attention_scaling;
  p.q_in = operand_of(check, lead, lead_name);
  same_shape_and_dtype(check, out, out_name, lead, lead_name);
  p.q_out = operand_of(check, out, out_name);

  if (k.has_value() != k_out.has_value())
    check.fail(k ? k_out_name : k_name, std::string("a tensor since '") + (k ? k_name : k_out_name) + "' is given",
               "none");
  if (k) {
    check.dtype_is(*k, k_name, lead.dtype, (std::string("as '") + lead_name + "'").c_str());
    const Dims kd = dims_of(check, *k, k_name);
    if (k->ndim != lead.ndim || kd.b != qd.b || kd.s != qd.s || kd.d != qd.d) {
      // Built by appending: GCC 12 warns falsely (-Wrestrict) on chains that start "(" + std::string.
      std::string want = "shape (";
      if (lead.ndim == 4) want += str(qd.b) + ", ";
      want += str(qd.s) + ", Hk, " + str(qd.d) + ") (";
      want += lead_name;
      want += "'s batch, sequence and head dim)";
      check.fail(k_name, want, k->shape_string());
    }
    p.heads_k = kd.h;
    p.k_in = operand_of(check, *k, k_name);
    same_shape_and_dtype(check, *k_out, k_out_name, *k, k_name);
    p.k_out = operand_of(check, *k_out, k_out_name);
  }
  if (p.tokens() > kMaxTokens)
    check.fail(lead_name, "at most 2^31 - 1 tokens (batch x sequence)", str(p.tokens()) + " tokens");
  if (p.heads_q + p.heads_k > kRopeMaxHeads)
    check.fail(k ? k_name : lead_name, "at most " + str(kRopeMaxHeads) + " heads of q and k together",
               str(p.heads_q + p.heads_k) + " heads");
  if (position_ids) check_positions(check, *position_ids, lead, qd, p);
  check_tables(check, tables, config, p.rotary_dim, p);

  // In place: an output may be its own input exactly; nothing else may overlap.
  p.q_in_place = same_view(out, lead);
  p.k_in_place = k && same_view(*k_out, *k);
  const detail::NamedArg none{"", nullptr};
  const detail::NamedArg lead_arg = p.q_in_place ? none : arg(lead_name, lead);
  const detail::NamedArg k_arg = p.k_in_place ? none : arg(k_name, k);
  check.no_overlap({arg(out_name, out)}, {lead_arg, arg(k_name, k), arg("position_ids", position_ids),
                                          arg("inv_freq", tables.inv_freq), arg("cos", tables.cos),
                                          arg("sin", tables.sin)});
  check.no_overlap({arg(k_out_name, k_out)}, {arg(lead_name, lead), k_arg, arg(out_name, out),
                                              arg("position_ids", position_ids), arg("inv_freq", tables.inv_freq),
                                              arg("cos", tables.cos), arg("sin", tables.sin)});
  if (p.source == rope::AngleSource::cos_sin && !lead.device.is_cuda()) check_table_positions(check, p);
  return p;
}

void dispatch(const ArgCheck& check, const rope::Params& p, Device device, Stream stream) {
  if (p.tokens() == 0 || p.heads_q + p.heads_k == 0) return;
  if (device.is_cuda()) {
    require_supported_gpu(check.op(), device.index);
    rope::rotate_cuda(p, device.index, stream);
  } else {
    rope::rotate_cpu(p);
  }
}

}  // namespace

void rope_forward(const TensorView& q, const OptionalTensor& k, const OptionalTensor& position_ids,
                  const RopeConfig& config, const TensorView& q_out, const OptionalTensor& k_out,
                  const RopeTables& tables, Stream stream) {
  ArgCheck check("rope_forward");
  rope::Params p = check_call(check, "q", q, "k", k, position_ids, config, "q_out", q_out, "k_out", k_out, tables);
  p.transpose = false;
  dispatch(check, p, q.device, stream);
}

void rope_backward(const TensorView& dq_out, const OptionalTensor& dk_out, const OptionalTensor& position_ids,
                   const RopeConfig& config, const TensorView& dq, const OptionalTensor& dk,
                   const RopeTables& tables, Stream stream) {
  ArgCheck check("rope_backward");
  rope::Params p =
      check_call(check, "dq_out", dq_out, "dk_out", dk_out, position_ids, config, "dq", dq, "dk", dk, tables);
  p.transpose = true;
  dispatch(check, p, dq_out.device, stream);
}

}  // namespace fusekit
