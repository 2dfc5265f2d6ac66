// Stop strings across token boundaries: held-back tails, trimming, earliest match, flush.
#include <gtest/gtest.h>

#include "server/frontend/stop_matcher.h"

namespace bg::frontend {
namespace {

// Feeds pieces; returns the emitted text.
std::string feed(StopMatcher& m, const std::vector<std::string>& pieces) {
  std::string out;
  for (const auto& p : pieces) out += m.push(p);
  return out;
}

TEST(StopMatcher, NoStopsPassesThrough) {
  StopMatcher m({});
  EXPECT_EQ(m.push("abc"), "abc");
  EXPECT_EQ(m.flush(), "");
  EXPECT_FALSE(m.stopped());
}

TEST(StopMatcher, MatchSplitAcrossPieces) {
  StopMatcher m({"STOP"});
  EXPECT_EQ(m.push("hello S"), "hello ");  // "S" may start STOP: held back
  EXPECT_EQ(m.push("T"), "");
  EXPECT_EQ(m.push("OP and more"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.matched(), "STOP");
  EXPECT_EQ(m.push("later"), "");
  EXPECT_EQ(m.flush(), "");
}

TEST(StopMatcher, FalseStartIsReleased) {
  StopMatcher m({"STOP"});
  EXPECT_EQ(feed(m, {"a ST", "A", "RT"}), "a START");  // "STA" is no prefix of STOP: released at once
  EXPECT_EQ(m.push("S"), "");
  EXPECT_EQ(m.flush(), "S");
  EXPECT_FALSE(m.stopped());
}

TEST(StopMatcher, EarliestOfSeveralAndOneByteAtATime) {
  StopMatcher m({"world", "lo w"});
  std::string out;
  for (char c : std::string("hello world")) out += m.push(std::string(1, c));
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(out, "hel");
  EXPECT_EQ(m.matched(), "lo w");
}

TEST(StopMatcher, MatchAtStartAndMultibyte) {
  StopMatcher a({"\n"});
  EXPECT_EQ(a.push("\nrest"), "");
  EXPECT_TRUE(a.stopped());
  StopMatcher b({"\xc3\xa9t\xc3\xa9"});  // "été"
  EXPECT_EQ(feed(b, {"un \xc3\xa9", "t", "\xc3\xa9!"}), "un ");
  EXPECT_TRUE(b.stopped());
}

}  // namespace
}  // namespace bg::frontend
