// Hugging Face tokenizer.json: loading with every field validated (model vocabulary and merges, added tokens,
// normalizer, pre-tokenizer, post-processor, decoder) and encoding (added-token split, normalize, pre-tokenize, pair
// merges), following the Rust `tokenizers` crate. Byte-level vocabularies are stored as raw bytes.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <queue>

#include "core/error.h"
#include "core/log.h"
#include "server/tokenizer/tokenizer_impl.h"
#include "server/tokenizer/unicode_text.h"

namespace bg {
namespace {

using nlohmann::json;

int32_t id_value(const json& v, const std::string& where) {
  BG_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < (int64_t{1} << 31),
           "{}: must be a token id (an integer in [0, 2^31)), not {}", where, v.dump().substr(0, 40));
  return static_cast<int32_t>(v.get<int64_t>());
}

bool flag(const json& obj, const char* key, bool fallback, const std::string& where) {
  if (!obj.contains(key) || obj[key].is_null()) return fallback;
  BG_CHECK(obj[key].is_boolean(), "{}.{}: must be true or false", where, key);
  return obj[key].get<bool>();
}

// A byte-level vocabulary entry -> raw bytes: each character maps back to its byte; an entry with a character
// outside the map keeps its UTF-8 bytes (what the ByteLevel decoder does).
std::string byte_level_decode(const std::string& token) {
  std::string out;
  size_t pos = 0;
  while (pos < token.size()) {
    const int b = byte_level_byte(next_code_point(token, pos));
    if (b < 0) return token;
    out.push_back(static_cast<char>(b));
  }
  return out;
}

struct Vocab {
  std::map<int32_t, std::string> by_id;  // id -> vocabulary string (byte-level characters)
  std::unordered_map<std::string, int32_t> by_text;
};

Vocab read_vocab(const json& model, const std::string& where) {
  BG_CHECK(model.contains("vocab") && model["vocab"].is_object(), "{}.vocab: must be an object", where);
  Vocab v;
  for (const auto& [text, idj] : model["vocab"].items()) {
    const int32_t id = id_value(idj, fmt::format("{}.vocab[\"{}\"]", where, text));
    BG_CHECK(!text.empty(), "{}.vocab: empty token for id {}", where, id);
    auto [it, inserted] = v.by_id.emplace(id, text);
    BG_CHECK(inserted, "{}.vocab: tokens \"{}\" and \"{}\" share id {}", where, it->second, text, id);
    v.by_text.emplace(text, id);
  }
  BG_CHECK(!v.by_id.empty(), "{}.vocab: empty", where);
  return v;
}

// merges: ["a b", ...] (older files) or [["a", "b"], ...]; rank = position. Both parts and their concatenation must
// be in the vocabulary.
void read_merges(const json& model, const Vocab& v, const std::string& where, HfModel& hf) {
  BG_CHECK(model.contains("merges") && model["merges"].is_array(), "{}.merges: must be an array", where);
  const json& merges = model["merges"];
  hf.merges.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const json& m = merges[i];
    const std::string mw = fmt::format("{}.merges[{}]", where, i);
    std::string a, b;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t sp = s.find(' ');
      BG_CHECK(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos && sp > 0 && sp + 1 < s.size(),
               "{}: \"{}\" is not two tokens separated by one space", mw, s);
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else {
      BG_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(),
               "{}: must be \"a b\" or [\"a\", \"b\"]", mw);
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    }
    const auto ia = v.by_text.find(a), ib = v.by_text.find(b), im = v.by_text.find(a + b);
    BG_CHECK(ia != v.by_text.end(), "{}: \"{}\" is not in the vocabulary", mw, a);
    BG_CHECK(ib != v.by_text.end(), "{}: \"{}\" is not in the vocabulary", mw, b);
    BG_CHECK(im != v.by_text.end(), "{}: the merged token \"{}\" is not in the vocabulary", mw, a + b);
    const uint64_t key = (uint64_t(uint32_t(ia->second)) << 32) | uint32_t(ib->second);
    // A repeated pair keeps its first (lowest) rank, as the Rust crate's map construction does.
    hf.merges.emplace(key, std::make_pair(static_cast<int32_t>(i), im->second));
  }
}

