#include "bench/harness/bench.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <curand_kernel.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "fusekit/runtime.h"

namespace fusekit::bench {

void check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("bench: " + what);
}

void cuda_check(int status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("bench: ") + what + ": " +
                             cudaGetErrorString(static_cast<cudaError_t>(status)));
}

DeviceBuffer::DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
  cuda_check(cudaMalloc(&ptr_, std::max<std::size_t>(bytes, 16)), "cudaMalloc");
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) cudaFree(ptr_);
}

namespace {
template <typename T>
__global__ void fill_normal_kernel(T* out, std::size_t n, std::uint64_t seed, float mean, float stddev) {
  const std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  curandStatePhilox4_32_10_t s;
  curand_init(seed, i, 0, &s);
  const float v = mean + stddev * curand_normal(&s);
  if constexpr (sizeof(T) == 2) out[i] = __float2bfloat16_rn(v);
  else out[i] = v;
}
}  // namespace

void DeviceBuffer::fill_random_bf16(std::uint64_t seed, float mean, float stddev) {
  const std::size_t n = bytes_ / 2;
  fill_normal_kernel<__nv_bfloat16><<<(n + 255) / 256, 256>>>(static_cast<__nv_bfloat16*>(ptr_), n, seed, mean, stddev);
  cuda_check(cudaGetLastError(), "fill_random_bf16");
}

void DeviceBuffer::fill_random_f32(std::uint64_t seed, float mean, float stddev) {
  const std::size_t n = bytes_ / 4;
  fill_normal_kernel<float><<<(n + 255) / 256, 256>>>(static_cast<float*>(ptr_), n, seed, mean, stddev);
  cuda_check(cudaGetLastError(), "fill_random_f32");
}

namespace {
Options& mutable_options() {
  static Options o;
  return o;
}
}  // namespace

void set_options(const Options& o) {
  if (o.row_pad < 0 || o.row_pad % 16 != 0 || o.row_pad > (1 << 20))
    throw std::runtime_error(fmt::format("--row-pad: expected a multiple of 16 in [0, 2^20], got {}", o.row_pad));
  if (o.batch < 1 || o.batch > 256)
    throw std::runtime_error(fmt::format("--batch: expected 1..256, got {}", o.batch));
  mutable_options() = o;
}

const Options& options() { return mutable_options(); }

std::vector<std::pair<std::int64_t, std::int64_t>> selected_shapes(
    const std::vector<std::pair<std::int64_t, std::int64_t>>& defaults) {
  const std::string& list = options().shapes;
  if (list.empty()) return defaults;
  const std::string bad = "--shapes: expected RxC[,RxC...] with positive sizes, got " + list;
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes;
  for (const char* p = list.c_str(); *p;) {
    char* end = nullptr;
    const long long r = std::strtoll(p, &end, 10);
    if (*end != 'x') throw std::runtime_error(bad);
    const long long c = std::strtoll(end + 1, &end, 10);
    if (r <= 0 || c <= 0 || (*end != ',' && *end != '\0')) throw std::runtime_error(bad);
    shapes.emplace_back(r, c);
    p = *end == ',' ? end + 1 : end;
  }
  return shapes;
}

std::int64_t row_pad_elements() { return options().row_pad; }

std::string padded_shape_label(std::int64_t rows, std::int64_t cols) {
  const std::int64_t pad = row_pad_elements();
  return pad == 0 ? fmt::format("({}, {})", rows, cols) : fmt::format("({}, {}) +{}", rows, cols, pad);
}

int rotations_for(std::size_t bytes) {
  int device = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  int l2 = 0;
  cuda_check(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device), "L2 size");
  const std::size_t want = 2 * static_cast<std::size_t>(l2);
  return static_cast<int>(std::max<std::size_t>(2, (want + bytes - 1) / std::max<std::size_t>(bytes, 1)));
}

Timing time_same_size_copy(std::size_t bytes, int rotations, const std::function<void*(int)>& dst,
                           const std::function<const void*(int)>& src) {
  return time_kernel(
      [&](int r) { cuda_check(cudaMemcpyAsync(dst(r), src(r), bytes, cudaMemcpyDeviceToDevice), "copy"); },
      rotations);
}

namespace {
// Occupies the GPU for `ns` nanoseconds on one warp: lets a run start after an idle gap while
// the host has already queued its events and launches (--gap-us).
__global__ void idle_gap_kernel(unsigned long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}
// Reads `n` 16-byte words: with a buffer several times L2, it leaves L2 holding clean lines only
// (--l2-flush: the previous run's dirty lines are written back before the next run).
__global__ void l2_flush_kernel(const uint4* p, std::size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x)
    acc ^= p[i].x;
  if (acc == 0x12345678u) *sink = acc;
}
}  // namespace

