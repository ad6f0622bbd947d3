// The backward's dx GEMM for Hopper with dz = dout * act'(pre) formed inside the same kernel.
//
// Why: dz feeds both backward GEMMs (dx = dz W, dW = dz^T x). Formed by a separate elementwise pass
// it costs 6 bytes per element of memory traffic (dout and pre read, dz written): 5.8% of the two
// GEMMs at (M, K, N) = (8191, 4096, 12296) even at the copy ceiling, more than the issue's 5% bar
// allows. Transforming the GEMM's A operand in its mainloop instead repeats act' once per CTA that
// reads a dz tile (K / 128 = 32 times at K = 4096): cheap for relu, too costly for the
// transcendental activations (bench: linear bwd gelu_erf, silu, H200). Here each dz element is
// formed once, by warps that a GEMM leaves idle, while the tensor cores run:
//
//   - The kernel is CUTLASS's warp-specialized cooperative GEMM (a producer warp group feeding
//     two consumer warp groups that share each 128 x 256 tile), rebuilt around CUTLASS's own
//     collectives so that the producer group's warps 1-3, idle in a GEMM without a source matrix
//     C, form dz. (The forward's 128 x 128 ping-pong configuration ran this GEMM ~20% slower than
//     cuBLAS at the odd shape; 128 x 256 cooperative tiles in clusters of 2 along M matched it.)
//   - The dz rows are cut into units of kDgradUnitRows rows x kDgradSliceCols columns. The
//     forming warps claim units in order (an atomic counter: no warp depends on another CTA being
//     resident, so the kernel cannot deadlock), write dz, add its columns up for dbias (one float
//     partial row per row group, summed later in a fixed order), and publish each unit with a
//     release store of its flag.
//   - Before the TMA producer loads a k-tile of A, it waits (acquire) for the flags of the units
//     that tile covers, then fences the async proxy so that TMA sees the generic-proxy stores.
//     The scheduler walks the output tiles in row strips (raster along N), the order in which the
//     units are claimed, so that the wait is rare after the first tiles.
//   - The rows of the first tiles, which are needed before any unit could be formed, are formed
//     by the separate elementwise pass before the kernel (first_row; linear_cuda.cu chooses it).
//
// dz itself is still stored (the dW GEMM, cuBLAS, reads it), but its store and the reads of dout
// and pre overlap the dx GEMM's math instead of adding to the backward's time: the backward is
// 1.036-1.041x the two plain cuBLAS GEMMs at (8191, 4096, 12296) for every activation against
// 1.060-1.082x with the separate pass, 0.998-1.002x against 1.032-1.064x at (8192, 4096, 16384)
// (bench: linear bwd, H200).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.h>
#include <cutlass/pipeline/pipeline.hpp>

#include <cstdint>
#include <string>

#include "core/activation.h"
#include "core/launch_tuning.h"
#include "fusekit/error.h"
#include "linear/linear_cutlass.h"
#include "linear/linear_kernels.cuh"

namespace fusekit::linear::sm90 {

// What the forming warps need; all pointers device memory.
struct DzFormParams {
  const void* dout = nullptr;
  std::int64_t lddout = 0;
  const void* pre = nullptr;
  std::int64_t ldpre = 0;
  void* dz = nullptr;
  std::int64_t lddz = 0;
  float* partial = nullptr;  // null: no dbias; else one row of n floats per unit row group
  unsigned* flags = nullptr;  // one per unit, zero before the kernel
  int* counter = nullptr;     // units claimed so far, zero before the kernel
  int m = 0, n = 0;
  int first_row = 0;  // rows below it were formed before the kernel (a multiple of the tile M)
  int slices = 0;     // units per row group: ceil(n / kDgradSliceCols)
  int units = 0;      // row groups from first_row on, times slices
  int activation = 0;
  int gated = 0;  // dout is dy (n / 2 columns); dz = the gated backward, gate and up interleaved
};

namespace dgrad_detail {

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// The TMA loads that follow read global memory through the async proxy; the units' stores were
// made through the generic proxy by other SMs.
__device__ __forceinline__ void fence_generic_to_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// A k-tile iterator for CUTLASS's producer load loop that, when dereferenced for k-tile k,
// first waits until the dz units covering k-tile k of this tile's rows are formed. The load loop
// dereferences it from its one elected thread, right before the TMA copy of that k-tile.
struct WaitingKTileIterator {
  int k = 0;
  const unsigned* flags = nullptr;  // flags of the first row group of this tile, or null: no wait
  int groups = 0;                   // row groups of this tile that are formed in the kernel
  int slices = 0;                   // flag stride between row groups
  int k_tiles_per_slice = 1;
  mutable int ready_slices = 0;  // slices [0, ready_slices) are known to be formed

