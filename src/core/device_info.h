// Cached properties of a CUDA device, read once per device.
#pragma once

#include <string>

namespace fusekit::detail {

struct DeviceInfo {
  std::string name;
  int major = 0, minor = 0;
  int sm_count = 0;
  int l2_bytes = 0;
  std::size_t max_smem_per_block_optin = 0;
  int max_threads_per_sm = 0;
  // Peak DRAM bytes (read + write) per SM and SM clock, from the rated memory clock and bus width
  // and the peak SM clock: 12.83 on an H100 SXM (3.35 TB/s), 18.42 on an H200 (4.8 TB/s). Tuning
  // tables of memory-bound kernels key on it. 0 where the driver does not report the clocks.
  double dram_bytes_per_sm_clock = 0.0;
};

// Throws Error(invalid_argument) for a device index that does not exist.
const DeviceInfo& device_info(const char* op, int device_index);

}  // namespace fusekit::detail
