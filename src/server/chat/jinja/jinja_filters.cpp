// Jinja filters, tests, methods (string and object members) and globals, each with @huggingface/jinja's behaviour;
// errors name the filter and the operand's type.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <ctime>

#include "core/error.h"
#include "server/chat/jinja/jinja_interp.h"
#include "server/tokenizer/unicode_text.h"

namespace bg::jinja {
namespace {

using K = Value::Kind;

std::string js_trim(const std::string& s, bool left, bool right) {
  size_t b = 0, e = s.size();
  while (left && b < e) {
    size_t p = b;
    if (!js_space(next_code_point(s, p))) break;
    b = p;
  }
  while (right && e > b) {
    size_t start = 0;
    if (!js_space(previous_code_point(s, e, start))) break;
    e = start;
  }
  return s.substr(b, e - b);
}

bool ascii_word(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// JavaScript's /\b\w/g -> upper case (ASCII word characters; the rest of each word is left as it is).
std::string title_case(const std::string& s) {
  std::string out = s;
  for (size_t k = 0; k < out.size(); ++k) {
    if (ascii_word(out[k]) && (k == 0 || !ascii_word(out[k - 1]))) {
      out[k] = static_cast<char>(std::toupper(static_cast<unsigned char>(out[k])));
    }
  }
  return out;
}

std::string capitalize(const std::string& s) {
  if (s.empty()) return s;
  size_t p = 0;
  next_code_point(s, p);
  return unicode_uppercase(s.substr(0, p)) + s.substr(p);
}

std::string replace_all(Interpreter& in, const std::string& s, const std::string& from, const std::string& to,
                        int64_t count) {
  if (count == 0) return s;
  std::string out;
  int64_t left = count < 0 ? INT64_MAX : count;
  if (from.empty()) {  // insert `to` between code points (and at both ends)
    for (const std::string& c : split_code_points(s)) {
      if (left > 0) {
        out += to;
        --left;
      }
      out += c;
      in.check_size(out.size());
    }
    if (left > 0) out += to;
    return out;
  }
  size_t pos = 0;
  for (size_t hit; left > 0 && (hit = s.find(from, pos)) != std::string::npos; --left) {
    out.append(s, pos, hit - pos);
    out += to;
    pos = hit + from.size();
    in.check_size(out.size());
  }
  out.append(s, pos, std::string::npos);
  return out;
}

Value split(Interpreter& in, const std::string& s, const Value* sep_v, const Value* max_v) {
  if (sep_v != nullptr && !sep_v->is(K::kString) && !sep_v->is(K::kNull)) in.error("split: sep must be a string");
  if (max_v != nullptr && !max_v->is(K::kInt)) in.error("split: maxsplit must be an integer");
  const int64_t maxsplit = max_v != nullptr ? max_v->i : -1;
  Array out;
  if (sep_v == nullptr || sep_v->is(K::kNull)) {  // runs of whitespace; no empty strings at the ends
    const std::string t = js_trim(s, true, false);
    size_t p = 0;
    while (p < t.size()) {
      size_t b = p;
      while (b < t.size()) {
        size_t q = b;
        if (!js_space(next_code_point(t, q))) break;
        b = q;
      }
      if (b >= t.size()) break;
      if (maxsplit != -1 && static_cast<int64_t>(out.size()) >= maxsplit) {
        out.push_back(Value::string(t.substr(b)));
        break;
      }
      size_t e = b;
      while (e < t.size()) {
        size_t q = e;
        if (js_space(next_code_point(t, q))) break;
        e = q;
      }
      out.push_back(Value::string(t.substr(b, e - b)));
      p = e;
    }
    return Value::array(std::move(out));
  }
  const std::string& sep = sep_v->s;
  if (sep.empty()) in.error("split: empty separator");
  size_t pos = 0;
  for (size_t hit; (maxsplit == -1 || static_cast<int64_t>(out.size()) < maxsplit) &&
                   (hit = s.find(sep, pos)) != std::string::npos;) {
    out.push_back(Value::string(s.substr(pos, hit - pos)));
    pos = hit + sep.size();
  }
  out.push_back(Value::string(s.substr(pos)));
  return Value::array(std::move(out));
}

const Value* arg(const Args& a, size_t index, const char* key) { return a.at(index, key); }

bool bool_arg(Interpreter& in, const Args& a, size_t index, const char* key, bool fallback) {
  const Value* v = arg(a, index, key);
  if (v == nullptr) return fallback;
  if (!v->is(K::kBool)) in.error(fmt::format("'{}' must be a boolean", key));
  return v->b;
}

// -1 / 0 / 1 (sort, dictsort): numbers (and booleans) with numbers, strings with strings, none with none.
int compare(Interpreter& in, const Value& a, const Value& b, bool case_sensitive) {
  if (a.is(K::kNull) && b.is(K::kNull)) return 0;
  if (a.is(K::kUndefined) && b.is(K::kUndefined)) return 0;
  if ((a.numeric() || a.is(K::kBool)) && (b.numeric() || b.is(K::kBool))) {
    return a.number() < b.number() ? -1 : a.number() > b.number() ? 1 : 0;
  }
  if (a.is(K::kString) && b.is(K::kString)) {
    const std::string x = case_sensitive ? a.s : unicode_lowercase(a.s), y = case_sensitive ? b.s : unicode_lowercase(b.s);
    return x < y ? -1 : x > y ? 1 : 0;
  }
  in.error(fmt::format("cannot compare {} with {}", kind_name(a.kind), kind_name(b.kind)));
}

Value attribute_path(const Value& item, const std::string& path) {
  Value v = item;
  size_t pos = 0;
  while (true) {
    const size_t dot = path.find('.', pos);
    const std::string part = path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    if (v.is(K::kObject) || v.is(K::kNamespace)) {
      const Value* x = v.find(part);
      if (x == nullptr) return Value();
      v = *x;
    } else if (v.is(K::kArray) && !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit)) {
      const size_t k = std::stoul(part);
      if (k >= v.arr->size()) return Value();
      v = (*v.arr)[k];
    } else {
      return Value();
    }
    if (dot == std::string::npos) return v;
    pos = dot + 1;
  }
}

Value dictsort(Interpreter& in, const Value& obj, const Args& a) {
  const bool case_sensitive = bool_arg(in, a, 0, "case_sensitive", false);
  const Value* by = arg(a, 1, "by");
  if (by != nullptr && (!by->is(K::kString) || (by->s != "key" && by->s != "value"))) {
    in.error("dictsort: 'by' must be 'key' or 'value'");
  }
  const bool by_value = by != nullptr && by->s == "value";
  const bool reverse = bool_arg(in, a, 2, "reverse", false);
  Array items;
  for (const auto& [k, v] : *obj.obj) items.push_back(Value::array({Value::string(k), v}));
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    const int c = compare(in, (*x.arr)[by_value ? 1 : 0], (*y.arr)[by_value ? 1 : 0], case_sensitive);
    return reverse ? c > 0 : c < 0;
  });
  return Value::array(std::move(items));
}

