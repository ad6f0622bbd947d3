// Rotary position embeddings (RoPE) of queries and keys, forward and backward, q and k in one
// launch.
//
// ---- Layout -----------------------------------------------------------------------------------
// q: (B, S, Hq, D), or (T, Hq, D) for packed sequences (then B = 1 and S = T). Any strides as long
// as the head dim is contiguous (stride 1): (B, H, S, D) storage is the permuted view
// q.transpose(1, 2), and q may be a slice of a packed QKV tensor. k (optional): (B, S, Hk, D) or
// (T, Hk, D), q's dtype, batch, sequence and head dim, its own head count Hk >= 0 (any: GQA, MQA
// or more key heads than query heads) and its own strides. q_out has q's shape and dtype, k_out
// k's (given exactly when k is); each has its own strides.
// In place: q_out may be q itself (the same data, shape and strides), k_out k itself; any other
// overlap of an output with an input or with the other output is refused.
// Dtypes: q, k, q_out, k_out f32, f16 or bf16; math in float32.
//
// ---- Math -------------------------------------------------------------------------------------
// r = config.rotary_dim (0: r = D) is even, 2 <= r <= D; head dims r .. D - 1 pass through
// unchanged (copied when the output is not the input). With m = config.attention_scaling and the
// angle a_i of pair i < r / 2 at the token's position,
//   rotate_half (GPT-NeoX, Llama): pairs (i, i + r/2)     x' = m (x cos a_i - y sin a_i)
//   interleaved (GPT-J):           pairs (2i, 2i + 1)     y' = m (y cos a_i + x sin a_i)
// with (x, y) the pair's two elements. Every head of the token (of q and of k) uses the same
// angles. cos, sin and the rotation are computed in float32 (not with the fast intrinsics), once
// per token.
//
// Angles: a_i = fl32(fl32(p) * inv_freq[i]) (one float32 multiply; fl32 = round to float32),
// from one of three sources (RopeTables):
//   * none given (the default): inv_freq[i] = fl32(theta^(-2i / r) / linear_scaling), computed in
//     float64 and rounded once. linear_scaling is Hugging Face's "linear" rope scaling.
//   * inv_freq: a float32 table of r / 2 values (how NTK-aware, YaRN or Llama 3 scalings, or a
//     table computed exactly as some framework computes it, are expressed).
//   * cos and sin: float32 tables (P, r / 2) read at row p directly (no angle is formed).
// linear_scaling applies to the first source only (it must be 1 with a table); theta is ignored
// with a table. attention_scaling (YaRN's mscale) multiplies cos and sin in every case.
//
// Positions: p = the token's sequence index s (0 .. S - 1; packed: the token index) when
// position_ids is absent. Otherwise position_ids gives them: int32 or int64, shape (B, S) or
// (1, S) (the same positions for every batch) with q 4-D, (T) with q 3-D; any strides. With
// position ids, packed variable-length batches restart their positions per sequence. With cos /
// sin tables every position must lie in [0, P): the CPU refuses others (invalid_argument naming
// position_ids); on the GPU, where that check would cost a pass over the positions, it is the
// caller's precondition and a token whose position is outside gives NaN in its rotated dims
// (nothing is read out of bounds).
//
// Backward: the rotation's transpose, m R(-a): dq = m (dq_out rotated by -a_i), dk likewise; the
// passed-through dims pass the gradient through. Same config, tables and positions as the
// forward; nothing else is saved. dq may be dq_out itself (in place), dk dk_out. The tables get
// no gradient.
//
// Limits: D <= kRopeMaxHeadDim; B * S <= 2^31 - 1 tokens; Hq + Hk <= kRopeMaxHeads. No workspace.
#pragma once

#include <cstdint>

#include "fusekit/tensor.h"

namespace fusekit {

inline constexpr std::int64_t kRopeMaxHeadDim = 512;
inline constexpr std::int64_t kRopeMaxHeads = 65535;

enum class RopeStyle : std::uint8_t {
  rotate_half,  // pairs (i, i + r/2): GPT-NeoX, Llama, Hugging Face's rotate_half
  interleaved,  // pairs (2i, 2i + 1): GPT-J, the complex-number form
};

const char* rope_style_name(RopeStyle style);

// Everything that defines the op besides its tensors. Pass the same value to the backward.
struct RopeConfig {
  RopeStyle style = RopeStyle::rotate_half;
  std::int64_t rotary_dim = 0;    // r, even, <= D; 0: the whole head dim
  float theta = 10000.0f;         // base of inv_freq[i] = theta^(-2i / r); finite, > 0
  float linear_scaling = 1.0f;    // positions divided by it (theta source only); finite, > 0
  float attention_scaling = 1.0f; // multiplies cos and sin; finite
};

// Where the angles come from besides the config (see the header comment): nothing (theta),
// inv_freq, or cos and sin together.
struct RopeTables {
  OptionalTensor inv_freq;  // (r / 2) float32, contiguous
  OptionalTensor cos, sin;  // (P, r / 2) float32 each, last dim contiguous, any row stride
};

// q_out = rope(q), k_out = rope(k). k and k_out: both or neither.
void rope_forward(const TensorView& q, const OptionalTensor& k, const OptionalTensor& position_ids,
                  const RopeConfig& config, const TensorView& q_out, const OptionalTensor& k_out,
                  const RopeTables& tables = {}, Stream stream = nullptr);

// dq = rope^T(dq_out), dk = rope^T(dk_out). dk_out and dk: both or neither.
void rope_backward(const TensorView& dq_out, const OptionalTensor& dk_out,
                   const OptionalTensor& position_ids, const RopeConfig& config,
                   const TensorView& dq, const OptionalTensor& dk, const RopeTables& tables = {},
                   Stream stream = nullptr);

}  // namespace fusekit
