// DeviceInfo of the GPUs the config tables are tested against, as the driver reports them.
#pragma once

#include "core/device_info.h"

namespace fusekit::testing {

inline detail::DeviceInfo h100_device() {
  detail::DeviceInfo d;
  d.name = "NVIDIA H100 80GB HBM3";
  d.major = 9, d.minor = 0, d.sm_count = 132, d.l2_bytes = 50 << 20;
  d.max_smem_per_block_optin = 232448, d.max_threads_per_sm = 2048, d.dram_bytes_per_sm_clock = 12.83;
  return d;
}

inline detail::DeviceInfo h200_device() {
  detail::DeviceInfo d = h100_device();
  d.name = "NVIDIA H200";
  d.l2_bytes = 60 << 20;
  d.dram_bytes_per_sm_clock = 18.42;
  return d;
}

inline detail::DeviceInfo a100_device() {
  detail::DeviceInfo d;
  d.name = "NVIDIA A100-SXM4-80GB";
  d.major = 8, d.minor = 0, d.sm_count = 108, d.l2_bytes = 40 << 20;
  d.max_smem_per_block_optin = 166912, d.max_threads_per_sm = 2048, d.dram_bytes_per_sm_clock = 13.6;
  return d;
}

}  // namespace fusekit::testing
