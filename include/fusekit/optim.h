// Optimizer ops over lists of tensors: the global L2 norm of the gradients and a multi-tensor
// AdamW step, both on the caller's stream without a host synchronization.
//
// ---- global_norm ------------------------------------------------------------------------------
// norm = sqrt(sum over every element x of every tensor of x^2), written as one float32 to `norm`
// (any shape with one element, contiguous, on the tensors' device). The squares are summed in
// float32 per block and the block sums in float64, in a fixed order: the same tensors give bitwise
// the same norm on every run (for a given GPU). The CPU backend sums in float64.
// tensors: f32, f16 or bf16 (each tensor its own dtype), contiguous, any shape, any count (an
// empty list, or only empty tensors, give 0). A NaN or infinite element makes the norm NaN or inf.
// Scratch memory: on a GPU, ask global_norm_workspace_size() for the same list and pass a u8 view
// of at least that many bytes (16-byte aligned) on the tensors' device; none on the CPU.
// `norm` and the workspace must not overlap the tensors.
//
// ---- adamw_step -------------------------------------------------------------------------------
// PyTorch's AdamW (torch.optim.AdamW, amsgrad off, maximize off), preceded where
// max_grad_norm > 0 by PyTorch's clip_grad_norm_ with the norm given in device memory. For every
// element of every tensor i, in float32 (the CPU backend: float64):
//   s = max_grad_norm > 0 ? min(1, max_grad_norm / (grad_norm + 1e-6)) : 1
//   g = grads[i] * s
//   m = beta1 m + (1 - beta1) g                      (exp_avg[i])
//   v = beta2 v + (1 - beta2) g^2                    (exp_avg_sq[i])
//   p = p - lr * weight_decay * p                    (decoupled weight decay)
//   p = p - lr * (m / (1 - beta1^step)) / (sqrt(v / (1 - beta2^step)) + eps)
//   param_copies[i] = p rounded to its dtype         (when param_copies are given)
// grad_norm is one float32 in device memory, typically global_norm()'s output over the same
// grads; it is read by the kernel (s is computed there), so no host synchronization is needed.
// Give grad_norm exactly when max_grad_norm > 0.
//
// Non-finite values are not checked or skipped, as in PyTorch (clip_grad_norm_ with
// error_if_nonfinite=False): a NaN or inf gradient element makes its m, v and parameter NaN or
// inf. With clipping on, a NaN grad_norm makes s NaN (every gradient NaN) and an infinite one makes
// s 0 (finite gradients 0, infinite ones NaN). A loop that wants to skip such steps checks the norm.
//
// Tensors: params, exp_avg, exp_avg_sq (the optimizer's float32 master state) f32; grads f32, f16
// or bf16; param_copies (empty, or one per param) f32, f16 or bf16: the weights the model computes
// with, rewritten from the updated master. Each list may mix dtypes where allowed. All lists have
// the same length (param_copies: that length or 0); grads[i], exp_avg[i], exp_avg_sq[i] and
// param_copies[i] have params[i]'s shape exactly. Every tensor is contiguous and on one device
// (grad_norm too). params, exp_avg, exp_avg_sq and param_copies are updated in place and must not
// overlap each other or the grads (any tensor of any list); grads may alias each other.
// Empty lists and empty tensors are fine (nothing is written).
//
// Config ranges (checked, invalid_argument naming the field): lr finite and >= 0; beta1, beta2 in
// [0, 1); eps finite and > 0; weight_decay finite and >= 0; step >= 1; max_grad_norm finite and
// >= 0. The bias corrections 1 - beta^step are formed in float64 on the host.
//
// On a GPU the tensors go in one kernel launch per group of up to a few dozen tensors of one
// dtype combination (their addresses travel in the launch's parameters); no workspace is needed.
//
// Limits (both ops): each tensor at most 2^44 elements; any number of tensors.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusekit/tensor.h"
#include "fusekit/tensor_list.h"

namespace fusekit {

// Bytes of scratch memory global_norm() needs for `tensors` on `device` (0 on the CPU).
std::size_t global_norm_workspace_size(TensorList tensors, Device device);

// norm = the L2 norm over every element of every tensor (one float32, in the tensors' memory).
void global_norm(TensorList tensors, const TensorView& norm,
                 const OptionalTensor& workspace, Stream stream = nullptr);

// Everything that defines an AdamW step besides its tensors.
struct AdamWConfig {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.0f;
  std::int64_t step = 1;       // 1-based, for the bias correction
  float max_grad_norm = 0.0f;  // > 0: gradients scaled by min(1, max_grad_norm / (grad_norm + 1e-6))
};

// One AdamW step over every tensor of the lists (see the header comment).
void adamw_step(TensorList params, TensorList grads,
                TensorList exp_avg, TensorList exp_avg_sq,
                TensorList param_copies, const AdamWConfig& config,
                const OptionalTensor& grad_norm, Stream stream = nullptr);

}  // namespace fusekit
