// The benchmark's RESULT line (`dpstream bench`): the engine path's rate, stages, shuffle bytes and memory.
// No naive program is timed here: the yardstick is jobs/bench-whole-job.sh (the whole job against
// tests/bench/naive_job.cpp, side by side). The test oracle tools/naive_reference.cpp is no yardstick: it
// keeps a std::map of sets per trigger, ran 148 k records/s on the 10 M-user workload and its tables set
// rank 0's peak RSS (4.9 GB against the engine's 0.27 GB).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shuffle/comm.hpp"
#include "src/run_summary.hpp"

namespace dpstream {

// Returns the RESULT line (collective: peak RSS and state are the max over ranks).
std::string bench_result_line(const RunFigures& run, nlohmann::json& summary, const shuffle::Comm& comm);

// One repeat of `dpstream bench --repeats N`, read from its summary.json (rank 0).
struct BenchRepeat {
  double engine_seconds = 0;
  double records_per_s_per_core = 0;
};
BenchRepeat bench_repeat(const std::string& summary_json, int cores);

// The repeats' spread, one line: on a shared host the same binary's rate moves by a third between minutes, so the
// fastest repeat (the least disturbed) and the median are printed together. At least one repeat.
std::string bench_repeats_line(const std::string& job, int ranks, int threads, const std::vector<BenchRepeat>& runs);

}  // namespace dpstream
