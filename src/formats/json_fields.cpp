// JsonFields: config.json accessors with type checks.
#include "formats/json_fields.h"

#include <fstream>
#include <sstream>

#include "core/error.h"

namespace bg {

nlohmann::json read_json_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  BG_CHECK(in.good(), "cannot open '{}'", path.string());
  std::stringstream ss;
  ss << in.rdbuf();
  auto j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  BG_CHECK(!j.is_discarded(), "'{}' is not valid JSON", path.string());
  return j;
}

JsonFields::JsonFields(const nlohmann::json& obj, std::string where) : obj_(obj), where_(std::move(where)) {
  BG_CHECK(obj_.is_object(), "{}: expected a JSON object", where_);
}

bool JsonFields::has(const std::string& key) const { return obj_.contains(key) && !obj_[key].is_null(); }

const nlohmann::json& JsonFields::at(const std::string& key) const {
  BG_CHECK(has(key), "{}: missing required field '{}'", where_, key);
  return obj_[key];
}

int64_t JsonFields::get_int(const std::string& key) const {
  const auto& v = at(key);
  BG_CHECK(v.is_number_integer(), "{}: field '{}' must be an integer, got {}", where_, key, v.dump());
  return v.get<int64_t>();
}

int64_t JsonFields::get_int(const std::string& key, int64_t fallback) const {
  return has(key) ? get_int(key) : fallback;
}

std::optional<int64_t> JsonFields::get_optional_int(const std::string& key) const {
  if (!has(key)) return std::nullopt;
  return get_int(key);
}

double JsonFields::get_double(const std::string& key) const {
  const auto& v = at(key);
  BG_CHECK(v.is_number(), "{}: field '{}' must be a number, got {}", where_, key, v.dump());
  return v.get<double>();
}

double JsonFields::get_double(const std::string& key, double fallback) const {
  return has(key) ? get_double(key) : fallback;
}

bool JsonFields::get_bool(const std::string& key, bool fallback) const {
  if (!has(key)) return fallback;
  const auto& v = obj_[key];
  BG_CHECK(v.is_boolean(), "{}: field '{}' must be true or false, got {}", where_, key, v.dump());
  return v.get<bool>();
}

std::string JsonFields::get_string(const std::string& key) const {
  const auto& v = at(key);
  BG_CHECK(v.is_string(), "{}: field '{}' must be a string, got {}", where_, key, v.dump());
  return v.get<std::string>();
}

std::string JsonFields::get_string(const std::string& key, const std::string& fallback) const {
  return has(key) ? get_string(key) : fallback;
}

std::vector<int64_t> JsonFields::get_int_list(const std::string& key) const {
  const auto& v = at(key);
  BG_CHECK(v.is_array(), "{}: field '{}' must be a list of integers, got {}", where_, key, v.dump());
  std::vector<int64_t> out;
  for (const auto& e : v) {
    BG_CHECK(e.is_number_integer(), "{}: field '{}' must be a list of integers, got element {}", where_, key,
             e.dump());
    out.push_back(e.get<int64_t>());
  }
  return out;
}

JsonFields JsonFields::object(const std::string& key) const {
  const auto& v = at(key);
  BG_CHECK(v.is_object(), "{}: field '{}' must be an object, got {}", where_, key, v.dump());
  return JsonFields(v, where_ + " " + key);
}

}  // namespace bg
