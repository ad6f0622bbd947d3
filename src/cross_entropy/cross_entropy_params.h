// The validated, backend-neutral description of one cross-entropy call. The public entry points
// (cross_entropy.cpp) check the arguments and fill these; each backend reads them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusekit/cross_entropy.h"
#include "fusekit/tensor.h"

namespace fusekit::detail {
class ArgCheck;
}

namespace fusekit::cross_entropy {

// A known reduction, and the options' ranges (label_smoothing in [0, 1), z_loss finite and >= 0):
// the checks of every op that takes a CrossEntropyConfig (cross_entropy, linear_cross_entropy).
void check_reduction(const detail::ArgCheck& check, LossReduction r);
void check_options(const detail::ArgCheck& check, const CrossEntropyConfig& c);

// Which public call the parameters describe.
enum class Pass : int { forward, backward, forward_backward };

struct Params {
  Pass pass = Pass::forward;
  std::int64_t rows = 0, cols = 0;  // T, V
  DType dtype = DType::f32;         // logits and dlogits
  DType target_dtype = DType::i64;  // i32 or i64
  const void* logits = nullptr;
  std::int64_t logits_row_stride = 0;
  const void* targets = nullptr;
  // Backward: T values (reduction none) or one; the gradient's scale.
  const float* dloss = nullptr;
  // Forward and fused: T values (none) or one. Null in the backward.
  float* loss = nullptr;
  // Forward and fused: written when non-null. Backward: the saved lse, read.
  float* lse = nullptr;
  // Backward and fused; may equal logits (in place, same row stride).
  void* dlogits = nullptr;
  std::int64_t dlogits_row_stride = 0;

  std::int64_t ignore_index = -100;
  float label_smoothing = 0.0f;
  float z_loss = 0.0f;
  LossReduction reduction = LossReduction::mean;

  void* workspace = nullptr;  // GPU only; at least workspace_bytes(rows, reduction, pass)
  std::size_t workspace_bytes = 0;
};

// The GPU workspace: the gradient's scale (mean: dloss / N), then the row losses that the mean or
// the sum reduces. Pure arithmetic, shared by the size query, the entry points and the launcher.
inline constexpr std::size_t kWorkspaceAlignment = 256;
inline constexpr std::size_t kScaleSlotBytes = kWorkspaceAlignment;  // one float, padded

inline std::size_t row_losses_bytes(std::int64_t rows) {
  const std::size_t bytes = static_cast<std::size_t>(rows) * sizeof(float);
  return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

// What a call of `pass` needs: the row losses where it reduces them (forward and fused, mean or
// sum), the scale slot where a mean's gradient is formed (backward and fused, mean).
inline std::size_t workspace_bytes(std::int64_t rows, LossReduction reduction, Pass pass) {
  if (reduction == LossReduction::none || rows <= 0) return 0;
  const bool reduces_losses = pass != Pass::backward;
  const bool scales_gradient = pass != Pass::forward && reduction == LossReduction::mean;
  if (!reduces_losses && !scales_gradient) return 0;
  return kScaleSlotBytes + (reduces_losses ? row_losses_bytes(rows) : 0);
}

// Every call's workspace: the fused call's, which is the largest.
inline std::size_t workspace_bytes_any_pass(std::int64_t rows, LossReduction reduction) {
  return workspace_bytes(rows, reduction, Pass::forward_backward);
}

void run_cpu(const Params& p);
void run_cuda(const Params& p, int device_index, Stream stream);

// The kernels one at a time, for a caller that holds the logits a chunk of rows at a time
// (linear_cross_entropy). All on `stream`, none synchronizing with the host; `op` names the caller
// in errors.
//  * mean_scale_cuda: *scale = 1 / N, N the rows of `targets` not ignored (0 when all are).
//  * rows_cuda: the forward (p.pass forward) or fused (forward_backward) row kernel on p's rows,
//    each row's loss written to row_loss[r] (no reduction: p.loss, p.workspace unused), the
//    gradient scaled by *grad_scale (device memory; 1 where null).
//  * reduce_losses_cuda: *loss = the sum of row_loss over `rows` rows in a fixed order, divided by
//    N for the mean (0 when every row is ignored).
void mean_scale_cuda(const void* targets, DType target_dtype, std::int64_t rows, std::int64_t ignore_index,
                     float* scale, const char* op, Stream stream);
void rows_cuda(const Params& p, float* row_loss, const float* grad_scale, int device_index, const char* op,
               Stream stream);
void reduce_losses_cuda(const float* row_loss, const void* targets, DType target_dtype, std::int64_t rows,
                        std::int64_t ignore_index, bool mean, float* loss, const char* op, Stream stream);

}  // namespace fusekit::cross_entropy
