// Which statistics kernel and which backward tuning a CUDA FP8 RMSNorm runs, and the hooks for
// tests and benchmarks to force one. Not part of the public API: the public entry points choose
// automatically (fp8_norm_config.h) unless a test forces a choice or an override key
// ("fp8_norm.stats", "fp8_norm.backward.tuning", core/overrides.h) names one.
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

// Process-wide; `automatic` restores the normal choice (and the override key "fp8_norm.stats" is
// read only then). A forced `bulk` that cannot serve a call falls back to `registers`.
void set_stats_design_override(StatsDesign design);

// The statistics kernel the calling thread's most recent forward ran (`automatic` when it had no
// rows).
StatsDesign last_stats_design();

// Which tuning of the vector backward runs. A thread of the vector backward owns runs of 8
// columns of a row; the two tunings differ in how many runs a thread owns for rows of 1032-2048
// columns and in the L2 priority of the 4096-column staged kernel. Each is faster on one class
// of device and slower on the other, so the automatic choice keys on DRAM bytes per SM clock
// (fp8_norm_config.h). dx and dweight are each deterministic for a given tuning; the two tunings
// sum dweight's partial rows in different groupings, so they may differ in the last bits.
enum class BackwardTuning : int {
  automatic = 0,       // (override value) choose by the device
  four_runs_cached,    // 4 runs per thread up to 8192 columns, copies with the default L2 priority
  two_runs_streaming,  // 2 runs per thread in 128-thread groups for 1032-2048 columns, and the
                       // 4096-column staged kernel with L2 evict-first copies and streaming dx stores
};

const char* backward_tuning_name(BackwardTuning tuning);

// Process-wide; `automatic` restores the device's choice (the override key
// "fp8_norm.backward.tuning" is read only then).
void set_backward_tuning_override(BackwardTuning tuning);

// The tuning the calling thread's most recent vector backward used (`automatic` when none ran).
BackwardTuning last_backward_tuning();

}  // namespace fusekit::fp8_norm
