#include "optimizer.h"

#include <fusekit/optim.h>

#include <algorithm>
#include <cmath>
#include <numbers>

namespace train_gpt {

float learning_rate(const OptimizerConfig& c, std::int64_t step) {
  if (c.warmup_steps > 0 && step <= c.warmup_steps)
    return c.lr * static_cast<float>(step) / static_cast<float>(c.warmup_steps);
  const double decay_steps = static_cast<double>(std::max<std::int64_t>(c.total_steps - c.warmup_steps, 1));
  const double progress = std::clamp(static_cast<double>(step - c.warmup_steps) / decay_steps, 0.0, 1.0);
  const double min_lr = static_cast<double>(c.lr) * c.min_lr_ratio;
  return static_cast<float>(min_lr + 0.5 * (1.0 + std::cos(std::numbers::pi * progress)) * (c.lr - min_lr));
}

Optimizer::Optimizer(Parameters& params, const OptimizerConfig& config, Arena& arena)
    : params_(params), config_(config) {
  // One adamw_step call per (weight decay or not) x (low-precision copy or not): a call takes one
  // weight decay, and a copy for every parameter or none. Parameters the ops read as float32 are
  // their own master: nothing to rewrite.
  for (int decay = 1; decay >= 0; --decay) {
    for (int copy = 0; copy <= 1; ++copy) {
      Group g;
      g.weight_decay = decay ? config.weight_decay : 0.0f;
      for (std::size_t i = 0; i < params.size(); ++i) {
        if (params.layout().info[i].decay != bool(decay) || params.has_copy[i] != bool(copy)) continue;
        g.params.push_back(params.master[i]);
        g.grads.push_back(params.grad[i]);
        g.exp_avg.push_back(params.exp_avg[i]);
        g.exp_avg_sq.push_back(params.exp_avg_sq[i]);
        if (copy) g.copies.push_back(params.compute[i]);
      }
      if (!g.params.empty()) groups_.push_back(std::move(g));
    }
  }
  norm_ = arena.tensor(fusekit::DType::f32, {1});
  const std::size_t ws = fusekit::global_norm_workspace_size(params.grad, arena.device());
  workspace_ = arena.tensor(fusekit::DType::u8, {static_cast<std::int64_t>(std::max<std::size_t>(ws, 1))});
}

void Optimizer::enqueue_grad_norm() {
  fusekit::global_norm(params_.grad, norm_, workspace_, params_.backend().stream);
}

float Optimizer::grad_norm_value() const {
  float norm = 0.0f;
  copy_to_host(&norm, norm_);
  return norm;
}

float Optimizer::grad_norm() {
  enqueue_grad_norm();
  return grad_norm_value();
}

void Optimizer::step(std::int64_t step, float lr) {
  for (const Group& g : groups_) {
    fusekit::AdamWConfig c;
    c.lr = lr;
    c.beta1 = config_.beta1;
    c.beta2 = config_.beta2;
    c.eps = config_.eps;
    c.weight_decay = g.weight_decay;
    c.step = step;
    c.max_grad_norm = config_.max_grad_norm;
    fusekit::adamw_step(g.params, g.grads, g.exp_avg, g.exp_avg_sq, g.copies, c,
                        config_.max_grad_norm > 0.0f ? fusekit::OptionalTensor(norm_) : std::nullopt,
                        params_.backend().stream);
  }
}

}  // namespace train_gpt
