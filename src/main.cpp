// dpstream command line: run | bench | generate | budget | evaluate | choose-c | ledger | query. Runs under mpirun /
// srun. Exit codes: 0 ok, 1 unexpected failure, 2 bad job spec or option, 3 bad input, 4 unusable checkpoint, 5 stopped
// cleanly by SIGTERM / SIGUSR1 (resume with --resume).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <malloc.h>
#include <omp.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <string_view>

#include "common/fault_injection.hpp"
#include "dpstream_version.hpp"
#include "shuffle/comm.hpp"
#include "sql/operator.hpp"
#include "sql/query.hpp"
#include "sql/query_spec.hpp"
#include "sql/schedules.hpp"
#include "src/config.hpp"
#include "src/durable_io.hpp"
#include "src/engine.hpp"
#include "src/errors.hpp"
#include "src/omp_threads.hpp"
#include "src/output_lock.hpp"
#include "src/privacy_plan.hpp"
#include "src/stop_request.hpp"
#include "src/workload.hpp"
#include "tools/bench_result.hpp"
#include "tools/choose_c.hpp"
#include "tools/evaluate.hpp"
#include "tools/ledger_report.hpp"

namespace {

// An option that turns a mechanism on with its value: a finite number > 0 (0, a negative value or NaN must not
// quietly mean "off", which is what the command does without the option).
const CLI::Validator kPositiveFinite(
    [](std::string& text) {
      double v = 0;
      if (!CLI::detail::lexical_cast(text, v) || !std::isfinite(v) || v <= 0)
        return std::string("must be a finite number > 0 (got ") + text + ")";
      return std::string();
    },
    "NUMBER > 0");

// A whole number of type T, all of the text (CLI11's strtoull took "-1" for 2^64 - 1 and clamped 2^64 and beyond
// to it, so that different seeds gave one output; strtoll clamped beyond int64 without a word).
template <class T>
CLI::Validator whole_number(const char* range, const char* name) {
  return CLI::Validator(
      [range](std::string& text) {
        T v = 0;
        const char* end = text.data() + text.size();
        const auto [at, ec] = std::from_chars(text.data(), end, v);
        if (text.empty() || ec != std::errc() || at != end)
          return "must be a whole number in " + std::string(range) + " (got " + text + ")";
        return std::string();
      },
      name);
}
// A real number, all of the text: CLI11 read an empty --epsilon "" as 0 and an empty --trigger "" as no option at all.
// Ranges are the commands' own checks, which say what to change.
const CLI::Validator kNumber(
    [](std::string& text) {
      double v = 0;
      if (text.empty() || !CLI::detail::lexical_cast(text, v)) return "must be a number (got '" + text + "')";
      return std::string();
    },
    "NUMBER");
const CLI::Validator kSeed = whole_number<std::uint64_t>("[0, 2^64 - 1]", "SEED");
const CLI::Validator kUint32 = whole_number<std::uint32_t>("[0, 2^32 - 1]", "UINT32");
const CLI::Validator kInt64 = whole_number<std::int64_t>("[-2^63, 2^63 - 1]", "INT64");
// A ledger path given on the command line: an empty one (an unset shell variable) would silently charge nothing.
const CLI::Validator kLedgerPath(
    [](std::string& p) {
      return p.empty() ? "the ledger's path is empty: give the ledger file (dpstream ledger init PATH ...), or drop "
                         "the option"
                       : "";
    },
    "PATH");

using dpstream::kExitCheckpoint;
using dpstream::kExitConfig;
using dpstream::kExitInput;
using dpstream::kExitOther;
using dpstream::kExitStopped;

struct JobArgs {
  std::string command;  // run, bench, ... (for messages)
  std::string spec;
  bool demo = false;
  std::vector<std::string> overrides;
  std::string out;
  const CLI::Option* out_option = nullptr;  // given on the command line (an empty --out is refused, not ignored)
  std::string progress;
};

void add_job_args(CLI::App* cmd, JobArgs& a) {
  a.command = cmd->get_name();
  cmd->add_option("job", a.spec, "Job spec (TOML), e.g. jobs/demo.toml");
  cmd->add_flag("--demo", a.demo, "Use the built-in demo job (small synthetic stream) instead of a file");
  cmd->add_option("--set", a.overrides,
                  "Override a job key: --set section.key=value (repeatable), e.g. --set input.users=1000")
      ->allow_extra_args(false);
  a.out_option = cmd->add_option("--out", a.out, "Output directory (overrides [output] dir)");
  cmd->add_option("--progress", a.progress, "Progress lines on rank 0: always | auto (only on a terminal) | never")
      ->check(CLI::IsMember(dpstream::enum_names<dpstream::ProgressMode>()));
}

dpstream::JobConfig load(const JobArgs& a) {
  if (a.demo && !a.spec.empty()) throw dpstream::ConfigError("give either a job spec or --demo, not both");
  if (!a.demo && a.spec.empty())
    throw dpstream::ConfigError(fmt::format("no job spec given: dpstream {} JOB.toml (or --demo)", a.command));
  auto config = a.demo ? dpstream::parse_job(dpstream::demo_job_toml(), "built-in demo", a.overrides)
                       : dpstream::load_job(a.spec, a.overrides);
  // Paths and choices from options are taken verbatim (never re-parsed as TOML).
  if (a.out_option != nullptr && a.out_option->count() > 0) {
    if (a.out.empty())
      throw dpstream::ConfigError("--out is empty: give the output directory, or drop --out to use [output] dir");
    config.output.dir = a.out;
  }
  if (!a.progress.empty()) config.output.progress = *dpstream::parse_enum<dpstream::ProgressMode>(a.progress);
  return config;
}

void print_warning(const std::string& warning, bool root) {
  if (root && !warning.empty()) std::fprintf(stderr, "dpstream: warning: %s\n", warning.c_str());
}

// The synthetic input's users are known before it is read; a CSV file's are not.
void warn_of_large_delta(const dpstream::JobConfig& config, bool root) {
  if (!dpstream::is_private(config.privacy.mode)) return;
  const bool synthetic = config.input.kind == dpstream::InputKind::Synthetic;
  print_warning(dpstream::large_delta_warning(config.privacy.delta, synthetic ? config.input.users : 0), root);
}

// A clean stop on a signal: rank 0 says where it stopped and how to continue.
bool stopped(const dpstream::RunReport& report, bool root) {
  if (root && report.stop_signal) std::fprintf(stderr, "%s\n", report.stop_message.c_str());
  return report.stop_signal != 0;
}

// A tool's result on stdout: its JSON (--json) or its text; only the chosen form is built.
template <class Json, class Text>
void print_result(bool as_json, Json&& json, Text&& text) {
  std::fputs(as_json ? (json().dump(2) + "\n").c_str() : text().c_str(), stdout);
}

// Writes the synthetic stream as CSV (user_id,key,value,timestamp) in stream order. It goes to `path`.tmp, made
// exclusively, and is published once complete by link(2), which never replaces a file: an interrupted or failed
// run leaves no file that looks whole, and no existing file (`path` or `path`.tmp) is ever overwritten.
void generate_csv(const dpstream::JobConfig& config, const std::string& path) {
  const auto exists_already = [&] {
    return dpstream::ConfigError(
        fmt::format("{} exists already; remove it or choose another --csv (nothing is overwritten)", path));
  };
  std::error_code ec;
  if (std::filesystem::exists(path, ec)) throw exists_already();  // before the work; link(2) below decides
  const std::string partial = path + ".tmp";
  if (const int err = dpstream::create_new_file(partial, 0644); err != 0)
    throw dpstream::ConfigError(
        err == EEXIST ? fmt::format("{} exists (another generate writing, or one that failed); remove it, or "
                                    "choose another --csv (nothing is overwritten)",
                                    partial)
                      : fmt::format("cannot create {}: {}; choose a --csv path in a writable directory", partial,
                                    dpstream::errno_text(err)));
  try {
    std::ofstream out(partial);
    out << "user_id,key,value,timestamp\n";
    dpstream::SyntheticSource source(config, 0, 1);
    for (std::uint32_t w = 0; w < config.stream.windows; ++w)
      for (std::uint32_t t = 0; t < config.stream.triggers; ++t) {
        auto records = source.take_trigger(config.stream.first_window + w, t);
        std::sort(records.begin(), records.end(), dpstream::stream_order_less);
        for (const auto& r : records) out << r.user << ',' << r.key << ',' << r.value << ',' << r.timestamp << '\n';
      }
    out.close();
    if (!out)
      throw dpstream::ConfigError(
          fmt::format("cannot write {}: {}{}", partial, dpstream::errno_text(errno),
                      dpstream::free_space_note(std::filesystem::path(partial).parent_path(), "")));
    if (::link(partial.c_str(), path.c_str()) != 0) {
      if (errno == EEXIST) throw exists_already();
      throw dpstream::ConfigError(fmt::format("cannot create {}: {}", path, dpstream::errno_text(errno)));
    }
  } catch (...) {
    ::unlink(partial.c_str());
    throw;
  }
  ::unlink(partial.c_str());
}

// run_job; a run refused before it wrote anything (a ledger's refusal, a bad input) removes the --out it made.
dpstream::RunReport run_removing_a_refused_out(const dpstream::JobConfig& config, const dpstream::shuffle::Comm& comm,
                                               const dpstream::RunOptions& options, bool root) {
  std::error_code ec;
  const bool made_out = root && !std::filesystem::exists(config.output.dir, ec);
  try {
    return dpstream::run_job(config, comm, options);
  } catch (...) {
    if (made_out && std::filesystem::is_empty(config.output.dir, ec)) std::filesystem::remove(config.output.dir, ec);
    throw;
  }
}

// A subcommand: its options (add) and what it does once they are parsed (exec, on every rank; the
// exit code). Each CLI::App keeps references into its command's fields, so commands are not moved.
struct RunCommand {
  JobArgs args;
  bool resume = false, fresh = false, result_line = false;
  CLI::App* cmd = nullptr;
  void add(CLI::App& app) {
    cmd = app.add_subcommand("run", "Run a job: DIR/releases.csv (window,trigger,key,count,sum) and DIR/summary.json");
    add_job_args(cmd, args);
    auto* resume_flag =
        cmd->add_flag("--resume", resume,
                      "Continue from the last committed checkpoint in DIR/checkpoint (any rank count); the "
                      "output equals an uninterrupted run");
    cmd->add_flag("--fresh", fresh, "Discard the checkpoint and output in DIR and start over")->excludes(resume_flag);
    cmd->add_flag(
        "--result", result_line,
        "Also print a RESULT line (throughput, ms per trigger by stage, shuffle bytes per record, peak memory) "
        "for the scaling drivers in slurm/");
  }
  int exec(const dpstream::shuffle::Comm& comm, bool root) const {
    const auto config = load(args);
    warn_of_large_delta(config, root);
    dpstream::RunOptions options;
    options.start_mode = resume  ? dpstream::checkpoint::StartMode::Resume
                         : fresh ? dpstream::checkpoint::StartMode::Fresh
                                 : dpstream::checkpoint::StartMode::Start;
    const auto report = run_removing_a_refused_out(config, comm, options, root);
    if (stopped(report, root)) return kExitStopped;
    if (root && report.already_complete) {
      std::printf("dpstream: job '%s' is already complete in %s; nothing to do\n  releases: %s\n", config.name.c_str(),
                  config.output.dir.c_str(), report.releases_path.c_str());
    } else if (root) {
      std::printf("dpstream: %s finished on %d rank(s) x %d thread(s)\n", config.name.c_str(), comm.size(),
                  omp_get_max_threads());
      std::printf("  releases: %s\n  summary:  %s/summary.json\n", report.releases_path.c_str(),
                  config.output.dir.c_str());
      if (result_line) std::printf("%s\n", report.run_result_line.c_str());
    }
    if (root && !report.skipped_rows_message.empty()) std::fprintf(stderr, "%s\n", report.skipped_rows_message.c_str());
    return 0;
  }
};

struct BenchCommand {
  JobArgs args;
  int repeats = 1;
  CLI::App* cmd = nullptr;
  void add(CLI::App& app) {
    cmd = app.add_subcommand(
        "bench",
        "Time the engine path (shuffles, bounding, accumulation, release; no generation, output or checkpoints) and "
        "print a RESULT line; jobs/bench-whole-job.sh times a whole job against the naive program");
    add_job_args(cmd, args);
    cmd->add_option("--repeats", repeats,
                    "Time the engine path this many times (the stream generated afresh each time) and print a "
                    "RESULT_REPEATS line with the fastest, median and slowest")
        ->check(CLI::Range(1, 1000));
  }
  int exec(const dpstream::shuffle::Comm& comm, bool root) const {
    auto config = load(args);
    if (config.input.kind != dpstream::InputKind::Synthetic)
      throw dpstream::ConfigError("bench needs [input] kind = \"synthetic\"");
    // A benchmark reads synthetic data and releases nothing: it charges no ledger (each repeat would be charged).
    config.privacy.ledger.clear();
    const int threads = omp_get_max_threads();
    std::vector<dpstream::BenchRepeat> runs;
    for (int i = 0; i < repeats; ++i) {
      const auto report =
          dpstream::run_job(config, comm, {.write_output = false, .bench_line = dpstream::bench_result_line});
      if (stopped(report, root)) return kExitStopped;
      if (!root) continue;
      std::printf("%s\n", report.result_line.c_str());
      std::fflush(stdout);  // each repeat's line as it ends: a long series shows its progress
      runs.push_back(dpstream::bench_repeat(report.summary_json, comm.size() * threads));
    }
    if (root && repeats > 1)
      std::printf("%s\n", dpstream::bench_repeats_line(config.name, comm.size(), threads, runs).c_str());
    return 0;
  }
};

struct GenerateCommand {
  JobArgs args;
  std::string csv;
  CLI::App* cmd = nullptr;
  void add(CLI::App& app) {
    cmd = app.add_subcommand("generate", "Write a job's synthetic stream as CSV (rank 0)");
    add_job_args(cmd, args);
    cmd->add_option("--csv", csv, "Output CSV file")
        ->required()
        ->check(CLI::Validator(
            [](std::string& p) {
              return p.empty() ? "is empty: give the CSV file to write, e.g. --csv stream.csv" : "";
            },
            "FILE"));
  }
  int exec(const dpstream::shuffle::Comm& /*comm*/, bool root) const {
    // --out (an output directory) comes with the job options, but generate writes its one file to --csv.
    if (args.out_option != nullptr && args.out_option->count() > 0)
      throw dpstream::ConfigError("generate writes --csv FILE only: drop --out (give the file's path to --csv)");
    const auto config = load(args);
    if (config.input.kind != dpstream::InputKind::Synthetic)  // on every rank: all exit alike
      throw dpstream::ConfigError(
          "generate writes a synthetic job's stream, and this job reads a CSV file ([input] "
          "kind = \"csv\"): give a job with [input] kind = \"synthetic\"");
    if (root) generate_csv(config, csv);
    return 0;
  }
};

struct BudgetCommand {
  JobArgs args;
  bool as_json = false, thresholds = false;
  CLI::App* cmd = nullptr;
  void add(CLI::App& app) {
    cmd = app.add_subcommand(
        "budget",
        "Print a DP job's privacy accounting (rho and sigma per tree family, thresholds, eps by the tight and "
        "simple conversions, delta terms, total vs budget) without reading data; refuses a job over budget");
    add_job_args(cmd, args);
    cmd->add_flag("--json", as_json, "Print JSON instead of text");
    cmd->add_flag("--thresholds", thresholds, "Also print tau for every round step 1..T");
  }
  int exec(const dpstream::shuffle::Comm& /*comm*/, bool root) const {
    const auto config = load(args);
    const auto plan = dpstream::make_privacy_plan(config);
    // [privacy] ledger: whether it would admit the job now, asked as run asks it (nothing charged). Reported, not an
    // exit code: the verdict depends on the jobs admitted so far, the exit code on the spec alone.
    nlohmann::json ledger;
    if (!config.privacy.ledger.empty() && root) {
      ledger = {{"path", config.privacy.ledger},
                {"note", "nothing charged; jobs admitted before this one starts spend first"}};
      try {
        const auto request = dpstream::job_ledger_request(config, plan, "budget: a preview, never charged");
        const auto a =
            dpstream::ledger::preview_admission(config.privacy.ledger, config.stream.window_seconds, request);
        ledger["admits_now"] = a.outcome != dpstream::ledger::Outcome::Refused;
        if (a.outcome == dpstream::ledger::Outcome::Refused) ledger["refusal"] = a.message;
      } catch (const std::exception& e) {
        ledger["admits_now"] = false;
        ledger["refusal"] = e.what();
      }
    }
    if (root)
      print_result(
          as_json,
          [&] {
            nlohmann::json j = dpstream::budget_json(plan, thresholds);
            if (!ledger.is_null()) j["ledger"] = ledger;
            return j;
          },
          [&] {
            std::string text = dpstream::budget_text(plan, thresholds);
            if (ledger.is_null()) return text;
            return text + (ledger["admits_now"].get<bool>()
                               ? fmt::format("ledger {}: would admit the job now (nothing charged; jobs admitted "
                                             "before this one starts spend first)\n",
                                             config.privacy.ledger)
                               // The refusal names the ledger itself.
                               : fmt::format("would refuse the job now: {}\n", ledger["refusal"].get<std::string>()));
          });
    return 0;
  }
};

struct EvaluateCommand {
  dpstream::EvaluateOptions opts;
  std::string column = "count";
  bool as_json = false, every_trigger = false;
  CLI::App* cmd = nullptr;
  void add(CLI::App& app) {
    cmd = app.add_subcommand(
        "evaluate",
        "Error of a released histogram stream against the truth (a mode \"none\" run of the same stream) over "
        "the whole key space: keys released, linf, l1, l2 at every trigger of a window (rank 0)");
    cmd->add_option("--truth", opts.truth_dir, "Output directory of the mode \"none\" run (releases.csv, summary.json)")
        ->required();
    cmd->add_option("--released", opts.released_dir, "Output directory of the run to evaluate (dp or a baseline)")
        ->required();
    cmd->add_option("--window", opts.window, "Window (default: the last window of the truth file)")->check(kInt64);
    cmd->add_option("--trigger", opts.trigger, "Trigger of that window (default: its last trigger)")->check(kInt64);
    cmd->add_option("--column", column, "Released column to evaluate: count | sum (default count)")
        ->check(CLI::IsMember({"count", "sum"}));
    cmd->add_flag("--per-trigger", every_trigger, "Print every trigger in the table (default: about 10 and the last)");
    cmd->add_flag("--json", as_json, "Print one JSON object instead of text");
  }
  int exec(const dpstream::shuffle::Comm& /*comm*/, bool root) {
    opts.column = column == "sum" ? dpstream::EvalColumn::Sum : dpstream::EvalColumn::Count;
    if (root) {
      const auto result = dpstream::evaluate(opts);
      print_result(
          as_json, [&] { return dpstream::evaluate_json(result); },
          [&] { return dpstream::evaluate_text(result, every_trigger); });
    }
    return 0;
  }
};

struct ChooseCCommand {
  std::string spec;
  std::vector<std::string> overrides;
  dpstream::ChooseCOptions opts;
  bool as_json = false;
  CLI::App* cmd = nullptr;
  void add(CLI::App& app) {
    cmd = app.add_subcommand(
        "choose-c",
        "Choose the contribution bound C ([privacy] max_records_per_user) with DP: the q-quantile of the "
        "per-user record counts in one window of the job's input, released with discrete Gaussian noise "
        "(docs/CHOOSING-C.md)");
    cmd->add_option("job", spec, "Job spec (TOML) whose input is measured, e.g. jobs/paper-workload-dp.toml")
        ->required();
    cmd->add_option("--set", overrides, "Override a job key: --set section.key=value (repeatable)")
        ->allow_extra_args(false);
    cmd->add_option("--epsilon", opts.epsilon, "Epsilon spent on this release (> 0)")->required()->check(kNumber);
    cmd->add_option("--delta", opts.delta, "Delta spent on this release, in (0, 1)")->required()->check(kNumber);
    cmd->add_option("--quantile", opts.quantile, "Quantile q of the per-user counts, in (0, 1) (default 0.99)")
        ->check(kNumber);
    cmd->add_option("--max-c", opts.max_c, "Largest C considered, 1..1000000 (default 1000)")->check(kInt64);
    cmd->add_option("--window", opts.window, "Window measured (default: the job's first window)")->check(kInt64);
    cmd->add_option("--seed", opts.seed, "Noise secret from this seed: tests only, the output is NOT private")
        ->check(kSeed);
    cmd->add_option("--ledger", opts.ledger,
                    "Charge this budget ledger for the window before reading it (default: the job's [privacy] "
                    "ledger; docs/LEDGER.md)")
        ->check(kLedgerPath);
    cmd->add_flag("--json", as_json, "Print one JSON object instead of text");
  }
  int exec(const dpstream::shuffle::Comm& comm, bool root) const {
    const auto result = dpstream::choose_c(spec, overrides, opts, comm);
    if (root)
      print_result(
          as_json, [&] { return dpstream::choose_c_json(result); }, [&] { return dpstream::choose_c_text(result); });
    return 0;
  }
};

// dpstream ledger init | show | explain | retire: the budget ledger shared by jobs (src/ledger.hpp).
struct LedgerCommand {
  std::string path;
  dpstream::ledger::Ceiling ceiling{0, 0, 86400};
  std::int64_t through = 0;
  bool as_json = false;
  CLI::App *cmd = nullptr, *init = nullptr, *show = nullptr, *explain = nullptr, *retire = nullptr;
  void add(CLI::App& app) {
    cmd = app.add_subcommand("ledger",
                             "A privacy budget ledger shared by the jobs that read a stream: a ceiling per block "
                             "(event-time window), charged by every job with [privacy] ledger (docs/LEDGER.md)");
    cmd->require_subcommand(1);
    init = cmd->add_subcommand("init", "Create a ledger: the ceiling (epsilon, delta) of every block");
    init->add_option("path", path, "The ledger file (SQLite), e.g. /shared/stream.ledger")
        ->required()
        ->check(kLedgerPath);
    init->add_option("--epsilon", ceiling.epsilon, "Ceiling epsilon per block (> 0)")->required()->check(kNumber);
    init->add_option("--delta", ceiling.delta, "Ceiling delta per block, in (0, 1)")->required()->check(kNumber);
    init->add_option("--block-seconds", ceiling.block_seconds,
                     "Block length: the jobs' [stream] window_seconds (default 86400)")
        ->check(kInt64);
    show = cmd->add_subcommand("show", "Per block: what was spent and what remains");
    explain = cmd->add_subcommand("explain", "Per block: every charge (job, time, mechanism, rho or epsilon/delta)");
    retire = cmd->add_subcommand("retire", "Retire every block up to a window: no job may read it again");
    for (auto* sub : {show, explain, retire})
      sub->add_option("path", path, "The ledger file")->required()->check(kLedgerPath);
    for (auto* sub : {show, explain}) sub->add_flag("--json", as_json, "Print one JSON object instead of text");
    retire->add_option("--through", through, "The last window retired")->required()->check(kInt64);
  }
  int exec(const dpstream::shuffle::Comm& /*comm*/, bool root) {
    if (!root) return 0;  // one process touches the file
    try {
      if (init->parsed()) {
        dpstream::ledger::init(path, ceiling);
        std::printf("dpstream: ledger %s created: ceiling per block (epsilon, delta) = (%g, %g), blocks of %lld s\n",
                    path.c_str(), ceiling.epsilon, ceiling.delta, static_cast<long long>(ceiling.block_seconds));
        return 0;
      }
      dpstream::ledger::Ledger book(path);
      if (retire->parsed()) {
        const std::optional<std::int64_t> before = book.retired_through();
        book.retire_through(through);
        const std::int64_t now = book.retired_through().value_or(through);
        if (before && *before >= through)
          std::printf("dpstream: ledger %s: every block <= %lld was retired already; nothing changed\n", path.c_str(),
                      static_cast<long long>(now));
        else
          std::printf("dpstream: ledger %s: every block <= %lld is retired\n", path.c_str(),
                      static_cast<long long>(now));
        return 0;
      }
      const bool every_charge = explain->parsed();
      print_result(
          as_json, [&] { return dpstream::ledger_json(path, book, every_charge); },
          [&] { return dpstream::ledger_text(path, book, every_charge); });
      return 0;
    } catch (const std::exception& e) {  // a bad ledger or option: what to change
      throw dpstream::ConfigError(e.what());
    }
  }
};

// dpstream query: one SELECT WITH ANONYMIZATION over a CSV table (sql/, docs/SQL.md).
struct QueryCommand {
  std::string text, input, out, public_groups, bad_rows = "skip", selection = "gaussian", noise = "gaussian";
  std::string windows, ledger, spec;
  double growing = 0;
  std::int64_t growing_first = 1;
  dpstream::sql::AccuracyTarget target{0, 100, 0.05, 4};
  dpstream::sql::QueryOptions opts;
  std::optional<std::uint64_t> seed;
  bool explain = false;
  mutable std::map<std::string, std::string> filled_by_;  // option -> the source that filled it (a spec, OPTIONS)
  CLI::App* cmd = nullptr;
  void add(CLI::App& app) {
    cmd = app.add_subcommand("query",
                             "Run a DP SQL query (SELECT WITH ANONYMIZATION ... FROM input GROUP BY ...) over a CSV "
                             "table: DIR/result.csv and DIR/report.json (docs/SQL.md)");
    cmd->add_option("sql", text,
                    "The query, e.g. \"SELECT WITH ANONYMIZATION region, ANON_COUNT(*) AS n FROM input "
                    "GROUP BY region\"");
    cmd->add_option("--job", spec, "A job spec whose [query] table gives these options (the command line wins)");
    cmd->add_option("--input", input, "The table: a CSV file with a header (required)");
    cmd->add_option("--user-column", opts.user_column,
                    "The column that identifies the user, the privacy unit (required)");
    cmd->add_option("--epsilon", opts.epsilon, "Epsilon of the whole query, > 0 (required)")->check(kNumber);
    cmd->add_option("--delta", opts.delta, "Delta of the whole query, in [0, 1) (required)")->check(kNumber);
    cmd->add_option("--max-groups-per-user", opts.max_groups_per_user,
                    "k: groups a user may contribute to (the seed's C_u); more are sampled away (default 1)")
        ->check(kUint32);
    cmd->add_option("--max-rows-per-group", opts.max_rows_per_group,
                    "U of ANON_COUNT(*) without a bound: rows of a user counted per group (default 1)")
        ->check(kUint32);
    cmd->add_option("--selection", selection, "Partition selection: gaussian (default) | laplace | magic | public")
        ->check(CLI::IsMember({"gaussian", "laplace", "magic", "public"}));
    cmd->add_option("--public-groups", public_groups, "With --selection public: a CSV of the groups to release");
    cmd->add_option("--noise", noise, "Noise of the aggregates: gaussian (zCDP, default) | laplace (pure epsilon)")
        ->check(CLI::IsMember({"gaussian", "laplace"}));
    cmd->add_option("--selection-share", opts.selection_share,
                    "Share of the budget spent on partition selection, in (0, 1) (default 0.5)")
        ->check(kNumber);
    cmd->add_option("--window-column", opts.windows.column,
                    "The table's event time (integer seconds), cut into windows (the ledger's blocks)");
    cmd->add_option("--window-seconds", opts.windows.seconds, "Window length with --window-column (default 86400)")
        ->check(kInt64);
    cmd->add_flag("--per-window", opts.windows.per_window,
                  "One release per window (privacy unit: user x window); else one release over the windows read");
    cmd->add_option("--windows", windows, "Read only windows A..B (inclusive), e.g. 20:26; required with --ledger");
    cmd->add_option("--ledger", ledger,
                    "Charge this budget ledger on every window read, before reading (docs/LEDGER.md)")
        ->check(kLedgerPath);
    cmd->add_option("--growing", growing,
                    "Growing stream: re-release over all windows so far each time they grew by (1 + GAMMA), "
                    "within one budget for an unbounded number of releases (docs/SQL.md)")
        ->check(kPositiveFinite);
    cmd->add_option("--growing-first", growing_first, "Windows covered by the first growing release (default 1)")
        ->check(kInt64);
    cmd->add_option("--target-error", target.relative_error,
                    "Accuracy-targeted release: spend a small share of the budget, double it until every group "
                    "whose noisy first ANON_COUNT is >= --target-min-count has relative error <= R (docs/SQL.md)")
        ->check(kPositiveFinite);
    cmd->add_option("--target-min-count", target.min_count, "Groups judged by --target-error (default 100)")
        ->check(kNumber);
    cmd->add_option("--target-beta", target.beta, "Failure probability of the target's claim (default 0.05)")
        ->check(kNumber);
    cmd->add_option("--target-first-share-log2", target.first_share_log2,
                    "The first attempt spends 2^-N of the budget (default 4)");
    cmd->add_option("--bad-rows", bad_rows, "Rows that do not parse: skip (count them, default) | fail")
        ->check(CLI::IsMember({"skip", "fail"}));
    cmd->add_option("--seed", seed, "Noise secret from this seed: tests only, the output is NOT private")->check(kSeed);
    cmd->add_option("--out", out, "Output directory (result.csv, report.json; never overwritten) (required)");
    cmd->add_flag("--explain", explain, "Print the plan (noise and budget of every aggregate) and exit");
  }
  // Sets an option the command line left out, as if it had been given there (CLI11 converts and checks it);
  // `where` names the source in the error.
  void fill_option(CLI::Option* opt, const std::string& value, const std::string& where) const {
    filled_by_[opt->get_name()] = where;  // named, not the option, when a later source disagrees with the value
    opt->add_result(value);
    try {
      opt->run_callback();
    } catch (const CLI::Error& e) {
      throw dpstream::ConfigError(fmt::format("{}: {}", where, e.what()));
    }
  }

