// Attention bindings (fusekit/attention.h): one Python function per C++ entry point, same argument
// names and order. AttentionConfig is flattened into keyword-only arguments (scale, mask,
// window_left, window_right, dropout_p, seed, offset) and AttentionVarlen into cu_seqlens_q,
// cu_seqlens_k, max_seqlen_q, max_seqlen_k (variable lengths when the cumulative lengths are
// given); outputs and workspace are arrays the caller allocates.
#include <cstdint>
#include <optional>
#include <string>

#include "bindings.h"
#include "fusekit/attention.h"

namespace fusekit::python {

namespace {

constexpr AttentionMask kMasks[] = {AttentionMask::none, AttentionMask::causal_top_left,
                                    AttentionMask::causal_bottom_right};

// The config from its flattened keyword arguments; the bindings convert it before the arrays, so
// that a mistyped scalar is reported first, as PyTorch's argument parser checks every type first.
AttentionConfig make_config(const ScalarArgs& c, nb::handle scale, nb::handle mask,
                            nb::handle window_left, nb::handle window_right, nb::handle dropout_p,
                            nb::handle seed, nb::handle offset) {
  AttentionConfig config;
  config.scale = c.optional_f32(scale, "scale");  // None: 1 / sqrt(D)
  config.mask = c.option(mask, "mask", "fusekit.AttentionMask", kMasks, attention_mask_name);
  config.window_left = c.i64(window_left, "window_left");
  config.window_right = c.i64(window_right, "window_right");
  config.dropout_p = c.f32(dropout_p, "dropout_p");
  config.seed = c.u64(seed, "seed");
  config.offset = c.u64(offset, "offset");
  return config;
}

// The config tuple of fusekit.torch's calls: (scale, mask, window_left, window_right,
// dropout_p, seed, offset, max_seqlen_q, max_seqlen_k[, ...]), its items converted as the
// keyword arguments of the public bindings are.
struct TupleConfig {
  AttentionConfig config;
  std::int64_t max_seqlen_q, max_seqlen_k;
};

TupleConfig config_from_tuple(const ScalarArgs& c, nb::handle cfg) {
  if (!PyTuple_Check(cfg.ptr())) c.fail_type("cfg", "tuple", cfg);
  const Py_ssize_t size = PyTuple_GET_SIZE(cfg.ptr());
  if (size < 9) c.fail("cfg", "a tuple of at least 9 items", std::to_string(size) + " items");
  auto item = [&](Py_ssize_t i) { return nb::handle(PyTuple_GET_ITEM(cfg.ptr(), i)); };
  TupleConfig t;
  t.config = make_config(c, item(0), item(1), item(2), item(3), item(4), item(5), item(6));
  t.max_seqlen_q = c.i64(item(7), "max_seqlen_q");
  t.max_seqlen_k = c.i64(item(8), "max_seqlen_k");
  return t;
}

// Variable lengths when cu_seqlens_q and cu_seqlens_k are given (both or neither).
std::optional<AttentionVarlen> varlen_arg(OpCall& c, nb::handle cu_seqlens_q,
                                          nb::handle cu_seqlens_k, std::int64_t max_seqlen_q,
                                          std::int64_t max_seqlen_k) {
  const bool has_q = cu_seqlens_q.is_valid() && !cu_seqlens_q.is_none();
  const bool has_k = cu_seqlens_k.is_valid() && !cu_seqlens_k.is_none();
  if (!has_q && !has_k) {
    if (max_seqlen_q != 0)
      c.fail("max_seqlen_q", "0 without variable lengths (cu_seqlens_q is None)",
             std::to_string(max_seqlen_q));
    if (max_seqlen_k != 0)
      c.fail("max_seqlen_k", "0 without variable lengths (cu_seqlens_k is None)",
             std::to_string(max_seqlen_k));
    return std::nullopt;
  }
  if (!has_q)
    c.fail("cu_seqlens_q", "an int32 array (batch + 1) since 'cu_seqlens_k' is given", "None");
  if (!has_k)
    c.fail("cu_seqlens_k", "an int32 array (batch + 1) since 'cu_seqlens_q' is given", "None");
  AttentionVarlen varlen;
  varlen.cu_seqlens_q = c.tensor(cu_seqlens_q, "cu_seqlens_q", Access::read);
  varlen.cu_seqlens_k = c.tensor(cu_seqlens_k, "cu_seqlens_k", Access::read);
  varlen.max_seqlen_q = max_seqlen_q;
  varlen.max_seqlen_k = max_seqlen_k;
  return varlen;
}

AttentionShape make_shape(std::int64_t batch, std::int64_t seqlen_q, std::int64_t seqlen_k,
                          std::int64_t heads_q, std::int64_t heads_kv, std::int64_t head_dim,
                          std::int64_t head_dim_v, DType dtype, bool bias_gradient) {
  AttentionShape s;
  s.batch = batch, s.seqlen_q = seqlen_q, s.seqlen_k = seqlen_k;
  s.heads_q = heads_q, s.heads_kv = heads_kv, s.head_dim = head_dim, s.head_dim_v = head_dim_v;
  s.dtype = dtype;
  s.bias_gradient = bias_gradient;
  return s;
}

// The problem sizes and dtype of a workspace-size query from its arguments, converted in order
// (bias_gradient, a keyword argument, is left to the caller).
AttentionShape shape_arg(const ScalarArgs& c, nb::handle batch, nb::handle seqlen_q,
                         nb::handle seqlen_k, nb::handle heads_q, nb::handle heads_kv,
                         nb::handle head_dim, nb::handle head_dim_v, nb::handle dtype) {
  const std::int64_t b = c.i64(batch, "batch"), sq = c.i64(seqlen_q, "seqlen_q"),
                     sk = c.i64(seqlen_k, "seqlen_k"), hq = c.i64(heads_q, "heads_q"),
                     hkv = c.i64(heads_kv, "heads_kv"), d = c.i64(head_dim, "head_dim"),
                     dv = c.i64(head_dim_v, "head_dim_v");
  const DType t = c.dtype(dtype, "dtype");
  return make_shape(b, sq, sk, hq, hkv, d, dv, t, false);
}

// The problem sizes of the workspace queries from the arrays (for workspace='auto'); false when
// q/k/v do not have the layout's number of dimensions (the op reports that).
bool shape_from_arrays(const TensorView& q, const TensorView& k, const TensorView& v,
                       const std::optional<AttentionVarlen>& varlen, bool bias_gradient,
                       AttentionShape* s) {
  const int want = varlen ? 3 : 4;
  if (q.ndim != want || k.ndim != want || v.ndim != want) return false;
  if (varlen) {
    *s = make_shape(varlen->cu_seqlens_q.numel() - 1, varlen->max_seqlen_q, varlen->max_seqlen_k,
                    q.shape[1], k.shape[1], q.shape[2], v.shape[2], q.dtype, bias_gradient);
  } else {
    *s = make_shape(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3],
                    v.shape[3], q.dtype, bias_gradient);
  }
  return true;
}

// The size query behind the forward's workspace='auto' (0 when q/k/v do not have the layout's
// number of dimensions: the op reports that).
auto forward_workspace(const TensorView& q, const TensorView& k, const TensorView& v,
                       const std::optional<AttentionVarlen>& varlen,
                       const AttentionConfig& config) {
  return [&q, &k, &v, &varlen, &config]() -> std::size_t {
    AttentionShape shape;
    if (!shape_from_arrays(q, k, v, varlen, false, &shape)) return 0;
    return attention_forward_workspace_size(shape, config, q.device);
  };
}

// Whether fusekit reads an operand as it is (float dtype, the
// head dim a multiple of 16 bytes and contiguous, the other strides of dims longer than 1
// multiples of 16 bytes, 16-byte aligned data), so that no Python-side fix-up is needed.
bool operand_ready(const TensorView& t, int dims) {
  if (t.ndim != dims || t.dtype == DType::u8 || t.dtype == DType::i32 || t.dtype == DType::i64)
    return false;
  const std::int64_t e = 16 / static_cast<std::int64_t>(dtype_size(t.dtype));
  if (e < 1 || t.shape[dims - 1] % e != 0 || reinterpret_cast<std::uintptr_t>(t.data) % 16 != 0)
    return false;
  if (t.shape[dims - 1] > 1 && t.strides[dims - 1] != 1) return false;
  for (int d = 0; d < dims - 1; ++d)
    if (t.shape[d] > 1 && t.strides[d] % e != 0) return false;
  return true;
}


// The body of both backward bindings (the public one and fusekit.torch's): converts
// the arrays, takes the workspace (an array, None or 'auto') and runs the op.
struct BackwardArgs {
  nb::handle dout, q, k, v, out, lse, bias, dq, dk, dv, dbias, cu_seqlens_q, cu_seqlens_k;
  std::int64_t max_seqlen_q, max_seqlen_k;
  bool deterministic;
};

void run_backward(OpCall& c, const AttentionConfig& config, const BackwardArgs& a,
                  nb::handle workspace, nb::handle stream) {
  const TensorView dov = c.tensor(a.dout, "dout", Access::read);
  const TensorView qv = c.tensor(a.q, "q", Access::read);
  const TensorView kv = c.tensor(a.k, "k", Access::read);
  const TensorView vv = c.tensor(a.v, "v", Access::read);
  const TensorView ov = c.tensor(a.out, "out", Access::read);
  const TensorView lv = c.tensor(a.lse, "lse", Access::read);
  const OptionalTensor bv = c.optional(a.bias, "bias", Access::read);
  const OptionalTensor dqv = c.optional(a.dq, "dq", Access::write);
  const OptionalTensor dkv = c.optional(a.dk, "dk", Access::write);
  const OptionalTensor dvv = c.optional(a.dv, "dv", Access::write);
  const OptionalTensor dbv = c.optional(a.dbias, "dbias", Access::write);
  const std::optional<AttentionVarlen> vl =
      varlen_arg(c, a.cu_seqlens_q, a.cu_seqlens_k, a.max_seqlen_q, a.max_seqlen_k);
  const OptionalTensor wsv = c.workspace(workspace, [&]() -> std::size_t {
    AttentionShape shape;
    if (!(dqv || dkv || dvv || dbv) || !shape_from_arrays(qv, kv, vv, vl, dbv.has_value(), &shape))
      return 0;
    return attention_backward_workspace_size(shape, config, a.deterministic, qv.device);
  });
  c.run(stream, [&](Stream s) {
    attention_backward(dov, qv, kv, vv, ov, lv, bv, config, dqv, dkv, dvv, dbv, vl, a.deterministic,
                       wsv, s);
  });
}

}  // namespace

