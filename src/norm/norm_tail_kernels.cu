// The row kernels' tail variants (norm_tail_kernels.h): every ForwardRows::any forward variant and
// every backward variant with a tail twin (has_tail_twin), for each (element, weight) type pair.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <utility>

#include "norm/norm_kernels.cuh"
#include "norm/norm_tail_kernels.h"

namespace fusekit::norm {
namespace {

template <typename T, typename W, bool RESIDUAL>
ForwardKernel forward_tail_iters(int vectors_per_thread) {
  using kernels::forward_registers_kernel;
  switch (vectors_per_thread) {
    case 1: return forward_registers_kernel<T, W, 1, ForwardRows::any, RESIDUAL, true>;
    case 2: return forward_registers_kernel<T, W, 2, ForwardRows::any, RESIDUAL, true>;
    case 3: return forward_registers_kernel<T, W, 3, ForwardRows::any, RESIDUAL, true>;
    default: return forward_registers_kernel<T, W, 4, ForwardRows::any, RESIDUAL, true>;
  }
}

constexpr BackwardVariant with_tail(BackwardVariant v) {
  v.tail = true;
  return v;
}

// Listed variant I's tail twin where it has one and it is `v`; compiles only the twins.
template <typename T, typename W, std::size_t I>
BackwardKernel tail_kernel_at(const BackwardVariant& v) {
  constexpr BackwardVariant listed = kBackwardVariants[I];
  if constexpr (has_tail_twin(listed)) {
    constexpr BackwardVariant tail = with_tail(listed);
    if (tail == v) return kernels::backward_streaming_kernel<T, W, tail.pack()>;
  }
  return nullptr;
}

template <typename T, typename W, std::size_t... I>
BackwardKernel find_backward_tail_kernel(const BackwardVariant& v, std::index_sequence<I...>) {
  BackwardKernel kernel = nullptr;
  ((kernel = kernel ? kernel : tail_kernel_at<T, W, I>(v)), ...);
  return kernel;
}

}  // namespace

template <typename T, typename W>
ForwardKernel forward_tail_kernel(const ForwardVariant& v) {
  return v.residual ? forward_tail_iters<T, W, true>(v.vectors_per_thread)
                    : forward_tail_iters<T, W, false>(v.vectors_per_thread);
}

template <typename T, typename W>
BackwardKernel backward_tail_kernel(const BackwardVariant& v) {
  constexpr std::size_t kCount = sizeof(kBackwardVariants) / sizeof(kBackwardVariants[0]);
  return find_backward_tail_kernel<T, W>(v, std::make_index_sequence<kCount>{});
}

#define FUSEKIT_NORM_TAIL_KERNELS(T, W)                                         \
  template ForwardKernel forward_tail_kernel<T, W>(const ForwardVariant&); \
  template BackwardKernel backward_tail_kernel<T, W>(const BackwardVariant&);
FUSEKIT_NORM_TAIL_KERNELS(float, float)
FUSEKIT_NORM_TAIL_KERNELS(__half, __half)
FUSEKIT_NORM_TAIL_KERNELS(__half, float)
FUSEKIT_NORM_TAIL_KERNELS(__nv_bfloat16, __nv_bfloat16)
FUSEKIT_NORM_TAIL_KERNELS(__nv_bfloat16, float)
#undef FUSEKIT_NORM_TAIL_KERNELS

}  // namespace fusekit::norm
