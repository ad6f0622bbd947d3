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
// Timing: CUDA events, 5 warm-ups, median of 60, inputs rotated over more than 200 MB.
// Percentages are against a 1 GiB cudaMemcpy measured at the start of the run.
// Run: build/fusekit_streaming_probe (GPU only; results for the H200 in performance-notes.md).
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <functional>

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

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("streaming_probe: no CUDA device; this tool measures a GPU\n");
    return 2;
  }
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  auto time_it = [&](std::function<void(int)> f, int reps) {
    for (int i = 0; i < 5; ++i) f(i);
    std::vector<float> t;
    for (int i = 0; i < reps; ++i) {
      CK(cudaEventRecord(e0)); f(i); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
      float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); t.push_back(ms * 1000.f);
    }
    CK(cudaGetLastError());
    std::sort(t.begin(), t.end()); return t[t.size() / 2];
  };
  // ceiling: 1 GiB copy
  size_t big = 1ull << 30; void *a, *b; CK(cudaMalloc(&a, big)); CK(cudaMalloc(&b, big));
  float tc = time_it([&](int) { CK(cudaMemcpyAsync(b, a, big, cudaMemcpyDeviceToDevice)); }, 30);
  double ceil_gbs = 2.0 * big / tc / 1e3;
  printf("ceiling 1GiB memcpy %.1f us %.0f GB/s\n", tc, ceil_gbs);
  CK(cudaFree(a)); CK(cudaFree(b));
  size_t sizes[] = {16384ull * 1024 * 2, 16384ull * 4096 * 2, 8192ull * 16384 * 2};
  for (size_t bytes : sizes) {
    const int R = std::max<int>(2, (int)(200e6 / bytes) + 1);  // rotate > 3x L2 of inputs
    std::vector<uint4*> ins(R), outs(R);
    for (int r = 0; r < R; ++r) { CK(cudaMalloc(&ins[r], bytes)); CK(cudaMalloc(&outs[r], bytes)); CK(cudaMemset(ins[r], r + 1, bytes)); CK(cudaMemset(outs[r], 0, bytes)); }
    size_t nvec = bytes / 16;
    auto report = [&](const char* name, float us, double mult = 2.0) {
      printf("%10.1f MB %-34s %8.2f us %6.0f GB/s %5.1f%%\n", bytes / 1e6, name, us, mult * bytes / us / 1e3, 100.0 * mult * bytes / us / 1e3 / ceil_gbs);
    };
    report("memcpy", time_it([&](int i) { CK(cudaMemcpyAsync(outs[i % R], ins[i % R], bytes, cudaMemcpyDeviceToDevice)); }, 60));
    report("empty kernel", time_it([&](int i) { writeonly<<<1, 32>>>(ins[0], outs[i % R], 0); }, 60));
    for (int gm : {4, 8, 16}) {
      char n[64]; snprintf(n, 64, "gridstride256 x%dSM", gm);
      report(n, time_it([&](int i) { gridstride<<<sms * gm, 256>>>(ins[i % R], outs[i % R], nvec); }, 60));
    }
#define ONESHOT(U, S, L, BS) { char n[64]; snprintf(n, 64, "oneshot U%d st%d ld%d b%d", U, S, L, BS); \
    unsigned g = (unsigned)((nvec + (size_t)BS * U - 1) / ((size_t)BS * U)); \
    report(n, time_it([&](int i) { oneshot<U, S, L><<<g, BS>>>(ins[i % R], outs[i % R], nvec); }, 60)); }
    ONESHOT(1, 0, 0, 256) ONESHOT(2, 0, 0, 256) ONESHOT(4, 0, 0, 256) ONESHOT(8, 0, 0, 256)
    ONESHOT(4, 0, 0, 128) ONESHOT(4, 0, 0, 512) ONESHOT(2, 0, 0, 512)
    ONESHOT(4, 1, 0, 256) ONESHOT(4, 2, 0, 256) ONESHOT(4, 0, 1, 256) ONESHOT(4, 0, 2, 256) ONESHOT(4, 1, 1, 256)
    for (int gm : {2, 4, 8}) for (int bs : {256, 512}) {
      char n[64]; snprintf(n, 64, "persist U4 b%d x%dSM", bs, gm);
      report(n, time_it([&](int i) { persist<4><<<sms * gm, bs>>>(ins[i % R], outs[i % R], nvec); }, 60));
    }
    for (int ch : {16384, 32768}) {
      char n[64]; snprintf(n, 64, "bulk %d B/block", ch);
      unsigned g = (unsigned)(bytes / ch);
      if (ch == 16384) { CK(cudaFuncSetAttribute(bulk<16384>, cudaFuncAttributeMaxDynamicSharedMemorySize, ch));
        report(n, time_it([&](int i) { bulk<16384><<<g, 256, ch>>>(ins[i % R], outs[i % R], nvec); }, 60)); }
      else { CK(cudaFuncSetAttribute(bulk<32768>, cudaFuncAttributeMaxDynamicSharedMemorySize, ch));
        report(n, time_it([&](int i) { bulk<32768><<<g, 256, ch>>>(ins[i % R], outs[i % R], nvec); }, 60)); }
    }
    { unsigned g = (unsigned)((nvec + 1023) / 1024);
      report("readonly U4 (1x bytes)", time_it([&](int i) { readonly<<<g, 256>>>(ins[i % R], outs[i % R], nvec); }, 60), 1.0);
      report("writeonly U4 (1x bytes)", time_it([&](int i) { writeonly<<<g, 256>>>(ins[i % R], outs[i % R], nvec); }, 60), 1.0);
      report("memset (1x bytes)", time_it([&](int i) { CK(cudaMemsetAsync(outs[i % R], i, bytes)); }, 60), 1.0); }
    // correctness spot check of the oneshot kernel
    oneshot<4, 0, 0><<<(unsigned)((nvec + 1023) / 1024), 256>>>(ins[0], outs[0], nvec); CK(cudaDeviceSynchronize());
    uint16_t h[2]; CK(cudaMemcpy(h, outs[0], 4, cudaMemcpyDeviceToHost)); if (h[0] != (uint16_t)(0x0101 ^ 0x8000)) printf("MISMATCH %x\n", h[0]);
    for (int r = 0; r < R; ++r) { CK(cudaFree(ins[r])); CK(cudaFree(outs[r])); }
  }
  return 0;
}
