// The validated, backend-neutral description of one embedding call. The public entry points
// (embedding.cpp) check the arguments and fill these; each backend reads them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusekit/tensor.h"

namespace fusekit::embedding {

struct ForwardParams {
  std::int64_t tokens = 0;      // N
  std::int64_t positions = 0;   // T, tokens' last dimension
  std::int64_t vocab = 0;       // V
  std::int64_t dim = 0;         // C
  DType dtype = DType::f32;     // weight, position_weight, out
  DType token_dtype = DType::i64;
  const void* token_ids = nullptr;
  const void* weight = nullptr;
  std::int64_t weight_row_stride = 0;
  const void* position_weight = nullptr;  // null: no position embeddings
  std::int64_t position_row_stride = 0;
  void* out = nullptr;
  std::int64_t out_row_stride = 0;
};

struct BackwardParams {
  std::int64_t tokens = 0;      // N
  std::int64_t positions = 0;   // T
  std::int64_t vocab = 0;       // V
  std::int64_t dim = 0;         // C
  std::int64_t position_rows = 0;  // P, dposition_weight's rows
  DType dtype = DType::f32;     // dout
  DType token_dtype = DType::i64;
  const void* dout = nullptr;
  std::int64_t dout_row_stride = 0;
  const void* token_ids = nullptr;
  void* dweight = nullptr;
  DType dweight_dtype = DType::f32;
  std::int64_t dweight_row_stride = 0;
  void* dposition_weight = nullptr;  // null: not wanted
  DType dposition_dtype = DType::f32;
  std::int64_t dposition_row_stride = 0;
  bool accumulate = false;
  void* workspace = nullptr;  // GPU only; at least backward_workspace_bytes_cuda(...)
  std::size_t workspace_bytes = 0;
};

void forward_cpu(const ForwardParams& p);
void backward_cpu(const BackwardParams& p);

void forward_cuda(const ForwardParams& p, int device_index, Stream stream);
void backward_cuda(const BackwardParams& p, int device_index, Stream stream);
// The backward's scratch bytes on `device_index` for N tokens, a vocabulary of V rows and C
// columns: the sort's keys and indices (double-buffered), the float32 partial sums of the runs
// longer than a segment window, and the radix sort's own temporary storage.
std::size_t backward_workspace_bytes_cuda(std::int64_t tokens, std::int64_t vocab, std::int64_t dim,
                                          int device_index);

}  // namespace fusekit::embedding