  // A message that names an option filled by --job's [query] or OPTIONS(...) also says where its value came from:
  // the option's name alone sends the user to a command line that never gave it.
  std::string with_sources(std::string message) const {
    for (const auto& [option, where] : filled_by_) {
      if (!option.starts_with("--") || message.find(where) != std::string::npos) continue;
      for (std::size_t at = message.find(option); at != std::string::npos; at = message.find(option, at + 1)) {
        const std::size_t after = at + option.size();
        if (after == message.size() ||
            !(std::isalnum(static_cast<unsigned char>(message[after])) || message[after] == '-')) {
          message += fmt::format(" ({} is {})", option, where);
          break;
        }
      }
    }
    return message;
  }

  // OPTIONS(...) in the query text: each names an option; it fills the option when nothing else set it and
  // must agree with it otherwise (never silently ignored).
  void apply_query_options() const {
    if (cmd->get_option("sql")->count() == 0) return;
    static const std::map<std::string, std::string> kNames = {
        {"epsilon", "--epsilon"},
        {"delta", "--delta"},
        {"max_groups_per_user", "--max-groups-per-user"},
        {"max_groups_contributed", "--max-groups-per-user"},
        {"kappa", "--max-groups-per-user"},
        {"max_rows_per_group", "--max-rows-per-group"},
        {"max_contributions_per_partition", "--max-rows-per-group"},
        {"selection", "--selection"},
        {"noise", "--noise"}};
    dpstream::sql::Query q;
    try {
      q = dpstream::sql::parse_query(text);
    } catch (const dpstream::sql::QueryError& e) {
      // Before the required options are looked for: "--epsilon is required" hid a syntax error in a query whose
      // OPTIONS(...) gives the budget.
      throw dpstream::ConfigError(fmt::format("query: {}", with_sources(e.what())));
    }
    for (const auto& o : q.options) {
      const auto it = kNames.find(o.name);
      if (it == kNames.end())
        throw dpstream::ConfigError(
            fmt::format("query: column {} ('{}'): unknown option; OPTIONS takes epsilon, "
                        "delta, max_groups_per_user, max_rows_per_group, selection, noise",
                        o.column_pos, o.name));
      CLI::Option* opt = cmd->get_option(it->second);
      if (opt->count() == 0) {
        fill_option(opt, o.value.text, fmt::format("OPTIONS({})", o.name));
        continue;
      }
      const std::string given = opt->as<std::string>();
      char* end = nullptr;
      const double number = std::strtod(given.c_str(), &end);  // a text option against a number: they disagree
      const bool same =
          o.value.is_string ? given == o.value.text : !given.empty() && *end == '\0' && number == o.value.number;
      const auto filled = filled_by_.find(opt->get_name());
      const std::string source =
          filled != filled_by_.end() ? fmt::format("{} = {}", filled->second, given) : it->second + " " + given;
      if (!same)
        throw dpstream::ConfigError(
            fmt::format("query: OPTIONS({} = {}) and {} disagree; give it once", o.name, o.value.text, source));
    }
  }

