#include "src/csv_input.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <absl/container/flat_hash_set.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>

#include "partition/hash.hpp"
#include "src/errors.hpp"

namespace dpstream {

namespace {

const std::vector<std::string> kRequiredColumns = {"user_id", "key", "value", "timestamp"};

struct Columns {
  std::size_t user, key, value, timestamp, count;
};

}  // namespace

void refuse_repeated_column(const std::string& path, const std::vector<std::string>& header, const std::string& name) {
  const auto first = std::find(header.begin(), header.end(), name);
  if (first == header.end()) return;
  const auto second = std::find(first + 1, header.end(), name);
  if (second != header.end())
    throw InputError(
        fmt::format("{}: the header names column '{}' twice (columns {} and {}), so which one is read "
                    "is ambiguous; rename one of them",
                    path, name, first - header.begin() + 1, second - header.begin() + 1));
}

namespace {

Columns parse_header(const std::string& path, std::string_view header) {
  // A carriage return not ending the line: the file's lines end in bare CR, so it reads as one line.
  if (const std::size_t cr = header.find('\r'); cr != std::string_view::npos && cr + 1 < header.size())
    throw InputError(fmt::format(
        "{}: the header line holds a carriage return before its end: the file's lines end in a bare CR (old Mac "
        "line ends), not LF or CRLF; convert them, e.g. tr '\\r' '\\n' < FILE > FILE.csv",
        path));
  std::vector<std::string> fields;
  if (!split_csv_header(header, fields))
    throw InputError(fmt::format("{}: the header line is not valid CSV (unbalanced quotes)", path));
  std::size_t idx[4];
  for (std::size_t c = 0; c < 4; ++c) {
    const auto it = std::find(fields.begin(), fields.end(), kRequiredColumns[c]);
    if (it == fields.end())
      throw InputError(
          fmt::format("{}: missing column '{}' in the header (found: {}); the header must name "
                      "user_id,key,value,timestamp",
                      path, kRequiredColumns[c], quoted_header(fields)));
    idx[c] = static_cast<std::size_t>(it - fields.begin());
    refuse_repeated_column(path, fields, *it);
  }
  return Columns{idx[0], idx[1], idx[2], idx[3], fields.size()};
}

bool parse_timestamp(std::string_view text, std::int64_t& ts) {
  const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), ts);
  return ec == std::errc() && p == text.data() + text.size() && !text.empty();
}

}  // namespace

std::pair<std::size_t, std::size_t> csv_share_of(std::string_view all, std::size_t header_end, int rank, int ranks) {
  const std::size_t body = std::min(header_end + 1, all.size());
  const std::size_t span = all.size() - body;
  std::size_t begin = body + span * static_cast<std::size_t>(rank) / static_cast<std::size_t>(ranks);
  const std::size_t end = body + span * static_cast<std::size_t>(rank + 1) / static_cast<std::size_t>(ranks);
  if (begin > body && begin < all.size() && all[begin - 1] != '\n') {
    const std::size_t nl = all.find('\n', begin);
    begin = nl == std::string_view::npos ? all.size() : nl + 1;
  }
  return {begin, end};
}

std::size_t line_number_of(std::string_view file, std::size_t offset) {
  return 1 +
         static_cast<std::size_t>(std::count(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(offset), '\n'));
}

NumberCheck parse_finite_number(const std::string& text, double& value) {
  // from_chars takes no leading '+', strtod does: skip one before a digit or a point.
  const char* first = text.data();
  if (text.size() > 1 && text[0] == '+' && (std::isdigit(static_cast<unsigned char>(text[1])) || text[1] == '.'))
    ++first;
  const auto [p, ec] = std::from_chars(first, text.data() + text.size(), value);
  if (ec == std::errc::result_out_of_range && p == text.data() + text.size()) {
    // Too large is infinite; too small (1e-400) is a finite value that rounds to 0.
    value = std::strtod(text.c_str(), nullptr);
    if (std::isinf(value)) return NumberCheck::Overflows;
  } else if (ec != std::errc() || p != text.data() + text.size() || first == text.data() + text.size()) {
    return NumberCheck::NotANumber;
  }
  return std::isfinite(value) ? NumberCheck::Ok : NumberCheck::NotFinite;
}