int batch_calls() { return options().batch; }

Timing time_kernel(const std::function<void(int)>& fn, int rotations, int warmup, int runs) {
  const unsigned long long gap_ns = 1000ull * options().gap_us;
  const bool flush = options().l2_flush;
  static void* flush_buf = nullptr;
  const std::size_t flush_bytes = std::size_t(256) << 20;
  if (flush && !flush_buf) {
    cuda_check(cudaMalloc(&flush_buf, flush_bytes + 64), "cudaMalloc");
    cuda_check(cudaMemset(flush_buf, 1, flush_bytes + 64), "cudaMemset");
  }
  const int batch = batch_calls();
  for (int i = 0; i < warmup; ++i) fn(i % rotations);
  cuda_check(cudaDeviceSynchronize(), "warm-up");
  std::vector<cudaEvent_t> start(runs), stop(runs);
  for (int i = 0; i < runs; ++i) {
    cuda_check(cudaEventCreate(&start[i]), "cudaEventCreate");
    cuda_check(cudaEventCreate(&stop[i]), "cudaEventCreate");
  }
  for (int i = 0; i < runs; ++i) {
    if (flush)
      l2_flush_kernel<<<132 * 8, 512>>>(static_cast<const uint4*>(flush_buf), flush_bytes / 16,
                                        reinterpret_cast<unsigned*>(static_cast<char*>(flush_buf) + flush_bytes));
    if (gap_ns) idle_gap_kernel<<<1, 32>>>(gap_ns);
    cuda_check(cudaEventRecord(start[i]), "cudaEventRecord");
    for (int b = 0; b < batch; ++b) fn((i * batch + b) % rotations);
    cuda_check(cudaEventRecord(stop[i]), "cudaEventRecord");
  }
  cuda_check(cudaDeviceSynchronize(), "timed runs");
  std::vector<double> us(runs);
  for (int i = 0; i < runs; ++i) {
    float ms = 0;
    cuda_check(cudaEventElapsedTime(&ms, start[i], stop[i]), "cudaEventElapsedTime");
    us[i] = ms * 1e3 / batch;
    cudaEventDestroy(start[i]);
    cudaEventDestroy(stop[i]);
  }
  std::sort(us.begin(), us.end());
  return {us[runs / 2], us.front(), us.back(), runs};
}

std::vector<Timing> time_in_turns(const std::vector<std::function<void(int)>>& fns, int rotations, int warmup,
                                  int runs) {
  const std::size_t n = fns.size();
  for (int i = 0; i < warmup; ++i)
    for (const auto& fn : fns) fn(i % rotations);
  cuda_check(cudaDeviceSynchronize(), "warm-up");
  // Per run: a start event, then one after each implementation.
  std::vector<cudaEvent_t> events((n + 1) * runs);
  for (cudaEvent_t& e : events) cuda_check(cudaEventCreate(&e), "cudaEventCreate");
  for (int i = 0; i < runs; ++i) {
    cudaEvent_t* e = &events[(n + 1) * i];
    cuda_check(cudaEventRecord(e[0]), "cudaEventRecord");
    for (std::size_t f = 0; f < n; ++f) {
      fns[f](i % rotations);
      cuda_check(cudaEventRecord(e[f + 1]), "cudaEventRecord");
    }
  }
  cuda_check(cudaDeviceSynchronize(), "timed runs");
  std::vector<std::vector<double>> us(n, std::vector<double>(runs));
  for (int i = 0; i < runs; ++i)
    for (std::size_t f = 0; f < n; ++f) {
      float ms = 0;
      cuda_check(cudaEventElapsedTime(&ms, events[(n + 1) * i + f], events[(n + 1) * i + f + 1]),
                 "cudaEventElapsedTime");
      us[f][i] = ms * 1e3;
    }
  for (cudaEvent_t& e : events) cudaEventDestroy(e);
  std::vector<Timing> out;
  for (auto& u : us) {
    std::sort(u.begin(), u.end());
    out.push_back(Timing{u[runs / 2], u.front(), u.back(), runs});
  }
  return out;
}

std::pair<Timing, Timing> time_interleaved(const std::function<void(int)>& a,
                                           const std::function<void(int)>& b, int rotations,
                                           int warmup, int runs) {
  const std::vector<Timing> t = time_in_turns({a, b}, rotations, warmup, runs);
  return {t[0], t[1]};
}

