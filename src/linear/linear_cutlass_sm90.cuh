// The fused forward GEMM for Hopper, built from CUTLASS 3 collectives:
//   mainloop: TMA loads, wgmma, warp-specialized ping-pong (a producer warp group feeds two
//             consumer warp groups that take turns: while one runs its tile's math the other runs
//             the previous tile's epilogue, so an epilogue with erf/exp is hidden behind math);
//   epilogue: the stock per-column-bias + activation (+ aux store) fusion of CUTLASS's epilogue
//             visitor tree, with fusekit's own activation functor (core/activation.h, the one
//             definition every op shares) chosen at run time.
//
// Why a run-time activation: the activation only changes a few instructions of the epilogue, and
// every template instantiation of a Hopper GEMM costs minutes of compile time. One kernel per
// (dtype, pre-activation stored or not) = 4 instantiations serve all six activations. The switch
// sits outside the per-fragment loop and is uniform across the CTA, so it costs a branch per
// fragment, not per element.
//
// Layouts: x (M, K) row-major is A, K-major; W (N, K) row-major is B (K x N column-major),
// K-major; y and pre (M, N) row-major. Bias is indexed by the column n of y ("per-column bias").
#pragma once

#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.h>

#include <string>
#include <type_traits>

#include "core/activation.h"
#include "fusekit/error.h"
#include "linear/linear_cutlass.h"

namespace fusekit::linear::sm90 {

// The epilogue's result is stored in the 16-bit output dtype only (the pre-activation is stored
// before it): gelu_erf through the degree-5 erfc fit.
inline constexpr detail::GeluErfMath kEpilogueGeluErf = detail::GeluErfMath::fit_16bit;

// fusekit's activation as a CUTLASS epilogue functor. CUTLASS's Sm90Compute node passes a
// functor's `Arguments` (here: which activation) as the last call argument.
template <typename T>
struct EpilogueActivation {
  static constexpr bool kIsHeavy = true;
  struct Arguments {
    int activation = static_cast<int>(Activation::none);
  };
  CUTLASS_HOST_DEVICE T operator()(T const& value, Arguments const& args) const {
    return detail::ActivationMath<T, kEpilogueGeluErf>::forward(static_cast<Activation>(args.activation), value, T(0));
  }
};

template <typename T, int N>
struct EpilogueActivation<cutlass::Array<T, N>> {
  static constexpr bool kIsHeavy = true;
  using Arguments = typename EpilogueActivation<T>::Arguments;

  template <Activation A>
  CUTLASS_DEVICE static cutlass::Array<T, N> apply(cutlass::Array<T, N> const& values) {
    cutlass::Array<T, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = detail::ActivationMath<T, kEpilogueGeluErf>::forward(A, values[i], T(0));
    return out;
  }

  CUTLASS_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& values,
                                                 Arguments const& args) const {
    switch (static_cast<Activation>(args.activation)) {
      case Activation::relu: return apply<Activation::relu>(values);
      case Activation::gelu_erf: return apply<Activation::gelu_erf>(values);
      case Activation::gelu_tanh: return apply<Activation::gelu_tanh>(values);
      case Activation::squared_relu: return apply<Activation::squared_relu>(values);
      case Activation::silu: return apply<Activation::silu>(values);
      default: return values;  // none (leaky_relu is refused before any kernel runs)
    }
  }
};

// Whether the kernel also stores the pre-activation (x W^T + bias) as CUTLASS's aux output.
enum class PreActivation { skip, store };

template <typename Element, PreActivation kPre>
struct FusedGemm {
  using Accumulator = float;
  using Compute = float;
  static constexpr int kAlignment = static_cast<int>(kFusedAlignmentElements);
  static_assert(kAlignment * sizeof(Element) == 16, "TMA needs 16-byte aligned rows");

  // 128x128x64 tiles per consumer warp group, clusters of 2 along M sharing (multicasting) the
  // W tile. A common high-throughput bf16 configuration for ping-pong on H100.
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;

