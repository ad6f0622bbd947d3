// Device-side element conversions and 16-byte vector packing shared by the memory-bound kernels
// (norm, bias+activation+dropout, fp8 RMSNorm), and the sm_90 launch-control instructions they
// use. Math is float32; storage is float, half or bfloat16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace fusekit::detail::device {

// ---- single elements --------------------------------------------------------------------------

// The bits of `from` as a `To` of the same size. Reading a local through a reinterpret_cast
// pointer of another type breaks C++'s aliasing rules (the compiler happens to do what was meant,
// but need not); a memcpy of the bytes is the defined form and compiles to a register move.
template <typename To, typename From>
__device__ __forceinline__ To bit_copy(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "same size");
  To to;
  memcpy(&to, &from, sizeof(To));
  return to;
}

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Two floats into one 32-bit word of 16-bit values, first in the low half (one F2FP on sm_90).
template <typename T>
__device__ __forceinline__ std::uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ std::uint32_t pack2<__half>(float a, float b) {
  return bit_copy<std::uint32_t>(__floats2half2_rn(a, b));
}
template <>
__device__ __forceinline__ std::uint32_t pack2<__nv_bfloat16>(float a, float b) {
  return bit_copy<std::uint32_t>(__floats2bfloat162_rn(a, b));
}

// ---- 16-byte vectors --------------------------------------------------------------------------

// 16 bytes of T -> 16 / sizeof(T) floats (unpack16_to: into out[0 .. 16 / sizeof(T))). bf16 is the high half of a float: one shift or one
// mask per element (the generic conversion of a high half costs a byte permute and a shift).
// `raw` is taken by value: from a reference into shared memory the compiler reads each word
// with its own narrower load instead of one 16-byte load.
template <typename T>
__device__ __forceinline__ void unpack16_to(const uint4 raw, float* out) {
  const std::uint32_t word[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (std::is_same_v<T, float>) {
      out[j] = __uint_as_float(word[j]);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      out[2 * j] = __uint_as_float(word[j] << 16);
      out[2 * j + 1] = __uint_as_float(word[j] & 0xFFFF0000u);
    } else {
      static_assert(std::is_same_v<T, __half>, "float, half or bfloat16");
      const float2 f = __half22float2(bit_copy<__half2>(word[j]));
      out[2 * j] = f.x;
      out[2 * j + 1] = f.y;
    }
  }
}

template <typename T>
__device__ __forceinline__ void unpack16(const uint4 raw, float (&out)[16 / sizeof(T)]) {
  unpack16_to<T>(raw, out);
}

// 16 / sizeof(T) floats -> 16 bytes of T, round to nearest even (pack16_from: from in[0 ..)).
template <typename T>
__device__ __forceinline__ uint4 pack16_from(const float* in) {
  if constexpr (std::is_same_v<T, float>) {
    return make_uint4(__float_as_uint(in[0]), __float_as_uint(in[1]), __float_as_uint(in[2]),
                      __float_as_uint(in[3]));
  } else {
    return make_uint4(pack2<T>(in[0], in[1]), pack2<T>(in[2], in[3]), pack2<T>(in[4], in[5]),
                      pack2<T>(in[6], in[7]));
  }
}
template <typename T>
__device__ __forceinline__ uint4 pack16(const float (&in)[16 / sizeof(T)]) {
  return pack16_from<T>(in);
}

// How load_floats reads global memory: plain loads, or the read-only (non-coherent) path for data
// no kernel of the launch writes.
enum class LoadPath { plain, read_only };

// VEC consecutive values of W at a 16-byte aligned address (VEC * sizeof(W) a multiple of 16), as
// floats, in 16-byte loads.
template <typename W, int VEC, LoadPath kPath = LoadPath::plain>
__device__ __forceinline__ void load_floats(const W* p, float (&out)[VEC]) {
  constexpr int kPer = 16 / sizeof(W);
  static_assert(VEC % kPer == 0, "whole 16-byte chunks");
#pragma unroll
  for (int c = 0; c < VEC / kPer; ++c) {
    float part[kPer];
    if constexpr (kPath == LoadPath::read_only)
      unpack16<W>(__ldg(reinterpret_cast<const uint4*>(p) + c), part);
    else
      unpack16<W>(*reinterpret_cast<const uint4*>(p + c * kPer), part);
#pragma unroll
    for (int i = 0; i < kPer; ++i) out[c * kPer + i] = part[i];
  }
}

