// The parameter table: every trainable tensor of the model with its shape, initialization and
// whether weight decay applies, and the tensors the trainer keeps for each:
//   master      float32, what AdamW updates and checkpoints store;
//   compute     what the ops read: the master itself where the op takes float32 (LayerNorm
//               weights, the biases added by bias_act_dropout, everything on the CPU backend), a
//               bfloat16 copy on the GPU otherwise (AdamW rewrites it from the master);
//   grad        float32, except for the weights and biases linear_backward writes: those are in
//               the compute dtype (linear writes dW and dbias in its input's dtype); all of one
//               dtype lie in one contiguous block (grad_buckets), so that a data-parallel run
//               averages them with one all-reduce per dtype;
//   exp_avg, exp_avg_sq  AdamW's moments, float32.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <fusekit/tensor.h>

#include "config.h"
#include "memory.h"

namespace train_gpt {

struct ParamInfo {
  std::string name;
  std::vector<std::int64_t> shape;
  float init_std = 0.0f;   // > 0: normal(0, init_std); else the constant init_value
  float init_value = 0.0f;
  bool decay = false;      // weight decay applies (the 2-D weights, embeddings included)
  bool float32_op = false; // the ops that read it take float32 whatever the activations' dtype
  bool linear_op = false;  // a weight or bias of linear_forward (its gradient in the compute dtype)
  std::int64_t numel() const;
};

// The tensor indices of one block's parameters.
struct BlockParams {
  int ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, fcproj_w, fcproj_b;
};

// The model's parameters in checkpoint order, without memory.
struct ParamLayout {
  std::vector<ParamInfo> info;
  int wte = -1, wpe = -1, lnf_w = -1, lnf_b = -1;
  std::vector<BlockParams> blocks;

  std::int64_t count() const;  // elements of all parameters
};

ParamLayout param_layout(const ModelConfig& config);

class Parameters {
 public:
  Parameters(const ModelConfig& config, const Backend& backend, Arena& arena);

  const ParamLayout& layout() const { return layout_; }
  const ModelConfig& config() const { return config_; }
  const Backend& backend() const { return backend_; }
  std::size_t size() const { return layout_.info.size(); }

  // GPT-2's initialization from `seed` (normal(0, 0.02), the residual projections scaled by
  // 1 / sqrt(2 n_layer), biases 0, LayerNorm weights 1); the moments zeroed.
  void initialize(std::uint64_t seed);

  // All master values in layout order (count() floats), and back (the compute copies follow).
  std::vector<float> master_values() const;
  void set_master_values(const std::vector<float>& values);
  // Moments in layout order, for checkpoints.
  std::vector<float> moment_values(bool second) const;
  void set_moment_values(bool second, const std::vector<float>& values);
  // Rewrites the low-precision compute copies from the masters (after initialization or loading).
  void refresh_compute_copies();
  // Gradients as float32 in layout order (tests).
  std::vector<float> grad_values() const;
  // A 64-bit hash of each master tensor's bytes, in layout order: data-parallel replicas, which
  // must stay bitwise identical, compare these.
  std::vector<std::uint64_t> master_hashes() const;

  std::vector<fusekit::TensorView> master, compute, grad, exp_avg, exp_avg_sq;
  // One 1-D view per gradient dtype over the block that holds every gradient of that dtype (each
  // tensor 256-byte aligned in it; the padding between them stays zero).
  std::vector<fusekit::TensorView> grad_buckets;
  // Whether compute[i] is a separate low-precision copy of master[i].
  std::vector<bool> has_copy;

 private:
  ModelConfig config_;
  Backend backend_;
  ParamLayout layout_;
};

}  // namespace train_gpt