const char* number_problem(NumberCheck c) {
  switch (c) {
    case NumberCheck::Ok:
      return "is a number";
    case NumberCheck::NotANumber:
      return "is not a number";
    case NumberCheck::Overflows:
      return "overflows a double";
    case NumberCheck::NotFinite:
      return "is not finite";
  }
  return "is not a number";
}

namespace {

// Mappings a SIGBUS may come from: their range and the line to print, published by `begin` (release) once the rest
// is written. Read by the signal handler, which makes async-signal-safe calls only (write, _exit, sigaction, raise).
constexpr int kGuardedMappings = 16;
struct GuardedMapping {
  std::atomic<const char*> begin{nullptr};
  std::atomic<std::size_t> size{0};
  std::atomic<bool> claimed{false};
  std::atomic<std::size_t> length{0};  // of message
  char message[768] = {};
};
GuardedMapping g_guarded[kGuardedMappings];
struct sigaction g_previous_sigbus {};

extern "C" void on_sigbus(int, siginfo_t* info, void*) {
  const bool fault = info->si_code > 0;  // raised by the kernel (si_addr is the address), not sent by kill(2)
  const char* at = static_cast<const char*>(info->si_addr);
  for (const GuardedMapping& g : g_guarded) {
    const char* begin = g.begin.load(std::memory_order_acquire);
    if (fault && begin != nullptr && at >= begin && at < begin + g.size.load(std::memory_order_relaxed)) {
      const ssize_t ignored = ::write(STDERR_FILENO, g.message, g.length.load(std::memory_order_relaxed));
      (void)ignored;
      ::_exit(kExitInput);
    }
  }
  // Not a guarded file's: handled as before. A fault repeats when the instruction does; a sent signal is sent again.
  ::sigaction(SIGBUS, &g_previous_sigbus, nullptr);
  if (!fault) ::raise(SIGBUS);
}

// Guards [data, data + size) of `path`; returns its slot, or -1 when every slot is taken. The handler is installed
// on first use (after MPI_Init: Open MPI's own handler stays in place for every other SIGBUS).
int guard_mapping(const char* data, std::size_t size, const std::string& path) {
  static std::once_flag installed;
  std::call_once(installed, [] {
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGBUS, &sa, &g_previous_sigbus);
  });
  for (int i = 0; i < kGuardedMappings; ++i) {
    GuardedMapping& g = g_guarded[i];
    bool free = false;
    if (!g.claimed.compare_exchange_strong(free, true)) continue;
    const std::string line = fmt::format(
        "dpstream: input error: input file {} shrank while it was read (its end was cut off): keep the input "
        "unchanged until the job ends, then run again\n",
        path.substr(0, 512));
    const std::size_t length = std::min(line.size(), sizeof g.message);
    std::memcpy(g.message, line.data(), length);
    g.length.store(length, std::memory_order_relaxed);
    g.size.store(size, std::memory_order_relaxed);
    g.begin.store(data, std::memory_order_release);
    return i;
  }
  return -1;
}

void unguard_mapping(int slot) {
  if (slot < 0) return;
  g_guarded[slot].begin.store(nullptr, std::memory_order_release);
  g_guarded[slot].claimed.store(false, std::memory_order_release);
}

}  // namespace

MappedFile::MappedFile(const std::string& path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw InputError(fmt::format("cannot open input file {}: {}", path, errno_text(errno)));
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    throw InputError(fmt::format("input {} is not a regular file", path));
  }
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd_, 0);
    if (p == MAP_FAILED) {
      ::close(fd_);
      throw InputError(fmt::format("cannot map input file {}: {}", path, errno_text(errno)));
    }
    data_ = static_cast<const char*>(p);
    ::madvise(p, size_, MADV_SEQUENTIAL);
    guard_ = guard_mapping(data_, size_, path);
  }
}

