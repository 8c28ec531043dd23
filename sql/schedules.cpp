#include "sql/schedules.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "sql/growing.hpp"
#include "src/accounting.hpp"
#include "src/csv_input.hpp"
#include "src/durable_io.hpp"
#include "src/errors.hpp"
#include "src/output_lock.hpp"

namespace dpstream::sql {

namespace {

// The whole schedule's zCDP budget: rho at delta/2 when thresholds spend the other half.
struct ScheduleBudget {
  double rho = 0, delta_thresholds = 0, delta_conversion = 0;
};

ScheduleBudget schedule_budget(const QueryOptions& o) {
  const bool thresholds = o.selection != SelectionKind::Public;
  ScheduleBudget b;
  b.delta_conversion = thresholds ? o.delta / 2 : o.delta;
  b.delta_thresholds = thresholds ? o.delta / 2 : 0;
  b.rho = accounting::zcdp_rho_tight(o.epsilon, b.delta_conversion);
  return b;
}

// One run of a schedule: the base job with its windows, rho and threshold delta, into `dir`.
QueryJob scheduled_run(const QueryJob& base, double rho, double delta_selection, const std::string& dir,
                       std::int64_t stream) {
  QueryOptions o = base.plan.options;
  o.release_rho = rho, o.release_delta_selection = delta_selection;
  QueryJob job = base;
  try {
    job.plan = plan_query(base.plan.query, o);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
  job.out_dir = dir;
  job.noise_stream = stream;
  check_query_job(job);
  return job;
}

// Invalid UTF-8 (a --out or alias of other bytes) written as U+FFFD, as in report.json: a throw here came after every
// run had spent its share.
void write_json(const shuffle::Comm& comm, const std::string& dir, const char* name, const nlohmann::json& j) {
  if (comm.rank() == 0)
    write_file_atomically(std::filesystem::path(dir) / name,
                          j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
}

// Every file a schedule will write, refused before its first run spends anything (rank 0 looks): found at run i,
// one failed the schedule after runs 0 .. i - 1 had spent their shares, and an existing summary was replaced.
void refuse_existing_schedule_outputs(const std::string& out_dir, const char* summary,
                                      const std::vector<std::string>& run_dirs, const shuffle::Comm& comm) {
  namespace fs = std::filesystem;
  shuffle::on_all_ranks<ConfigError>(comm, [&] {
    if (comm.rank() != 0) return;
    refuse_existing_outputs(out_dir, {summary});
    for (const std::string& dir : run_dirs) {
      std::error_code ec;
      if (!fs::exists(dir, ec)) continue;  // made by its run
      if (!fs::is_directory(dir, ec))
        throw ConfigError(fmt::format("{} is not a directory; remove it or choose another --out", dir));
      refuse_unwritable_dir(dir, "make it writable, or choose another --out");
      refuse_existing_outputs(dir);
    }
  });
}

// The records of a CSV text: a line break inside a quoted field (an alias in the header, a group's value) is
// part of its field.
std::vector<std::string_view> csv_records(std::string_view text) {
  std::vector<std::string_view> records;
  bool quoted = false;
  std::size_t start = 0;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '"') quoted = !quoted;  // a doubled quote inside a field turns it off and on again
    if (text[i] == '\n' && !quoted) {
      records.push_back(text.substr(start, i - start));
      start = i + 1;
    }
  }
  if (start < text.size()) records.push_back(text.substr(start));
  return records;
}

// The first ANON_COUNT / ANON_COUNT(DISTINCT): its output column and noise sd.
struct TargetColumn {
  std::size_t column = 0;  // in result.csv
  double sd = 0;
};

TargetColumn target_column(const QueryPlan& plan) {
  const auto aggs = plan_json(plan)["aggregates"];
  std::size_t offset = plan.options.windows.per_window ? 1 : 0;
  for (std::size_t c = 0; c < plan.query.select.size(); ++c) {
    const SelectItem& it = plan.query.select[c];
    if (!it.is_aggregate) continue;
    const AggKind k = plan.query.aggregates[it.aggregate].kind;
    if (k == AggKind::Count || k == AggKind::CountDistinct)
      return {c + offset, aggs[it.aggregate]["noise_scale"][0].get<double>()};
  }
  throw ConfigError("an accuracy target needs an ANON_COUNT(...) in the query: its noisy count is what is judged");
}

// Rank 0 judges an attempt from its result.csv (DP outputs and the public noise scale only): with the
// union bound over the G released groups, every one has |noise| <= z sd except with probability beta_j, and
// then a group of true count >= min_count has relative error <= z sd / min_count.
struct Judgement {
  std::size_t released = 0, above = 0;  // groups released; of them, with noisy count >= min_count
  double z = 0, bound = 0;              // the bound z sd / min_count
  bool met = false;
};

Judgement judge(const std::string& dir, const TargetColumn& col, const AccuracyTarget& t, double beta_j) {
  const std::filesystem::path path = std::filesystem::path(dir) / "result.csv";
  const MappedFile file(path.string());
  const std::vector<std::string_view> records = csv_records(file.view());
  Judgement j;
  std::vector<std::string> fields;
  for (std::size_t r = 1; r < records.size(); ++r) {  // records[0]: the header
    double count = 0;
    if (!split_csv_line(records[r], fields) || col.column >= fields.size() ||
        parse_finite_number(fields[col.column], count) != NumberCheck::Ok)
      throw std::logic_error(fmt::format("{}: row {} is not as the query wrote it", path.string(), r));
    ++j.released;
    if (count >= t.min_count) ++j.above;
  }
  j.z = accounting::normal_upper_quantile(beta_j / (2.0 * static_cast<double>(std::max<std::size_t>(1, j.released))));
  j.bound = j.z * col.sd / t.min_count;
  j.met = j.bound <= t.relative_error;
  return j;
}

}  // namespace

ScheduleResult run_growing(const QueryJob& base, double gamma, std::int64_t first_length, const shuffle::Comm& comm) {
  const QueryOptions& o = base.plan.options;
  if (!o.windows.active() || !o.windows.first)
    throw ConfigError("--growing needs --window-column and --windows A:B (the stream's windows so far)");
  if (!base.ledger.empty())
    throw ConfigError(
        "--growing with --ledger: a schedule's privacy unit is the user over the whole stream, not "
        "one block; drop --ledger");
  const ScheduleBudget b = schedule_budget(o);
  std::vector<GrowingRelease> schedule;
  try {
    schedule = growing_schedule(gamma, *o.windows.first, *o.windows.last, first_length, b.rho, b.delta_thresholds);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
  std::vector<std::string> dirs;
  dirs.reserve(schedule.size());
  for (const GrowingRelease& r : schedule) dirs.push_back(fmt::format("{}/release-{}", base.out_dir, r.index));
  refuse_existing_schedule_outputs(base.out_dir, "schedule.json", dirs, comm);
  nlohmann::json releases = nlohmann::json::array();
  QueryCounters c;
  for (std::size_t i = 0; i < schedule.size(); ++i) {
    const GrowingRelease& r = schedule[i];
    QueryJob job = base;
    job.plan.options.windows.first = r.first_window, job.plan.options.windows.last = r.last_window;
    job = scheduled_run(job, r.rho, r.delta_selection, dirs[i], r.index + 1);
    c = run_query(job, comm);
    releases.push_back({{"release", r.index},
                        {"windows", {r.first_window, r.last_window}},
                        {"rho", r.rho},
                        {"weight", growing_weight(r.index, gamma)},
                        {"delta_selection", r.delta_selection},
                        {"rho_spent", job.plan.rho_total},
                        {"groups_released_not_dp", c.groups_released},
                        {"dir", job.out_dir}});
  }
  nlohmann::json out = {
      {"gamma", gamma},
      {"first_length", first_length},
      {"epsilon", o.epsilon},
      {"delta", o.delta},
      {"rho_schedule", b.rho},
      {"delta_thresholds_schedule", b.delta_thresholds},
      {"delta_conversion", b.delta_conversion},
      {"note",
       "the weights sum to 1 over every release i >= 0, these and all later ones: the whole stream's releases are "
       "(epsilon, delta)-DP for each user"},
      {"releases", releases}};
  write_json(comm, base.out_dir, "schedule.json", out);
  return {std::move(out), std::move(c)};
}

ScheduleResult run_adaptive(const QueryJob& base, const AccuracyTarget& t, const shuffle::Comm& comm) {
  if (!(t.relative_error > 0) || !(t.beta > 0 && t.beta < 1) || !(t.min_count >= 1) || t.first_share_log2 < 0 ||
      t.first_share_log2 > 20)
    throw ConfigError(
        "--target-error must be > 0, --target-beta in (0, 1), --target-min-count >= 1, "
        "--target-first-share-log2 in [0, 20]");
  const ScheduleBudget b = schedule_budget(base.plan.options);
  const int n = t.first_share_log2;
  std::vector<std::string> dirs;
  dirs.reserve(static_cast<std::size_t>(n) + 1);
  for (int j = 0; j <= n; ++j) dirs.push_back(fmt::format("{}/attempt-{}", base.out_dir, j));
  refuse_existing_schedule_outputs(base.out_dir, "adaptive.json", dirs, comm);
  nlohmann::json attempts = nlohmann::json::array();
  std::string stop = "budget spent: the target was not met with the whole budget";
  double spent = 0;
  std::string final_dir;
  QueryCounters c;
  for (int j = 0; j <= n; ++j) {
    const double rho_j = b.rho * std::ldexp(1.0, j == 0 ? -n : -(n + 1 - j));  // cumulative: rho 2^-(n - j)
    const double delta_j = b.delta_thresholds * std::ldexp(1.0, -(j + 1));
    const double beta_j = t.beta * std::ldexp(1.0, -(j + 1));
    const QueryJob job = scheduled_run(base, rho_j, delta_j, dirs[static_cast<std::size_t>(j)], j + 1);
    const TargetColumn col = target_column(job.plan);
    c = run_query(job, comm);
    spent += job.plan.rho_total;
    final_dir = job.out_dir;
    Judgement verdict;  // a failure on rank 0 stops every rank (no rank left in the broadcast)
    shuffle::on_all_ranks<std::runtime_error>(comm, [&] {
      if (comm.rank() == 0) verdict = judge(job.out_dir, col, t, beta_j);
    });
    comm.broadcast(&verdict.met, sizeof verdict.met);
    attempts.push_back({{"attempt", j},
                        {"rho", rho_j},
                        {"rho_spent_so_far", spent},
                        {"count_noise_sd", col.sd},
                        {"groups_released", verdict.released},
                        {"groups_with_noisy_count_above_min", verdict.above},
                        {"z", verdict.z},
                        {"relative_error_bound", verdict.bound},
                        {"met", verdict.met},
                        {"dir", job.out_dir}});
    if (verdict.met) {
      stop = fmt::format("target met at attempt {}", j);
      break;
    }
  }
  const double delta_used = b.delta_conversion + b.delta_thresholds;
  nlohmann::json out = {
      {"target",
       {{"relative_error", t.relative_error},
        {"min_count", t.min_count},
        {"beta", t.beta},
        {"claim",
         "with probability >= 1 - beta, every group of the final attempt whose noisy count is >= min_count "
         "has |released - true| <= relative_error * true (judged from DP outputs only)"}}},
      {"budget", {{"epsilon", base.plan.options.epsilon}, {"delta", base.plan.options.delta}, {"rho", b.rho}}},
      {"spent",
       {{"rho", spent},
        {"share", spent / b.rho},
        {"epsilon", spent > 0 ? accounting::zcdp_eps_tight(spent, b.delta_conversion) : 0.0},
        {"delta", delta_used}}},
      {"stopped", stop},
      {"final", final_dir},
      {"attempts", attempts}};
  write_json(comm, base.out_dir, "adaptive.json", out);
  return {std::move(out), std::move(c)};
}

}  // namespace dpstream::sql
