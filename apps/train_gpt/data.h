// Text in, token batches out. The tokenizer is byte level: a token is one byte of the UTF-8 text
// (ids 0..255, no merges, no special tokens), so set-up needs no vocabulary file and decoding is
// exact. The corpus is split once: the first 90% of the bytes train, the last 10% validate.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace train_gpt {

std::string read_text_file(const std::string& path);

std::vector<std::int32_t> encode_bytes(const std::string& text);
std::string decode_bytes(const std::vector<std::int32_t>& tokens);

struct TokenSplit {
  std::vector<std::int32_t> train, val;
};
TokenSplit split_tokens(const std::vector<std::int32_t>& tokens, double val_fraction);

// Batches of (inputs, targets) windows of seq_len + 1 consecutive tokens. The token stream is cut
// into windows starting at multiples of seq_len; with `shuffle`, epoch e visits them in the order
// permutation(windows, mix_seed(seed, data stream, e)) (rng.h), without it in stream order. A
// batch is the next `batch` windows of that order, so the loader's whole state is one counter,
// `position` (windows consumed), which checkpoints store.
class BatchLoader {
 public:
  BatchLoader(const std::vector<std::int32_t>& tokens, std::int64_t batch, std::int64_t seq_len,
              std::uint64_t seed, bool shuffle);

  // Fills inputs and targets (batch * seq_len each, row-major) and advances the position.
  void next(std::vector<std::int32_t>& inputs, std::vector<std::int32_t>& targets);

  std::uint64_t position() const { return position_; }
  void seek(std::uint64_t position) { position_ = position; }
  std::int64_t windows() const { return windows_; }
  std::int64_t batches_per_epoch() const { return windows_ / batch_; }

 private:
  std::int64_t window_start(std::uint64_t index);

  const std::vector<std::int32_t>& tokens_;
  std::int64_t batch_, seq_len_, windows_;
  std::uint64_t seed_;
  bool shuffle_;
  std::uint64_t position_ = 0;
  std::int64_t order_epoch_ = -1;
  std::vector<std::int64_t> order_;
};

// Data parallelism splits each batch by rows: of `ranks` replicas, rank r trains on rows
// [r * batch / ranks, (r + 1) * batch / ranks) of exactly the batch a single device would take at
// that step, so the ranks together see the same tokens, and the loader's position (windows
// consumed) does not depend on the number of ranks.
//
// batch / ranks; throws std::invalid_argument naming --batch and --gpus unless ranks >= 1
// divides batch.
std::int64_t micro_batch(std::int64_t batch, int ranks);
// The rows of rank `rank` out of a (batch, seq_len) row-major batch of tokens.
std::vector<std::int32_t> rank_rows(const std::vector<std::int32_t>& tokens, std::int64_t batch,
                                    std::int64_t seq_len, int ranks, int rank);

// The seed stream of the data order (the other streams are in rng.h's callers).
inline constexpr std::uint64_t kDataStream = 0x64617461ull;

}  // namespace train_gpt
