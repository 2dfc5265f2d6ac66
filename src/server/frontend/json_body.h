// Request bodies -> JSON with bounds: a nesting limit (a 400 naming the field where it is exceeded), numbers that do
// not fit a double refused, parse errors described without library internals. The DOM is built iteratively (SAX), so
// no client value can overflow the stack here, and every later recursive walk (dump, copy) is bounded by the limit.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace bg::frontend {

// Deepest nesting a request may use: the body object is level 1, so {"tools": [{"function": {"parameters": {...}}}]}
// reaches level 5 at "parameters". Real JSON Schemas nest far less than this.
inline constexpr size_t kMaxJsonDepth = 128;

// Parses `text` into any JSON value. Throws ApiError(400): malformed JSON or UTF-8 (message with line and column),
// a number out of range, or nesting deeper than `max_depth` (param = the path of the container that is too deep, as
// "tools[0].function.parameters.properties.a").
nlohmann::json parse_json_bounded(std::string_view text, size_t max_depth = kMaxJsonDepth);
// The same with objects in document order (a repeated key keeps its first position and its last value).
nlohmann::ordered_json parse_json_bounded_ordered(std::string_view text, size_t max_depth = kMaxJsonDepth);

// "[json.exception.parse_error.101] parse error at ..." -> "parse error at ...".
std::string strip_json_exception_prefix(const std::string& what);

}  // namespace bg::frontend
