// Where a rank's records come from, one trigger at a time: the synthetic generator or a CSV file.
#pragma once

#include <absl/container/flat_hash_map.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/record.hpp"

namespace dpstream {

struct InputStats {
  std::uint64_t rows = 0;           // data rows (or generated records) read by this rank
  std::uint64_t malformed = 0;      // wrong field count, unparsable number, empty id
  std::uint64_t non_finite = 0;     // NaN or infinite value
  std::uint64_t out_of_window = 0;  // timestamp outside the job's windows
  std::uint64_t accepted() const { return rows - malformed - non_finite - out_of_window; }
};

class RecordSource {
 public:
  virtual ~RecordSource() = default;
  // This rank's records of trigger `trigger` of window `window` (windows and triggers are
  // visited in increasing order).
  virtual std::vector<Record> take_trigger(std::int64_t window, std::uint32_t trigger) = 0;
  virtual const InputStats& stats() const = 0;
  // Resume: moves past every trigger before (window, trigger), counting its rows in stats() as if
  // they had been read, without keeping them.
  virtual void skip_to(std::int64_t first_window, std::int64_t window, std::uint32_t trigger) {
    for (std::int64_t w = first_window; w < window; ++w)
      for (std::uint32_t t = 0; t < triggers_per_window(); ++t) take_trigger(w, t);
    for (std::uint32_t t = 0; t < trigger; ++t) take_trigger(window, t);
  }
  virtual std::uint32_t triggers_per_window() const = 0;
  // False only when this rank certainly has no record in `window` (lets a job skip empty windows).
  virtual bool has_window(std::int64_t /*window*/) const { return true; }
  // Names of string keys read by this rank (CSV input); empty for integer keys.
  virtual const absl::flat_hash_map<std::uint64_t, std::string>& key_names() const { return no_names_; }
  virtual bool has_string_keys() const { return false; }
  // Distinct users a window of the whole input (all ranks) holds, when known in advance (0: unknown):
  // the user tables are sized for them at the window's start instead of growing step by step.
  virtual std::uint64_t users_per_window() const { return 0; }
  // Distinct keys a window of the whole input is expected to touch (0: unknown), likewise for the key
  // tables; an estimate: a table above it grows as before.
  virtual std::uint64_t keys_per_window() const { return 0; }
  // Records a window of the whole input is expected to keep (at most C per user; 0: unknown): an upper
  // bound on its (user, key) pairs, which size the user tables with users_per_window.
  virtual std::uint64_t kept_records_per_window() const { return 0; }

 private:
  absl::flat_hash_map<std::uint64_t, std::string> no_names_;
};

}  // namespace dpstream
