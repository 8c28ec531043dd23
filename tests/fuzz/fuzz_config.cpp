// Fuzzes the job spec (src/config.cpp): parse_job on TOML text with --set overrides, then, for a
// private mode, the privacy plan that `run` and `budget` build from it before reading any data
// (src/privacy_plan.cpp). A bad spec may only end in ConfigError.
// Input: the TOML text, then optional overrides ("section.key=value"), each after a NUL byte.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "src/config.hpp"
#include "src/errors.hpp"
#include "src/privacy_plan.hpp"

using namespace dpstream;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  std::size_t end = std::min(input.find('\0'), input.size());
  const std::string toml(input.substr(0, end));
  std::vector<std::string> overrides;
  while (end < input.size() && overrides.size() < 4) {
    const std::size_t next = std::min(input.find('\0', end + 1), input.size());
    overrides.emplace_back(input.substr(end + 1, next - end - 1));
    end = next;
  }
  try {
    const JobConfig config = parse_job(toml, "fuzz.toml", overrides);
    // Plans over a million triggers are valid but slow to build: the fuzzer's time goes elsewhere.
    if (is_private(config.privacy.mode) && config.stream.triggers <= 4096) {
      const PrivacyPlan plan = make_privacy_plan(config);
      if (is_baseline(plan.mode))
        (void)baseline_params(plan);
      else
        (void)release_params(plan);
      (void)budget_json(plan, false).dump();
      (void)budget_text(plan, false);
    }
  } catch (const ConfigError&) {
  }
  return 0;
}
