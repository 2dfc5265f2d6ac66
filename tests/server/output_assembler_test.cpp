// Token events -> deltas: stop strings over token boundaries (trimmed, cancel requested), reasoning and tool-call
// pieces, finish reasons, logprobs, counts.
#include <gtest/gtest.h>

#include "fake_text_model.h"
#include "server/frontend/output_assembler.h"

namespace bg::frontend {
namespace {

using bg::testing::bytes_to_ids;

proto::TokenEvent ev(std::vector<int32_t> tokens, std::string finish = "") {
  proto::TokenEvent e;
  e.id = std::string("r");
  e.tokens = std::move(tokens);
  e.finish_reason = std::move(finish);
  e.prompt_tokens = 3;
  return e;
}

TEST(OutputAssembler, CompletionStopStringAcrossTokens) {
  bg::testing::FakeTextModel model;
  CommonRequest req;
  req.stop = {"END"};
  OutputAssembler a(model, ApiKind::completion, req, {});
  FullOutput out;
  for (int32_t t : bytes_to_ids("abcENxyzEND tail")) {
    out.add(a.feed(ev({t})));
    if (a.done()) break;
  }
  EXPECT_TRUE(a.done());
  EXPECT_TRUE(a.stop_matched());
  EXPECT_EQ(a.finish_reason(), "stop");
  EXPECT_EQ(out.text, "abcENxyz");
  EXPECT_EQ(a.completion_tokens(), 11);  // up to and including the token that completed "END"
  EXPECT_EQ(a.prompt_tokens(), 3);
  EXPECT_TRUE(a.feed(ev({65})).empty());  // nothing after done
}

TEST(OutputAssembler, HeldBackTextIsFlushedAtTheEnd) {
  bg::testing::FakeTextModel model;
  CommonRequest req;
  req.stop = {"xyz"};
  OutputAssembler a(model, ApiKind::completion, req, {});
  FullOutput out;
  out.add(a.feed(ev(bytes_to_ids("abx"))));
  EXPECT_EQ(out.text, "ab");
  out.add(a.feed(ev(bytes_to_ids("y"), "length")));
  EXPECT_EQ(out.text, "abxy");
  EXPECT_EQ(a.finish_reason(), "length");
  EXPECT_FALSE(a.stop_matched());
}

TEST(OutputAssembler, ChatReasoningToolCallsAndFinish) {
  using namespace bg::testing;
  FakeTextModel model;
  OutputAssembler a(model, ApiKind::chat, CommonRequest{}, ChatParams{});
  std::vector<int32_t> toks = {kThink};
  for (int32_t t : bytes_to_ids("plan")) toks.push_back(t);
  toks.push_back(kThinkEnd);
  toks.push_back(kTool);
  for (int32_t t : bytes_to_ids("get:{\"q\":1}")) toks.push_back(t);
  toks.push_back(kToolEnd);
  toks.push_back(kEos);
  FullOutput out;
  for (size_t i = 0; i < toks.size(); ++i) out.add(a.feed(ev({toks[i]}, i + 1 == toks.size() ? "stop" : "")));
  EXPECT_EQ(out.reasoning, "plan");
  EXPECT_EQ(out.text, "");
  ASSERT_EQ(out.tool_calls.size(), 1u);
  EXPECT_EQ(out.tool_calls[0].name, "get");
  EXPECT_EQ(out.tool_calls[0].id, "call_0");
  EXPECT_EQ(out.tool_calls[0].arguments, "{\"q\":1}");
  EXPECT_EQ(a.finish_reason(), "tool_calls");
}

TEST(OutputAssembler, LogprobsAndErrors) {
  bg::testing::FakeTextModel model;
  CommonRequest req;
  req.logprobs = true;
  OutputAssembler a(model, ApiKind::completion, req, {});
  proto::TokenEvent e = ev({'h', 'i'});
  e.logprobs = {{'h', -0.1f, {{'h', -0.1f}}}, {'i', -0.2f, {}}};
  OutputDelta d = a.feed(e);
  ASSERT_EQ(d.logprobs.size(), 2u);
  EXPECT_EQ(d.logprobs[0].bytes, "h");
  EXPECT_EQ(d.logprobs[0].top[0].first, "h");
  EXPECT_FLOAT_EQ(d.logprobs[1].logprob, -0.2f);

  proto::TokenEvent err = ev({}, "error");
  err.error = "boom";
  err.error_code = 429;
  a.feed(err);
  EXPECT_EQ(a.finish_reason(), "error");
  EXPECT_EQ(a.error(), "boom");
  EXPECT_EQ(a.error_code(), 429);
}

}  // namespace
}  // namespace bg::frontend
