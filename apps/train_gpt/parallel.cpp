#include "parallel.h"

#include <algorithm>

#ifdef TRAIN_GPT_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#if NCCL_VERSION_CODE < NCCL_VERSION(2, 10, 0)
#error "train_gpt needs NCCL 2.10 or later (ncclAvg, ncclBfloat16)"
#endif
#endif

namespace train_gpt {

// ---- RankThreads ---------------------------------------------------------------------------

RankThreads::RankThreads(int ranks) : ranks_(ranks), errors_(static_cast<std::size_t>(std::max(ranks, 1))) {
  if (ranks < 1) throw std::invalid_argument("RankThreads: ranks must be >= 1, got " + std::to_string(ranks));
  for (int r = 1; r < ranks; ++r) threads_.emplace_back([this, r] { work(r); });
}

RankThreads::~RankThreads() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void RankThreads::work(int rank) {
  std::uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* job = nullptr;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || round_ != seen; });
      if (stopping_) return;
      seen = round_;
      job = job_;
    }
    std::exception_ptr error;
    try {
      (*job)(rank);
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      errors_[static_cast<std::size_t>(rank)] = error;
      if (--running_ == 0) done_.notify_all();
    }
  }
}

void RankThreads::run(const std::function<void(int)>& job) {
  if (ranks_ == 1) {
    job(0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::fill(errors_.begin(), errors_.end(), nullptr);
    job_ = &job;
    running_ = ranks_ - 1;
    ++round_;
  }
  wake_.notify_all();
  try {
    job(0);
  } catch (...) {
    errors_[0] = std::current_exception();  // rank 0's slot: no worker writes it
  }
  {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return running_ == 0; });
  }
  std::exception_ptr first, first_own;
  for (const std::exception_ptr& e : errors_) {
    if (!e) continue;
    if (!first) first = e;
    try {
      std::rethrow_exception(e);
    } catch (const PeerFailure&) {
    } catch (...) {
      if (!first_own) first_own = e;
    }
  }
  if (first_own) std::rethrow_exception(first_own);
  if (first) std::rethrow_exception(first);
}

// ---- RankBarrier ---------------------------------------------------------------------------

bool RankBarrier::arrive_and_wait(bool ok) {
  std::unique_lock<std::mutex> lock(mutex_);
  const std::uint64_t round = round_;
  round_ok_ = round_ok_ && ok;
  if (++arrived_ == ranks_) {
    // The last to arrive closes the round. last_result_ cannot be overwritten before every
    // waiter has read it: the next round needs each of them to arrive again.
    last_result_ = round_ok_;
    arrived_ = 0;
    round_ok_ = true;
    ++round_;
    all_arrived_.notify_all();
    return last_result_;
  }
  all_arrived_.wait(lock, [&] { return round_ != round; });
  return last_result_;
}

// ---- the host average (CPU backend) ----------------------------------------------------------

namespace {

class HostGradientAverage final : public GradientAverage {
 public:
  explicit HostGradientAverage(int ranks) : ranks_(ranks), buckets_(static_cast<std::size_t>(ranks)) {}

  void run(int rank, const std::vector<fusekit::TensorView>& buckets, fusekit::Stream) override {
    std::unique_lock<std::mutex> lock(mutex_);
    const std::uint64_t round = round_;
    buckets_[static_cast<std::size_t>(rank)] = &buckets;
    if (++arrived_ < ranks_) {
      all_done_.wait(lock, [&] { return round_ != round; });
      if (!problem_.empty()) throw PeerFailure(problem_);
      return;
    }
    // The last rank to arrive averages for everyone, then releases them.
    problem_ = average();
    arrived_ = 0;
    ++round_;
    all_done_.notify_all();
    if (!problem_.empty()) throw std::logic_error(problem_);
  }

  void release(int) override {}

  std::string describe() const override {
    return "the gradients averaged on the host (float64 sums in rank order), standing in for NCCL";
  }

 private:
  // Returns what is wrong with the buckets (empty when nothing is, and the average is done).
  std::string average() {
    const std::vector<fusekit::TensorView>& first = *buckets_[0];
    for (const std::vector<fusekit::TensorView>* b : buckets_) {
      if (b->size() != first.size()) return "host gradient average: the ranks hold different bucket counts";
      for (std::size_t i = 0; i < first.size(); ++i) {
        const fusekit::TensorView& t = (*b)[i];
        if (t.dtype != fusekit::DType::f32 || t.device.is_cuda() || !t.is_contiguous() || t.numel() != first[i].numel())
          return "host gradient average: bucket " + std::to_string(i) +
                 " must be contiguous float32 host memory of the same size on every rank";
      }
    }
    std::vector<float*> data(buckets_.size());
    for (std::size_t i = 0; i < first.size(); ++i) {
      for (std::size_t r = 0; r < buckets_.size(); ++r) data[r] = (*buckets_[r])[i].data_as<float>();
      const std::int64_t n = first[i].numel();
      for (std::int64_t k = 0; k < n; ++k) {
        double sum = 0.0;
        for (float* d : data) sum += static_cast<double>(d[k]);
        const auto mean = static_cast<float>(sum / static_cast<double>(ranks_));
        for (float* d : data) d[k] = mean;
      }
    }
    return {};
  }

