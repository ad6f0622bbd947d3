#include "checkpoint.h"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <vector>

namespace train_gpt {
namespace {

// The header's fields at fixed offsets (README.md, "Checkpoint format"); the host is little-endian
// (x86-64, aarch64), which is the file's byte order.
struct Header {
  char magic[8];
  std::uint32_t version;
  std::uint32_t header_bytes;
  std::int64_t n_layer, n_head, n_embd, seq_len, vocab, padded_vocab;
  std::int64_t step;
  std::uint64_t seed;
  std::uint64_t data_position;
  std::int64_t param_count;
  float last_loss;
  std::uint8_t reserved[28];
};
static_assert(sizeof(Header) == kCheckpointHeaderBytes, "the checkpoint header is 128 bytes");

void write_floats(std::ofstream& out, const std::vector<float>& values) {
  out.write(reinterpret_cast<const char*>(values.data()), static_cast<std::streamsize>(values.size() * 4));
}

std::vector<float> read_floats(std::ifstream& in, std::int64_t count, const std::string& path) {
  std::vector<float> values(static_cast<std::size_t>(count));
  in.read(reinterpret_cast<char*>(values.data()), static_cast<std::streamsize>(values.size() * 4));
  if (!in) throw std::runtime_error("checkpoint '" + path + "': truncated (expected " + std::to_string(count) +
                                    " floats per section)");
  return values;
}

Header read_header(std::ifstream& in, const std::string& path) {
  Header h{};
  in.read(reinterpret_cast<char*>(&h), sizeof h);
  if (!in) throw std::runtime_error("checkpoint '" + path + "': shorter than its 128-byte header");
  if (std::memcmp(h.magic, kCheckpointMagic, 8) != 0)
    throw std::runtime_error("checkpoint '" + path + "': not a train_gpt checkpoint (bad magic)");
  if (h.version != kCheckpointVersion || h.header_bytes != kCheckpointHeaderBytes)
    throw std::runtime_error("checkpoint '" + path + "': version " + std::to_string(h.version) +
                             ", this program reads version " + std::to_string(kCheckpointVersion));
  return h;
}

TrainingState state_of(const Header& h) {
  TrainingState s;
  s.config = ModelConfig{h.n_layer, h.n_head, h.n_embd, h.seq_len, h.vocab, h.padded_vocab};
  s.step = h.step;
  s.seed = h.seed;
  s.data_position = h.data_position;
  s.last_loss = h.last_loss;
  return s;
}

}  // namespace

void save_checkpoint(const std::string& path, const TrainingState& state, const Parameters& params) {
  Header h{};
  std::memcpy(h.magic, kCheckpointMagic, 8);
  h.version = kCheckpointVersion;
  h.header_bytes = kCheckpointHeaderBytes;
  const ModelConfig& c = state.config;
  h.n_layer = c.n_layer;
  h.n_head = c.n_head;
  h.n_embd = c.n_embd;
  h.seq_len = c.seq_len;
  h.vocab = c.vocab;
  h.padded_vocab = c.padded_vocab;
  h.step = state.step;
  h.seed = state.seed;
  h.data_position = state.data_position;
  h.param_count = params.layout().count();
  h.last_loss = state.last_loss;
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw std::runtime_error("cannot write checkpoint '" + tmp + "'");
    out.write(reinterpret_cast<const char*>(&h), sizeof h);
    write_floats(out, params.master_values());
    write_floats(out, params.moment_values(false));
    write_floats(out, params.moment_values(true));
    if (!out.flush()) throw std::runtime_error("writing checkpoint '" + tmp + "' failed");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw std::runtime_error("cannot rename '" + tmp + "' to '" + path + "'");
}

TrainingState read_checkpoint_state(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open checkpoint '" + path + "'");
  return state_of(read_header(in, path));
}

Checkpoint read_checkpoint(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open checkpoint '" + path + "'");
  const Header h = read_header(in, path);
  Checkpoint c;
  c.state = state_of(h);
  const std::int64_t expected = param_layout(c.state.config).count();
  if (h.param_count != expected)
    throw std::runtime_error("checkpoint '" + path + "': " + std::to_string(h.param_count) + " parameters, a model of " +
                             describe(c.state.config) + " has " + std::to_string(expected));
  c.master = read_floats(in, h.param_count, path);
  c.exp_avg = read_floats(in, h.param_count, path);
  c.exp_avg_sq = read_floats(in, h.param_count, path);
  return c;
}

void apply_checkpoint(const Checkpoint& c, const std::string& path, Parameters& params) {
  if (!(c.state.config == params.config()))
    throw std::runtime_error("checkpoint '" + path + "' holds a model of " + describe(c.state.config) +
                             ", not the " + describe(params.config()) + " asked for");
  params.set_master_values(c.master);
  params.set_moment_values(false, c.exp_avg);
  params.set_moment_values(true, c.exp_avg_sq);
}

TrainingState load_checkpoint(const std::string& path, Parameters& params) {
  const Checkpoint c = read_checkpoint(path);
  apply_checkpoint(c, path, params);
  return c.state;
}

}  // namespace train_gpt
