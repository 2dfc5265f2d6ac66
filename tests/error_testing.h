// error_of: runs a callable that must throw bg::Error and returns its message, for tests that check what an error
// says. Shared by the test folders (formats, model, sched, moe).
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <source_location>
#include <string>

#include "core/error.h"

namespace bg::testing {

// Runs f, which must throw bg::Error (no other type), and returns its message ("" plus a test failure, reported at
// the caller's line, otherwise).
template <typename F>
std::string error_of(F&& f, std::source_location loc = std::source_location::current()) {
  ::testing::ScopedTrace trace(loc.file_name(), static_cast<int>(loc.line()), "error_of");
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-bg::Error exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

}  // namespace bg::testing
