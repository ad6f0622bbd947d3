// Launch-choice overrides: the one way tests, benchmarks and tuning sweeps force a choice that a
// family's config table would otherwise make. Host code only; not part of the public API.
//
// A key names one choice ("norm.backward.block", "linear.autotune", ...); every key is listed, with
// what it takes, in kOverrideKeys (overrides.cpp), and `fusekit overrides` prints that list. Values
// come from set_override() (tests, `fusekit bench --override key=value`) or from the environment
// variable FUSEKIT_OVERRIDE="key=value,key=value", read once at the first lookup. An unknown key or
// a value that does not parse is an Error, never silently ignored. With nothing set, a lookup is
// one relaxed atomic load.
#pragma once

#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fusekit/error.h"

namespace fusekit::detail {

struct OverrideKey {
  const char* name;
  const char* values;  // what it takes, e.g. "64..1024" or "auto|cluster|single"
  const char* what;    // the choice it forces, one line
};

// Every key the library reads.
const std::vector<OverrideKey>& override_keys();

// Sets `key` to `value` (an empty value clears it). Throws Error(invalid_argument) for an unknown key.
void set_override(const std::string& key, const std::string& value);
// Parses "key=value,key=value" and sets each.
void set_overrides(const std::string& list);
void clear_overrides();

// The value set for `key`, if any.
std::optional<std::string> override_value(const char* key);

// An integer in [lo, hi]; throws Error naming the key for anything else.
std::optional<long long> override_int(const char* key, long long lo, long long hi);

// One of `names`; throws Error naming the key and listing the names for anything else.
template <typename Choice>
std::optional<Choice> override_choice(const char* key, std::initializer_list<std::pair<const char*, Choice>> names) {
  const std::optional<std::string> value = override_value(key);
  if (!value) return std::nullopt;
  std::string known;
  for (const auto& [name, choice] : names) {
    if (*value == name) return choice;
    if (!known.empty()) known += "|";
    known += name;
  }
  throw Error(ErrorKind::invalid_argument, "override", key, known, *value);
}

}  // namespace fusekit::detail
