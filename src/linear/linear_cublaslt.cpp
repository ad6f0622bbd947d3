// cuBLASLt plans for the linear family: one matmul descriptor, three matrix layouts and an
// algorithm per distinct problem, created on first use and kept for the life of the process (a
// training run sees a handful of shapes). Nothing is allocated on the device here: cuBLASLt's
// workspace is a slice of the caller's workspace.
//
// Which algorithm: cuBLASLt's heuristic ranks its candidates without running them, and its first
// choice is not always the fastest (up to 7% slower than its eighth on the dx GEMM; bench: linear
// bwd (8192, 16384, 4096), H200). So the first call of a problem times the heuristic's top
// candidates on the caller's stream, with the caller's buffers, and keeps the fastest (as cuDNN's
// benchmark mode and torch.compile's max-autotune do). Tuning is skipped while the stream is being
// captured into a CUDA graph (the first candidate runs and the problem is tuned at its next
// uncaptured call) and with the override linear.autotune=off (FUSEKIT_OVERRIDE), which keeps the
// heuristic's first choice for runs that must pick the same algorithm on every machine.
#include "linear/linear_cublaslt.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/cuda_check.h"
#include "core/overrides.h"
#include "fusekit/error.h"
#include "linear/linear_paths.h"

namespace fusekit::linear {

bool autotune_enabled() {
  return detail::override_choice<bool>("linear.autotune", {{"on", true}, {"off", false}}).value_or(true);
}

namespace lt {

// How many of the heuristic's candidates the first call of a problem times, and how often.
constexpr int kAutotuneCandidates = 8;
constexpr int kAutotuneRounds = 5;  // timed rounds after one untimed warm-up round

bool autotune_log() {
  return detail::override_choice<bool>("linear.autotune_log", {{"on", true}, {"off", false}}).value_or(false);
}

bool can_time_on(void* stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky; leave nothing behind for the caller's next check
    return false;
  }
  return capture == cudaStreamCaptureStatusNone;
}

std::vector<float> time_in_turns(const char* op, int count, void* stream,
                                 const std::function<void(int)>& run) {
  constexpr int kRounds = kAutotuneRounds;
  const auto s = static_cast<cudaStream_t>(stream);
  std::vector<cudaEvent_t> events(static_cast<std::size_t>(count) * kRounds * 2, nullptr);
  struct EventsGuard {
    std::vector<cudaEvent_t>& events;
    ~EventsGuard() {
      for (cudaEvent_t e : events)
        if (e) cudaEventDestroy(e);
    }
  } guard{events};
  for (cudaEvent_t& e : events) detail::check_cuda(cudaEventCreate(&e), op, "cudaEventCreate");
  for (int i = 0; i < count; ++i) run(i);  // warm-up: first launches, nested tuning
  for (int r = 0; r < kRounds; ++r)
    for (int i = 0; i < count; ++i) {
      const std::size_t slot = static_cast<std::size_t>(r * count + i) * 2;
      detail::check_cuda(cudaEventRecord(events[slot], s), op, "cudaEventRecord");
      run(i);
      detail::check_cuda(cudaEventRecord(events[slot + 1], s), op, "cudaEventRecord");
    }
  detail::check_cuda(cudaEventSynchronize(events.back()), op, "cudaEventSynchronize");
  std::vector<float> medians(static_cast<std::size_t>(count));
  for (int i = 0; i < count; ++i) {
    std::array<float, kRounds> ms{};
    for (int r = 0; r < kRounds; ++r) {
      const std::size_t slot = static_cast<std::size_t>(r * count + i) * 2;
      detail::check_cuda(cudaEventElapsedTime(&ms[r], events[slot], events[slot + 1]), op,
                         "cudaEventElapsedTime");
    }
    std::sort(ms.begin(), ms.end());
    medians[i] = ms[kRounds / 2] * 1e3f;
  }
  return medians;
}

namespace {

[[noreturn]] void fail(const char* op, const char* what, cublasStatus_t status) {
  throw Error(ErrorKind::cuda, op,
              std::string(what) + " failed: " + cublasLtGetStatusName(status) + " (" +
                  cublasLtGetStatusString(status) + ")");
}

void check(cublasStatus_t status, const char* op, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) fail(op, what, status);
}

cudaDataType_t cuda_type(DType d) {
  switch (d) {
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
  }
}

// The alignment cuBLASLt can rely on for a pointer: its lowest set address bit, capped at 256
// (the heuristic's default assumption; anything less must be declared or it may pick a kernel
// that faults).
std::uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  if (address == 0) return 256;
  std::uint32_t a = 1;
  while (a < 256 && (address & a) == 0) a <<= 1;
  return a;
}