  CUTLASS_DEVICE int operator*() const {
    if (flags != nullptr) {
      const int slice = k / k_tiles_per_slice;
      if (slice >= ready_slices) {
        for (int s = ready_slices; s <= slice; ++s)
          for (int g = 0; g < groups; ++g)
            while (load_acquire(flags + g * slices + s) == 0u) __nanosleep(64);
        fence_generic_to_async_global();
        ready_slices = slice + 1;
      }
    }
    return k;
  }
  CUTLASS_DEVICE WaitingKTileIterator& operator++() {
    ++k;
    return *this;
  }
};

// kVec columns of dz from their dout and pre values (kDout of dout: kVec, or kVec / 2 for a
// gated backward, whose dout is dy), with the elementwise passes' exact arithmetic (linear's dz
// pass, gated_act's backward), so dz is bitwise the same whichever forms it; its values are added
// to `sum`.
template <typename T, Activation A, bool kGated, int kVec, int kDout>
CUTLASS_DEVICE kernels::Pack<T, kVec> form_vector(const kernels::Pack<T, kDout>& g, const kernels::Pack<T, kVec>& p,
                                                  float* sum) {
  kernels::Pack<T, kVec> z;
  if constexpr (kGated) {
    using GateMath = detail::ActivationMath<float, detail::GeluErfMath::fit_16bit>;
#pragma unroll
    for (int i = 0; i < kDout; ++i) {
      float act, deriv;
      GateMath::forward_and_derivative(A, kernels::to_float(p.v[2 * i]), 0.0f, &act, &deriv);
      const float dy = kernels::to_float(g.v[i]);
      z.v[2 * i] = kernels::from_float<T>(dy * kernels::to_float(p.v[2 * i + 1]) * deriv);
      z.v[2 * i + 1] = kernels::from_float<T>(dy * act);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i)
      z.v[i] = kernels::from_float<T>(kernels::to_float(g.v[i]) * kernels::act_derivative<A, T>(kernels::to_float(p.v[i])));
  }
#pragma unroll
  for (int i = 0; i < kVec; ++i) sum[i] += kernels::to_float(z.v[i]);
  return z;
}

// One forming warp's loop: claim units in order until none is left. Each lane owns 8 columns (one
// 16-byte vector) of the unit's slice and walks its rows two at a time (four loads in flight).
template <typename T, Activation A, bool kGated>
CUTLASS_DEVICE void form_dz_units(const DzFormParams& f, int lane) {
  constexpr int kVec = 8;
  constexpr int kDout = kGated ? kVec / 2 : kVec;
  using Vec = kernels::Pack<T, kVec>;
  using DoutVec = kernels::Pack<T, kDout>;
  const T* dout = static_cast<const T*>(f.dout);
  const T* pre = static_cast<const T*>(f.pre);
  T* dz = static_cast<T*>(f.dz);
  for (;;) {
    int unit = 0;
    if (lane == 0) unit = atomicAdd(f.counter, 1);
    unit = __shfl_sync(0xffffffffu, unit, 0);
    if (unit >= f.units) return;
    const int group = unit / f.slices;
    const int slice = unit - group * f.slices;
    const int row0 = f.first_row + group * kDgradUnitRows;
    const int rows = min(kDgradUnitRows, f.m - row0);
    const int col = slice * kDgradSliceCols + lane * kVec;
    if (col < f.n) {
      float sum[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) sum[i] = 0.0f;
      const T* g_row = dout + static_cast<std::int64_t>(row0) * f.lddout + col / (kVec / kDout);
      const T* p_row = pre + static_cast<std::int64_t>(row0) * f.ldpre + col;
      T* z_row = dz + static_cast<std::int64_t>(row0) * f.lddz + col;
      for (int r = 0; r < rows; r += 2) {
        const bool second = r + 1 < rows;
        DoutVec g0 = *reinterpret_cast<const DoutVec*>(g_row);
        Vec p0 = *reinterpret_cast<const Vec*>(p_row);
        DoutVec g1 = g0;
        Vec p1 = p0;
        if (second) {
          g1 = *reinterpret_cast<const DoutVec*>(g_row + f.lddout);
          p1 = *reinterpret_cast<const Vec*>(p_row + f.ldpre);
        }
        *reinterpret_cast<Vec*>(z_row) = form_vector<T, A, kGated>(g0, p0, sum);
        if (second) *reinterpret_cast<Vec*>(z_row + f.lddz) = form_vector<T, A, kGated>(g1, p1, sum);
        g_row += 2 * f.lddout;
        p_row += 2 * f.ldpre;
        z_row += 2 * f.lddz;
      }
      if (f.partial != nullptr) {
        float* out = f.partial + static_cast<std::int64_t>(group) * f.n + col;
#pragma unroll
        for (int i = 0; i < kVec; ++i) out[i] = sum[i];
      }
    }
    // Every lane's stores are ordered before lane 0's release: each lane fences its own, the warp
    // barrier orders the lanes.
    __threadfence();
    __syncwarp();
    if (lane == 0) store_release(f.flags + unit, 1u);
  }
}

template <typename T>
CUTLASS_DEVICE void form_dz(const DzFormParams& f, int lane) {
  if (f.gated) {
    switch (static_cast<Activation>(f.activation)) {
      case Activation::relu: form_dz_units<T, Activation::relu, true>(f, lane); break;
      case Activation::gelu_erf: form_dz_units<T, Activation::gelu_erf, true>(f, lane); break;
      case Activation::gelu_tanh: form_dz_units<T, Activation::gelu_tanh, true>(f, lane); break;
      case Activation::silu: form_dz_units<T, Activation::silu, true>(f, lane); break;
      default: break;  // refused on the host
    }
    return;
  }
  switch (static_cast<Activation>(f.activation)) {
    case Activation::relu: form_dz_units<T, Activation::relu, false>(f, lane); break;
    case Activation::gelu_erf: form_dz_units<T, Activation::gelu_erf, false>(f, lane); break;
    case Activation::gelu_tanh: form_dz_units<T, Activation::gelu_tanh, false>(f, lane); break;
    case Activation::squared_relu: form_dz_units<T, Activation::squared_relu, false>(f, lane); break;
    case Activation::silu: form_dz_units<T, Activation::silu, false>(f, lane); break;
    default: break;  // refused on the host
  }
}

}  // namespace dgrad_detail

// The kernel: CUTLASS's cooperative GemmUniversal (`Base`) for its types, host-side helpers and
// shared storage, with its own device entry. Only what this GEMM uses is kept: the static
// persistent scheduler, no source matrix C (so no epilogue load warp), no auxiliary loads, no
// split-K fixup.
template <class Base, typename T>
struct DgradFormingKernel : Base {
  using CollectiveMainloop = typename Base::CollectiveMainloop;
  using CollectiveEpilogue = typename Base::CollectiveEpilogue;
  using TileScheduler = typename Base::TileScheduler;
  using TileShape = typename Base::TileShape;
  using ClusterShape = typename Base::ClusterShape;
  using TiledMma = typename Base::TiledMma;
  using SharedStorage = typename Base::SharedStorage;
  static constexpr int kMmaThreads = cute::size(TiledMma{});
  static_assert(kMmaThreads == 256, "two consumer warp groups on one tile (the cooperative schedule)");
  static_assert(!TileScheduler::IsDynamicPersistent, "the static persistent scheduler only");
  static_assert(cute::size<0>(TileShape{}) % kDgradUnitRows == 0, "tiles cover whole row groups");
  static_assert(kDgradSliceCols % cute::size<2>(TileShape{}) == 0, "slices cover whole k-tiles");

