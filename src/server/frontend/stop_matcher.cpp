// Stop-string matching: earliest match wins; the held-back tail is the longest suffix that is a stop-string prefix.
#include "server/frontend/stop_matcher.h"

#include <algorithm>
#include <utility>

namespace bg::frontend {

StopMatcher::StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}

std::string StopMatcher::push(std::string_view text) {
  if (stopped_) return "";
  pending_.append(text);
  if (stops_.empty()) return std::exchange(pending_, std::string());
  size_t best = std::string::npos;
  for (const std::string& s : stops_) {
    const size_t pos = pending_.find(s);
    if (pos != std::string::npos && (best == std::string::npos || pos < best)) {
      best = pos;
      matched_ = s;
    }
  }
  if (best != std::string::npos) {
    stopped_ = true;
    std::string out = pending_.substr(0, best);
    pending_.clear();
    return out;
  }
  // Longest k such that pending_ ends with the first k bytes of some stop string (k < that string's length).
  size_t hold = 0;
  for (const std::string& s : stops_) {
    const size_t max_k = std::min(s.size() - 1, pending_.size());
    for (size_t k = max_k; k > hold; --k) {
      if (pending_.compare(pending_.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
    }
  }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string StopMatcher::flush() {
  if (stopped_) return "";
  return std::exchange(pending_, std::string());
}

}  // namespace bg::frontend
