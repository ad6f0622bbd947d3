// Host-side helpers of the Hopper attention launchers (attention_sm90_forward.cu,
// attention_sm90_backward.cu): TMA tensors over the caller's views, and the launch itself.
// Internal to the CUDA backend.
#pragma once

#include <cstdint>
#include <string>

#include "attention/attention_config.h"
#include "attention/attention_params.h"
#include "attention/attention_sm90_kernels.cuh"
#include "core/cuda_check.h"
#include "core/launch_tuning.h"
#include "fusekit/error.h"

namespace fusekit::attention::sm90::launch_detail {

template <typename Traits>
typename Traits::GmemTensor gmem_tensor(const Operand& op, std::int64_t tokens, std::int64_t heads,
                                        std::int64_t batch, bool varlen) {
  using namespace cute;
  using E = typename Traits::Element;
  // A dim of extent 1 is never stepped, and its stride may be anything the caller's view had (the
  // argument checks skip it), but TMA wants every stride a non-zero multiple of 16 bytes: such a
  // dim gets the row length (kD elements) instead. With variable lengths the batch extent is 1.
  auto stride_of = [](std::int64_t extent, std::int64_t stride) { return extent > 1 ? stride : std::int64_t{Traits::kD}; };
  return make_tensor(make_gmem_ptr(static_cast<const E*>(op.data)),
                     make_layout(make_shape(static_cast<std::int32_t>(tokens), static_cast<std::int32_t>(Traits::kD),
                                            static_cast<std::int32_t>(heads), static_cast<std::int32_t>(batch)),
                                 make_stride(stride_of(tokens, op.s_stride), _1{}, stride_of(heads, op.h_stride),
                                             stride_of(batch, varlen ? 0 : op.b_stride))));
}

// q, k and v as (token, d, head, batch) TMA tensors.
template <typename Traits>
struct QkvTensors {
  typename Traits::GmemTensor q, k, v;
};
template <typename Traits>
QkvTensors<Traits> qkv_tensors(const Problem& p) {
  const TmaExtents x = tma_extents(p);
  return {gmem_tensor<Traits>(p.q, x.tokens_q, p.heads_q, x.batch, p.varlen),
          gmem_tensor<Traits>(p.k, x.tokens_k, p.heads_kv, x.batch, p.varlen),
          gmem_tensor<Traits>(p.v, x.tokens_k, p.heads_kv, x.batch, p.varlen)};
}

// Launches `kernel` with `smem` bytes of dynamic shared memory (more than the default 48 KB: the
// kernel is opted in first, and the GPU must have it).
template <typename Kernel, typename Params>
void launch_kernel(const char* op, const char* what, Kernel kernel, dim3 grid, int threads, int smem, const Params& P,
                   int device_index, cudaStream_t stream) {
  detail::allow_dynamic_smem(op, kernel, static_cast<std::size_t>(smem), device_index, std::string("the ") + what);
  kernel<<<grid, threads, smem, stream>>>(P);
  detail::check_launch(op, what);
}

// The bias (or dbias) as a (query, key, head, batch) TMA tensor: a dimension the view broadcasts
// (stride 0) gets extent 1 and a valid TMA stride (the padded key row) and is always read at 0
// (BiasCoords). Only views bias_on_tma accepts come here.
template <typename Element>
auto bias_tensor(const BiasOperand& b, Element* data) {
  using namespace cute;
  const std::int64_t keys = b.shape[3], row = (keys + 7) / 8 * 8;
  auto extent = [](std::int64_t n, std::int64_t stride) { return static_cast<std::int32_t>(stride > 0 ? n : 1); };
  auto step = [&](std::int64_t stride) { return stride > 0 ? stride : row; };
  return make_tensor(make_gmem_ptr(data),
                     make_layout(make_shape(extent(b.shape[2], b.i_stride), static_cast<std::int32_t>(keys),
                                            extent(b.shape[1], b.h_stride), extent(b.shape[0], b.b_stride)),
                                 make_stride(step(b.i_stride), _1{}, step(b.h_stride), step(b.b_stride))));
}

inline BiasCoords bias_coords(const BiasOperand& b) { return {b.h_stride > 0 ? 1 : 0, b.b_stride > 0 ? 1 : 0}; }

// Calls f(Traits<T, D>{}) for the call's dtype (f16 or bf16) and head dim (64 or 128): the
// instantiations the Hopper kernels have.
template <template <typename, int> class Traits, typename F>
void with_traits(const Problem& p, F&& f) {
  const bool bf16 = p.dtype == DType::bf16;
  if (p.head_dim == 64) {
    if (bf16) f(Traits<__nv_bfloat16, 64>{});
    else f(Traits<__half, 64>{});
  } else {
    if (bf16) f(Traits<__nv_bfloat16, 128>{});
    else f(Traits<__half, 128>{});
  }
}

}  // namespace fusekit::attention::sm90::launch_detail
