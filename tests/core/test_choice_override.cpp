// The implementation-choice switch behind the ops' test and benchmark overrides: a forced choice
// wins over the environment, the environment names a choice only when nothing is forced (and
// only a known name), and the last choice is recorded per calling thread.
#include <gtest/gtest.h>

#include <cstdlib>
#include <thread>

#include "core/choice_override.h"

namespace fusekit {
namespace {

enum class Fruit : int { automatic = 0, apple, pear };
using FruitChoice = detail::ChoiceOverride<Fruit>;
constexpr const char* kEnv = "FUSEKIT_TEST_FRUIT";

Fruit requested() { return FruitChoice::requested(kEnv, {{"apple", Fruit::apple}, {"pear", Fruit::pear}}); }

TEST(ChoiceOverride, ForcedWinsOverTheEnvironment) {
  unsetenv(kEnv);
  FruitChoice::force(Fruit::automatic);
  EXPECT_EQ(requested(), Fruit::automatic);
  setenv(kEnv, "pear", 1);
  EXPECT_EQ(requested(), Fruit::pear);
  FruitChoice::force(Fruit::apple);
  EXPECT_EQ(FruitChoice::forced(), Fruit::apple);
  EXPECT_EQ(requested(), Fruit::apple);
  FruitChoice::force(Fruit::automatic);
  EXPECT_EQ(requested(), Fruit::pear);
  setenv(kEnv, "plum", 1);  // an unknown name chooses nothing
  EXPECT_EQ(requested(), Fruit::automatic);
  unsetenv(kEnv);
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