// Four consecutive values at a 4-element-aligned address (16-byte aligned base) as floats, with
// one 8-byte (16-bit types) or 16-byte (float) load through the read-only cache.
template <typename T>
__device__ __forceinline__ float4 load4_floats(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return __ldg(reinterpret_cast<const float4*>(p));
  } else {
    const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
    float f[8];
    unpack16_to<T>(make_uint4(raw.x, raw.y, 0u, 0u), f);
    return make_float4(f[0], f[1], f[2], f[3]);
  }
}

// Per-block staging of per-column data (weights into shared memory) over `units` items: thread
// t takes items t, t + blockDim.x, ... and issues the global loads of kBatch items before the
// first store. A plain strided loop waits out one full load latency per iteration (Nsight: the
// norm backward's weight staging, 8 iterations of 512 threads at N = 4096, held every warp for
// several us before its first row).
template <int kBatch, typename Load, typename Store>
__device__ __forceinline__ void staged_for_each(int units, Load&& load, Store&& store) {
  using Value = decltype(load(0));
  for (int base = threadIdx.x; base < units; base += kBatch * static_cast<int>(blockDim.x)) {
    Value v[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int u = base + k * static_cast<int>(blockDim.x);
      if (u < units) v[k] = load(u);
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int u = base + k * static_cast<int>(blockDim.x);
      if (u < units) store(u, v[k]);
    }
  }
}

// Asks L2 to fetch the 128-byte line holding `at` (prefetch.global.L2): bytes in flight that hold
// no register and need no completion wait. The address must be one the kernel may read.
__device__ __forceinline__ void prefetch_l2(const void* at) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(at));
}

// ---- shared memory and launch control (sm_90) --------------------------------------------------

// The 32-bit shared-window address of a shared-memory pointer (what cp.async, mbarrier and bulk
// copies take).
__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// mbarriers and bulk copies (TMA, sm_90): a copy of `bytes` into shared memory completes by
// adding its bytes to an mbarrier's transaction count; the consumer waits on the barrier's phase.
// The forms on 32-bit shared-window addresses (shared_address) are for loops that keep their
// addresses: one that issues a copy every few hundred instructions from one lane pays for every
// address conversion it makes.
__device__ __forceinline__ void mbarrier_init(std::uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive(std::uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(bar)) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive_expect_tx(std::uint64_t* bar, unsigned bytes) {
  mbarrier_arrive_expect_tx(shared_address(bar), bytes);
}
__device__ __forceinline__ void mbarrier_wait(unsigned bar, unsigned parity) {
  unsigned done = 0;
  do {
    asm volatile(
        "{\n .reg .pred ready;\n"
        " mbarrier.try_wait.parity.shared::cta.b64 ready, [%1], %2;\n"
        " selp.u32 %0, 1, 0, ready;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void mbarrier_wait(std::uint64_t* bar, unsigned parity) {
  mbarrier_wait(shared_address(bar), parity);
}
// True in exactly one active lane of a converged warp (elect.sync): lets a whole warp run code
// whose operands the compiler can keep warp-uniform while one lane issues the side effect.
__device__ __forceinline__ bool elect_one_lane() {
  unsigned elected = 0;
  asm volatile(
      "{\n .reg .pred p;\n elect.sync _|p, 0xffffffff;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(elected));
  return elected != 0;
}
// Orders this thread's earlier shared-memory accesses (generic proxy) before later bulk copies
// (async proxy) into the same bytes.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// `bytes` a multiple of 16, both addresses 16-byte aligned.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, unsigned bytes, std::uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar))
      : "memory");
}
// Asks L2 to fetch `bytes` (a multiple of 16) from `src` (16-byte aligned) by one bulk copy that
// nothing waits for (cp.async.bulk.prefetch.L2).
__device__ __forceinline__ void bulk_prefetch_l2(const void* src, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}
// Lets the next kernel in the stream, when launched with programmatic stream serialization,
// begin launching now; it still waits for this grid's results in wait_for_prerequisite_grid().
__device__ __forceinline__ void allow_dependent_launch() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
// Waits for the grid this one depends on to complete and its writes to be visible (a no-op when
// the kernel was launched without programmatic stream serialization).
__device__ __forceinline__ void wait_for_prerequisite_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Synchronizes `threads` threads of the block on hardware barrier `id` (1..15; 0 is
// __syncthreads'): a row group waits only for itself, not for the block's other row groups.
__device__ __forceinline__ void group_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace fusekit::detail::device
