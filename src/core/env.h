// Settings from the environment (the BG_* switches of docs/GPU.md and docs/PERF.md): one parser per kind, so every
// switch accepts the same spellings, refuses the same bad input and names itself in the error. Each takes the raw
// getenv() value (tests pass their own) and has a form that reads the variable.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string_view>

namespace bg {

// A whole decimal number in [min, max] (nothing before or after it): nullopt when unset or empty; anything else
// throws bg::Error naming the variable, the value and the range.
std::optional<int64_t> env_int(const char* name, const char* value, int64_t min, int64_t max);
std::optional<int64_t> env_int(const char* name, int64_t min, int64_t max);

// "1" (on) or "0" (off); `fallback` when unset or empty; anything else throws naming the variable and the value.
bool env_switch(const char* name, const char* value, bool fallback);
bool env_switch(const char* name, bool fallback);

// The index of the value among `choices`; -1 when unset or empty; anything else throws listing the choices.
int env_choice(const char* name, const char* value, std::initializer_list<std::string_view> choices);
int env_choice(const char* name, std::initializer_list<std::string_view> choices);

}  // namespace bg
