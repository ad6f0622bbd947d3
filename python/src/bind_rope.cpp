// Rotary-embedding bindings (fusekit/rope.h): rope_forward and rope_backward with the C++ names
// and argument order. RopeConfig is flattened into keyword-only arguments (style, rotary_dim,
// theta, linear_scaling, attention_scaling) and RopeTables into inv_freq, cos and sin; outputs are
// arrays the caller allocates, and may be the inputs themselves (in place).
#include <cstdint>

#include "bindings.h"
#include "fusekit/rope.h"

namespace fusekit::python {

namespace {

constexpr RopeStyle kStyles[] = {RopeStyle::rotate_half, RopeStyle::interleaved};

// The config from its flattened keyword arguments, converted before the arrays (a mistyped scalar
// is reported first, as PyTorch's argument parser checks every type first). `style` is a
// fusekit.RopeStyle or its name.
RopeConfig make_config(const ScalarArgs& c, nb::handle style, nb::handle rotary_dim, nb::handle theta,
                       nb::handle linear_scaling, nb::handle attention_scaling) {
  RopeConfig config;
  config.style = c.option(style, "style", "fusekit.RopeStyle", kStyles, rope_style_name);
  config.rotary_dim = c.i64(rotary_dim, "rotary_dim");
  config.theta = c.f32(theta, "theta");
  config.linear_scaling = c.f32(linear_scaling, "linear_scaling");
  config.attention_scaling = c.f32(attention_scaling, "attention_scaling");
  return config;
}

RopeTables make_tables(OpCall& c, nb::handle inv_freq, nb::handle cos, nb::handle sin) {
  RopeTables t;
  t.inv_freq = c.optional(inv_freq, "inv_freq", Access::read);
  t.cos = c.optional(cos, "cos", Access::read);
  t.sin = c.optional(sin, "sin", Access::read);
  return t;
}

// The arrays of either direction: (lead, lead_k, ..., out, out_k) are (q, k, ..., q_out, k_out)
// forward and (dq_out, dk_out, ..., dq, dk) backward. An output passed as its own input (the
// same array, or another array over the same elements) converts to the same view: in place.
struct Arrays {
  TensorView lead, out;
  OptionalTensor lead_k, out_k, position_ids;
  RopeTables tables;
};

Arrays convert(OpCall& c, const char* const names[4], nb::handle lead, nb::handle lead_k, nb::handle position_ids,
               nb::handle out, nb::handle out_k, nb::handle inv_freq, nb::handle cos, nb::handle sin) {
  Arrays a;
  a.lead = c.tensor(lead, names[0], Access::read);
  a.lead_k = c.optional(lead_k, names[1], Access::read);
  a.position_ids = c.optional(position_ids, "position_ids", Access::read);
  a.out = c.tensor(out, names[2], Access::write);
  a.out_k = c.optional(out_k, names[3], Access::write);
  a.tables = make_tables(c, inv_freq, cos, sin);
  return a;
}

}  // namespace

void bind_rope(nb::module_& m) {
  using nb::arg;
  const auto none = nb::none();
  m.attr("ROPE_MAX_HEAD_DIM") = kRopeMaxHeadDim;

  auto styles = nb::enum_<RopeStyle>(
      m, "RopeStyle", "Pairings of rotary embeddings (names as in the C++ API); ops also accept the names.");
  for (RopeStyle s : kStyles) styles.value(rope_style_name(s), s);

  m.def(
      "rope_forward",
      [](nb::handle q, nb::handle k, nb::handle position_ids, nb::handle q_out, nb::handle k_out, nb::handle style,
         nb::handle rotary_dim, nb::handle theta, nb::handle linear_scaling, nb::handle attention_scaling, nb::handle inv_freq,
         nb::handle cos, nb::handle sin, nb::handle stream) {
        OpCall c("rope_forward");
        const RopeConfig config = make_config(c, style, rotary_dim, theta, linear_scaling, attention_scaling);
        static constexpr const char* kNames[4] = {"q", "k", "q_out", "k_out"};
        const Arrays a = convert(c, kNames, q, k, position_ids, q_out, k_out, inv_freq, cos, sin);
        c.run(stream, [&](Stream s) {
          rope_forward(a.lead, a.lead_k, a.position_ids, config, a.out, a.out_k, a.tables, s);
        });
      },
      arg("q").none(), arg("k").none(), arg("position_ids").none(), arg("q_out").none(), arg("k_out").none(),
      nb::kw_only(), arg("style").none() = "rotate_half", arg("rotary_dim").none() = 0,
      arg("theta").none() = 10000.0f, arg("linear_scaling").none() = 1.0f,
      arg("attention_scaling").none() = 1.0f, arg("inv_freq").none() = none,
      arg("cos").none() = none, arg("sin").none() = none, arg("stream").none() = none,
      "q_out = rope(q), k_out = rope(k) in one pass. q (B, S, Hq, D) with any strides whose head dim is "
      "contiguous (a (B, H, S, D) array through .transpose(1, 2)), or packed (T, Hq, D); k likewise with its own "
      "head count, or None (then k_out None). position_ids: None (the sequence index), int32/int64 (B, S) or "
      "(1, S), or (T) for packed tensors. style: 'rotate_half' (pairs i, i + r/2) or 'interleaved' (pairs 2i, "
      "2i + 1); rotary_dim: 0 (all of D) or an even r <= D, the other dims passing through. Angles: fl32(p) * "
      "inv_freq[i] in float32, inv_freq from theta (and linear_scaling) or the float32 table inv_freq (r/2); or "
      "the float32 tables cos, sin (P, r/2) read at row p. attention_scaling multiplies cos and sin. q_out may "
      "be q itself (in place), k_out k. See include/fusekit/rope.h.");

  m.def(
      "rope_backward",
      [](nb::handle dq_out, nb::handle dk_out, nb::handle position_ids, nb::handle dq, nb::handle dk,
         nb::handle style, nb::handle rotary_dim, nb::handle theta, nb::handle linear_scaling, nb::handle attention_scaling,
         nb::handle inv_freq, nb::handle cos, nb::handle sin, nb::handle stream) {
        OpCall c("rope_backward");
        const RopeConfig config = make_config(c, style, rotary_dim, theta, linear_scaling, attention_scaling);
        static constexpr const char* kNames[4] = {"dq_out", "dk_out", "dq", "dk"};
        const Arrays a = convert(c, kNames, dq_out, dk_out, position_ids, dq, dk, inv_freq, cos, sin);
        c.run(stream, [&](Stream s) {
          rope_backward(a.lead, a.lead_k, a.position_ids, config, a.out, a.out_k, a.tables, s);
        });
      },
      arg("dq_out").none(), arg("dk_out").none(), arg("position_ids").none(), arg("dq").none(), arg("dk").none(),
      nb::kw_only(), arg("style").none() = "rotate_half", arg("rotary_dim").none() = 0,
      arg("theta").none() = 10000.0f, arg("linear_scaling").none() = 1.0f,
      arg("attention_scaling").none() = 1.0f, arg("inv_freq").none() = none,
      arg("cos").none() = none, arg("sin").none() = none, arg("stream").none() = none,
      "dq = rope^T(dq_out), dk = rope^T(dk_out): the rotation by the negated angles, with the forward's "
      "positions, config and tables. dq may be dq_out itself (in place), dk dk_out.");
}

}  // namespace fusekit::python
