// The benchmark's RESULT line (`dpstream bench`): the engine path against the naive reference.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "shuffle/comm.hpp"
#include "src/run_summary.hpp"

namespace dpstream {

// Benchmark: times the naive single-threaded reference on rank 0, adds "naive_records_per_second"
// to `summary` and returns the RESULT line (collective).
std::string bench_result_line(const RunFigures& run, nlohmann::json& summary, const shuffle::Comm& comm);

}  // namespace dpstream
