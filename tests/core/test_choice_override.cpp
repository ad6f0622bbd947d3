// The implementation-choice switch behind the ops' test and benchmark overrides: a forced choice
// wins over an override key, the key names a choice only when nothing is forced (an unknown name is
// an error), and the last choice is recorded per calling thread. Also the override keys
// themselves (core/overrides.h): known keys only, values parsed and range-checked.
#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "core/choice_override.h"
#include "core/overrides.h"
#include "fusekit/error.h"

namespace fusekit {
namespace {

enum class Fruit : int { automatic = 0, apple, pear };
using FruitChoice = detail::ChoiceOverride<Fruit>;
// Any registered key serves: the choice's names are the caller's.
constexpr const char* kKey = "linear.backward.dz";

Fruit requested() { return FruitChoice::requested(kKey, {{"separate", Fruit::apple}, {"in_dgrad", Fruit::pear}}); }

TEST(ChoiceOverride, ForcedWinsOverTheOverrideKey) {
  detail::clear_overrides();
  FruitChoice::force(Fruit::automatic);
  EXPECT_EQ(requested(), Fruit::automatic);
  detail::set_override(kKey, "in_dgrad");
  EXPECT_EQ(requested(), Fruit::pear);
  FruitChoice::force(Fruit::apple);
  EXPECT_EQ(FruitChoice::forced(), Fruit::apple);
  EXPECT_EQ(requested(), Fruit::apple);
  FruitChoice::force(Fruit::automatic);
  EXPECT_EQ(requested(), Fruit::pear);
  detail::set_override(kKey, "plum");  // an unknown name is an error naming the key and the names
  try {
    requested();
    ADD_FAILURE() << "no Error for an unknown value";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), kKey);
    EXPECT_NE(std::string(e.what()).find("separate|in_dgrad"), std::string::npos) << e.what();
  }
  detail::set_override(kKey, "");  // an empty value clears the key
  EXPECT_EQ(requested(), Fruit::automatic);
  detail::clear_overrides();
}

TEST(Overrides, KnownKeysOnlyAndValuesChecked) {
  detail::clear_overrides();
  EXPECT_FALSE(detail::override_keys().empty());
  EXPECT_THROW(detail::set_override("no.such.key", "1"), Error);
  EXPECT_FALSE(detail::override_value("norm.backward.block").has_value());
  detail::set_overrides("norm.backward.block=256,linear.autotune=off");
  EXPECT_EQ(detail::override_int("norm.backward.block", 128, 512), 256);
  EXPECT_EQ(detail::override_value("linear.autotune"), "off");
  EXPECT_THROW(detail::override_int("norm.backward.block", 512, 1024), Error);  // out of range
  detail::set_override("norm.backward.block", "12x");
  EXPECT_THROW(detail::override_int("norm.backward.block", 1, 1024), Error);  // not a number
  EXPECT_THROW(detail::set_overrides("norm.backward.block"), Error);           // no '='
  detail::clear_overrides();
  EXPECT_FALSE(detail::override_value("linear.autotune").has_value());
}

TEST(ChoiceOverride, LastChoiceIsPerThread) {
  FruitChoice::record(Fruit::apple);
  Fruit seen_by_other = Fruit::apple;
  std::thread other([&] {
    seen_by_other = FruitChoice::last();  // nothing recorded on this thread yet
    FruitChoice::record(Fruit::pear);
  });
  other.join();
  EXPECT_EQ(seen_by_other, Fruit::automatic);
  EXPECT_EQ(FruitChoice::last(), Fruit::apple);
}

TEST(ChoiceOverride, ForcedIsProcessWide) {
  FruitChoice::force(Fruit::pear);
  Fruit seen_by_other = Fruit::automatic;
  std::thread other([&] { seen_by_other = FruitChoice::forced(); });
  other.join();
  EXPECT_EQ(seen_by_other, Fruit::pear);
  FruitChoice::force(Fruit::automatic);
}

}  // namespace
}  // namespace fusekit
