// One training run: the parameters, model, optimizer and data of a run, and its step.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "config.h"
#include "data.h"
#include "memory.h"
#include "model.h"
#include "optimizer.h"
#include "params.h"

namespace train_gpt {

struct TrainerOptions {
  ModelConfig model;
  Backend backend;
  OptimizerConfig optimizer;  // total_steps: the schedule's last step
  std::int64_t batch = 16;
  float dropout = 0.0f;
  std::uint64_t seed = 1337;
  bool deterministic = false;  // bitwise-reproducible attention backward on the GPU
  std::string resume;          // a checkpoint to continue from (empty: initialize from the seed)
};

struct StepStats {
  std::int64_t step = 0;
  float loss = 0.0f, lr = 0.0f, grad_norm = 0.0f;
  double seconds = 0.0;
};

class Trainer {
 public:
  // `tokens`: the training and validation token streams (kept by reference).
  Trainer(const TrainerOptions& options, const TokenSplit& tokens);

  // One optimizer step on the next training batch: forward and backward, the global gradient
  // norm, AdamW with clipping at the scheduled learning rate.
  StepStats train_step();
  // The mean loss over the first `batches` validation batches (dropout off).
  float validation_loss(std::int64_t batches);
  // Continues `prompt` by `count` sampled bytes.
  std::string sample(const std::string& prompt, std::int64_t count, float temperature, std::uint64_t seed);

  void save(const std::string& path) const;

  std::int64_t step() const { return step_; }
  float last_loss() const { return last_loss_; }
  const TrainerOptions& options() const { return options_; }
  Parameters& params() { return *params_; }
  Model& model() { return *model_; }
  std::size_t arena_bytes() const { return arena_->bytes(); }
  double flops_per_token() const { return model_->training_flops_per_token(); }

 private:
  TrainerOptions options_;
  const TokenSplit& tokens_;
  std::unique_ptr<Arena> arena_;
  std::unique_ptr<Parameters> params_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<BatchLoader> train_loader_;
  std::int64_t step_ = 0;
  float last_loss_ = 0.0f;
  std::vector<std::int32_t> inputs_, targets_;
};

}  // namespace train_gpt
