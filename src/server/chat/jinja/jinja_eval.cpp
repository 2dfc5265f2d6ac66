// Jinja interpreter: statements (text, if, for, set, macro, call and filter blocks, break/continue) and expressions,
// with @huggingface/jinja's semantics (dynamic scope for macros, JavaScript-like `==`, strings concatenated by `+`),
// except that output written before a `break`/`continue` in the same iteration is kept (as Jinja2 does).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "server/chat/jinja/jinja_interp.h"

namespace bg::jinja {

std::unique_ptr<Program> parse_template(const std::string& source, const std::string& name, int max_nesting);

const Value* Env::lookup(const std::string& name) const {
  for (const Env* e = this; e != nullptr; e = e->parent_) {
    for (const auto& [k, v] : e->vars_) {
      if (k == name) return &v;
    }
  }
  return nullptr;
}

void Env::set(const std::string& name, Value v) {
  for (auto& [k, old] : vars_) {
    if (k == name) {
      old = std::move(v);
      return;
    }
  }
  vars_.emplace_back(name, std::move(v));
}

void Interpreter::error(const std::string& msg) const { fail("{}:{}: {}", name_, line_, msg); }

void Interpreter::check_size(size_t bytes) const {
  if (bytes > limits_.max_output_bytes) error(fmt::format("output larger than {} bytes", limits_.max_output_bytes));
}

void Interpreter::count_iteration() {
  if (++iterations_ > limits_.max_iterations) {
    error(fmt::format("more than {} loop iterations in one render", limits_.max_iterations));
  }
}

std::string Interpreter::run(const Program& p, Env& globals) {
  std::string out;
  try {
    if (exec_block(p.body, globals, out) != Flow::kNormal) error("'break' or 'continue' outside a loop");
  } catch (const Error& e) {
    const std::string what = e.what();
    if (what.rfind(name_ + ":", 0) == 0) throw;
    fail("{}:{}: {}", name_, line_, what);  // a builtin's error, located at the node being evaluated
  }
  return out;
}

Interpreter::Flow Interpreter::exec_block(const std::vector<NodePtr>& body, Env& env, std::string& out) {
  for (const NodePtr& n : body) {
    const Flow f = exec(*n, env, out);
    if (f != Flow::kNormal) return f;
  }
  return Flow::kNormal;
}

Interpreter::Flow Interpreter::exec(const Node& n, Env& env, std::string& out) {
  line_ = n.line;
  switch (n.kind) {
    case NodeKind::kText: out += n.str; break;
    case NodeKind::kComment: break;
    case NodeKind::kIf: {
      const bool t = truthy(eval(*n.a[0], env));
      return exec_block(t ? n.body : n.alt, env, out);
    }
    case NodeKind::kFor: return exec_for(n, env, out);
    case NodeKind::kSet: exec_set(n, env); break;
    case NodeKind::kMacro: env.set(n.str, make_macro(n, env)); break;
    case NodeKind::kBreak: return Flow::kBreak;
    case NodeKind::kContinue: return Flow::kContinue;
    case NodeKind::kFilterBlock: {
      std::string body;
      if (exec_block(n.body, env, body) != Flow::kNormal) error("'break' or 'continue' inside a filter block");
      out += to_display(apply_filter(*this, Value::string(std::move(body)), *n.a[0], env));
      break;
    }
    case NodeKind::kCallBlock: {
      // caller() renders the block body; the macro runs in a scope that defines it.
      const Node* block = &n;
      Env* outer = &env;
      Value caller = Value::function([this, block, outer](Interpreter&, Args& args) {
        Env scope(outer);
        bind_parameters(*block, 1, args, scope);
        std::string s;
        if (exec_block(block->body, scope, s) != Flow::kNormal) error("'break' or 'continue' inside a call block");
        return Value::string(std::move(s));
      });
      const Node& c = *n.a[0];
      Args args = eval_args(c.a, 1, env);
      Env with_caller(&env);
      with_caller.set("caller", std::move(caller));
      args.caller_env = &with_caller;
      const Value fn = eval(*c.a[0], env);
      const Value r = call(fn, args);
      if (!r.is(Value::Kind::kNull) && !r.is(Value::Kind::kUndefined)) out += to_display(r);
      break;
    }
    default: {
      const Value v = eval(n, env);
      if (!v.is(Value::Kind::kNull) && !v.is(Value::Kind::kUndefined)) out += to_display(v);
    }
  }
  check_size(out.size());
  return Flow::kNormal;
}

Interpreter::Flow Interpreter::exec_for(const Node& n, Env& env, std::string& out) {
  Env scope(&env);
  const Node& target = *n.a[0];
  const Node* iterable_node = n.a[1].get();
  const Node* condition = nullptr;
  if (iterable_node->kind == NodeKind::kSelect) {  // for x in xs if cond
    condition = iterable_node->a[1].get();
    iterable_node = iterable_node->a[0].get();
  }
  const Value iterable = eval(*iterable_node, scope);
  Array all;
  if (iterable.is(Value::Kind::kArray)) {
    all = *iterable.arr;
  } else if (iterable.is(Value::Kind::kObject)) {
    for (const auto& [k, v] : *iterable.obj) all.push_back(Value::string(k));
  } else {
    error(fmt::format("'for' needs an array or an object, not {}", kind_name(iterable.kind)));
  }
  auto bind = [&](Env& e, const Value& item) {
    if (target.kind == NodeKind::kIdentifier) {
      e.set(target.str, item);
      return;
    }
    if (!item.is(Value::Kind::kArray)) error(fmt::format("cannot unpack {} into loop variables", kind_name(item.kind)));
    if (item.arr->size() != target.a.size()) {
      error(fmt::format("too {} values to unpack (expected {})", item.arr->size() < target.a.size() ? "few" : "many",
                        target.a.size()));
    }
    for (size_t j = 0; j < target.a.size(); ++j) {
      if (target.a[j]->kind != NodeKind::kIdentifier) error("loop variables must be names");
      e.set(target.a[j]->str, (*item.arr)[j]);
    }
  };
  Array items;
  for (const Value& item : all) {
    count_iteration();
    if (condition != nullptr) {
      Env probe(&scope);
      bind(probe, item);
      if (!truthy(eval(*condition, probe))) continue;
    }
    items.push_back(item);
  }
  line_ = n.line;
  if (items.empty()) return exec_block(n.alt, scope, out);
  const auto count = static_cast<int64_t>(items.size());
  for (int64_t i = 0; i < count; ++i) {
    count_iteration();
    Object loop = {{"index", Value::integer(i + 1)},
                   {"index0", Value::integer(i)},
                   {"revindex", Value::integer(count - i)},
                   {"revindex0", Value::integer(count - i - 1)},
                   {"first", Value::boolean(i == 0)},
                   {"last", Value::boolean(i == count - 1)},
                   {"length", Value::integer(count)},
                   {"previtem", i > 0 ? items[i - 1] : Value()},
                   {"nextitem", i + 1 < count ? items[i + 1] : Value()}};
    scope.set("loop", Value::object(std::move(loop)));
    bind(scope, items[static_cast<size_t>(i)]);
    const Flow f = exec_block(n.body, scope, out);
    if (f == Flow::kBreak) break;
  }
  return Flow::kNormal;
}

void Interpreter::exec_set(const Node& n, Env& env) {
  Value v;
  if (n.a.size() > 1) {
    v = eval(*n.a[1], env);
  } else {
    std::string s;
    if (exec_block(n.body, env, s) != Flow::kNormal) error("'break' or 'continue' inside a set block");
    v = Value::string(std::move(s));
  }
  const Node& t = *n.a[0];
  if (t.kind == NodeKind::kIdentifier) {
    env.set(t.str, std::move(v));
  } else if (t.kind == NodeKind::kTuple) {
    if (!v.is(Value::Kind::kArray)) error(fmt::format("cannot unpack {} in 'set'", kind_name(v.kind)));
    if (v.arr->size() != t.a.size()) error("wrong number of values to unpack in 'set'");
    for (size_t j = 0; j < t.a.size(); ++j) {
      if (t.a[j]->kind != NodeKind::kIdentifier) error("'set' can only unpack into names");
      env.set(t.a[j]->str, (*v.arr)[j]);
    }
  } else if (t.kind == NodeKind::kMember && !t.flag && t.a[1]->kind == NodeKind::kIdentifier) {
    const Value ns = eval(*t.a[0], env);
    if (!ns.is(Value::Kind::kNamespace)) error("attributes can only be set on a namespace()");
    for (auto& [k, old] : *ns.obj) {
      if (k == t.a[1]->str) {
        old = std::move(v);
        return;
      }
    }
    ns.obj->emplace_back(t.a[1]->str, std::move(v));
  } else {
    error("'set' needs a name, a tuple of names or namespace.attribute on the left");
  }
}

namespace {

bool mentions(const Node& n, const std::string& name) {
  if (n.kind == NodeKind::kIdentifier && n.str == name) return true;
  for (const auto* list : {&n.a, &n.body, &n.alt}) {
    for (const NodePtr& c : *list) {
      if (mentions(*c, name)) return true;
    }
  }
  return false;
}

}  // namespace

// Parameters of `def` (from index first_param of def.a): positional arguments, then keywords, then defaults (which
// may refer to earlier parameters); `varargs` / `kwargs` take the rest when the body uses them.
void Interpreter::bind_parameters(const Node& def, size_t first_param, Args& args, Env& scope) {
  std::vector<const Node*> defaults;
  size_t n_params = 0;
  for (size_t k = first_param; k < def.a.size(); ++k, ++n_params) {
    const Node& p = *def.a[k];
    const std::string& pname = p.str;
    const size_t idx = k - first_param;
    if (idx < args.pos.size()) {
      scope.set(pname, args.pos[idx]);
      continue;
    }
    auto it = std::find_if(args.kw.begin(), args.kw.end(), [&](const auto& kv) { return kv.first == pname; });
    if (it != args.kw.end()) {
      scope.set(pname, it->second);
      args.kw.erase(it);
      continue;
    }
    scope.set(pname, Value());
    if (p.kind == NodeKind::kKwArg) defaults.push_back(&p);
  }
  const bool body_kwargs = std::any_of(def.body.begin(), def.body.end(), [](const NodePtr& b) { return mentions(*b, "kwargs"); });
  const bool body_varargs = std::any_of(def.body.begin(), def.body.end(), [](const NodePtr& b) { return mentions(*b, "varargs"); });
  if (body_kwargs) {
    scope.set("kwargs", Value::object(args.kw));
  } else if (!args.kw.empty()) {
    error(fmt::format("macro '{}' has no parameter '{}'", def.str, args.kw.front().first));
  }
  if (args.pos.size() > n_params) {
    if (!body_varargs) error(fmt::format("macro '{}' takes at most {} argument(s)", def.str, n_params));
    scope.set("varargs", Value::array(Array(args.pos.begin() + static_cast<std::ptrdiff_t>(n_params), args.pos.end())));
  } else if (body_varargs) {
    scope.set("varargs", Value::array({}));
  }
  for (const Node* p : defaults) scope.set(p->str, eval(*p->a[0], scope));
}

Value Interpreter::make_macro(const Node& n, Env& definition_env) {
  const Node* def = &n;
  Env* fallback = &definition_env;
  return Value::function([this, def, fallback](Interpreter&, Args& args) {
    if (++call_depth_ > limits_.max_call_depth) {
      error(fmt::format("macro calls nested deeper than {} (unbounded recursion?)", limits_.max_call_depth));
    }
    // Dynamic scope, as @huggingface/jinja: the macro body sees the caller's variables.
    Env scope(args.caller_env != nullptr ? args.caller_env : fallback);
    bind_parameters(*def, 0, args, scope);
    std::string s;
    if (exec_block(def->body, scope, s) != Flow::kNormal) error("'break' or 'continue' outside a loop in a macro");
    --call_depth_;
    return Value::string(std::move(s));
  });
}

Args Interpreter::eval_args(const std::vector<NodePtr>& nodes, size_t first, Env& env) {
  Args args;
  for (size_t k = first; k < nodes.size(); ++k) {
    const Node& n = *nodes[k];
    if (n.kind == NodeKind::kSpread) {
      const Value v = eval(*n.a[0], env);
      if (!v.is(Value::Kind::kArray)) error(fmt::format("cannot unpack {} with '*'", kind_name(v.kind)));
      args.pos.insert(args.pos.end(), v.arr->begin(), v.arr->end());
    } else if (n.kind != NodeKind::kKwArg && n.kind != NodeKind::kKwSpread) {
      args.pos.push_back(eval(n, env));
    }
  }
  auto add_kw = [&](const std::string& key, Value v) {
    for (const auto& [k, old] : args.kw) {
      if (k == key) error(fmt::format("keyword argument '{}' given twice", key));
    }
    args.kw.emplace_back(key, std::move(v));
  };
  for (size_t k = first; k < nodes.size(); ++k) {
    const Node& n = *nodes[k];
    if (n.kind == NodeKind::kKwArg) add_kw(n.str, eval(*n.a[0], env));
    if (n.kind == NodeKind::kKwSpread) {
      const Value v = eval(*n.a[0], env);
      if (!v.is(Value::Kind::kObject)) error(fmt::format("'**' needs a mapping, not {}", kind_name(v.kind)));
      for (const auto& [key, val] : *v.obj) add_kw(key, val);
    }
  }
  args.caller_env = &env;
  return args;
}

Value Interpreter::call(const Value& fn, Args& args) {
  if (!fn.is(Value::Kind::kFunction)) error(fmt::format("{} is not callable", kind_name(fn.kind)));
  return (*fn.fn)(*this, args);
}

Value Interpreter::eval(const Node& n, Env& env) {
  if (n.line > 0) line_ = n.line;
  switch (n.kind) {
    case NodeKind::kInt: return Value::integer(n.i);
    case NodeKind::kFloat: return Value::real(n.f);
    case NodeKind::kString: return Value::string(n.str);
    case NodeKind::kIdentifier: {
      const Value* v = env.lookup(n.str);
      return v != nullptr ? *v : Value();
    }
    case NodeKind::kArray:
    case NodeKind::kTuple:
    case NodeKind::kObject: return eval_literal(n, env);
    case NodeKind::kMember: return eval_member(n, env);
    case NodeKind::kCall: {
      Args args = eval_args(n.a, 1, env);
      const Value fn = eval(*n.a[0], env);
      line_ = n.line;
      return call(fn, args);
    }
    case NodeKind::kBinary: return eval_binary(n, env);
    case NodeKind::kUnary: return eval_unary(n, env);
    case NodeKind::kFilter: {
      const Value operand = eval(*n.a[0], env);
      line_ = n.line;
      return apply_filter(*this, operand, *n.a[1], env);
    }
    case NodeKind::kTest: {
      const Value operand = eval(*n.a[0], env);
      line_ = n.line;
      return Value::boolean(apply_test(*this, n.str, operand) != n.flag);
    }
    case NodeKind::kSelect: return truthy(eval(*n.a[1], env)) ? eval(*n.a[0], env) : Value();
    case NodeKind::kTernary: return truthy(eval(*n.a[0], env)) ? eval(*n.a[1], env) : eval(*n.a[2], env);
    case NodeKind::kNone: return Value();
    default: error("this statement cannot be used as a value");
  }
}

Value Interpreter::eval_literal(const Node& n, Env& env) {
  if (n.kind == NodeKind::kObject) {
    Object o;
    for (size_t k = 0; k + 1 < n.a.size(); k += 2) {
      const Value key = eval(*n.a[k], env);
      if (!key.is(Value::Kind::kString)) error(fmt::format("object keys must be strings, not {}", kind_name(key.kind)));
      Value v = eval(*n.a[k + 1], env);
      auto it = std::find_if(o.begin(), o.end(), [&](const auto& kv) { return kv.first == key.s; });
      if (it != o.end()) {
        it->second = std::move(v);
      } else {
        o.emplace_back(key.s, std::move(v));
      }
    }
    return Value::object(std::move(o));
  }
  Array items;
  for (const NodePtr& c : n.a) items.push_back(eval(*c, env));
  Value v = Value::array(std::move(items));
  v.tuple = n.kind == NodeKind::kTuple;
  return v;
}

Value Interpreter::eval_member(const Node& n, Env& env) {
  const Value object = eval(*n.a[0], env);
  const Node& prop_node = *n.a[1];
  line_ = n.line;
  if (prop_node.kind == NodeKind::kSlice) {
    return slice_value(*this, object, eval(*prop_node.a[0], env), eval(*prop_node.a[1], env),
                       eval(*prop_node.a[2], env));
  }
  Value prop;
  if (n.flag) {
    prop = eval(prop_node, env);
  } else if (prop_node.kind == NodeKind::kInt) {
    prop = Value::integer(prop_node.i);
  } else {
    prop = Value::string(prop_node.str);
  }
  if (object.is(Value::Kind::kObject) || object.is(Value::Kind::kNamespace)) {
    if (!prop.is(Value::Kind::kString)) error(fmt::format("cannot index an object with {}", kind_name(prop.kind)));
    if (const Value* v = object.find(prop.s)) return *v;
    return object.is(Value::Kind::kObject) ? builtin_member(*this, object, prop.s) : Value();
  }
  if ((object.is(Value::Kind::kArray) || object.is(Value::Kind::kString)) && prop.is(Value::Kind::kInt)) {
    if (object.is(Value::Kind::kArray)) {
      const auto size = static_cast<int64_t>(object.arr->size());
      const int64_t k = prop.i < 0 ? size + prop.i : prop.i;
      return k >= 0 && k < size ? (*object.arr)[static_cast<size_t>(k)] : Value();
    }
    const std::vector<std::string> chars = split_code_points(object.s);
    const auto size = static_cast<int64_t>(chars.size());
    const int64_t k = prop.i < 0 ? size + prop.i : prop.i;
    return k >= 0 && k < size ? Value::string(chars[static_cast<size_t>(k)]) : Value();
  }
  if (!prop.is(Value::Kind::kString)) error(fmt::format("cannot index {} with {}", kind_name(object.kind),
                                                        kind_name(prop.kind)));
  return builtin_member(*this, object, prop.s);
}

Value Interpreter::eval_unary(const Node& n, Env& env) {
  const Value v = eval(*n.a[0], env);
  if (n.str == "not") return Value::boolean(!truthy(v));
  const int sign = n.str == "-" ? -1 : 1;
  if (v.is(Value::Kind::kFloat)) return Value::real(sign * v.f);
  if (v.is(Value::Kind::kInt) || v.is(Value::Kind::kBool)) return Value::integer(sign * static_cast<int64_t>(v.number()));
  error(fmt::format("unary '{}' on {}", n.str, kind_name(v.kind)));
}

Value Interpreter::eval_binary(const Node& n, Env& env) {
  const std::string& op = n.str;
  const Value left = eval(*n.a[0], env);
  if (op == "and") return truthy(left) ? eval(*n.a[1], env) : left;
  if (op == "or") return truthy(left) ? left : eval(*n.a[1], env);
  const Value right = eval(*n.a[1], env);
  line_ = n.line;
  using K = Value::Kind;
  if (op == "==") return Value::boolean(loose_equal(left, right));
  if (op == "!=") return Value::boolean(!loose_equal(left, right));
  const bool membership = op == "in" || op == "not in";
  if (left.is(K::kUndefined) || right.is(K::kUndefined)) {
    if (membership && right.is(K::kUndefined)) return Value::boolean(op == "not in");
    error(fmt::format("'{}' on an undefined value", op));
  }
  if (left.is(K::kNull) || right.is(K::kNull)) error(fmt::format("'{}' on none", op));
  if (op == "~") {
    std::string s = to_display(left) + to_display(right);
    check_size(s.size());
    return Value::string(std::move(s));
  }
  const bool num_like_l = left.numeric() || left.is(K::kBool), num_like_r = right.numeric() || right.is(K::kBool);
  if (op == "**" && num_like_l && num_like_r) {
    const double a = left.number(), b = right.number(), r = std::pow(a, b);
    if (a == 0 && b < 0) error("0 cannot be raised to a negative power");
    if (!std::isfinite(r)) error("'**' result is not a finite number");
    const bool is_float = left.is(K::kFloat) || right.is(K::kFloat) || b < 0;
    return is_float ? Value::real(r) : Value::integer(static_cast<int64_t>(r));
  }
  if (left.numeric() && right.numeric()) {
    const bool is_float = left.is(K::kFloat) || right.is(K::kFloat);
    const double a = left.number(), b = right.number();
    if (op == "<") return Value::boolean(a < b);
    if (op == ">") return Value::boolean(a > b);
    if (op == "<=") return Value::boolean(a <= b);
    if (op == ">=") return Value::boolean(a >= b);
    if (op == "/") {
      if (b == 0) error("division by zero");
      return Value::real(a / b);
    }
    if ((op == "//" || op == "%") && b == 0) error("division by zero");
    if (is_float) {
      if (op == "+") return Value::real(a + b);
      if (op == "-") return Value::real(a - b);
      if (op == "*") return Value::real(a * b);
      if (op == "//") return Value::real(std::floor(a / b));
      if (op == "%") return Value::real(std::fmod(a, b));
    } else {
      int64_t r = 0;
      const int64_t x = left.i, y = right.i;
      if (op == "+" && !__builtin_add_overflow(x, y, &r)) return Value::integer(r);
      if (op == "-" && !__builtin_sub_overflow(x, y, &r)) return Value::integer(r);
      if (op == "*" && !__builtin_mul_overflow(x, y, &r)) return Value::integer(r);
      if (op == "//") return Value::integer(static_cast<int64_t>(std::floor(static_cast<double>(x) / static_cast<double>(y))));
      if (op == "%") return Value::integer(x % y);
      if (op == "+" || op == "-" || op == "*") error(fmt::format("integer overflow in '{}'", op));
    }
  } else if (left.is(K::kArray) && right.is(K::kArray) && op == "+") {
    Array r = *left.arr;
    r.insert(r.end(), right.arr->begin(), right.arr->end());
    return Value::array(std::move(r));
  } else if (right.is(K::kArray) && membership) {
    const bool found = std::any_of(right.arr->begin(), right.arr->end(), [&](const Value& x) { return strict_equal(x, left); });
    return Value::boolean(found == (op == "in"));
  }
  if (op == "+" && (left.is(K::kString) || right.is(K::kString))) {
    std::string s = to_display(left) + to_display(right);
    check_size(s.size());
    return Value::string(std::move(s));
  }
  if (membership && left.is(K::kString) && right.is(K::kString)) {
    return Value::boolean((right.s.find(left.s) != std::string::npos) == (op == "in"));
  }
  if (membership && left.is(K::kString) && right.is(K::kObject)) {
    return Value::boolean((right.find(left.s) != nullptr) == (op == "in"));
  }
  error(fmt::format("unsupported operator '{}' between {} and {}", op, kind_name(left.kind), kind_name(right.kind)));
}

// ---- Template ----

Template::Template(const std::string& source, std::string name, Limits limits)
    : name_(std::move(name)), limits_(limits), program_(parse_template(source, name_, limits_.max_nesting)) {}
Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

std::string Template::render(const nlohmann::ordered_json& vars) const {
  BG_CHECK(vars.is_object(), "{}: template variables must be a JSON object", name_);
  Env globals(nullptr);
  install_globals(globals);
  for (const auto& [k, v] : vars.items()) {
    try {
      globals.set(k, from_json(v, 0, limits_.max_value_depth));
    } catch (const Error& e) {
      fail("{}: variable '{}': {}", name_, k, e.what());
    }
  }
  Interpreter in(name_, limits_);
  return in.run(*program_, globals);
}

}  // namespace bg::jinja
