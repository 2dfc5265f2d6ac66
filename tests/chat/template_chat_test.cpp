// The checkpoint's own chat template as the chat format: prompts and ids equal to @huggingface/jinja +
// @huggingface/tokenizers on the three layouts make-random writes (fixture hf_reference), the format chosen by
// for_model (template, override file, built-in fallback, K3), the Kimi-K2 and DeepSeek-V3 output parsers, stop ids,
// and reasoning_effort values accepted consistently by every format.
#include <gtest/gtest.h>

#include <fstream>

#include "chat/chat_testing.h"
#include "core/error.h"
#include "server/chat/chat_templates.h"
#include "temp_dir.h"

namespace bg {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

fs::path reference_dir() { return fs::path(BG_BINARY_DIR) / "hf_reference"; }

json load_json(const fs::path& p) {
  std::ifstream in(p);
  if (!in.good()) return json();
  return json::parse(in);
}

ChatOptions case_options(const json& c) {
  ChatOptions o;
  o.thinking = c["thinking"].get<bool>();
  o.add_generation_prompt = c["add_generation_prompt"].get<bool>();
  return o;
}

TEST(TemplateReference, PromptsMatchJinjaJs) {
  const json expected = load_json(reference_dir() / "expected.json");
  ASSERT_FALSE(expected.is_null()) << "run the hf_reference CTest fixture first";
  const json cases = load_json(fs::path(BG_SOURCE_DIR) / "tests/chat/template_cases.json");
  for (const std::string layout : {"deepseek_v3.1", "deepseek_v3", "kimi_k2"}) {
    const fs::path dir = reference_dir() / layout;
    const Tokenizer tok = Tokenizer::load(dir);
    const auto fmt = ChatFormat::for_model(dir, tok);
    EXPECT_NE(fmt->describe().find("tokenizer_config.json"), std::string::npos);
    const json& got = expected["layouts"][layout]["chat"];
    ASSERT_EQ(got.size(), cases.size());
    for (size_t i = 0; i < cases.size(); ++i) {
      const json& c = cases[i];
      EXPECT_EQ(fmt->render_text(c["messages"], c["tools"], case_options(c)), got[i]["text"].get<std::string>())
          << layout << " case " << c["name"];
    }
  }
}

TEST(TemplateReference, IdsMatchTokenizersJs) {
  const json expected = load_json(reference_dir() / "expected.json");
  ASSERT_FALSE(expected.is_null()) << "run the hf_reference CTest fixture first";
  const json cases = load_json(fs::path(BG_SOURCE_DIR) / "tests/chat/template_cases.json");
  for (const std::string layout : {"deepseek_v3.1", "deepseek_v3"}) {
    const fs::path dir = reference_dir() / layout;
    const Tokenizer tok = Tokenizer::load(dir);
    const auto fmt = ChatFormat::for_model(dir, tok);
    const json& got = expected["layouts"][layout]["chat"];
    for (size_t i = 0; i < cases.size(); ++i) {
      const json& c = cases[i];
      EXPECT_EQ(fmt->render(c["messages"], c["tools"], case_options(c)), got[i]["ids"].get<std::vector<int32_t>>())
          << layout << " case " << c["name"];
    }
  }
}

// A deepseek_v3 checkpoint directory (config + tokenizer files) of a chat-template layout.
void write_checkpoint(const fs::path& dir, const std::string& layout) {
  json config = {{"model_type", "deepseek_v3"}, {"vocab_size", 512}, {"bos_token_id", 0}, {"eos_token_id", 1}};
  if (layout == "kimi_k2") config.update(kimi_k2_config_patch(512));
  std::ofstream(dir / "config.json") << config.dump();
  write_random_tokenizer("deepseek_v3", config, dir, layout);
}

TEST(TemplateChat, ForModelPicksTemplateOverrideAndFallback) {
  testing::TempDir dir;
  write_checkpoint(dir.path(), "deepseek_v3.1");
  const Tokenizer tok = Tokenizer::load(dir.path());
  const json hello = json::parse(R"([{"role": "user", "content": "Hello"}])");
  EXPECT_EQ(ChatFormat::for_model(dir.path(), tok)->render_text(hello, nullptr, testing::options(false)),
            "<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜></think>");
  // --chat-template FILE overrides the checkpoint's.
  std::ofstream(dir / "mine.jinja") << "{{ bos_token }}{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}";
  auto over = ChatFormat::for_model(dir.path(), tok, dir / "mine.jinja");
  EXPECT_EQ(over->render_text(hello, nullptr, {}), "<｜begin▁of▁sentence｜>[user:Hello]");
  EXPECT_EQ(over->render(hello, nullptr, {}).front(), 0);  // the BOS text became the BOS id
  EXPECT_THROW(ChatFormat::for_model(dir.path(), tok, dir / "missing.jinja"), Error);
  std::ofstream(dir / "bad.jinja") << "{% if %}";
  EXPECT_THROW(ChatFormat::for_model(dir.path(), tok, dir / "bad.jinja"), Error);
  // chat_template.jinja beside the config is read when tokenizer_config.json has none.
  json config = load_json(dir / "tokenizer_config.json");
  config.erase("chat_template");
  std::ofstream(dir / "tokenizer_config.json") << config.dump();
  EXPECT_NE(ChatFormat::for_model(dir.path(), tok)->describe().find("built-in"), std::string::npos);
  std::ofstream(dir / "chat_template.jinja") << "{{ messages[0].content }}!";
  EXPECT_EQ(ChatFormat::for_model(dir.path(), tok)->render_text(hello, nullptr, {}), "Hello!");
}

TEST(TemplateChat, TemplateErrorsAreRequestErrors) {
  testing::TempDir dir;
  write_checkpoint(dir.path(), "deepseek_v3.1");
  const Tokenizer tok = Tokenizer::load(dir.path());
  std::ofstream(dir / "strict.jinja") << "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}"
                                         "{% endif %}ok";
  auto fmt = ChatFormat::for_model(dir.path(), tok, dir / "strict.jinja");
  try {
    fmt->render(json::parse(R"([{"role": "system", "content": "s"}])"), nullptr, {});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("first must be user"), std::string::npos);
  }
  EXPECT_THROW(fmt->render(json::parse(R"([{"role": "robot", "content": "s"}])"), nullptr, {}), Error);
}

