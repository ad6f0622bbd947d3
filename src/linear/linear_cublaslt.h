// cuBLASLt GEMMs for the linear family, with descriptors, layouts and the heuristic's algorithm
// cached per problem (shape, leading dimensions, dtype, epilogue, pointer alignments, device).
//
// Everything here is column-major, as cuBLASLt sees it: D (m x n) = op(A) (m x k) * op(B) (k x n).
// Row-major fusekit tensors map onto it by transposition (a row-major (R, C) matrix with row stride
// ld is a column-major (C x R) matrix with leading dimension ld); linear_cuda.cu does the mapping.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "fusekit/tensor.h"

namespace fusekit::linear::lt {

// The cuBLASLt epilogues the linear family uses (values are cublasLtEpilogue_t).
enum class Epilogue : std::uint32_t {
  none = 1,            // CUBLASLT_EPILOGUE_DEFAULT
  bias = 4,            // CUBLASLT_EPILOGUE_BIAS: D = AB + bias (bias per row of D)
  relu = 2,            // CUBLASLT_EPILOGUE_RELU
  relu_bias = 6,       // CUBLASLT_EPILOGUE_RELU_BIAS
  gelu = 32,           // CUBLASLT_EPILOGUE_GELU (tanh approximation)
  gelu_bias = 36,      // CUBLASLT_EPILOGUE_GELU_BIAS
  gelu_aux = 160,      // CUBLASLT_EPILOGUE_GELU_AUX: aux = AB (GELU input)
  gelu_aux_bias = 164, // CUBLASLT_EPILOGUE_GELU_AUX_BIAS: aux = AB + bias
  dgelu = 192,         // CUBLASLT_EPILOGUE_DGELU: D = AB * gelu'(aux)
  dgelu_bgrad = 208,   // CUBLASLT_EPILOGUE_DGELU_BGRAD: and `bias` (an output) = sums of D's rows
};

struct Gemm {
  DType dtype = DType::bf16;  // A, B, D, bias and aux
  bool trans_a = false, trans_b = false;
  std::int64_t m = 0, n = 0, k = 0;
  std::int64_t lda = 0, ldb = 0, ldd = 0;
  Epilogue epilogue = Epilogue::none;
  // D in float32 (A and B stay in `dtype`): linear_cross_entropy's dW accumulator.
  bool d_f32 = false;
  // D += AB (beta = 1) instead of D = AB. Such a GEMM is never timed (a timing run would add AB
  // again): it keeps the heuristic's first choice, which is then the same on every call.
  bool accumulate = false;
  std::int64_t ld_aux = 0;  // gelu_aux*: leading dimension of aux (m x n, column-major)
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  const void* bias = nullptr;
  void* aux = nullptr;
};

// Bytes of cuBLASLt workspace the linear family hands to every GEMM (NVIDIA's recommendation for
// Hopper). It is part of linear_*_workspace_size().
inline constexpr std::size_t kWorkspaceBytes = std::size_t(32) << 20;

// With the override linear.autotune_log=on every timed candidate (GEMM algorithm or forward path)
// is printed to stderr. Whether tuning happens at all: linear::autotune_enabled() (linear_paths.h).
bool autotune_log();
// Problems of fewer floating-point operations than this (2 m n k) are not timed: at ~700 TFLOP/s a
// GEMM of 2^30 flops takes ~1.5 us, and its candidates differ by less than the timer's noise. A
// timed pick of noise would change their algorithm, and with it their rounding, from one process
// to the next; below the threshold they keep the heuristic's first choice (the forward's path
// choice too, linear_cuda.cu).
inline constexpr double kMinTimedFlops = 1073741824.0;  // 2^30

// Whether timing on `stream` is allowed now: not while a CUDA graph capture involves it (a query
// that fails counts as capturing).
bool can_time_on(void* stream);

// Times `count` candidates on `stream` taking turns (clock and temperature drift then fall on all
// of them alike): one untimed round, then five timed rounds, candidate i run by run(i). Returns
// each candidate's median in microseconds. Synchronizes with the stream once.
std::vector<float> time_in_turns(const char* op, int count, void* stream,
                                 const std::function<void(int)>& run);

// Runs the GEMM on `stream`; the first call of a problem may time cuBLASLt's candidates there
// first (synchronizing with the stream once). Returns false, launching nothing, when cuBLASLt has no algorithm for
// this combination (e.g. an epilogue with unusual alignment): the caller then takes another path.
// Throws fusekit::Error(cuda) naming `op` when a cuBLASLt call fails.
bool run(const char* op, const Gemm& g, int device_index, void* workspace, void* stream);

}  // namespace fusekit::linear::lt
