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

}  // namespace fusekit::fp8_norm