MappedFile::~MappedFile() {
  unguard_mapping(guard_);  // before the range may be mapped again for something else
  if (data_) ::munmap(const_cast<char*>(data_), size_);
  if (fd_ >= 0) ::close(fd_);
}

bool CsvFieldReader::next(CsvField& f) {
  if (done_) return false;
  ++count_;
  const std::size_t n = line_.size(), i = pos_;
  f.escaped = false;
  f.quoted = i < n && line_[i] == '"';
  if (!f.quoted) {
    std::size_t k = i;
    while (k < n && line_[k] != ',') ++k;  // fields are short: cheaper than memchr
    f.text = line_.substr(i, k - i);
    return end_field(k);
  }
  for (std::size_t j = i + 1;;) {
    const void* q = j < n ? std::memchr(line_.data() + j, '"', n - j) : nullptr;
    if (!q) return fail(Error::UnterminatedQuote);
    const std::size_t k = static_cast<std::size_t>(static_cast<const char*>(q) - line_.data());
    if (k + 1 < n && line_[k + 1] == '"') {  // "" inside the quotes
      f.escaped = true;
      j = k + 2;
      continue;
    }
    f.text = line_.substr(i + 1, k - i - 1);
    if (k + 1 < n && line_[k + 1] != ',') return fail(Error::TextAfterQuote);
    return end_field(k + 1);
  }
}

// The field ends at `end`, the end of the line or a comma (which starts one more field).
bool CsvFieldReader::end_field(std::size_t end) {
  done_ = end >= line_.size();
  pos_ = end + 1;
  return true;
}

bool CsvFieldReader::fail(Error e) {
  error_ = e;
  done_ = true;
  return false;
}

std::string unescape(const CsvField& f) {
  if (!f.escaped) return std::string(f.text);
  std::string out;
  for (std::size_t i = 0; i < f.text.size(); ++i) {
    out += f.text[i];
    if (f.text[i] == '"') ++i;  // "" -> "
  }
  return out;
}

std::string quoted_header(const std::vector<std::string>& columns) {
  return quoted_row(fmt::to_string(fmt::join(columns, ",")), kQuotedHeaderBytes);
}

std::string quoted_row(std::string_view line, std::size_t limit) {
  std::string out = terminal_safe(line.substr(0, limit), /*line_breaks=*/false);
  if (line.size() > limit) out += "...";
  return out;
}

bool split_csv_header(std::string_view line, std::vector<std::string>& fields) {
  constexpr std::string_view kByteOrderMark = "\xEF\xBB\xBF";
  if (line.starts_with(kByteOrderMark)) line.remove_prefix(kByteOrderMark.size());
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  return split_csv_line(line, fields);
}

bool split_csv_line(std::string_view line, std::vector<std::string>& fields) {
  fields.clear();
  CsvFieldReader reader(line);
  CsvField f;
  while (reader.next(f)) {
    if (!f.quoted && f.text.find('"') != std::string_view::npos) return false;  // stray quote in an unquoted field
    fields.push_back(unescape(f));
  }
  return reader.error() == CsvFieldReader::Error::None;
}

void refuse_non_regular_input(const std::string& path, std::string_view fix) {
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(path, ec);
  if (std::filesystem::is_directory(st)) throw InputError(fmt::format("input file {} is a directory; {}", path, fix));
  if (std::filesystem::exists(st) && !std::filesystem::is_regular_file(st))
    throw InputError(fmt::format("input file {} is not a regular file (a device, FIFO or socket); {}", path, fix));
}

void check_csv_file(const std::string& path) {
  refuse_non_regular_input(path, "set [input] path to a CSV file");
  std::ifstream f(path, std::ios::binary);
  if (!f)
    throw InputError(fmt::format("cannot open input file {}: {}; set [input] path to an existing CSV file", path,
                                 errno_text(errno)));
  std::string header;
  if (!std::getline(f, header))
    throw InputError(fmt::format("{}: the file is empty; it needs a header user_id,key,value,timestamp", path));
  parse_header(path, header);
}

