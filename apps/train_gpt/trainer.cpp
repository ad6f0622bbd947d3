#include "trainer.h"

#include <fusekit/runtime.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <stdexcept>

#include "checkpoint.h"
#include "rng.h"
#include "sampler.h"

namespace train_gpt {
namespace {

// The seed stream of the dropout masks of ranks other than 0.
constexpr std::uint64_t kDropoutStream = 0x64726f70ull;

Backend replica_backend(const Backend& first, int rank) {
  Backend b = first;
  if (b.device.is_cuda()) b.device = fusekit::Device::cuda(first.device.index + rank);
  b.stream = nullptr;  // each replica makes its own
  return b;
}

}  // namespace

std::uint64_t replica_dropout_seed(std::uint64_t seed, int rank) {
  return rank == 0 ? seed : mix_seed(seed, kDropoutStream, static_cast<std::uint64_t>(rank));
}

// One replica of the model: everything of a run that lives on one device.
struct Trainer::Replica {
  Replica(const TrainerOptions& o, int rank, std::int64_t rows, const Checkpoint* from)
      : backend(replica_backend(o.backend, rank)), stream(backend.device) {
    use_device(backend.device);
    backend.stream = stream.get();
    arena = std::make_unique<Arena>(backend.device);
    params = std::make_unique<Parameters>(o.model, backend, *arena);
    if (from)
      apply_checkpoint(*from, o.resume, *params);
    else
      params->initialize(o.seed);
    model = std::make_unique<Model>(*params, rows, o.deterministic, *arena);
    // One-GPU runs only: a data-parallel replica launches its ops directly.
    model->set_step_graph(o.step_graph && o.replicas == 1);
    optimizer = std::make_unique<Optimizer>(*params, o.optimizer, *arena);
  }

  Backend backend;
  DeviceStream stream;
  std::unique_ptr<Arena> arena;
  std::unique_ptr<Parameters> params;
  std::unique_ptr<Model> model;
  std::unique_ptr<Optimizer> optimizer;
  // Results of the last job, read by the calling thread once every rank is done.
  float loss = 0.0f, grad_norm = 0.0f;
  std::vector<float> losses;
  std::vector<std::uint64_t> hashes;
};

Trainer::Trainer(const TrainerOptions& options, const TokenSplit& tokens) : options_(options), tokens_(tokens) {
  const int n = options.replicas;
  micro_batch_ = train_gpt::micro_batch(options.batch, n);
  const fusekit::Device first = options.backend.device;
  if (first.is_cuda() && first.index + n > fusekit::cuda_device_count())
    throw std::invalid_argument("--gpus " + std::to_string(n) + ": needs CUDA devices " + std::to_string(first.index) +
                                " .. " + std::to_string(first.index + n - 1) + "; CUDA devices visible: " +
                                std::to_string(fusekit::cuda_device_count()));
  std::optional<Checkpoint> checkpoint;
  std::uint64_t data_position = 0;
  if (!options.resume.empty()) {
    checkpoint = read_checkpoint(options.resume);
    const TrainingState& state = checkpoint->state;
    if (state.seed != options.seed)
      throw std::runtime_error("checkpoint '" + options.resume + "' was trained with seed " + std::to_string(state.seed) +
                               ", not " + std::to_string(options.seed) + " (its data order and dropout masks depend on it)");
    step_ = state.step;
    last_loss_ = state.last_loss;
    data_position = state.data_position;
  }
  train_loader_ = std::make_unique<BatchLoader>(tokens.train, options.batch, options.model.seq_len, options.seed, true);
  train_loader_->seek(data_position);

  use_device(first);  // the calling thread runs rank 0
  if (n > 1) {
    barrier_ = std::make_unique<RankBarrier>(n);
    average_ = first.is_cuda() ? nccl_gradient_average(n, first.index) : host_gradient_average(n);
  }
  threads_ = std::make_unique<RankThreads>(n);
  replicas_.resize(static_cast<std::size_t>(n));
  try {
    // Each replica is built on its own thread: its device becomes that thread's current one.
    threads_->run([&](int r) {
      replicas_[static_cast<std::size_t>(r)] =
          std::make_unique<Replica>(options, r, micro_batch_, checkpoint ? &*checkpoint : nullptr);
    });
  } catch (...) {
    release();
    throw;
  }
}

Trainer::~Trainer() { release(); }

void Trainer::release() noexcept {
  if (!threads_) return;
  try {
    threads_->run([&](int r) {
      std::exception_ptr error;
      try {
        if (average_) average_->release(r);
      } catch (...) {
        error = std::current_exception();
      }
      replicas_[static_cast<std::size_t>(r)].reset();
      if (error) std::rethrow_exception(error);
    });
  } catch (...) {
    // Nothing to report from a destructor; the process's CUDA state is torn down at exit anyway.
  }
  replicas_.clear();
}

void Trainer::on_replicas(const std::function<void(Replica&, int)>& job) {
  threads_->run([&](int r) {
    Replica& x = *replicas_[static_cast<std::size_t>(r)];
    use_device(x.backend.device);
    job(x, r);
  });
}

StepStats Trainer::train_step() {
  const auto start = std::chrono::steady_clock::now();
  StepStats s;
  s.step = ++step_;
  s.lr = learning_rate(options_.optimizer, s.step);
  train_loader_->next(inputs_, targets_);
  const int n = replicas();
  const std::int64_t T = options_.model.seq_len;
  threads_->run([&](int r) {
    Replica& x = *replicas_[static_cast<std::size_t>(r)];
    bool arrived = false;  // at the barrier before the gradient average, which every rank passes once
    try {
      use_device(x.backend.device);
      x.model->set_batch(rank_rows(inputs_, options_.batch, T, n, r), rank_rows(targets_, options_.batch, T, n, r),
                         micro_batch_);
      // The whole step is enqueued first, then read once: no synchronization inside it.
      x.model->enqueue_forward_backward(
          DropoutConfig{options_.dropout, replica_dropout_seed(options_.seed, r), s.step});
      if (average_) {
        arrived = true;
        if (!barrier_->arrive_and_wait(true))
          throw PeerFailure("replica " + std::to_string(r) + " stopped: another replica failed before the gradient average");
        average_->run(r, x.params->grad_buckets, x.backend.stream);
      }
      x.optimizer->enqueue_grad_norm();
      x.optimizer->step(s.step, s.lr);
      if (r == 0) s.enqueue_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      synchronize(x.backend.device);
      x.loss = x.model->loss_value();
      x.grad_norm = x.optimizer->grad_norm_value();
    } catch (...) {
      if (average_ && !arrived) barrier_->arrive_and_wait(false);
      throw;
    }
  });
  // The batch mean: every replica's rows hold the same number of targets.
  double total = 0.0;
  for (const auto& x : replicas_) total += static_cast<double>(x->loss);
  s.loss = static_cast<float>(total / static_cast<double>(n));
  s.grad_norm = replicas_[0]->grad_norm;  // the same on every replica: computed from the same averaged gradients
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  last_loss_ = s.loss;
  return s;
}

float Trainer::validation_loss(std::int64_t batches) {
  BatchLoader loader(tokens_.val, options_.batch, options_.model.seq_len, options_.seed, false);
  const std::int64_t count = std::max<std::int64_t>(1, std::min(batches, loader.batches_per_epoch()));
  std::vector<std::vector<std::int32_t>> inputs(static_cast<std::size_t>(count)), targets(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) loader.next(inputs[i], targets[i]);
  const int n = replicas();
  on_replicas([&](Replica& x, int r) {
    x.losses.assign(inputs.size(), 0.0f);
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      x.model->set_batch(rank_rows(inputs[i], options_.batch, options_.model.seq_len, n, r),
                         rank_rows(targets[i], options_.batch, options_.model.seq_len, n, r), micro_batch_);
      x.losses[i] = x.model->loss();
    }
  });
  double total = 0.0;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    double batch = 0.0;
    for (const auto& x : replicas_) batch += static_cast<double>(x->losses[i]);
    total += batch / static_cast<double>(n);
  }
  return static_cast<float>(total / static_cast<double>(count));
}