  // An option that would be ignored is refused: the two ways of spending the budget over releases exclude each
  // other, each one's own options need it, and --explain shows one release's plan only.
  void refuse_options_out_of_place() const {
    const auto given = [&](const char* name) { return cmd->get_option(name)->count() > 0; };
    if (given("--growing") && given("--target-error"))
      throw dpstream::ConfigError(
          "--growing and --target-error are two ways to spend the budget over several releases: give one");
    if (given("--growing-first") && !given("--growing"))
      throw dpstream::ConfigError("--growing-first is an option of --growing: give --growing GAMMA, or drop it");
    for (const char* name : {"--target-min-count", "--target-beta", "--target-first-share-log2"})
      if (given(name) && !given("--target-error"))
        throw dpstream::ConfigError(
            fmt::format("{} is an option of --target-error: give --target-error R, or drop it", name));
    if (given("--window-seconds") && !given("--window-column"))
      throw dpstream::ConfigError(
          "--window-seconds is the length of --window-column's windows: give --window-column, "
          "or drop it");
    if (given("--selection-share") && selection == "public")
      throw dpstream::ConfigError(
          "--selection-share is the budget share of a partition selection, which --selection public does not make "
          "(its groups are given): drop it");
    if (explain && (given("--growing") || given("--target-error")))
      throw dpstream::ConfigError(
          "--explain prints the plan of one release that spends the whole budget; --growing and --target-error "
          "spend it over several (schedule.json and adaptive.json say what each spent): drop --explain");
  }