Ceilings measure_copy_ceiling() {
  Ceilings c;
  c.device = describe_cuda_device(0);
  {
    const std::size_t bytes = std::size_t(1) << 30;  // 1 GiB each way
    DeviceBuffer a(bytes), b(bytes);
    cuda_check(cudaMemset(a.get(), 1, bytes), "memset");
    const Timing t = time_kernel(
        [&](int r) {
          cuda_check(r % 2 ? cudaMemcpyAsync(a.get(), b.get(), bytes, cudaMemcpyDeviceToDevice)
                           : cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice),
                     "copy");
        },
        2, 3, 20);
    c.copy_gbps = 2.0 * bytes / t.median_us / 1e3;
  }
  return c;
}

double measure_gemm_ceiling() {
  double tflops = 0;
  {
    const int n = 8192;
    DeviceBuffer a(std::size_t(n) * n * 2), b(std::size_t(n) * n * 2), d(std::size_t(n) * n * 2);
    a.fill_random_bf16(1);
    b.fill_random_bf16(2);
    cublasHandle_t h;
    check(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS, "cublasCreate");
    const float alpha = 1.f, beta = 0.f;
    const Timing t = time_kernel(
        [&](int) {
          check(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.get(), CUDA_R_16BF, n,
                             b.get(), CUDA_R_16BF, n, &beta, d.get(), CUDA_R_16BF, n,
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS,
                "cublasGemmEx");
        },
        1, 5, 30);
    tflops = 2.0 * n * double(n) * n / t.median_us / 1e6;
    cublasDestroy(h);
  }
  return tflops;
}

void Report::print() const {
  fmt::print("device: {}\nceilings: copy {:.0f} GB/s (read+write), bf16 GEMM 8192^3 {:.1f} TFLOP/s\n",
             ceilings_.device, ceilings_.copy_gbps, ceilings_.gemm_tflops);
  // Memory-bound rows (flops == 0): bandwidth against the copy ceiling.
  const bool any_matrix = std::any_of(rows_.begin(), rows_.end(), [](const Row& r) { return r.flops > 0; });
  const bool any_memory = std::any_of(rows_.begin(), rows_.end(), [](const Row& r) { return r.flops <= 0; });
  if (any_memory || !any_matrix) {
    fmt::print("{:<14} {:<4} {:<22} {:<10} {:>10} {:>10} {:>8}\n", "op", "dir", "shape", "impl",
               "time_us", "GB/s", "%copy");
    for (const Row& r : rows_) {
      if (r.flops > 0) continue;
      fmt::print("{:<14} {:<4} {:<22} {:<10} {:>10.1f} {:>10.0f} {:>7.1f}%\n", r.op, r.direction,
                 r.shape, r.impl, r.time_us, r.gbps(), 100.0 * r.gbps() / ceilings_.copy_gbps);
    }
  }
  // Matrix rows (flops > 0): throughput against the bf16 GEMM ceiling.
  if (any_matrix) {
    fmt::print("{:<14} {:<4} {:<36} {:<16} {:>10} {:>10} {:>8}\n", "op", "dir", "shape", "impl",
               "time_us", "TFLOP/s", "%gemm");
    for (const Row& r : rows_) {
      if (r.flops <= 0) continue;
      fmt::print("{:<14} {:<4} {:<36} {:<16} {:>10.1f} {:>10.1f} {:>7.1f}%\n", r.op, r.direction,
                 r.shape, r.impl, r.time_us, r.tflops(), 100.0 * r.tflops() / ceilings_.gemm_tflops);
    }
  }
}

std::string Report::json() const {
  nlohmann::json j;
  j["device"] = ceilings_.device;
  j["ceilings"] = {{"copy_gbps", ceilings_.copy_gbps}, {"gemm_bf16_tflops", ceilings_.gemm_tflops}};
  j["rows"] = nlohmann::json::array();
  for (const Row& r : rows_) {
    j["rows"].push_back({{"op", r.op}, {"direction", r.direction}, {"shape", r.shape},
                         {"impl", r.impl}, {"time_us", r.time_us}, {"bytes", r.bytes},
                         {"gbps", r.gbps()}, {"fraction_of_copy", r.gbps() / ceilings_.copy_gbps}});
    if (r.flops > 0) {  // matrix ops also report throughput against the GEMM ceiling
      auto& row = j["rows"].back();
      row["flops"] = r.flops;
      row["tflops"] = r.tflops();
      row["fraction_of_gemm"] = r.tflops() / ceilings_.gemm_tflops;
    }
  }
  return j.dump(2);
}

}  // namespace fusekit::bench