bool has_bias(Epilogue e) {  // dgelu_bgrad's bias is its bias-gradient output
  return e == Epilogue::bias || e == Epilogue::relu_bias || e == Epilogue::gelu_bias ||
         e == Epilogue::gelu_aux_bias || e == Epilogue::dgelu_bgrad;
}
bool has_aux(Epilogue e) {
  return e == Epilogue::gelu_aux || e == Epilogue::gelu_aux_bias || e == Epilogue::dgelu ||
         e == Epilogue::dgelu_bgrad;
}

struct Key {
  int device = 0;
  DType dtype = DType::bf16;
  bool trans_a = false, trans_b = false;
  std::int64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldd = 0, ld_aux = 0;
  Epilogue epilogue = Epilogue::none;
  bool d_f32 = false, accumulate = false;
  std::uint32_t align_a = 0, align_b = 0, align_d = 0, align_bias = 0, align_aux = 0;

  bool operator==(const Key& o) const {
    return device == o.device && dtype == o.dtype && trans_a == o.trans_a &&
           trans_b == o.trans_b && m == o.m && n == o.n && k == o.k && lda == o.lda &&
           ldb == o.ldb && ldd == o.ldd && ld_aux == o.ld_aux && epilogue == o.epilogue &&
           d_f32 == o.d_f32 && accumulate == o.accumulate &&
           align_a == o.align_a && align_b == o.align_b && align_d == o.align_d &&
           align_bias == o.align_bias && align_aux == o.align_aux;
  }
};

