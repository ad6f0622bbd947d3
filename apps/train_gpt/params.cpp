#include "params.h"

#include <cmath>
#include <cstring>
#include <stdexcept>

#include "rng.h"

namespace train_gpt {

std::int64_t ParamInfo::numel() const {
  std::int64_t n = 1;
  for (std::int64_t s : shape) n *= s;
  return n;
}

std::int64_t ParamLayout::count() const {
  std::int64_t n = 0;
  for (const ParamInfo& p : info) n += p.numel();
  return n;
}

ParamLayout param_layout(const ModelConfig& c) {
  validate(c);
  ParamLayout layout;
  const std::int64_t C = c.n_embd;
  constexpr float kStd = 0.02f;
  // GPT-2 scales the weights of the projections that add into the residual stream by
  // 1 / sqrt(number of residual additions), keeping the stream's variance independent of depth.
  const float residual_std = kStd / std::sqrt(2.0f * static_cast<float>(c.n_layer));
  // kind: 'e' embedding (bf16 copy, float32 gradient), 'f' read as float32 by its op, 'l' a
  // linear layer's weight or bias.
  auto add = [&](std::string name, std::vector<std::int64_t> shape, float std_, float value, bool decay,
                 char kind) {
    layout.info.push_back(
        ParamInfo{std::move(name), std::move(shape), std_, value, decay, kind == 'f', kind == 'l'});
    return static_cast<int>(layout.info.size() - 1);
  };
  layout.wte = add("wte", {c.padded_vocab, C}, kStd, 0.0f, true, 'e');
  layout.wpe = add("wpe", {c.seq_len, C}, kStd, 0.0f, true, 'e');
  for (std::int64_t l = 0; l < c.n_layer; ++l) {
    const std::string p = "h" + std::to_string(l) + ".";
    auto named = [&p](const char* field) {
      std::string name = p;
      name.append(field);
      return name;
    };
    BlockParams b{};
    b.ln1_w = add(named("ln_1.weight"), {C}, 0.0f, 1.0f, false, 'f');
    b.ln1_b = add(named("ln_1.bias"), {C}, 0.0f, 0.0f, false, 'f');
    b.qkv_w = add(named("attn.c_attn.weight"), {3 * C, C}, kStd, 0.0f, true, 'l');
    b.qkv_b = add(named("attn.c_attn.bias"), {3 * C}, 0.0f, 0.0f, false, 'l');
    b.proj_w = add(named("attn.c_proj.weight"), {C, C}, residual_std, 0.0f, true, 'l');
    b.proj_b = add(named("attn.c_proj.bias"), {C}, 0.0f, 0.0f, false, 'l');
    b.ln2_w = add(named("ln_2.weight"), {C}, 0.0f, 1.0f, false, 'f');
    b.ln2_b = add(named("ln_2.bias"), {C}, 0.0f, 0.0f, false, 'f');
    b.fc_w = add(named("mlp.c_fc.weight"), {4 * C, C}, kStd, 0.0f, true, 'l');
    b.fc_b = add(named("mlp.c_fc.bias"), {4 * C}, 0.0f, 0.0f, false, 'l');
    b.fcproj_w = add(named("mlp.c_proj.weight"), {C, 4 * C}, residual_std, 0.0f, true, 'l');
    b.fcproj_b = add(named("mlp.c_proj.bias"), {C}, 0.0f, 0.0f, false, 'l');
    layout.blocks.push_back(b);
  }
  layout.lnf_w = add("ln_f.weight", {C}, 0.0f, 1.0f, false, 'f');
  layout.lnf_b = add("ln_f.bias", {C}, 0.0f, 0.0f, false, 'f');
  return layout;
}

Parameters::Parameters(const ModelConfig& config, const Backend& backend, Arena& arena)
    : config_(config), backend_(backend), layout_(param_layout(config)) {
  using fusekit::DType;
  for (const ParamInfo& p : layout_.info) {
    const bool copy = backend.compute_dtype != DType::f32 && !p.float32_op;
    master.push_back(arena.tensor(DType::f32, p.shape));
    compute.push_back(copy ? arena.tensor(backend.compute_dtype, p.shape) : master.back());
    exp_avg.push_back(arena.tensor(DType::f32, p.shape));
    exp_avg_sq.push_back(arena.tensor(DType::f32, p.shape));
    has_copy.push_back(copy);
  }
  // The gradients: one block per dtype (in the order the dtypes first appear), each tensor at a
  // 256-byte aligned offset, as the arena would have placed it on its own.
  struct Bucket {
    DType dtype;
    std::size_t bytes = 0;
  };
  std::vector<Bucket> buckets;
  std::vector<std::pair<std::size_t, std::size_t>> place;  // (bucket, byte offset) of each gradient
  for (const ParamInfo& p : layout_.info) {
    const DType dtype = p.linear_op ? backend.compute_dtype : DType::f32;
    std::size_t b = 0;
    while (b < buckets.size() && buckets[b].dtype != dtype) ++b;
    if (b == buckets.size()) buckets.push_back(Bucket{dtype});
    const std::size_t offset = (buckets[b].bytes + 255) / 256 * 256;
    place.emplace_back(b, offset);
    buckets[b].bytes = offset + static_cast<std::size_t>(p.numel()) * fusekit::dtype_size(dtype);
  }
  std::vector<char*> blocks;
  for (const Bucket& b : buckets) {
    blocks.push_back(static_cast<char*>(arena.allocate(b.bytes)));
    const auto elements = static_cast<std::int64_t>(b.bytes / fusekit::dtype_size(b.dtype));
    grad_buckets.push_back(contiguous_view(blocks.back(), b.dtype, backend.device, {elements}));
  }
  for (std::size_t i = 0; i < layout_.info.size(); ++i) {
    const auto [b, offset] = place[i];
    grad.push_back(contiguous_view(blocks[b] + offset, buckets[b].dtype, backend.device, layout_.info[i].shape));
  }
}

void Parameters::initialize(std::uint64_t seed) {
  std::vector<float> values(static_cast<std::size_t>(layout_.count()));
  std::size_t at = 0;
  for (std::size_t i = 0; i < layout_.info.size(); ++i) {
    const ParamInfo& p = layout_.info[i];
    // One generator per tensor (its index mixed into the seed): a tensor's values do not depend
    // on the shapes of the tensors before it.
    NormalRng rng(mix_seed(seed, 0x706172616d73ull, i));
    for (std::int64_t k = 0; k < p.numel(); ++k)
      values[at++] = p.init_std > 0.0f ? p.init_std * rng.next() : p.init_value;
  }
  set_master_values(values);
  const std::vector<float> zeros(values.size(), 0.0f);
  set_moment_values(false, zeros);
  set_moment_values(true, zeros);
}

namespace {

std::vector<float> gather(const std::vector<fusekit::TensorView>& tensors, std::int64_t count) {
  std::vector<float> out(static_cast<std::size_t>(count));
  std::size_t at = 0;
  for (const fusekit::TensorView& t : tensors) {
    copy_to_host(out.data() + at, t);
    at += static_cast<std::size_t>(t.numel());
  }
  return out;
}

void scatter(const std::vector<fusekit::TensorView>& tensors, const std::vector<float>& values,
             std::int64_t count) {
  if (static_cast<std::int64_t>(values.size()) != count)
    throw std::invalid_argument("parameter values: expected " + std::to_string(count) + " floats, got " +
                                std::to_string(values.size()));
  std::size_t at = 0;
  for (const fusekit::TensorView& t : tensors) {
    copy_from_host(t, values.data() + at);
    at += static_cast<std::size_t>(t.numel());
  }
}

}  // namespace

std::vector<float> Parameters::master_values() const { return gather(master, layout_.count()); }

void Parameters::set_master_values(const std::vector<float>& values) {
  scatter(master, values, layout_.count());
  refresh_compute_copies();
}

std::vector<float> Parameters::moment_values(bool second) const {
  return gather(second ? exp_avg_sq : exp_avg, layout_.count());
}

void Parameters::set_moment_values(bool second, const std::vector<float>& values) {
  scatter(second ? exp_avg_sq : exp_avg, values, layout_.count());
}

void Parameters::refresh_compute_copies() {
  for (std::size_t i = 0; i < master.size(); ++i) {
    if (!has_copy[i]) continue;
    if (compute[i].dtype != fusekit::DType::bf16)
      throw std::logic_error("refresh_compute_copies: only bfloat16 copies are supported");
    std::vector<float> values(static_cast<std::size_t>(master[i].numel()));
    copy_to_host(values.data(), master[i]);
    std::vector<std::uint16_t> bits(values.size());
    for (std::size_t k = 0; k < values.size(); ++k) bits[k] = float_to_bf16(values[k]);
    copy_from_host(compute[i], bits.data());
  }
}

std::vector<float> Parameters::grad_values() const {
  std::vector<float> out;
  out.reserve(static_cast<std::size_t>(layout_.count()));
  for (const fusekit::TensorView& g : grad) {
    const std::size_t n = static_cast<std::size_t>(g.numel());
    if (g.dtype == fusekit::DType::f32) {
      std::vector<float> v(n);
      copy_to_host(v.data(), g);
      out.insert(out.end(), v.begin(), v.end());
    } else {
      std::vector<std::uint16_t> bits(n);
      copy_to_host(bits.data(), g);
      for (std::uint16_t b : bits) out.push_back(bf16_to_float(b));
    }
  }
  return out;
}

std::vector<std::uint64_t> Parameters::master_hashes() const {
  std::vector<std::uint64_t> hashes;
  for (const fusekit::TensorView& t : master) {
    std::vector<std::uint32_t> words(static_cast<std::size_t>(t.numel()));  // float32 bits
    copy_to_host(words.data(), t);
    // FNV-1a over the 32-bit words: any differing bit changes the hash (up to collisions).
    std::uint64_t h = 0xCBF29CE484222325ull;
    for (std::uint32_t w : words) h = (h ^ w) * 0x100000001B3ull;
    hashes.push_back(h);
  }
  return hashes;
}

}  // namespace train_gpt
