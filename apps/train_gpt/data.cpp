#include "data.h"

#include <fstream>
#include <sstream>
#include <stdexcept>

#include "rng.h"

namespace train_gpt {

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open the text corpus '" + path + "'");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<std::int32_t> encode_bytes(const std::string& text) {
  std::vector<std::int32_t> tokens(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<unsigned char>(text[i]);
  return tokens;
}

std::string decode_bytes(const std::vector<std::int32_t>& tokens) {
  std::string text;
  text.reserve(tokens.size());
  for (std::int32_t t : tokens) text.push_back(static_cast<char>(t >= 0 && t < 256 ? t : '?'));
  return text;
}

TokenSplit split_tokens(const std::vector<std::int32_t>& tokens, double val_fraction) {
  const auto n_val = static_cast<std::size_t>(static_cast<double>(tokens.size()) * val_fraction);
  const std::size_t n_train = tokens.size() - n_val;
  return TokenSplit{std::vector<std::int32_t>(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(n_train)),
                    std::vector<std::int32_t>(tokens.begin() + static_cast<std::ptrdiff_t>(n_train), tokens.end())};
}

BatchLoader::BatchLoader(const std::vector<std::int32_t>& tokens, std::int64_t batch, std::int64_t seq_len,
                         std::uint64_t seed, bool shuffle)
    : tokens_(tokens), batch_(batch), seq_len_(seq_len), seed_(seed), shuffle_(shuffle) {
  const auto n = static_cast<std::int64_t>(tokens.size());
  windows_ = n > seq_len ? (n - 1) / seq_len : 0;
  if (windows_ < batch)
    throw std::invalid_argument("the token stream (" + std::to_string(n) + " tokens) holds fewer than one batch of " +
                                std::to_string(batch) + " windows of " + std::to_string(seq_len + 1) + " tokens");
}

std::int64_t BatchLoader::window_start(std::uint64_t index) {
  const auto epoch = static_cast<std::int64_t>(index / static_cast<std::uint64_t>(windows_));
  const auto within = static_cast<std::int64_t>(index % static_cast<std::uint64_t>(windows_));
  if (!shuffle_) return within * seq_len_;
  if (epoch != order_epoch_) {
    order_ = permutation(windows_, mix_seed(seed_, kDataStream, static_cast<std::uint64_t>(epoch)));
    order_epoch_ = epoch;
  }
  return order_[static_cast<std::size_t>(within)] * seq_len_;
}

void BatchLoader::next(std::vector<std::int32_t>& inputs, std::vector<std::int32_t>& targets) {
  inputs.resize(static_cast<std::size_t>(batch_ * seq_len_));
  targets.resize(inputs.size());
  for (std::int64_t b = 0; b < batch_; ++b) {
    const std::int64_t start = window_start(position_++);
    for (std::int64_t t = 0; t < seq_len_; ++t) {
      inputs[static_cast<std::size_t>(b * seq_len_ + t)] = tokens_[static_cast<std::size_t>(start + t)];
      targets[static_cast<std::size_t>(b * seq_len_ + t)] = tokens_[static_cast<std::size_t>(start + t + 1)];
    }
  }
}

std::int64_t micro_batch(std::int64_t batch, int ranks) {
  if (ranks < 1) throw std::invalid_argument("--gpus must be >= 1, got " + std::to_string(ranks));
  if (batch < 1 || batch % ranks != 0)
    throw std::invalid_argument("--batch " + std::to_string(batch) + " does not split evenly over --gpus " +
                                std::to_string(ranks) + ": each GPU trains on batch / gpus sequences, so --batch " +
                                "must be a positive multiple of --gpus");
  return batch / ranks;
}

std::vector<std::int32_t> rank_rows(const std::vector<std::int32_t>& tokens, std::int64_t batch, std::int64_t seq_len,
                                    int ranks, int rank) {
  const std::int64_t rows = micro_batch(batch, ranks);
  if (rank < 0 || rank >= ranks || static_cast<std::int64_t>(tokens.size()) != batch * seq_len)
    throw std::invalid_argument("rank_rows: rank " + std::to_string(rank) + " of " + std::to_string(ranks) +
                                ", " + std::to_string(tokens.size()) + " tokens for a batch of " +
                                std::to_string(batch) + " x " + std::to_string(seq_len));
  const auto begin = tokens.begin() + static_cast<std::ptrdiff_t>(rank * rows * seq_len);
  return std::vector<std::int32_t>(begin, begin + static_cast<std::ptrdiff_t>(rows * seq_len));
}

}  // namespace train_gpt