Value method(std::function<Value(Interpreter&, Args&)> f) { return Value::function(std::move(f)); }

}  // namespace

Value builtin_member(Interpreter&, const Value& o, const std::string& name) {
  if (o.is(K::kString)) {
    const std::string s = o.s;
    if (name == "length") return Value::integer(static_cast<int64_t>(code_points(s)));
    if (name == "upper") return method([s](Interpreter&, Args&) { return Value::string(unicode_uppercase(s)); });
    if (name == "lower") return method([s](Interpreter&, Args&) { return Value::string(unicode_lowercase(s)); });
    if (name == "strip") return method([s](Interpreter&, Args&) { return Value::string(js_trim(s, true, true)); });
    if (name == "lstrip") return method([s](Interpreter&, Args&) { return Value::string(js_trim(s, true, false)); });
    if (name == "rstrip") return method([s](Interpreter&, Args&) { return Value::string(js_trim(s, false, true)); });
    if (name == "title") return method([s](Interpreter&, Args&) { return Value::string(title_case(s)); });
    if (name == "capitalize") return method([s](Interpreter&, Args&) { return Value::string(capitalize(s)); });
    if (name == "startswith" || name == "endswith") {
      const bool start = name == "startswith";
      return method([s, start](Interpreter& in, Args& a) {
        if (a.pos.empty()) in.error("startswith()/endswith() needs an argument");
        auto test = [&](const Value& p) {
          if (!p.is(K::kString)) in.error("startswith()/endswith() takes strings");
          return start ? s.rfind(p.s, 0) == 0 : s.size() >= p.s.size() && s.compare(s.size() - p.s.size(), p.s.size(), p.s) == 0;
        };
        if (a.pos[0].is(K::kArray)) {
          return Value::boolean(std::any_of(a.pos[0].arr->begin(), a.pos[0].arr->end(), test));
        }
        return Value::boolean(test(a.pos[0]));
      });
    }
    if (name == "split") return method([s](Interpreter& in, Args& a) { return split(in, s, arg(a, 0, "sep"), arg(a, 1, "maxsplit")); });
    if (name == "replace") {
      return method([s](Interpreter& in, Args& a) {
        const Value *from = arg(a, 0, "old"), *to = arg(a, 1, "new"), *count = arg(a, 2, "count");
        if (from == nullptr || to == nullptr || !from->is(K::kString) || !to->is(K::kString)) {
          in.error("replace() needs two strings");
        }
        if (count != nullptr && !count->is(K::kInt) && !count->is(K::kNull)) in.error("replace(): count must be an integer");
        return Value::string(replace_all(in, s, from->s, to->s, count != nullptr && count->is(K::kInt) ? count->i : -1));
      });
    }
    return Value();
  }
  if (o.is(K::kArray)) return name == "length" ? Value::integer(static_cast<int64_t>(o.arr->size())) : Value();
  if (!o.is(K::kObject)) return Value();
  const Value obj = o;
  if (name == "get") {
    return method([obj](Interpreter& in, Args& a) {
      if (a.pos.empty() || !a.pos[0].is(K::kString)) in.error("get() needs a string key");
      if (const Value* v = obj.find(a.pos[0].s)) return *v;
      return a.pos.size() > 1 ? a.pos[1] : Value::null();
    });
  }
  if (name == "items" || name == "keys" || name == "values") {
    return method([obj, name](Interpreter&, Args&) {
      Array out;
      for (const auto& [k, v] : *obj.obj) {
        if (name == "items") out.push_back(Value::array({Value::string(k), v}));
        if (name == "keys") out.push_back(Value::string(k));
        if (name == "values") out.push_back(v);
      }
      return Value::array(std::move(out));
    });
  }
  if (name == "dictsort") return method([obj](Interpreter& in, Args& a) { return dictsort(in, obj, a); });
  return Value();
}

