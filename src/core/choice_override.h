// Which of an op's implementations runs: a process-wide forced choice (tests set it; benchmarks
// name one in an environment variable) and the choice the calling thread's most recent call made
// (tests read it to check the routing). Host code only; not part of the public API.
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <utility>

namespace fusekit::detail {

// Choice: an enum class whose value 0 means `automatic` (nothing forced). One instance of the
// state per enum type, shared by every translation unit.
template <typename Choice>
class ChoiceOverride {
 public:
  static void force(Choice choice) { forced_slot().store(static_cast<int>(choice)); }
  static Choice forced() { return static_cast<Choice>(forced_slot().load()); }
  // The forced choice; else the one that environment variable `env` names among `names` (read on
  // every call, so that a benchmark can switch between runs); else automatic.
  static Choice requested(const char* env, std::initializer_list<std::pair<const char*, Choice>> names) {
    if (const Choice choice = forced(); choice != Choice{}) return choice;
    if (const char* value = std::getenv(env))
      for (const auto& [name, choice] : names)
        if (std::strcmp(value, name) == 0) return choice;
    return Choice{};
  }
  static void record(Choice choice) { last_slot() = choice; }
  static Choice last() { return last_slot(); }

 private:
  static std::atomic<int>& forced_slot() {
    static std::atomic<int> value{0};
    return value;
  }
  static Choice& last_slot() {
    thread_local Choice value{};
    return value;
  }
};

}  // namespace fusekit::detail