std::string Trainer::sample(const std::string& prompt, std::int64_t count, float temperature, std::uint64_t seed) {
  std::string text;
  on_replicas([&](Replica& x, int r) {
    if (r == 0) text = sample_text(*x.model, options_.model, prompt, count, temperature, seed);
  });
  return text;
}

void Trainer::save(const std::string& path) const {
  TrainingState state;
  state.config = options_.model;
  state.step = step_;
  state.seed = options_.seed;
  state.data_position = train_loader_->position();
  state.last_loss = last_loss_;
  // The calling thread is rank 0's: its current device is replica 0's.
  save_checkpoint(path, state, *replicas_[0]->params);
}

void Trainer::check_replicas() {
  on_replicas([&](Replica& x, int) { x.hashes = x.params->master_hashes(); });
  const std::vector<std::uint64_t>& reference = replicas_[0]->hashes;
  for (std::size_t r = 1; r < replicas_.size(); ++r) {
    const std::vector<std::uint64_t>& h = replicas_[r]->hashes;
    for (std::size_t i = 0; i < reference.size(); ++i) {
      if (h[i] != reference[i])
        throw std::runtime_error("after step " + std::to_string(step_) + ", replica " + std::to_string(r) +
                                 "'s parameter " + replicas_[0]->params->layout().info[i].name +
                                 " differs from replica 0's: the replicas have diverged");
    }
  }
}

std::string Trainer::describe_parallelism() const { return average_ ? average_->describe() : std::string(); }

Parameters& Trainer::params(int rank) { return *replicas_.at(static_cast<std::size_t>(rank))->params; }

Model& Trainer::model(int rank) { return *replicas_.at(static_cast<std::size_t>(rank))->model; }

std::size_t Trainer::arena_bytes() const { return replicas_[0]->arena->bytes(); }

double Trainer::flops_per_token() const { return replicas_[0]->model->training_flops_per_token(); }

}  // namespace train_gpt
