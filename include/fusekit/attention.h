// Scaled dot-product attention, forward and backward, with masks, sliding windows, an additive
// bias (and its gradient), dropout, variable sequence lengths and grouped-query attention.
//
// STATUS: the API, the argument checks and the float64 CPU reference are complete. The first
// CUDA implementation (src/attention/attention_cuda.cu, attention_kernels.cuh) serves every
// feature below for f16 / bf16: flash-style tiles on mma.sync tensor cores, online softmax, the
// backward recomputing P from lse. It is written for correctness first (no wgmma/TMA yet). f32
// and f64 CUDA tensors get fusekit::Error(ErrorKind::unsupported) after the arguments have been
// checked (no CUDA call is made before that).
//
// ---- Layout -----------------------------------------------------------------------------------
// Fixed lengths:  q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), out (B, Sq, Hq, Dv),
//                 lse (B, Hq, Sq) float32 contiguous.
// Variable lengths (AttentionVarlen given): sequences packed along one token dimension,
//                 q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv), out (Tq, Hq, Dv),
//                 lse (Hq, Tq) float32 contiguous; sequence b holds query tokens
//                 cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 and key tokens likewise in k and v.
//                 cu_seqlens_q/k: int32, shape (B + 1), contiguous, starting at 0, non-decreasing,
//                 ending at Tq (resp. Tk); every length at most max_seqlen_q (resp. _k).
// q, k, v, out, dout, dq, dk, dv take arbitrary non-negative strides (so packed QKV and the
// (B, H, S, D) memory layout work without copies), subject to the alignment rule below. Each
// tensor has its own strides; dq/dk/dv have the shapes of q/k/v, dout the shape of out.
// Hq must be a multiple of Hkv (GQA; Hkv = 1 is MQA): query head h reads key/value head
// h / (Hq / Hkv). dk and dv are summed over the Hq / Hkv query heads of their group.
// Head dims: 1 <= D, Dv <= 256 (kAttentionMaxHeadDim); Dv may differ from D.
//
// ---- Dtypes -----------------------------------------------------------------------------------
// q, k, v, out, dout, dq, dk, dv: one dtype for all, f16 or bf16 (the GPU dtypes), or f32 / f64.
// f32 and f64 are served by the CPU reference only; the CUDA kernels take f16 and bf16 with
// float32 accumulation (P and dS are rounded to the input dtype before their matrix products, as
// in FlashAttention) and refuse f32 / f64 with ErrorKind::unsupported.
// bias and dbias: f16, bf16 or f32 (f64 too on the CPU), each independent of q's dtype. dbias is
// summed in float32 and rounded once.
// lse: float32 always. cu_seqlens: int32.
//
// ---- Alignment rule (checked on every device, so code tested on the CPU runs on the GPU) ------
// With E = 16 / element size (8 for f16/bf16, 4 for f32, 2 for f64):
//   q, k, v, out, dout, dq, dk, dv: data pointer 16-byte aligned; the head-dim stride is 1;
//     D and Dv are multiples of E; every other stride (of a dimension longer than 1) is a
//     multiple of E.
//   bias, dbias: data pointer 16-byte aligned; key-dim stride 1; every other stride of a
//     dimension longer than 1 is 0 or a multiple of E (so Sk must be padded to a multiple of E in
//     memory when the bias is a dense (B, H, Sq, Sk) tensor, as with the xformers kernel).
//   lse, cu_seqlens: contiguous; lse 16-byte aligned.
//
// ---- Math -------------------------------------------------------------------------------------
// For batch b (sequence b with variable lengths), query head h, query i < Sq_b, key j < Sk_b:
//   S[i, j] = scale * <q_i, k_j> + bias[b, h, i, j]        scale defaults to 1 / sqrt(D)
//   S[i, j] = -inf where the mask excludes (i, j)
//   lse[i]  = log(sum_j exp(S[i, j]))                      (float32, saved for the backward)
//   P[i, j] = exp(S[i, j] - lse[i])
//   out[i]  = sum_j P[i, j] * Z[i, j] * v_j,   Z = keep(b, h, i, j) / (1 - p), or 1 when p = 0
// lse is that of the softmax before dropout.
//
// Masks and windows. Let d be the diagonal offset: d = 0 for causal_top_left, and d = Sk_b - Sq_b
// for causal_bottom_right and for no causal mask (FlashAttention's convention; the two agree when
// Sq_b = Sk_b). Key j is visible from query i iff
//   causal:            j <= i + d
//   window_left  >= 0: j >= i + d - window_left
//   window_right >= 0: j <= i + d + window_right
// (-1 = unbounded on that side; a causal mask already bounds the right side at 0). A window of
// Sq + Sk keys or more (Sq, Sk the max lengths with varlen) bounds nothing either: it is the same
// as -1, so INT64_MAX may stand for "unbounded" (the bounds are never formed near int64 overflow).
//
// Fully masked rows. A row in which no key is visible (e.g. causal_bottom_right with Sq > Sk, a
// window that falls outside the keys, Sk_b = 0, or a bias that is -inf on every visible key) gives
// out = 0 and lse = -inf, and contributes zero to every gradient; no NaN anywhere. The bias may
// hold -inf (a mask); it must not hold +inf or NaN (the softmax of +inf is NaN). The CPU checks
// every bias element and refuses +inf and NaN (invalid_argument naming the element); on the GPU,
// where that check would cost a pass over the bias, they are the caller's precondition and give
// NaN in out and lse.
//
// Bias. A 4-D view indexed (b, h, i, j) with shape (B or 1, Hq or 1, Sq or 1, Sk). A dimension of
// size 1 is broadcast (its stride is not read); a full-size dimension may also have stride 0 (an
// expanded view). With variable lengths B is the number of sequences and the view is padded: its
// query and key dims must be at least max_seqlen_q (or 1) and max_seqlen_k; sequence b reads
// bias[b, h, i, j] for its local positions i, j.
// dbias has the bias's shape, except that a dimension the bias expands with stride 0 must be 1
// in dbias (a stride-0 expanded dbias is refused: it would be written concurrently); it receives
// dL/dS summed over the broadcast dimensions (those of size 1 in dbias). Every element of dbias is written: elements no (i, j) of any sequence
// maps to (the padding of a variable-length bias) are set to 0.
//
// Dropout. p in [0, 1). Element (b, h, i, j) — batch or sequence b, query head h, query position
// i and key position j within the sequence — is kept iff
//   dropout_keeps(seed, subsequence, index, dropout_keep_threshold(p))      (fusekit/dropout.h)
//   with subsequence = (b * Hq + h) * 2^32 + offset,  index = i * 2^32 + j,
// i.e. the 16-bit random value of the element is half (j % 2) of word ((j % 8) / 2) of
// philox::random4(seed, subsequence, i * 2^29 + j / 8): the rule of the dropout family applied to
// a logical matrix with rows of 2^32 keys, one Philox stream per (b, h). Every group of 8 keys
// j = 8m .. 8m + 7 of one row comes from one Philox call, whatever Sk is, so a kernel tile whose
// key range starts at a multiple of 8 needs no re-packing. The mask does not depend on the
// sequence lengths of other batches, on strides, on Hkv or on the launch. offset must be below
// 2^32; give every call that needs an independent mask its own offset (or seed). Kept elements
// are scaled by 1 / (1 - p) computed in float32; attention_dropout_keeps() reproduces the mask.
//
// Backward. Given dout, q, k, v, out and lse from the forward (and the same bias, config and
// varlen), it recomputes P = exp(S - lse) and returns any subset of dq, dk, dv, dbias:
//   dP = (dout v^T) * Z,  dS = P * (dP - rowsum(dout * out)),
//   dq = scale * dS k,  dk = scale * dS^T q (summed over the group),  dv = (P * Z)^T dout (summed).
// `deterministic`: bitwise the same gradients run after run. The CPU reference always is. On the
// GPU dk, dv and dbias are always deterministic (fixed-order reductions); dq is summed by float32
// additions in no fixed order (atomics, or TMA reduce-adds on Hopper) unless `deterministic` is
// set (then a separate pass over the key blocks computes it, costing about one more forward's
// worth of work).
//
// Workspace. The caller allocates it (u8, 16-byte aligned, on the tensors' device) after asking
// attention_*_workspace_size(). The CPU needs none (size 0). It is at most O(B * H * S * D)
// float32 on the GPU; never O(S^2). The GPU forward needs none; the GPU backward needs
// 4 * B * Sq * Hq bytes (delta = rowsum(dout * out)) plus, unless deterministic, 4 * B * Sq * Hq * D
// (a float32 dq accumulator), each rounded up to 256 bytes (Sq = max_seqlen_q with varlen). The
// size functions make no CUDA call.
//
// Outputs must not overlap inputs or each other, nor themselves: out, lse, dq, dk, dv and dbias
// with a stride of 0 over a dimension longer than 1 (an expanded view) are refused on every device.
//
// Sizes. Every size query checks its arguments (non-negative sizes, head dims up to
// kAttentionMaxHeadDim, a q/k/v dtype, a valid config) and refuses (invalid_argument) shapes whose
// workspace would not fit in 2^63 - 1 bytes, rather than returning a wrapped size. The CPU
// reference holds one (batch, head) slice's Sq x Sk scores in float64 at a time: sizes whose scratch
// exceeds 2^63 - 1 bytes are refused (invalid_argument) before any work, and a scratch allocation
// that fails gives ErrorKind::unsupported naming the op and the bytes asked for.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "fusekit/dropout.h"
#include "fusekit/philox.h"
#include "fusekit/tensor.h"

