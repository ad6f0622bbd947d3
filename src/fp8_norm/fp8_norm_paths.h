// Which statistics kernel a CUDA FP8 RMSNorm forward runs, and a hook for tests and benchmarks to
// force one. Not part of the public API: the public entry point chooses automatically unless a
// test has set an override or FUSEKIT_FP8_STATS (benchmarks) names a design.
#pragma once

namespace fusekit::fp8_norm {

// How the forward's statistics kernel gets x and its scales.
enum class StatsDesign : int {
  automatic = 0,  // (override value) let the library choose
  registers,      // 16-byte register loads, row groups of 1 to 32 threads (any vector-path layout)
  bulk,           // bulk copies (TMA) into a ring per warp (N a multiple of 2048, 16-byte chunks of scales)
  generic,        // (reported only) element by element: unaligned rows or groups under 16
};

const char* stats_design_name(StatsDesign design);

// Process-wide; `automatic` restores the normal choice (and FUSEKIT_FP8_STATS=registers|bulk is
// read only then). A forced `bulk` that cannot serve a call falls back to `registers`.
void set_stats_design_override(StatsDesign design);

// The statistics kernel the calling thread's most recent forward ran (`automatic` when it had no
// rows).
StatsDesign last_stats_design();

// Which tuning of the vector backward runs. The same kernels' best shapes differ between devices
// by their DRAM bandwidth per SM clock (DeviceInfo::dram_bytes_per_sm_clock): measured on an H100
// (12.83 bytes) and an H200 (18.42) in session 40, each choice below won on one and lost on the
// other. dx and dweight are each deterministic for a given tuning; the two tunings sum dweight's
// partial rows in different groupings, so they may differ in the last bits.
enum class BackwardTuning : int {
  automatic = 0,  // (override value) choose by the device
  rich_bandwidth,  // >= 15 bytes per SM clock (H200): the kernels as tuned since session 9
  lean_bandwidth,  // under 15 (H100 SXM): N <= 2048 in 128-thread groups of 2 octs per thread,
                   // the N = 4096 staged kernel with L2 evict-first copies and streaming dx stores
};

const char* backward_tuning_name(BackwardTuning tuning);

// Process-wide; `automatic` restores the device's choice (FUSEKIT_FP8_BWD_TUNING=lean|rich is read
// only then).
void set_backward_tuning_override(BackwardTuning tuning);

// The tuning the calling thread's most recent vector backward used (`automatic` when none ran).
BackwardTuning last_backward_tuning();

}  // namespace fusekit::fp8_norm
