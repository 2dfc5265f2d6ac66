// Request validation: typed reads of every supported OpenAI parameter, explicit 400s for unsupported ones.
#include "server/frontend/request_parse.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "server/frontend/api_error.h"

namespace bg::frontend {

using nlohmann::json;

namespace {

[[noreturn]] void bad(const std::string& param, const std::string& message) { throw ApiError(400, message, param); }

// Typed optional reads from the request object: absent or null -> nullopt; a wrong type -> 400 naming the field.
class Fields {
 public:
  explicit Fields(const json& obj) : obj_(obj) {}

  const json* find(const char* key) const {
    auto it = obj_.find(key);
    return it == obj_.end() || it->is_null() ? nullptr : &*it;
  }
  std::optional<bool> boolean(const char* key) const {
    const json* v = find(key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_boolean()) bad(key, fmt::format("'{}' must be a boolean", key));
    return v->get<bool>();
  }
  std::optional<double> number(const char* key) const {
    const json* v = find(key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number()) bad(key, fmt::format("'{}' must be a number", key));
    return v->get<double>();
  }
  std::optional<int64_t> integer(const char* key) const {
    const json* v = find(key);
    if (v == nullptr) return std::nullopt;
    if (v->is_number_float()) {
      const double d = v->get<double>();
      if (std::floor(d) == d && std::fabs(d) < 9e15) return static_cast<int64_t>(d);
    }
    if (!v->is_number_integer()) bad(key, fmt::format("'{}' must be an integer", key));
    if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      bad(key, fmt::format("'{}' is out of range", key));
    }
    return v->get<int64_t>();
  }
  std::optional<std::string> string(const char* key) const {
    const json* v = find(key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_string()) bad(key, fmt::format("'{}' must be a string", key));
    return v->get<std::string>();
  }

 private:
  const json& obj_;
};

std::vector<std::string> parse_stop(const json* v) {
  std::vector<std::string> out;
  if (v == nullptr) return out;
  if (v->is_string()) {
    out.push_back(v->get<std::string>());
  } else if (v->is_array()) {
    for (const json& s : *v) {
      if (!s.is_string()) bad("stop", "'stop' must be a string or an array of strings");
      out.push_back(s.get<std::string>());
    }
  } else {
    bad("stop", "'stop' must be a string or an array of strings");
  }
  for (const std::string& s : out) {
    if (s.empty()) bad("stop", "'stop' strings must not be empty");
  }
  return out;
}

std::vector<int32_t> parse_token_list(const json& v, const char* param) {
  if (!v.is_array()) bad(param, fmt::format("'{}' must be an array of token ids", param));
  std::vector<int32_t> out;
  for (const json& t : v) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      bad(param, fmt::format("'{}' must hold non-negative integer token ids", param));
    }
    out.push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  return out;
}

// Parameters we do not implement: a non-default value is an error, never silently dropped.
void reject_unsupported(const Fields& f) {
  for (const char* key : {"presence_penalty", "frequency_penalty"}) {
    if (auto v = f.number(key); v && *v != 0.0) bad(key, fmt::format("'{}' is not supported yet", key));
  }
  if (const json* v = f.find("logit_bias"); v != nullptr && !(v->is_object() && v->empty())) {
    bad("logit_bias", "'logit_bias' is not supported yet");
  }
  if (auto v = f.integer("best_of"); v && *v != 1) bad("best_of", "'best_of' other than 1 is not supported");
  if (auto v = f.boolean("echo"); v && *v) bad("echo", "'echo' is not supported yet");
  if (f.find("suffix") != nullptr) bad("suffix", "'suffix' is not supported");
  if (const json* v = f.find("response_format"); v != nullptr) {
    if (!v->is_object() || v->value("type", std::string()) != "text") {
      bad("response_format", "only response_format {\"type\": \"text\"} is supported yet");
    }
  }
}

