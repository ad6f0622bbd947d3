// Which design a CUDA FP8 RMSNorm forward runs, and a hook for tests and benchmarks to force one.
// Not part of the public API: the public entry point chooses automatically unless a test has set
// an override or FUSEKIT_FP8_FORWARD (benchmarks) names a design.
#pragma once

namespace fusekit::fp8_norm {

enum class ForwardDesign : int {
  automatic = 0,  // (override value) let the library choose
  fused,          // one cooperative kernel, part of x kept in shared memory between the phases
  two_pass,       // the statistics kernel, then the quantize/transpose kernel
};

const char* forward_design_name(ForwardDesign design);

// Process-wide; `automatic` restores the normal choice (and FUSEKIT_FP8_FORWARD=fused|two_pass
// is read only then). A forced `fused` that cannot serve a call (alignment, shape, y requested)
// leaves that call to the two-pass design; last_forward_design() tells what ran.
void set_forward_design_override(ForwardDesign design);

// The design the calling thread's most recent CUDA fp8_rms_norm_forward ran.
ForwardDesign last_forward_design();

// How the two-pass forward's statistics kernel gets x and its scales.
enum class StatsDesign : int {
  automatic = 0,  // (override value) let the library choose
  registers,      // 16-byte register loads, row groups of 1 to 32 threads (any vector-path layout)
  bulk,           // bulk copies (TMA) into a ring per warp (N a multiple of 2048, 16-byte chunks of scales)
  generic,        // (reported only) element by element: unaligned rows or groups under 16
};

const char* stats_design_name(StatsDesign design);

// Process-wide, like the forward design override; FUSEKIT_FP8_STATS=registers|bulk is read only
// when no override is set. A forced `bulk` that cannot serve a call falls back to `registers`.
void set_stats_design_override(StatsDesign design);

// The statistics kernel the calling thread's most recent two-pass forward ran (`automatic` when
// the forward ran fused or had no rows).
StatsDesign last_stats_design();

}  // namespace fusekit::fp8_norm