  // The [query] table of --job fills every option the command line left out; then the required ones must be set.
  void apply_spec() const {
    if (!spec.empty())
      for (const auto& v : dpstream::sql::read_query_section(spec)) {
        CLI::Option* opt = cmd->get_option(v.option);
        if (opt->count() == 0) fill_option(opt, v.value, fmt::format("{}: [query] {}", spec, v.key));
      }
    apply_query_options();
    refuse_options_out_of_place();
    for (const char* name : {"sql", "--input", "--user-column", "--epsilon", "--delta", "--out"})
      if (cmd->get_option(name)->count() == 0)
        throw dpstream::ConfigError(fmt::format("query: {} is required (on the command line or in --job's [query])",
                                                std::string(name) == "sql" ? "the query text" : name));
  }
  dpstream::sql::QueryJob job() const {
    using namespace dpstream::sql;
    QueryOptions o = opts;
    o.selection = selection == "laplace"  ? SelectionKind::Laplace
                  : selection == "magic"  ? SelectionKind::Magic
                  : selection == "public" ? SelectionKind::Public
                                          : SelectionKind::Gaussian;
    o.noise = noise == "laplace" ? NoiseKind::Laplace : NoiseKind::Gaussian;
    if (!windows.empty()) {
      // Two int64 window numbers and nothing else (sscanf's %lld clamped one beyond int64 without a word).
      std::int64_t a = 0, b = 0;
      const char* const end = windows.data() + windows.size();
      const auto number = [end](const char* p, std::int64_t& v) {  // from_chars, with an optional '+' as sscanf's
        return std::from_chars(p != end && *p == '+' && p + 1 != end && p[1] != '-' ? p + 1 : p, end, v);
      };
      const auto first = number(windows.data(), a);
      const auto second = first.ec == std::errc() && first.ptr != end && *first.ptr == ':'
                              ? number(first.ptr + 1, b)
                              : std::from_chars_result{end, std::errc::invalid_argument};
      if (second.ec != std::errc() || second.ptr != end)
        throw dpstream::ConfigError(fmt::format(
            "--windows {}: write A:B, two window numbers (integers of at most 19 digits), e.g. 20:26", windows));
      o.windows.first = a, o.windows.last = b;
    }
    try {
      return QueryJob{.text = text,
                      .plan = plan_query(parse_query(text), o),
                      .input = input,
                      .bad_rows = bad_rows == "fail" ? dpstream::BadRowPolicy::Fail : dpstream::BadRowPolicy::Skip,
                      .seed = seed,
                      .public_groups = public_groups,
                      .out_dir = out,
                      .ledger = ledger};
    } catch (const QueryError& e) {
      throw dpstream::ConfigError(fmt::format("query: {}", e.what()));
    } catch (const std::invalid_argument& e) {
      throw dpstream::ConfigError(e.what());
    }
  }
  int exec(const dpstream::shuffle::Comm& comm, bool root) const {
    dpstream::fault::arm_from_environment(comm.rank());  // tests: DPSTREAM_FAULT
    dpstream::sql::QueryJob j;
    // Every rank plans and checks the same job before the first collective; all fail alike, with the
    // first failing rank's message and kind (2: the query or an option, 3: the input).
    std::string err;
    try {
      apply_spec();
      j = job();
      dpstream::sql::check_query_job(j);
    } catch (const dpstream::sql::QueryError& e) {
      err = fmt::format("2query: {}", with_sources(e.what()));
    } catch (const dpstream::InputError& e) {
      err = fmt::format("3{}", with_sources(e.what()));
    } catch (const std::exception& e) {
      err = fmt::format("2{}", with_sources(e.what()));
    }
    if (err = comm.agree_on_error(err); !err.empty()) {
      if (err[0] == '3') throw dpstream::InputError(err.substr(1));
      throw dpstream::ConfigError(err.substr(1));
    }
    print_warning(dpstream::large_delta_warning(opts.delta, 0), root);  // a table's users are known once it is read
    if (explain) {
      if (root) std::fputs(dpstream::sql::plan_text(j.plan).c_str(), stdout);
      if (root && !ledger.empty()) std::printf("--explain charged nothing to ledger %s\n", ledger.c_str());
      return 0;
    }
    // Rank 0 makes and locks --out before anything is charged or read: one that cannot be made is refused before
    // a ledger is charged, and a second query into it while this one runs is refused. Then the outputs are looked
    // for again: the check above ran before the lock.
    std::unique_ptr<dpstream::OutputLock> out_lock;
    bool made_out = false;  // rank 0 made --out: a refusal from here on removes it again while it is empty
    dpstream::shuffle::on_all_ranks<dpstream::ConfigError>(comm, [&] {
      if (!root) return;
      std::error_code ec;
      made_out = !std::filesystem::exists(j.out_dir, ec);
      out_lock = std::make_unique<dpstream::OutputLock>(j.out_dir, true);
      if (!out_lock->note().empty()) std::fprintf(stderr, "dpstream: note: %s\n", out_lock->note().c_str());
      dpstream::refuse_unwritable_dir(j.out_dir, "choose a directory you can write to as --out");
      dpstream::sql::refuse_existing_outputs(j.out_dir);
    });
    try {
      return release(j, comm, root);
    } catch (...) {
      std::error_code ec;
      if (made_out && std::filesystem::is_empty(j.out_dir, ec)) std::filesystem::remove(j.out_dir, ec);
      throw;
    }
  }

