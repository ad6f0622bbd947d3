// The model's shape and the run's settings of the GPT-2-style trainer.
#pragma once

#include <cstdint>
#include <string>

#include <fusekit/tensor.h>

namespace train_gpt {

// A GPT-2 decoder: token and position embeddings, n_layer pre-norm blocks (LayerNorm, causal
// self-attention, LayerNorm, GELU MLP of width 4 * n_embd), a final LayerNorm and an output layer
// tied to the token embedding.
struct ModelConfig {
  std::int64_t n_layer = 4;
  std::int64_t n_head = 4;
  std::int64_t n_embd = 128;
  std::int64_t seq_len = 64;         // the longest context (rows of the position embedding)
  std::int64_t vocab = 256;          // ids the tokenizer produces
  std::int64_t padded_vocab = 256;   // rows of the token embedding / classes of the softmax

  std::int64_t head_dim() const { return n_embd / n_head; }
  friend bool operator==(const ModelConfig&, const ModelConfig&) = default;
};

// What runs without a GPU: 4 layers, 4 heads, width 128, context 64, the 256 byte ids.
ModelConfig tiny_config();
// GPT-2 small's shapes (124M parameters with its 50257-token vocabulary): 12 layers, 12 heads,
// width 768, context 1024, the vocabulary padded to 50304 (a multiple of 128, as llm.c does). The
// byte tokenizer uses only ids < 256; the other rows are trained towards never being predicted.
ModelConfig gpt2_124m_config();
// "tiny" or "gpt2-124m"; throws std::invalid_argument otherwise.
ModelConfig preset_config(const std::string& name);

// Throws std::invalid_argument naming the field when the shapes cannot form a model.
void validate(const ModelConfig& config);

std::string describe(const ModelConfig& config);

// Where the model lives and the dtype its activations have: float32 on the CPU backend, bfloat16
// on a GPU (with float32 master weights and optimizer state on both). `stream`: the CUDA stream
// every fusekit call of this model runs on (a data-parallel replica has its own; nullptr is the
// device's default stream, and the CPU backend ignores it).
struct Backend {
  fusekit::Device device = fusekit::Device::cpu();
  fusekit::DType compute_dtype = fusekit::DType::f32;
  fusekit::Stream stream = nullptr;

  static Backend cpu() { return {fusekit::Device::cpu(), fusekit::DType::f32}; }
  static Backend cuda(int index) { return {fusekit::Device::cuda(index), fusekit::DType::bf16}; }
};

// Dropout rates and the randomness of one step: every dropout mask is a function of (seed, step,
// layer, site), so a resumed run draws the same masks.
struct DropoutConfig {
  float p = 0.0f;          // attention probabilities and both residual projections
  std::uint64_t seed = 0;
  std::int64_t step = 0;
};

}  // namespace train_gpt
