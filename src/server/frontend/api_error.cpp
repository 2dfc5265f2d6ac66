// OpenAI-style error bodies and the status -> error type table.
#include "server/frontend/api_error.h"

namespace bg::frontend {

using nlohmann::json;

ApiError::ApiError(int status, std::string message, std::string param, std::string code)
    : std::runtime_error(std::move(message)), status_(status), param_(std::move(param)), code_(std::move(code)) {}

std::string ApiError::type() const { return error_type_for_status(status_); }

json ApiError::body() const { return error_body(status_, what(), param_, code_); }

std::string error_type_for_status(int status) {
  switch (status) {
    case 400:
    case 404:
    case 405:
    case 413:
    case 422:
      return "invalid_request_error";
    case 401:
      return "authentication_error";
    case 403:
      return "permission_error";
    case 429:
      return "rate_limit_error";
    case 503:
      return "service_unavailable_error";
    default:
      return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

json error_body(int status, const std::string& message, const std::string& param, const std::string& code) {
  json e = {{"message", message},
            {"type", error_type_for_status(status)},
            {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code.empty() ? json(nullptr) : json(code)}};
  return json{{"error", std::move(e)}};
}

std::string dump_json(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

}  // namespace bg::frontend