CsvSource::CsvSource(const JobConfig& config, int rank, int ranks, IdPrf& ids)
    : config_(config), clock_{config.stream.window_seconds, config.stream.triggers} {
  const std::string& path = config.input.path;
  MappedFile file(path);
  const std::string_view all = file.view();
  const std::size_t header_end = std::min(all.find('\n'), all.size());
  const Columns cols = parse_header(path, all.substr(0, header_end));

  const auto [begin, end] = csv_share_of(all, header_end, rank, ranks);

  // Windows from the input: any window a job may have (the span is resolved once every rank has parsed).
  const bool any_window = config.stream.windows_from_input;
  const std::int64_t first_window = any_window ? 0 : config.stream.first_window;
  const std::int64_t last_window =
      any_window ? StreamConfig::kMaxWindow + 1 : first_window + config.stream.windows;  // exclusive
  absl::flat_hash_map<std::string, Id128> key_ids;  // the ids of the key names seen so far
  std::vector<std::string> fields;
  auto bad = [&](std::uint64_t& counter, std::size_t offset, std::string_view line, const std::string& why) {
    ++counter;
    if (config_.input.bad_rows == BadRowPolicy::Fail)
      throw InputError(
          fmt::format("{}:{}: {} in row '{}' (set [input] bad_rows = \"skip\" to count and skip such rows)", path,
                      line_number_of(all, offset), why, quoted_row(line)));
  };

  for_each_csv_line(all, begin, end, [&](std::size_t offset, std::string_view line) {
    ++stats_.rows;
    if (!split_csv_line(line, fields)) {
      bad(stats_.malformed, offset, line, "unbalanced quotes");
      return;
    }
    if (fields.size() != cols.count) {
      bad(stats_.malformed, offset, line, fmt::format("{} fields where the header has {}", fields.size(), cols.count));
      return;
    }
    const std::string& user = fields[cols.user];
    const std::string& key = fields[cols.key];
    const std::string& vtext = fields[cols.value];
    const std::string& ttext = fields[cols.timestamp];
    if (user.empty() || key.empty()) {
      bad(stats_.malformed, offset, line, "empty user_id or key");
      return;
    }
    double value = 0;
    if (const NumberCheck c = parse_finite_number(vtext, value); c != NumberCheck::Ok) {
      bad(c == NumberCheck::NotANumber ? stats_.malformed : stats_.non_finite, offset, line,
          fmt::format("value '{}' {}", vtext, number_problem(c)));
      return;
    }
    std::int64_t ts = 0;
    if (!parse_timestamp(ttext, ts)) {
      bad(stats_.malformed, offset, line, fmt::format("timestamp '{}' is not an integer number of seconds", ttext));
      return;
    }
    const std::int64_t w = clock_.window_of(ts);
    if (w < first_window || w >= last_window) {
      bad(stats_.out_of_window, offset, line,
          fmt::format("timestamp {} lies in window {}, outside the job's windows [{}, {})", ts, w, first_window,
                      last_window));
      return;
    }
    // Keys repeat: each distinct name is mapped once (two names share a 128-bit id with probability ~2^-128).
    auto known = key_ids.find(key);
    if (known == key_ids.end()) {
      known = key_ids.emplace(key, ids(IdDomain::Key, key)).first;
      parsed_names_.try_emplace(known->second, key);
    }
    const Id128 key_id = known->second, user_id = ids(IdDomain::User, user);
    records_.push_back(Record{user_id.id, key_id.id, ts, static_cast<std::uint64_t>(offset), value});
    user_checks_.push_back(user_id.check);
    key_checks_.push_back(key_id.check);
  });
}

