// streaming_probe: what plain read+write streaming kernels of different shapes reach against a
// cudaMemcpy of the same bytes, at the sizes of the memory-bound benchmarks (a bf16 (M, N)
// tensor in, one out). It answers "how far below the copy ceiling is the best kernel of this
// size, and which launch shape gets there" before a fused kernel is tuned toward a bar.
//
// Kernels (each flips the sign bits of 16-byte vectors, so nothing can be elided):
//   gridstride  one wave of blocks looping over the tensor;
//   oneshot     one block per chunk, U vectors per thread, all loads before the stores, with
//               optional cache hints on the stores (st) and loads (ld);
//   persist     one wave, the next chunk's loads issued before this chunk's stores;
//   bulk        TMA bulk copies global -> shared -> global, one chunk per block;
//   readonly / writeonly / memset: one direction alone.
// Timing and the copy ceiling: the benchmark harness (bench/harness: CUDA events, 5 warm-ups,
// median of 60, inputs rotated past L2; the 1 GiB cudaMemcpy ceiling measured first).
// Run: build/fusekit_streaming_probe (GPU only; results for the H200 in performance-notes.md).
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <functional>
#include <type_traits>

#include "bench/harness/bench.h"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { std::printf("CUDA error: %s (%s, line %d)\n", cudaGetErrorString(e), #x, __LINE__); std::exit(1); } } while (0)

__device__ __forceinline__ uint4 xform(uint4 v) {  // flips the sign of 8 bf16 values
  v.x ^= 0x80008000u; v.y ^= 0x80008000u; v.z ^= 0x80008000u; v.w ^= 0x80008000u; return v;
}
__device__ __forceinline__ void st_cs(uint4* p, uint4 v) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ void st_ef(uint4* p, uint4 v) {
  uint64_t pol; asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  asm volatile("st.global.L1::no_allocate.L2::cache_hint.v4.u32 [%0], {%1,%2,%3,%4}, %5;" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(pol) : "memory");
}
__device__ __forceinline__ uint4 ld_nc(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 ld_ef(const uint4* p) {
  uint4 v;
  uint64_t pol; asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
  return v;
}

__global__ void gridstride(const uint4* __restrict__ in, uint4* __restrict__ out, size_t nvec) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < nvec; i += (size_t)gridDim.x * blockDim.x)
    out[i] = xform(in[i]);
}
// One-shot: each thread U vectors, block-strided (coalesced), all loads before stores.
template <int U, int STORE, int LOAD>
__global__ void oneshot(const uint4* __restrict__ in, uint4* __restrict__ out, size_t nvec) {
  size_t base = (size_t)blockIdx.x * blockDim.x * U + threadIdx.x;
  uint4 v[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    size_t i = base + (size_t)u * blockDim.x;
    if (i < nvec) v[u] = LOAD == 0 ? in[i] : LOAD == 1 ? ld_nc(in + i) : ld_ef(in + i);
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    size_t i = base + (size_t)u * blockDim.x;
    if (i < nvec) {
      uint4 w = xform(v[u]);
      if (STORE == 0) out[i] = w; else if (STORE == 1) st_cs(out + i, w); else st_ef(out + i, w);
    }
  }
}
// Persistent with a register prefetch: next chunk's loads issued before this chunk's stores.
template <int U>
__global__ void persist(const uint4* __restrict__ in, uint4* __restrict__ out, size_t nvec) {
  size_t chunk = (size_t)blockDim.x * U;
  size_t nchunks = nvec / chunk;
  size_t c = blockIdx.x;
  uint4 v[U];
  if (c < nchunks) {
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = in[c * chunk + u * blockDim.x + threadIdx.x];
  }
  for (; c < nchunks; c += gridDim.x) {
    uint4 w[U];
#pragma unroll
    for (int u = 0; u < U; ++u) w[u] = v[u];
    size_t nc = c + gridDim.x;
    if (nc < nchunks) {
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = in[nc * chunk + u * blockDim.x + threadIdx.x];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) out[c * chunk + u * blockDim.x + threadIdx.x] = xform(w[u]);
  }
}
__global__ void readonly(const uint4* __restrict__ in, uint4* __restrict__ out, size_t nvec) {
  constexpr int U = 4;
  size_t base = (size_t)blockIdx.x * blockDim.x * U + threadIdx.x;
  uint32_t acc = 0;
#pragma unroll
  for (int u = 0; u < U; ++u) { size_t i = base + (size_t)u * blockDim.x; if (i < nvec) { uint4 v = in[i]; acc ^= v.x ^ v.y ^ v.z ^ v.w; } }
  if (acc == 0x12345678u) out[0] = make_uint4(acc, 0, 0, 0);
}
__global__ void writeonly(const uint4* __restrict__ in, uint4* __restrict__ out, size_t nvec) {
  constexpr int U = 4;
  size_t base = (size_t)blockIdx.x * blockDim.x * U + threadIdx.x;
#pragma unroll
  for (int u = 0; u < U; ++u) { size_t i = base + (size_t)u * blockDim.x; if (i < nvec) out[i] = make_uint4(u, 1, 2, 3); }
}