std::vector<HfAddedToken> read_added_tokens(const json& j, const std::string& where) {
  std::vector<HfAddedToken> out;
  if (!j.contains("added_tokens") || j["added_tokens"].is_null()) return out;
  BG_CHECK(j["added_tokens"].is_array(), "{}.added_tokens: must be an array", where);
  const json& list = j["added_tokens"];
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string w = fmt::format("{}.added_tokens[{}]", where, i);
    const json& t = list[i];
    BG_CHECK(t.is_object(), "{}: must be an object", w);
    BG_CHECK(t.contains("id"), "{}.id: missing", w);
    BG_CHECK(t.contains("content") && t["content"].is_string() && !t["content"].get<std::string>().empty(),
             "{}.content: must be a non-empty string", w);
    HfAddedToken a;
    a.id = id_value(t["id"], w + ".id");
    a.content = t["content"].get<std::string>();
    a.special = flag(t, "special", false, w);
    a.single_word = flag(t, "single_word", false, w);
    a.lstrip = flag(t, "lstrip", false, w);
    a.rstrip = flag(t, "rstrip", false, w);
    a.normalized = flag(t, "normalized", !a.special, w);
    out.push_back(std::move(a));
  }
  return out;
}

// tokenizer_config.json's added_tokens_decoder: entries tokenizer.json lacks are added (as transformers does);
// an id both files name must carry the same text.
void merge_config_added_tokens(const json& config, std::vector<HfAddedToken>& added) {
  if (!config.is_object() || !config.contains("added_tokens_decoder")) return;
  const json& dec = config["added_tokens_decoder"];
  BG_CHECK(dec.is_object(), "tokenizer_config.json: added_tokens_decoder must be an object");
  for (const auto& [key, entry] : dec.items()) {
    const std::string w = fmt::format("tokenizer_config.json: added_tokens_decoder[\"{}\"]", key);
    int32_t id = -1;
    try {
      size_t used = 0;
      const long v = std::stol(key, &used);
      BG_CHECK(used == key.size() && v >= 0 && v < (1L << 31), "{}: the key is not a token id", w);
      id = static_cast<int32_t>(v);
    } catch (const std::logic_error&) {
      fail("{}: the key is not a token id", w);
    }
    BG_CHECK(entry.is_object() && entry.contains("content") && entry["content"].is_string(),
             "{}: needs a string 'content'", w);
    const std::string content = entry["content"].get<std::string>();
    auto it = std::find_if(added.begin(), added.end(), [&](const HfAddedToken& a) { return a.id == id; });
    if (it != added.end()) {
      BG_CHECK(it->content == content, "{}: '{}' but tokenizer.json's added token {} is '{}'", w, content, id,
               it->content);
      continue;
    }
    HfAddedToken a;
    a.id = id;
    a.content = content;
    a.special = flag(entry, "special", false, w);
    a.single_word = flag(entry, "single_word", false, w);
    a.lstrip = flag(entry, "lstrip", false, w);
    a.rstrip = flag(entry, "rstrip", false, w);
    a.normalized = flag(entry, "normalized", !a.special, w);
    added.push_back(std::move(a));
  }
}

