#include "config.h"

#include <stdexcept>

namespace train_gpt {

ModelConfig tiny_config() { return ModelConfig{4, 4, 128, 64, 256, 256}; }

ModelConfig gpt2_124m_config() { return ModelConfig{12, 12, 768, 1024, 256, 50304}; }

ModelConfig preset_config(const std::string& name) {
  if (name == "tiny") return tiny_config();
  if (name == "gpt2-124m") return gpt2_124m_config();
  throw std::invalid_argument("unknown model preset '" + name + "' (known: tiny, gpt2-124m)");
}

void validate(const ModelConfig& c) {
  auto require = [](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("model config: " + what);
  };
  require(c.n_layer >= 1, "n_layer must be >= 1");
  require(c.n_head >= 1, "n_head must be >= 1");
  require(c.n_embd >= 1 && c.n_embd % c.n_head == 0, "n_embd must be a positive multiple of n_head");
  // The attention kernels read q, k and v as strided views of one (B, T, 3, H, D) tensor: 16-byte
  // rows of the head dimension for every dtype the trainer uses.
  require(c.head_dim() % 8 == 0, "n_embd / n_head must be a multiple of 8");
  require(c.seq_len >= 1, "seq_len must be >= 1");
  require(c.vocab >= 1 && c.vocab <= c.padded_vocab, "vocab must be in 1 .. padded_vocab");
  require(c.padded_vocab % 8 == 0, "padded_vocab must be a multiple of 8");
}

std::string describe(const ModelConfig& c) {
  return "layers " + std::to_string(c.n_layer) + ", heads " + std::to_string(c.n_head) + ", width " +
         std::to_string(c.n_embd) + ", context " + std::to_string(c.seq_len) + ", vocab " +
         std::to_string(c.vocab) + " (padded to " + std::to_string(c.padded_vocab) + ")";
}

}  // namespace train_gpt