  // The query's release (one, a growing stream's or an accuracy-targeted one) into --out, held by rank 0.
  int release(const dpstream::sql::QueryJob& j, const dpstream::shuffle::Comm& comm, bool root) const {
    if (growing > 0) {
      const auto schedule = dpstream::sql::run_growing(j, growing, growing_first, comm);
      if (root)
        std::printf("dpstream: growing stream: %zu releases to %s (schedule.json)\n",
                    schedule.summary["releases"].size(), j.out_dir.c_str());
      warn_of_bad_rows(schedule.last_run, "in every release", root);
      return 0;
    }
    if (target.relative_error > 0) {
      const auto a = dpstream::sql::run_adaptive(j, target, comm);
      if (root)
        std::printf("dpstream: accuracy-targeted release: %s; spent %.3g of rho %.3g (adaptive.json in %s)\n",
                    a.summary["stopped"].get<std::string>().c_str(), a.summary["spent"]["rho"].get<double>(),
                    a.summary["budget"]["rho"].get<double>(), j.out_dir.c_str());
      warn_of_bad_rows(a.last_run, "in every attempt", root);
      return 0;
    }
    const auto c = dpstream::sql::run_query(j, comm);
    if (root)
      std::printf("dpstream: query released %llu groups to %s (rows read %llu, bad %llu; raw counts, not DP)\n",
                  static_cast<unsigned long long>(c.groups_released), j.out_dir.c_str(),
                  static_cast<unsigned long long>(c.rows), static_cast<unsigned long long>(c.bad));
    warn_of_bad_rows(c, "", root);
    return 0;
  }
  // Skipped rows are easy to miss (a --window-column of dates makes every row bad): the first one says why.
  static void warn_of_bad_rows(const dpstream::sql::QueryCounters& c, std::string_view where, bool root) {
    if (c.bad > 0)
      print_warning(fmt::format("{} of {} rows were bad and skipped{}{}; the first, {}", c.bad, c.rows,
                                where.empty() ? "" : " ", where, c.first_bad),
                    root);
  }
};

struct Commands {
  RunCommand run;
  BenchCommand bench;
  GenerateCommand generate;
  BudgetCommand budget;
  EvaluateCommand evaluate;
  ChooseCCommand choose_c;
  LedgerCommand ledger;
  QueryCommand query;
  // In the order of `dpstream --help`.
  void add(CLI::App& app) {
    run.add(app), bench.add(app), generate.add(app), budget.add(app), evaluate.add(app), choose_c.add(app),
        ledger.add(app), query.add(app);
  }
  int exec(const dpstream::shuffle::Comm& comm, bool root) {
    if (*run.cmd) return run.exec(comm, root);
    if (*bench.cmd) return bench.exec(comm, root);
    if (*budget.cmd) return budget.exec(comm, root);
    if (*evaluate.cmd) return evaluate.exec(comm, root);
    if (*choose_c.cmd) return choose_c.exec(comm, root);
    if (*generate.cmd) return generate.exec(comm, root);
    if (*ledger.cmd) return ledger.exec(comm, root);
    if (*query.cmd) return query.exec(comm, root);
    return 0;
  }
};

// The first argument where a command is expected, when it names none (CLI11 would only say that one is required).
std::string unknown_command(const CLI::App& app, int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-') return {};
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    if (sub->get_name() == argv[1]) return {};
    names.push_back(sub->get_name());
  }
  return fmt::format("unknown command '{}' (commands: {}; dpstream --help describes them)", argv[1],
                     fmt::join(names, ", "));
}

