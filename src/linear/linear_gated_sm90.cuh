// The gated forward GEMM for Hopper: y = act(gate) * up with [gate, up] = x W^T + bias, in one
// kernel, for W's rows in the interleaved order (gate j at row 2j, up j at row 2j + 1).
//   mainloop: the same CUTLASS 3 collective as the fused linear forward (TMA, wgmma, ping-pong
//             consumer warp groups, so one tile's epilogue runs under the other's math);
//   epilogue: fusekit's own, because the output has half the GEMM's columns, which CUTLASS's
//             epilogue visitor trees cannot express. It reads the accumulators in registers.
//
// Why the interleaved order needs no shuffle of the operands: in a wgmma accumulator fragment each
// thread holds columns 2i and 2i + 1 of its rows in adjacent registers, so every gate sits beside
// its up in the same thread. A lane quad holds whole 8-column blocks, 2 columns per lane; the quad
// transposes four blocks among its lanes so that each lane stores one block whole (16 bytes of
// pre, 8 of y) instead of 4- and 2-byte pieces.
#pragma once

#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/epilogue/dispatch_policy.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.h>
#include <cutlass/numeric_conversion.h>

#include <cstdint>
#include <string>

#include "core/activation.h"
#include "fusekit/error.h"
#include "linear/linear_cutlass.h"

namespace fusekit::linear::sm90 {

// y only reaches 16-bit storage: gelu_erf through the degree-5 erfc fit (core/activation.h).
inline constexpr detail::GeluErfMath kGatedGeluErf = detail::GeluErfMath::fit_16bit;

// The epilogue collective. It follows the interface CUTLASS's register-to-global epilogues offer
// the warp-specialized kernels (wrapped in Sm90TmaWarpSpecializedAdapter): no shared memory, no
// producer loads, one call per output tile with the accumulators.
template <typename Element>
class GatedEpilogue {
 public:
  using EpilogueSchedule = cutlass::epilogue::NoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementC = Element;  // no source matrix is read
  using ElementD = Element;
  using StrideC = cute::Stride<std::int64_t, cute::Int<1>, std::int64_t>;
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  struct ThreadEpilogueOp {};  // named by the device adapter; the math is below
  struct SharedStorage {};
  using TensorStorage = SharedStorage;

  struct Arguments {
    const Element* bias = nullptr;  // (2F) or null
    Element* y = nullptr;           // (M, F)
    std::int64_t ldy = 0;
    Element* pre = nullptr;  // (M, 2F) or null
    std::int64_t ldpre = 0;
    int activation = static_cast<int>(Activation::silu);
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static std::size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem, Arguments const& args) {
    // Whole 8-column blocks, stored as 16 bytes of pre and 8 bytes of y.
    return cute::get<1>(problem) % 8 == 0 && args.ldy % 4 == 0 && args.ldpre % 8 == 0;
  }

  CUTLASS_HOST_DEVICE explicit GatedEpilogue(Params const& params, SharedStorage const& = SharedStorage())
      : params_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_mnkl, BlockShapeMNK block_shape,
                                 BlockCoordMNKL block_coord, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    switch (static_cast<Activation>(params_.activation)) {
      case Activation::gelu_tanh: return store<Activation::gelu_tanh>(problem_mnkl, block_shape, block_coord, acc, tiled_mma, thread_idx);
      case Activation::gelu_erf: return store<Activation::gelu_erf>(problem_mnkl, block_shape, block_coord, acc, tiled_mma, thread_idx);
      case Activation::relu: return store<Activation::relu>(problem_mnkl, block_shape, block_coord, acc, tiled_mma, thread_idx);
      default: return store<Activation::silu>(problem_mnkl, block_shape, block_coord, acc, tiled_mma, thread_idx);
    }
  }

 private:
  using Pair = cutlass::Array<Element, 2>;

