// Softmax cross-entropy over large vocabularies: the loss, its gradient, and both in one call.
//
// For row r with logits x (V classes) and target t:
//   lse    = log(sum_j exp(x_j))
//   loss_r = lse - (1 - s) x_t - (s / V) sum_j x_j + z lse^2
//   d loss_r / d x_j = softmax_j (1 + 2 z lse) - s / V - (1 - s) [j == t]
// s is the label smoothing (PyTorch's definition: the target distribution is (1 - s) one_hot(t) +
// s / V), z the z-loss coefficient (PaLM's auxiliary z * log(Z)^2; 0 turns it off).
//
// Shapes: logits is (..., V): the leading dimensions are flattened into T rows, which must be
// expressible with a single row stride (any stride >= V; the last dimension contiguous); dlogits
// has logits' shape and dtype and a row stride of its own. V may be 1 .. kCrossEntropyMaxClasses.
// Dtypes: logits and dlogits f32, f16 or bf16; all math in float32 (the CPU backend: float64).
// targets: T class indices (any shape with T elements, contiguous), i32 or i64.
// loss, lse, dloss: float32, contiguous. loss and dloss hold T values for reduction none, one
// value (any shape with one element) for mean and sum. lse holds T values.
//
// Ignored rows (target == ignore_index) have loss 0 and a zero gradient and do not count in the
// mean. The mean divides the sum of the row losses by N, the number of rows not ignored; a batch
// whose rows are all ignored (or that has no rows) has mean loss 0, not NaN, and a zero gradient.
// lse is written for every row, ignored ones included.
//
// A target that is neither ignore_index nor in [0, V): on the CPU an invalid_argument error
// naming the row. On a GPU the kernels cannot report it without a host synchronization per call,
// so they mark it in the results instead: the row's loss is NaN (so a mean or sum is NaN) and its
// gradient row is NaN (lse is still the row's logsumexp). A loop that checks its loss sees it.
//
// Calls:
//  * cross_entropy_forward: the loss, and optionally lse (what the backward needs).
//  * cross_entropy_backward: dlogits[r, j] = g_r * d loss_r / d x_j from logits, targets and the
//    saved lse (softmax = exp(x - lse): no reduction over the row). g_r comes from dloss, read
//    from device memory (no host synchronization): dloss[r] for reduction none (T values), dloss for
//    sum, dloss / N for mean (one value; N counted on the device).
//  * cross_entropy_forward_backward: the training step's usual case in one launch sequence: the
//    loss and its own gradient (g_r = 1 for sum and none, 1 / N for mean; N counted on the
//    device), optionally lse. The kernel sweeps each row twice (its statistics, then its
//    gradient), the second sweep right after the first, from L2: the logits are read from memory
//    once and dlogits written once.
// dlogits may be the logits themselves (the same data pointer and row stride: in place, the
// gradient overwrites the logits) in the backward and in the fused call; any other overlap of an
// output with an input is refused.
//
// Reductions are deterministic: row statistics and the mean / sum over rows are summed in a fixed
// order, so the same inputs give bitwise the same loss, lse and dlogits on every run (for a given
// GPU and shape).
//
// Scratch memory: on a GPU, reductions mean and sum need a workspace: ask
// cross_entropy_workspace_size() (enough for any of the three calls) and pass a u8 view of at least
// that many bytes (16-byte aligned) on the logits' device. None is needed on the CPU or for reduction
// none.
//
// Options: ignore_index any integer (it may name a real class: those rows are then ignored, as in
// PyTorch); label_smoothing in [0, 1); z_loss finite and >= 0. Outputs must not overlap inputs
// (dlogits over logits exactly excepted). Limits: T <= 2^31 - 1.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusekit/tensor.h"

namespace fusekit {

inline constexpr std::int64_t kCrossEntropyMaxClasses = 262144;

// How the row losses become the loss: kept per row (T values), their mean over the rows not
// ignored, or their sum.
enum class LossReduction : std::uint8_t { none, mean, sum };

const char* loss_reduction_name(LossReduction r);  // "none", "mean", "sum"

// Everything that defines the loss besides its tensors. Pass the same value to every call of one
// loss (forward, backward).
struct CrossEntropyConfig {
  std::int64_t ignore_index = -100;
  float label_smoothing = 0.0f;  // s, in [0, 1)
  float z_loss = 0.0f;           // z, finite and >= 0
  LossReduction reduction = LossReduction::mean;
};

// Bytes of scratch memory any cross-entropy call on `rows` rows of `classes` logits on `device`
// needs (0 on the CPU and for reduction none).
std::size_t cross_entropy_workspace_size(std::int64_t rows, std::int64_t classes,
                                         LossReduction reduction, Device device);

// loss (and lse, where given) from logits and targets.
void cross_entropy_forward(const TensorView& logits, const TensorView& targets,
                           const CrossEntropyConfig& config, const TensorView& loss,
                           const OptionalTensor& lse = std::nullopt,
                           const OptionalTensor& workspace = std::nullopt, Stream stream = nullptr);

// dlogits from the loss's gradient dloss, the logits, targets and the forward's lse.
void cross_entropy_backward(const TensorView& dloss, const TensorView& logits,
                            const TensorView& targets, const TensorView& lse,
                            const CrossEntropyConfig& config, const TensorView& dlogits,
                            const OptionalTensor& workspace = std::nullopt, Stream stream = nullptr);

// loss and dlogits = d loss / d logits (and lse, where given) in one launch sequence.
void cross_entropy_forward_backward(const TensorView& logits, const TensorView& targets,
                                    const CrossEntropyConfig& config, const TensorView& loss,
                                    const TensorView& dlogits,
                                    const OptionalTensor& lse = std::nullopt,
                                    const OptionalTensor& workspace = std::nullopt,
                                    Stream stream = nullptr);

}  // namespace fusekit