// Runs the parsed command; errors become the exit codes above (rank 0 prints the message).
int exec_reporting_errors(Commands& commands, const dpstream::shuffle::Comm& comm) {
  const bool root = comm.rank() == 0;
  try {
    return commands.exec(comm, root);
  } catch (const dpstream::ConfigError& e) {
    dpstream::stop_request::ending();
    if (root) std::fprintf(stderr, "dpstream: error: %s\n", dpstream::terminal_safe(e.what()).c_str());
    return kExitConfig;
  } catch (const dpstream::CheckpointError& e) {
    dpstream::stop_request::ending();
    if (root) std::fprintf(stderr, "dpstream: checkpoint error: %s\n", dpstream::terminal_safe(e.what()).c_str());
    return kExitCheckpoint;
  } catch (const dpstream::InputError& e) {
    dpstream::stop_request::ending();
    if (root) std::fprintf(stderr, "dpstream: input error: %s\n", dpstream::terminal_safe(e.what()).c_str());
    return kExitInput;
  } catch (const std::exception& e) {
    // Unexpected: this rank may be alone; take every rank down rather than leave them waiting.
    std::fprintf(stderr, "dpstream: fatal on rank %d: %s\n", comm.rank(), dpstream::terminal_safe(e.what()).c_str());
    MPI_Abort(MPI_COMM_WORLD, kExitOther);
  }
  return kExitOther;
}

