#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "bench/harness/bench.h"

namespace fusekit::bench {

const std::vector<std::pair<std::int64_t, std::int64_t>>& fp8_norm_bench_shapes();

// Adds fwd and bwd rows for fp8_rms_norm (e4m3 input and output, groups of 16, bf16 scales and
// weight) on the shapes.
void bench_fp8_norm(Report& report);

// Device buffers of random inputs: `n` fp8 e4m3 values (normal, spread over the format's range,
// some saturated) and `n_scales` positive bf16 scales (never zero, never NaN).
void fill_fp8_norm_inputs(void* x_e4m3, std::size_t n, void* scales_bf16, std::size_t n_scales,
                          std::uint64_t seed);

}  // namespace fusekit::bench
