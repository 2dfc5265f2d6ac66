// The frontend with the real text model of DeepSeek-V3-layout checkpoints (tokenizer.json + Jinja chat_template, as
// make-random writes them) against the scripted fake worker: tools reach the template in the client's key order, the
// output parser starts in the channel the rendered prompt leaves open, and a completions text prompt gets the BOS the
// tokenizer files ask for.
#include <fstream>

#include "frontend_fixture.h"
#include "server/frontend/text_model.h"
#include "server/tokenizer/tokenizer.h"
#include "server/tokenizer/tokenizer_writer.h"
#include "temp_dir.h"

namespace bg::frontend {
namespace {

using nlohmann::json;

// A tiny DeepSeek-V3 checkpoint's tokenizer files with the chat-template layout `layout` ("deepseek_v3.1" or
// "deepseek_v3"); `tokenizer_config` entries replace the written ones.
void write_ds_checkpoint(const std::filesystem::path& dir, const std::string& layout,
                         const json& tokenizer_config = {}) {
  const json config = {{"model_type", "deepseek_v3"}, {"vocab_size", 512}, {"bos_token_id", 0}, {"eos_token_id", 1}};
  std::ofstream(dir / "config.json") << config.dump();
  write_random_tokenizer("deepseek_v3", config, dir, layout);
  if (tokenizer_config.is_object()) {
    json tc = json::parse(std::ifstream(dir / "tokenizer_config.json"));
    tc.update(tokenizer_config);
    std::ofstream(dir / "tokenizer_config.json") << tc.dump();
  }
}

class TemplateFrontendTest : public FrontendTest {
 protected:
  // Serves dir_ (`chat_template`: a file replacing its template, "" = its own); the worker answers `reasoning` +
  // </think> (when non-empty), then `reply` and EOS.
  void serve(const std::string& chat_template, const std::string& reasoning, const std::string& reply) {
    text_model_ = load_text_model(dir_.path().string(), chat_template);
    tok_ = std::make_unique<Tokenizer>(Tokenizer::load(dir_.path()));
    std::vector<int32_t> script = tok_->encode(reasoning);
    if (!reasoning.empty()) script.push_back(*tok_->special_id("</think>"));
    for (int32_t id : tok_->encode(reply)) script.push_back(id);
    script.push_back(tok_->eos_id());
    start([script](const proto::GenerateRequest&) { return script; }, {}, text_model_.get(), 4096);
  }
  json chat(const json& body) {
    const auto res = post("/v1/chat/completions", body.dump());
    EXPECT_EQ(res.status, 200) << res.body;
    return json::parse(res.body)["choices"][0]["message"];
  }

  bg::testing::TempDir dir_;
  std::unique_ptr<TextModel> text_model_;
  std::unique_ptr<Tokenizer> tok_;
};

const json kHello = json::array({{{"role", "user"}, {"content", "Hi"}}});

// Tool schemas are rendered as the client wrote them (keys unsorted), as Python dicts keep them for the reference
// template engines: "required" before "properties", "zeta" before "alpha".
TEST_F(TemplateFrontendTest, ToolsKeepTheClientsKeyOrder) {
  write_ds_checkpoint(dir_.path(), "deepseek_v3.1");
  std::ofstream(dir_ / "tools.jinja") << "{{ bos_token }}{{ tools | tojson }}{% for m in messages %}{{ m.content }}"
                                         "{% endfor %}";
  serve((dir_ / "tools.jinja").string(), "", "Hello");
  const std::string body = R"({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "tools": [
      {"type": "function", "function": {"name": "zz_tool", "parameters": {"type": "object", "required": ["zeta"],
       "properties": {"zeta": {"type": "string"}, "alpha": {"type": "integer"}}}}}]})";
  const auto res = post("/v1/chat/completions", body);
  ASSERT_EQ(res.status, 200) << res.body;
  const auto received = worker_->received();
  ASSERT_EQ(received.size(), 1u);
  const std::string prompt = tok_->decode(received[0].prompt);
  const size_t type = prompt.find("\"type\""), function = prompt.find("\"function\"");
  const size_t required = prompt.find("\"required\""), properties = prompt.find("\"properties\"");
  const size_t zeta = prompt.find("\"zeta\":"), alpha = prompt.find("\"alpha\":");
  for (size_t pos : {type, function, required, properties, zeta, alpha}) ASSERT_NE(pos, std::string::npos) << prompt;
  EXPECT_LT(type, function) << prompt;
  EXPECT_LT(required, properties) << prompt;
  EXPECT_LT(zeta, alpha) << prompt;
  EXPECT_TRUE(prompt.ends_with("Hi")) << prompt;
}

