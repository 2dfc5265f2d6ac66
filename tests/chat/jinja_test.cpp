// The Jinja renderer: the subset chat templates use (expressions, filters, tests, loops and loop.*, if/elif/else,
// set + namespace, macros and call blocks, whitespace control, raise_exception), @huggingface/jinja's quirks that
// templates see (trim_blocks + lstrip_blocks, JSON spacing, number printing), errors with line numbers, and the bounds
// that keep a hostile template or value from overflowing the stack or running forever.
#include <gtest/gtest.h>

#include "core/error.h"
#include "server/chat/jinja/jinja.h"

namespace bg {
namespace {

using nlohmann::json;

std::string render(const std::string& src, const json& vars = json::object(), jinja::Limits limits = {}) {
  return jinja::Template(src, "t.jinja", limits).render(vars);
}

std::string error_of(const std::string& src, const json& vars = json::object(), jinja::Limits limits = {}) {
  try {
    render(src, vars, limits);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Jinja, ExpressionsAndFilters) {
  const json v = {{"name", "  Kimi  "}, {"xs", {3, 1, 2}}, {"obj", {{"b", 1}, {"a", "x"}}}, {"f", 2.5}, {"n", nullptr}};
  EXPECT_EQ(render("{{ name | trim | upper }}|{{ name|length }}", v), "KIMI|8");
  EXPECT_EQ(render("{{ xs|first }}{{ xs|last }}{{ xs|length }}{{ xs|sort|join(',') }}{{ xs|reverse|join }}", v),
            "3231,2,3213");
  EXPECT_EQ(render("{{ obj|tojson }}|{{ xs|tojson(indent=2) }}|{{ obj|tojson(separators=(',', ':')) }}", v),
            "{\"a\": \"x\", \"b\": 1}|[\n  3,\n  1,\n  2\n]|{\"a\":\"x\",\"b\":1}");
  EXPECT_EQ(render("{% for k, val in obj|items %}{{ k }}={{ val }};{% endfor %}", v), "a=x;b=1;");
  EXPECT_EQ(render("{{ missing|default('d') }}{{ n|default('d') }}{{ ''|default('e', true) }}", v), "de");
  EXPECT_EQ(render("{{ 'a-b-c'.replace('-', '+') }} {{ 'a-b'|replace('-', '') }} {{ 'Ab'.lower() }}", v), "a+b+c ab ab");
  EXPECT_EQ(render("{{ '42'|int + 1 }} {{ 7 // 2 }} {{ 7 / 2 }} {{ 2 ** 3 }} {{ f }} {{ 3.0 }} {{ 1 ~ 'x' }}", v),
            "43 3 3.5 8 2.5 3.0 1x");
  EXPECT_EQ(render("{{ xs|string }} {{ true }} {{ none }}|{{ 'x' if false else 'y' }}", v), "[3, 1, 2] true |y");
  EXPECT_EQ(render("{{ 'héllo'[1] }}{{ 'héllo'[1:3] }}{{ xs[-1] }}{{ xs[::-1]|join }}", v), "éél2213");
  EXPECT_EQ(render("{{ 'a b  c'.split()|length }}{{ 'a,b'.split(',')[1] }}{{ 'ab'.startswith('a') }}", v), "3btrue");
  EXPECT_EQ(render("{{ obj.get('a') }}{{ obj.get('z', 'dflt') }}{{ obj['b'] }}{{ obj.b }}", v), "xdflt11");
  EXPECT_EQ(render("{{ 'a' in 'cat' }}{{ 2 in xs }}{{ 'a' in obj }}{{ 'q' not in obj }}", v), "truetruetruetrue");
}

TEST(Jinja, Tests) {
  const json v = {{"s", "x"}, {"m", json::object()}, {"n", nullptr}, {"i", 3}};
  EXPECT_EQ(render("{{ s is string }}{{ m is mapping }}{{ n is none }}{{ u is defined }}{{ u is undefined }}", v),
            "truetruetruefalsetrue");
  EXPECT_EQ(render("{{ i is odd }}{{ i is even }}{{ i is number }}{{ s is not none }}{{ s is lower }}", v),
            "truefalsetruetruetrue");
  EXPECT_NE(error_of("{{ 1 is frobnicated }}").find("unknown test 'frobnicated'"), std::string::npos);
}

TEST(Jinja, LoopsAndConditionals) {
  const json v = {{"xs", {"a", "b", "c"}}};
  EXPECT_EQ(render("{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{% if loop.first %}F{% elif "
                   "loop.last %}L{% else %}M{% endif %}{% endfor %}",
                   v),
            "103F212M321L");
  EXPECT_EQ(render("{% for x in xs if x != 'b' %}{{ x }}{{ loop.length }}{% endfor %}", v), "a2c2");
  EXPECT_EQ(render("{% for x in [] %}x{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(render("{% for x in xs %}{{ x }}{% if x == 'b' %}{% break %}{% endif %}{% endfor %}", v), "ab");
  EXPECT_EQ(render("{% for x in xs %}{% if x == 'b' %}{% continue %}{% endif %}{{ x }}{% endfor %}", v), "ac");
  EXPECT_EQ(render("{% for i in range(5, 0, -2) %}{{ i }}{% endfor %}"), "531");
  EXPECT_EQ(render("{% for x in xs %}{{ loop.previtem }}{% endfor %}", v), "ab");
}

TEST(Jinja, SetNamespaceAndScopes) {
  EXPECT_EQ(render("{% set x = 1 %}{% for i in [1, 2] %}{% set x = i %}{% endfor %}{{ x }}"), "1");  // loop scope
  EXPECT_EQ(render("{% set ns = namespace(n=0) %}{% for i in [1, 2, 3] %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}"),
            "6");
  EXPECT_EQ(render("{% set a, b = [1, 2] %}{{ b }}{{ a }}{% set blk %}in{{ a }}{% endset %}{{ blk }}"), "21in1");
  EXPECT_NE(error_of("{% set x = {} %}{% set x.y = 1 %}").find("namespace"), std::string::npos);
}

TEST(Jinja, MacrosAndCallBlocks) {
  EXPECT_EQ(render("{% macro m(a, b='B') %}[{{ a }}{{ b }}]{% endmacro %}{{ m(1) }}{{ m(2, b=3) }}{{ m(b=4, a=5) }}"),
            "[1B][23][54]");
  EXPECT_EQ(render("{% macro w(x) %}<{{ caller() }}{{ x }}>{% endmacro %}{% call w(1) %}body{% endcall %}"),
            "<body1>");
  EXPECT_EQ(render("{% macro v() %}{{ varargs|length }}{{ kwargs.k }}{% endmacro %}{{ v(1, 2, k='z') }}"), "2z");
  EXPECT_NE(error_of("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}").find("takes at most 1"), std::string::npos);
}

TEST(Jinja, WhitespaceControlAndBlocks) {
  // trim_blocks + lstrip_blocks (as transformers renders chat templates), {%- -%} and {{- -}} trimming.
  EXPECT_EQ(render("a\n  {% if true %}\nb\n  {% endif %}\nc"), "a\nb\nc");
  EXPECT_EQ(render("a   {%- if true -%}   b   {%- endif -%}   c"), "abc");
  EXPECT_EQ(render("x {{- ' y ' -}} z\n"), "x y z");  // one trailing newline of the template is dropped
  EXPECT_EQ(render("{# comment #}a{#- c -#}  b"), "ab");
}

TEST(Jinja, RaiseExceptionAndErrorsHaveLines) {
  EXPECT_NE(error_of("{{ raise_exception('Only user and assistant roles') }}").find("Only user and assistant roles"),
            std::string::npos);
  EXPECT_NE(error_of("line1\nline2\n{% if %}").find("t.jinja:3: syntax error"), std::string::npos)
      << error_of("line1\nline2\n{% if %}");
  EXPECT_NE(error_of("a\n{{ 1 + none }}").find("t.jinja:2:"), std::string::npos) << error_of("a\n{{ 1 + none }}");
  EXPECT_NE(error_of("{% for x in xs %}").find("missing '{% endfor %}'"), std::string::npos);
  EXPECT_NE(error_of("{{ 'unterminated }}").find("unterminated string"), std::string::npos);
  EXPECT_NE(error_of("{{ x.y.z() }}").find("not callable"), std::string::npos);
  EXPECT_EQ(render("{{ strftime_now('%Y') | length }}"), "4");
}

TEST(Jinja, BoundsStopHostileTemplatesAndValues) {
  // Nesting in the source: a syntax error, not a stack overflow.
  EXPECT_NE(error_of("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}").find("nested deeper"),
            std::string::npos);
  std::string ifs;
  for (int i = 0; i < 500; ++i) ifs += "{% if true %}";
  EXPECT_NE(error_of(ifs).find("nested deeper"), std::string::npos);
  // Unbounded recursion, loops and output.
  EXPECT_NE(error_of("{% macro r() %}{{ r() }}{% endmacro %}{{ r() }}").find("deeper than 64"), std::string::npos);
  EXPECT_NE(error_of("{% for i in range(100000000) %}{% endfor %}").find("loop iterations"), std::string::npos);
  jinja::Limits small;
  small.max_output_bytes = 1000;
  EXPECT_NE(error_of("{% for i in range(100) %}{{ 'xxxxxxxxxxxxxxxxxxxx' }}{% endfor %}", json::object(), small)
                .find("output larger than"),
            std::string::npos);
  // Values from a client: nesting is bounded too.
  json deep = 1;
  for (int i = 0; i < 200; ++i) deep = json::array({deep});
  EXPECT_NE(error_of("{{ v }}", {{"v", deep}}).find("nested deeper than"), std::string::npos);
}

}  // namespace
}  // namespace bg
