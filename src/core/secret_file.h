// Reading a shared secret from a file: the file must be a regular file readable by its owner only (mode 600 or
// stricter), and the secret (a trailing newline dropped) must have at least kMinSecretBytes bytes.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>

namespace bg {

inline constexpr size_t kMinSecretBytes = 32;

// The file's bytes. Throws bg::Error starting with `what` when it is not a regular file or group/others may access it.
std::string read_private_file(const std::filesystem::path& path, const std::string& what);

// read_private_file, a trailing "\n" / "\r\n" dropped; throws when fewer than kMinSecretBytes bytes remain.
std::string read_secret_file(const std::filesystem::path& path, const std::string& what);

}  // namespace bg
