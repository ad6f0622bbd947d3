// Data parallelism inside one process: one host thread per replica of the model, a meeting point
// before each collective, and the gradient average (NCCL across GPUs; on the CPU backend a host
// average that stands in for it, so that the tests exercise the same steps).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fusekit/tensor.h>

namespace train_gpt {

// What a rank throws when it stops because another rank failed (whose own error is the one worth
// reporting: RankThreads::run prefers it).
struct PeerFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Runs a job on `ranks` ranks at once: rank 0 on the calling thread, ranks 1 .. ranks - 1 each on
// a thread of its own that lives as long as the object, so that per-thread state (the current
// GPU, the library's per-thread handles) persists from one job to the next.
class RankThreads {
 public:
  explicit RankThreads(int ranks);
  ~RankThreads();
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;

  int ranks() const { return ranks_; }
  // Calls job(rank) for every rank concurrently and returns when every call has returned. If any
  // threw, rethrows one of their exceptions: the lowest rank's that is not a PeerFailure, else
  // the lowest rank's.
  void run(const std::function<void(int rank)>& job);

 private:
  void work(int rank);

  int ranks_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(int)>* job_ = nullptr;
  std::uint64_t round_ = 0;
  int running_ = 0;
  bool stopping_ = false;
  std::vector<std::exception_ptr> errors_;
  std::vector<std::thread> threads_;  // last: started once the members above exist
};

// Where the ranks meet before a collective. A collective waits for every rank, so a rank that
// failed earlier in the step would leave the others waiting in it forever; instead it arrives
// here with ok = false, and no rank enters the collective.
class RankBarrier {
 public:
  explicit RankBarrier(int ranks) : ranks_(ranks) {}
  // Blocks until every rank has arrived (each rank arrives once per round); returns whether all
  // of them arrived with ok.
  bool arrive_and_wait(bool ok);

 private:
  int ranks_;
  std::mutex mutex_;
  std::condition_variable all_arrived_;
  int arrived_ = 0;
  bool round_ok_ = true, last_result_ = true;
  std::uint64_t round_ = 0;
};

// Replaces every rank's gradients with their mean over the ranks, in place, so that every rank
// then holds the same values bit for bit and takes the same optimizer step.
class GradientAverage {
 public:
  virtual ~GradientAverage() = default;
  // Called by every rank's thread at once with its own buckets (Parameters::grad_buckets: the
  // same dtypes and sizes on every rank) and the stream its work runs on; returns once the
  // average is queued on that stream (GPU) or done (CPU).
  virtual void run(int rank, const std::vector<fusekit::TensorView>& buckets, fusekit::Stream stream) = 0;
  // Called by every rank's thread at once when the run ends: frees the rank's share.
  virtual void release(int rank) = 0;
  // How the average is computed, for the log.
  virtual std::string describe() const = 0;
};

// The CPU backend's: the last rank to arrive sums the ranks' float32 values in rank order in
// float64, divides by the number of ranks, rounds once to float32 and writes the result to every
// rank.
std::unique_ptr<GradientAverage> host_gradient_average(int ranks);

// Across the GPUs first_device .. first_device + ranks - 1 through NCCL: one communicator per GPU
// from ncclCommInitAll, then per step one ncclAllReduce with ncclAvg per bucket, in the bucket's
// dtype, on the rank's stream. Throws std::runtime_error when this build has no NCCL (CMake found
// none) or NCCL fails.
std::unique_ptr<GradientAverage> nccl_gradient_average(int ranks, int first_device);

// The NCCL this build links ("2.28.9"), or empty when it was built without NCCL.
std::string nccl_version();

}  // namespace train_gpt
