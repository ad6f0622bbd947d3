#include "core/overrides.h"

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>

namespace fusekit::detail {

namespace {

// One row per key, grouped by family. A key that no code reads does not belong here.
const std::vector<OverrideKey> kOverrideKeys = {
    // FP8 RMSNorm (src/fp8_norm/fp8_norm_config.h).
    {"fp8_norm.stats", "registers|bulk", "the forward's statistics kernel (a bulk that cannot serve runs registers)"},
    {"fp8_norm.stats.chunk_rounds", "1..4", "rounds of 2048 columns per bulk copy of the bulk statistics kernel"},
    {"fp8_norm.stats.ring_slots", "2..8", "chunk slots per warp of the bulk statistics kernel"},
    {"fp8_norm.backward.tuning", "four_runs_cached|two_runs_streaming", "the vector backward's tuning"},
    // norm (LayerNorm / RMSNorm): the launch table's sweep dimensions.
    {"norm.forward.vectors", "1..4", "vectors per thread of forward rows longer than 128 vectors"},
    {"norm.backward.vectors", "1..4", "vectors per thread of backward rows longer than 128 vectors (g not kept)"},
    {"norm.backward.block", "128..512", "threads per block of the backward row kernels"},
    {"norm.backward.stages", "2..4", "deepest shared-memory ring of the backward (rows per row group)"},
    {"norm.backward.cluster", "1|2|4|8", "blocks per cluster pre-summing dweight and dbias (1: no clusters)"},
    {"norm.backward.ring_dsum", "on|off",
     "the residual backward's dsum rows through the ring where they fit (default), or from memory"},
    // linear (bias_act_dropout reads none)
    {"linear.autotune", "on|off",
     "time cuBLASLt's GEMM algorithms and the forward paths on a problem's first call (default on)"},
    {"linear.autotune_log", "on|off", "print every timed autotuning candidate to stderr (default off)"},
    {"linear.backward.dz", "separate|in_dgrad",
     "how the backward forms dz: one elementwise pass, or inside the dx GEMM where it can"},
    {"linear.backward.dz_first_rows", "0..2147483647",
     "rows the in_dgrad route forms with the elementwise pass before its kernel (multiple of 128)"},
    {"linear.backward.input_activation", "bgrad_epilogue|epilogue|pass",
     "linear_backward_through_input_activation: cuBLASLt's DGELU_BGRAD epilogue, DGELU then a column-sum pass, "
     "or dx then the elementwise pass"},
    {"linear.gated.forward", "epilogue|separate",
     "how gated_linear_forward runs: the GEMM with the gated epilogue, or the GEMM then gated_act"},
    // cross_entropy (src/cross_entropy/cross_entropy_config.h): the launch table's sweep dimensions
    {"cross_entropy.threads", "64|128|256", "threads per block of the cross-entropy kernels"},
    {"cross_entropy.cluster", "1|2|4|8", "blocks per row (one cluster) of the forward and fused kernel"},
    {"cross_entropy.backward.chunks", "1..1024", "blocks per row of the backward kernel"},
    {"cross_entropy.staged", "on|off", "the staged row kernel (row in shared memory, the rest streamed), or never"},
    // linear_cross_entropy (src/linear_cross_entropy/linear_cross_entropy_config.h): the tests'
    // multi-chunk runs on small problems, the chunk-size sweep
    {"linear_cross_entropy.chunk_tokens", "1..2147483647", "rows per chunk (the workspace query sees it too)"},
    // gated_act (src/gated_act/gated_act_config.h): the rows-per-thread sweep of the vector path.
    {"gated_act.forward.rows", "1|2|4", "rows each thread of the vector forward loads together"},
    {"gated_act.backward.rows", "1|2|4", "rows each thread of the vector backward loads together"},
    // attention
    {"attention.path", "auto|sm90|mma",
     "attention kernels: the Hopper ones where they serve the call (auto), always them (sm90), or mma.sync"},
    // rope (src/rope/rope_config.h): the tests' narrower accesses on aligned data, the tuning sweep
    {"rope.max_access_bytes", "16|8|4|element",
     "widest unit access of the rotary kernel (element: one element per access, any alignment)"},
    {"rope.tokens_per_block", "1..16", "tokens per block of the rotary kernel"},
};

struct State {
  std::mutex mutex;
  std::map<std::string, std::string> values;
  std::atomic<bool> any{false};
};

const OverrideKey* find_key(const std::string& key) {
  for (const OverrideKey& k : kOverrideKeys)
    if (key == k.name) return &k;
  return nullptr;
}

void set_locked(State& s, const std::string& key, const std::string& value) {
  if (!find_key(key)) {
    std::string known;
    for (const OverrideKey& k : kOverrideKeys) {
      if (!known.empty()) known += ", ";
      known += k.name;
    }
    throw Error(ErrorKind::invalid_argument, "override", "key",
                "one of " + (known.empty() ? std::string("(none)") : known), key);
  }
  if (value.empty())
    s.values.erase(key);
  else
    s.values[key] = value;
  s.any.store(!s.values.empty(), std::memory_order_relaxed);
}

void set_list_locked(State& s, const std::string& list) {
  std::size_t start = 0;
  while (start <= list.size()) {
    const std::size_t end = std::min(list.find(',', start), list.size());
    const std::string item = list.substr(start, end - start);
    if (!item.empty()) {
      const std::size_t eq = item.find('=');
      if (eq == std::string::npos)
        throw Error(ErrorKind::invalid_argument, "override", "FUSEKIT_OVERRIDE", "key=value", item);
      set_locked(s, item.substr(0, eq), item.substr(eq + 1));
    }
    start = end + 1;
  }
}

State& state() {
  static State* s = [] {
    auto* fresh = new State;  // never destroyed: lookups may run during static destruction
    if (const char* env = std::getenv("FUSEKIT_OVERRIDE")) set_list_locked(*fresh, env);
    return fresh;
  }();
  return *s;
}

}  // namespace

const std::vector<OverrideKey>& override_keys() { return kOverrideKeys; }

void set_override(const std::string& key, const std::string& value) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  set_locked(s, key, value);
}

void set_overrides(const std::string& list) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  set_list_locked(s, list);
}

void clear_overrides() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.values.clear();
  s.any.store(false, std::memory_order_relaxed);
}

std::optional<std::string> override_value(const char* key) {
  State& s = state();
  if (!s.any.load(std::memory_order_relaxed)) return std::nullopt;
  std::lock_guard<std::mutex> lock(s.mutex);
  const auto it = s.values.find(key);
  if (it == s.values.end()) return std::nullopt;
  return it->second;
}

std::optional<long long> override_int(const char* key, long long lo, long long hi) {
  const std::optional<std::string> value = override_value(key);
  if (!value) return std::nullopt;
  char* end = nullptr;
  const long long v = std::strtoll(value->c_str(), &end, 10);
  if (value->empty() || *end != '\0' || v < lo || v > hi)
    throw Error(ErrorKind::invalid_argument, "override", key,
                "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]", *value);
  return v;
}

}  // namespace fusekit::detail
