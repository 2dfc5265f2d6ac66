// Jinja builtins with @huggingface/jinja's semantics: value display and tojson, filters, tests, methods of strings
// and objects (upper, split, get, items, ...), globals (namespace, range, raise_exception, strftime_now), and the
// conversion of JSON values (numbers as JavaScript sees them: 3.0 is the integer 3).
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>

#include "core/error.h"
#include "server/chat/chat_messages.h"
#include "server/chat/jinja/jinja_interp.h"
#include "server/tokenizer/unicode_text.h"

namespace bg::jinja {

using K = Value::Kind;

const Value* Value::find(const std::string& key) const {
  if (!obj) return nullptr;
  for (const auto& [k, v] : *obj) {
    if (k == key) return &v;
  }
  return nullptr;
}

const Value* Args::kwarg(const std::string& key) const {
  for (const auto& [k, v] : kw) {
    if (k == key) return &v;
  }
  return nullptr;
}

const Value* Args::at(size_t index, const std::string& key) const {
  return index < pos.size() ? &pos[index] : kwarg(key);
}

const char* kind_name(K k) {
  switch (k) {
    case K::kUndefined: return "undefined";
    case K::kNull: return "none";
    case K::kBool: return "boolean";
    case K::kInt: return "integer";
    case K::kFloat: return "float";
    case K::kString: return "string";
    case K::kArray: return "array";
    case K::kObject: return "object";
    case K::kNamespace: return "namespace";
    case K::kFunction: return "function";
  }
  return "?";
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case K::kUndefined:
    case K::kNull: return false;
    case K::kBool: return v.b;
    case K::kInt: return v.i != 0;
    case K::kFloat: return v.f != 0 && !std::isnan(v.f);
    case K::kString: return !v.s.empty();
    case K::kArray: return !v.arr->empty();
    case K::kObject: return !v.obj->empty();
    default: return true;
  }
}

bool js_space(char32_t c) {
  return c == 0x09 || c == 0x0A || c == 0x0B || c == 0x0C || c == 0x0D || c == 0x20 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000 ||
         c == 0xFEFF;
}

size_t code_points(const std::string& s) {
  return static_cast<size_t>(std::count_if(s.begin(), s.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; }));
}

std::vector<std::string> split_code_points(const std::string& s) {
  std::vector<std::string> out;
  for (size_t p = 0; p < s.size();) {
    const size_t b = p;
    next_code_point(s, p);
    out.push_back(s.substr(b, p - b));
  }
  return out;
}

std::string js_number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  if (v == 0) return "0";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
  std::string sci(buf, r.ptr);  // shortest round-trip digits: [-]d[.ddd]e[+-]xx
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  const size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exp10 = std::stoi(sci.substr(e + 1));
  const int k = static_cast<int>(digits.size()), n = exp10 + 1;  // value = 0.digits * 10^n
  if (k <= n && n <= 21) return sign + digits + std::string(static_cast<size_t>(n - k), '0');
  if (0 < n && n <= 21) return sign + digits.substr(0, static_cast<size_t>(n)) + "." + digits.substr(static_cast<size_t>(n));
  if (-6 < n && n <= 0) return sign + "0." + std::string(static_cast<size_t>(-n), '0') + digits;
  std::string m = digits.substr(0, 1);
  if (k > 1) m += "." + digits.substr(1);
  return sign + m + "e" + (n - 1 >= 0 ? "+" : "-") + std::to_string(std::abs(n - 1));
}

std::string to_display(const Value& v) {
  switch (v.kind) {
    case K::kUndefined:
    case K::kNull: return "";
    case K::kBool: return v.b ? "true" : "false";
    case K::kInt: return std::to_string(v.i);
    case K::kFloat:
      if (v.f == 0 && std::signbit(v.f)) return "-0.0";
      if (std::isfinite(v.f) && std::floor(v.f) == v.f && std::abs(v.f) < 1e21) return fmt::format("{:.1f}", v.f);
      return js_number(v.f);
    case K::kString: return v.s;
    case K::kFunction: return "<function>";
    default: return to_json(v, JsonOptions{}, /*undefined_as_null=*/false);
  }
}

