// Errors and boundary checks: every failure says what and where (BG_CHECK with the offending value).
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace bg {

// The one exception type the engine throws for bad input or violated preconditions.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace bg

// Validate at the boundary: BG_CHECK(n > 0, "bad count {}", n). Throws bg::Error.
#define BG_CHECK(cond, ...)                  \
  do {                                       \
    if (!(cond)) [[unlikely]] {              \
      ::bg::fail(__VA_ARGS__);               \
    }                                        \
  } while (0)
