// The fused Hopper forward GEMM (CUTLASS 3 collective builder, sm90): y = act(x W^T + bias), and
// optionally pre = x W^T + bias, in one kernel. Host-side interface; the kernels live in
// linear_cutlass_sm90.cuh, instantiated once per dtype in linear_cutlass_{bf16,f16}.cu.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusekit/activation.h"
#include "fusekit/tensor.h"

namespace fusekit::linear::sm90 {

struct FusedForwardArgs {
  int m = 0, n = 0, k = 0;
  const void* x = nullptr;  // (m, k) row-major
  std::int64_t ldx = 0;
  const void* w = nullptr;  // (n, k) row-major
  std::int64_t ldw = 0;
  const void* bias = nullptr;  // (n) or null
  void* y = nullptr;           // (m, n) row-major
  std::int64_t ldy = 0;
  void* pre = nullptr;  // (m, n) row-major or null
  std::int64_t ldpre = 0;
  Activation activation = Activation::none;
  int device_index = 0;
  int sm_count = 0;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

// Elements every row stride, K and N must be a multiple of (TMA: 16-byte strides).
inline constexpr std::int64_t kFusedAlignmentElements = 8;

// Launches the fused kernel. Throws fusekit::Error (op `op`) when CUTLASS rejects the problem or
// the launch fails; the caller has checked the alignment rules already.
void fused_forward_bf16(const char* op, const FusedForwardArgs& a, void* stream);
void fused_forward_f16(const char* op, const FusedForwardArgs& a, void* stream);

}  // namespace fusekit::linear::sm90