  int ranks_;
  std::mutex mutex_;
  std::condition_variable all_done_;
  std::vector<const std::vector<fusekit::TensorView>*> buckets_;
  int arrived_ = 0;
  std::uint64_t round_ = 0;
  std::string problem_;
};

}  // namespace

std::unique_ptr<GradientAverage> host_gradient_average(int ranks) {
  return std::make_unique<HostGradientAverage>(ranks);
}

// ---- NCCL ------------------------------------------------------------------------------------

#ifdef TRAIN_GPT_HAVE_NCCL

namespace {

void nccl_check(ncclResult_t status, const char* what) {
  if (status != ncclSuccess)
    throw std::runtime_error(std::string("NCCL error in ") + what + ": " + ncclGetErrorString(status));
}

ncclDataType_t nccl_type(fusekit::DType dtype) {
  switch (dtype) {
    case fusekit::DType::f32: return ncclFloat32;
    case fusekit::DType::bf16: return ncclBfloat16;
    case fusekit::DType::f16: return ncclFloat16;
    default: throw std::logic_error("NCCL gradient average: gradients must be float32, bfloat16 or float16");
  }
}

class NcclGradientAverage final : public GradientAverage {
 public:
  NcclGradientAverage(int ranks, int first_device) : comms_(static_cast<std::size_t>(ranks), nullptr) {
    std::vector<int> devices(static_cast<std::size_t>(ranks));
    for (int r = 0; r < ranks; ++r) devices[static_cast<std::size_t>(r)] = first_device + r;
    // ncclCommInitAll visits every GPU: the calling thread's current device is put back after.
    int current = 0;
    if (cudaGetDevice(&current) != cudaSuccess) throw std::runtime_error("cudaGetDevice failed before ncclCommInitAll");
    const ncclResult_t status = ncclCommInitAll(comms_.data(), ranks, devices.data());
    (void)cudaSetDevice(current);
    nccl_check(status, "ncclCommInitAll");
  }

  // Communicators that release() did not see (a run that failed while starting) are aborted:
  // ncclCommAbort is local to its rank, where ncclCommDestroy would wait for the others.
  ~NcclGradientAverage() override {
    for (ncclComm_t c : comms_)
      if (c) (void)ncclCommAbort(c);
  }

  void run(int rank, const std::vector<fusekit::TensorView>& buckets, fusekit::Stream stream) override {
    ncclComm_t comm = comms_.at(static_cast<std::size_t>(rank));
    std::vector<ncclDataType_t> types;
    for (const fusekit::TensorView& b : buckets) types.push_back(nccl_type(b.dtype));
    // One group: NCCL launches the buckets' all-reduces together.
    nccl_check(ncclGroupStart(), "ncclGroupStart");
    ncclResult_t status = ncclSuccess;
    for (std::size_t i = 0; i < buckets.size() && status == ncclSuccess; ++i)
      status = ncclAllReduce(buckets[i].data, buckets[i].data, static_cast<std::size_t>(buckets[i].numel()), types[i],
                             ncclAvg, comm, static_cast<cudaStream_t>(stream));
    const ncclResult_t end = ncclGroupEnd();
    nccl_check(status, "ncclAllReduce");
    nccl_check(end, "ncclGroupEnd");
  }

  void release(int rank) override {
    ncclComm_t& comm = comms_.at(static_cast<std::size_t>(rank));
    if (!comm) return;
    const ncclResult_t status = ncclCommDestroy(comm);
    comm = nullptr;
    nccl_check(status, "ncclCommDestroy");
  }

  std::string describe() const override {
    return "the gradients averaged by NCCL " + nccl_version() + " (ncclAllReduce, ncclAvg, one call per dtype)";
  }

 private:
  std::vector<ncclComm_t> comms_;
};

}  // namespace

std::unique_ptr<GradientAverage> nccl_gradient_average(int ranks, int first_device) {
  return std::make_unique<NcclGradientAverage>(ranks, first_device);
}

std::string nccl_version() {
  int code = 0;
  if (ncclGetVersion(&code) != ncclSuccess) return "(unknown version)";
  // Since NCCL 2.9 the code is major * 10000 + minor * 100 + patch.
  return std::to_string(code / 10000) + "." + std::to_string(code / 100 % 100) + "." + std::to_string(code % 100);
}

#else

std::unique_ptr<GradientAverage> nccl_gradient_average(int ranks, int) {
  throw std::runtime_error("--gpus " + std::to_string(ranks) +
                           ": this train_gpt was built without NCCL (CMake found no nccl.h and libnccl.so.2 at build "
                           "time; see apps/train_gpt/README.md, \"Data-parallel training\"), so it trains on one GPU "
                           "only");
}

std::string nccl_version() { return {}; }

#endif

}  // namespace train_gpt