  using FusionOp = std::conditional_t<
      kPre == PreActivation::store,
      cutlass::epilogue::fusion::LinCombPerColBiasEltActAux<
          cutlass::layout::RowMajor, EpilogueActivation, Element, Compute, /*aux*/ Element,
          /*bias*/ Element, /*source*/ void, /*scalar*/ Compute>,
      cutlass::epilogue::fusion::LinCombPerColBiasEltAct<
          EpilogueActivation, Element, Compute, /*bias*/ Element, /*source*/ void, /*scalar*/ Compute>>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, Accumulator, Compute,
      /*C*/ void, cutlass::layout::RowMajor, kAlignment,
      /*D*/ Element, cutlass::layout::RowMajor, kAlignment, EpilogueSchedule,
      FusionOp>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, cutlass::layout::RowMajor, kAlignment,     // x
      Element, cutlass::layout::ColumnMajor, kAlignment,  // W
      Accumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>,
                                                      CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

inline const char* cutlass_status_name(cutlass::Status s) { return cutlassGetStatusString(s); }

inline constexpr auto kRaster = cutlass::gemm::kernel::detail::RasterOrderOptions::AlongN;

template <typename Element, PreActivation kPre>
void run_fused(const char* op, const FusedForwardArgs& a, void* stream) {
  using G = FusedGemm<Element, kPre>;
  using Gemm = typename G::Gemm;
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideC = typename Gemm::GemmKernel::StrideC;
  using StrideD = typename Gemm::GemmKernel::StrideD;

  // Strides (row stride, 1, batch stride); the batch mode has extent 1.
  StrideA stride_x{a.ldx, cute::Int<1>{}, a.ldx * a.m};
  StrideB stride_w{a.ldw, cute::Int<1>{}, a.ldw * a.n};
  StrideD stride_y{a.ldy, cute::Int<1>{}, a.ldy * a.m};
  StrideC stride_c = stride_y;  // unused: no source matrix

  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {a.m, a.n, a.k, 1};
  args.mainloop.ptr_A = static_cast<const Element*>(a.x);
  args.mainloop.dA = stride_x;
  args.mainloop.ptr_B = static_cast<const Element*>(a.w);
  args.mainloop.dB = stride_w;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = stride_c;
  args.epilogue.ptr_D = static_cast<Element*>(a.y);
  args.epilogue.dD = stride_y;
  auto& fusion = args.epilogue.thread;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  fusion.bias_ptr = static_cast<const Element*>(a.bias);  // null: bias of zeros
  fusion.activation.activation = static_cast<int>(a.activation);
  if constexpr (kPre == PreActivation::store) {
    fusion.aux_ptr = static_cast<Element*>(a.pre);
    fusion.dAux = {a.ldpre, cute::Int<1>{}, a.ldpre * a.m};
  }
  args.hw_info.device_id = a.device_index;
  args.hw_info.sm_count = a.sm_count;
  args.scheduler.max_swizzle_size = kSwizzle;
  args.scheduler.raster_order = kRaster;

  Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess)
    throw Error(ErrorKind::unsupported, op,
                std::string("the fused CUTLASS GEMM rejected the problem: ") + cutlass_status_name(status));
  const std::size_t need = Gemm::get_workspace_size(args);
  if (need > a.workspace_bytes)
    throw Error(ErrorKind::invalid_argument, op, "workspace",
                "at least " + std::to_string(need) + " bytes for the fused GEMM",
                std::to_string(a.workspace_bytes) + " bytes");
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  status = gemm.initialize(args, a.workspace, cuda_stream);
  if (status != cutlass::Status::kSuccess)
    throw Error(ErrorKind::cuda, op,
                std::string("fused CUTLASS GEMM initialization failed: ") + cutlass_status_name(status));
  status = gemm.run(cuda_stream);
  if (status != cutlass::Status::kSuccess) {
    const cudaError_t launch = cudaGetLastError();
    throw Error(ErrorKind::cuda, op,
                std::string("fused CUTLASS GEMM launch failed: ") + cutlass_status_name(status) +
                    " (" + cudaGetErrorString(launch) + ")");
  }
}

template <typename Element>
void fused_forward(const char* op, const FusedForwardArgs& a, void* stream) {
  if (a.pre) run_fused<Element, PreActivation::store>(op, a, stream);
  else run_fused<Element, PreActivation::skip>(op, a, stream);
}

}  // namespace fusekit::linear::sm90
