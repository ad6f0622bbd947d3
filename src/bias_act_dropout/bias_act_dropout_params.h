// The validated, backend-neutral description of one bias + activation + dropout call. The public
// entry points (dropout.cpp) check the arguments and fill these; each backend reads them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusekit/activation.h"
#include "fusekit/philox.h"  // FUSEKIT_HOST_DEVICE
#include "fusekit/tensor.h"

namespace fusekit::bias_act_dropout {

inline constexpr int kPhiloxRounds = 10;

// The op's scalars, shared by forward and backward.
struct Scalars {
  Activation activation = Activation::none;
  float slope = 0.0f;
  float p = 0.0f;
  std::uint32_t keep_threshold = 0;       // dropout_keep_threshold(p), 0..65535
  std::uint32_t keep_threshold2 = 0;      // keep_threshold in both 16-bit halves (packed compares)
  float scale = 1.0f;                     // 1 / (1 - p) in float32 (the kernels' value)
  float keep = 1.0f;                      // 1 - p in float32
  std::uint64_t seed = 0, offset = 0;
  // Philox4x32-10's key schedule for `seed`, computed once on the host: round i uses
  // (key0[i], key1[i]). Kernels read it from the parameter bank instead of re-deriving 20 keys
  // per call in registers.
  std::uint32_t key0[kPhiloxRounds] = {}, key1[kPhiloxRounds] = {};

  // p > 0 exactly when the threshold is above 0 (ceil(p * 2^16) >= 1).
  FUSEKIT_HOST_DEVICE bool dropout() const { return keep_threshold != 0; }

  void set_seed(std::uint64_t new_seed) {
    seed = new_seed;
    std::uint32_t k0 = static_cast<std::uint32_t>(seed), k1 = static_cast<std::uint32_t>(seed >> 32);
    for (int i = 0; i < kPhiloxRounds; ++i) {
      key0[i] = k0;
      key1[i] = k1;
      k0 += philox::kWeyl0;
      k1 += philox::kWeyl1;
    }
  }

  // philox::random4(seed, offset, n) from the precomputed key schedule (same rounds, same bits).
  FUSEKIT_HOST_DEVICE philox::Words4 random4(std::uint64_t n) const {
    philox::Words4 c{static_cast<std::uint32_t>(n), static_cast<std::uint32_t>(n >> 32),
                     static_cast<std::uint32_t>(offset), static_cast<std::uint32_t>(offset >> 32)};
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int i = 0; i < kPhiloxRounds; ++i) c = philox::round(c, key0[i], key1[i]);
    return c;
  }
};

struct ForwardParams {
  Scalars s;
  std::int64_t rows = 0, cols = 0;
  DType dtype = DType::f32;       // x, y, pre_activation
  DType bias_dtype = DType::f32;  // x's dtype or f32
  const void* x = nullptr;
  std::int64_t x_row_stride = 0;
  const void* bias = nullptr;     // may be null: no bias
  void* y = nullptr;
  std::int64_t y_row_stride = 0;
  void* pre_activation = nullptr; // may be null: not kept
  std::int64_t pre_activation_row_stride = 0;
};

struct BackwardParams {
  Scalars s;
  std::int64_t rows = 0, cols = 0;
  DType dtype = DType::f32;        // dy, x, dx
  DType bias_dtype = DType::f32;   // bias: x's dtype or f32
  DType dbias_dtype = DType::f32;  // dbias: x's dtype or f32
  const void* dy = nullptr;
  std::int64_t dy_row_stride = 0;
  const void* x = nullptr;  // x, or the kept pre-activation (then bias is null)
  std::int64_t x_row_stride = 0;
  const void* bias = nullptr;
  void* dx = nullptr;  // each output may be null: not computed
  std::int64_t dx_row_stride = 0;
  void* dbias = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

void forward_cpu(const ForwardParams& p);
void backward_cpu(const BackwardParams& p);

void forward_cuda(const ForwardParams& p, int device_index, Stream stream);
void backward_cuda(const BackwardParams& p, int device_index, Stream stream);
std::size_t backward_workspace_cuda(std::int64_t rows, std::int64_t cols, DType dtype,
                                    int device_index);

}  // namespace fusekit::bias_act_dropout
