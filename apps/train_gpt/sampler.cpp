#include "sampler.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "data.h"
#include "rng.h"

namespace train_gpt {

std::string sample_text(Model& model, const ModelConfig& config, const std::string& prompt, std::int64_t count,
                        float temperature, std::uint64_t seed) {
  std::vector<std::int32_t> context = encode_bytes(prompt.empty() ? std::string("\n") : prompt);
  std::vector<std::int32_t> generated;
  SplitMix64 rng(seed);
  const auto T = static_cast<std::size_t>(config.seq_len);
  std::vector<std::int32_t> window(T), unused(T);
  for (std::int64_t n = 0; n < count; ++n) {
    // The last (at most) T tokens, left-aligned; the causal mask makes the padding after them
    // invisible to the position read.
    const std::size_t used = std::min(context.size(), T);
    std::fill(window.begin(), window.end(), 0);
    std::copy(context.end() - static_cast<std::ptrdiff_t>(used), context.end(), window.begin());
    model.set_batch(window, unused, 1);
    const std::vector<float> logits = model.next_token_logits(static_cast<std::int64_t>(used) - 1);
    // The softmax at the temperature over the real vocabulary, on the host (256 values).
    const auto V = static_cast<std::size_t>(config.vocab);
    const float top = *std::max_element(logits.begin(), logits.begin() + static_cast<std::ptrdiff_t>(V));
    std::vector<double> weights(V);
    double total = 0.0;
    for (std::size_t v = 0; v < V; ++v) total += weights[v] = std::exp((logits[v] - top) / std::max(temperature, 1e-4f));
    double pick = rng.uniform() * total;
    std::size_t token = V - 1;
    for (std::size_t v = 0; v < V; ++v) {
      if ((pick -= weights[v]) < 0.0) {
        token = v;
        break;
      }
    }
    context.push_back(static_cast<std::int32_t>(token));
    generated.push_back(static_cast<std::int32_t>(token));
  }
  return decode_bytes(generated);
}

}  // namespace train_gpt