namespace {

std::string json_string(const std::string& s, bool ensure_ascii) {
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back('"');
  out += json_escape(s);
  out.push_back('"');
  if (!ensure_ascii) return out;
  std::string ascii;
  for (size_t p = 0; p < out.size();) {
    const char32_t c = next_code_point(out, p);
    if (c < 0x7F) {
      ascii.push_back(static_cast<char>(c));
    } else if (c < 0x10000) {
      ascii += fmt::format("\\u{:04x}", static_cast<uint32_t>(c));
    } else {
      const uint32_t u = static_cast<uint32_t>(c) - 0x10000;
      ascii += fmt::format("\\u{:04x}\\u{:04x}", 0xD800 + (u >> 10), 0xDC00 + (u & 0x3FF));
    }
  }
  return ascii;
}

}  // namespace

std::string to_json(const Value& v, const JsonOptions& o, bool undefined_as_null, int depth) {
  if (depth > 256) fail("tojson: value nested deeper than 256 levels");
  switch (v.kind) {
    case K::kNull: return "null";
    case K::kUndefined: return undefined_as_null ? "null" : "undefined";
    case K::kBool: return v.b ? "true" : "false";
    case K::kInt: return std::to_string(v.i);
    case K::kFloat: return std::isfinite(v.f) ? js_number(v.f) : "null";
    case K::kString: return json_string(v.s, o.ensure_ascii);
    case K::kFunction: fail("tojson: cannot serialize a function");
    default: break;
  }
  const std::string pad = o.indent > 0 ? std::string(static_cast<size_t>(o.indent), ' ') : "";
  std::string base = "\n", child;
  for (int d = 0; d < depth; ++d) base += pad;
  child = base + pad;
  std::vector<std::string> parts;
  if (v.is(K::kArray)) {
    for (const Value& x : *v.arr) parts.push_back(to_json(x, o, undefined_as_null, depth + 1));
  } else {
    std::vector<const std::pair<std::string, Value>*> entries;
    for (const auto& kv : *v.obj) entries.push_back(&kv);
    if (o.sort_keys) std::stable_sort(entries.begin(), entries.end(), [](auto* a, auto* b) { return a->first < b->first; });
    for (const auto* kv : entries) {
      parts.push_back((o.indent > 0 ? child : "") + json_string(kv->first, o.ensure_ascii) + o.key_sep +
                      to_json(kv->second, o, undefined_as_null, depth + 1));
    }
  }
  const bool is_array = v.is(K::kArray);
  std::string joined;
  for (size_t k = 0; k < parts.size(); ++k) {
    if (k > 0) joined += o.item_sep + (o.indent > 0 && is_array ? child : "");
    joined += parts[k];
  }
  if (o.indent > 0 && !parts.empty()) {
    return is_array ? "[" + child + joined + base + "]" : "{" + joined + base + "}";
  }
  return (is_array ? "[" : "{") + joined + (is_array ? "]" : "}");
}

bool loose_equal(const Value& a, const Value& b) {
  const bool nullish_a = a.is(K::kNull) || a.is(K::kUndefined), nullish_b = b.is(K::kNull) || b.is(K::kUndefined);
  if (nullish_a || nullish_b) return nullish_a && nullish_b;
  if ((a.numeric() || a.is(K::kBool)) && (b.numeric() || b.is(K::kBool))) return a.number() == b.number();
  if (a.is(K::kString) && b.is(K::kString)) return a.s == b.s;
  if (a.is(K::kString) != b.is(K::kString)) {  // JavaScript compares a string and a number as numbers
    const Value& str = a.is(K::kString) ? a : b;
    const Value& other = a.is(K::kString) ? b : a;
    if (!(other.numeric() || other.is(K::kBool))) return false;
    double d = 0;
    const auto r = std::from_chars(str.s.data(), str.s.data() + str.s.size(), d);
    return r.ec == std::errc() && r.ptr == str.s.data() + str.s.size() && d == other.number();
  }
  if (a.kind != b.kind) return false;
  if (a.is(K::kArray)) return a.arr == b.arr;
  if (a.is(K::kObject) || a.is(K::kNamespace)) return a.obj == b.obj;
  return a.fn == b.fn;
}

