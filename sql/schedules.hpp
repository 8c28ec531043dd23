// Queries run several times under one budget: cumulative releases on a growing stream (seed 004's
// BBScheduler, sql/growing.hpp) and the accuracy-targeted release (Sage's privacy-adaptive release,
// Lecuyer et al., SOSP 2019, arXiv 1909.01502, section 3.3). Each run is one `run_query` with its own
// zCDP share and its own noise stream; the budget of all runs together is the query's (eps, delta).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>

#include "shuffle/comm.hpp"
#include "sql/operator.hpp"

namespace dpstream::sql {

// What a schedule of runs returns: rank 0's summary (the file it wrote) and its last run's raw counters (each run
// reads the same table, so the bad rows are the same in every run).
struct ScheduleResult {
  nlohmann::json summary;
  QueryCounters last_run;
};

// Release i over windows A .. A + L_i - 1 into OUT/release-i; rank 0 writes OUT/schedule.json (returned).
ScheduleResult run_growing(const QueryJob& base, double gamma, std::int64_t first_length, const shuffle::Comm& comm);

// The target of an accuracy-targeted release, judged on the query's first ANON_COUNT from DP outputs only:
// every released group whose true count is at least min_count has a relative error at most r. Attempt j
// meets it when z sigma_j <= r min_count, z = Phi^-1(1 - beta_j / (2 G_j)) over its G_j released groups,
// beta_j = beta 2^-(j + 1) (so the claim holds with probability >= 1 - beta over all attempts together).
struct AccuracyTarget {
  double relative_error = 0.1;
  double min_count = 100;
  double beta = 0.05;
  int first_share_log2 = 4;  // attempt 0 spends rho 2^-4; each later attempt doubles the total spent
};

// Attempts j = 0, 1, ... into OUT/attempt-j, rho_j = rho 2^-n for j = 0 and rho 2^-(n+1-j) after, so that
// the rho spent after attempt j is rho 2^-(n-j); stops when the target is met or rho is spent. Rank 0
// writes OUT/adaptive.json (returned): every attempt, its cost, its judgement, why it stopped.
ScheduleResult run_adaptive(const QueryJob& base, const AccuracyTarget& target, const shuffle::Comm& comm);

}  // namespace dpstream::sql