bool apply_test(Interpreter& in, const std::string& name, const Value& v) {
  if (name == "defined") return !v.is(K::kUndefined);
  if (name == "undefined") return v.is(K::kUndefined);
  if (name == "none") return v.is(K::kNull);
  if (name == "boolean") return v.is(K::kBool);
  if (name == "true") return v.is(K::kBool) && v.b;
  if (name == "false") return v.is(K::kBool) && !v.b;
  if (name == "string") return v.is(K::kString);
  if (name == "number") return v.numeric();
  if (name == "integer") return v.is(K::kInt);
  if (name == "mapping") return v.is(K::kObject);
  if (name == "iterable") return v.is(K::kArray) || v.is(K::kString);
  if (name == "sequence") return v.is(K::kArray) || v.is(K::kObject) || v.is(K::kString);
  if (name == "callable") return v.is(K::kFunction);
  if (name == "lower") return v.is(K::kString) && v.s == unicode_lowercase(v.s);
  if (name == "upper") return v.is(K::kString) && v.s == unicode_uppercase(v.s);
  if (name == "odd" || name == "even") {
    if (!v.is(K::kInt)) in.error(fmt::format("'{}' test on {}", name, kind_name(v.kind)));
    return (v.i % 2 != 0) == (name == "odd");
  }
  in.error(fmt::format("unknown test '{}'", name));
}