  static constexpr int kTileRows = cute::size<0>(TileShape{});
  // Registers per thread after the warp groups re-balance: the forming warps need more than the
  // 40 that CUTLASS leaves a TMA-only producer group (at 40 they spilled 216 bytes); each consumer
  // thread holds 128 float accumulators (a 64 x 256 half tile), which fit in 224 instead of
  // CUTLASS's 232. At 56 / 224 ptxas reports no spills. 128 x 56 + 256 x 224 = 64512 of 65536.
  static constexpr uint32_t kProducerRegisters = 56;
  static constexpr uint32_t kConsumerRegisters = 224;
  static constexpr int kKTilesPerSlice = kDgradSliceCols / cute::size<2>(TileShape{});

  struct Params {
    typename Base::Params gemm;
    DzFormParams form;
  };

  CUTLASS_DEVICE void operator()(Params const& params, char* smem_buf) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace cute;
    enum class Role { producer = 0, consumer0 = 1, consumer1 = 2 };

    SharedStorage& shared_storage = *reinterpret_cast<SharedStorage*>(smem_buf);
    const int thread_idx = int(threadIdx.x);
    const int lane_idx = cutlass::canonical_lane_idx();
    const int warp_idx = cutlass::canonical_warp_idx_sync();
    const int warp_in_group = warp_idx % cutlass::NumWarpsPerWarpGroup;
    const int group_thread_idx = thread_idx % cutlass::NumThreadsPerWarpGroup;
    const Role role = Role(cutlass::canonical_warp_group_idx());
    const int lane_predicate = cute::elect_one_sync();
    const uint32_t block_rank_in_cluster = cute::block_rank_in_cluster();

