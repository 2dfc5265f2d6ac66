// Request validation: typed reads of every supported OpenAI parameter, explicit 400s for unsupported ones.
#include "server/frontend/request_parse.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>

#include "server/frontend/api_error.h"
#include "server/frontend/json_body.h"

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
    auto type = v->is_object() ? v->find("type") : v->end();
    if (!v->is_object() || type == v->end() || *type != "text") {
      bad("response_format", "only response_format {\"type\": \"text\"} is supported yet");
    }
  }
  for (const char* key : {"functions", "function_call"}) {
    if (f.find(key) != nullptr) bad(key, fmt::format("'{}' (the legacy functions API) is not supported; use 'tools'", key));
  }
  if (auto v = f.boolean("parallel_tool_calls"); v && !*v) {
    bad("parallel_tool_calls", "'parallel_tool_calls': false is not supported (the model may call several tools)");
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
    auto type = t.is_object() ? t.find("type") : t.end();
    if (!t.is_object() || type == t.end() || !type->is_string() || *type != "function") {
      bad(param, fmt::format("'{}' must be an object with type \"function\"", param));
    }
    auto fn = t.find("function");
    auto name = fn != t.end() && fn->is_object() ? fn->find("name") : t.end();
    if (fn == t.end() || !fn->is_object() || name == fn->end() || !name->is_string()) {
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


// Every field the endpoints know, including those accepted and ignored by design (user, metadata, store,
// service_tier) and those rejected unless at their default (reject_unsupported).
constexpr std::string_view kCommonFields[] = {
    "model", "stream", "stream_options", "n", "max_tokens", "stop", "temperature", "top_p", "top_k", "seed",
    "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "logit_bias", "best_of", "echo",
    "suffix", "response_format", "logprobs", "user", "metadata", "store", "service_tier"};
constexpr std::string_view kChatFields[] = {
    "messages", "tools", "tool_choice", "top_logprobs", "chat_template_kwargs", "reasoning_effort",
    "max_completion_tokens", "parallel_tool_calls", "functions", "function_call"};
constexpr std::string_view kCompletionFields[] = {"prompt", "max_completion_tokens"};

size_t edit_distance(std::string_view a, std::string_view b) {
  if (a.size() > 64 || b.size() > 64) return a == b ? 0 : 64;  // only short names can be typos
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

bool known_field(const std::string& key, bool chat) {
  auto in = [&](std::span<const std::string_view> list) {
    return std::find(list.begin(), list.end(), key) != list.end();
  };
  return in(kCommonFields) || in(chat ? std::span<const std::string_view>(kChatFields)
                                      : std::span<const std::string_view>(kCompletionFields));
}

// Collects (or, strictly, rejects) the fields no endpoint knows.
void check_fields(const json& body, bool chat, const ParseOptions& options, CommonRequest& r) {
  for (const auto& [key, value] : body.items()) {
    if (known_field(key, chat)) continue;
    if (options.strict_params) {
      throw ApiError(400, fmt::format("unknown field {} (--strict-params is on)", describe_unknown_field(key, chat)),
                     key.size() <= 64 ? key : key.substr(0, 64));
    }
    r.unknown_fields.push_back(key);
  }
}
}  // namespace

json parse_body(std::string_view body) {
  json j = parse_json_bounded(body);
  if (!j.is_object()) throw ApiError(400, "the request body must be a JSON object");
  return j;
}

std::string describe_unknown_field(const std::string& field, bool chat) {
  const std::string shown = field.size() <= 64 ? field : field.substr(0, 64) + "...";
  std::string best;
  size_t best_distance = 3;  // suggest only within two edits
  auto consider = [&](std::string_view known) {
    const size_t d = edit_distance(field, known);
    if (d < best_distance) {
      best_distance = d;
      best = known;
    }
  };
  for (std::string_view k : kCommonFields) consider(k);
  for (std::string_view k : chat ? std::span<const std::string_view>(kChatFields)
                                  : std::span<const std::string_view>(kCompletionFields)) {
    consider(k);
  }
  return best.empty() ? fmt::format("'{}'", shown) : fmt::format("'{}' (did you mean '{}'?)", shown, best);
}

ChatRequest parse_chat_request(const json& body, const ParseOptions& options) {
  ChatRequest r;
  check_fields(body, /*chat=*/true, options, r.common);
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

ChatRequest parse_chat_body(std::string_view body, const ParseOptions& options) {
  const nlohmann::ordered_json ordered = parse_json_bounded_ordered(body);
  if (!ordered.is_object()) throw ApiError(400, "the request body must be a JSON object");
  ChatRequest r = parse_chat_request(json(ordered), options);  // the copy's depth is bounded by the parse
  if (!r.tools.empty()) r.tools = ordered.at("tools");
  return r;
}

CompletionRequest parse_completion_request(const json& body, const ParseOptions& options) {
  CompletionRequest r;
  check_fields(body, /*chat=*/false, options, r.common);
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
