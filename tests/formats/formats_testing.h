// Helpers shared by the formats tests: a self-deleting temp dir, raw byte files, and "throws bg::Error naming X".
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <source_location>
#include <string>
#include <string_view>

#include "core/error.h"
#include "error_testing.h"
#include "temp_dir.h"

namespace bg::testing {

inline void write_bytes(const std::filesystem::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

inline std::string read_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// 8-byte little-endian length followed by the given bytes.
inline std::string u64_le(uint64_t v) {
  std::string out(8, '\0');
  for (size_t i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return out;
}

// A safetensors file image with an arbitrary header text and data buffer (no validation: for corrupt inputs).
inline std::string raw_safetensors(std::string_view header, std::string_view data) {
  return u64_le(header.size()) + std::string(header) + std::string(data);
}

// Expects f to throw bg::Error whose message contains every one of `parts`.
template <typename F>
void expect_error(F&& f, std::initializer_list<std::string_view> parts,
                  std::source_location loc = std::source_location::current()) {
  std::string msg = error_of(std::forward<F>(f), loc);
  ::testing::ScopedTrace trace(loc.file_name(), static_cast<int>(loc.line()), "expect_error");
  for (auto part : parts) {
    EXPECT_NE(msg.find(part), std::string::npos) << "message \"" << msg << "\" lacks \"" << part << "\"";
  }
}

}  // namespace bg::testing
