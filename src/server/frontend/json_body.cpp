// A SAX handler that builds the DOM with an explicit stack of open containers, tracking each one's path so the
// depth error can name the field.
#include "server/frontend/json_body.h"

#include <fmt/format.h>

#include <type_traits>
#include <unordered_map>
#include <vector>

#include "server/frontend/api_error.h"

namespace bg::frontend {

namespace {

constexpr size_t kMaxKeyInPath = 64;  // bytes of one key shown in a path (keys may be megabytes long)

// `json` is nlohmann::json (keys sorted) or nlohmann::ordered_json (keys in document order). ordered_json's own
// operator[] searches keys linearly, so its objects are filled through a per-object key index instead: a body with a
// million keys costs O(n), not O(n^2).
template <class json>
class BoundedBuilder {
 public:
  using number_integer_t = typename json::number_integer_t;
  using number_unsigned_t = typename json::number_unsigned_t;
  using number_float_t = typename json::number_float_t;
  using string_t = typename json::string_t;
  using binary_t = typename json::binary_t;
  using exception_t = typename json::exception;

  BoundedBuilder(json& root, size_t max_depth) : root_(root), max_depth_(max_depth) {}

  bool null() { return add(json(nullptr)); }
  bool boolean(bool v) { return add(json(v)); }
  bool number_integer(number_integer_t v) { return add(json(v)); }
  bool number_unsigned(number_unsigned_t v) { return add(json(v)); }
  bool number_float(number_float_t v, const string_t&) { return add(json(v)); }
  bool string(string_t& v) { return add(json(std::move(v))); }
  bool binary(binary_t&) { return add(json(nullptr)); }  // the text parser never produces binary values

  bool start_object(size_t) { return open(json::object()); }
  bool start_array(size_t) { return open(json::array()); }
  bool key(string_t& k) {
    frames_.back().key = std::move(k);
    return true;
  }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool parse_error(size_t, const std::string&, const exception_t& ex) {
    if (ex.id == 406) {  // out_of_range.406: a number that does not fit a double (1e400)
      throw ApiError(400, fmt::format("a number in {} is out of range (it does not fit a 64-bit float)", where()),
                     path());
    }
    throw ApiError(400, "the request body is not valid JSON (or not valid UTF-8): " +
                            strip_json_exception_prefix(ex.what()));
  }

 private:
  static constexpr bool kOrdered = std::is_same_v<json, nlohmann::ordered_json>;

  struct Frame {
    json* value;
    std::string key;   // objects: the key being read
    std::unordered_map<std::string, size_t> index;  // ordered objects: key -> position in the object
  };

  // The object's slot for `key` (a repeated key: the last value wins, in the first one's position).
  json& object_slot(Frame& top) {
    if constexpr (kOrdered) {
      using Entries = typename json::object_t::Container;  // ordered_map is a vector of (key, value)
      auto& entries = static_cast<Entries&>(top.value->template get_ref<typename json::object_t&>());
      const auto [it, fresh] = top.index.try_emplace(top.key, entries.size());
      if (fresh) entries.emplace_back(top.key, json());
      return entries[it->second].second;
    } else {
      return (*top.value)[top.key];
    }
  }

  // Places a value at the current position; returns where it lives.
  json* place(json&& v) {
    if (frames_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Frame& top = frames_.back();
    if (top.value->is_array()) {
      top.value->push_back(std::move(v));
      return &top.value->back();
    }
    json& slot = object_slot(top);
    slot = std::move(v);
    return &slot;
  }
  bool add(json&& v) {
    place(std::move(v));
    return true;
  }
  bool open(json&& container) {
    if (frames_.size() >= max_depth_) {
      throw ApiError(400, fmt::format("{} nests deeper than {} levels of objects and arrays", where(), max_depth_),
                     path());
    }
    json* c = place(std::move(container));
    frames_.push_back(Frame{c, {}, {}});
    return true;
  }
  bool close() {
    frames_.pop_back();
    return true;
  }

  // The path of the value being parsed: "tools[0].function.parameters" ("" at the top level).
  std::string path() const {
    std::string p;
    for (size_t i = 0; i < frames_.size(); ++i) {
      const Frame& f = frames_[i];
      if (f.value->is_array()) {
        // An enclosing array already holds the open element (its last); the innermost one gets the next index.
        const size_t n = f.value->size();
        p += fmt::format("[{}]", i + 1 < frames_.size() ? n - 1 : n);
      } else if (i + 1 < frames_.size() || !f.key.empty()) {
        if (!p.empty()) p += '.';
        p += f.key.size() <= kMaxKeyInPath ? f.key : f.key.substr(0, kMaxKeyInPath) + "...";
      }
    }
    return p;
  }
  std::string where() const {
    const std::string p = path();
    return p.empty() ? "the request body" : "'" + p + "'";
  }

  json& root_;
  size_t max_depth_;
  std::vector<Frame> frames_;
};

}  // namespace

std::string strip_json_exception_prefix(const std::string& what) {
  if (!what.empty() && what[0] == '[') {
    const size_t end = what.find("] ");
    if (end != std::string::npos) return what.substr(end + 2);
  }
  return what;
}

template <class json>
json parse_bounded(std::string_view text, size_t max_depth) {
  json root;
  BoundedBuilder<json> builder(root, max_depth);
  // parse_error() throws, so a false return cannot happen without an exception; keep the check for safety.
  if (!json::sax_parse(text.begin(), text.end(), &builder)) {
    throw ApiError(400, "the request body is not valid JSON");
  }
  return root;
}

nlohmann::json parse_json_bounded(std::string_view text, size_t max_depth) {
  return parse_bounded<nlohmann::json>(text, max_depth);
}

nlohmann::ordered_json parse_json_bounded_ordered(std::string_view text, size_t max_depth) {
  return parse_bounded<nlohmann::ordered_json>(text, max_depth);
}

}  // namespace bg::frontend