// A stop signal stops `run` and `bench` after their current trigger; `query` and `choose-c`, which may charge a
// ledger before they read, finish their release first (killed, they spent budget and wrote nothing).
void install_stop_handlers(std::string_view command) {
  using dpstream::stop_request::Stops;
  if (command == "run" || command == "bench") dpstream::stop_request::install(Stops::AfterTrigger);
  if (command == "query" || command == "choose-c") dpstream::stop_request::install(Stops::AfterRelease);
}

}  // namespace

int main(int argc, char** argv) {
  // Keep freed memory in the process instead of unmapping it: the trigger loop allocates and frees
  // the same large buffers (shuffles, checkpoint images) every trigger, and on these VMs the page
  // faults of fresh mappings cost ~0.6 ms per MB (docs/PERFORMANCE.md).
  // NOLINTBEGIN(concurrency-mt-unsafe): the first statements of main, before any thread exists
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  // NOLINTEND(concurrency-mt-unsafe)
  // A stop signal (a job cancelled while it starts) is a clean stop from the first instruction on,
  // not only once MPI is up and the command line parsed (MPI_Init can take seconds on a busy node).
  install_stop_handlers(argc > 1 ? argv[1] : "");
  dpstream::shuffle::MpiSession mpi(argc, argv);
  const dpstream::shuffle::Comm comm;
  const bool root = comm.rank() == 0;
  try {
    dpstream::choose_threads_per_rank(comm);  // OMP_NUM_THREADS unset: no more threads than the node's cores
  } catch (const std::exception& e) {         // MPI refused the node split: keep OpenMP's own default
    if (root) std::fprintf(stderr, "dpstream: warning: threads per rank left to OpenMP: %s\n", e.what());
  }

  CLI::App app{
      "dpstream: user-level differentially private histograms at every trigger of a stream (MPI + OpenMP).\n"
      "Run under mpirun -np N or srun; OMP_NUM_THREADS sets threads per rank (default: the CPUs the rank may\n"
      "use, at most the node's CPUs divided by its ranks)."};
  app.set_version_flag("--version", dpstream::kVersionLine);
  app.require_subcommand(1);
  Commands commands;
  commands.add(app);
  if (const std::string unknown = unknown_command(app, argc, argv); !unknown.empty()) {
    if (root) std::fprintf(stderr, "dpstream: error: %s\n", unknown.c_str());
    return kExitConfig;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = root ? app.exit(e) : (e.get_exit_code() == 0 ? 0 : kExitConfig);
    return code == 0 ? 0 : kExitConfig;
  }
  // Before anything slow (job spec, checkpoint load): from here a stop signal is a clean stop.
  for (const CLI::App* cmd : app.get_subcommands()) install_stop_handlers(cmd->get_name());
  const int code = exec_reporting_errors(commands, comm);
  if (const int s = dpstream::stop_request::signal_received();
      s != 0 && root && code == 0 && (*commands.query.cmd || *commands.choose_c.cmd))
    std::fprintf(stderr, "dpstream: the %s came while the release ran; it was finished first\n",
                 dpstream::stop_request::signal_name(s));
  return code;
}
