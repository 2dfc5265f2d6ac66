// A fresh temporary directory per use, named after the running test, removed with everything in it on destruction.
#pragma once

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace bg::testing {

class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string test = info != nullptr ? std::string(info->name()) : std::string("none");
    for (char& ch : test) {
      if (ch == '/') ch = '_';  // parameterized test names
    }
    path_ = std::filesystem::temp_directory_path() /
            ("bg_test_" + test + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

// Writes `text` to `dir`/`name` with `mode` (600: a secret only its owner reads) and returns the path.
inline std::string write_secret_file(const TempDir& dir, const std::string& name, const std::string& text,
                                     mode_t mode = 0600) {
  const std::string path = (dir / name).string();
  std::ofstream(path) << text;
  EXPECT_EQ(::chmod(path.c_str(), mode), 0) << path;
  return path;
}

}  // namespace bg::testing