// One read, two writes (the FP8 RMSNorm quantize pass's mix: x in, qy and its transpose out).
// REVERSE: block b takes chunk gridDim.x - 1 - b, so that a pass run right after one in forward
// order meets the most recently read chunks first (what L2 may still hold).
template <int U, bool REVERSE>
__global__ void fanout2(const uint4* __restrict__ in, uint4* __restrict__ out, uint4* __restrict__ out2, size_t nvec) {
  const size_t b = REVERSE ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  size_t base = b * blockDim.x * U + threadIdx.x;
  uint4 v[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    size_t i = base + (size_t)u * blockDim.x;
    if (i < nvec) v[u] = in[i];
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    size_t i = base + (size_t)u * blockDim.x;
    if (i < nvec) {
      out[i] = xform(v[u]);
      out2[i] = v[u];
    }
  }
}

// readonly with an L2 eviction priority by position: vectors at or past `keep_from` are loaded
// evict_last (what a second, reversed pass should find in L2), the others evict_first.
__device__ __forceinline__ uint4 ld_el(const uint4* p) {
  uint4 v;
  uint64_t pol; asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
  return v;
}
__global__ void readonly_keep_tail(const uint4* __restrict__ in, uint4* __restrict__ out, size_t nvec, size_t keep_from) {
  constexpr int U = 4;
  size_t base = (size_t)blockIdx.x * blockDim.x * U + threadIdx.x;
  uint32_t acc = 0;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    size_t i = base + (size_t)u * blockDim.x;
    if (i < nvec) { uint4 v = i >= keep_from ? ld_el(in + i) : ld_ef(in + i); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
  }
  if (acc == 0x12345678u) out[0] = make_uint4(acc, 0, 0, 0);
}
// fanout2, reversed, with evict_first loads and stores (the outputs must not push x out of L2).
template <int U>
__global__ void fanout2_ef(const uint4* __restrict__ in, uint4* __restrict__ out, uint4* __restrict__ out2, size_t nvec) {
  const size_t b = gridDim.x - 1 - blockIdx.x;
  size_t base = b * blockDim.x * U + threadIdx.x;
  uint4 v[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    size_t i = base + (size_t)u * blockDim.x;
    if (i < nvec) v[u] = ld_ef(in + i);
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    size_t i = base + (size_t)u * blockDim.x;
    if (i < nvec) {
      st_ef(out + i, xform(v[u]));
      st_ef(out2 + i, v[u]);
    }
  }
}

// TMA bulk: each block copies CH bytes global->smem (one mbarrier), flips sign bits in smem, bulk-stores.
template <int CH>
__global__ void bulk(const uint4* __restrict__ in, uint4* __restrict__ out, size_t nvec) {
  extern __shared__ __align__(128) uint4 buf[];
  __shared__ __align__(8) uint64_t bar;
  size_t first = (size_t)blockIdx.x * (CH / 16);
  uint32_t sbuf = (uint32_t)__cvta_generic_to_shared(buf), sbar = (uint32_t)__cvta_generic_to_shared(&bar);
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(sbar));
    asm volatile("fence.mbarrier_init.release.cluster;");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(sbar), "r"(CH));
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(sbuf), "l"(in + first), "r"(CH), "r"(sbar) : "memory");
  }
  __syncthreads();
  asm volatile("{ .reg .pred p; W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0; @!p bra W; }" :: "r"(sbar) : "memory");
  for (int i = threadIdx.x; i < CH / 16; i += blockDim.x) buf[i] = xform(buf[i]);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(out + first), "r"(sbuf), "r"(CH) : "memory");
    asm volatile("cp.async.bulk.commit_group;");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  }
}

