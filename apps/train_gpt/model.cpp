#include "model.h"

#include <fusekit/fusekit.h>

#include <algorithm>
#include <stdexcept>

namespace train_gpt {

using fusekit::Activation;
using fusekit::DType;
using fusekit::TensorView;
using std::nullopt;

using DropoutSite = Model::DropoutSite;

namespace {

constexpr float kLayerNormEps = 1e-5f;

std::uint64_t dropout_offset(const DropoutConfig& d, std::int64_t n_layer, std::int64_t layer, DropoutSite site) {
  // Attention takes offsets below 2^32; a run would need a billion steps to wrap.
  const auto index = (static_cast<std::uint64_t>(d.step) * static_cast<std::uint64_t>(n_layer) +
                      static_cast<std::uint64_t>(layer)) * 3 + static_cast<std::uint64_t>(site);
  return index & 0xFFFFFFFFull;
}

fusekit::AttentionConfig attention_config(const DropoutConfig& d, std::int64_t n_layer, std::int64_t layer) {
  fusekit::AttentionConfig c;
  c.mask = fusekit::AttentionMask::causal_top_left;
  c.dropout_p = d.p;
  c.seed = d.seed;
  c.offset = dropout_offset(d, n_layer, layer, DropoutSite::attention);
  return c;
}

fusekit::BiasActDropoutConfig bias_dropout_config(const DropoutConfig& d, std::int64_t n_layer, std::int64_t layer,
                                                  DropoutSite site) {
  fusekit::BiasActDropoutConfig c;
  c.activation = Activation::none;
  c.p = d.p;
  c.seed = d.seed;
  c.offset = dropout_offset(d, n_layer, layer, site);
  return c;
}

fusekit::CrossEntropyConfig loss_config() {
  fusekit::CrossEntropyConfig c;
  c.reduction = fusekit::LossReduction::mean;
  return c;
}

}  // namespace

Model::Model(Parameters& params, std::int64_t batch, bool deterministic, Arena& arena)
    : params_(params), config_(params.config()), backend_(params.backend()), batch_(batch),
      deterministic_(deterministic) {
  if (batch < 1) throw std::invalid_argument("batch must be >= 1");
  const std::int64_t B = batch, T = config_.seq_len, C = config_.n_embd, H = config_.n_head;
  const DType dt = backend_.compute_dtype;
  const DType f32 = DType::f32;
  inputs_ = arena.tensor(DType::i32, {B, T});
  targets_ = arena.tensor(DType::i32, {B, T});
  for (std::int64_t k = 0; k <= 2 * config_.n_layer; ++k) resid_.push_back(arena.tensor(dt, {B, T, C}));
  for (std::int64_t l = 0; l < config_.n_layer; ++l) {
    BlockActs a;
    a.ln1 = arena.tensor(dt, {B, T, C});
    a.ln1_mean = arena.tensor(f32, {B * T});
    a.ln1_rstd = arena.tensor(f32, {B * T});
    a.qkv = arena.tensor(dt, {B, T, 3 * C});
    a.att = arena.tensor(dt, {B, T, C});
    a.lse = arena.tensor(f32, {B, H, T});
    a.att_proj = arena.tensor(dt, {B, T, C});
    a.ln2 = arena.tensor(dt, {B, T, C});
    a.ln2_mean = arena.tensor(f32, {B * T});
    a.ln2_rstd = arena.tensor(f32, {B * T});
    a.fc_pre = arena.tensor(dt, {B, T, 4 * C});
    a.fc = arena.tensor(dt, {B, T, 4 * C});
    a.fc_proj = arena.tensor(dt, {B, T, C});
    blocks_.push_back(a);
  }
  branch_ = arena.tensor(dt, {B, T, C});
  lnf_ = arena.tensor(dt, {B, T, C});
  lnf_mean_ = arena.tensor(f32, {B * T});
  lnf_rstd_ = arena.tensor(f32, {B * T});
  loss_ = arena.tensor(f32, {1});
  d_lnf_ = arena.tensor(dt, {B, T, C});
  d_resid_[0] = arena.tensor(dt, {B, T, C});
  d_resid_[1] = arena.tensor(dt, {B, T, C});
  d_ln_ = arena.tensor(dt, {B, T, C});
  d_branch_ = arena.tensor(dt, {B, T, C});
  d_att_ = arena.tensor(dt, {B, T, C});
  d_qkv_ = arena.tensor(dt, {B, T, 3 * C});
  d_fc_ = arena.tensor(dt, {B, T, 4 * C});
  logits_ = arena.tensor(dt, {1, config_.padded_vocab});

  // One scratch buffer serves every call: they run one after another on one stream.
  const fusekit::Device dev = backend_.device;
  const std::int64_t M = B * T, V = config_.padded_vocab;
  std::size_t ws = 0;
  auto need = [&](std::size_t bytes) { ws = std::max(ws, bytes); };
  const struct { std::int64_t n, k; Activation act; } linears[] = {
      {3 * C, C, Activation::none}, {C, C, Activation::none}, {4 * C, C, Activation::gelu_tanh},
      {C, 4 * C, Activation::none}};
  for (const auto& s : linears) {
    need(fusekit::linear_forward_workspace_size(M, s.n, s.k, dt, s.act, dev));
    need(fusekit::linear_backward_workspace_size(M, s.n, s.k, dt, s.act, dev));
  }
  need(fusekit::linear_backward_through_input_activation_workspace_size(M, C, 4 * C, dt, Activation::none, dev));
  need(fusekit::linear_forward_workspace_size(1, V, C, dt, Activation::none, dev));
  fusekit::AttentionShape shape{B, T, T, H, H, config_.head_dim(), config_.head_dim(), dt, false};
  fusekit::AttentionConfig att_config;
  att_config.mask = fusekit::AttentionMask::causal_top_left;
  att_config.dropout_p = 0.1f;
  need(fusekit::attention_forward_workspace_size(shape, att_config, dev));
  need(fusekit::attention_backward_workspace_size(shape, att_config, deterministic_, dev));
  need(fusekit::norm_backward_workspace_size(M, C, dt, dev));
  need(fusekit::bias_act_dropout_backward_workspace_size(M, C, dt, dev));
  need(fusekit::linear_cross_entropy_workspace_size(M, V, C, dt, f32, false, loss_config(), dev));
  need(fusekit::embedding_backward_workspace_size(M, V, C, dev));
  workspace_ = arena.tensor(DType::u8, {static_cast<std::int64_t>(std::max<std::size_t>(ws, 1))});
}

// A residual branch's output projection into branch_: with dropout, the GEMM then bias + dropout
// in one pass (the mask regenerated in the backward); without, the bias in the GEMM's epilogue.
void Model::projection_forward(const TensorView& in, const TensorView& weight, const TensorView& bias,
                               const TensorView& pre_dropout, const DropoutConfig& dropout, std::int64_t layer,
                               DropoutSite site) {
  const fusekit::Stream s = backend_.stream;
  if (dropout.p == 0.0f) {
    fusekit::linear_forward(in, weight, bias, Activation::none, rows(branch_), nullopt, workspace_, s);
    return;
  }
  fusekit::linear_forward(in, weight, nullopt, Activation::none, pre_dropout, nullopt, workspace_, s);
  fusekit::bias_act_dropout_forward(pre_dropout, bias, bias_dropout_config(dropout, config_.n_layer, layer, site),
                                    rows(branch_), nullopt, s);
}

// Its backward from d_out (the gradient at branch_): d_in, dweight and dbias. With `input`, the
// projection's input is input->activation(input->pre) and d_in receives the gradient at `pre`.
void Model::projection_backward(const TensorView& d_out, const TensorView& in, const TensorView& weight,
                                const TensorView& bias, const TensorView& pre_dropout, const TensorView& d_in,
                                const TensorView& d_weight, const TensorView& d_bias, const DropoutConfig& dropout,
                                std::int64_t layer, DropoutSite site, const InputActivation* input) {
  const fusekit::Stream s = backend_.stream;
  fusekit::OptionalTensor linear_dbias = d_bias;
  TensorView d_linear_out = d_out;
  if (dropout.p != 0.0f) {
    fusekit::bias_act_dropout_backward(d_out, pre_dropout, bias,
                                       bias_dropout_config(dropout, config_.n_layer, layer, site), rows(d_branch_),
                                       d_bias, workspace_, s);
    d_linear_out = rows(d_branch_);
    linear_dbias = nullopt;
  }
  if (input) {
    fusekit::linear_backward_through_input_activation(d_linear_out, in, weight, nullopt, Activation::none, input->pre,
                                                      input->activation, d_in, input->dbias, d_weight, linear_dbias,
                                                      workspace_, s);
  } else {
    fusekit::linear_backward(d_linear_out, in, weight, nullopt, Activation::none, d_in, d_weight, linear_dbias,
                             workspace_, s);
  }
}

TensorView Model::rows(const TensorView& buffer) const {
  TensorView v = buffer;
  // Every activation buffer is either batch-major (B, ...) or, for per-row statistics, (B * T).
  v.shape[0] = v.ndim == 1 ? rows_ * config_.seq_len : rows_;
  return v;
}

TensorView Model::qkv_part(const TensorView& qkv, int part) const {
  const std::int64_t T = config_.seq_len, C = config_.n_embd, H = config_.n_head, D = config_.head_dim();
  void* data = static_cast<char*>(qkv.data) + static_cast<std::size_t>(part * C) * fusekit::dtype_size(qkv.dtype);
  return TensorView(data, qkv.dtype, qkv.device, {rows_, T, H, D}, {T * 3 * C, 3 * C, D, 1});
}

TensorView Model::heads(const TensorView& x) const {
  return TensorView(x.data, x.dtype, x.device, {rows_, config_.seq_len, config_.n_head, config_.head_dim()});
}

void Model::set_batch(const std::vector<std::int32_t>& inputs, const std::vector<std::int32_t>& targets,
                      std::int64_t sequences) {
  const auto n = static_cast<std::size_t>(sequences * config_.seq_len);
  if (sequences < 1 || sequences > batch_ || inputs.size() != n || targets.size() != n)
    throw std::invalid_argument("set_batch: expected 1.." + std::to_string(batch_) + " sequences of " +
                                std::to_string(config_.seq_len) + " tokens");
  rows_ = sequences;
  copy_from_host(rows(inputs_), inputs.data());
  copy_from_host(rows(targets_), targets.data());
}

void Model::forward(const DropoutConfig& dropout) {
  const ParamLayout& L = params_.layout();
  const std::vector<TensorView>& w = params_.compute;
  const std::int64_t n_layer = config_.n_layer;
  const TensorView ws = workspace_;
  const fusekit::Stream s = backend_.stream;

  fusekit::embedding_forward(rows(inputs_), w[L.wte], w[L.wpe], rows(resid_[0]), s);
  fusekit::layer_norm_forward(rows(resid_[0]), w[L.blocks[0].ln1_w], w[L.blocks[0].ln1_b], kLayerNormEps,
                              rows(blocks_[0].ln1), rows(blocks_[0].ln1_mean), rows(blocks_[0].ln1_rstd), s);
  for (std::int64_t l = 0; l < n_layer; ++l) {
    const BlockParams& p = L.blocks[static_cast<std::size_t>(l)];
    BlockActs& a = blocks_[static_cast<std::size_t>(l)];
    const TensorView qkv = rows(a.qkv);
    fusekit::linear_forward(rows(a.ln1), w[p.qkv_w], w[p.qkv_b], Activation::none, qkv, nullopt, ws, s);
    fusekit::attention_forward(qkv_part(qkv, 0), qkv_part(qkv, 1), qkv_part(qkv, 2), nullopt,
                               attention_config(dropout, n_layer, l), heads(a.att), rows(a.lse), nullopt, ws, s);
    projection_forward(rows(a.att), w[p.proj_w], w[p.proj_b], rows(a.att_proj), dropout, l,
                       DropoutSite::attention_proj);
    fusekit::layer_norm_residual_forward(rows(branch_), rows(resid_[2 * l]), w[p.ln2_w], w[p.ln2_b], kLayerNormEps,
                                         rows(a.ln2), rows(resid_[2 * l + 1]), rows(a.ln2_mean), rows(a.ln2_rstd), s);
    fusekit::linear_forward(rows(a.ln2), w[p.fc_w], w[p.fc_b], Activation::gelu_tanh, rows(a.fc), rows(a.fc_pre), ws,
                            s);
    projection_forward(rows(a.fc), w[p.fcproj_w], w[p.fcproj_b], rows(a.fc_proj), dropout, l, DropoutSite::mlp_proj);
    // The sum feeds the next block's ln_1, or ln_f after the last block.
    const bool last = l + 1 == n_layer;
    const BlockActs* next = last ? nullptr : &blocks_[static_cast<std::size_t>(l + 1)];
    const int norm_w = last ? L.lnf_w : L.blocks[static_cast<std::size_t>(l + 1)].ln1_w;
    const int norm_b = last ? L.lnf_b : L.blocks[static_cast<std::size_t>(l + 1)].ln1_b;
    fusekit::layer_norm_residual_forward(rows(branch_), rows(resid_[2 * l + 1]), w[norm_w], w[norm_b], kLayerNormEps,
                                         rows(last ? lnf_ : next->ln1), rows(resid_[2 * l + 2]),
                                         rows(last ? lnf_mean_ : next->ln1_mean),
                                         rows(last ? lnf_rstd_ : next->ln1_rstd), s);
  }
}

void Model::backward(const DropoutConfig& dropout) {
  const ParamLayout& L = params_.layout();
  const std::vector<TensorView>& w = params_.compute;
  const std::vector<TensorView>& g = params_.grad;
  const std::int64_t n_layer = config_.n_layer;
  const TensorView ws = workspace_;
  const fusekit::Stream s = backend_.stream;
  int cur = 0;  // d_resid_[cur] holds d r_k for the r_k being processed

  fusekit::layer_norm_residual_backward(rows(d_lnf_), rows(resid_[2 * n_layer]), nullopt, w[L.lnf_w], rows(lnf_mean_),
                                        rows(lnf_rstd_), rows(d_resid_[cur]), g[L.lnf_w], g[L.lnf_b], ws, s);
  for (std::int64_t l = n_layer - 1; l >= 0; --l) {
    const BlockParams& p = L.blocks[static_cast<std::size_t>(l)];
    BlockActs& a = blocks_[static_cast<std::size_t>(l)];
    // MLP branch: its output's gradient is d r_2l+2.
    // The down projection's backward returns the gradient at the GELU's input (and c_fc's bias
    // gradient): the up projection's backward then has no activation to go through.
    const InputActivation gelu{rows(a.fc_pre), Activation::gelu_tanh, g[p.fc_b]};
    projection_backward(rows(d_resid_[cur]), rows(a.fc), w[p.fcproj_w], w[p.fcproj_b], rows(a.fc_proj),
                        rows(d_fc_), g[p.fcproj_w], g[p.fcproj_b], dropout, l, DropoutSite::mlp_proj, &gelu);
    fusekit::linear_backward(rows(d_fc_), rows(a.ln2), w[p.fc_w], nullopt, Activation::none, rows(d_ln_), g[p.fc_w],
                             nullopt, ws, s);
    fusekit::layer_norm_residual_backward(rows(d_ln_), rows(resid_[2 * l + 1]), rows(d_resid_[cur]), w[p.ln2_w],
                                          rows(a.ln2_mean), rows(a.ln2_rstd), rows(d_resid_[1 - cur]), g[p.ln2_w],
                                          g[p.ln2_b], ws, s);
    cur = 1 - cur;
    // Attention branch: its output's gradient is d r_2l+1.
    projection_backward(rows(d_resid_[cur]), rows(a.att), w[p.proj_w], w[p.proj_b], rows(a.att_proj),
                        rows(d_att_), g[p.proj_w], g[p.proj_b], dropout, l, DropoutSite::attention_proj);
    const TensorView qkv = rows(a.qkv), d_qkv = rows(d_qkv_);
    fusekit::attention_backward(heads(d_att_), qkv_part(qkv, 0), qkv_part(qkv, 1), qkv_part(qkv, 2), heads(a.att),
                                rows(a.lse), nullopt, attention_config(dropout, n_layer, l), qkv_part(d_qkv, 0),
                                qkv_part(d_qkv, 1), qkv_part(d_qkv, 2), nullopt, nullopt, deterministic_, ws, s);
    fusekit::linear_backward(d_qkv, rows(a.ln1), w[p.qkv_w], nullopt, Activation::none, rows(d_ln_), g[p.qkv_w],
                             g[p.qkv_b], ws, s);
    fusekit::layer_norm_residual_backward(rows(d_ln_), rows(resid_[2 * l]), rows(d_resid_[cur]), w[p.ln1_w],
                                          rows(a.ln1_mean), rows(a.ln1_rstd), rows(d_resid_[1 - cur]), g[p.ln1_w],
                                          g[p.ln1_b], ws, s);
    cur = 1 - cur;
  }
  // d r_0 into the embeddings: the token rows add to the output layer's gradient already in
  // g[wte]; embedding_backward has one accumulate flag for both tensors, so wpe's is zeroed first.
  zero_fill(g[L.wpe], s);
  fusekit::embedding_backward(rows(d_resid_[cur]), rows(inputs_), g[L.wte], g[L.wpe], true, ws, s);
}

void Model::enqueue_step(const DropoutConfig& dropout) {
  const ParamLayout& L = params_.layout();
  forward(dropout);
  fusekit::linear_cross_entropy(rows(lnf_), params_.compute[L.wte], nullopt, rows(targets_), loss_config(), loss_,
                                rows(d_lnf_), params_.grad[L.wte], nullopt, workspace_, backend_.stream);
  backward(dropout);
}

bool Model::step_graph_taken(const DropoutConfig& dropout) const {
  return step_graph_ && backend_.device.is_cuda() && dropout.p == 0.0f;
}

void Model::enqueue_forward_backward(const DropoutConfig& dropout) {
  if (!step_graph_taken(dropout)) {
    enqueue_step(dropout);
    return;
  }
  if (!graph_.recorded() || graph_rows_ != rows_) {
    if (direct_rows_ != rows_) {
      direct_rows_ = rows_;
      enqueue_step(dropout);
      return;
    }
    graph_.record(backend_.stream, [&] { enqueue_step(dropout); });
    graph_rows_ = rows_;
  }
  graph_.replay(backend_.stream);
  ++graph_replays_;
}

float Model::loss_value() const {
  float loss = 0.0f;
  copy_to_host(&loss, loss_);
  return loss;
}

float Model::forward_backward(const DropoutConfig& dropout) {
  enqueue_forward_backward(dropout);
  return loss_value();
}

float Model::loss(const DropoutConfig& dropout) {
  forward(dropout);
  fusekit::linear_cross_entropy(rows(lnf_), params_.compute[params_.layout().wte], nullopt, rows(targets_),
                                loss_config(), loss_, nullopt, nullopt, nullopt, workspace_, backend_.stream);
  float loss = 0.0f;
  copy_to_host(&loss, loss_);
  return loss;
}

std::vector<float> Model::next_token_logits(std::int64_t position) {
  if (position < 0 || position >= config_.seq_len) throw std::invalid_argument("next_token_logits: position out of range");
  forward(DropoutConfig{});
  const std::int64_t C = config_.n_embd;
  void* row = static_cast<char*>(lnf_.data) + static_cast<std::size_t>(position * C) * fusekit::dtype_size(lnf_.dtype);
  const TensorView h(row, lnf_.dtype, lnf_.device, {1, C});
  fusekit::linear_forward(h, params_.compute[params_.layout().wte], nullopt, Activation::none, logits_, nullopt,
                          workspace_, backend_.stream);
  const auto V = static_cast<std::size_t>(config_.padded_vocab);
  std::vector<float> out(V);
  if (logits_.dtype == DType::f32) {
    copy_to_host(out.data(), logits_);
  } else {
    std::vector<std::uint16_t> bits(V);
    copy_to_host(bits.data(), logits_);
    for (std::size_t i = 0; i < V; ++i) out[i] = bf16_to_float(bits[i]);
  }
  return out;
}

double Model::training_flops_per_token() const {
  const double C = static_cast<double>(config_.n_embd), Ly = static_cast<double>(config_.n_layer);
  const double T = static_cast<double>(config_.seq_len), V = static_cast<double>(config_.padded_vocab);
  const double matmul_weights = Ly * 12.0 * C * C + V * C;
  return 6.0 * matmul_weights + 12.0 * Ly * T * C;
}

}  // namespace train_gpt
