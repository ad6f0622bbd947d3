// AdamW with gradient clipping by the global norm, and the learning-rate schedule.
#pragma once

#include <cstdint>
#include <vector>

#include <fusekit/tensor.h>

#include "memory.h"
#include "params.h"

namespace train_gpt {

struct OptimizerConfig {
  float lr = 1e-3f;            // the peak learning rate
  float min_lr_ratio = 0.1f;   // the cosine decays to lr * min_lr_ratio at the last step
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 1;
  // beta2 0.99, not GPT-2's 0.95: at 16 x 1024-token batches, 0.95's short memory of the squared
  // gradients lets a gradient surge through at full step size, and GPT-2 124M's loss then spikes
  // (gradient norm ~100-280) within the first 20 steps at every learning rate and warm-up tried,
  // in reference.py alike (record: train_gpt, h200-2026-11-29). nanoGPT's small-batch configs
  // make the same choice.
  float beta1 = 0.9f, beta2 = 0.99f, eps = 1e-8f;
  float weight_decay = 0.1f;   // on the 2-D weights (embeddings included), not on biases and norms
  float max_grad_norm = 1.0f;  // 0: no clipping
};

// Linear warm-up from lr / warmup_steps to lr over the first warmup_steps steps, then a cosine
// from lr down to lr * min_lr_ratio at step total_steps. `step` is 1-based.
float learning_rate(const OptimizerConfig& config, std::int64_t step);

class Optimizer {
 public:
  Optimizer(Parameters& params, const OptimizerConfig& config, Arena& arena);

  // The global L2 norm of the gradients (global_norm on the device; the value read back for the
  // progress line). Call after the backward (and after a gradient all-reduce, where there is one).
  float grad_norm();
  // The same, enqueued without reading it back; grad_norm_value() reads it (waiting for it).
  void enqueue_grad_norm();
  float grad_norm_value() const;
  // One AdamW step (1-based `step`) at learning rate `lr`, gradients clipped by the norm that
  // grad_norm() left in device memory; the compute copies are rewritten from the masters.
  void step(std::int64_t step, float lr);

 private:
  struct Group {
    std::vector<fusekit::TensorView> params, grads, exp_avg, exp_avg_sq, copies;
    float weight_decay = 0.0f;
  };
  Parameters& params_;
  OptimizerConfig config_;
  std::vector<Group> groups_;
  fusekit::TensorView norm_, workspace_;
};

}  // namespace train_gpt