// DeepSeek-V3.1's template opens the assistant turn with <think> when thinking: the reply up to </think> is reasoning.
TEST_F(TemplateFrontendTest, ParserStartsInReasoningWhenThePromptOpensIt) {
  write_ds_checkpoint(dir_.path(), "deepseek_v3.1");
  serve("", "Let me think.", "Hello");
  const json on = chat({{"model", "tiny"}, {"messages", kHello}, {"chat_template_kwargs", {{"thinking", true}}}});
  EXPECT_EQ(on["reasoning_content"], "Let me think.");
  EXPECT_EQ(on["content"], "Hello");
  EXPECT_EQ(worker_->received().back().prompt.back(), *tok_->special_id("<think>"));
}

// DeepSeek-V3 (0324) has no thinking mode: asked to think, its template still opens no <think>, so the reply is
// content (the parser must follow the prompt, not the request's flag).
TEST_F(TemplateFrontendTest, ParserStartsInContentWhenThePromptDoesNotOpenReasoning) {
  write_ds_checkpoint(dir_.path(), "deepseek_v3");
  serve("", "", "Hello there");
  const json m = chat({{"model", "tiny"}, {"messages", kHello}, {"chat_template_kwargs", {{"thinking", true}}}});
  EXPECT_EQ(m["content"], "Hello there");
  EXPECT_TRUE(!m.contains("reasoning_content") || m["reasoning_content"].is_null() || m["reasoning_content"] == "")
      << m.dump();
  EXPECT_NE(worker_->received().back().prompt.back(), *tok_->special_id("<think>"));
}

// /v1/completions: a text prompt starts with BOS as tokenizer(text) does; token ids are taken as given.
TEST_F(TemplateFrontendTest, CompletionTextPromptGetsBosIdsDoNot) {
  write_ds_checkpoint(dir_.path(), "deepseek_v3.1");
  serve("", "", "Hello");
  ASSERT_EQ(post("/v1/completions", R"({"model": "tiny", "prompt": "Hi there"})").status, 200);
  ASSERT_EQ(post("/v1/completions", R"({"model": "tiny", "prompt": [5, 6, 7]})").status, 200);
  const auto received = worker_->received();
  ASSERT_EQ(received.size(), 2u);
  std::vector<int32_t> want{tok_->bos_id()};
  for (int32_t id : tok_->encode("Hi there")) want.push_back(id);
  EXPECT_EQ(received[0].prompt, want);
  EXPECT_EQ(received[1].prompt, (std::vector<int32_t>{5, 6, 7}));
}

// tokenizer_config.json's add_bos_token: false (LlamaTokenizerFast) wins over tokenizer.json's post-processor.
TEST_F(TemplateFrontendTest, CompletionFollowsAddBosTokenFalse) {
  write_ds_checkpoint(dir_.path(), "deepseek_v3.1", {{"add_bos_token", false}});
  serve("", "", "Hello");
  ASSERT_EQ(post("/v1/completions", R"({"model": "tiny", "prompt": "Hi there"})").status, 200);
  EXPECT_EQ(worker_->received().at(0).prompt, tok_->encode("Hi there"));
}

}  // namespace
}  // namespace bg::frontend