Value apply_filter(Interpreter& in, const Value& v, const Node& f, Env& env) {
  const bool called = f.kind == NodeKind::kCall;
  const std::string name = called ? f.a[0]->str : f.str;
  Args a;
  if (called) a = in.eval_args(f.a, 1, env);
  auto unsupported = [&]() -> Value {
    in.error(fmt::format("filter '{}' does not apply to {}", name, kind_name(v.kind)));
  };
  if (name == "safe") return v;
  if (name == "tojson") {
    JsonOptions o;
    if (const Value* x = a.kwarg("indent"); x != nullptr && !x->is(K::kNull)) {
      if (!x->is(K::kInt)) in.error("tojson: indent must be an integer");
      o.indent = static_cast<int>(x->i);
      o.item_sep = ",";
    }
    o.ensure_ascii = bool_arg(in, a, SIZE_MAX, "ensure_ascii", false);
    o.sort_keys = bool_arg(in, a, SIZE_MAX, "sort_keys", false);
    if (const Value* x = a.kwarg("separators"); x != nullptr && !x->is(K::kNull)) {
      if (!x->is(K::kArray) || x->arr->size() != 2 || !(*x->arr)[0].is(K::kString) || !(*x->arr)[1].is(K::kString)) {
        in.error("tojson: separators must be two strings");
      }
      o.item_sep = (*x->arr)[0].s;
      o.key_sep = (*x->arr)[1].s;
    }
    std::string s = to_json(v, o);
    in.check_size(s.size());
    return Value::string(std::move(s));
  }
  if (name == "default" || name == "d") {
    const Value* fallback = arg(a, 0, "default_value");
    const bool boolean = bool_arg(in, a, 1, "boolean", false);
    if (v.is(K::kUndefined) || (boolean && !truthy(v))) return fallback != nullptr ? *fallback : Value::string("");
    return v;
  }
  if (name == "length" || name == "count") {
    if (v.is(K::kString)) return Value::integer(static_cast<int64_t>(code_points(v.s)));
    if (v.is(K::kArray)) return Value::integer(static_cast<int64_t>(v.arr->size()));
    if (v.is(K::kObject)) return Value::integer(static_cast<int64_t>(v.obj->size()));
    return unsupported();
  }
  if (name == "string") {
    if (v.is(K::kArray)) return Value::string(to_json(v, JsonOptions{}, false));
    if (v.is(K::kUndefined) || v.is(K::kFunction)) return unsupported();
    return Value::string(to_display(v));
  }
  if (name == "int" || name == "float") {
    const bool to_int = name == "int";
    const Value* fallback = arg(a, 0, "default");
    const Value def = fallback != nullptr ? *fallback : to_int ? Value::integer(0) : Value::real(0);
    if (v.is(K::kString)) {
      const std::string t = js_trim(v.s, true, false);
      size_t used = 0;
      try {
        if (to_int) {
          const long long x = std::stoll(t, &used, 10);
          return Value::integer(x);
        }
        return Value::real(std::stod(t, &used));
      } catch (const std::exception&) {
        return def;
      }
    }
    if (v.is(K::kBool)) return to_int ? Value::integer(v.b ? 1 : 0) : Value::real(v.b ? 1 : 0);
    if (v.is(K::kInt)) return to_int ? v : Value::real(static_cast<double>(v.i));
    if (v.is(K::kFloat)) return to_int ? Value::integer(static_cast<int64_t>(std::floor(v.f))) : v;
    return unsupported();
  }
  if (name == "bool" && v.is(K::kBool)) return v;
  if (name == "abs" && v.numeric()) return v.is(K::kInt) ? Value::integer(std::llabs(v.i)) : Value::real(std::abs(v.f));
  if (v.is(K::kString)) {
    if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
      Args none;
      return in.call(builtin_member(in, v, name), none);
    }
    if (name == "trim") return Value::string(js_trim(v.s, true, true));
    if (name == "replace") {
      Args copy = a;
      return in.call(builtin_member(in, v, "replace"), copy);
    }
    if (name == "list") {
      Array out;
      for (auto& c : split_code_points(v.s)) out.push_back(Value::string(c));
      return Value::array(std::move(out));
    }
    if (name == "join") {
      const Value* sep = arg(a, 0, "d");
      std::string out;
      const auto chars = split_code_points(v.s);
      for (size_t k = 0; k < chars.size(); ++k) out += (k > 0 && sep != nullptr ? to_display(*sep) : "") + chars[k];
      return Value::string(out);
    }
    if (name == "indent") {
      const Value* width = arg(a, 0, "width");
      if (width != nullptr && !width->is(K::kInt)) in.error("indent: width must be an integer");
      const std::string pad(width != nullptr ? static_cast<size_t>(std::max<int64_t>(width->i, 0)) : 4, ' ');
      const Value* first = arg(a, 1, "first");
      const Value* blank = arg(a, 2, "blank");
      std::string out;
      size_t pos = 0, line = 0;
      while (true) {
        const size_t nl = v.s.find('\n', pos);
        const std::string l = v.s.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
        const bool skip = (line == 0 && !(first != nullptr && truthy(*first))) || (l.empty() && !(blank != nullptr && truthy(*blank)));
        out += (skip ? "" : pad) + l;
        in.check_size(out.size());
        if (nl == std::string::npos) break;
        out += "\n";
        pos = nl + 1;
        ++line;
      }
      return Value::string(out);
    }
    return unsupported();
  }
  if (v.is(K::kArray)) {
    const Array& xs = *v.arr;
    if (name == "list") return v;
    if (name == "first") return xs.empty() ? Value() : xs.front();
    if (name == "last") return xs.empty() ? Value() : xs.back();
    if (name == "reverse") return Value::array(Array(xs.rbegin(), xs.rend()));
    if (name == "join") {
      const Value* sep = arg(a, 0, "d");
      std::string out;
      for (size_t k = 0; k < xs.size(); ++k) {
        if (k > 0 && sep != nullptr) out += to_display(*sep);
        out += to_display(xs[k]);
        in.check_size(out.size());
      }
      return Value::string(out);
    }
    if (name == "unique") {
      Array out;
      for (const Value& x : xs) {
        if (std::none_of(out.begin(), out.end(), [&](const Value& y) { return strict_equal(x, y); })) out.push_back(x);
      }
      return Value::array(std::move(out));
    }
    if (name == "sort") {
      const bool reverse = bool_arg(in, a, 0, "reverse", false);
      const bool case_sensitive = bool_arg(in, a, 1, "case_sensitive", false);
      const Value* attr = arg(a, 2, "attribute");
      Array out = xs;
      std::stable_sort(out.begin(), out.end(), [&](const Value& x, const Value& y) {
        const Value kx = attr != nullptr && !attr->is(K::kNull) ? attribute_path(x, to_display(*attr)) : x;
        const Value ky = attr != nullptr && !attr->is(K::kNull) ? attribute_path(y, to_display(*attr)) : y;
        const int c = compare(in, kx, ky, case_sensitive);
        return reverse ? c > 0 : c < 0;
      });
      return Value::array(std::move(out));
    }
    if (name == "selectattr" || name == "rejectattr") {
      const bool select = name == "selectattr";
      if (a.pos.empty() || !a.pos[0].is(K::kString)) in.error(fmt::format("{} needs an attribute name", name));
      Array out;
      for (const Value& x : xs) {
        if (!x.is(K::kObject) && !x.is(K::kNamespace)) in.error(fmt::format("{} applies to a list of objects", name));
        const Value* field = x.find(a.pos[0].s);
        bool r = false;
        if (field != nullptr) {
          if (a.pos.size() < 2) {
            r = truthy(*field);
          } else if (a.pos[1].is(K::kString) && (a.pos[1].s == "equalto" || a.pos[1].s == "eq" || a.pos[1].s == "==")) {
            r = a.pos.size() > 2 && strict_equal(*field, a.pos[2]);
          } else {
            r = apply_test(in, a.pos[1].s, *field);
          }
        }
        if (r == select) out.push_back(x);
      }
      return Value::array(std::move(out));
    }
    if (name == "map") {
      const Value* attr = a.kwarg("attribute");
      if (attr == nullptr || !attr->is(K::kString)) in.error("map: only map(attribute='...') is supported");
      const Value* def = a.kwarg("default");
      Array out;
      for (const Value& x : xs) {
        const Value r = attribute_path(x, attr->s);
        out.push_back(r.is(K::kUndefined) && def != nullptr ? *def : r);
      }
      return Value::array(std::move(out));
    }
    return unsupported();
  }
  if (v.is(K::kObject)) {
    if (name == "items" || name == "keys" || name == "values" || name == "dictsort") {
      return in.call(builtin_member(in, v, name), a);
    }
    return unsupported();
  }
  if (v.is(K::kBool) && (name == "int" || name == "float")) return Value::integer(v.b ? 1 : 0);
  return unsupported();
}

