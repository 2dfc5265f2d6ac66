#include "core/env.h"

#include <charconv>
#include <cstdlib>
#include <string>

#include "core/error.h"

namespace bg {

std::optional<int64_t> env_int(const char* name, const char* value, int64_t min, int64_t max) {
  if (value == nullptr || *value == '\0') return std::nullopt;
  const std::string_view v(value);
  int64_t n = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  BG_CHECK(ec == std::errc() && end == v.data() + v.size() && n >= min && n <= max,
           "{}='{}': expected a whole number in [{}, {}]", name, v, min, max);
  return n;
}

std::optional<int64_t> env_int(const char* name, int64_t min, int64_t max) {
  return env_int(name, std::getenv(name), min, max);
}

bool env_switch(const char* name, const char* value, bool fallback) {
  if (value == nullptr || *value == '\0') return fallback;
  const std::string_view v(value);
  if (v == "1") return true;
  if (v == "0") return false;
  fail("{}='{}': expected 0 or 1", name, v);
}

bool env_switch(const char* name, bool fallback) { return env_switch(name, std::getenv(name), fallback); }

int env_choice(const char* name, const char* value, std::initializer_list<std::string_view> choices) {
  if (value == nullptr || *value == '\0') return -1;
  const std::string_view v(value);
  int i = 0;
  std::string list;
  for (std::string_view c : choices) {
    if (c == v) return i;
    list += (i == 0 ? "" : ", ") + std::string(c);
    ++i;
  }
  fail("{}='{}': expected one of {}", name, v, list);
}

int env_choice(const char* name, std::initializer_list<std::string_view> choices) {
  return env_choice(name, std::getenv(name), choices);
}

}  // namespace bg
