// The job spec: a TOML file plus --set overrides, parsed and validated in one place.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/counter_kind.hpp"
#include "kernels/key_scan.hpp"

namespace dpstream {

enum class InputKind { Synthetic, Csv };
enum class KeyDistribution { ZipfMandelbrot, Uniform };
enum class BadRowPolicy { Skip, Fail };
// none: exact totals; dp: DP-SQLP (the product); the two baselines of the core paper's section 5:
// baseline-repeated: a one-shot DP query on all data so far at every trigger (baseline 1);
// baseline-batch: a one-shot DP query on each trigger's micro-batch, released values summed (baseline 2).
enum class PrivacyMode { None, Dp, BaselineRepeated, BaselineBatch };
inline bool is_private(PrivacyMode m) { return m != PrivacyMode::None; }
inline bool is_baseline(PrivacyMode m) { return m == PrivacyMode::BaselineRepeated || m == PrivacyMode::BaselineBatch; }
// How the parts of a DP job are composed (docs/PRIVACY.md sections 7 and 8):
// zcdp: one zCDP ledger for every noisy part, converted once to (epsilon, delta) (default);
// basic: dp mode as the core paper: key selection and aggregation converted separately and added;
// optimal: baselines as the core paper: a per-release (eps0, delta0) composed over the T releases
// by the optimal composition theorem (Kairouz, Oh & Viswanath 2015).
enum class Composition { Zcdp, Basic, Optimal };
// How tau is set from the prefix noise's standard deviation lambda: the proven subgaussian tail
// of the discrete Gaussian (tau = lambda sqrt(2 ln(1/beta))) or the paper's Gaussian quantile.
enum class ThresholdTail { Subgaussian, GaussianQuantile };
enum class ProgressMode { Always, Auto, Never };
using kernels::CounterKind;  // [privacy] selection_counter, value_counter
using kernels::KeyScan;      // [engine] key_scan

struct InputConfig {
  InputKind kind = InputKind::Synthetic;
  std::string path;  // csv only
  BadRowPolicy bad_rows = BadRowPolicy::Skip;
  // Synthetic workload (core paper, section 5.1).
  std::uint64_t users = 10'000;
  std::uint64_t keys = 1'000;
  KeyDistribution key_distribution = KeyDistribution::ZipfMandelbrot;
  std::uint64_t seed = 1;
  // Records per user = X, or 1 + X when records_per_user_min = 0, with X ~ Zipf-Mandelbrot(q, s) on
  // {min..max}. The core paper states {1..1e5}; its Table 1 totals match 1 + X on {0..1e5} (5.905 per user).
  double records_per_user_q = 26.0;
  double records_per_user_s = 6.738;
  std::uint64_t records_per_user_min = 1;  // 0 or 1
  std::uint64_t records_per_user_max = 100'000;
  double key_q = 1000.0;  // keys ~ Zipf-Mandelbrot on {1..keys}
  double key_s = 1.4;
};

struct StreamConfig {
  std::int64_t window_seconds = 86'400;
  std::uint32_t triggers = 0;     // T, required
  std::int64_t first_window = 0;  // windows [first_window, first_window + windows) are processed
  std::uint32_t windows = 1;
  // CSV input without first_window and windows: the windows are those of the input (from its earliest
  // to its latest window, resolved by resolve_windows_from_input before the job runs).
  bool windows_from_input = false;
  static constexpr std::int64_t kMaxWindow = std::int64_t{1} << 20;  // windows are 0..kMaxWindow
};

struct PrivacyConfig {
  PrivacyMode mode = PrivacyMode::None;
  // C, required except in mode "none", where leaving it out keeps every record (the true totals).
  static constexpr std::uint32_t kUnbounded = 0xffffffffu;
  std::uint32_t max_records_per_user = 0;
  Composition composition = Composition::Zcdp;
  double clamp_min = 0.0;
  double clamp_max = 1.0;
  // mode = "dp" (docs/PRIVACY.md): user-level (epsilon, delta)-DP per window.
  double epsilon = 0;
  double delta = 0;
  std::optional<double> mu;                  // keys with <= mu distinct users (in a round) are never released;
                                             // default: a quarter of the smallest threshold margin (PrivacyPlan)
  std::optional<double> beta;                // failure probability per threshold test; default from delta
  std::optional<std::uint64_t> seed;         // fixed noise secret: test mode, the output is not private
  double selection_epsilon_share = 0.5;      // key selection's share of epsilon (the rest: aggregation)
  double selection_delta_share = 2.0 / 3.0;  // key selection's share of delta
  ThresholdTail threshold = ThresholdTail::Subgaussian;
  CounterKind selection_counter = CounterKind::Banded;  // key selection's counters
  CounterKind value_counter = CounterKind::Banded;      // the released columns' counters
  std::uint32_t counter_band = 8;                       // b of the banded counters (1..16)
  std::string ledger;  // the budget ledger every window is charged to before anything is released (src/ledger.hpp)
};

// Released columns: the aggregation budget is shared by the chosen ones.
struct QueryConfig {
  bool count = true;
  bool sum = true;
};

struct OutputConfig {
  std::string dir = "dpstream-out";
  static constexpr std::string_view kFormats[] = {"csv"};  // the accepted [output] format values
  std::string format = "csv";
  ProgressMode progress = ProgressMode::Always;
};

// Exactly-once checkpoints (docs/CHECKPOINTS.md): a commit once `seconds` have passed since the
// last one (rank 0's clock), or once the commit journal holds `journal_mib` MiB on any rank, or every
// `every` triggers when given, and always at the end of every window; every = 0: none (releases.csv
// appears at the end; a killed run cannot resume). Does not change the output, so all three may
// differ on resume.
struct CheckpointConfig {
  std::optional<std::uint32_t> every;  // unset: by time and journal size only
  double seconds = 30.0;               // default cadence: a commit costs ~1% of 30 s of triggers
  // Per rank: about the journal `every = 3` gave the 1/10-scale job (docs/SCALE.md), which fit its
  // 24-GiB machine; a fixed figure, so the cadence does not depend on the machine the job runs on.
  std::uint32_t journal_mib = 1024;
  bool enabled() const { return !every || *every > 0; }
};

struct EngineConfig {
  KeyScan key_scan = KeyScan::Predicted;
  // Consecutive triggers bounded in one pass over the user state (bound_and_aggregate_batch); 0: auto.
  std::uint32_t trigger_batch = 0;
  static constexpr std::uint32_t kMaxTriggerBatch = 1024;
  // The auto batch: about a fiftieth of a window's triggers (T = 100: 2, T = 1000: 20), so that from T = 100 on
  // a batch holds about 2% of the window's records; 1 below T = 100. Larger batches run the key side of their
  // triggers back to back, with the key tables still in cache (docs/PERFORMANCE.md round 40); beyond about 2%
  // bounding's batch outgrows the caches its sort works in.
  std::uint32_t triggers_per_batch(std::uint32_t triggers_per_window) const {
    return trigger_batch ? trigger_batch : std::max<std::uint32_t>(1, triggers_per_window / 50);
  }
};

struct JobConfig {
  std::string name = "job";
  std::string source;             // where the spec came from (file path or "built-in demo")
  std::vector<std::string> sets;  // the --set assignments applied over it, in order
  InputConfig input;
  StreamConfig stream;
  PrivacyConfig privacy;
  QueryConfig query;
  OutputConfig output;
  CheckpointConfig checkpoint;
  EngineConfig engine;
  // What an error about several values names: the spec, and every --set that replaced one of its values.
  std::string origin() const;
};

// Parses TOML text; `overrides` are "section.key=value" strings applied before validation.
// Throws ConfigError naming the offending key and what to change.
JobConfig parse_job(const std::string& toml_text, const std::string& source, const std::vector<std::string>& overrides);
JobConfig load_job(const std::string& path, const std::vector<std::string>& overrides);

// A warning (empty if none) for a delta too large to mean privacy: a mechanism may publish a user's records outright
// with probability delta, so delta should lie well below 1 / users. `users` 0: not known before the data are read;
// then delta >= kLargeDelta is warned of.
inline constexpr double kLargeDelta = 1e-3;
std::string large_delta_warning(double delta, std::uint64_t users);

// The built-in demo: a small synthetic stream that runs in seconds.
std::string demo_job_toml();

// ---- enum <-> string: one table per enum, used by the parser and every printer ----------------

template <class E>
struct EnumName {
  E value;
  std::string_view name;
};

// The table of each enum's spellings, found by overload on the enum type.
inline constexpr EnumName<InputKind> kInputKindNames[] = {{InputKind::Synthetic, "synthetic"}, {InputKind::Csv, "csv"}};
constexpr std::span<const EnumName<InputKind>> names_of(InputKind) { return kInputKindNames; }
inline constexpr EnumName<KeyDistribution> kKeyDistributionNames[] = {
    {KeyDistribution::ZipfMandelbrot, "zipf-mandelbrot"}, {KeyDistribution::Uniform, "uniform"}};
constexpr std::span<const EnumName<KeyDistribution>> names_of(KeyDistribution) { return kKeyDistributionNames; }
inline constexpr EnumName<BadRowPolicy> kBadRowPolicyNames[] = {{BadRowPolicy::Skip, "skip"},
                                                                {BadRowPolicy::Fail, "fail"}};
constexpr std::span<const EnumName<BadRowPolicy>> names_of(BadRowPolicy) { return kBadRowPolicyNames; }
inline constexpr EnumName<PrivacyMode> kPrivacyModeNames[] = {{PrivacyMode::None, "none"},
                                                              {PrivacyMode::Dp, "dp"},
                                                              {PrivacyMode::BaselineRepeated, "baseline-repeated"},
                                                              {PrivacyMode::BaselineBatch, "baseline-batch"}};
constexpr std::span<const EnumName<PrivacyMode>> names_of(PrivacyMode) { return kPrivacyModeNames; }
inline constexpr EnumName<Composition> kCompositionNames[] = {
    {Composition::Zcdp, "zcdp"}, {Composition::Basic, "basic"}, {Composition::Optimal, "optimal"}};
constexpr std::span<const EnumName<Composition>> names_of(Composition) { return kCompositionNames; }
inline constexpr EnumName<ThresholdTail> kThresholdTailNames[] = {
    {ThresholdTail::Subgaussian, "subgaussian"}, {ThresholdTail::GaussianQuantile, "gaussian-quantile"}};
constexpr std::span<const EnumName<ThresholdTail>> names_of(ThresholdTail) { return kThresholdTailNames; }
inline constexpr EnumName<ProgressMode> kProgressModeNames[] = {
    {ProgressMode::Always, "always"}, {ProgressMode::Auto, "auto"}, {ProgressMode::Never, "never"}};
constexpr std::span<const EnumName<ProgressMode>> names_of(ProgressMode) { return kProgressModeNames; }
inline constexpr EnumName<KeyScan> kKeyScanNames[] = {{KeyScan::Predicted, "predicted"}, {KeyScan::Full, "full"}};
constexpr std::span<const EnumName<KeyScan>> names_of(KeyScan) { return kKeyScanNames; }
inline constexpr EnumName<CounterKind> kCounterKindNames[] = {{CounterKind::Tree, "tree"},
                                                              {CounterKind::Banded, "banded"}};
constexpr std::span<const EnumName<CounterKind>> names_of(CounterKind) { return kCounterKindNames; }

template <class E>
concept NamedEnum = requires(E e) {
  names_of(e);
};

template <NamedEnum E>
std::string to_string(E value) {
  for (const auto& [v, name] : names_of(value))
    if (v == value) return std::string(name);
  return "?";  // unreachable: every enumerator is in its table (tests/src/test_config.cpp)
}

template <NamedEnum E>
std::optional<E> parse_enum(std::string_view text) {
  for (const auto& [v, name] : names_of(E{}))
    if (name == text) return v;
  return std::nullopt;
}

// The spellings of E in table order, e.g. for a command-line option's allowed values.
template <NamedEnum E>
std::vector<std::string> enum_names() {
  std::vector<std::string> out;
  for (const auto& entry : names_of(E{})) out.emplace_back(entry.name);
  return out;
}

// ---- the job spec's fields: the parser's known keys and the checkpoint identity, in one list ----

// MustMatch: the field defines the output, so a checkpoint records it and a resume must not change it.
enum class OnResume { MustMatch, MayChange };
// The jobs for which a MustMatch field is recorded (it has no effect on the others).
// BandedCounters: private jobs with a banded counter (absent otherwise, so that the identity of jobs on
// trees, and their earlier checkpoints, stay as they were).
enum class AppliesTo { All, Synthetic, Csv, Private, BandedCounters, Ledger };

struct SpecField {
  std::string_view name;  // "section.key", as in the TOML and in --set
  OnResume on_resume;
  AppliesTo applies = AppliesTo::All;
  std::string (*identity)(const JobConfig&) = nullptr;  // the recorded value; MustMatch fields only
};

// Every key the parser accepts, grouped by section in the order of its "known keys" message.
std::span<const SpecField> job_spec_fields();
// The sections in table order, and the keys (without "section.") of one of them.
std::vector<std::string> spec_sections();
std::vector<std::string> spec_keys(std::string_view section);
// Whether checkpoint identity records `field` for job `c`.
bool in_identity(const SpecField& field, const JobConfig& c);

}  // namespace dpstream
