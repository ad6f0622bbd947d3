#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/harness/bench.h"

namespace fusekit::bench {

struct LinearBenchShape {
  std::int64_t m, k, n;  // x (m, k), W (n, k), y (m, n)
};

const std::vector<LinearBenchShape>& linear_bench_shapes();
// Adds forward and backward rows for every activation on every shape, with the plain cuBLAS GEMMs
// of the same shapes measured in the same run ("cublas_plain").
void bench_linear(Report& report, const std::string& only);

// (M, K, F) per shape: x (M, K), W (2F, K), y (M, F).
const std::vector<LinearBenchShape>& gated_linear_bench_shapes();
// Forward and backward rows of gated_linear (SwiGLU, interleaved W) on every shape, with the plain
// cuBLAS GEMMs of the same total shape measured in the same run ("cublas_plain").
void bench_gated_linear(Report& report, const std::string& only);

}  // namespace fusekit::bench
