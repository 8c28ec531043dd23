// dpstream evaluate: the error of a released histogram stream against the true histogram of the
// same stream, over the whole key space, at every trigger of one window.
//
// Both inputs are output directories of `dpstream run` (releases.csv + summary.json). The truth is
// a mode "none" run without contribution bounding; the released run is any mode. The histogram of a
// run at (window W, trigger i) maps each key to its last row in W with trigger <= i ("running"
// rows), or to the sum of those rows ("increments": summary.json "release_values", or a string
// "release_rows"); other keys are 0.
// The truth file is streamed once (no whole-file load); values are summed in the engine's fixed
// point (record.hpp), so l1, linf and the truth figures are exact and l2 is exact up to the final
// square root (unless the sum of squares leaves 128 bits, then long double).
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dpstream {

enum class EvalColumn { Count, Sum };

struct EvaluateOptions {
  std::string truth_dir;
  std::string released_dir;
  std::optional<std::int64_t> window;   // default: the last window of the truth file
  std::optional<std::int64_t> trigger;  // default: the window's last trigger
  EvalColumn column = EvalColumn::Count;
};

// Metrics of err = estimate - truth over the key space at one trigger, in records (or value units).
struct TriggerMetrics {
  std::uint32_t trigger = 0;
  std::uint64_t keys_released = 0;  // keys with at least one released row in the window so far (l0)
  double linf = 0, l1 = 0, l2 = 0;
};

struct EvaluateResult {
  std::string truth_dir, released_dir;
  std::string mode;          // the released run's mode (summary.json)
  std::string release_rows;  // the released run's rows: "running" or "increments"
  std::string column;        // "count" or "sum"
  std::int64_t window = 0;
  std::uint32_t trigger = 0;
  std::optional<std::uint32_t> triggers_per_window;  // when summary.json states it
  TriggerMetrics final;                              // at `trigger` (= per_trigger.back())
  std::uint64_t truth_keys = 0;                      // keys with a nonzero true value at `trigger`
  double truth_total = 0;                            // sum of the true values
  double truth_max = 0;                              // largest |true value|
  std::optional<double> dropped_share;               // released run: records dropped by bounding / accepted
  std::vector<TriggerMetrics> per_trigger;           // triggers 0..trigger of the window
  std::uint64_t truth_rows_read = 0, released_rows_read = 0;
};

// Throws InputError (missing or malformed files, runs of different streams) or ConfigError (an
// option that does not fit the data: --window, --trigger, --column), each naming what to change.
EvaluateResult evaluate(const EvaluateOptions& options);

// {"truth", "released", "mode", "release_rows", "column", "window", "trigger", "keys_released",
//  "linf", "l1", "l2", "truth_keys", "truth_total", "truth_max", "dropped_share", "per_trigger"}
nlohmann::ordered_json evaluate_json(const EvaluateResult& r);
// Header, final metrics and a per-trigger table (every trigger, or about 10 and the last).
std::string evaluate_text(const EvaluateResult& r, bool every_trigger);

// Decimal text of a release column (as format_fixed writes it) to the engine's fixed point, the
// way the engine reads its own text back: to_fixed(correctly rounded double). Empty = no value.
enum class FixedParse { Ok, Empty, Bad, NonFinite, OutOfRange };
FixedParse parse_fixed_text(std::string_view text, std::int64_t& out);

}  // namespace dpstream
