// Typed, validated reads of JSON config fields: a wrong type or range is an error naming the file and key.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace bg {

// Reads and parses a JSON file; throws naming the file on I/O or syntax errors.
nlohmann::json read_json_file(const std::filesystem::path& path);

// A JSON object plus the name used in errors ("config.json", "config.json text_config").
class JsonFields {
 public:
  JsonFields(const nlohmann::json& obj, std::string where);

  bool has(const std::string& key) const;  // present and not null
  int64_t get_int(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t fallback) const;
  // null or absent -> nullopt.
  std::optional<int64_t> get_optional_int(const std::string& key) const;
  double get_double(const std::string& key) const;
  double get_double(const std::string& key, double fallback) const;
  bool get_bool(const std::string& key, bool fallback) const;
  std::string get_string(const std::string& key) const;
  std::string get_string(const std::string& key, const std::string& fallback) const;
  std::vector<int64_t> get_int_list(const std::string& key) const;
  // A nested object (throws if absent or not an object).
  JsonFields object(const std::string& key) const;
  const nlohmann::json& json() const { return obj_; }
  const std::string& where() const { return where_; }

 private:
  const nlohmann::json& at(const std::string& key) const;
  const nlohmann::json& obj_;
  std::string where_;
};

}  // namespace bg