    if (warp_idx == 0 && lane_predicate) {
      CollectiveMainloop::prefetch_tma_descriptors(params.gemm.mainloop);
      CollectiveEpilogue::prefetch_tma_descriptors(params.gemm.epilogue);
    }

    // Mainloop pipeline: warp 0 of the producer group produces, both consumer groups consume.
    using MainloopPipeline = typename CollectiveMainloop::MainloopPipeline;
    typename MainloopPipeline::Params mainloop_pipeline_params;
    if (role == Role::producer && warp_in_group == 0)
      mainloop_pipeline_params.role = MainloopPipeline::ThreadCategory::Producer;
    if (role != Role::producer) mainloop_pipeline_params.role = MainloopPipeline::ThreadCategory::Consumer;
    mainloop_pipeline_params.is_leader = group_thread_idx == 0;
    mainloop_pipeline_params.num_consumers = kMmaThreads;
    mainloop_pipeline_params.num_producers = CollectiveMainloop::NumProducerThreadEvents;
    mainloop_pipeline_params.transaction_bytes = params.gemm.mainloop.tma_transaction_bytes;
    MainloopPipeline mainloop_pipeline(shared_storage.pipelines.mainloop, mainloop_pipeline_params, ClusterShape{});

    // Epilogue pipelines: nothing is loaded (no C); stores go out through TMA.
    using EpiLoadPipeline = typename CollectiveEpilogue::LoadPipeline;
    typename EpiLoadPipeline::Params epi_load_pipeline_params;
    if (role != Role::producer) epi_load_pipeline_params.role = EpiLoadPipeline::ThreadCategory::Consumer;
    epi_load_pipeline_params.dst_blockid = cute::block_rank_in_cluster();
    epi_load_pipeline_params.producer_arv_count = cutlass::NumThreadsPerWarp;
    epi_load_pipeline_params.consumer_arv_count = kMmaThreads;
    if constexpr (CollectiveEpilogue::RequiresTransactionBytes)
      epi_load_pipeline_params.transaction_bytes = params.gemm.epilogue.tma_transaction_bytes;
    EpiLoadPipeline epi_load_pipeline(shared_storage.pipelines.epi_load, epi_load_pipeline_params);

    using EpiStorePipeline = typename CollectiveEpilogue::StorePipeline;
    typename EpiStorePipeline::Params epi_store_pipeline_params;
    epi_store_pipeline_params.always_wait = true;
    EpiStorePipeline epi_store_pipeline(epi_store_pipeline_params);

    typename CollectiveMainloop::PipelineState mainloop_pipe_consumer_state;
    typename CollectiveEpilogue::LoadPipelineState epi_load_pipe_consumer_state;
    auto mainloop_pipe_producer_state = cutlass::make_producer_start_state<MainloopPipeline>();
    auto epi_store_pipe_producer_state = cutlass::make_producer_start_state<EpiStorePipeline>();

    // Barrier initialization visible to every CTA of the cluster before anyone uses it.
    if constexpr (size(ClusterShape{}) > 1) cute::cluster_arrive_relaxed();
    else __syncthreads();

    auto problem_shape_MNKL = append<4>(params.gemm.problem_shape, Int<1>{});
    TiledMma tiled_mma;
    auto blk_shape = TileShape{};
    CollectiveMainloop collective_mainloop;
    auto load_inputs = collective_mainloop.load_init(problem_shape_MNKL, params.gemm.mainloop);
    Tensor gA_mkl = get<0>(load_inputs);
    Tensor gB_nkl = get<1>(load_inputs);
    auto k_tile_count = size<3>(gA_mkl);

    TileScheduler scheduler{params.gemm.scheduler};
    auto work_tile_info = scheduler.initial_work_tile_info(ClusterShape{});