  // A 4 x 4 transpose across a lane quad: lane q's a[i] becomes lane i's a[q]. Two exchange steps
  // (lanes 1 apart, then 2 apart), each swapping the two elements whose index differs from the
  // lane's in that bit.
  template <typename V>
  CUTLASS_DEVICE static void quad_transpose(V (&a)[4], int q) {
    const bool odd = (q & 1) != 0;
    V r0 = __shfl_xor_sync(0xffffffffu, odd ? a[0] : a[1], 1);
    V r1 = __shfl_xor_sync(0xffffffffu, odd ? a[2] : a[3], 1);
    if (odd) {
      a[0] = r0;
      a[2] = r1;
    } else {
      a[1] = r0;
      a[3] = r1;
    }
    const bool high = (q & 2) != 0;
    r0 = __shfl_xor_sync(0xffffffffu, high ? a[0] : a[2], 2);
    r1 = __shfl_xor_sync(0xffffffffu, high ? a[1] : a[3], 2);
    if (high) {
      a[0] = r0;
      a[1] = r1;
    } else {
      a[2] = r0;
      a[3] = r1;
    }
  }

  CUTLASS_DEVICE static std::uint32_t pack_pair(float a, float b) {
    cutlass::NumericArrayConverter<Element, float, 2> convert;
    cutlass::Array<float, 2> v;
    v[0] = a;
    v[1] = b;
    const Pair packed = convert(v);
    return *reinterpret_cast<const std::uint32_t*>(&packed);
  }

  template <Activation kAct, class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL,
            class FrgEngine, class FrgLayout, class TiledMma>
  CUTLASS_DEVICE void store(ProblemShapeMNKL problem_mnkl, BlockShapeMNK block_shape, BlockCoordMNKL block_coord,
                            cute::Tensor<FrgEngine, FrgLayout> const& acc, TiledMma tiled_mma, int thread_idx) {
    using namespace cute;
    using Math = detail::ActivationMath<float, kGatedGeluErf>;
    // The wgmma accumulator fragment: ((2 adjacent columns, 2 rows 8 apart, N / 8 column blocks),
    // MMA_M, MMA_N); lane q of a quad holds columns 2q, 2q + 1 of each 8-column block.
    static_assert(rank<0>(FrgLayout{}) == 3, "expected the sm90 wgmma accumulator layout");
    static_assert(size<0, 0>(FrgLayout{}) == 2 && size<0, 1>(FrgLayout{}) == 2, "expected column pairs");
    static_assert(size<0, 2>(FrgLayout{}) % 4 == 0, "expected 8-column blocks in fours");
    constexpr int kBlocks = size<0, 2>(FrgLayout{});

    const int m_total = get<0>(problem_mnkl), n_total = get<1>(problem_mnkl);
    Tensor coords = local_tile(make_identity_tensor(make_shape(m_total, n_total)), take<0, 2>(block_shape),
                               make_coord(get<0>(block_coord), get<1>(block_coord)));
    Tensor thread_coords = tiled_mma.get_thread_slice(thread_idx).partition_C(coords);
    static_assert(decltype(size(thread_coords))::value == decltype(size(acc))::value, "fragment mismatch");

    const int q = thread_idx & 3;
    const Element* bias = params_.bias;
    Element* pre = params_.pre;

    CUTLASS_PRAGMA_UNROLL
    for (int mi = 0; mi < size<1>(acc); ++mi) {
      CUTLASS_PRAGMA_UNROLL
      for (int ni = 0; ni < size<2>(acc); ++ni) {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r) {
          CUTLASS_PRAGMA_UNROLL
          for (int j0 = 0; j0 < kBlocks; j0 += 4) {
            // Four 8-column blocks of one row: per lane a (gate, up) pair in each.
            std::uint32_t pre_pairs[4];
            float out[4];
            int block_col[4];
            int row = 0;
            CUTLASS_PRAGMA_UNROLL
            for (int h = 0; h < 4; ++h) {
              const auto gate_at = make_coord(make_coord(0, r, j0 + h), mi, ni);
              const auto up_at = make_coord(make_coord(1, r, j0 + h), mi, ni);
              const auto c = thread_coords(gate_at);
              row = get<0>(c);
              const int col = get<1>(c);
              block_col[h] = col - 2 * q;
              float gate = acc(gate_at), up = acc(up_at);
              if (bias != nullptr && col < n_total) {
                const Pair b = *reinterpret_cast<const Pair*>(bias + col);
                gate += static_cast<float>(b[0]);
                up += static_cast<float>(b[1]);
              }
              pre_pairs[h] = pack_pair(gate, up);
              out[h] = Math::forward(kAct, gate, 0.0f) * up;
            }
            // Lane q takes block j0 + q whole: 8 pre columns (16 bytes) and 4 outputs (8 bytes),
            // so a quad writes 64 contiguous bytes of pre and 32 of y per row.
            if (pre != nullptr) quad_transpose(pre_pairs, q);
            quad_transpose(out, q);
            const int col = q == 0 ? block_col[0] : q == 1 ? block_col[1] : q == 2 ? block_col[2] : block_col[3];
            if (row < m_total && col < n_total) {
              if (pre != nullptr) {
                *reinterpret_cast<uint4*>(pre + row * params_.ldpre + col) =
                    make_uint4(pre_pairs[0], pre_pairs[1], pre_pairs[2], pre_pairs[3]);
              }
              *reinterpret_cast<uint2*>(params_.y + row * params_.ldy + col / 2) =
                  make_uint2(pack_pair(out[0], out[1]), pack_pair(out[2], out[3]));
            }
          }
        }
      }
    }
  }

  Params params_;
};