void install_globals(Env& env) {
  env.set("true", Value::boolean(true));
  env.set("false", Value::boolean(false));
  env.set("none", Value::null());
  env.set("True", Value::boolean(true));
  env.set("False", Value::boolean(false));
  env.set("None", Value::null());
  env.set("raise_exception", Value::function([](Interpreter& in, Args& a) -> Value {
    in.error(fmt::format("raise_exception: {}", a.pos.empty() ? std::string() : to_display(a.pos[0])));
  }));
  env.set("namespace", Value::function([](Interpreter& in, Args& a) {
    Object o;
    if (a.pos.size() > 1) in.error("namespace() takes at most one positional argument");
    if (a.pos.size() == 1) {
      const Value& src = a.pos[0];
      if (src.is(K::kObject)) {
        o = *src.obj;
      } else if (src.is(K::kArray)) {
        for (const Value& pair : *src.arr) {
          if (!pair.is(K::kArray) || pair.arr->size() != 2 || !(*pair.arr)[0].is(K::kString)) {
            in.error("namespace() expects [key, value] pairs");
          }
          o.emplace_back((*pair.arr)[0].s, (*pair.arr)[1]);
        }
      } else {
        in.error("namespace() expects an object or a list of pairs");
      }
    }
    for (auto& [k, v] : a.kw) o.emplace_back(k, v);
    return Value::object(std::move(o), K::kNamespace);
  }));
  env.set("range", Value::function([](Interpreter& in, Args& a) {
    if (a.pos.empty() || a.pos.size() > 3) in.error("range() takes 1 to 3 integers");
    for (const Value& x : a.pos) {
      if (!x.is(K::kInt)) in.error("range() takes integers");
    }
    const int64_t start = a.pos.size() == 1 ? 0 : a.pos[0].i, stop = a.pos.size() == 1 ? a.pos[0].i : a.pos[1].i;
    const int64_t step = a.pos.size() == 3 ? a.pos[2].i : 1;
    if (step == 0) in.error("range() step must not be zero");
    Array out;
    for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
      in.count_iteration();
      out.push_back(Value::integer(k));
    }
    return Value::array(std::move(out));
  }));
  env.set("strftime_now", Value::function([](Interpreter& in, Args& a) {
    if (a.pos.empty() || !a.pos[0].is(K::kString)) in.error("strftime_now() takes a format string");
    const std::time_t t = std::time(nullptr);
    std::tm tm{};
    localtime_r(&t, &tm);
    static const char* kMonths[] = {"January", "February", "March",     "April",   "May",      "June",
                                    "July",    "August",   "September", "October", "November", "December"};
    std::string out;
    const std::string& f = a.pos[0].s;
    for (size_t k = 0; k < f.size(); ++k) {
      if (f[k] != '%' || k + 1 >= f.size()) {
        out.push_back(f[k]);
        continue;
      }
      switch (f[++k]) {
        case 'Y': out += std::to_string(tm.tm_year + 1900); break;
        case 'm': out += fmt::format("{:02}", tm.tm_mon + 1); break;
        case 'd': out += fmt::format("{:02}", tm.tm_mday); break;
        case 'H': out += fmt::format("{:02}", tm.tm_hour); break;
        case 'M': out += fmt::format("{:02}", tm.tm_min); break;
        case 'B': out += kMonths[tm.tm_mon]; break;
        case 'b': out += std::string(kMonths[tm.tm_mon]).substr(0, 3); break;
        case '%': out += "%"; break;
        default: out += "%"; out.push_back(f[k]);
      }
    }
    return Value::string(out);
  }));
}

}  // namespace bg::jinja
