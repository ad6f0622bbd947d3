#pragma once

#include <cstdint>
#include <vector>

#include "bench/harness/bench.h"

namespace fusekit::bench {

// The parameter shapes of GPT-2 small (124M parameters in 148 tensors): token and position
// embeddings, 12 blocks of two LayerNorms, attention and MLP weights and biases, the final norm.
std::vector<std::vector<std::int64_t>> gpt2_small_parameter_shapes();
// Adds "global_norm" (bf16 gradients) and "adamw_step" rows (bf16 gradients with bf16 copies,
// with and without clipping; f32 gradients without copies) over those tensors.
void bench_optim(Report& report);

}  // namespace fusekit::bench
