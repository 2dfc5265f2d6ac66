// read_private_file / read_secret_file.
#include "core/secret_file.h"

#include <sys/stat.h>

#include <fstream>
#include <iterator>

#include "core/error.h"

namespace bg {

std::string read_private_file(const std::filesystem::path& path, const std::string& what) {
  struct stat st {};
  BG_CHECK(::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode), "{}: {} is not a readable file", what,
           path.string());
  BG_CHECK((st.st_mode & 077) == 0, "{}: {} holds a shared secret but has mode {:o}; chmod 600 it", what,
           path.string(), st.st_mode & 0777);
  std::ifstream in(path, std::ios::binary);
  BG_CHECK(in.good(), "{}: cannot read {}", what, path.string());
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string read_secret_file(const std::filesystem::path& path, const std::string& what) {
  std::string secret = read_private_file(path, what);
  while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r')) secret.pop_back();
  BG_CHECK(secret.size() >= kMinSecretBytes, "{}: the shared secret in {} has {} bytes; at least {} are required",
           what, path.string(), secret.size(), kMinSecretBytes);
  return secret;
}

}  // namespace bg