    if constexpr (size(ClusterShape{}) > 1) cute::cluster_wait();

    if (role == Role::producer) {
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
      if (warp_in_group == 0) {
        const DzFormParams& f = params.form;
        const int first_group_tile = f.first_row / kTileRows;  // tiles below it wait for nothing
        while (work_tile_info.is_valid()) {
          auto m_coord = idx2crd(work_tile_info.M_idx, shape<2>(gA_mkl));
          auto n_coord = idx2crd(work_tile_info.N_idx, shape<2>(gB_nkl));
          auto l_coord = idx2crd(work_tile_info.L_idx, shape<4>(gB_nkl));
          auto blk_coord = make_coord(m_coord, n_coord, _, l_coord);

          dgrad_detail::WaitingKTileIterator k_iter;
          const int tile_m = work_tile_info.M_idx;
          if (tile_m >= first_group_tile) {
            const int group0 = (tile_m * kTileRows - f.first_row) / kDgradUnitRows;
            const int rows_left = f.m - tile_m * kTileRows;
            k_iter.flags = f.flags + static_cast<std::int64_t>(group0) * f.slices;
            k_iter.groups = min(kTileRows, rows_left + kDgradUnitRows - 1) / kDgradUnitRows;
            k_iter.slices = f.slices;
            k_iter.k_tiles_per_slice = kKTilesPerSlice;
          }
          collective_mainloop.load(params.gemm.mainloop, mainloop_pipeline, mainloop_pipe_producer_state,
                                   load_inputs, blk_coord, k_iter, k_tile_count, lane_idx,
                                   block_rank_in_cluster, shared_storage.tensors.mainloop);
          mainloop_pipe_producer_state.advance(k_tile_count);
          scheduler.advance_to_next_work();
          work_tile_info = scheduler.get_current_work();
        }
        collective_mainloop.load_tail(mainloop_pipeline, mainloop_pipe_producer_state);
      } else {
        dgrad_detail::form_dz<T>(params.form, lane_idx);
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
      CollectiveEpilogue collective_epilogue(params.gemm.epilogue, shared_storage.tensors.epilogue);
      const int mma_thread_idx = thread_idx % kMmaThreads;
      bool stored = false;
      while (work_tile_info.is_valid()) {
        auto m_coord = idx2crd(work_tile_info.M_idx, shape<2>(gA_mkl));
        auto n_coord = idx2crd(work_tile_info.N_idx, shape<2>(gB_nkl));
        auto l_coord = idx2crd(work_tile_info.L_idx, shape<4>(gB_nkl));
        auto blk_coord = make_coord(m_coord, n_coord, _, l_coord);
        auto accumulators = partition_fragment_C(tiled_mma, take<0, 2>(blk_shape));
        collective_mainloop.mma(mainloop_pipeline, mainloop_pipe_consumer_state, accumulators, k_tile_count,
                                mma_thread_idx, shared_storage.tensors.mainloop, params.gemm.mainloop);
        collective_mainloop.mma_tail(mainloop_pipeline, mainloop_pipe_consumer_state, k_tile_count);
        mainloop_pipe_consumer_state.advance(k_tile_count);
        auto [epi_load_next, epi_store_next] = collective_epilogue.store(
            epi_load_pipeline, epi_load_pipe_consumer_state, epi_store_pipeline, epi_store_pipe_producer_state,
            problem_shape_MNKL, blk_shape, blk_coord, accumulators, tiled_mma, mma_thread_idx,
            shared_storage.tensors.epilogue);
        epi_load_pipe_consumer_state = epi_load_next;
        epi_store_pipe_producer_state = epi_store_next;
        stored = true;
        scheduler.advance_to_next_work();
        work_tile_info = scheduler.get_current_work();
      }
      // The CTA must not exit while its last tile's TMA stores still read shared memory.
      if (stored)
        collective_epilogue.store_tail(epi_load_pipeline, epi_load_pipe_consumer_state, epi_store_pipeline,
                                       epi_store_pipe_producer_state);
    }
#endif
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::MaxThreadsPerBlock, 1)
    dgrad_forming_entry(const __grid_constant__ typename Kernel::Params params) {
  extern __shared__ char smem[];
  Kernel kernel;
  kernel(params, smem);
}

template <typename Element>
struct DgradGemm {
  using Accumulator = float;
  static constexpr int kAlignment = static_cast<int>(kFusedAlignmentElements);
  // 128 x 256 x 64 tiles shared by the two consumer groups, clusters of 2 along M multicasting
  // the B tile. B is W (N x K row-major): contiguous along the GEMM's output columns ("row-major
  // B"), which TMA and wgmma take directly for 16-bit types. Against cuBLAS's dx GEMM at (8191,
  // 4096, 12296) (H200, the backward with dz formed before, so only the dx GEMM differs):
  // ping-pong 128 x 128 +10-12%, cooperative 256 x 128 +1.5-2%, cooperative 128 x 256 -0.8-+0.5%.
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, Accumulator, Accumulator,
      /*C*/ void, cutlass::layout::RowMajor, kAlignment,
      /*D*/ Element, cutlass::layout::RowMajor, kAlignment,
      cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, cutlass::layout::RowMajor, kAlignment,  // dz (M x N)
      Element, cutlass::layout::RowMajor, kAlignment,  // W (N x K)
      Accumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