void bind_attention(nb::module_& m) {
  using nb::arg;
  const auto none = nb::none();
  m.attr("ATTENTION_MAX_HEAD_DIM") = kAttentionMaxHeadDim;

  auto masks = nb::enum_<AttentionMask>(
      m, "AttentionMask",
      "Causal masks of attention (names as in the C++ API); ops also accept the names as strings.");
  for (AttentionMask mask : kMasks) masks.value(attention_mask_name(mask), mask);

  m.def(
      "attention_forward_workspace_size",
      [](nb::handle batch, nb::handle seqlen_q, nb::handle seqlen_k, nb::handle heads_q,
         nb::handle heads_kv, nb::handle head_dim, nb::handle head_dim_v, nb::handle dtype,
         nb::handle device, nb::handle bias_gradient) {
        const ScalarArgs c("attention_forward_workspace_size");
        AttentionShape shape = shape_arg(c, batch, seqlen_q, seqlen_k, heads_q, heads_kv,
                                         head_dim, head_dim_v, dtype);
        const Device d = c.device(device, "device");
        shape.bias_gradient = c.flag(bias_gradient, "bias_gradient");
        return attention_forward_workspace_size(shape, AttentionConfig{}, d);
      },
      arg("batch").none(), arg("seqlen_q").none(), arg("seqlen_k").none(), arg("heads_q").none(),
      arg("heads_kv").none(), arg("head_dim").none(), arg("head_dim_v").none(),
      arg("dtype").none(), arg("device").none(), nb::kw_only(), arg("bias_gradient").none() = false,
      "Bytes of u8 scratch memory attention_forward needs (0 on the CPU). Sequence lengths are "
      "the max lengths with variable lengths. device: 'cpu', 'cuda', 'cuda:N'.");

  m.def(
      "attention_backward_workspace_size",
      [](nb::handle batch, nb::handle seqlen_q, nb::handle seqlen_k, nb::handle heads_q,
         nb::handle heads_kv, nb::handle head_dim, nb::handle head_dim_v, nb::handle dtype,
         nb::handle device, nb::handle deterministic, nb::handle bias_gradient) {
        const ScalarArgs c("attention_backward_workspace_size");
        AttentionShape shape = shape_arg(c, batch, seqlen_q, seqlen_k, heads_q, heads_kv,
                                         head_dim, head_dim_v, dtype);
        const Device d = c.device(device, "device");
        const bool det = c.flag(deterministic, "deterministic");
        shape.bias_gradient = c.flag(bias_gradient, "bias_gradient");
        return attention_backward_workspace_size(shape, AttentionConfig{}, det, d);
      },
      arg("batch").none(), arg("seqlen_q").none(), arg("seqlen_k").none(), arg("heads_q").none(),
      arg("heads_kv").none(), arg("head_dim").none(), arg("head_dim_v").none(),
      arg("dtype").none(), arg("device").none(), nb::kw_only(),
      arg("deterministic").none() = false, arg("bias_gradient").none() = false,
      "Bytes of u8 scratch memory attention_backward needs (0 on the CPU; on the GPU the float32 "
      "row sums, plus the float32 dq accumulator unless deterministic).");

  m.def(
      "attention_forward",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle bias, nb::handle out,
         nb::handle lse, nb::handle scale, nb::handle mask, nb::handle window_left,
         nb::handle window_right, nb::handle dropout_p, nb::handle seed, nb::handle offset,
         nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, nb::handle max_seqlen_q_arg,
         nb::handle max_seqlen_k_arg, nb::handle workspace, nb::handle stream) {
        OpCall c("attention_forward");
        const AttentionConfig config =
            make_config(c, scale, mask, window_left, window_right, dropout_p, seed, offset);
        const std::int64_t max_seqlen_q = c.i64(max_seqlen_q_arg, "max_seqlen_q");
        const std::int64_t max_seqlen_k = c.i64(max_seqlen_k_arg, "max_seqlen_k");
        const TensorView qv = c.tensor(q, "q", Access::read);
        const TensorView kv = c.tensor(k, "k", Access::read);
        const TensorView vv = c.tensor(v, "v", Access::read);
        const OptionalTensor bv = c.optional(bias, "bias", Access::read);
        const TensorView ov = c.tensor(out, "out", Access::write);
        const TensorView lv = c.tensor(lse, "lse", Access::write);
        const std::optional<AttentionVarlen> vl =
            varlen_arg(c, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
        const OptionalTensor wsv =
            c.workspace(workspace, forward_workspace(qv, kv, vv, vl, config));
        c.run(stream, [&](Stream s) {
          attention_forward(qv, kv, vv, bv, config, ov, lv, vl, wsv, s);
        });
      },
      arg("q").none(), arg("k").none(), arg("v").none(), arg("bias").none(), arg("out").none(),
      arg("lse").none(), nb::kw_only(), arg("scale").none() = none, arg("mask").none() = "none",
      arg("window_left").none() = -1, arg("window_right").none() = -1,
      arg("dropout_p").none() = 0.0f, arg("seed").none() = 0, arg("offset").none() = 0,
      arg("cu_seqlens_q").none() = none, arg("cu_seqlens_k").none() = none,
      arg("max_seqlen_q").none() = 0, arg("max_seqlen_k").none() = 0,
      arg("workspace").none() = none, arg("stream").none() = none,
      "out = softmax(q k^T scale + bias) v per (batch, query head), with the float32 log-sum-exp "
      "saved into lse for the backward. q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), "
      "out (B, Sq, Hq, Dv), lse (B, Hq, Sq) float32; with cu_seqlens_q/k (int32, B + 1) packed "
      "(T, H, D) tensors and lse (Hq, Tq). bias: None or 4-D (B|1, Hq|1, Sq|1, Sk), broadcast "
      "over dims of size 1. mask: 'none', 'causal_top_left', 'causal_bottom_right'; window_left/"
      "right: -1 (unbounded) or a distance from the diagonal; dropout_p in [0, 1) with the mask "
      "from Philox (seed, offset < 2^32). See include/fusekit/attention.h.");

  m.def(
      "attention_backward",
      [](nb::handle dout, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
         nb::handle lse, nb::handle bias, nb::handle dq, nb::handle dk, nb::handle dv,
         nb::handle dbias, nb::handle scale, nb::handle mask, nb::handle window_left,
         nb::handle window_right, nb::handle dropout_p, nb::handle seed, nb::handle offset,
         nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, nb::handle max_seqlen_q,
         nb::handle max_seqlen_k, nb::handle deterministic, nb::handle workspace,
         nb::handle stream) {
        OpCall c("attention_backward");
        const AttentionConfig config =
            make_config(c, scale, mask, window_left, window_right, dropout_p, seed, offset);
        const std::int64_t max_q = c.i64(max_seqlen_q, "max_seqlen_q");
        const std::int64_t max_k = c.i64(max_seqlen_k, "max_seqlen_k");
        const bool det = c.flag(deterministic, "deterministic");
        run_backward(c, config,
                     {dout, q, k, v, out, lse, bias, dq, dk, dv, dbias, cu_seqlens_q, cu_seqlens_k,
                      max_q, max_k, det},
                     workspace, stream);
      },
      arg("dout").none(), arg("q").none(), arg("k").none(), arg("v").none(), arg("out").none(),
      arg("lse").none(), arg("bias").none(), arg("dq").none() = none, arg("dk").none() = none,
      arg("dv").none() = none, arg("dbias").none() = none, nb::kw_only(),
      arg("scale").none() = none, arg("mask").none() = "none", arg("window_left").none() = -1,
      arg("window_right").none() = -1, arg("dropout_p").none() = 0.0f, arg("seed").none() = 0,
      arg("offset").none() = 0, arg("cu_seqlens_q").none() = none,
      arg("cu_seqlens_k").none() = none, arg("max_seqlen_q").none() = 0,
      arg("max_seqlen_k").none() = 0, arg("deterministic").none() = false,
      arg("workspace").none() = none, arg("stream").none() = none,
      "Any subset of dq, dk, dv, dbias from the forward's out and lse, with the same bias, "
      "config and variable lengths as the forward. dk/dv are summed over the query heads of their "
      "group; dbias (the bias's shape, 1 where the bias broadcasts through stride 0) is summed "
      "over its broadcast dims. deterministic: bitwise reproducible dq on the GPU too.");

  // fusekit.torch's eager path, one call per direction. cfg is the tuple (scale, mask,
  // window_left, window_right, dropout_p, seed, offset, max_seqlen_q, max_seqlen_k, ...): one
  // argument instead of nine keyword arguments. The forward returns None, having done nothing,
  // when the operands do not suit fusekit as they are (see operand_ready; the caller then fixes
  // them up), else lse as an opaque capsule allocated through q's framework, which the backward
  // takes back. Both take the workspace from that framework too.
  m.def(
      "_attention_forward_alloc",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle bias, nb::handle out,
         nb::handle cfg, nb::handle cu_seqlens_q, nb::handle cu_seqlens_k) -> nb::object {
        OpCall c("attention_forward");
        const TupleConfig tc = config_from_tuple(c, cfg);
        const AttentionConfig& config = tc.config;
        const TensorView qv = c.tensor(q, "q", Access::read);
        const TensorView kv = c.tensor(k, "k", Access::read);
        const TensorView vv = c.tensor(v, "v", Access::read);
        const OptionalTensor bv = c.optional(bias, "bias", Access::read);
        const std::optional<AttentionVarlen> vl =
            varlen_arg(c, cu_seqlens_q, cu_seqlens_k, tc.max_seqlen_q, tc.max_seqlen_k);
        const int dims = vl ? 3 : 4;
        const std::int64_t keys = vl ? vl->max_seqlen_k : (kv.ndim == 4 ? kv.shape[1] : 0);
        if (!operand_ready(qv, dims) || !operand_ready(kv, dims) || !operand_ready(vv, dims) ||
            (bv && !(bv->ndim == 4 && bv->shape[3] == keys && bv->is_contiguous() &&
                     operand_ready(*bv, 4))))
          return nb::none();
        const TensorView ov = c.tensor(out, "out", Access::write);
        const std::int64_t lse_shape[3] = {vl ? qv.shape[1] : qv.shape[0],
                                           vl ? qv.shape[0] : qv.shape[2], qv.shape[1]};
        TensorView lv;
        nb::object lse = c.new_f32_capsule(vl ? 2 : 3, lse_shape, &lv);
        const OptionalTensor wsv = c.auto_workspace(forward_workspace(qv, kv, vv, vl, config));
        c.run(nb::none(), [&](Stream s) {
          attention_forward(qv, kv, vv, bv, config, ov, lv, vl, wsv, s);
        });
        return lse;
      },
      arg("q").none(), arg("k").none(), arg("v").none(), arg("bias").none(), arg("out").none(),
      arg("cfg").none(), arg("cu_seqlens_q").none(), arg("cu_seqlens_k").none(),
      "attention_forward allocating lse and the workspace through the framework of q (see the "
      "source).");

  m.def(
      "_attention_backward_alloc",
      [](nb::handle dout, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
         nb::handle lse, nb::handle bias, nb::handle dq, nb::handle dk, nb::handle dv,
         nb::handle dbias, nb::handle cfg, nb::handle cu_seqlens_q, nb::handle cu_seqlens_k,
         nb::handle deterministic) {
        OpCall c("attention_backward");
        const TupleConfig tc = config_from_tuple(c, cfg);
        const bool det = c.flag(deterministic, "deterministic");
        run_backward(c, tc.config,
                     {dout, q, k, v, out, lse, bias, dq, dk, dv, dbias, cu_seqlens_q, cu_seqlens_k,
                      tc.max_seqlen_q, tc.max_seqlen_k, det},
                     nb::str("auto"), nb::none());
      },
      arg("dout").none(), arg("q").none(), arg("k").none(), arg("v").none(), arg("out").none(),
      arg("lse").none(), arg("bias").none(), arg("dq").none(), arg("dk").none(), arg("dv").none(),
      arg("dbias").none(), arg("cfg").none(), arg("cu_seqlens_q").none(),
      arg("cu_seqlens_k").none(), arg("deterministic").none(),
      "attention_backward allocating the workspace through the framework of q (see "
      "_attention_forward_alloc).");

  // The documented dropout mask, for tests and for callers that want to inspect it.
  m.def(
      "attention_dropout_keep_mask",
      [](nb::handle seed_arg, nb::handle offset_arg, nb::handle p_arg, nb::handle mask) {
        OpCall c("attention_dropout_keep_mask");
        const auto [seed, offset, p] = keep_mask_args(c, seed_arg, offset_arg, p_arg);
        if (offset >= (std::uint64_t{1} << 32))
          c.fail("offset", "a Philox offset below 2^32", std::to_string(offset));
        const TensorView mv = c.tensor(mask, "mask", Access::write);
        if (mv.dtype != DType::u8 || mv.device.is_cuda() || mv.ndim != 4 || !mv.is_contiguous())
          c.fail("mask", "a contiguous 4-D (batch, heads_q, seqlen_q, seqlen_k) u8 array in CPU memory",
                 std::string(dtype_name(mv.dtype)) + " of shape " + mv.shape_string() + " on " +
                     to_string(mv.device) + (mv.is_contiguous() ? "" : ", not contiguous"));
        const std::uint32_t threshold = dropout_keep_threshold(p);
        auto* out = static_cast<std::uint8_t*>(mv.data);
        const std::int64_t B = mv.shape[0], H = mv.shape[1], Sq = mv.shape[2], Sk = mv.shape[3];
        c.run(nb::none(), [&](Stream) {
          std::int64_t n = 0;
          for (std::int64_t b = 0; b < B; ++b)
            for (std::int64_t h = 0; h < H; ++h)
              for (std::int64_t i = 0; i < Sq; ++i)
                for (std::int64_t j = 0; j < Sk; ++j, ++n)
                  out[n] = attention_dropout_keeps(seed, offset, static_cast<std::uint64_t>(b),
                                                   static_cast<std::uint64_t>(h),
                                                   static_cast<std::uint64_t>(H),
                                                   static_cast<std::uint64_t>(i),
                                                   static_cast<std::uint64_t>(j), threshold)
                               ? 1
                               : 0;
        });
      },
      arg("seed").none(), arg("offset").none(), arg("p").none(), arg("mask").none(),
      "Fills the contiguous u8 CPU array mask (batch, heads_q, seqlen_q, seqlen_k) with 1 where "
      "attention element (b, h, i, j) is kept under (seed, offset, p), 0 where dropped (i, j are "
      "positions within the sequence, also with variable lengths).");
}

}  // namespace fusekit::python
