#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "bench/harness/bench.h"

namespace fusekit::bench {

const std::vector<std::pair<std::int64_t, std::int64_t>>& norm_bench_shapes();
// Adds rows for layer_norm and rms_norm ("norm", an op name, or "" for both).
void bench_norm(Report& report, const std::string& only);

}  // namespace fusekit::bench
