// The validated, backend-neutral description of one linear_cross_entropy call, and the GPU
// workspace layout (pure arithmetic shared by the size query, the entry point and the launcher).
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusekit/cross_entropy.h"
#include "fusekit/tensor.h"

// The family's internals live in `lxent`: a namespace cannot share the public function's name.
namespace fusekit::lxent {

struct Params {
  std::int64_t tokens = 0, vocab = 0, hidden = 0;  // T, V, H
  DType dtype = DType::bf16;                       // h, weight, bias, dh
  DType target_dtype = DType::i64;
  const void* h = nullptr;
  std::int64_t ldh = 0;
  const void* weight = nullptr;
  std::int64_t ldw = 0;
  const void* bias = nullptr;  // null: no bias
  const void* targets = nullptr;
  float* loss = nullptr;  // T values (none) or one
  void* dh = nullptr;     // null: not computed
  std::int64_t lddh = 0;
  void* dweight = nullptr;  // null: not computed
  std::int64_t lddw = 0;
  DType dweight_dtype = DType::f32;
  void* dbias = nullptr;  // null: not computed
  DType dbias_dtype = DType::f32;

  std::int64_t ignore_index = -100;
  float label_smoothing = 0.0f;
  float z_loss = 0.0f;
  LossReduction reduction = LossReduction::mean;

  void* workspace = nullptr;  // GPU only
  std::size_t workspace_bytes = 0;

  bool gradients() const { return dh || dweight || dbias; }
  CrossEntropyConfig config() const { return {ignore_index, label_smoothing, z_loss, reduction}; }
};

// ---- the GPU workspace -----------------------------------------------------------------------
//
// [cuBLASLt scratch][gradient scale][row losses][chunk logits][dW f32 accumulator][db accumulator]
// Every part starts on a 256-byte boundary.

inline constexpr std::size_t kAlignment = 256;
inline constexpr std::size_t kCublasLtBytes = std::size_t(32) << 20;  // linear::lt::kWorkspaceBytes

inline std::size_t aligned(std::size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

// The chunk's row stride: V rounded up to 8 elements, so that every row starts 16-byte aligned
// (the GEMMs' and the cross-entropy kernel's vector accesses).
inline std::int64_t chunk_row_stride(std::int64_t vocab) { return (vocab + 7) / 8 * 8; }

struct Layout {
  std::size_t cublaslt = 0, scale = 0, row_losses = 0, logits = 0, dweight_acc = 0, dbias_acc = 0;
  std::size_t total = 0;
};

// Offsets of each part for a chunk of `chunk` rows (0 where a part is absent: its size is 0).
inline Layout workspace_layout(std::int64_t tokens, std::int64_t vocab, std::int64_t hidden,
                               std::int64_t chunk, DType dtype, DType dweight_dtype, bool has_bias,
                               LossReduction reduction) {
  Layout l;
  std::size_t at = 0;
  auto take = [&at](std::size_t bytes) {
    const std::size_t offset = at;
    at += aligned(bytes);
    return offset;
  };
  const auto V = static_cast<std::size_t>(vocab), H = static_cast<std::size_t>(hidden);
  l.cublaslt = take(kCublasLtBytes);
  l.scale = take(sizeof(float));
  l.row_losses = take(reduction == LossReduction::none ? 0 : static_cast<std::size_t>(tokens) * sizeof(float));
  l.logits = take(static_cast<std::size_t>(chunk) * static_cast<std::size_t>(chunk_row_stride(vocab)) *
                  dtype_size(dtype));
  l.dweight_acc = take(dweight_dtype == DType::f32 ? 0 : V * H * sizeof(float));
  l.dbias_acc = take(has_bias ? V * sizeof(float) : 0);
  l.total = at;
  return l;
}

void run_cpu(const Params& p);
void run_cuda(const Params& p, std::int64_t chunk, int device_index, Stream stream);

}  // namespace fusekit::lxent
