#include "tools/choose_c.hpp"

#include <absl/container/flat_hash_map.h>
#include <fmt/format.h>
#include <omp.h>
#include <openssl/crypto.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <system_error>
#include <type_traits>

#include "kernels/noise.hpp"
#include "partition/hash.hpp"
#include "partition/partitioner.hpp"
#include "shuffle/comm.hpp"
#include "src/accounting.hpp"
#include "src/csv_input.hpp"
#include "src/errors.hpp"
#include "src/ledger.hpp"
#include "src/record_source.hpp"
#include "src/workload.hpp"

namespace dpstream {

namespace {

// One user's record count in the window, as counted by one rank (sent to the user's owner).
struct UserCount {
  std::uint64_t user;
  std::uint64_t count;
};
static_assert(std::is_trivially_copyable_v<UserCount>);

// The sampler for this budget; ConfigError when sigma is outside the sampler's range.
noise::DiscreteGaussian make_sampler(const ChooseCOptions& o, double rho) {
  const double sigma = std::sqrt(1.0 / (2.0 * rho));
  try {
    return noise::DiscreteGaussian(sigma);
  } catch (const std::invalid_argument&) {
    if (!(sigma <= std::ldexp(1.0, 24)))
      throw ConfigError(
          fmt::format("--epsilon {} with --delta {} needs noise sigma {:.4g}, above the sampler's largest "
                      "2^24: use a larger --epsilon or --delta",
                      o.epsilon, o.delta, sigma));
    throw ConfigError(
        fmt::format("--epsilon {} with --delta {} needs noise sigma {:.4g}, below the sampler's smallest "
                    "2^-10: use a smaller --epsilon (a few hundred already gives noise that is almost "
                    "always 0)",
                    o.epsilon, o.delta, sigma));
  }
}

std::string describe_input(const JobConfig& config) {
  if (config.input.kind == InputKind::Csv) return fmt::format("the CSV file {}", config.input.path);
  return fmt::format("the synthetic stream with seed {}, as the job generates it", config.input.seed);
}

}  // namespace

namespace {
// Two names of one ledger file (a relative and an absolute path, a link): compared as canonical paths as far as
// they exist.
bool same_ledger(const std::string& a, const std::string& b) {
  std::error_code ea, eb;
  const auto ca = std::filesystem::weakly_canonical(a, ea), cb = std::filesystem::weakly_canonical(b, eb);
  return ea || eb ? a == b : ca == cb;
}
}  // namespace

void check_choose_c_options(const JobConfig& config, const ChooseCOptions& o) {
  if (!(o.epsilon > 0) || !std::isfinite(o.epsilon))
    throw ConfigError(fmt::format("--epsilon must be a positive finite number, got {}; e.g. --epsilon 1", o.epsilon));
  if (!(o.delta > 0 && o.delta < 1))
    throw ConfigError(fmt::format("--delta must be in (0, 1), got {}; e.g. --delta 1e-9", o.delta));
  if (!(o.quantile > 0 && o.quantile < 1))
    throw ConfigError(
        fmt::format("--quantile must be in (0, 1), got {}; e.g. --quantile 0.99 for the 99th percentile", o.quantile));
  if (o.max_c < 1 || o.max_c > kChooseCMaxC)
    throw ConfigError(fmt::format(
        "--max-c must be in [1, {}], got {}; it should exceed the C you expect (default 1000)", kChooseCMaxC, o.max_c));
  const std::int64_t first = config.stream.first_window;
  const std::int64_t last = first + static_cast<std::int64_t>(config.stream.windows) - 1;
  const bool known = !config.stream.windows_from_input;  // else any window run can read: the input's are not known
  if (!known && o.window && (*o.window < 0 || *o.window > StreamConfig::kMaxWindow))
    throw ConfigError(
        fmt::format("--window {} is not a window a job can read (0..{}: floor(timestamp / "
                    "window_seconds) of non-negative timestamps); choose one of the input's windows",
                    *o.window, StreamConfig::kMaxWindow));
  if (known && o.window && (*o.window < first || *o.window > last))
    throw ConfigError(
        fmt::format("--window {} is not one of the job's windows {}..{} ([stream] first_window = {}, "
                    "windows = {}); choose one of them or change the job with --set stream.first_window=...",
                    *o.window, first, last, first, config.stream.windows));
  // A window taken from the data (the input's first) would be printed, and would move with one user's row.
  if (!known && !o.window && !o.seed)
    throw ConfigError(
        "choose-c needs its window before any record is read, and this job's windows come from its input: give "
        "--window W (a window of floor(timestamp / window_seconds)), or set [stream] first_window and windows. The "
        "input's first window would be chosen by the data, and one user's row could move it");
  if (!o.ledger.empty() && o.seed)
    throw ConfigError("--ledger with --seed: a seeded choose-c is not private (its noise is known); drop one of them");
  if (!config.privacy.ledger.empty() && o.seed)
    throw ConfigError(fmt::format(
        "--seed with a job that charges ledger {} ([privacy] ledger): a seeded choose-c is not private (its noise is "
        "known); drop --seed, or measure a copy of the job without the ledger",
        config.privacy.ledger));
  if (!o.ledger.empty() && !config.privacy.ledger.empty() && !same_ledger(o.ledger, config.privacy.ledger))
    throw ConfigError(fmt::format(
        "--ledger {} is not the job's [privacy] ledger {}: the window's data is charged on its stream's ledger; drop "
        "--ledger (the job's is charged) or give the job's",
        o.ledger, config.privacy.ledger));
  // The release is private whatever the job's mode: a stop because of one row would be an output of that row.
  if (config.input.kind == InputKind::Csv && config.input.bad_rows == BadRowPolicy::Fail && !o.seed)
    throw ConfigError(
        "[input] bad_rows = \"fail\" would stop choose-c's private release because of one row: the stop is an output "
        "that depends on the data. Use --set input.bad_rows=skip (skipped rows are counted), or check the input first "
        "with dpstream run in mode = \"none\"");
  make_sampler(o, accounting::zcdp_rho_tight(o.epsilon, o.delta));  // sigma within the sampler's range
}

QuantileChoice choose_from_noisy_histogram(const std::vector<std::int64_t>& noisy, double quantile) {
  if (noisy.size() < 2) throw std::invalid_argument("choose_from_noisy_histogram: need bins 1..max_c+1, max_c >= 1");
  const auto max_c = static_cast<std::int64_t>(noisy.size()) - 1;
  std::int64_t n = 0;
  for (const auto v : noisy) n += v;
  QuantileChoice out;
  out.noisy_users = n;
  const double target = quantile * static_cast<double>(n);
  std::int64_t cdf = 0, cdf_at_c = 0;
  out.c = 0;
  for (std::int64_t c = 1; c <= max_c; ++c) {
    cdf += noisy[static_cast<std::size_t>(c - 1)];
    if (static_cast<double>(cdf) >= target) {
      out.c = c;
      cdf_at_c = cdf;
      break;
    }
  }
  if (out.c == 0) {
    out.c = max_c;
    out.c_at_max = true;
    cdf_at_c = cdf;
  }
  if (n > 0) out.share_above_c = static_cast<double>(n - cdf_at_c) / static_cast<double>(n);
  return out;
}

ChooseCResult choose_c(const JobConfig& job, const ChooseCOptions& options, const shuffle::Comm& comm) {
  JobConfig config = job;  // a CSV job's windows are resolved from its input below
  const int P = comm.size();
  const bool root = comm.rank() == 0;

  // Validation: local and identical on every rank; agreed before any data moves.
  double rho_budget = 0;
  std::unique_ptr<noise::DiscreteGaussian> dg;
  shuffle::on_all_ranks<ConfigError>(comm, [&] {
    check_choose_c_options(config, options);
    rho_budget = accounting::zcdp_rho_tight(options.epsilon, options.delta);
    dg = std::make_unique<noise::DiscreteGaussian>(make_sampler(options, rho_budget));
  });
  shuffle::on_all_ranks<InputError>(comm, [&] {
    if (config.input.kind == InputKind::Csv) check_csv_file(config.input.path);
  });
  const auto max_c = options.max_c;

  // Secret (noise, keyed CSV ids): from --seed (test mode) or 256 bits from the OS on rank 0, broadcast.
  noise::Secret secret{};
  if (options.seed) {
    secret = noise::secret_from_seed(*options.seed);
  } else {
    shuffle::on_all_ranks<std::runtime_error>(comm, [&] {
      if (root) secret = noise::secret_from_os();
    });
    comm.broadcast(secret.data(), secret.size());
  }

  // A ledger (docs/LEDGER.md), --ledger or the job's own: the window is charged rho before any record is read (its
  // window is known without the data: check_choose_c_options).
  const std::string ledger_path = !options.ledger.empty() ? options.ledger : config.privacy.ledger;
  if (!ledger_path.empty())
    shuffle::on_all_ranks<ConfigError>(comm, [&] {
      if (!root) return;
      const std::int64_t block = options.window.value_or(config.stream.first_window);
      ledger::Request request{.run_id = "",
                              .job = config.name + " (choose-c)",
                              .mechanism = fmt::format("choose-c: discrete Gaussian histogram of per-user counts, "
                                                       "quantile {}, max C {}",
                                                       options.quantile, options.max_c),
                              .zcdp = true,
                              .rho = rho_budget,
                              .delta_extra = 0,
                              .coupled = 0,
                              .epsilon = options.epsilon,
                              .delta = options.delta,
                              .blocks = {block}};
      request.run_id = ledger::run_id(
          secret.data(), secret.size(),
          fmt::format("choose-c|{}|{}|{}|{}|{:a}|{:a}|{:a}|{}", config.name, to_string(config.input.kind),
                      config.input.path, block, options.epsilon, options.delta, options.quantile, options.max_c));
      ledger::charge_or_refuse(ledger_path, config.stream.window_seconds, request);
    });

  // 1. This rank's records of the window, exactly as the job reads them; only counts per user kept.
  std::unique_ptr<RecordSource> source;
  shuffle::on_all_ranks<InputError>(comm, [&] {
    if (config.input.kind == InputKind::Csv) {
      IdPrf ids(secret);
      source = std::make_unique<CsvSource>(config, comm.rank(), P, ids);
    } else {
      source = std::make_unique<SyntheticSource>(config, comm.rank(), P);
    }
  });
  if (auto* csv = dynamic_cast<CsvSource*>(source.get())) {
    csv->separate_ids(comm);
    resolve_windows_from_input(config, *csv, comm);
  }
  // A --window outside the input's windows is measured as it is (an empty window), never refused: a
  // refusal would tell whether the input holds rows in it.
  const std::int64_t window = options.window.value_or(config.stream.first_window);
  absl::flat_hash_map<std::uint64_t, std::uint64_t> local;
  shuffle::on_all_ranks<InputError>(comm, [&] {
    source->skip_to(config.stream.first_window, window, 0);
    for (std::uint32_t t = 0; t < config.stream.triggers; ++t)
      for (const Record& r : source->take_trigger(window, t)) ++local[r.user];
  });
  source.reset();

  // 2. (user, count) to the user's owner rank: the engine's user partition and all-to-all.
  std::vector<UserCount> pairs;
  pairs.reserve(local.size());
  for (const auto& [user, count] : local) pairs.push_back({user, count});
  absl::flat_hash_map<std::uint64_t, std::uint64_t>().swap(local);
  auto by_user = partition::partition_by(pairs, static_cast<std::size_t>(P),
                                         [P](const UserCount& u) { return partition::user_owner(u.user, P); });
  std::vector<UserCount>().swap(pairs);
  const auto owned = comm.alltoallv(by_user.items, by_user.offsets, nullptr, "shuffle_user");
  by_user = {};
  absl::flat_hash_map<std::uint64_t, std::uint64_t> totals;  // this rank's users: their whole count
  for (const auto& u : owned) totals[u.user] += u.count;

  // 3. Histogram of min(count, max_c + 1): bin b at index b - 1, b in 1..max_c+1, summed over ranks.
  // A user present in the window has count >= 1, so every user lands in exactly one bin.
  std::vector<std::uint64_t> hist(static_cast<std::size_t>(max_c) + 1, 0);
  for (const auto& [user, count] : totals)
    ++hist[static_cast<std::size_t>(std::min<std::uint64_t>(count, static_cast<std::uint64_t>(max_c) + 1) - 1)];
  absl::flat_hash_map<std::uint64_t, std::uint64_t>().swap(totals);
  hist = comm.sum(hist);

  // 4. Noise, keyed with the secret drawn before the input was read.
  // The PRF is keyed with K = HMAC(secret, "dpstream window" || -1 - W). Jobs only have windows
  // >= 0 ([stream] first_window >= 0), so -1 - W is never a job's window: even with the same secret
  // (the same seed in tests) these draws never reuse a job's noise, and distinct W give distinct
  // keys. Bin b's noise is node (key = b, family Count, round 0, level 0, index 0): one node per bin,
  // so the bins' noises are independent. Every rank draws the same noise (thread-independent).
  const std::int64_t prf_window = choose_c_prf_window(window);
  std::vector<std::int64_t> noisy(hist.size());
  std::string draw_error;
#pragma omp parallel
  {
    try {
      noise::WindowPrf prf(secret, prf_window);
#pragma omp for schedule(static)
      for (std::int64_t i = 0; i < static_cast<std::int64_t>(hist.size()); ++i) {
        const noise::NodeId id{static_cast<std::uint64_t>(i + 1), noise::Family::Count, 0, 0, 0};
        noisy[static_cast<std::size_t>(i)] =
            static_cast<std::int64_t>(hist[static_cast<std::size_t>(i)]) + noise::node_noise(prf, id, *dg);
      }
    } catch (const std::exception& e) {
#pragma omp critical(choose_c_error)
      if (draw_error.empty()) draw_error = e.what();
    }
  }
  OPENSSL_cleanse(secret.data(), secret.size());
  std::fill(hist.begin(), hist.end(), 0);  // the raw histogram goes no further
  if (!draw_error.empty()) throw std::runtime_error("choose-c noise: " + draw_error);

  // 5. Post-processing of the noisy histogram only.
  const auto choice = choose_from_noisy_histogram(noisy, options.quantile);
  ChooseCResult r;
  r.job = config.name;
  r.input = describe_input(config);
  r.window = window;
  r.window_seconds = config.stream.window_seconds;
  r.quantile = options.quantile;
  r.max_c = max_c;
  r.epsilon = options.epsilon;
  r.delta = options.delta;
  r.rho_budget = rho_budget;
  r.sigma = dg->sigma();
  r.rho = 1.0 / (2.0 * r.sigma * r.sigma);
  r.c = choice.c;
  r.c_at_max = choice.c_at_max;
  r.noisy_users = choice.noisy_users;
  r.noisy_share_above_c = choice.share_above_c;
  r.cdf_stderr_at_c = r.sigma * std::sqrt(static_cast<double>(r.c));
  r.private_run = !options.seed;
  r.seed = options.seed;
  return r;
}

ChooseCResult choose_c(const std::string& spec, const std::vector<std::string>& overrides,
                       const ChooseCOptions& options, const shuffle::Comm& comm) {
  JobConfig config;
  shuffle::on_all_ranks<ConfigError>(comm, [&] {
    if (spec.empty()) throw ConfigError("no job spec given: dpstream choose-c JOB.toml --epsilon E --delta D");
    try {
      config = load_job(spec, overrides);
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      if (what.find("max_records_per_user") != std::string::npos && what.find("required") != std::string::npos)
        throw ConfigError(what +
                          " (choose-c does not use C: any placeholder will do, e.g. "
                          "--set privacy.max_records_per_user=1)");
      throw;
    }
  });
  return choose_c(config, options, comm);
}

nlohmann::ordered_json choose_c_json(const ChooseCResult& r) {
  nlohmann::ordered_json j;
  j["window"] = r.window;
  j["quantile"] = r.quantile;
  j["max_c"] = r.max_c;
  j["epsilon"] = r.epsilon;
  j["delta"] = r.delta;
  j["rho"] = r.rho;
  j["sigma"] = r.sigma;
  j["c"] = r.c;
  j["noisy_users"] = r.noisy_users;
  j["noisy_share_above_c"] = r.noisy_share_above_c ? nlohmann::ordered_json(*r.noisy_share_above_c) : nullptr;
  j["private"] = r.private_run;
  j["rho_budget"] = r.rho_budget;
  j["cdf_stderr_at_c"] = r.cdf_stderr_at_c;
  j["c_at_max"] = r.c_at_max;
  j["job"] = r.job;
  return j;
}

std::string choose_c_text(const ChooseCResult& r) {
  std::string s;
  auto line = [&s](const std::string& l) { s += l + "\n"; };
  line(fmt::format("dpstream choose-c: job '{}', window {} (seconds [{}, {}))", r.job, r.window,
                   r.window * r.window_seconds, (r.window + 1) * r.window_seconds));
  if (!r.private_run)
    line(
        fmt::format("  WARNING: NOT PRIVATE: the noise is derived from --seed {}; anyone who knows the seed can "
                    "remove it. Use this for tests only.",
                    *r.seed));
  line(fmt::format("  measured:  per-user record counts in window {} of the job's input, {},", r.window, r.input));
  line(fmt::format("             as a histogram of min(count, {}) over bins 1..{} (bin {} = more than {})", r.max_c + 1,
                   r.max_c + 1, r.max_c + 1, r.max_c));
  line(
      fmt::format("  privacy:   epsilon {}, delta {} -> rho {:.6g} (tight zCDP conversion); one user changes one bin "
                  "by 1 (L2 sensitivity 1)",
                  r.epsilon, r.delta, r.rho_budget));
  line(
      fmt::format("  noise:     discrete Gaussian per bin, sigma {:.6g} (sqrt(1 / (2 rho)) rounded up by the "
                  "sampler); rho spent {:.6g}",
                  r.sigma, r.rho));
  if (r.c_at_max)
    line(
        fmt::format("  result:    C = {}: no c <= --max-c {} reached {} of the noisy user count, so C is --max-c; "
                    "raise --max-c",
                    r.c, r.max_c, r.quantile));
  else
    line(fmt::format("  result:    C = {}: the smallest c with noisy F(c) >= {} x noisy n (q = {})", r.c, r.quantile,
                     r.quantile));
  line(fmt::format(
      "  noisy:     users n = {}; share of users above C = {}; standard error of F(C) = sigma sqrt(C) = "
      "{:.1f} users",
      r.noisy_users, r.noisy_share_above_c ? fmt::format("{:.4g}%", 100.0 * *r.noisy_share_above_c) : "undefined",
      r.cdf_stderr_at_c));
  line(fmt::format(
      "             standard error of n = sigma sqrt(max_c + 1) = {:.1f} users: it moves the target q n, usually the "
      "largest error of C; a smaller --max-c (still above C) reduces it",
      r.sigma * std::sqrt(static_cast<double>(r.max_c + 1))));
  if (r.noisy_users <= 0)
    line(
        "  WARNING: the noisy user count is not positive: the window has too few users for this epsilon, and C "
        "says nothing about the data");
  line(fmt::format("  use:       --set privacy.max_records_per_user={} (or [privacy] max_records_per_user = {})", r.c,
                   r.c));
  line(
      fmt::format("  budget:    this spends ({}, {}) of the window's budget in addition to the job's own, by basic "
                  "composition, unless window {} is not released by the job or the input is a separate sample",
                  r.epsilon, r.delta, r.window));
  return s;
}

}  // namespace dpstream
