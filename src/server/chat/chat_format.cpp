// ChatFormat::for_model: picks the chat format from config.json's model_type and the checkpoint's chat template.
#include "server/chat/chat_format.h"

#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/log.h"
#include "server/chat/kimi_k3_chat.h"

namespace bg {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  BG_CHECK(in.good(), "{}: cannot open the file", path.string());
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// tokenizer_config.json's chat_template: a string, or a list of {"name", "template"} (the "default" one is used);
// else chat_template.jinja. Returns {source, where} or {"", ""} when the checkpoint ships none.
std::pair<std::string, std::string> checkpoint_template(const fs::path& dir) {
  std::error_code ec;
  const fs::path config_path = dir / "tokenizer_config.json";
  if (fs::exists(config_path, ec)) {
    const json config = json::parse(read_text(config_path), nullptr, /*allow_exceptions=*/false);
    BG_CHECK(!config.is_discarded() && config.is_object(), "{}: not a JSON object", config_path.string());
    if (config.contains("chat_template") && !config["chat_template"].is_null()) {
      const json& t = config["chat_template"];
      const std::string where = config_path.string() + " chat_template";
      if (t.is_string()) return {t.get<std::string>(), where};
      BG_CHECK(t.is_array(), "{}: must be a string or a list of {{\"name\", \"template\"}}", where);
      for (const json& entry : t) {
        BG_CHECK(entry.is_object() && entry.value("name", json()).is_string() &&
                     entry.value("template", json()).is_string(),
                 "{}: every entry needs a string name and template", where);
        if (entry["name"] == "default") return {entry["template"].get<std::string>(), where + "[default]"};
      }
      fail("{}: no template named 'default'", where);
    }
  }
  const fs::path jinja_path = dir / "chat_template.jinja";
  if (fs::exists(jinja_path, ec)) return {read_text(jinja_path), jinja_path.string()};
  return {"", ""};
}

}  // namespace

std::unique_ptr<ChatFormat> make_kimi_k3_chat_format(const Tokenizer& tok) {
  return std::make_unique<KimiK3ChatFormat>(tok);
}

bool ChatFormat::reasoning_open_after(std::span<const int32_t>) const { return false; }

std::unique_ptr<ChatFormat> ChatFormat::for_model(const fs::path& dir, const Tokenizer& tok,
                                                  const fs::path& template_file) {
  const fs::path path = dir / "config.json";
  std::ifstream in(path);
  BG_CHECK(in.good(), "{}: cannot open the file", path.string());
  const json config = json::parse(in, nullptr, /*allow_exceptions=*/false);
  BG_CHECK(!config.is_discarded() && config.is_object(), "{}: not a JSON object", path.string());
  const json type = config.value("model_type", json());
  BG_CHECK(type.is_string(), "{}: model_type missing", path.string());
  const std::string t = type.get<std::string>();
  BG_CHECK(t == "kimi_k3" || t == "deepseek_v3" || t == "kimi_k2",
           "{}: no chat format for model_type '{}' (kimi_k3, deepseek_v3, kimi_k2)", path.string(), t);
  if (!template_file.empty()) return make_template_chat_format(tok, read_text(template_file), template_file.string(), dir);
  if (t == "kimi_k3") return make_kimi_k3_chat_format(tok);
  auto [source, where] = checkpoint_template(dir);
  if (!source.empty()) return make_template_chat_format(tok, source, where, dir);
  log::info("{}: the checkpoint ships no chat_template: using the built-in DeepSeek-V3.1 style format", dir.string());
  return make_deepseek_v3_chat_format(tok);
}

}  // namespace bg
