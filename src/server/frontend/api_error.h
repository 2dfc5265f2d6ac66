// OpenAI-style API errors: an exception carrying the HTTP status and the {"error": {...}} body fields.
#pragma once

#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

namespace bg::frontend {

class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string message, std::string param = "", std::string code = "");

  int status() const { return status_; }
  const std::string& param() const { return param_; }
  const std::string& code() const { return code_; }
  // "invalid_request_error", "authentication_error", ... derived from the status.
  std::string type() const;
  nlohmann::json body() const;

 private:
  int status_;
  std::string param_;
  std::string code_;
};

// The error type OpenAI uses for an HTTP status (400 -> invalid_request_error, 401 -> authentication_error, ...).
std::string error_type_for_status(int status);

// {"error": {"message", "type", "param", "code"}}; empty param/code become null.
nlohmann::json error_body(int status, const std::string& message, const std::string& param = "",
                          const std::string& code = "");

// Serializes JSON for the wire; invalid UTF-8 in strings is replaced (U+FFFD) instead of throwing.
std::string dump_json(const nlohmann::json& j);

}  // namespace bg::frontend
