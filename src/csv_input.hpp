// CSV input: header with columns user_id, key, value, timestamp (any order; other columns are
// ignored). Each rank maps the file and parses the lines that start in its byte range, so the
// file is read once in parallel. Fields may be quoted (RFC 4180, "" escapes a quote) but not
// contain line breaks. Ids are keyed PRF values of the strings (src/id_prf.hpp, docs/PRIVACY.md section 9).
#pragma once

#include <algorithm>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shuffle/comm.hpp"
#include "src/config.hpp"
#include "src/id_prf.hpp"
#include "src/record_source.hpp"
#include "src/stream_clock.hpp"

namespace dpstream {

// Read-only mapping of a whole file (RAII); throws InputError naming the file. A file that shrinks while mapped would
// raise SIGBUS where its lost pages are read: while a MappedFile lives, that ends the process with exit code
// kExitInput and a line naming the file, not a crash (up to 16 files mapped at once; more are unguarded).
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  std::string_view view() const { return {data_ ? data_ : "", size_}; }

 private:
  int fd_ = -1;
  const char* data_ = nullptr;
  std::size_t size_ = 0;
  int guard_ = -1;  // its slot in the SIGBUS guard, or -1
};

// One field of a CSV line: the text between the quotes when quoted, "" still doubled when `escaped`.
struct CsvField {
  std::string_view text;
  bool quoted = false;
  bool escaped = false;  // holds "" (a quoted quote)
};

// The RFC 4180 fields of one line (without its line break), one at a time: the grammar shared by
// the input reader and `dpstream evaluate`, which apply their own checks and messages to each field.
// A line has at least one field; a comma always starts one more ("a," has two).
class CsvFieldReader {
 public:
  enum class Error { None, UnterminatedQuote, TextAfterQuote };
  explicit CsvFieldReader(std::string_view line) : line_(line) {}
  bool more() const { return !done_; }  // another field follows
  // Reads the next field; false at the end of the line or on malformed quoting (then error() says which).
  bool next(CsvField& f);
  Error error() const { return error_; }
  int count() const { return count_; }  // fields started so far, a malformed one included

 private:
  bool end_field(std::size_t end);
  bool fail(Error e);

  std::string_view line_;
  std::size_t pos_ = 0;
  bool done_ = false;
  int count_ = 0;
  Error error_ = Error::None;
};

// A field's value: a doubled quote "" becomes one.
std::string unescape(const CsvField& f);

// Splits one CSV line (without its line break) into unescaped fields; false if quoting is malformed or a quote
// stands in an unquoted field.
bool split_csv_line(std::string_view line, std::vector<std::string>& fields);

// A header line's columns (split_csv_line after a trailing CR and a leading UTF-8 byte order mark are removed:
// spreadsheets write one, and it would otherwise be part of the first column's name).
bool split_csv_header(std::string_view line, std::vector<std::string>& fields);

// The byte range [begin, end) of the file whose lines this rank parses: the lines whose first byte
// lies in its equal share of the body (after the header line ending at header_end).
std::pair<std::size_t, std::size_t> csv_share_of(std::string_view all, std::size_t header_end, int rank, int ranks);

// Calls fn(offset, line) for every non-blank line (line break and trailing CR removed) starting in [begin, end).
template <class Fn>
void for_each_csv_line(std::string_view all, std::size_t begin, std::size_t end, Fn&& fn) {
  for (std::size_t pos = begin; pos < end && pos < all.size();) {
    const std::size_t nl = std::min(all.find('\n', pos), all.size());
    std::string_view line = all.substr(pos, nl - pos);
    const std::size_t offset = pos;
    pos = nl + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (!line.empty()) fn(offset, line);  // blank lines carry no record
  }
}

// The 1-based line number of the byte at `offset` (for error messages).
std::size_t line_number_of(std::string_view file, std::size_t offset);

// Text of the input as an error message quotes it: its first `limit` bytes (then "..."), control bytes written as
// \xNN, so that a binary or hostile file cannot send escape sequences to the user's terminal.
std::string quoted_row(std::string_view line, std::size_t limit = 200);
// A header's columns as a message lists them: comma-separated, quoted as above, whole up to kQuotedHeaderBytes (a
// real header, so that the user sees every column; beyond, a file whose lines do not end in \n read as one "header",
// whose rows would go into the message and the logs).
inline constexpr std::size_t kQuotedHeaderBytes = 4096;
std::string quoted_header(const std::vector<std::string>& columns);

// A number field: decimal or scientific notation with an optional sign (std::from_chars, plus one leading +),
// finite (too small rounds to 0); no hexadecimal, no surrounding spaces.
enum class NumberCheck { Ok, NotANumber, Overflows, NotFinite };
NumberCheck parse_finite_number(const std::string& text, double& value);
const char* number_problem(NumberCheck c);  // e.g. "is not a number"

// Checks that the file exists, is readable and has the required header columns; throws
// InputError saying what is wrong. Cheap: every rank calls it before the first collective.
void check_csv_file(const std::string& path);

// Refuses (InputError) an input path that names a directory, or a device, FIFO or socket: read as a stream, /dev/zero
// never ends and a FIFO blocks at its open. `fix` says what to give instead, e.g. "set [input] path to a CSV file".
// A missing path passes (its open says so).
void refuse_non_regular_input(const std::string& path, std::string_view fix);

// Refuses (InputError) a header that names column `name` more than once: which one is read would be ambiguous.
void refuse_repeated_column(const std::string& path, const std::vector<std::string>& header, const std::string& name);

class CsvSource final : public RecordSource {
 public:
  // Parses this rank's share of the file, mapping ids with `ids`. Throws InputError on the first bad
  // row when the policy is "fail"; counts bad rows otherwise. separate_ids must follow.
  CsvSource(const JobConfig& config, int rank, int ranks, IdPrf& ids);
  // Collective over the ranks that parse the file: distinct user ids (and keys) that share their
  // 64-bit id get distinct ids (separate_colliding_ids), then the records are put in time order.
  void separate_ids(const shuffle::Comm& comm);
  const std::vector<Record>& records() const { return records_; }  // accepted, in time order once separated

  std::vector<Record> take_trigger(std::int64_t window, std::uint32_t trigger) override;
  const InputStats& stats() const override { return stats_; }
  std::uint32_t triggers_per_window() const override { return clock_.triggers; }
  const absl::flat_hash_map<std::uint64_t, std::string>& key_names() const override { return names_; }
  bool has_string_keys() const override { return true; }
  bool has_window(std::int64_t window) const override;
  void skip_to(std::int64_t first_window, std::int64_t window, std::uint32_t trigger) override;

 private:
  JobConfig config_;
  StreamClock clock_;
  std::vector<Record> records_;                          // accepted records, sorted by timestamp once ids are separated
  std::vector<std::uint64_t> user_checks_, key_checks_;  // the checks of records_' ids until then
  bool separated_ = false;
  std::size_t next_ = 0;
  absl::flat_hash_map<Id128, std::string> parsed_names_;  // until separate_ids
  absl::flat_hash_map<std::uint64_t, std::string> names_;
  InputStats stats_;
};

// For a job with [stream] windows_from_input: sets first_window and windows to the span of the
// windows holding accepted records of `source` on any rank (a source of such a job accepts windows
// 0..kMaxWindow), or window 0 alone when there is none. Collective; after separate_ids.
void resolve_windows_from_input(JobConfig& config, const CsvSource& source, const shuffle::Comm& comm);

}  // namespace dpstream
