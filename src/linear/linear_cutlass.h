// The fused Hopper forward GEMM (CUTLASS 3 collective builder, sm90): y = act(x W^T + bias), and
// optionally pre = x W^T + bias, in one kernel. Host-side interface; the kernels live in
// linear_cutlass_sm90.cuh, instantiated once per dtype in linear_cutlass_{bf16,f16}.cu.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusekit/activation.h"
#include "fusekit/tensor.h"
#include "linear/linear_params.h"

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

// Tile order of the persistent scheduler. Consecutive tiles are grouped in strips kSwizzle tiles
// wide so that the x and W tiles one wave of CTAs reads stay in L2: without it, a wave over
// 8192 x 16384 with K = 4096 streams all of x from DRAM per column pair. Strips 2 tiles wide,
// rastered along N, are within +-2.5% of the plain cuBLAS GEMM at every linear benchmark shape,
// where CUTLASS's heuristic raster with strips of 8 was 13-15% slower at (8191, 4096, 12296)
// (bench: linear fwd gelu_tanh, H200).
inline constexpr int kSwizzle = 2;

// The kernel arguments of a forward call (its sizes checked to fit int by the entry point).
FusedForwardArgs fused_forward_args(const ForwardParams& p, int device_index);

// Launches the fused kernel. Throws fusekit::Error (op `op`) when CUTLASS rejects the problem or
// the launch fails; the caller has checked the alignment rules already.
void fused_forward_bf16(const char* op, const FusedForwardArgs& a, void* stream);
void fused_forward_f16(const char* op, const FusedForwardArgs& a, void* stream);

// The gated forward (linear_gated_sm90.cuh): y = act(gate) * up and optionally pre = x W^T + bias
// for W's rows interleaved (gate j at 2j, up j at 2j + 1): n = 2F, a multiple of 8, and y has n / 2
// columns; activation is the gate's.
void gated_forward_bf16(const char* op, const FusedForwardArgs& a, void* stream);
void gated_forward_f16(const char* op, const FusedForwardArgs& a, void* stream);

// The backward's dx GEMM with dz = dout * act'(pre) formed inside it (linear_dgrad_sm90.cuh):
// dx = dz W, and dz (and dbias's partial rows) written on the way for the dW GEMM. Rows below
// first_row must already hold dz (the elementwise pass); from first_row on, dz is cut into units
// of kDgradUnitRows rows x kDgradSliceCols columns, one flag each.
inline constexpr int kDgradUnitRows = 64;
inline constexpr int kDgradSliceCols = 256;

struct DgradFormingArgs {
  int m = 0, n = 0, k = 0;
  const void* dout = nullptr;  // (m, n) row-major
  std::int64_t lddout = 0;
  const void* pre = nullptr;  // (m, n) row-major
  std::int64_t ldpre = 0;
  void* dz = nullptr;  // (m, n) row-major, written from first_row on
  std::int64_t lddz = 0;
  const void* w = nullptr;  // (n, k) row-major
  std::int64_t ldw = 0;
  void* dx = nullptr;  // (m, k) row-major
  std::int64_t lddx = 0;
  float* partial = nullptr;  // null, or one float row of n per unit row group (dbias)
  unsigned* flags = nullptr;  // `units` flags, zeroed before the call
  int* counter = nullptr;     // zeroed before the call
  int first_row = 0;          // a multiple of 128
  int slices = 0;             // ceil(n / kDgradSliceCols)
  int units = 0;              // ceil((m - first_row) / kDgradUnitRows) * slices
  Activation activation = Activation::none;
  // dout is a gated backward's dy (n / 2 columns) and dz its gated backward, interleaved pairs.
  bool gated = false;
  int device_index = 0;
  int sm_count = 0;
};

void dgrad_forming_bf16(const char* op, const DgradFormingArgs& a, void* stream);
void dgrad_forming_f16(const char* op, const DgradFormingArgs& a, void* stream);

}  // namespace fusekit::linear::sm90
