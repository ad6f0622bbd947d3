// Which of an op's implementations runs: a process-wide forced choice (tests set it), else the one
// an override key names (core/overrides.h), and the choice the calling thread's most recent call
// made (tests read it to check the routing). Host code only; not part of the public API.
#pragma once

#include <atomic>
#include <initializer_list>
#include <utility>

#include "core/overrides.h"

namespace fusekit::detail {

// Choice: an enum class whose value 0 means `automatic` (nothing forced). One instance of the
// state per enum type, shared by every translation unit.
template <typename Choice>
class ChoiceOverride {
 public:
  static void force(Choice choice) { forced_slot().store(static_cast<int>(choice)); }
  static Choice forced() { return static_cast<Choice>(forced_slot().load()); }
  // The forced choice; else the one override key `key` names among `names`; else automatic.
  static Choice requested(const char* key, std::initializer_list<std::pair<const char*, Choice>> names) {
    if (const Choice choice = forced(); choice != Choice{}) return choice;
    return override_choice(key, names).value_or(Choice{});
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
