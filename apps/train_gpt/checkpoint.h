// Checkpoints: the whole training state in one little-endian binary file (format in
// apps/train_gpt/README.md, "Checkpoint format").
//
// Every random choice of a run is a pure function of the run seed and a counter: the data order
// of (seed, windows consumed), the dropout masks of (seed, step, layer, site). The seed, the step
// and the data position are therefore the complete random state, and a resumed run repeats the
// uninterrupted run's next steps bit for bit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config.h"
#include "params.h"

namespace train_gpt {

inline constexpr char kCheckpointMagic[8] = {'F', 'K', 'G', 'P', 'T', 'C', 'K', 'P'};
inline constexpr std::uint32_t kCheckpointVersion = 1;
inline constexpr std::uint32_t kCheckpointHeaderBytes = 128;

struct TrainingState {
  ModelConfig config;
  std::int64_t step = 0;             // optimizer steps completed
  std::uint64_t seed = 0;            // the run seed
  std::uint64_t data_position = 0;   // training windows consumed (BatchLoader::position)
  float last_loss = 0.0f;            // the loss of the last step (informational)
};

// Writes the state, the float32 master parameters and both AdamW moments (to `path`.tmp, then
// renamed, so a crash never leaves a torn checkpoint under the real name).
void save_checkpoint(const std::string& path, const TrainingState& state, const Parameters& params);

// Reads only the header (to build the model before loading). Throws std::runtime_error naming the
// file and what is wrong (magic, version, truncation).
TrainingState read_checkpoint_state(const std::string& path);

// A whole checkpoint in host memory: the state and, in layout order, the float32 master
// parameters and both AdamW moments.
struct Checkpoint {
  TrainingState state;
  std::vector<float> master, exp_avg, exp_avg_sq;
};

// Reads the whole file (once, however many replicas it then loads into). Throws
// std::runtime_error as read_checkpoint_state does, and when the file is shorter than its header
// says.
Checkpoint read_checkpoint(const std::string& path);

// Loads the parameters and moments of `checkpoint` into `params`, whose config must match the
// file's (std::runtime_error naming `path` and both shapes otherwise).
void apply_checkpoint(const Checkpoint& checkpoint, const std::string& path, Parameters& params);

// read_checkpoint, then apply_checkpoint; returns the state.
TrainingState load_checkpoint(const std::string& path, Parameters& params);

}  // namespace train_gpt
