#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>

namespace dpstream {
// Peak resident set size of this process, in bytes (getrusage).
std::uint64_t peak_rss_bytes();

// One `RESULT key=value ...` line of a run's summary.json for the scaling drivers (slurm/):
// throughput, seconds per trigger by stage (max over ranks), shuffle bytes per record, peak memory.
std::string run_result_line(const nlohmann::json& summary);
}  // namespace dpstream
