// cuBLASLt plans for the linear family: one matmul descriptor, three matrix layouts and the
// heuristic's best algorithm per distinct problem, created on first use and kept for the life of
// the process (a training run sees a handful of shapes). Nothing is allocated on the device here:
// cuBLASLt's workspace is a slice of the caller's workspace.
#include "linear/linear_cublaslt.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>

#include "fusekit/error.h"

namespace fusekit::linear::lt {
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

bool has_bias(Epilogue e) {
  return e == Epilogue::bias || e == Epilogue::relu_bias || e == Epilogue::gelu_bias ||
         e == Epilogue::gelu_aux_bias || e == Epilogue::bgradb;
}
bool has_aux(Epilogue e) { return e == Epilogue::gelu_aux || e == Epilogue::gelu_aux_bias; }

struct Key {
  int device = 0;
  DType dtype = DType::bf16;
  bool trans_a = false, trans_b = false;
  std::int64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldd = 0, ld_aux = 0;
  Epilogue epilogue = Epilogue::none;
  std::uint32_t align_a = 0, align_b = 0, align_d = 0, align_bias = 0, align_aux = 0;

  bool operator==(const Key& o) const {
    return device == o.device && dtype == o.dtype && trans_a == o.trans_a &&
           trans_b == o.trans_b && m == o.m && n == o.n && k == o.k && lda == o.lda &&
           ldb == o.ldb && ldd == o.ldd && ld_aux == o.ld_aux && epilogue == o.epilogue &&
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
    for (std::uint32_t v : {k.align_a, k.align_b, k.align_d, k.align_bias, k.align_aux}) mix(v);
    return h;
  }
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t layout_a = nullptr, layout_b = nullptr, layout_d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool has_algo = false;
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
    const std::int32_t bias_type = type;  // bias and bias gradient in the tensors' dtype
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
  check(cublasLtMatrixLayoutCreate(&plan->layout_d, type, key.m, key.n, key.ldd), op,
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
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->layout_a, plan->layout_b,
                                     plan->layout_d, plan->layout_d, pref, 1, &result, &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  // No result means no kernel for this combination: remembered, not an error; the caller takes
  // another path. An epilogue cuBLASLt does not offer for this dtype/layout may also be reported
  // as an invalid value; only a plain GEMM that cannot be planned is an error.
  if (status != CUBLAS_STATUS_SUCCESS && status != CUBLAS_STATUS_NOT_SUPPORTED &&
      key.epilogue == Epilogue::none)
    fail(op, "cublasLtMatmulAlgoGetHeuristic", status);
  if (status == CUBLAS_STATUS_SUCCESS && returned > 0 && result.state == CUBLAS_STATUS_SUCCESS &&
      result.workspaceSize <= kWorkspaceBytes) {
    plan->algo = result.algo;
    plan->has_algo = true;
  }
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
  key.ld_aux = has_aux(g.epilogue) ? g.ld_aux : 0;
  key.align_a = alignment_of(g.a);
  key.align_b = alignment_of(g.b);
  key.align_d = alignment_of(g.d);
  key.align_bias = has_bias(g.epilogue) ? alignment_of(g.bias) : 0;
  key.align_aux = has_aux(g.epilogue) ? alignment_of(g.aux) : 0;

  cublasLtHandle_t handle = handle_for(op, device_index);
  Plan& plan = plan_for(op, key, g, handle);
  if (!plan.has_algo) return false;

  const float alpha = 1.0f, beta = 0.0f;
  std::lock_guard lock(plan.in_use);
  set_pointers(op, plan, g);
  check(cublasLtMatmul(handle, plan.desc, &alpha, g.a, plan.layout_a, g.b, plan.layout_b, &beta,
                       g.d, plan.layout_d, g.d, plan.layout_d, &plan.algo, workspace,
                       kWorkspaceBytes, static_cast<cudaStream_t>(stream)),
        op, "cublasLtMatmul");
  return true;
}

}  // namespace fusekit::linear::lt