void parse_sampling(const Fields& f, CommonRequest& r) {
  proto::SamplingParams& s = r.sampling;
  if (auto t = f.number("temperature")) {
    if (*t < 0.0 || *t > 2.0) bad("temperature", fmt::format("'temperature' {} must be in [0, 2]", *t));
    s.temperature = static_cast<float>(*t);
  }
  if (auto p = f.number("top_p")) {
    if (*p <= 0.0 || *p > 1.0) bad("top_p", fmt::format("'top_p' {} must be in (0, 1]", *p));
    s.top_p = static_cast<float>(*p);
  }
  if (auto k = f.integer("top_k")) {
    if (*k < -1 || *k > std::numeric_limits<int32_t>::max()) bad("top_k", "'top_k' must be -1, 0 (off) or positive");
    s.top_k = *k <= 0 ? 0 : static_cast<int32_t>(*k);
  }
  if (auto seed = f.integer("seed")) s.seed = static_cast<uint64_t>(*seed);
  if (const json* ids = f.find("stop_token_ids")) s.stop_token_ids = parse_token_list(*ids, "stop_token_ids");
  if (auto ie = f.boolean("ignore_eos")) s.ignore_eos = *ie;
}

void parse_common(const json& body, CommonRequest& r) {
  Fields f(body);
  reject_unsupported(f);
  r.model = f.string("model").value_or("");
  r.stream = f.boolean("stream").value_or(false);
  if (const json* so = f.find("stream_options")) {
    if (!so->is_object()) bad("stream_options", "'stream_options' must be an object");
    if (!r.stream) bad("stream_options", "'stream_options' is only allowed when 'stream' is true");
    r.include_usage = Fields(*so).boolean("include_usage").value_or(false);
  }
  if (auto n = f.integer("n"); n && *n != 1) bad("n", fmt::format("'n' must be 1 (got {})", *n));
  std::optional<int64_t> max_tokens = f.integer("max_tokens");
  const char* max_key = "max_tokens";
  if (auto mct = f.integer("max_completion_tokens")) {
    max_tokens = mct;
    max_key = "max_completion_tokens";
  }
  if (max_tokens && *max_tokens <= 0) bad(max_key, fmt::format("'{}' must be at least 1 (got {})", max_key, *max_tokens));
  r.max_tokens = max_tokens;
  r.stop = parse_stop(f.find("stop"));
  parse_sampling(f, r);
}

void validate_messages(const json* messages) {
  if (messages == nullptr) bad("messages", "'messages' is required");
  if (!messages->is_array()) bad("messages", "'messages' must be an array");
  if (messages->empty()) bad("messages", "'messages' must not be empty");
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& m = (*messages)[i];
    const std::string param = fmt::format("messages[{}]", i);
    if (!m.is_object()) bad(param, fmt::format("'{}' must be an object", param));
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) bad(param + ".role", fmt::format("'{}.role' must be a string", param));
    static const char* kRoles[] = {"system", "developer", "user", "assistant", "tool"};
    bool known = false;
    for (const char* r : kRoles) known = known || *role == r;
    if (!known) bad(param + ".role", fmt::format("'{}.role' '{}' is not one of system, developer, user, assistant, "
                                                  "tool", param, role->get<std::string>()));
    auto content = m.find("content");
    if (content != m.end() && !content->is_null() && !content->is_string() && !content->is_array()) {
      bad(param + ".content", fmt::format("'{}.content' must be a string, an array of parts or null", param));
    }
  }
}

json validate_tools(const Fields& f) {
  const json* tools = f.find("tools");
  if (tools == nullptr) return json::array();
  if (!tools->is_array()) bad("tools", "'tools' must be an array");
  for (size_t i = 0; i < tools->size(); ++i) {
    const json& t = (*tools)[i];
    const std::string param = fmt::format("tools[{}]", i);
    if (!t.is_object() || t.value("type", std::string()) != "function") {
      bad(param, fmt::format("'{}' must be an object with type \"function\"", param));
    }
    auto fn = t.find("function");
    if (fn == t.end() || !fn->is_object() || !fn->contains("name") || !(*fn)["name"].is_string()) {
      bad(param + ".function", fmt::format("'{}.function' must be an object with a string name", param));
    }
  }
  return *tools;
}

