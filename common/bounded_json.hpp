// JSON read from a file a user or an adversary may have written (a checkpoint's manifest, a run's summary.json):
// nesting deeper than kMaxJsonDepth is refused while it is parsed. nlohmann's parser keeps its own stack, but dump()
// and the conversions recurse once a level: a manifest of 200 000 nested arrays crashed `run --resume` with SIGSEGV.
#pragma once

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <string_view>

namespace dpstream {

inline constexpr int kMaxJsonDepth = 64;  // the project's own files nest 4 levels at most

// Throws nlohmann::json::parse_error on invalid JSON, std::invalid_argument on nesting deeper than kMaxJsonDepth.
inline nlohmann::json parse_bounded_json(std::string_view text) {
  return nlohmann::json::parse(
      text.begin(), text.end(), [](int depth, nlohmann::json::parse_event_t /*event*/, nlohmann::json& /*parsed*/) {
        if (depth > kMaxJsonDepth)
          throw std::invalid_argument("JSON nested deeper than " + std::to_string(kMaxJsonDepth) + " levels");
        return true;
      });
}

}  // namespace dpstream
