// Text generation from the trained model: each next byte drawn from the softmax of the last
// position's logits at a temperature, over the tokenizer's ids only (the padded rows excluded).
#pragma once

#include <cstdint>
#include <string>

#include "model.h"

namespace train_gpt {

// Continues `prompt` by `count` tokens (a sliding window of the last seq_len tokens feeds each
// forward pass) and returns the continuation. Deterministic for a seed.
std::string sample_text(Model& model, const ModelConfig& config, const std::string& prompt, std::int64_t count,
                        float temperature, std::uint64_t seed);

}  // namespace train_gpt
