// One training run: the parameters, model, optimizer and data of a run, and its step.
//
// Data parallelism (TrainerOptions::replicas > 1): one replica of the model per GPU (devices
// backend.device.index .. + replicas - 1), each with its own arena, parameters, optimizer state
// and stream, driven by a host thread of its own. A step splits the global batch by rows
// (rank_rows, data.h), runs every replica's forward and backward on its rows, averages the
// gradients across the replicas (NCCL, in the gradients' own dtypes) before the global norm and
// clipping, and lets every replica take the same AdamW step, so the replicas stay bitwise
// identical. On the CPU backend the replicas run on host threads and a host average stands in for
// NCCL: the same split and the same arithmetic, for tests.
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
#include "parallel.h"

namespace train_gpt {

struct TrainerOptions {
  ModelConfig model;
  Backend backend;            // replica 0's; replica r runs on the GPU backend.device.index + r
  OptimizerConfig optimizer;  // total_steps: the schedule's last step
  std::int64_t batch = 16;    // sequences per step, over all replicas
  int replicas = 1;           // data-parallel replicas (train_gpt --gpus); must divide batch
  float dropout = 0.0f;
  std::uint64_t seed = 1337;
  bool deterministic = false;  // bitwise-reproducible attention backward on the GPU
  bool step_graph = true;      // replay the step as a CUDA graph where Model::step_graph_taken (one replica)
  std::string resume;          // a checkpoint to continue from (empty: initialize from the seed)
};

struct StepStats {
  std::int64_t step = 0;
  float loss = 0.0f, lr = 0.0f, grad_norm = 0.0f;
  double seconds = 0.0;
  double enqueue_seconds = 0.0;  // from the step's start until its last kernel was enqueued (replica 0)
};

// The dropout seed of data-parallel rank `rank`. fusekit's masks are a function of each element's
// position in the tensor an op sees, and a replica sees only its rows, so a replica cannot draw
// the masks a single device draws for those rows: rank 0 keeps the run seed (the masks of a
// one-replica run for its rows), every other rank draws from a seed of its own derived from it, so
// that no two ranks share masks. With dropout on, runs on different numbers of replicas therefore
// differ; at dropout 0 they agree within rounding.
std::uint64_t replica_dropout_seed(std::uint64_t seed, int rank);

class Trainer {
 public:
  // `tokens`: the training and validation token streams (kept by reference). Throws
  // std::invalid_argument when replicas does not divide batch (naming --batch and --gpus) or
  // more GPUs are asked for than exist, std::runtime_error when replicas > 1 on a GPU and the
  // build has no NCCL.
  Trainer(const TrainerOptions& options, const TokenSplit& tokens);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // One optimizer step on the next training batch: forward and backward, the gradient average
  // across replicas, the global gradient norm, AdamW with clipping at the scheduled learning
  // rate. The loss is the mean over the whole batch (the mean of the replicas' means: every row
  // has seq_len targets, none ignored).
  StepStats train_step();
  // The mean loss over the first `batches` validation batches (dropout off), each batch split
  // over the replicas as in training.
  float validation_loss(std::int64_t batches);
  // Continues `prompt` by `count` sampled bytes (replica 0).
  std::string sample(const std::string& prompt, std::int64_t count, float temperature, std::uint64_t seed);

  // Writes replica 0's state (every replica holds the same): the checkpoint does not depend on
  // the number of replicas, and resumes on any number.
  void save(const std::string& path) const;

  // Throws std::runtime_error naming the first replica and parameter whose float32 master values
  // differ from replica 0's. Copies every parameter to the host: a check, not for every step.
  void check_replicas();

  std::int64_t step() const { return step_; }
  float last_loss() const { return last_loss_; }
  const TrainerOptions& options() const { return options_; }
  int replicas() const { return static_cast<int>(replicas_.size()); }
  std::int64_t micro_batch() const { return micro_batch_; }
  // How the gradients are averaged (empty with one replica), for the log.
  std::string describe_parallelism() const;
  Parameters& params(int rank = 0);
  Model& model(int rank = 0);
  std::size_t arena_bytes() const;  // one replica's
  double flops_per_token() const;

 private:
  struct Replica;
  // Runs job(replica, rank) on every replica's thread.
  void on_replicas(const std::function<void(Replica&, int)>& job);
  // Frees the replicas and the communicators on their own threads.
  void release() noexcept;

  TrainerOptions options_;
  const TokenSplit& tokens_;
  std::int64_t micro_batch_ = 0;
  std::unique_ptr<BatchLoader> train_loader_;
  std::unique_ptr<RankThreads> threads_;
  std::unique_ptr<RankBarrier> barrier_;
  std::unique_ptr<GradientAverage> average_;
  std::vector<std::unique_ptr<Replica>> replicas_;
  std::int64_t step_ = 0;
  float last_loss_ = 0.0f;
  std::vector<std::int32_t> inputs_, targets_;
};

}  // namespace train_gpt
