// Jinja interpreter internals shared by jinja_eval.cpp (statements, expressions, macros) and jinja_builtins.cpp
// (filters, tests, methods of strings/objects, globals).
#pragma once

#include <string>
#include <vector>

#include "server/chat/jinja/jinja.h"
#include "server/chat/jinja/jinja_ast.h"

namespace bg::jinja {

// A scope: variables of a loop body, a macro call, or the template. Lookups walk to the parent.
class Env {
 public:
  explicit Env(Env* parent) : parent_(parent) {}
  const Value* lookup(const std::string& name) const;
  void set(const std::string& name, Value v);

 private:
  Env* parent_;
  std::vector<std::pair<std::string, Value>> vars_;
};

class Interpreter {
 public:
  Interpreter(const std::string& name, const Limits& limits) : name_(name), limits_(limits) {}

  std::string run(const Program& p, Env& globals);
  [[noreturn]] void error(const std::string& msg) const;
  const Limits& limits() const { return limits_; }
  void check_size(size_t bytes) const;
  void count_iteration();

  Value call(const Value& fn, Args& args);
  Value eval(const Node& n, Env& env);
  Args eval_args(const std::vector<NodePtr>& nodes, size_t first, Env& env);

 private:
  enum class Flow { kNormal, kBreak, kContinue };
  Flow exec_block(const std::vector<NodePtr>& body, Env& env, std::string& out);
  Flow exec(const Node& n, Env& env, std::string& out);
  Flow exec_for(const Node& n, Env& env, std::string& out);
  void exec_set(const Node& n, Env& env);
  Value make_macro(const Node& n, Env& definition_env);
  Value eval_member(const Node& n, Env& env);
  Value eval_binary(const Node& n, Env& env);
  Value eval_unary(const Node& n, Env& env);
  Value eval_literal(const Node& n, Env& env);
  void bind_parameters(const Node& macro, size_t first_param, Args& args, Env& scope);

  const std::string& name_;
  const Limits& limits_;
  int line_ = 0;  // the node being evaluated, for error messages
  int call_depth_ = 0;
  int64_t iterations_ = 0;
};

// jinja_builtins.cpp
Value apply_filter(Interpreter& in, const Value& operand, const Node& filter, Env& env);
bool apply_test(Interpreter& in, const std::string& name, const Value& operand);
Value builtin_member(Interpreter& in, const Value& object, const std::string& name);  // undefined when none
void install_globals(Env& env);
Value from_json(const nlohmann::ordered_json& j, int depth, int max_depth);  // objects in key order
bool loose_equal(const Value& a, const Value& b);   // `==` as @huggingface/jinja (JavaScript ==)
bool strict_equal(const Value& a, const Value& b);  // membership (`in`): JavaScript ===
Value slice_value(Interpreter& in, const Value& v, const Value& start, const Value& stop, const Value& step);

}  // namespace bg::jinja
