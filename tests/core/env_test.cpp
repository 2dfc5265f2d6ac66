// The BG_* environment parsers: what each accepts, and that anything else is an error naming the variable.
#include "core/env.h"

#include <gtest/gtest.h>

#include <string>

#include "core/error.h"

namespace bg {
namespace {

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Env, IntegersInRange) {
  EXPECT_EQ(env_int("BG_X", nullptr, 1, 10), std::nullopt);
  EXPECT_EQ(env_int("BG_X", "", 1, 10), std::nullopt);
  EXPECT_EQ(env_int("BG_X", "7", 1, 10), 7);
  EXPECT_EQ(env_int("BG_X", "10", 1, 10), 10);
  EXPECT_EQ(env_int("BG_X", "-3", -5, 10), -3);
  for (const char* bad : {"0", "11", "7x", " 7", "7 ", "x", "1e3", "99999999999999999999", "+7"}) {
    const std::string e = error_of([&] { env_int("BG_X", bad, 1, 10); });
    EXPECT_NE(e.find("BG_X='"), std::string::npos) << bad << ": " << e;
    EXPECT_NE(e.find("[1, 10]"), std::string::npos) << bad << ": " << e;
  }
}

TEST(Env, Switches) {
  EXPECT_TRUE(env_switch("BG_S", nullptr, true));
  EXPECT_FALSE(env_switch("BG_S", "", false));
  EXPECT_TRUE(env_switch("BG_S", "1", false));
  EXPECT_FALSE(env_switch("BG_S", "0", true));
  for (const char* bad : {"yes", "true", "2", "01", " 1"}) {
    EXPECT_NE(error_of([&] { env_switch("BG_S", bad, true); }).find("BG_S='"), std::string::npos) << bad;
  }
}

TEST(Env, Choices) {
  EXPECT_EQ(env_choice("BG_C", nullptr, {"a", "b"}), -1);
  EXPECT_EQ(env_choice("BG_C", "", {"a", "b"}), -1);
  EXPECT_EQ(env_choice("BG_C", "b", {"a", "b"}), 1);
  const std::string e = error_of([] { env_choice("BG_C", "c", {"a", "b"}); });
  EXPECT_NE(e.find("BG_C='c'"), std::string::npos) << e;
  EXPECT_NE(e.find("a, b"), std::string::npos) << e;
}

}  // namespace
}  // namespace bg
