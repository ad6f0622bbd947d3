// The validated, backend-neutral description of one gated-activation call. The public entry points
// (gated_act.cpp) check the arguments and fill these; each backend reads them.
//
// Both input forms reduce to one of two row layouts: two planes (gate and up each at a pointer
// with a row stride: two tensors, or the halves of one tensor with up = gate + F), or one
// interleaved tensor (gate j at column 2j, up j at 2j + 1).
#pragma once

#include <cstdint>

#include "fusekit/activation.h"
#include "fusekit/tensor.h"

namespace fusekit::gated_act {

// Where a row's gate and up values (or their gradients) are. Planes: `gate` and `up`, each with its
// row stride. Interleaved: the one tensor at `gate` (row stride gate_row_stride); `up` unused.
template <typename Ptr>
struct GateUp {
  Ptr gate = nullptr;
  Ptr up = nullptr;
  std::int64_t gate_row_stride = 0, up_row_stride = 0;
};

struct ForwardParams {
  std::int64_t rows = 0, cols = 0;  // M, F
  DType dtype = DType::bf16;
  Activation activation = Activation::silu;
  bool interleaved = false;
  GateUp<const void*> in;
  void* y = nullptr;
  std::int64_t y_row_stride = 0;
};

struct BackwardParams {
  std::int64_t rows = 0, cols = 0;
  DType dtype = DType::bf16;
  Activation activation = Activation::silu;
  bool interleaved = false;
  const void* dy = nullptr;
  std::int64_t dy_row_stride = 0;
  GateUp<const void*> in;
  // dgate and dup (planes: either may be null, not computed; interleaved: dgate_up at `gate`).
  // Each may be exactly its input's view (in-place backward).
  GateUp<void*> grad;
};

void forward_cpu(const ForwardParams& p);
void backward_cpu(const BackwardParams& p);

// `op` names the public entry point in errors.
void forward_cuda(const char* op, const ForwardParams& p, int device_index, Stream stream);
void backward_cuda(const char* op, const BackwardParams& p, int device_index, Stream stream);

}  // namespace fusekit::gated_act