void CsvSource::separate_ids(const shuffle::Comm& comm) {
  // The distinct local ids of each kind; the keys' are those of parsed_names_ (one entry per key id).
  absl::flat_hash_set<Id128> users;
  for (std::size_t i = 0; i < records_.size(); ++i) users.insert({records_[i].user, user_checks_[i]});
  std::vector<Id128> keys;
  keys.reserve(parsed_names_.size());
  for (const auto& [id, name] : parsed_names_) keys.push_back(id);
  const auto user_moves = separate_colliding_ids({users.begin(), users.end()}, partition::kUserSalt, comm);
  const auto key_moves = separate_colliding_ids(keys, partition::kKeySalt, comm);
  absl::flat_hash_set<Id128>().swap(users);
  for (std::size_t i = 0; i < records_.size() && !(user_moves.empty() && key_moves.empty()); ++i) {
    if (const auto it = user_moves.find(Id128{records_[i].user, user_checks_[i]}); it != user_moves.end())
      records_[i].user = it->second;
    if (const auto it = key_moves.find(Id128{records_[i].key, key_checks_[i]}); it != key_moves.end())
      records_[i].key = it->second;
  }
  for (auto& [id, name] : parsed_names_) {
    const auto it = key_moves.find(id);
    names_.try_emplace(it == key_moves.end() ? id.id : it->second, std::move(name));
  }
  parsed_names_ = {};
  std::vector<std::uint64_t>().swap(user_checks_);
  std::vector<std::uint64_t>().swap(key_checks_);
  std::sort(records_.begin(), records_.end(),
            [](const Record& a, const Record& b) { return a.timestamp < b.timestamp; });
  separated_ = true;
}

void resolve_windows_from_input(JobConfig& config, const CsvSource& source, const shuffle::Comm& comm) {
  if (!config.stream.windows_from_input) return;
  const StreamClock clock{config.stream.window_seconds, config.stream.triggers};
  // This rank's records are in time order: its span is that of its first and last record.
  const auto& records = source.records();
  const std::int64_t lo = records.empty() ? StreamConfig::kMaxWindow + 1 : clock.window_of(records.front().timestamp);
  const std::int64_t hi = records.empty() ? -1 : clock.window_of(records.back().timestamp);
  // Both ends by one max-reduction each: max(offset - lo) = offset - min(lo); windows stay below 2^21.
  constexpr std::int64_t kOffset = std::int64_t{1} << 40;
  const auto first = kOffset - static_cast<std::int64_t>(comm.max(static_cast<std::uint64_t>(kOffset - lo)));
  const auto last = static_cast<std::int64_t>(comm.max(static_cast<std::uint64_t>(hi + 1))) - 1;
  config.stream.first_window = last < 0 ? 0 : first;
  config.stream.windows = last < 0 ? 1 : static_cast<std::uint32_t>(last - first + 1);
}

bool CsvSource::has_window(std::int64_t window) const {
  const auto it = std::lower_bound(records_.begin() + static_cast<std::ptrdiff_t>(next_), records_.end(), window,
                                   [&](const Record& r, std::int64_t w) { return clock_.window_of(r.timestamp) < w; });
  return it != records_.end() && clock_.window_of(it->timestamp) == window;
}

void CsvSource::skip_to(std::int64_t /*first_window*/, std::int64_t window, std::uint32_t trigger) {
  // Rows were counted when the file was parsed: skipping only moves past the records before (window, trigger).
  while (next_ < records_.size()) {
    const std::int64_t w = clock_.window_of(records_[next_].timestamp);
    if (w > window || (w == window && clock_.trigger_of(records_[next_].timestamp) >= trigger)) break;
    ++next_;
  }
}

std::vector<Record> CsvSource::take_trigger(std::int64_t window, std::uint32_t trigger) {
  if (!separated_) throw std::logic_error("CsvSource: separate_ids must run before the records are taken");
  // Records are sorted by timestamp, (window, trigger) is monotone in it, and triggers are
  // visited in increasing order: the trigger's records are the next run.
  const std::size_t first = next_;
  auto in_trigger = [&](std::int64_t ts) { return clock_.window_of(ts) == window && clock_.trigger_of(ts) == trigger; };
  while (next_ < records_.size() && in_trigger(records_[next_].timestamp)) ++next_;
  return {records_.begin() + static_cast<std::ptrdiff_t>(first), records_.begin() + static_cast<std::ptrdiff_t>(next_)};
}

}  // namespace dpstream
