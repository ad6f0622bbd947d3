// The GPT-2 forward and backward passes, every numeric step a fusekit call.
//
// The residual stream r_0 .. r_2L: r_0 = wte[tokens] + wpe (embedding_forward), and each block adds
// its attention branch (r_2l+1) and its MLP branch (r_2l+2). The LayerNorm that follows each
// addition is fused with it (layer_norm_residual_forward writes both the sum and the normalized
// rows), so block l reads ln_1(r_2l), and the final norm is ln_f(r_2L).
//
//   attention branch: qkv = ln_1 W_qkv^T + b_qkv (linear_forward); q, k, v are strided views of
//     qkv's (B, T, 3, H, D) layout (no copies); causal attention with dropout (attention_forward);
//     the projection without bias (linear_forward), then bias + dropout (bias_act_dropout_forward,
//     activation none).
//   MLP branch: h = gelu_tanh(ln_2 W_fc^T + b_fc) (linear_forward, the pre-activation kept for the
//     backward); the projection without bias, then bias + dropout as above.
//   output: the loss of softmax(ln_f(r_2L) wte^T) against the next tokens (linear_cross_entropy,
//     mean over the B*T rows), the logits never materialized; its dh and d wte in the same call.
//
// The backward runs the same calls' backward counterparts in reverse. d r_k flows through two
// alternating buffers: layer_norm_residual_backward returns LN'(d ln) + d r_k+1, the gradient of
// both the branch output and the residual input. embedding_backward adds the token rows' gradient
// to the output layer's (accumulate; the position rows are zeroed first).
//
// A step is forward_backward() (every parameter's gradient written, none accumulated), then the
// optimizer; data-parallel training averages the replicas' gradients between the two (trainer.h).
// Every call runs on the parameters' Backend::stream.
#pragma once

#include <cstdint>
#include <vector>

#include <fusekit/activation.h>
#include <fusekit/tensor.h>

#include "config.h"
#include "memory.h"
#include "params.h"

namespace train_gpt {

class Model {
 public:
  // Activations for up to `batch` sequences of config.seq_len tokens.
  Model(Parameters& params, std::int64_t batch, bool deterministic, Arena& arena);

  std::int64_t batch() const { return batch_; }

  // Uploads `sequences` (<= batch) sequences of inputs and targets (sequences * seq_len each).
  void set_batch(const std::vector<std::int32_t>& inputs, const std::vector<std::int32_t>& targets,
                 std::int64_t sequences);

  // The mean loss over the batch set last, with every parameter gradient written.
  float forward_backward(const DropoutConfig& dropout);
  // The same work enqueued on the backend's stream without waiting for it; loss_value() then
  // reads the loss (waiting for it), so that a step synchronizes once.
  void enqueue_forward_backward(const DropoutConfig& dropout);
  float loss_value() const;
  // Whether enqueue_forward_backward replays the step as one recorded CUDA graph (memory.h's
  // StreamGraph) instead of launching its ops one by one. Taken on a GPU at dropout 0 only: with
  // dropout the masks' Philox offsets, kernel arguments, change every step. The first step of a
  // batch size runs directly (ops that tune themselves on a problem's first call time their
  // candidates then, which a recording cannot); the second records and replays; later ones replay.
  void set_step_graph(bool on) { step_graph_ = on; }
  bool step_graph_taken(const DropoutConfig& dropout) const;
  std::int64_t graph_replays() const { return graph_replays_; }
  // The mean loss without gradients (dropout off unless given: a gradient check compares this
  // with forward_backward under the same masks).
  float loss(const DropoutConfig& dropout = DropoutConfig{});
  // The logits (padded_vocab floats) after position `position` of the first sequence of the
  // batch set last (one sequence, dropout off): the sampler's call.
  std::vector<float> next_token_logits(std::int64_t position);

  // Matmul FLOPs per token of one training step (forward + backward): 6 per weight of the linear
  // layers and the output layer, plus the attention score and value products (12 L T C; PaLM's
  // count, the causal mask not subtracted).
  double training_flops_per_token() const;

  // The three dropout sites of a block, each with its own Philox offset per (step, layer).
  enum class DropoutSite : std::uint64_t { attention = 0, attention_proj = 1, mlp_proj = 2 };

 private:
  struct BlockActs {
    fusekit::TensorView ln1, ln1_mean, ln1_rstd, qkv, att, lse, att_proj;
    fusekit::TensorView ln2, ln2_mean, ln2_rstd, fc_pre, fc, fc_proj;
  };
  // A view of `buffer`'s first `rows_` sequences.
  fusekit::TensorView rows(const fusekit::TensorView& buffer) const;
  // The first rows_ sequences of a contiguous (B, T, C) tensor as (B, T, H, D): attention's layout.
  fusekit::TensorView heads(const fusekit::TensorView& x) const;
  // q, k or v (part 0, 1, 2) of a (B, T, 3C) tensor as a (B, T, H, D) view.
  fusekit::TensorView qkv_part(const fusekit::TensorView& qkv, int part) const;
  void forward(const DropoutConfig& dropout);
  void backward(const DropoutConfig& dropout);
  // The step's ops: forward, the loss with dh and d wte, backward.
  void enqueue_step(const DropoutConfig& dropout);
  void projection_forward(const fusekit::TensorView& in, const fusekit::TensorView& weight,
                          const fusekit::TensorView& bias, const fusekit::TensorView& pre_dropout,
                          const DropoutConfig& dropout, std::int64_t layer, DropoutSite site);
  // A projection's input that is an activation's output: its pre-activation, the activation, and
  // where the gradient's column sums go (the bias gradient of the layer that produced `pre`).
  struct InputActivation {
    fusekit::TensorView pre;
    fusekit::Activation activation;
    fusekit::TensorView dbias;
  };
  void projection_backward(const fusekit::TensorView& d_out, const fusekit::TensorView& in,
                           const fusekit::TensorView& weight, const fusekit::TensorView& bias,
                           const fusekit::TensorView& pre_dropout, const fusekit::TensorView& d_in,
                           const fusekit::TensorView& d_weight, const fusekit::TensorView& d_bias,
                           const DropoutConfig& dropout, std::int64_t layer, DropoutSite site,
                           const InputActivation* input = nullptr);

  Parameters& params_;
  ModelConfig config_;
  Backend backend_;
  std::int64_t batch_;
  std::int64_t rows_ = 0;  // sequences in the batch set last
  bool deterministic_;

  fusekit::TensorView inputs_, targets_;
  std::vector<fusekit::TensorView> resid_;  // r_0 .. r_2L
  std::vector<BlockActs> blocks_;
  fusekit::TensorView branch_, lnf_, lnf_mean_, lnf_rstd_, loss_;
  // Gradients of activations, reused by every block.
  fusekit::TensorView d_lnf_, d_resid_[2], d_ln_, d_branch_, d_att_, d_qkv_, d_fc_;
  fusekit::TensorView logits_;
  fusekit::TensorView workspace_;

  bool step_graph_ = false;
  StreamGraph graph_;
  std::int64_t graph_rows_ = 0;   // the batch size graph_ was recorded at
  std::int64_t direct_rows_ = 0;  // the batch size of the last step run directly
  std::int64_t graph_replays_ = 0;
};

}  // namespace train_gpt
