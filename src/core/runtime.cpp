#include "fusekit/runtime.h"

#include <cuda_runtime.h>

#include <array>
#include <mutex>

#include "core/cuda_check.h"
#include "core/device_info.h"
#include "fusekit/error.h"

#ifndef FUSEKIT_CUDA_ARCHS
#define FUSEKIT_CUDA_ARCHS "unknown"
#endif
#ifndef FUSEKIT_VERSION
#define FUSEKIT_VERSION "unknown"
#endif

namespace fusekit {

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error so later calls start clean
    return 0;
  }
  return count;
}

const char* built_cuda_architectures() { return FUSEKIT_CUDA_ARCHS; }

const char* version() { return FUSEKIT_VERSION; }

namespace detail {

const DeviceInfo& device_info(const char* op, int device_index) {
  constexpr int kMaxDevices = 64;
  static std::array<DeviceInfo, kMaxDevices> cache{};
  static std::array<std::once_flag, kMaxDevices> once;
  const int count = cuda_device_count();
  if (device_index < 0 || device_index >= kMaxDevices || device_index >= count) {
    const std::string expected =
        count == 0 ? "a CUDA device present on this machine (it has none: no GPU or no CUDA driver)"
                   : "a CUDA device index below " + std::to_string(count);
    throw Error(ErrorKind::invalid_argument, op, "device", expected, "cuda:" + std::to_string(device_index));
  }
  std::call_once(once[device_index], [&] {
    cudaDeviceProp prop{};
    check_cuda(cudaGetDeviceProperties(&prop, device_index), op, "cudaGetDeviceProperties");
    DeviceInfo& info = cache[device_index];
    info.name = prop.name;
    info.major = prop.major;
    info.minor = prop.minor;
    info.sm_count = prop.multiProcessorCount;
    info.l2_bytes = prop.l2CacheSize;
    info.max_smem_per_block_optin = prop.sharedMemPerBlockOptin;
    info.max_threads_per_sm = prop.maxThreadsPerMultiProcessor;
    int memory_khz = 0, bus_bits = 0, sm_khz = 0;
    if (cudaDeviceGetAttribute(&memory_khz, cudaDevAttrMemoryClockRate, device_index) == cudaSuccess &&
        cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device_index) == cudaSuccess &&
        cudaDeviceGetAttribute(&sm_khz, cudaDevAttrClockRate, device_index) == cudaSuccess && sm_khz > 0 &&
        info.sm_count > 0) {
      // Double data rate: two transfers of bus_bits per memory clock.
      info.dram_bytes_per_sm_clock =
          2.0 * memory_khz * (bus_bits / 8.0) / (double(sm_khz) * info.sm_count);
    } else {
      cudaGetLastError();  // an attribute the driver lacks is not an error of the caller's
    }
  });
  return cache[device_index];
}

}  // namespace detail

// The kernels are compiled for sm_90a only (wgmma, TMA, Hopper tuning): nothing else can run
// them, so say so instead of failing later with "no kernel image is available".
bool supports_compute_capability(int major, int minor) { return major == 9 && minor == 0; }

bool cuda_device_supported(int device_index) {
  if (device_index < 0 || device_index >= cuda_device_count()) return false;
  const detail::DeviceInfo& info = detail::device_info("cuda_device_supported", device_index);
  return supports_compute_capability(info.major, info.minor);
}

void require_supported_gpu(const char* op, int device_index) {
  const detail::DeviceInfo& info = detail::device_info(op, device_index);
  if (!supports_compute_capability(info.major, info.minor)) {
    throw Error(ErrorKind::unsupported, op,
                "GPU " + std::to_string(device_index) + " (" + info.name + ", compute capability " +
                    std::to_string(info.major) + "." + std::to_string(info.minor) +
                    ") is not supported: this build of fusekit runs on compute capability 9.0 "
                    "(Hopper: H100, H200) only; built for sm_" FUSEKIT_CUDA_ARCHS);
  }
}

std::string describe_cuda_device(int device_index) {
  const detail::DeviceInfo& info = detail::device_info("describe_cuda_device", device_index);
  return std::string(info.name) + " (sm_" + std::to_string(info.major) + std::to_string(info.minor) + ", " +
         std::to_string(info.sm_count) + " SMs, " + std::to_string(info.l2_bytes / (1024 * 1024)) + " MB L2)";
}

}  // namespace fusekit
