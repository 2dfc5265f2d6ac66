// A renderer for the Jinja subset chat templates use (the grammar and semantics of @huggingface/jinja, the reference
// the tests compare with): expressions, filters, tests, loops, conditionals, set/namespace, macros and call blocks,
// whitespace control, trim_blocks + lstrip_blocks. Bounded: parse nesting, macro recursion, loop iterations and
// output size all have limits, so a template from a file and values from a client can neither overflow the stack
// nor run forever. Errors are bg::Error naming the template and line.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

namespace bg::jinja {

struct Limits {
  int max_nesting = 128;                     // parser: nested blocks + expressions
  int max_call_depth = 64;                   // macro calls in flight
  int max_value_depth = 64;                  // nesting of JSON values handed in
  int64_t max_iterations = 1'000'000;        // loop iterations over a whole render
  size_t max_output_bytes = size_t{64} << 20;  // rendered text and any one string value
};

struct Program;  // the parsed template (jinja_ast.h)

class Template {
 public:
  // Throws bg::Error "<name>:<line>: <message>" on a syntax error.
  Template(const std::string& source, std::string name, Limits limits = {});
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;

  // `vars` (a JSON object) are the template's variables (messages, tools, add_generation_prompt, ...). Besides them
  // the globals true/false/none, namespace(), range(), raise_exception() and strftime_now() exist. Throws bg::Error
  // "<name>:<line>: <message>" on a runtime error (raise_exception's message is passed through).
  std::string render(const nlohmann::ordered_json& vars) const;  // objects keep their key order
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  Limits limits_;
  std::unique_ptr<Program> program_;
};

}  // namespace bg::jinja
