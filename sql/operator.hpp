// The DP SQL operator over the engine's MPI exchange (seed 003's two stages, docs/SQL.md):
//   read (each rank its byte range, partials per (user, group)) -> all-to-all by user -> merge, keep at
//   most k groups per user (keyed sample) -> all-to-all by group -> per-group DP aggregation and
//   partition selection -> rows gathered on rank 0, written atomically with the report.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

#include "shuffle/comm.hpp"
#include "sql/plan.hpp"
#include "src/config.hpp"

namespace dpstream::sql {

struct QueryJob {
  std::string text;  // the query as given (for the report)
  QueryPlan plan;
  std::string input;
  BadRowPolicy bad_rows = BadRowPolicy::Skip;
  std::optional<std::uint64_t> seed;  // test mode: a fixed secret (the output is not private)
  std::string public_groups;          // CSV of the listed groups (selection public)
  std::string out_dir;
  std::string ledger;             // charge this budget ledger for every window read, before reading (docs/LEDGER.md)
  std::int64_t noise_stream = 0;  // the keyed PRF's stream (releases of a schedule draw independent noise)
};

// Checks on this rank what can be checked before reading data (input header, columns, public groups file,
// output directory); throws InputError / QueryError / ConfigError. Every rank calls it before run_query.
void check_query_job(const QueryJob& job);
// The part of check_query_job that a caller repeats once it holds --out: result.csv or report.json there (or the
// files `names`) is refused.
void refuse_existing_outputs(const std::string& out_dir,
                             std::initializer_list<const char*> names = {"result.csv", "report.json"});

// Raw counters of a run (not DP), summed over ranks.
struct QueryCounters {
  std::uint64_t rows = 0, bad = 0, filtered_out = 0, kept = 0;
  std::uint64_t user_groups = 0, user_groups_dropped = 0, users = 0;
  std::uint64_t groups = 0, groups_released = 0;
  std::uint64_t user_groups_unlisted = 0;  // public selection: (user, group) pairs of unlisted groups
  std::string first_bad = {};  // rank 0: "line N: why" of the file's first bad row (what to fix), empty if none
  // Wall seconds of each stage on rank 0 (read includes id separation; the exchanges include waiting).
  double read_s = 0, by_user_s = 0, bound_s = 0, by_group_s = 0, release_s = 0, write_s = 0, total_s = 0;
};

// Runs the query (collective); rank 0 writes out_dir/result.csv and out_dir/report.json.
QueryCounters run_query(const QueryJob& job, const shuffle::Comm& comm);

}  // namespace dpstream::sql