TEST(TemplateChat, KimiK2ToolCallsAndThinkingParse) {
  testing::TempDir dir;
  write_checkpoint(dir.path(), "kimi_k2");
  const Tokenizer tok = Tokenizer::load(dir.path());
  const auto fmt = ChatFormat::for_model(dir.path(), tok);
  const auto stops = fmt->stop_token_ids();
  EXPECT_NE(std::find(stops.begin(), stops.end(), *tok.special_id("<|im_end|>")), stops.end());
  using testing::Special;
  const auto ids = testing::stream(
      tok, {Special{"<think>"}, std::string("Need weather."), Special{"</think>"}, std::string("Checking."),
            Special{"<|tool_calls_section_begin|>"}, Special{"<|tool_call_begin|>"}, std::string("functions.get_weather:0"),
            Special{"<|tool_call_argument_begin|>"}, std::string("{\"city\": \"巴黎\"}"), Special{"<|tool_call_end|>"},
            Special{"<|tool_call_begin|>"}, std::string("functions.noop:1"), Special{"<|tool_call_argument_begin|>"},
            Special{"<|tool_call_end|>"}, Special{"<|tool_calls_section_end|>"}, Special{"<|im_end|>"}});
  auto parser = fmt->make_parser(testing::options(false));
  const testing::Parsed p = testing::parse_all(*parser, ids);
  EXPECT_EQ(p.reasoning, "Need weather.");
  EXPECT_EQ(p.content, "Checking.");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].id, "functions.get_weather:0");
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(p.calls[0].arguments, "{\"city\": \"巴黎\"}");
  EXPECT_EQ(p.calls[1].name, "noop");
  EXPECT_EQ(p.calls[1].arguments, "{}");
}

TEST(TemplateChat, DeepSeekV3CallLayoutAndReasoningStart) {
  testing::TempDir dir;
  write_checkpoint(dir.path(), "deepseek_v3");
  const Tokenizer tok = Tokenizer::load(dir.path());
  const auto fmt = ChatFormat::for_model(dir.path(), tok);
  using testing::Special;
  const auto ids = testing::stream(
      tok, {std::string("Sure."), Special{"<｜tool▁calls▁begin｜>"}, Special{"<｜tool▁call▁begin｜>"},
            std::string("function"), Special{"<｜tool▁sep｜>"}, std::string("get_weather\n```json\n{\"city\": \"Paris\"}\n```"),
            Special{"<｜tool▁call▁end｜>"}, Special{"<｜tool▁calls▁end｜>"}, Special{"<｜end▁of▁sentence｜>"}});
  auto parser = fmt->make_parser(testing::options(false));
  const testing::Parsed p = testing::parse_all(*parser, ids);
  EXPECT_EQ(p.content, "Sure.");
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(p.calls[0].arguments, "{\"city\": \"Paris\"}");
  // V3.1: the generation prompt ends with <think> when thinking: the parser starts in reasoning.
  testing::TempDir v31;
  write_checkpoint(v31.path(), "deepseek_v3.1");
  const Tokenizer t31 = Tokenizer::load(v31.path());
  const auto f31 = ChatFormat::for_model(v31.path(), t31);
  const json hello = json::parse(R"([{"role": "user", "content": "Hi"}])");
  EXPECT_TRUE(f31->reasoning_open_after(f31->render(hello, nullptr, testing::options(true))));
  EXPECT_FALSE(f31->reasoning_open_after(f31->render(hello, nullptr, testing::options(false))));
  ChatOptions o = testing::options(true);
  o.starts_in_reasoning = true;
  auto p31 = f31->make_parser(o);
  const auto r = testing::parse_all(*p31, testing::stream(t31, {std::string("hmm"), Special{"</think>"}, std::string("Hello")}));
  EXPECT_EQ(r.reasoning, "hmm");
  EXPECT_EQ(r.content, "Hello");
}

TEST(TemplateChat, ReasoningEffortValuesAreTheSameEverywhere) {
  const json hello = json::parse(R"([{"role": "user", "content": "Hi"}])");
  testing::TempDir dir;
  write_checkpoint(dir.path(), "deepseek_v3.1");
  const Tokenizer tok = Tokenizer::load(dir.path());
  std::vector<std::unique_ptr<ChatFormat>> formats;
  formats.push_back(make_kimi_k3_chat_format(testing::k3_tokenizer()));
  formats.push_back(ChatFormat::for_model(dir.path(), tok));
  formats.push_back(make_deepseek_v3_chat_format(testing::ds_tokenizer()));
  for (const auto& fmt : formats) {
    for (std::string_view effort : kReasoningEfforts) {
      EXPECT_NO_THROW(fmt->render(hello, nullptr, testing::options(true, std::string(effort)))) << effort;
    }
    EXPECT_THROW(fmt->render(hello, nullptr, testing::options(true, "extreme")), Error) << fmt->describe();
  }
}

}  // namespace
}  // namespace bg
