// Token embeddings plus learned absolute position embeddings (GPT-2's wte + wpe), forward and
// backward.
//
//   out[..., t, :] = weight[tokens[..., t], :] + position_weight[t, :]
// t is the index along tokens' last dimension (T positions); without position_weight the output
// is the token rows alone.
//
// Shapes:
//   tokens: (..., T), at least one dimension, contiguous; N = numel(tokens) tokens, B = N / T
//     sequences (the leading dimensions).
//   weight: (V, C); position_weight: (P, C) with T <= P. Each has its last dimension contiguous
//     and a row stride of its own (>= C).
//   out, dout: (..., T, C): tokens' shape followed by C, the leading dimensions collapsible into
//     one row stride (>= C, the last dimension contiguous).
//   dweight: (V, C); dposition_weight: (P, C), P >= T; laid out like weight.
// Dtypes:
//   tokens: i32 or i64.
//   weight, position_weight, out: one dtype, f32, f16 or bf16; f64 on the CPU only (the float64
//     reference; a CUDA tensor of f64 is refused). The forward adds in float32 (the CPU: float64)
//     and rounds once to out's dtype, so with no position_weight out is an exact copy of the rows.
//   dout: f32, f16 or bf16 (f64 on the CPU only). dweight and dposition_weight: each either
//     dout's dtype or f32 (a mixed-precision model's float32 gradient).
// Limits: N <= 2^31 - 1; V in 1 .. 2^31 - 1; C in 1 .. kEmbeddingMaxDim; P in T .. 2^31 - 1.
//
// Backward:
//   dweight[v, :] (+)= the sum of the rows dout[i, :] whose token is v, in increasing i
//   dposition_weight[t, :] (+)= the sum of dout[b, t, :] over the B sequences, in increasing b
// accumulate = false overwrites the whole gradient tensors: rows of tokens that do not occur, and
// rows t >= T of dposition_weight, become 0. accumulate = true adds to what they hold (the tied
// output layer's gradient already in dweight). Sums are float32 on a GPU (float64 on the CPU),
// with the old value added last (accumulate) and one rounding to the gradient's dtype.
// dposition_weight may be left out (a model without position embeddings).
//
// Determinism: every sum has a fixed order (above), so the same inputs give bitwise the same
// gradients on every run (for a given GPU and shape). The GPU backward sorts the (token, index)
// pairs with a stable radix sort, then sums each run of equal tokens in index order.
//
// Out-of-range tokens (< 0 or >= V): on the CPU an invalid_argument error naming the position
// (flat index) and the token. A GPU kernel cannot report one without a host synchronization per
// call, so it marks the results instead: the forward writes NaN into that token's output row, and
// the backward leaves the token out of dweight (its dposition_weight contribution still counts).
// A loop that checks its loss sees the NaN.
//
// Scratch memory: on a GPU the backward needs a workspace: ask
// embedding_backward_workspace_size(N, V, C, device) and pass a u8 view of at least that many
// bytes (16-byte aligned) on the tensors' device. None is needed on the CPU. The query checks its
// arguments (N in 0 .. 2^31 - 1, V in 1 .. 2^31 - 1, C in 1 .. kEmbeddingMaxDim).
//
// Outputs must not overlap any input or each other. All calls run on `stream` without a host
// synchronization.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusekit/tensor.h"

namespace fusekit {

inline constexpr std::int64_t kEmbeddingMaxDim = 65536;
inline constexpr std::int64_t kEmbeddingMaxVocab = 2147483647;  // 2^31 - 1

// out = weight[tokens] + position_weight[t] (position_weight optional).
void embedding_forward(const TensorView& tokens, const TensorView& weight,
                       const OptionalTensor& position_weight, const TensorView& out,
                       Stream stream = nullptr);

// Bytes of scratch memory embedding_backward needs for `tokens` tokens (N), a vocabulary of
// `vocab` rows (V) and embedding dimension `dim` (C) on `device` (0 on the CPU).
std::size_t embedding_backward_workspace_size(std::int64_t tokens, std::int64_t vocab,
                                              std::int64_t dim, Device device);

// dweight (and dposition_weight, where given) from dout and the forward's tokens; overwritten
// (accumulate = false) or added to (accumulate = true).
void embedding_backward(const TensorView& dout, const TensorView& tokens,
                        const TensorView& dweight, const OptionalTensor& dposition_weight,
                        bool accumulate, const OptionalTensor& workspace,
                        Stream stream = nullptr);

}  // namespace fusekit