// The post-processor's ids before and after one sequence. TemplateProcessing, Bert/RobertaProcessing, ByteLevel
// (ids unchanged) and Sequence of those.
void read_post_processor(const json& p, const std::string& where, const std::function<int32_t(const std::string&)>&
                         id_of, std::vector<int32_t>& prefix, std::vector<int32_t>& suffix) {
  if (p.is_null()) return;
  BG_CHECK(p.is_object() && p.contains("type") && p["type"].is_string(), "{}.type: missing", where);
  const std::string type = p["type"].get<std::string>();
  if (type == "ByteLevel") return;
  if (type == "Sequence") {
    BG_CHECK(p.contains("processors") && p["processors"].is_array(), "{}.processors: must be an array", where);
    for (size_t i = 0; i < p["processors"].size(); ++i) {
      read_post_processor(p["processors"][i], fmt::format("{}.processors[{}]", where, i), id_of, prefix, suffix);
    }
    return;
  }
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    for (const char* key : {"cls", "sep"}) {
      const json& v = p.value(key, json());
      BG_CHECK(v.is_array() && v.size() == 2 && v[0].is_string(), "{}.{}: must be [token, id]", where, key);
      const int32_t id = id_value(v[1], fmt::format("{}.{}[1]", where, key));
      BG_CHECK(id_of(v[0].get<std::string>()) == id, "{}.{}: '{}' is not token {}", where, key,
               v[0].get<std::string>(), id);
      (std::string(key) == "cls" ? prefix : suffix).push_back(id);
    }
    return;
  }
  BG_CHECK(type == "TemplateProcessing", "{}: unsupported post-processor type '{}' (supported: TemplateProcessing, "
           "ByteLevel, BertProcessing, RobertaProcessing, Sequence)", where, type);
  BG_CHECK(p.contains("single") && p["single"].is_array(), "{}.single: must be an array", where);
  const json specials = p.value("special_tokens", json::object());
  BG_CHECK(specials.is_object(), "{}.special_tokens: must be an object", where);
  bool seen_a = false;
  for (size_t i = 0; i < p["single"].size(); ++i) {
    const json& item = p["single"][i];
    const std::string w = fmt::format("{}.single[{}]", where, i);
    if (item.is_object() && item.contains("Sequence")) {
      BG_CHECK(item["Sequence"].is_object() && item["Sequence"].value("id", json()) == "A" && !seen_a,
               "{}: a single-sequence template has exactly one Sequence 'A'", w);
      seen_a = true;
      continue;
    }
    BG_CHECK(item.is_object() && item.contains("SpecialToken") && item["SpecialToken"].is_object() &&
                 item["SpecialToken"].contains("id") && item["SpecialToken"]["id"].is_string(),
             "{}: must be {{\"SpecialToken\": {{\"id\": ...}}}} or {{\"Sequence\": {{\"id\": \"A\"}}}}", w);
    const std::string name = item["SpecialToken"]["id"].get<std::string>();
    BG_CHECK(specials.contains(name) && specials[name].is_object() && specials[name].contains("ids") &&
                 specials[name]["ids"].is_array(),
             "{}: special token '{}' is not in {}.special_tokens", w, name, where);
    for (const json& idj : specials[name]["ids"]) {
      const int32_t id = id_value(idj, fmt::format("{}.special_tokens[\"{}\"].ids", where, name));
      (seen_a ? suffix : prefix).push_back(id);
    }
  }
  BG_CHECK(seen_a, "{}.single: has no Sequence 'A'", where);
}

// transformers' LlamaTokenizerFast (DeepSeek-V3's tokenizer_class) rebuilds the post-processor from the config's
// add_bos_token (default true) and add_eos_token (default false) when it loads, whatever tokenizer.json says: what
// `tokenizer(text)` returns, and so what a text prompt of /v1/completions starts with.
void apply_llama_bos_eos(const json& config, const std::string& where, int32_t bos, int32_t eos, HfModel& hf) {
  if (!config.is_object()) return;
  const json& cls = config.value("tokenizer_class", json());
  if (cls != "LlamaTokenizerFast" && cls != "LlamaTokenizer") return;
  auto flag_of = [&](const char* key, bool fallback) {
    const json& v = config.value(key, json(fallback));
    BG_CHECK(v.is_boolean(), "{}: tokenizer_config.json {} must be true or false", where, key);
    return v.get<bool>();
  };
  const bool add_bos = flag_of("add_bos_token", true), add_eos = flag_of("add_eos_token", false);
  BG_CHECK(!add_bos || bos >= 0, "{}: tokenizer_config.json add_bos_token is true but there is no bos_token", where);
  BG_CHECK(!add_eos || eos >= 0, "{}: tokenizer_config.json add_eos_token is true but there is no eos_token", where);
  hf.prefix_ids = add_bos ? std::vector<int32_t>{bos} : std::vector<int32_t>{};
  hf.suffix_ids = add_eos ? std::vector<int32_t>{eos} : std::vector<int32_t>{};
}

