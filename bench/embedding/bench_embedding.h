#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "bench/harness/bench.h"

namespace fusekit::bench {

// (tokens, C) over GPT-2's vocabulary (50257): sequences of 1024 tokens, the embedding widths of
// GPT-2 small (768), medium (1024), XL (1600) and a 4096-wide model.
const std::vector<std::pair<std::int64_t, std::int64_t>>& embedding_bench_shapes();
// Adds "embedding" rows (fwd, bwd; bf16 tables with position embeddings, int64 tokens, f32 dweight).
void bench_embedding(Report& report);

}  // namespace fusekit::bench
