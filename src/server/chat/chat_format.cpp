// ChatFormat::for_model: picks the chat format from config.json's model_type.
#include "server/chat/chat_format.h"

#include <fstream>

#include "core/error.h"
#include "server/chat/kimi_k3_chat.h"

namespace bg {

std::unique_ptr<ChatFormat> make_kimi_k3_chat_format(const Tokenizer& tok) {
  return std::make_unique<KimiK3ChatFormat>(tok);
}

std::unique_ptr<ChatFormat> ChatFormat::for_model(const std::filesystem::path& dir, const Tokenizer& tok) {
  const std::filesystem::path path = dir / "config.json";
  std::ifstream in(path);
  BG_CHECK(in.good(), "{}: cannot open the file", path.string());
  const nlohmann::json config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  BG_CHECK(!config.is_discarded() && config.is_object(), "{}: not a JSON object", path.string());
  const nlohmann::json type = config.value("model_type", nlohmann::json());
  BG_CHECK(type.is_string(), "{}: model_type missing", path.string());
  const std::string t = type.get<std::string>();
  if (t == "kimi_k3") return make_kimi_k3_chat_format(tok);
  if (t == "deepseek_v3" || t == "kimi_k2") return make_deepseek_v3_chat_format(tok);
  fail("{}: no chat format for model_type '{}' (kimi_k3, deepseek_v3, kimi_k2)", path.string(), t);
}

}  // namespace bg