ChatParams parse_chat_params(const Fields& f) {
  ChatParams p;
  if (const json* kw = f.find("chat_template_kwargs")) {
    if (!kw->is_object()) bad("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    Fields k(*kw);
    if (auto t = k.boolean("thinking")) p.thinking = *t;
    if (auto t = k.boolean("enable_thinking")) p.thinking = *t;
  }
  if (auto effort = f.string("reasoning_effort")) {
    if (*effort == "none") {
      p.thinking = false;
    } else if (*effort == "low" || *effort == "medium" || *effort == "high" || *effort == "max") {
      p.reasoning_effort = *effort;  // the chat format rejects a level its model does not have (400)
    } else {
      bad("reasoning_effort", fmt::format("'reasoning_effort' '{}' must be none, low, medium, high or max", *effort));
    }
  }
  return p;
}

}  // namespace

json parse_body(std::string_view body) {
  json j;
  try {
    j = json::parse(body.begin(), body.end());
  } catch (const json::parse_error& e) {
    throw ApiError(400, fmt::format("the request body is not valid JSON (or not valid UTF-8): {}", e.what()));
  }
  if (!j.is_object()) throw ApiError(400, "the request body must be a JSON object");
  return j;
}

ChatRequest parse_chat_request(const json& body) {
  ChatRequest r;
  parse_common(body, r.common);
  Fields f(body);
  if (auto lp = f.boolean("logprobs")) r.common.logprobs = *lp;
  if (auto top = f.integer("top_logprobs")) {
    if (*top < 0 || *top > 20) bad("top_logprobs", fmt::format("'top_logprobs' {} must be in [0, 20]", *top));
    if (!r.common.logprobs) bad("top_logprobs", "'top_logprobs' requires 'logprobs': true");
    r.common.top_logprobs = static_cast<int32_t>(*top);
  }
  validate_messages(f.find("messages"));
  r.messages = body.at("messages");
  r.tools = validate_tools(f);
  if (const json* choice = f.find("tool_choice")) {
    if (!choice->is_string() || (*choice != "auto" && *choice != "none")) {
      bad("tool_choice", "only 'tool_choice' \"auto\" or \"none\" is supported yet");
    }
    if (*choice == "none") r.tools = json::array();
  }
  r.chat = parse_chat_params(f);
  return r;
}

CompletionRequest parse_completion_request(const json& body) {
  CompletionRequest r;
  parse_common(body, r.common);
  Fields f(body);
  if (auto lp = f.integer("logprobs")) {
    if (*lp < 0 || *lp > 20) bad("logprobs", fmt::format("'logprobs' {} must be in [0, 20]", *lp));
    r.common.logprobs = true;
    r.common.top_logprobs = static_cast<int32_t>(*lp);
  }
  const json* prompt = f.find("prompt");
  if (prompt == nullptr) bad("prompt", "'prompt' is required");
  json p = *prompt;
  // A batch of one ([["text"]] or [[ids]]) is the same as the single prompt; larger batches are not supported.
  if (p.is_array() && !p.empty() && (p[0].is_string() || p[0].is_array())) {
    if (p.size() != 1) bad("prompt", "a batch of several prompts is not supported yet; send one prompt per request");
    p = json(p[0]);
  }
  if (p.is_string()) {
    r.prompt_text = p.get<std::string>();
    if (r.prompt_text.empty()) bad("prompt", "'prompt' must not be empty");
  } else if (p.is_array()) {
    r.prompt_ids = parse_token_list(p, "prompt");
    r.prompt_is_ids = true;
    if (r.prompt_ids.empty()) bad("prompt", "'prompt' must not be empty");
  } else {
    bad("prompt", "'prompt' must be a string or an array of token ids");
  }
  return r;
}

}  // namespace bg::frontend