namespace fusekit {

inline constexpr std::int64_t kAttentionMaxHeadDim = 256;

enum class AttentionMask : std::uint8_t { none, causal_top_left, causal_bottom_right };

const char* attention_mask_name(AttentionMask mask);

// Everything that defines the op besides its tensors. Pass the same value to the backward.
struct AttentionConfig {
  std::optional<float> scale;  // default 1 / sqrt(D); must be finite
  AttentionMask mask = AttentionMask::none;
  std::int64_t window_left = -1;   // -1 (or >= Sq + Sk): unbounded
  std::int64_t window_right = -1;  // -1 (or >= Sq + Sk): unbounded
  float dropout_p = 0.0f;          // in [0, 1)
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;  // < 2^32
};

// Packed variable-length sequences (see the header comment).
struct AttentionVarlen {
  TensorView cu_seqlens_q;  // int32 (B + 1)
  TensorView cu_seqlens_k;  // int32 (B + 1)
  std::int64_t max_seqlen_q = 0;
  std::int64_t max_seqlen_k = 0;
};

// The problem sizes the workspace depends on (max lengths for variable lengths).
struct AttentionShape {
  std::int64_t batch = 0, seqlen_q = 0, seqlen_k = 0, heads_q = 0, heads_kv = 0;
  std::int64_t head_dim = 0, head_dim_v = 0;
  DType dtype = DType::bf16;
  bool bias_gradient = false;
};

std::size_t attention_forward_workspace_size(const AttentionShape& shape,
                                             const AttentionConfig& config, Device device);
std::size_t attention_backward_workspace_size(const AttentionShape& shape,
                                              const AttentionConfig& config, bool deterministic,
                                              Device device);

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                       const OptionalTensor& bias, const AttentionConfig& config,
                       const TensorView& out, const TensorView& lse,
                       const std::optional<AttentionVarlen>& varlen = std::nullopt,
                       const OptionalTensor& workspace = std::nullopt, Stream stream = nullptr);

void attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& out, const TensorView& lse,
                        const OptionalTensor& bias, const AttentionConfig& config,
                        const OptionalTensor& dq, const OptionalTensor& dk,
                        const OptionalTensor& dv, const OptionalTensor& dbias,
                        const std::optional<AttentionVarlen>& varlen = std::nullopt,
                        bool deterministic = false,
                        const OptionalTensor& workspace = std::nullopt, Stream stream = nullptr);

// ---- the dropout mask, for callers that want to reproduce or inspect it ----------------------

FUSEKIT_HOST_DEVICE std::uint64_t attention_dropout_subsequence(std::uint64_t offset,
                                                                std::uint64_t b, std::uint64_t h,
                                                                std::uint64_t heads_q) {
  return ((b * heads_q + h) << 32) + offset;
}

// Whether element (b, h, i, j) is kept under threshold = dropout_keep_threshold(p).
FUSEKIT_HOST_DEVICE bool attention_dropout_keeps(std::uint64_t seed, std::uint64_t offset,
                                                 std::uint64_t b, std::uint64_t h,
                                                 std::uint64_t heads_q, std::uint64_t i,
                                                 std::uint64_t j, std::uint32_t threshold) {
  return dropout_keeps(seed, attention_dropout_subsequence(offset, b, h, heads_q), (i << 32) + j,
                       threshold);
}

}  // namespace fusekit