  using Base = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                    CollectiveEpilogue>;
};

template <typename Element, typename T>
void run_dgrad_forming(const char* op, const DgradFormingArgs& a, void* stream) {
  using G = DgradGemm<Element>;
  using Base = typename G::Base;
  using Kernel = DgradFormingKernel<Base, T>;

  typename Base::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {a.m, a.k, a.n, 1};  // GEMM (M, N, K) = (rows, dx columns, dz columns)
  args.mainloop.ptr_A = static_cast<const Element*>(a.dz);
  args.mainloop.dA = {a.lddz, cute::Int<1>{}, a.lddz * a.m};
  args.mainloop.ptr_B = static_cast<const Element*>(a.w);
  args.mainloop.dB = {cute::Int<1>{}, a.ldw, a.ldw * a.n};
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = {a.lddx, cute::Int<1>{}, a.lddx * a.m};
  args.epilogue.ptr_D = static_cast<Element*>(a.dx);
  args.epilogue.dD = {a.lddx, cute::Int<1>{}, a.lddx * a.m};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.hw_info.device_id = a.device_index;
  args.hw_info.sm_count = a.sm_count;
  // Row strips (raster along N): the order in which the forming warps claim dz's row groups.
  args.scheduler.max_swizzle_size = 2;
  args.scheduler.raster_order = cutlass::gemm::kernel::detail::RasterOrderOptions::AlongN;

  if (!Base::can_implement(args))
    throw Error(ErrorKind::unsupported, op, "the dx GEMM with dz formed inside rejected the problem");
  if (Base::get_workspace_size(args) != 0)
    throw Error(ErrorKind::unsupported, op, "the dx GEMM's scheduler asked for a workspace");

  typename Kernel::Params params;
  params.gemm = Base::to_underlying_arguments(args, nullptr);
  DzFormParams& f = params.form;
  f.dout = a.dout;
  f.lddout = a.lddout;
  f.pre = a.pre;
  f.ldpre = a.ldpre;
  f.dz = a.dz;
  f.lddz = a.lddz;
  f.partial = a.partial;
  f.flags = a.flags;
  f.counter = a.counter;
  f.m = a.m;
  f.n = a.n;
  f.first_row = a.first_row;
  f.slices = a.slices;
  f.units = a.units;
  f.activation = static_cast<int>(a.activation);
  f.gated = a.gated ? 1 : 0;

  const dim3 grid = Base::get_grid_shape(params.gemm);
  const int smem = static_cast<int>(sizeof(typename Base::SharedStorage));
  auto kernel = &dgrad_forming_entry<Kernel>;
  // The shared-memory limit is a per-device attribute of the kernel: raised once for each GPU it
  // runs on (a data-parallel process launches it on several).
  ::fusekit::detail::allow_dynamic_smem(op, kernel, static_cast<std::size_t>(smem), a.device_index,
                                       "the dx GEMM with dz formed inside");

  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(Base::MaxThreadsPerBlock, 1, 1);
  config.dynamicSmemBytes = static_cast<std::size_t>(smem);
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = cute::size<0>(typename G::ClusterShape{});
  attribute[0].val.clusterDim.y = cute::size<1>(typename G::ClusterShape{});
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  const cudaError_t launch = cudaLaunchKernelEx(&config, kernel, params);
  if (launch != cudaSuccess)
    throw Error(ErrorKind::cuda, op, std::string("dx GEMM (dz formed inside) launch failed: ") +
                                         cudaGetErrorString(launch));
}

}  // namespace fusekit::linear::sm90