struct KeyHash {
  std::size_t operator()(const Key& k) const {
    std::size_t h = 1469598103934665603ull;
    auto mix = [&h](std::uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    mix(std::uint64_t(k.device));
    mix(std::uint64_t(k.dtype));
    mix(std::uint64_t(k.trans_a) * 2 + std::uint64_t(k.trans_b));
    for (std::int64_t v : {k.m, k.n, k.k, k.lda, k.ldb, k.ldd, k.ld_aux}) mix(std::uint64_t(v));
    mix(std::uint64_t(k.epilogue));
    mix(std::uint64_t(k.d_f32) * 2 + std::uint64_t(k.accumulate));
    for (std::uint32_t v : {k.align_a, k.align_b, k.align_d, k.align_bias, k.align_aux}) mix(v);
    return h;
  }
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t layout_a = nullptr, layout_b = nullptr, layout_d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool has_algo = false;
  // The heuristic's candidates, best-ranked first, until the problem has been timed.
  std::vector<cublasLtMatmulAlgo_t> candidates;
  bool tuned = false;
  // The descriptor holds the bias/aux pointers, set per call: one call at a time per plan.
  std::mutex in_use;

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (layout_d) cublasLtMatrixLayoutDestroy(layout_d);
    if (layout_b) cublasLtMatrixLayoutDestroy(layout_b);
    if (layout_a) cublasLtMatrixLayoutDestroy(layout_a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

// One cuBLASLt handle per (host thread, device): handles are cheap host objects, and keeping
// them per thread avoids any question of sharing one between threads. Never destroyed (at most a
// few per thread; destroying at exit races the CUDA runtime's own teardown).
cublasLtHandle_t handle_for(const char* op, int device_index) {
  constexpr int kMaxDevices = 64;
  thread_local std::array<cublasLtHandle_t, kMaxDevices> handles{};
  if (device_index < 0 || device_index >= kMaxDevices)
    throw Error(ErrorKind::invalid_argument, op, "device", "a CUDA device index below 64",
                std::to_string(device_index));
  cublasLtHandle_t& h = handles[device_index];
  if (!h) check(cublasLtCreate(&h), op, "cublasLtCreate");
  return h;
}

template <typename T>
void set_desc(const char* op, cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
              const T& value) {
  check(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)), op,
        "cublasLtMatmulDescSetAttribute");
}

void set_pointers(const char* op, Plan& plan, const Gemm& g) {
  if (has_bias(g.epilogue)) set_desc(op, plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  if (has_aux(g.epilogue)) set_desc(op, plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
}

std::unique_ptr<Plan> make_plan(const char* op, const Key& key, const Gemm& g,
                                cublasLtHandle_t handle) {
  auto plan = std::make_unique<Plan>();
  const cudaDataType_t type = cuda_type(key.dtype);
  // float32 accumulation for every dtype; for f32 inputs this is plain IEEE float32 math
  // (CUBLAS_COMPUTE_32F never uses TF32; only *_FAST_TF32 would).
  check(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), op,
        "cublasLtMatmulDescCreate");
  const cublasOperation_t ta = key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = key.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  set_desc(op, plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, ta);
  set_desc(op, plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, tb);
  const auto epilogue = static_cast<cublasLtEpilogue_t>(key.epilogue);
  set_desc(op, plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
  if (has_bias(key.epilogue)) {
    const std::int32_t bias_type = type;  // bias in the tensors' dtype
    set_desc(op, plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, bias_type);
  }
  if (has_aux(key.epilogue)) set_desc(op, plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, key.ld_aux);
  set_pointers(op, *plan, g);  // the heuristic reads the pointers' alignment

  const std::uint64_t a_rows = key.trans_a ? key.k : key.m, a_cols = key.trans_a ? key.m : key.k;
  const std::uint64_t b_rows = key.trans_b ? key.n : key.k, b_cols = key.trans_b ? key.k : key.n;
  check(cublasLtMatrixLayoutCreate(&plan->layout_a, type, a_rows, a_cols, key.lda), op,
        "cublasLtMatrixLayoutCreate(A)");
  check(cublasLtMatrixLayoutCreate(&plan->layout_b, type, b_rows, b_cols, key.ldb), op,
        "cublasLtMatrixLayoutCreate(B)");
  check(cublasLtMatrixLayoutCreate(&plan->layout_d, key.d_f32 ? CUDA_R_32F : type, key.m, key.n, key.ldd), op,
        "cublasLtMatrixLayoutCreate(D)");

  cublasLtMatmulPreference_t pref = nullptr;
  check(cublasLtMatmulPreferenceCreate(&pref), op, "cublasLtMatmulPreferenceCreate");
  auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attr, auto value) {
    check(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)), op,
          "cublasLtMatmulPreferenceSetAttribute");
  };
  set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, std::uint64_t(kWorkspaceBytes));
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_a);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_b);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_d);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_d);
  std::array<cublasLtMatmulHeuristicResult_t, kAutotuneCandidates> results{};
  int returned = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      handle, plan->desc, plan->layout_a, plan->layout_b, plan->layout_d, plan->layout_d, pref,
      autotune_enabled() ? kAutotuneCandidates : 1, results.data(), &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  // No result means no kernel for this combination: remembered, not an error; the caller takes
  // another path. An epilogue cuBLASLt does not offer for this dtype/layout may also be reported
  // as an invalid value; only a plain GEMM that cannot be planned is an error.
  if (status != CUBLAS_STATUS_SUCCESS && status != CUBLAS_STATUS_NOT_SUPPORTED &&
      key.epilogue == Epilogue::none)
    fail(op, "cublasLtMatmulAlgoGetHeuristic", status);
  if (status == CUBLAS_STATUS_SUCCESS) {
    for (int i = 0; i < returned; ++i)
      if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= kWorkspaceBytes)
        plan->candidates.push_back(results[i].algo);
  }
  if (!plan->candidates.empty()) {
    plan->algo = plan->candidates.front();
    plan->has_algo = true;
  }
  const double flops = 2.0 * double(key.m) * double(key.n) * double(key.k);
  plan->tuned = plan->candidates.size() <= 1 || flops < kMinTimedFlops || key.accumulate;
  if (plan->tuned) plan->candidates.clear();
  return plan;
}

struct Cache {
  std::shared_mutex mutex;
  std::unordered_map<Key, std::unique_ptr<Plan>, KeyHash> plans;
};

