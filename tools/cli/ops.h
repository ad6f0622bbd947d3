// The op registry behind the CLI: what each op family is, which backends it has, how to check
// it against its CPU reference and how to benchmark it. Each new op family adds one entry.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "bench/harness/bench.h"
#include "fusekit/tensor.h"
#include "tests/harness/harness.h"

namespace fusekit::cli {

struct CheckLine {
  std::string op, backend, what;
  double error = 0, tolerance = 0;
  bool pass = false;
};

struct OpEntry {
  std::string name;
  std::string summary;
  std::string dtypes;
  std::vector<std::string> backends;
  // Runs the op on `device` against the CPU reference (on the CPU: the reference against finite
  // differences) and returns one line per compared output.
  std::function<std::vector<CheckLine>(Device device)> check;
  std::function<void(bench::Report&, const std::string& only)> bench;
};

const std::vector<OpEntry>& registry();

// One compared output: got against the float64 reference under the tests' tolerance rule
// (tests/harness/harness.h), reported for `op` on `device`.
CheckLine compared_line(const std::string& op, Device device, const std::string& what,
                        const std::vector<double>& got, const std::vector<double>& ref, DType dtype);

// The CPU checks' reference gradient: d/dparam of sum(y * dy) by central differences of step h,
// `forward` recomputing y from the parameters (param is restored afterwards).
std::vector<double> finite_difference_gradient(testing::Buffer& param, const testing::Buffer& y,
                                               const testing::Buffer& dy, double h,
                                               const std::function<void()>& forward);

// One per op family, defined in tools/cli/ops_<family>.cpp and called by registry().
void add_norm_ops(std::vector<OpEntry>& ops);
void add_bias_act_dropout_ops(std::vector<OpEntry>& ops);
void add_cross_entropy_ops(std::vector<OpEntry>& ops);
void add_gated_act_ops(std::vector<OpEntry>& ops);
void add_linear_ops(std::vector<OpEntry>& ops);
void add_linear_cross_entropy_ops(std::vector<OpEntry>& ops);
void add_fp8_norm_ops(std::vector<OpEntry>& ops);
void add_attention_ops(std::vector<OpEntry>& ops);
void add_rope_ops(std::vector<OpEntry>& ops);
void add_embedding_ops(std::vector<OpEntry>& ops);
void add_optim_ops(std::vector<OpEntry>& ops);

}  // namespace fusekit::cli
