// Stop strings over streamed text: holds back a tail that could still become a stop string, trims the match out.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace bg::frontend {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);

  // Appends newly decoded text; returns the text that can be emitted now (everything before a match, or everything
  // except a tail that is a prefix of some stop string). After a match, stopped() is true and push returns "".
  std::string push(std::string_view text);
  // End of output without a match: the held-back tail.
  std::string flush();

  bool stopped() const { return stopped_; }
  const std::string& matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  std::string pending_;
  std::string matched_;
  bool stopped_ = false;
};

}  // namespace bg::frontend