Cache& cache() {
  static Cache* c = new Cache();  // never destroyed: plans outlive every caller
  return *c;
}

Plan& plan_for(const char* op, const Key& key, const Gemm& g, cublasLtHandle_t handle) {
  Cache& c = cache();
  {
    std::shared_lock lock(c.mutex);
    auto it = c.plans.find(key);
    if (it != c.plans.end()) return *it->second;
  }
  // Built outside the lock (the heuristic query takes a while); if two threads race, the first
  // insert wins and the other plan is dropped.
  std::unique_ptr<Plan> fresh = make_plan(op, key, g, handle);
  std::unique_lock lock(c.mutex);
  auto [it, inserted] = c.plans.try_emplace(key, std::move(fresh));
  return *it->second;
}

void matmul(const char* op, cublasLtHandle_t handle, const Plan& plan,
            const cublasLtMatmulAlgo_t& algo, const Gemm& g, void* workspace, cudaStream_t stream) {
  const float alpha = 1.0f, beta = g.accumulate ? 1.0f : 0.0f;
  check(cublasLtMatmul(handle, plan.desc, &alpha, g.a, plan.layout_a, g.b, plan.layout_b, &beta,
                       g.d, plan.layout_d, g.d, plan.layout_d, &algo, workspace, kWorkspaceBytes,
                       stream),
        op, "cublasLtMatmul");
}

// Times every candidate on the caller's stream and buffers (time_in_turns) and keeps the one with
// the lowest median. The GEMM writes only D (and the bias gradient or aux), never its inputs, so
// running it again is harmless: the caller's own run follows.
void autotune(const char* op, cublasLtHandle_t handle, Plan& plan, const Gemm& g, void* workspace,
              cudaStream_t stream) {
  const int count = static_cast<int>(plan.candidates.size());
  const std::vector<float> us = time_in_turns(op, count, stream, [&](int i) {
    matmul(op, handle, plan, plan.candidates[i], g, workspace, stream);
  });
  int best = 0;
  for (int i = 0; i < count; ++i) {
    if (autotune_log())
      std::fprintf(stderr, "fusekit autotune %s: m %lld n %lld k %lld epilogue %u candidate %d: %.1f us\n",
                   op, static_cast<long long>(g.m), static_cast<long long>(g.n),
                   static_cast<long long>(g.k), static_cast<unsigned>(g.epilogue), i, us[i]);
    if (us[i] < us[best]) best = i;
  }
  plan.algo = plan.candidates[best];
  plan.candidates.clear();
  plan.candidates.shrink_to_fit();
  plan.tuned = true;
}

}  // namespace

bool run(const char* op, const Gemm& g, int device_index, void* workspace, void* stream) {
  Key key;
  key.device = device_index;
  key.dtype = g.dtype;
  key.trans_a = g.trans_a;
  key.trans_b = g.trans_b;
  key.m = g.m;
  key.n = g.n;
  key.k = g.k;
  key.lda = g.lda;
  key.ldb = g.ldb;
  key.ldd = g.ldd;
  key.epilogue = g.epilogue;
  key.d_f32 = g.d_f32;
  key.accumulate = g.accumulate;
  key.ld_aux = has_aux(g.epilogue) ? g.ld_aux : 0;
  key.align_a = alignment_of(g.a);
  key.align_b = alignment_of(g.b);
  key.align_d = alignment_of(g.d);
  key.align_bias = has_bias(g.epilogue) ? alignment_of(g.bias) : 0;
  key.align_aux = has_aux(g.epilogue) ? alignment_of(g.aux) : 0;

  cublasLtHandle_t handle = handle_for(op, device_index);
  Plan& plan = plan_for(op, key, g, handle);
  if (!plan.has_algo) return false;

  const auto s = static_cast<cudaStream_t>(stream);
  std::lock_guard lock(plan.in_use);
  set_pointers(op, plan, g);
  if (!plan.tuned && autotune_enabled() && can_time_on(stream)) autotune(op, handle, plan, g, workspace, s);
  matmul(op, handle, plan, plan.algo, g, workspace, s);
  return true;
}

}  // namespace lt
}  // namespace fusekit::linear
