// ChatFormat::for_model on make-random style directories: config.json model_type + the written tokenizer files.
#include <gtest/gtest.h>

#include <fstream>

#include "chat/chat_testing.h"
#include "core/error.h"
#include "temp_dir.h"

namespace bg {
namespace {

using nlohmann::json;

TEST(ChatForModel, PicksTheFormatFromModelType) {
  testing::TempDir dir;
  const json k3_config = {{"model_type", "kimi_k3"}, {"text_config", {{"vocab_size", 1024}}}};
  std::ofstream(dir / "config.json") << k3_config.dump();
  write_random_tokenizer("kimi_k3", k3_config, dir.path());
  Tokenizer tok = Tokenizer::load(dir.path());
  auto fmt = ChatFormat::for_model(dir.path(), tok);
  const auto ids = fmt->render(json::parse(R"([{"role": "user", "content": "What is 2+2?"}])"), nullptr, {});
  const std::string text = tok.decode(ids);
  const std::string prompt_end = "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>";
  ASSERT_GT(text.size(), prompt_end.size());
  EXPECT_EQ(text.substr(text.size() - prompt_end.size()), prompt_end);
  EXPECT_EQ(fmt->stop_token_ids(), std::vector<int32_t>{1024 - 254});

  std::ofstream(dir / "config.json") << R"({"model_type": "llama"})";
  EXPECT_THROW(ChatFormat::for_model(dir.path(), tok), Error);
  std::ofstream(dir / "config.json") << R"({"model_type": "deepseek_v3"})";
  EXPECT_THROW(ChatFormat::for_model(dir.path(), tok), Error);  // a Kimi tokenizer has no DeepSeek markers

  testing::TempDir ds;
  const json ds_config = {{"model_type", "deepseek_v3"}, {"vocab_size", 512}, {"bos_token_id", 0}, {"eos_token_id", 1}};
  std::ofstream(ds / "config.json") << ds_config.dump();
  write_random_tokenizer("deepseek_v3", ds_config, ds.path());
  Tokenizer ds_tok = Tokenizer::load(ds.path());
  EXPECT_EQ(ChatFormat::for_model(ds.path(), ds_tok)->stop_token_ids(), std::vector<int32_t>{1});
}

}  // namespace
}  // namespace bg