void check_decoder(const json& d, const std::string& where) {
  BG_CHECK(d.is_object() && d.contains("type") && d["type"].is_string(), "{}.type: missing (a byte-level "
           "vocabulary needs the ByteLevel decoder)", where);
  const std::string type = d["type"].get<std::string>();
  if (type == "ByteLevel") return;
  if (type == "Sequence" && d.contains("decoders") && d["decoders"].is_array() && d["decoders"].size() == 1) {
    check_decoder(d["decoders"][0], where + ".decoders[0]");
    return;
  }
  fail("{}: unsupported decoder type '{}' for a byte-level vocabulary (supported: ByteLevel)", where, type);
}

std::optional<std::string> config_token_name(const json& config, const char* key) {
  if (!config.is_object() || !config.contains(key) || config[key].is_null()) return std::nullopt;
  const json& v = config[key];
  if (v.is_string()) return v.get<std::string>();
  BG_CHECK(v.is_object() && v.contains("content") && v["content"].is_string(),
           "tokenizer_config.json: {} must be a string or an object with a string 'content'", key);
  return v["content"].get<std::string>();
}

}  // namespace

Tokenizer Tokenizer::from_hf_json(const json& j, const json& config, const std::string& where) {
  BG_CHECK(j.is_object(), "{}: not a JSON object", where);
  BG_CHECK(j.contains("model") && j["model"].is_object(), "{}: model: missing", where);
  const json& model = j["model"];
  const std::string mw = where + ": model";
  const std::string model_type = model.value("type", std::string("BPE"));
  BG_CHECK(model_type == "BPE", "{}.type: '{}' is not supported (only byte-level BPE)", mw, model_type);
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    BG_CHECK(!model.contains(key) || model[key].is_null() || model[key] == "", "{}.{}: not supported", mw, key);
  }
  BG_CHECK(!model.contains("dropout") || model["dropout"].is_null() || model["dropout"] == 0,
           "{}.dropout: BPE dropout is not supported for inference", mw);
  const json pre = j.value("pre_tokenizer", json());
  BG_CHECK(hf_pre_tokenizer_is_byte_level(pre), "{}: pre_tokenizer: only byte-level BPE is supported (the "
           "pre-tokenizer has no ByteLevel step)", where);
  check_decoder(j.value("decoder", json()), where + ": decoder");

  auto impl = std::make_shared<Impl>();
  auto hf = std::make_unique<HfModel>();
  const Vocab vocab = read_vocab(model, mw);
  read_merges(model, vocab, mw, *hf);
  hf->ignore_merges = flag(model, "ignore_merges", false, mw);
  hf->normalizer = parse_hf_normalizer(j.value("normalizer", json()), where + ": normalizer");
  hf->pre_tokenizer = parse_hf_pre_tokenizer(pre, where + ": pre_tokenizer");
  hf->added = read_added_tokens(j, where);
  merge_config_added_tokens(config, hf->added);

  int32_t max_id = vocab.by_id.rbegin()->first;
  for (const auto& a : hf->added) max_id = std::max(max_id, a.id);
  impl->bytes.resize(static_cast<size_t>(max_id) + 1);
  impl->kind.assign(static_cast<size_t>(max_id) + 1, IdKind::kNone);
  impl->byte_rank.fill(kNoRank);
  for (const auto& [id, text] : vocab.by_id) {
    std::string b = byte_level_decode(text);
    auto [it, inserted] = impl->ranks.emplace(b, id);
    BG_CHECK(inserted, "{}.vocab: tokens {} and {} decode to the same bytes", mw, it->second, id);
    if (b.size() == 1 && text == byte_level_chars()[static_cast<unsigned char>(b[0])]) impl->byte_rank[static_cast<unsigned char>(b[0])] = id;
    impl->kind[id] = IdKind::kRank;
    impl->bytes[id] = std::move(b);
  }
  for (int b = 0; b < 256; ++b) {
    BG_CHECK(impl->byte_rank[b] != kNoRank, "{}.vocab: no token for byte 0x{:02x} ('{}'); a byte-level vocabulary "
             "needs all 256", mw, b, byte_level_chars()[b]);
  }
  std::vector<std::string> raw_all, raw_plain, norm_all, norm_plain;
  for (size_t i = 0; i < hf->added.size(); ++i) {
    const HfAddedToken& a = hf->added[i];
    if (impl->kind[a.id] == IdKind::kRank) {
      BG_CHECK(vocab.by_id.at(a.id) == a.content, "{}: added token '{}' has id {}, which the vocabulary gives to "
               "'{}'", where, a.content, a.id, vocab.by_id.at(a.id));
    } else {
      BG_CHECK(impl->kind[a.id] == IdKind::kNone, "{}: added tokens share id {}", where, a.id);
    }
    auto [sit, fresh] = impl->specials.emplace(a.content, a.id);
    BG_CHECK(fresh, "{}: added token '{}' appears twice (ids {} and {})", where, a.content, sit->second, a.id);
    impl->kind[a.id] = a.special ? IdKind::kSpecial : IdKind::kAdded;
    impl->bytes[a.id] = a.content;
    if (a.normalized && hf->normalizer) {
      const std::string n = hf->normalizer->apply(a.content);
      BG_CHECK(!n.empty(), "{}: added token '{}' normalizes to nothing", where, a.content);
      hf->added_normalized.emplace(n, static_cast<int32_t>(i));
      norm_all.push_back(n);
      if (!a.special) norm_plain.push_back(n);
    } else {
      hf->added_raw.emplace(a.content, static_cast<int32_t>(i));
      raw_all.push_back(a.content);
      if (!a.special) raw_plain.push_back(a.content);
    }
  }
  auto finder = [](std::vector<std::string> texts, std::optional<Regex>& out) {
    if (!texts.empty()) out.emplace(literal_alternation(std::move(texts)), Regex::Mode::kBytes, "added tokens");
  };
  finder(raw_all, hf->raw_all);
  finder(raw_plain, hf->raw_plain);
  finder(norm_all, hf->norm_all);
  finder(norm_plain, hf->norm_plain);

  auto id_of = [&](const std::string& name) -> int32_t {
    if (auto it = impl->specials.find(name); it != impl->specials.end()) return it->second;
    if (auto it = vocab.by_text.find(name); it != vocab.by_text.end()) return it->second;
    fail("{}: token '{}' is neither an added token nor in the vocabulary", where, name);
  };
  read_post_processor(j.value("post_processor", json()), where + ": post_processor", id_of, hf->prefix_ids,
                      hf->suffix_ids);
  for (int32_t id : hf->prefix_ids) BG_CHECK(id <= max_id && impl->kind[id] != IdKind::kNone,
                                             "{}: post_processor id {} is not in the vocabulary", where, id);
  for (int32_t id : hf->suffix_ids) BG_CHECK(id <= max_id && impl->kind[id] != IdKind::kNone,
                                             "{}: post_processor id {} is not in the vocabulary", where, id);
  if (const auto n = config_token_name(config, "bos_token")) impl->bos = id_of(*n);
  if (const auto n = config_token_name(config, "eos_token")) impl->eos = id_of(*n);
  if (const auto n = config_token_name(config, "pad_token")) impl->pad = id_of(*n);
  apply_llama_bos_eos(config, where, impl->bos, impl->eos, *hf);
  if (config.is_object() && config.value("clean_up_tokenization_spaces", false) == true) {
    log::warn("{}: tokenizer_config.json asks for clean_up_tokenization_spaces, which batchgen does not apply: "
              "decoded text keeps spaces before punctuation", where);
  }
  impl->pattern = pre.dump();
  impl->hf = std::move(hf);
  return Tokenizer(std::move(impl));
}

}  // namespace bg
