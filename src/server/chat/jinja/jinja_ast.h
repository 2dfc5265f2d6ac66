// Jinja internals: the syntax tree the parser builds (jinja_parse.cpp) and the runtime values the interpreter
// (jinja_eval.cpp, jinja_builtins.cpp) computes with. Not part of the public API (jinja.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace bg::jinja {

enum class NodeKind : uint8_t {
  // statements
  kText, kIf, kFor, kSet, kMacro, kCallBlock, kFilterBlock, kBreak, kContinue, kComment,
  // expressions
  kIdentifier, kInt, kFloat, kString, kArray, kTuple, kObject, kMember, kSlice, kCall, kKwArg, kSpread, kKwSpread,
  kBinary, kUnary, kFilter, kTest, kSelect, kTernary, kNone,
};

struct Node;
using NodePtr = std::unique_ptr<Node>;

// One node; the meaning of `a`/`body`/`alt` depends on the kind:
//   kIf: a[0] test, body, alt (an elif is a nested kIf in alt)       kFor: a[0] target, a[1] iterable, body, alt
//   kSet: a[0] target, a[1] value (absent: block set, body)           kMacro: str name, a = parameters, body
//   kCallBlock: a[0] call, a[1..] caller parameters, body             kFilterBlock: a[0] filter, body
//   kMember: a[0] object, a[1] property, flag = computed ([..])       kSlice: a[0..2] start/stop/step (kNone = absent)
//   kCall: a[0] callee, a[1..] arguments                              kKwArg: str name, a[0] value
//   kBinary/kUnary: str operator, a = operands                        kFilter: a[0] operand, a[1] filter (name/call)
//   kTest: a[0] operand, str test name, flag = negated                kSelect: a[0] value, a[1] condition
//   kTernary: a[0] condition, a[1] if true, a[2] if false             kObject: a = key, value, key, value, ...
struct Node {
  NodeKind kind = NodeKind::kNone;
  int line = 0;
  std::string str;
  int64_t i = 0;
  double f = 0;
  bool flag = false;
  std::vector<NodePtr> a, body, alt;
};

struct Program {
  std::vector<NodePtr> body;
};

class Interpreter;
class Env;
struct Value;
using Array = std::vector<Value>;
using Object = std::vector<std::pair<std::string, Value>>;  // insertion-ordered (chat objects are small)
struct Args;
using NativeFn = std::function<Value(Interpreter&, Args&)>;

// A runtime value. Arrays, objects and namespaces are shared by reference (as in @huggingface/jinja); only
// namespaces are ever mutated (by `set ns.x = ...`).
struct Value {
  enum class Kind : uint8_t { kUndefined, kNull, kBool, kInt, kFloat, kString, kArray, kObject, kNamespace, kFunction };
  Kind kind = Kind::kUndefined;
  bool b = false;
  bool tuple = false;     // an array written as a tuple literal
  bool kwargs = false;    // an object holding keyword arguments (the last argument of a call)
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::shared_ptr<Array> arr;
  std::shared_ptr<Object> obj;  // kObject and kNamespace
  std::shared_ptr<NativeFn> fn;

  static Value null() { return make(Kind::kNull); }
  static Value boolean(bool v) { Value x = make(Kind::kBool); x.b = v; return x; }
  static Value integer(int64_t v) { Value x = make(Kind::kInt); x.i = v; return x; }
  static Value real(double v) { Value x = make(Kind::kFloat); x.f = v; return x; }
  static Value string(std::string v) { Value x = make(Kind::kString); x.s = std::move(v); return x; }
  static Value array(Array v) { Value x = make(Kind::kArray); x.arr = std::make_shared<Array>(std::move(v)); return x; }
  static Value object(Object v, Kind k = Kind::kObject) {
    Value x = make(k);
    x.obj = std::make_shared<Object>(std::move(v));
    return x;
  }
  static Value function(NativeFn f) { Value x = make(Kind::kFunction); x.fn = std::make_shared<NativeFn>(std::move(f)); return x; }
  static Value make(Kind k) { Value x; x.kind = k; return x; }

  bool is(Kind k) const { return kind == k; }
  bool numeric() const { return kind == Kind::kInt || kind == Kind::kFloat; }
  double number() const { return kind == Kind::kInt ? static_cast<double>(i) : kind == Kind::kFloat ? f : b ? 1 : 0; }
  const Value* find(const std::string& key) const;  // objects and namespaces
};

// Call arguments: positional values and keyword arguments, in order.
struct Args {
  std::vector<Value> pos;
  Object kw;
  Env* caller_env = nullptr;  // the calling scope (macros see it: dynamic scope, as @huggingface/jinja)
  const Value* kwarg(const std::string& key) const;
  const Value* at(size_t index, const std::string& key) const;  // positional index, else keyword
};

const char* kind_name(Value::Kind k);
bool truthy(const Value& v);
std::string to_display(const Value& v);  // what {{ v }} prints
struct JsonOptions {
  int indent = -1;  // < 0: none
  bool ensure_ascii = false, sort_keys = false;
  std::string item_sep = ", ", key_sep = ": ";
};
std::string to_json(const Value& v, const JsonOptions& o, bool undefined_as_null = true, int depth = 0);
std::string js_number(double v);   // JavaScript's Number#toString
size_t code_points(const std::string& s);
std::vector<std::string> split_code_points(const std::string& s);
bool js_space(char32_t c);  // JavaScript's \s (trim, lexer whitespace)

}  // namespace bg::jinja