bool strict_equal(const Value& a, const Value& b) {
  if (a.numeric() && b.numeric()) return a.number() == b.number();
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case K::kUndefined:
    case K::kNull: return true;
    case K::kBool: return a.b == b.b;
    case K::kString: return a.s == b.s;
    default: return loose_equal(a, b);
  }
}

Value from_json(const nlohmann::ordered_json& j, int depth, int max_depth) {
  BG_CHECK(depth <= max_depth, "value nested deeper than {} levels", max_depth);
  switch (j.type()) {
    case nlohmann::json::value_t::null: return Value::null();
    case nlohmann::json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::json::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      const auto u = j.get<uint64_t>();
      return u <= static_cast<uint64_t>(INT64_MAX) ? Value::integer(static_cast<int64_t>(u))
                                                   : Value::real(static_cast<double>(u));
    }
    case nlohmann::json::value_t::number_float: {
      const double d = j.get<double>();
      if (std::isfinite(d) && std::floor(d) == d && std::abs(d) <= 9007199254740992.0) {
        return Value::integer(static_cast<int64_t>(d));  // JSON.parse gives JavaScript no integer/float distinction
      }
      return Value::real(d);
    }
    case nlohmann::json::value_t::string: return Value::string(j.get<std::string>());
    case nlohmann::json::value_t::array: {
      Array a;
      a.reserve(j.size());
      for (const auto& x : j) a.push_back(from_json(x, depth + 1, max_depth));
      return Value::array(std::move(a));
    }
    case nlohmann::json::value_t::object: {
      Object o;
      o.reserve(j.size());
      for (const auto& [k, x] : j.items()) o.emplace_back(k, from_json(x, depth + 1, max_depth));
      return Value::object(std::move(o));
    }
    default: fail("unsupported JSON value ({})", j.type_name());
  }
}

Value slice_value(Interpreter& in, const Value& v, const Value& start, const Value& stop, const Value& step) {
  for (const Value* x : {&start, &stop, &step}) {
    if (!x->is(K::kInt) && !x->is(K::kUndefined)) in.error("slice bounds must be integers");
  }
  std::vector<std::string> chars;
  size_t n = 0;
  if (v.is(K::kArray)) {
    n = v.arr->size();
  } else if (v.is(K::kString)) {
    chars = split_code_points(v.s);
    n = chars.size();
  } else {
    in.error(fmt::format("cannot slice {}", kind_name(v.kind)));
  }
  const auto len = static_cast<int64_t>(n);
  const int64_t st = step.is(K::kInt) ? step.i : 1;
  if (st == 0) in.error("slice step must not be zero");
  int64_t b = 0, e = 0;
  if (st > 0) {
    b = start.is(K::kInt) ? (start.i < 0 ? std::max<int64_t>(len + start.i, 0) : std::min(start.i, len)) : 0;
    e = stop.is(K::kInt) ? (stop.i < 0 ? std::max<int64_t>(len + stop.i, 0) : std::min(stop.i, len)) : len;
  } else {
    b = start.is(K::kInt) ? (start.i < 0 ? std::max<int64_t>(len + start.i, -1) : std::min(start.i, len - 1)) : len - 1;
    e = stop.is(K::kInt) ? (stop.i < -1 ? std::max<int64_t>(len + stop.i, -1) : std::min(stop.i, len - 1)) : -1;
  }
  Array items;
  std::string s;
  for (int64_t k = b; st > 0 ? k < e : k > e; k += st) {
    if (v.is(K::kArray)) {
      items.push_back((*v.arr)[static_cast<size_t>(k)]);
    } else {
      s += chars[static_cast<size_t>(k)];
    }
  }
  return v.is(K::kArray) ? Value::array(std::move(items)) : Value::string(std::move(s));
}

}  // namespace bg::jinja
