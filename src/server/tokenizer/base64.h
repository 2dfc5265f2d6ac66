// Standard base64 (RFC 4648, '+' '/', '=' padding) as used by tiktoken.model files.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace bg {

std::string base64_encode(std::string_view bytes);
// nullopt on any character outside the alphabet, a length that is not a multiple of 4, or misplaced padding.
std::optional<std::string> base64_decode(std::string_view text);

}  // namespace bg
