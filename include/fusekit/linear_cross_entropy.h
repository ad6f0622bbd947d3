// The output layer's loss without its logits: softmax cross-entropy of x = h W^T + b against
// targets, and, in the same call, the gradients of h, W and b (the backward of a loss is known when
// the loss is computed). The (T, V) logits are never materialized: tokens are processed in chunks
// of Tc rows, each chunk's logits living in the workspace only while that chunk is processed.
//
// Per row r (logits x = h_r W^T + b, target t, label smoothing s, z-loss z), exactly as
// cross_entropy (fusekit/cross_entropy.h):
//   lse    = log(sum_j exp(x_j))
//   loss_r = lse - (1 - s) x_t - (s / V) sum_j x_j + z lse^2
//   dx_rj  = g_r (softmax_j (1 + 2 z lse) - s / V - (1 - s) [j == t])
// with g_r = 1 / N for reduction mean (N: the rows not ignored, over ALL T rows, not per chunk), 1
// for sum and none (none: the gradient of the sum of the row losses). Then
//   dh = dx W      dW = dx^T h      db = sum over rows of dx
//
// Shapes:
//   h        (..., H): the leading dimensions flattened into T rows with one row stride (last
//            dimension contiguous)
//   weight   (V, H), last dimension contiguous, any row stride >= H (the nn.Linear / tied
//            embedding layout)
//   bias     (V), optional, contiguous
//   targets  T class indices (any shape with T elements, contiguous), i32 or i64
//   loss     float32, contiguous: one value for mean and sum, T for none
//   dh       like h (its own row stride); dweight (V, H) (its own row stride); dbias (V) contiguous
// H: 1 .. 2^31 - 1, V: 1 .. kCrossEntropyMaxClasses, T: 0 .. 2^31 - 1.
//
// Dtypes: h, weight and bias share one dtype. On a GPU: bf16 or f16 (tensor-core GEMMs
// accumulating in float32), or f32 (a slower path: plain float32 GEMMs, never TF32). On the CPU
// also f64; the CPU backend is the float64 reference for every dtype (outputs rounded once).
//   dh: h's dtype.  dweight, dbias: float32 or h's dtype (each its own choice).
//   The chunk's logits are stored in h's dtype (as an unfused bf16 / f16 layer stores them) and the
//   cross-entropy's float32 math reads them; its gradient dx overwrites them in place, in h's
//   dtype, and feeds the dh and dW GEMMs. dW is accumulated over the chunks in float32 (directly in
//   dweight when it is float32, else in the workspace, rounded into dweight once at the end); db
//   likewise in a float32 workspace row, summed over each chunk's rows in a fixed order.
//   f16 caveat: for reduction mean, dx = g_r (...) is stored in f16 scaled by 1 / N, so entries
//   below f16's normal range (6.1e-5, i.e. small probabilities over large N) lose precision, as
//   they do in an unfused f16 pipeline. Prefer bf16, or reduction sum with the scale applied
//   elsewhere.
//
// Calls: any subset of dh, dweight, dbias may be given; with all three absent the call is the
// validation loss (no gradient GEMMs, no gradient written). dweight and dbias are overwritten (not
// accumulated): a tied embedding adds its own gradient afterwards (embedding_backward with
// accumulate = true). The loss is always written.
//
// Options: CrossEntropyConfig as cross_entropy takes it: ignore_index (any integer), label_smoothing
// in [0, 1), z_loss finite and >= 0, reduction mean, sum or none. Ignored rows have loss 0, zero dh
// rows, and contribute nothing to dW and db; a call whose rows are all ignored (or with no rows) has
// mean loss 0 and zero gradients. A target outside [0, V) that is not ignore_index: on the CPU an
// invalid_argument error naming the row; on a GPU its row loss and gradient row are NaN (so are the
// mean / sum and dW, db), as in cross_entropy.
//
// Determinism: every reduction has a fixed order (row statistics, the loss over the rows in row
// order after the last chunk, db's column sums, dW's chunks accumulated in order with a fixed GEMM
// algorithm per shape): the same inputs give bitwise the same outputs on every run (for a given
// GPU, shape and process; the first call of a shape may time cuBLASLt's candidates, as
// linear_forward does, and keeps the fastest from then on).
//
// Workspace (GPU; none on the CPU): caller-owned, a u8 tensor of at least
// linear_cross_entropy_workspace_size() bytes, 256-byte aligned, on h's device. With e = h's element
// size, Tc = the chunk's rows (linear_cross_entropy_chunk_tokens()), Vp = V rounded up to a
// multiple of 8, and a(n) = n rounded up to a multiple of 256:
//   32 MiB (cuBLASLt's scratch) + 256 (the gradient's scale)
//   + a(4 T)        the row losses (reductions mean and sum)
//   + a(Tc Vp e)    one chunk's logits, overwritten by its gradient
//   + a(4 V H)      the float32 dW accumulator, only where dweight_dtype is not f32
//   + a(4 V)        the float32 db accumulator, only with a bias
// So beyond the gradients themselves the extra memory is one chunk of logits (plus the float32 dW
// accumulator when dW is wanted in bf16 / f16). The chunk is chosen so that Tc Vp e stays near
// 512 MiB, never above 4 GiB, with at least 4096 rows allowed per chunk (dW's accumulation reads
// and writes V H floats per chunk, which a shorter chunk could not hide behind its GEMM); T is then
// split into equal chunks (a multiple of 128 rows, so never fewer than 2048 when there are several).
//
// Outputs must not overlap inputs or each other, nor the workspace.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusekit/cross_entropy.h"
#include "fusekit/tensor.h"

namespace fusekit {

// Rows per chunk for a problem of `tokens` rows, `vocab` classes, `hidden` features in `dtype` on
// `device` (what the workspace formula above calls Tc; T itself where one chunk holds every row;
// 0 for T = 0 and on the CPU, which needs no chunks).
std::int64_t linear_cross_entropy_chunk_tokens(std::int64_t tokens, std::int64_t vocab,
                                               std::int64_t hidden, DType dtype, Device device);

// Bytes of scratch memory a linear_cross_entropy call needs on `device` (0 on the CPU): enough
// for any subset of gradients with dweight in `dweight_dtype` (pass f32 where dweight is not
// computed) and a bias when `has_bias`.
std::size_t linear_cross_entropy_workspace_size(std::int64_t tokens, std::int64_t vocab,
                                                std::int64_t hidden, DType dtype,
                                                DType dweight_dtype, bool has_bias,
                                                const CrossEntropyConfig& config, Device device);

// The loss, and dh, dweight, dbias where given (see the header comment).
void linear_cross_entropy(const TensorView& h, const TensorView& weight,
                          const OptionalTensor& bias, const TensorView& targets,
                          const CrossEntropyConfig& config, const TensorView& loss,
                          const OptionalTensor& dh = std::nullopt,
                          const OptionalTensor& dweight = std::nullopt,
                          const OptionalTensor& dbias = std::nullopt,
                          const OptionalTensor& workspace = std::nullopt, Stream stream = nullptr);

}  // namespace fusekit