// The fused linear forward's tiles, cluster and schedule (linear_cutlass_sm90.cuh says why). The
// dgrad kernel's 128 x 256 cooperative tiles ran this GEMM 1.10-1.29x cuBLASLt's against 1.01-1.06x
// (bench: gated_linear fwd, H200).
struct PingpongTiles {
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
};

template <typename Element>
struct GatedGemm {
  using Tiles = PingpongTiles;
  static constexpr int kAlignment = static_cast<int>(kFusedAlignmentElements);
  using CollectiveEpilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<GatedEpilogue<Element>>;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, cutlass::layout::RowMajor, kAlignment,     // x
      Element, cutlass::layout::ColumnMajor, kAlignment,  // W
      float, typename Tiles::TileShape, typename Tiles::ClusterShape,
      cutlass::gemm::collective::StageCountAuto, typename Tiles::MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <typename Element>
void gated_forward(const char* op, const FusedForwardArgs& a, void* stream) {
  using Gemm = typename GatedGemm<Element>::Gemm;
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;

  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {a.m, a.n, a.k, 1};
  args.mainloop.ptr_A = static_cast<const Element*>(a.x);
  args.mainloop.dA = StrideA{a.ldx, cute::Int<1>{}, a.ldx * a.m};
  args.mainloop.ptr_B = static_cast<const Element*>(a.w);
  args.mainloop.dB = StrideB{a.ldw, cute::Int<1>{}, a.ldw * a.n};
  args.epilogue.bias = static_cast<const Element*>(a.bias);
  args.epilogue.y = static_cast<Element*>(a.y);
  args.epilogue.ldy = a.ldy;
  args.epilogue.pre = static_cast<Element*>(a.pre);
  args.epilogue.ldpre = a.pre ? a.ldpre : 0;
  args.epilogue.activation = static_cast<int>(a.activation);
  args.hw_info.device_id = a.device_index;
  args.hw_info.sm_count = a.sm_count;
  args.scheduler.max_swizzle_size = kSwizzle;
  args.scheduler.raster_order = cutlass::gemm::kernel::detail::RasterOrderOptions::AlongN;

  Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess)
    throw Error(ErrorKind::unsupported, op,
                std::string("the gated CUTLASS GEMM rejected the problem: ") + cutlassGetStatusString(status));
  const std::size_t need = Gemm::get_workspace_size(args);
  if (need > a.workspace_bytes)
    throw Error(ErrorKind::invalid_argument, op, "workspace",
                "at least " + std::to_string(need) + " bytes for the gated GEMM",
                std::to_string(a.workspace_bytes) + " bytes");
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  status = gemm.initialize(args, a.workspace, cuda_stream);
  if (status != cutlass::Status::kSuccess)
    throw Error(ErrorKind::cuda, op,
                std::string("gated CUTLASS GEMM initialization failed: ") + cutlassGetStatusString(status));
  status = gemm.run(cuda_stream);
  if (status != cutlass::Status::kSuccess) {
    const cudaError_t launch = cudaGetLastError();
    throw Error(ErrorKind::cuda, op,
                std::string("gated CUTLASS GEMM launch failed: ") + cutlassGetStatusString(status) + " (" +
                    cudaGetErrorString(launch) + ")");
  }
}

}  // namespace fusekit::linear::sm90