namespace bench = fusekit::bench;

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("streaming_probe: no CUDA device; this tool measures a GPU\n");
    return 2;
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const double ceiling_gbps = bench::measure_copy_ceiling().copy_gbps;
  std::printf("ceiling 1GiB memcpy %.0f GB/s\n", ceiling_gbps);
  {
    // The FP8 RMSNorm forward's traffic at (16384, 4096): x (1 byte per element) read by a
    // statistics pass, read again by a quantize pass that writes two outputs of x's size. Counted
    // as the issue counts it (x twice, both outputs once: 4 bytes per element without scales).
    const std::size_t bytes = 16384ull * 4096;
    const int rotations = bench::rotations_for(3 * bytes);
    std::vector<bench::DeviceBuffer> ins, outs, outs2;
    for (int r = 0; r < rotations; ++r) {
      ins.emplace_back(bytes);
      outs.emplace_back(bytes);
      outs2.emplace_back(bytes);
      CK(cudaMemset(ins.back().get(), r + 1, bytes));
    }
    auto in = [&](int r) { return static_cast<const uint4*>(ins[r].get()); };
    auto out = [&](int r) { return static_cast<uint4*>(outs[r].get()); };
    auto out2 = [&](int r) { return static_cast<uint4*>(outs2[r].get()); };
    const std::size_t nvec = bytes / 16;
    auto report = [&](const char* name, const bench::Timing& t, double units) {
      const double gbps = units * bytes / t.median_us / 1e3;
      std::printf("fp8-mix %6.1f MB %-40s %8.2f us %6.0f GB/s %5.1f%%\n", bytes / 1e6, name, t.median_us, gbps,
                  100.0 * gbps / ceiling_gbps);
    };
    auto time = [&](const std::function<void(int)>& launch) { return bench::time_kernel(launch, rotations, 5, 60); };
    const unsigned ro_grid = static_cast<unsigned>((nvec + 1023) / 1024);
    report("readonly x (1 unit)", time([&](int r) { readonly<<<ro_grid, 256>>>(in(r), out(r), nvec); }), 1.0);
    auto fan = [&](auto u, auto rev, int threads, bool with_read_pass) {
      constexpr int U = decltype(u)::value;
      constexpr bool R = decltype(rev)::value;
      char name[80];
      std::snprintf(name, sizeof name, "%sfanout2 U%d b%d%s", with_read_pass ? "readonly + " : "", U, threads,
                    R ? " reversed" : "");
      const unsigned grid = static_cast<unsigned>((nvec + std::size_t(threads) * U - 1) / (std::size_t(threads) * U));
      report(name, time([&](int r) {
               if (with_read_pass) readonly<<<ro_grid, 256>>>(in(r), out(r), nvec);
               fanout2<U, R><<<grid, threads>>>(in(r), out(r), out2(r), nvec);
             }),
             with_read_pass ? 4.0 : 3.0);
    };
    using F = std::false_type;
    using T = std::true_type;
    fan(std::integral_constant<int, 1>{}, F{}, 256, false);
    fan(std::integral_constant<int, 2>{}, F{}, 256, false);
    fan(std::integral_constant<int, 4>{}, F{}, 256, false);
    fan(std::integral_constant<int, 2>{}, F{}, 512, false);
    fan(std::integral_constant<int, 1>{}, F{}, 256, true);
    fan(std::integral_constant<int, 2>{}, F{}, 256, true);
    fan(std::integral_constant<int, 4>{}, F{}, 256, true);
    fan(std::integral_constant<int, 1>{}, T{}, 256, true);
    fan(std::integral_constant<int, 2>{}, T{}, 256, true);
    fan(std::integral_constant<int, 4>{}, T{}, 256, true);
    for (int keep_mb : {0, 16, 24, 32, 40, 48}) {
      for (int policy_stores : {0, 1}) {
        char name[80];
        std::snprintf(name, sizeof name, "readonly keep last %d MB + fanout2 U2 rev%s", keep_mb,
                      policy_stores ? " ef" : "");
        const std::size_t keep_from = nvec - std::min<std::size_t>(nvec, std::size_t(keep_mb) << 16);
        const unsigned grid = static_cast<unsigned>((nvec + 511) / 512);
        report(name, time([&](int r) {
                 readonly_keep_tail<<<ro_grid, 256>>>(in(r), out(r), nvec, keep_from);
                 if (policy_stores) fanout2_ef<2><<<grid, 256>>>(in(r), out(r), out2(r), nvec);
                 else fanout2<2, true><<<grid, 256>>>(in(r), out(r), out2(r), nvec);
               }),
               4.0);
      }
    }
    if (std::getenv("FUSEKIT_PROBE_FP8_ONLY")) return 0;
  }
  const std::size_t sizes[] = {16384ull * 1024 * 2, 16384ull * 4096 * 2, 8192ull * 16384 * 2};
  for (std::size_t bytes : sizes) {
    const int rotations = bench::rotations_for(2 * bytes);
    std::vector<bench::DeviceBuffer> ins, outs;
    for (int r = 0; r < rotations; ++r) {
      ins.emplace_back(bytes);
      outs.emplace_back(bytes);
      CK(cudaMemset(ins.back().get(), r + 1, bytes));
    }
    auto in = [&](int r) { return static_cast<const uint4*>(ins[r].get()); };
    auto out = [&](int r) { return static_cast<uint4*>(outs[r].get()); };
    const std::size_t nvec = bytes / 16;
    // directions: 2 for read+write kernels, 1 for the one-direction rows.
    auto report = [&](const char* name, const bench::Timing& t, double directions = 2.0) {
      const double gbps = directions * bytes / t.median_us / 1e3;
      std::printf("%10.1f MB %-34s %8.2f us %6.0f GB/s %5.1f%%\n", bytes / 1e6, name, t.median_us, gbps,
                  100.0 * gbps / ceiling_gbps);
    };
    auto time = [&](const std::function<void(int)>& launch) {
      return bench::time_kernel(launch, rotations, 5, 60);
    };
    char name[64];
    report("memcpy", bench::time_same_size_copy(bytes, rotations, [&](int r) { return outs[r].get(); },
                                                [&](int r) { return ins[r].get(); }));
    report("empty kernel", time([&](int r) { writeonly<<<1, 32>>>(in(r), out(r), 0); }));
    for (int per_sm : {4, 8, 16}) {
      std::snprintf(name, sizeof name, "gridstride256 x%dSM", per_sm);
      report(name, time([&](int r) { gridstride<<<sms * per_sm, 256>>>(in(r), out(r), nvec); }));
    }
    auto oneshot_row = [&](auto u, auto store, auto load, int threads) {
      constexpr int U = decltype(u)::value, S = decltype(store)::value, L = decltype(load)::value;
      std::snprintf(name, sizeof name, "oneshot U%d st%d ld%d b%d", U, S, L, threads);
      const unsigned grid = static_cast<unsigned>((nvec + std::size_t(threads) * U - 1) / (std::size_t(threads) * U));
      report(name, time([&](int r) { oneshot<U, S, L><<<grid, threads>>>(in(r), out(r), nvec); }));
    };
    using I0 = std::integral_constant<int, 0>;
    using I1 = std::integral_constant<int, 1>;
    using I2 = std::integral_constant<int, 2>;
    using I4 = std::integral_constant<int, 4>;
    oneshot_row(I1{}, I0{}, I0{}, 256);
    oneshot_row(I2{}, I0{}, I0{}, 256);
    oneshot_row(I4{}, I0{}, I0{}, 256);
    oneshot_row(std::integral_constant<int, 8>{}, I0{}, I0{}, 256);
    oneshot_row(I4{}, I0{}, I0{}, 128);
    oneshot_row(I4{}, I0{}, I0{}, 512);
    oneshot_row(I2{}, I0{}, I0{}, 512);
    oneshot_row(I4{}, I1{}, I0{}, 256);
    oneshot_row(I4{}, I2{}, I0{}, 256);
    oneshot_row(I4{}, I0{}, I1{}, 256);
    oneshot_row(I4{}, I0{}, I2{}, 256);
    oneshot_row(I4{}, I1{}, I1{}, 256);
    for (int per_sm : {2, 4, 8})
      for (int threads : {256, 512}) {
        std::snprintf(name, sizeof name, "persist U4 b%d x%dSM", threads, per_sm);
        report(name, time([&](int r) { persist<4><<<sms * per_sm, threads>>>(in(r), out(r), nvec); }));
      }
    auto bulk_row = [&](auto chunk) {
      constexpr int CH = decltype(chunk)::value;
      CK(cudaFuncSetAttribute(bulk<CH>, cudaFuncAttributeMaxDynamicSharedMemorySize, CH));
      std::snprintf(name, sizeof name, "bulk %d B/block", CH);
      const unsigned grid = static_cast<unsigned>(bytes / CH);
      report(name, time([&](int r) { bulk<CH><<<grid, 256, CH>>>(in(r), out(r), nvec); }));
    };
    bulk_row(std::integral_constant<int, 16384>{});
    bulk_row(std::integral_constant<int, 32768>{});
    const unsigned grid = static_cast<unsigned>((nvec + 1023) / 1024);
    report("readonly U4 (1x bytes)", time([&](int r) { readonly<<<grid, 256>>>(in(r), out(r), nvec); }), 1.0);
    report("writeonly U4 (1x bytes)", time([&](int r) { writeonly<<<grid, 256>>>(in(r), out(r), nvec); }), 1.0);
    report("memset (1x bytes)", time([&](int r) { CK(cudaMemsetAsync(out(r), r, bytes)); }), 1.0);
    // The kernels compute what they should: a one-shot pass flips the sign bits of its input.
    oneshot<4, 0, 0><<<grid, 256>>>(in(0), out(0), nvec);
    CK(cudaGetLastError());
    std::uint16_t first = 0;
    CK(cudaMemcpy(&first, out(0), sizeof first, cudaMemcpyDeviceToHost));
    if (first != static_cast<std::uint16_t>(0x0101 ^ 0x8000)) {
      std::printf("streaming_probe: wrong output %#x\n", first);
      return 1;
    }
  }
  return 0;
}
