// Fuzzes the CSV reader (src/csv_input.cpp): split_csv_line on every line, check_csv_file,
// CsvSource's shares of 1-3 ranks over the fuzz input written to a
// file (each share's ids separated and its windows resolved on this single MPI process, as the unit tests do). Bad
// input may only end in InputError. Properties checked beyond "no crash":
//  - a line that splits re-splits to the same fields after quoting them again;
//  - every rank's accepted records come out of take_trigger exactly once, in their (window, trigger);
//  - with bad_rows = "skip", the ranks' shares add up to what a single rank reads (no row lost or
//    read twice at the byte-range boundaries).
// Input: byte 0 chooses the job (bit 0: bad_rows = "fail"; bits 1-2: ranks; bit 3: the largest
// window and first_window the job spec allows; bit 4: windows from the input, as a CSV job without
// [stream] first_window and windows), the rest is the file.
#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "shuffle/comm.hpp"
#include "src/config.hpp"
#include "src/csv_input.hpp"
#include "src/errors.hpp"
#include "src/id_prf.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using namespace dpstream;

namespace {

void check_split(std::string_view text) {
  std::vector<std::string> fields, again;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const std::size_t nl = std::min(text.find('\n', pos), text.size());
    const std::string_view line = text.substr(pos, nl - pos);
    pos = nl + 1;
    if (!split_csv_line(line, fields)) continue;
    if (fields.empty()) fuzz::property_failed("split_csv_line returned no field");
    std::string quoted;
    for (std::size_t i = 0; i < fields.size(); ++i) {
      if (i) quoted += ',';
      quoted += '"';
      for (char c : fields[i]) quoted += c == '"' ? std::string("\"\"") : std::string(1, c);
      quoted += '"';
    }
    if (!split_csv_line(quoted, again) || again != fields)
      fuzz::property_failed("re-quoted fields do not split back to the same fields");
  }
}

struct Share {
  InputStats stats;
  std::set<std::uint64_t> offsets;  // positions of the accepted records
};

// This rank's share, drained trigger by trigger as the engine does (windows without rows skipped
// when they come from the input); false when the reader refused the input.
bool read_share(const JobConfig& job, int rank, int ranks, Share& out) {
  try {
    IdPrf ids(noise::secret_from_seed(1));
    CsvSource source(job, rank, ranks, ids);
    source.separate_ids(shuffle::Comm());
    JobConfig config = job;  // windows from the input: this share's span (the engine reduces over ranks)
    resolve_windows_from_input(config, source, shuffle::Comm());
    if (config.stream.windows_from_input &&
        (config.stream.first_window < 0 || config.stream.windows < 1 ||
         config.stream.first_window + config.stream.windows > StreamConfig::kMaxWindow + 1))
      fuzz::property_failed("windows resolved from the input lie outside 0..kMaxWindow");
    const StreamClock clock{config.stream.window_seconds, config.stream.triggers};
    std::uint64_t taken = 0;
    for (std::int64_t w = config.stream.first_window; w < config.stream.first_window + config.stream.windows; ++w) {
      if (config.stream.windows_from_input && w + 1 < config.stream.first_window + config.stream.windows &&
          !source.has_window(w))
        continue;
      for (std::uint32_t t = 0; t < config.stream.triggers; ++t)
        for (const Record& r : source.take_trigger(w, t)) {
          if (clock.window_of(r.timestamp) != w || clock.trigger_of(r.timestamp) != t)
            fuzz::property_failed("take_trigger returned a record of another trigger");
          if (!out.offsets.insert(r.position).second) fuzz::property_failed("a row was returned twice");
          ++taken;
        }
    }
    out.stats = source.stats();
    if (taken != out.stats.accepted()) fuzz::property_failed("accepted records and records taken differ");
    return true;
  } catch (const InputError&) {
    return false;
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // One process: ids are separated on a 1-rank world. Never finalized (MPI_Finalize at exit leaves
  // threads that LeakSanitizer cannot stop).
  static const auto* mpi = new shuffle::MpiSession(*argc, *argv);
  (void)mpi;
  return 0;
}

// Open MPI keeps allocations from MPI_Init to the end: leaks are checked after each input (where the
// reader's own would show) but not at exit.
extern "C" const char* __lsan_default_options() { return "leak_check_at_exit=0"; }

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::uint8_t opts = data[0];
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  check_split(text);

  const auto path = fuzz::scratch_dir() / "input.csv";
  fuzz::write_file(path, text.data(), text.size());
  try {
    check_csv_file(path.string());
  } catch (const InputError&) {
  }

  JobConfig config;
  config.input.kind = InputKind::Csv;
  config.input.path = path.string();
  config.input.bad_rows = (opts & 1) ? BadRowPolicy::Fail : BadRowPolicy::Skip;
  const int ranks = 1 + (opts >> 1 & 3) % 3;
  if (opts & 8) {  // the limits of parse_job: window_seconds <= 2^40, first_window <= 2^20
    config.stream = {
        .window_seconds = std::int64_t{1} << 40, .triggers = 1000, .first_window = std::int64_t{1} << 20, .windows = 2};
  } else {
    config.stream = {.window_seconds = 100, .triggers = 4, .first_window = 0, .windows = 3};
  }
  config.stream.windows_from_input = (opts & 16) != 0;

  std::vector<Share> shares(ranks);
  bool all_read = true;
  for (int r = 0; r < ranks; ++r) all_read = read_share(config, r, ranks, shares[r]) && all_read;
  if (ranks > 1 && all_read && config.input.bad_rows == BadRowPolicy::Skip) {
    Share whole;
    if (!read_share(config, 0, 1, whole)) return 0;
    InputStats sum;
    std::set<std::uint64_t> offsets;
    for (const auto& s : shares) {
      sum.rows += s.stats.rows;
      sum.malformed += s.stats.malformed;
      sum.non_finite += s.stats.non_finite;
      sum.out_of_window += s.stats.out_of_window;
      offsets.insert(s.offsets.begin(), s.offsets.end());
    }
    if (sum.rows != whole.stats.rows || sum.malformed != whole.stats.malformed ||
        sum.non_finite != whole.stats.non_finite || sum.out_of_window != whole.stats.out_of_window ||
        offsets != whole.offsets)
      fuzz::property_failed("the ranks' shares of the file do not add up to a single rank's reading");
  }
  return 0;
}
