#include "trainer.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "checkpoint.h"
#include "sampler.h"

namespace train_gpt {

Trainer::Trainer(const TrainerOptions& options, const TokenSplit& tokens) : options_(options), tokens_(tokens) {
  use_device(options.backend.device);
  arena_ = std::make_unique<Arena>(options.backend.device);
  params_ = std::make_unique<Parameters>(options.model, options.backend, *arena_);
  std::uint64_t data_position = 0;
  if (options.resume.empty()) {
    params_->initialize(options.seed);
  } else {
    const TrainingState state = load_checkpoint(options.resume, *params_);
    if (state.seed != options.seed)
      throw std::runtime_error("checkpoint '" + options.resume + "' was trained with seed " + std::to_string(state.seed) +
                               ", not " + std::to_string(options.seed) + " (its data order and dropout masks depend on it)");
    step_ = state.step;
    last_loss_ = state.last_loss;
    data_position = state.data_position;
  }
  model_ = std::make_unique<Model>(*params_, options.batch, options.deterministic, *arena_);
  optimizer_ = std::make_unique<Optimizer>(*params_, options.optimizer, *arena_);
  train_loader_ = std::make_unique<BatchLoader>(tokens.train, options.batch, options.model.seq_len, options.seed, true);
  train_loader_->seek(data_position);
}

StepStats Trainer::train_step() {
  const auto start = std::chrono::steady_clock::now();
  StepStats s;
  s.step = ++step_;
  train_loader_->next(inputs_, targets_);
  model_->set_batch(inputs_, targets_, options_.batch);
  s.loss = model_->forward_backward(DropoutConfig{options_.dropout, options_.seed, s.step});
  // A data-parallel run would all-reduce params().grad here, before the norm and the update.
  s.grad_norm = optimizer_->grad_norm();
  s.lr = learning_rate(options_.optimizer, s.step);
  optimizer_->step(s.step, s.lr);
  synchronize(options_.backend.device);
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  last_loss_ = s.loss;
  return s;
}

float Trainer::validation_loss(std::int64_t batches) {
  BatchLoader loader(tokens_.val, options_.batch, options_.model.seq_len, options_.seed, false);
  const std::int64_t n = std::max<std::int64_t>(1, std::min(batches, loader.batches_per_epoch()));
  std::vector<std::int32_t> inputs, targets;
  double total = 0.0;
  for (std::int64_t i = 0; i < n; ++i) {
    loader.next(inputs, targets);
    model_->set_batch(inputs, targets, options_.batch);
    total += model_->loss();
  }
  return static_cast<float>(total / static_cast<double>(n));
}

std::string Trainer::sample(const std::string& prompt, std::int64_t count, float temperature, std::uint64_t seed) {
  return sample_text(*model_, options_.model, prompt, count, temperature, seed);
}

void Trainer::save(const std::string& path) const {
  TrainingState state;
  state.config = options_.model;
  state.step = step_;
  state.seed = options_.seed;
  state.data_position = train_loader_->position();
  state.last_loss = last_loss_;
  save_checkpoint(path, state, *params_);
}

}  // namespace train_gpt
