#include "tools/evaluate.hpp"

#include <absl/container/flat_hash_map.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <utility>

#include "common/bounded_json.hpp"
#include "common/int128.hpp"
#include "common/prefetch.hpp"
#include "common/record.hpp"
#include "src/config.hpp"
#include "src/csv_input.hpp"
#include "src/errors.hpp"

namespace dpstream {

namespace {

namespace fs = std::filesystem;
using u128 = uint128;  // common/int128.hpp

constexpr std::string_view kHeader = "window,trigger,key,count,sum";
constexpr std::size_t kChunk = std::size_t{4} << 20;     // read() size
constexpr std::size_t kMaxLine = std::size_t{64} << 20;  // longest line accepted
// |value| below 2^43 (the engine's own bound on a sum), so fixed point and differences fit 64 bits.
constexpr double kMaxAbsValue = 8796093022208.0;

std::string shown(std::string_view s) {  // a field as quoted in a message, cut if long
  return s.size() <= 60 ? fmt::format("'{}'", s) : fmt::format("'{}...'", s.substr(0, 57));
}

// ---- summary.json ----

struct RunInfo {
  std::string role;  // "--truth" or "--released"
  fs::path dir, releases, summary;
  nlohmann::json json;
  std::string mode;
  std::string release_rows = "running";
  bool increments = false;
  std::optional<std::uint64_t> read, accepted, dropped, clamped, triggers_total, windows;
  std::optional<std::int64_t> first_window;
  std::optional<std::uint32_t> triggers;  // per window
};

const nlohmann::json* find_path(const nlohmann::json& j, std::initializer_list<const char*> path) {
  const nlohmann::json* cur = &j;
  for (const char* p : path) {
    if (!cur->is_object()) return nullptr;
    auto it = cur->find(p);
    if (it == cur->end()) return nullptr;
    cur = &*it;
  }
  return cur;
}

std::string dotted(std::initializer_list<const char*> path) {
  std::string s;
  for (const char* p : path) {
    if (!s.empty()) s += '.';
    s += p;
  }
  return s;
}

std::optional<std::int64_t> opt_int(const RunInfo& run, std::initializer_list<const char*> path, std::int64_t lo) {
  const nlohmann::json* v = find_path(run.json, path);
  if (!v || v->is_null()) return std::nullopt;
  if (!v->is_number_integer() || v->get<std::int64_t>() < lo)
    throw InputError(
        fmt::format("{}: \"{}\" is {}, expected an integer >= {}; the file is damaged or not a dpstream "
                    "summary.json",
                    run.summary.string(), dotted(path), v->dump(), lo));
  return v->get<std::int64_t>();
}

RunInfo read_run(const std::string& dir, const char* role) {
  RunInfo run;
  run.role = role;
  run.dir = dir;
  std::error_code ec;
  if (dir.empty())
    throw ConfigError(fmt::format("{} needs a directory (the output directory of a dpstream run)", role));
  if (!fs::is_directory(dir, ec))
    throw InputError(fmt::format("{} {}: {}; give the output directory of a finished `dpstream run`", role, dir,
                                 fs::exists(dir, ec) ? "not a directory" : "no such directory"));
  run.releases = run.dir / "releases.csv";
  run.summary = run.dir / "summary.json";
  if (!fs::is_regular_file(run.releases, ec))
    throw InputError(
        fmt::format("{}: not found; {} must be the output directory of a `dpstream run`", run.releases.string(), role));
  if (!fs::is_regular_file(run.summary, ec))
    throw InputError(fmt::format(
        "{}: not found; {} must be the output directory of a finished `dpstream run` (summary.json appears when "
        "the job completes: finish an interrupted job with `dpstream run ... --resume`)",
        run.summary.string(), role));
  std::ifstream in(run.summary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) throw InputError(fmt::format("{}: cannot read", run.summary.string()));
  try {
    run.json = parse_bounded_json(text.str());
  } catch (const std::exception& e) {  // invalid, or nested beyond what a summary holds
    throw InputError(
        fmt::format("{}: not valid JSON ({}); the file is damaged, rerun the job", run.summary.string(), e.what()));
  }
  if (!run.json.is_object())
    throw InputError(fmt::format("{}: not a JSON object; rerun the job", run.summary.string()));
  const nlohmann::json* mode = find_path(run.json, {"mode"});
  if (!mode || !mode->is_string())
    throw InputError(fmt::format("{}: no \"mode\" string; is this a dpstream summary.json?", run.summary.string()));
  run.mode = mode->get<std::string>();
  // How rows combine: "release_values" (the engine's summary.json; "release_rows" is its row count
  // there), or a string "release_rows" (hand-made or other tools' summaries). Absent: running.
  const char* field = "release_values";
  const nlohmann::json* rr = find_path(run.json, {"release_values"});
  if (!rr || rr->is_null()) {
    field = "release_rows";
    rr = find_path(run.json, {"release_rows"});
  }
  if (rr && !rr->is_null()) {
    if (rr->is_string()) {
      run.release_rows = rr->get<std::string>();
      if (run.release_rows != "running" && run.release_rows != "increments")
        throw InputError(fmt::format("{}: \"{}\" is \"{}\"; expected \"running\" or \"increments\"",
                                     run.summary.string(), field, run.release_rows));
    } else if (!rr->is_number_integer() ||
               (run.mode != to_string(PrivacyMode::None) && run.mode != to_string(PrivacyMode::Dp))) {
      // A row count (summaries before "release_values"): only the modes of that time (none, dp)
      // are known to have running rows.
      throw InputError(
          fmt::format("{}: \"{}\" is {}, and no \"release_values\" says whether mode \"{}\" rows are "
                      "\"running\" or \"increments\"; rerun the job with this dpstream",
                      run.summary.string(), field, rr->dump(), run.mode));
    }
  }
  run.increments = run.release_rows == "increments";
  auto u = [&](std::initializer_list<const char*> p) -> std::optional<std::uint64_t> {
    auto v = opt_int(run, p, 0);
    return v ? std::optional<std::uint64_t>(static_cast<std::uint64_t>(*v)) : std::nullopt;
  };
  run.read = u({"records", "read"});
  run.accepted = u({"records", "accepted"});
  run.dropped = u({"records", "dropped_by_bounding"});
  run.clamped = u({"records", "clamped"});
  run.triggers_total = u({"triggers"});
  // Triggers per window: a "stream" section when the summary has one, else the DP plan's trees.
  auto per_window = u({"stream", "triggers"});
  if (!per_window) per_window = u({"privacy", "trees", "triggers"});
  if (per_window) {
    if (*per_window == 0 || *per_window > std::numeric_limits<std::uint32_t>::max())
      throw InputError(fmt::format("{}: {} triggers per window is out of range", run.summary.string(), *per_window));
    run.triggers = static_cast<std::uint32_t>(*per_window);
  }
  run.windows = u({"stream", "windows"});
  run.first_window = opt_int(run, {"stream", "first_window"}, std::numeric_limits<std::int64_t>::min());
  if (!run.windows && run.triggers && run.triggers_total && *run.triggers_total % *run.triggers == 0)
    run.windows = *run.triggers_total / *run.triggers;
  return run;
}

template <class T>
void same(const RunInfo& truth, const RunInfo& rel, const std::optional<T>& a, const std::optional<T>& b,
          std::string_view what) {
  if (a && b && *a != *b)
    throw InputError(fmt::format(
        "the two runs are not of the same stream: {} is {} in {} but {} in {}; evaluate a released run against the "
        "mode \"none\" run of the same job and input",
        what, *a, truth.summary.string(), *b, rel.summary.string()));
}

// ---- releases.csv, streamed ----

using Field = CsvField;  // the shared RFC 4180 splitter's field (src/csv_input.hpp)

class RowReader {
 public:
  RowReader(const RunInfo& run, std::optional<std::uint32_t> triggers, std::optional<std::int64_t> first_window,
            std::optional<std::uint64_t> windows)
      : path_(run.releases.string()),
        role_(run.role),
        triggers_(triggers),
        first_window_(first_window),
        windows_(windows) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw InputError(fmt::format("{}: cannot open: {}", path_, errno_text(errno)));
    ::posix_fadvise(fd_, 0, 0, POSIX_FADV_SEQUENTIAL);
    buf_.resize(kChunk);
    std::string_view header;
    if (!next_line(header))
      throw InputError(
          fmt::format("{}: the file is empty; expected the header line {} (is this a dpstream "
                      "releases.csv?)",
                      path_, kHeader));
    if (header != kHeader)
      fail(fmt::format("the header is {}, expected {}; is this a dpstream releases.csv?", shown(header), kHeader));
  }
  ~RowReader() {
    if (fd_ >= 0) ::close(fd_);
  }
  RowReader(const RowReader&) = delete;
  RowReader& operator=(const RowReader&) = delete;

  // The next data row (blank lines are skipped); false at the end of the file.
  bool next() {
    std::string_view line;
    do {
      if (!next_line(line)) return has_ = false;
    } while (line.empty());
    split(line);
    window_ = parse_int<std::int64_t>(fields_[0], "window");
    trigger_ = parse_int<std::uint32_t>(fields_[1], "trigger");
    if (triggers_ && trigger_ >= *triggers_)
      fail(fmt::format("trigger {} is out of range: the run has {} triggers per window (0..{})", trigger_, *triggers_,
                       *triggers_ - 1));
    if (first_window_ && windows_ &&
        (window_ < *first_window_ || static_cast<std::uint64_t>(window_ - *first_window_) >= *windows_))
      fail(fmt::format("window {} is out of range: the run has windows {}..{}", window_, *first_window_,
                       *first_window_ + static_cast<std::int64_t>(*windows_) - 1));
    if (rows_ > 0 && (window_ < prev_window_ || (window_ == prev_window_ && trigger_ < prev_trigger_)))
      fail(
          fmt::format("rows out of order: window {} trigger {} after window {} trigger {}; rows must be sorted by "
                      "(window, trigger) as dpstream writes them",
                      window_, trigger_, prev_window_, prev_trigger_));
    prev_window_ = window_;
    prev_trigger_ = trigger_;
    ++rows_;
    return has_ = true;
  }

  bool has() const { return has_; }
  bool in(std::int64_t w) const { return has_ && window_ == w; }
  std::int64_t window() const { return window_; }
  std::uint32_t trigger() const { return trigger_; }
  const Field& key() const { return fields_[2]; }
  const Field& column(EvalColumn c) const { return fields_[c == EvalColumn::Count ? 3 : 4]; }
  std::uint64_t line() const { return line_; }
  std::uint64_t rows() const { return rows_; }
  const std::string& path() const { return path_; }
  const std::string& role() const { return role_; }

  [[noreturn]] void fail(const std::string& what) const {
    throw InputError(fmt::format("{} line {}: {}", path_, line_, what));
  }

 private:
  bool next_line(std::string_view& line) {
    for (;;) {
      if (pos_ < end_) {
        const char* base = buf_.data();
        const void* nl = std::memchr(base + pos_ + scanned_, '\n', end_ - pos_ - scanned_);
        if (nl) {
          const std::size_t at = static_cast<std::size_t>(static_cast<const char*>(nl) - base);
          line = std::string_view(base + pos_, at - pos_);
          pos_ = at + 1;
          scanned_ = 0;
          ++line_;
          if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
          return true;
        }
        scanned_ = end_ - pos_;
      }
      if (eof_) {
        if (pos_ >= end_) return false;
        line = std::string_view(buf_.data() + pos_, end_ - pos_);  // a last line without a line break
        pos_ = end_;
        scanned_ = 0;
        ++line_;
        if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
        return true;
      }
      const std::size_t rest = end_ - pos_;
      if (pos_ > 0) {
        std::memmove(buf_.data(), buf_.data() + pos_, rest);
        pos_ = 0;
        end_ = rest;
      }
      if (end_ == buf_.size()) {
        if (buf_.size() >= kMaxLine) {
          ++line_;
          fail(fmt::format("a line longer than {} MiB; the file is damaged", kMaxLine >> 20));
        }
        buf_.resize(buf_.size() * 2);
      }
      ssize_t n;
      do n = ::read(fd_, buf_.data() + end_, buf_.size() - end_);
      while (n < 0 && errno == EINTR);
      if (n < 0) throw InputError(fmt::format("{}: read error: {}", path_, errno_text(errno)));
      if (n == 0) eof_ = true;
      end_ += static_cast<std::size_t>(n);
    }
  }

  // RFC 4180 fields without line breaks (CsvFieldReader); exactly 5.
  void split(std::string_view line) {
    CsvFieldReader reader(line);
    int nf = 0;
    while (reader.more()) {
      if (nf == 5)
        fail("more than 5 fields (window,trigger,key,count,sum); a key holding a comma must be quoted (RFC 4180)");
      Field& f = fields_[nf++];
      if (!reader.next(f))
        fail(reader.error() == CsvFieldReader::Error::UnterminatedQuote
                 ? fmt::format("field {} has an unterminated quote", nf)
                 : fmt::format("text after the closing quote of field {}", nf));
      if (nf == 3 && !f.quoted && f.text.find('"') != std::string_view::npos)
        fail(fmt::format("the key {} holds a quote but is not quoted (RFC 4180: quote the field, double the quote)",
                         shown(f.text)));
    }
    if (nf != 5) fail(fmt::format("{} field(s), expected 5 (window,trigger,key,count,sum)", nf));
  }

  template <class T>
  T parse_int(const Field& f, const char* what) const {
    T v{};
    const char* b = f.text.data();
    const char* e = b + f.text.size();
    if (f.text.size() <= 9 && !f.text.empty()) {  // common case: few digits, no sign
      std::uint32_t x = 0;
      const char* q = b;
      for (; q != e && static_cast<unsigned char>(*q - '0') < 10; ++q)
        x = x * 10 + static_cast<std::uint32_t>(*q - '0');
      if (q == e) return static_cast<T>(x);
    }
    auto [p, ec] = std::from_chars(b, e, v);
    if (f.text.empty() || ec != std::errc() || p != e)
      fail(fmt::format("{} {} is not an integer{}", what, shown(f.text),
                       std::is_signed_v<T> ? "" : " in 0..4294967295"));
    return v;
  }

  std::string path_, role_;
  std::optional<std::uint32_t> triggers_;
  std::optional<std::int64_t> first_window_;
  std::optional<std::uint64_t> windows_;
  int fd_ = -1;
  std::vector<char> buf_;
  std::size_t pos_ = 0, end_ = 0, scanned_ = 0;
  bool eof_ = false, has_ = false;
  std::uint64_t line_ = 0, rows_ = 0;
  Field fields_[5];
  std::int64_t window_ = 0, prev_window_ = 0;
  std::uint32_t trigger_ = 0, prev_trigger_ = 0;
};

// The window of the last data row (files are sorted by window): read from the end of the file.
std::optional<std::int64_t> last_window(const RunInfo& run) {
  std::ifstream in(run.releases, std::ios::binary);
  in.seekg(0, std::ios::end);
  const auto size = static_cast<std::int64_t>(in.tellg());
  for (std::int64_t span = 1 << 16;; span *= 4) {
    const std::int64_t from = std::max<std::int64_t>(0, size - span);
    std::string tail(static_cast<std::size_t>(size - from), '\0');
    in.seekg(from);
    in.read(tail.data(), static_cast<std::streamsize>(tail.size()));
    if (!in) throw InputError(fmt::format("{}: cannot read", run.releases.string()));
    while (!tail.empty() && (tail.back() == '\n' || tail.back() == '\r')) tail.pop_back();
    const auto nl = tail.rfind('\n');
    if (nl == std::string::npos && from > 0) continue;  // the last line is longer than the span
    const std::string_view line = std::string_view(tail).substr(nl == std::string::npos ? 0 : nl + 1);
    if (line.empty() || line == kHeader || (nl == std::string::npos && from == 0)) return std::nullopt;  // no rows
    std::string_view first = line.substr(0, line.find(','));
    if (first.size() >= 2 && first.front() == '"' && first.back() == '"') first = first.substr(1, first.size() - 2);
    std::int64_t w = 0;
    auto [p, ec] = std::from_chars(first.data(), first.data() + first.size(), w);
    if (ec != std::errc() || p != first.data() + first.size() || first.empty())
      throw InputError(
          fmt::format("{}: the last line {} does not start with a window number; the file is damaged "
                      "(or give --window)",
                      run.releases.string(), shown(line)));
    return w;
  }
}

// ---- the two histograms, per key ----

// Per-key state. Keys that are small canonical integers (the synthetic ids) live at their id in
// `direct_`, so a trigger's rows (sorted by key) walk it in order; other keys (strings, large or
// sparse ids) get dense slots through hash maps.
class KeyTable {
 public:
  struct Key {
    std::int64_t est = 0, truth = 0;               // fixed point
    std::uint32_t stamp_truth = 0, stamp_rel = 0;  // 1 + trigger of the key's last row in the window (0: none)
  };
  struct Ref {
    std::uint32_t index = 0;
    bool direct = false;
  };

  // The key's slot, added when new. A key is its text: a canonical decimal integer and its
  // quoted form are one key. `before_move` runs before slots move (a growing table takes over
  // ids from the hash map), so that the caller can first use the Refs it holds.
  template <class F>
  Ref find_or_add(const Field& key, F&& before_move) {
    const std::string_view t = key.text;
    std::uint64_t id = 0;
    if (!key.escaped && canonical_uint(t, id)) {
      if (id < direct_.size()) return {static_cast<std::uint32_t>(id), true};
      if (id < kDirectMax && id < 4 * (keys_ + 65536)) {
        if (!ints_.empty()) before_move();
        grow_direct(id);
        return {static_cast<std::uint32_t>(id), true};
      }
      auto [it, inserted] = ints_.try_emplace(id, static_cast<std::uint32_t>(dense_.size()));
      if (inserted) add_dense();
      return {it->second, false};
    }
    std::string_view name = t;
    if (key.escaped) {
      scratch_.clear();
      for (std::size_t i = 0; i < t.size(); ++i) {
        scratch_ += t[i];
        if (t[i] == '"') ++i;  // "" -> "
      }
      name = scratch_;
    }
    if (auto it = strs_.find(absl::string_view(name.data(), name.size())); it != strs_.end())
      return {it->second, false};
    strs_.emplace(std::string(name), static_cast<std::uint32_t>(dense_.size()));
    add_dense();
    return {static_cast<std::uint32_t>(dense_.size() - 1), false};
  }
  Key& at(Ref r) { return r.direct ? direct_[r.index] : dense_[r.index]; }
  void prefetch(Ref r) const { dpstream::prefetch(r.direct ? &direct_[r.index] : &dense_[r.index]); }
  template <class F>
  void for_each(F&& f) const {
    for (const Key& k : direct_) f(k);
    for (const Key& k : dense_) f(k);
  }
  const std::vector<Key>& slots(bool direct) const { return direct ? direct_ : dense_; }
  std::uint64_t moves() const { return moves_; }  // times slots moved (see find_or_add)
  // A direct slot used for the first time (the caller sees it when it first touches the slot): the
  // number of keys bounds the direct table's size.
  void count_direct_key() { ++keys_; }

 private:
  // Ids below 4 x (keys + 65536) and below 2^23 (a table of 192 MB at most) take the direct table.
  static constexpr std::uint64_t kDirectMax = std::uint64_t{1} << 23;

  static bool canonical_uint(std::string_view t, std::uint64_t& v) {
    if (t.empty() || t.size() > 20 || (t.size() > 1 && t[0] == '0')) return false;
    for (char c : t)
      if (c < '0' || c > '9') return false;
    auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
    return ec == std::errc();
  }
  void grow_direct(std::uint64_t id) {
    if (!ints_.empty()) ++moves_;
    direct_.resize(std::max<std::size_t>(std::bit_ceil(static_cast<std::size_t>(id) + 1), 1024));
    for (auto it = ints_.begin(); it != ints_.end();) {  // ids now covered move over; their dense slots stay 0
      if (it->first < direct_.size()) {
        direct_[it->first] = std::exchange(dense_[it->second], Key{});
        ints_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  void add_dense() {
    if (dense_.size() >= std::numeric_limits<std::uint32_t>::max())
      throw InputError("more than 2^32 - 1 distinct keys");
    dense_.emplace_back();
    ++keys_;
  }

  std::vector<Key> direct_, dense_;
  std::uint64_t keys_ = 0, moves_ = 0;  // keys: dense slots (also moved ones) + direct slots used
  absl::flat_hash_map<std::uint64_t, std::uint32_t> ints_;
  absl::flat_hash_map<std::string, std::uint32_t> strs_;
  std::string scratch_;
};

inline std::uint64_t abs_diff(std::int64_t a, std::int64_t b) {
  const auto ua = static_cast<std::uint64_t>(a), ub = static_cast<std::uint64_t>(b);
  return a >= b ? ua - ub : ub - ua;
}

// The metrics of err = est - truth, updated by delta as keys change. linf: the maximum of |err| per
// block of 1024 slots, an upper bound that is exact unless the block is marked dirty (its maximum
// went down); only dirty blocks are scanned again, and only when the overall maximum went down.
class ErrorState {
 public:
  explicit ErrorState(KeyTable& keys) : keys_(keys) {}

  void set(KeyTable::Ref ref, KeyTable::Key& key, bool truth, std::int64_t v) {
    const std::uint64_t before = abs_diff(key.est, key.truth);
    (truth ? key.truth : key.est) = v;
    const std::uint64_t after = abs_diff(key.est, key.truth);
    l1_ = l1_ + after - before;  // exact: the true sum is never negative
    if (!sq_overflow_) {
      sumsq_ -= static_cast<u128>(before) * before;
      sq_overflow_ = __builtin_add_overflow(sumsq_, static_cast<u128>(after) * after, &sumsq_);
    }
    Blocks& b = blocks_[ref.direct];
    const std::size_t i = ref.index >> kBlockBits;
    if (i >= b.max.size()) {
      b.max.resize(i + 1, 0);
      b.dirty.resize(i + 1, 0);
    }
    if (after >= b.max[i]) {
      b.max[i] = after;
    } else if (before == b.max[i] && !b.dirty[i]) {
      b.dirty[i] = 1;
      b.dirty_list.push_back(static_cast<std::uint32_t>(i));
    }
    if (before == linf_ && after < before) linf_dirty_ = true;  // the maximum may have gone down
    linf_ = std::max(linf_, after);
  }
  void count_released() { ++keys_released_; }

  TriggerMetrics metrics(std::uint32_t trigger) {
    if (keys_.moves() != moves_seen_) {  // slots moved: every block again
      moves_seen_ = keys_.moves();
      for (bool direct : {false, true}) {
        Blocks& b = blocks_[direct];
        const std::size_t n = (keys_.slots(direct).size() + kBlock - 1) >> kBlockBits;
        b.max.assign(n, 0);
        b.dirty.assign(n, 1);
        b.dirty_list.resize(n);
        std::iota(b.dirty_list.begin(), b.dirty_list.end(), 0u);
      }
      linf_dirty_ = true;
    }
    if (linf_dirty_) {
      std::uint64_t m = 0;
      for (bool direct : {false, true}) {
        Blocks& b = blocks_[direct];
        const auto& slots = keys_.slots(direct);
        for (std::uint32_t i : b.dirty_list) {
          std::uint64_t bm = 0;
          const std::size_t end = std::min(slots.size(), (std::size_t{i} + 1) << kBlockBits);
          for (std::size_t k = std::size_t{i} << kBlockBits; k < end; ++k)
            bm = std::max(bm, abs_diff(slots[k].est, slots[k].truth));
          b.max[i] = bm;
          b.dirty[i] = 0;
        }
        b.dirty_list.clear();
        for (std::uint64_t bm : b.max) m = std::max(m, bm);
      }
      linf_ = m;
      linf_dirty_ = false;
    }
    long double sq = 0;
    if (!sq_overflow_) {
      sq = static_cast<long double>(sumsq_);
    } else {  // beyond 128 bits: sum in long double, per trigger
      keys_.for_each([&sq](const KeyTable::Key& k) {
        const auto d = static_cast<long double>(abs_diff(k.est, k.truth));
        sq += d * d;
      });
    }
    const long double scale = kValueScale;
    TriggerMetrics m;
    m.trigger = trigger;
    m.keys_released = keys_released_;
    m.linf = static_cast<double>(static_cast<long double>(linf_) / scale);
    m.l1 = static_cast<double>(static_cast<long double>(l1_) / scale);
    m.l2 = static_cast<double>(std::sqrt(sq) / scale);
    return m;
  }

  void truth_figures(EvaluateResult& r) const {
    __extension__ __int128 total = 0;
    std::uint64_t nonzero = 0, max_abs = 0;
    keys_.for_each([&](const KeyTable::Key& k) {
      total += k.truth;
      nonzero += k.truth != 0;
      max_abs = std::max(max_abs, abs_diff(k.truth, 0));
    });
    r.truth_keys = nonzero;
    r.truth_total = static_cast<double>(static_cast<long double>(total) / static_cast<long double>(kValueScale));
    r.truth_max = static_cast<double>(static_cast<long double>(max_abs) / static_cast<long double>(kValueScale));
  }

 private:
  static constexpr int kBlockBits = 10;
  static constexpr std::size_t kBlock = std::size_t{1} << kBlockBits;
  struct Blocks {
    std::vector<std::uint64_t> max;  // >= the block's max |err|; equal unless dirty
    std::vector<std::uint8_t> dirty;
    std::vector<std::uint32_t> dirty_list;
  };
  KeyTable& keys_;
  Blocks blocks_[2];  // [direct?]
  std::uint64_t moves_seen_ = 0;
  u128 l1_ = 0, sumsq_ = 0;
  bool sq_overflow_ = false;
  std::uint64_t linf_ = 0;
  bool linf_dirty_ = false;
  std::uint64_t keys_released_ = 0;
};

const char* column_name(EvalColumn c) { return c == EvalColumn::Count ? "count" : "sum"; }

std::string fmt_num(double x) { return fmt::format("{:.10g}", x); }

}  // namespace

FixedParse parse_fixed_text(std::string_view s, std::int64_t& out) {
  if (s.empty()) return FixedParse::Empty;
  const char* b = s.data();
  const char* e = b + s.size();
  if (*b == '+') {  // from_chars takes no plus sign
    ++b;
    if (b == e || *b == '-' || *b == '+') return FixedParse::Bad;
  }
  double v = 0;
  // Fast path (Clinger): at most 15 digits, so the mantissa and 10^decimals are exact doubles and one
  // correctly rounded division gives what strtod gives.
  {
    const bool neg = *b == '-';
    const char* q = b + (neg ? 1 : 0);
    std::uint64_t m = 0;
    int digits = 0, decimals = 0;
    bool dot = false;
    for (; q != e; ++q) {
      const auto d = static_cast<unsigned char>(*q - '0');
      if (d < 10) {
        m = m * 10 + d;
        ++digits;
        decimals += dot;
      } else if (*q == '.' && !dot) {
        dot = true;
      } else {
        break;
      }
    }
    if (q == e && digits > 0 && digits <= 15 && decimals == 0 && m < (std::uint64_t{1} << 43)) {  // an integer
      const auto f = static_cast<std::int64_t>(m << kValueFracBits);
      out = neg ? -f : f;
      return FixedParse::Ok;
    }
    if (q == e && digits > 0 && digits <= 15) {
      static constexpr double kPow10[] = {1e0, 1e1, 1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                          1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15};
      v = static_cast<double>(m) / kPow10[decimals];
      if (neg) v = -v;
      if (!(std::fabs(v) < kMaxAbsValue)) return FixedParse::OutOfRange;
      out = to_fixed(v);
      return FixedParse::Ok;
    }
  }
  auto [p, ec] = std::from_chars(b, e, v);  // correctly rounded, like strtod (nan / inf parse too)
  if (ec == std::errc::result_out_of_range && p == e) {
    const char* x = std::find_if(b, e, [](char c) { return c == 'e' || c == 'E'; });
    if (x != e && x + 1 != e && x[1] == '-') {  // underflow, e.g. 1e-400: 0 on the 2^-20 grid
      out = 0;
      return FixedParse::Ok;
    }
    return FixedParse::OutOfRange;
  }
  if (ec != std::errc() || p != e) return FixedParse::Bad;
  if (!std::isfinite(v)) return FixedParse::NonFinite;
  if (!(std::fabs(v) < kMaxAbsValue)) return FixedParse::OutOfRange;
  out = to_fixed(v);
  return FixedParse::Ok;
}

EvaluateResult evaluate(const EvaluateOptions& opt) {
  RunInfo truth = read_run(opt.truth_dir, "--truth");
  RunInfo rel = read_run(opt.released_dir, "--released");

  if (truth.mode != to_string(PrivacyMode::None))
    throw InputError(
        fmt::format("{}: the --truth run has mode \"{}\"; the truth must be a run of the same job with "
                    "[privacy] mode = \"none\" and no contribution bounding",
                    truth.summary.string(), truth.mode));
  if (truth.dropped && *truth.dropped > 0)
    throw InputError(fmt::format(
        "{}: the --truth run dropped {} records by contribution bounding (records.dropped_by_bounding), so its totals "
        "are not the true histogram; rerun it without [privacy] max_records_per_user (mode \"none\" then keeps "
        "every record)",
        truth.summary.string(), *truth.dropped));
  // A clamped value is not the true sum's; counts do not see clamping.
  if (opt.column == EvalColumn::Sum && truth.clamped && *truth.clamped > 0)
    throw InputError(fmt::format(
        "{}: the --truth run clamped {} values to its [privacy] clamp_min..clamp_max (records.clamped), so its sums "
        "are not the true histogram's; rerun it with clamp_min and clamp_max wide enough to hold every value, or "
        "evaluate --column count",
        truth.summary.string(), *truth.clamped));
  same(truth, rel, truth.read, rel.read, "records.read");
  same(truth, rel, truth.accepted, rel.accepted, "records.accepted");
  same(truth, rel, truth.triggers_total, rel.triggers_total, "triggers (all windows)");
  same(truth, rel, truth.triggers, rel.triggers, "the number of triggers per window");
  same(truth, rel, truth.windows, rel.windows, "the number of windows");
  same(truth, rel, truth.first_window, rel.first_window, "the first window");
  const auto T = truth.triggers ? truth.triggers : rel.triggers;
  const auto windows = truth.windows ? truth.windows : rel.windows;
  const auto first_window = truth.first_window ? truth.first_window : rel.first_window;

  // The window.
  std::int64_t W = 0;
  if (opt.window) {
    W = *opt.window;
    if (first_window && windows && (W < *first_window || static_cast<std::uint64_t>(W - *first_window) >= *windows))
      throw ConfigError(fmt::format("--window {} is not a window of the runs (windows {}..{}); choose one of those", W,
                                    *first_window, *first_window + static_cast<std::int64_t>(*windows) - 1));
  } else if (auto w = last_window(truth)) {
    W = *w;
  } else if (auto wr = last_window(rel)) {
    W = *wr;
  } else {
    throw ConfigError(
        fmt::format("neither {} nor {} holds a row; give --window W (and --trigger I) to evaluate empty "
                    "histograms",
                    truth.releases.string(), rel.releases.string()));
  }
  // The trigger (checked against the data below when the summaries do not state T).
  std::optional<std::uint32_t> limit;
  if (opt.trigger) {
    if (T && (*opt.trigger < 0 || *opt.trigger >= static_cast<std::int64_t>(*T)))
      throw ConfigError(
          fmt::format("--trigger {} is outside window {}: the runs have {} triggers per window; choose "
                      "0..{}",
                      *opt.trigger, W, *T, *T - 1));
    if (*opt.trigger < 0)
      throw ConfigError(fmt::format("--trigger {} is negative; choose a trigger >= 0", *opt.trigger));
    if (*opt.trigger > std::numeric_limits<std::uint32_t>::max())
      throw ConfigError(fmt::format("--trigger {} is too large; choose a trigger of window {}", *opt.trigger, W));
    limit = static_cast<std::uint32_t>(*opt.trigger);
  } else if (T) {
    limit = *T - 1;
  }

  RowReader rt(truth, T, first_window, windows), rr(rel, T, first_window, windows);
  rt.next();
  rr.next();
  while (rt.has() && rt.window() < W) rt.next();
  while (rr.has() && rr.window() < W) rr.next();

  KeyTable keys;
  ErrorState state(keys);
  const EvalColumn col = opt.column;
  bool column_seen[2] = {false, false};  // [truth?]: a row of the window had a value in the column
  std::int64_t max_trigger_seen = -1;    // in window W, either file (rows read so far)
  EvaluateResult res;

  // Rows are parsed a batch ahead of their use, their keys' state prefetched meanwhile: with a
  // million keys most rows touch a key that is not in the cache.
  struct Pending {
    KeyTable::Ref ref;
    std::int64_t v = 0;
    std::uint64_t line = 0;
    std::string key;  // for messages (keys not in the direct table)
  };
  constexpr std::size_t kBatch = 32;
  std::vector<Pending> batch(kBatch);
  std::size_t pending = 0;
  auto flush = [&](RowReader& r, const RunInfo& run, bool is_truth, std::uint32_t t) {
    for (std::size_t i = 0; i < pending; ++i) {
      Pending& p = batch[i];
      KeyTable::Key& key = keys.at(p.ref);
      std::uint32_t& stamp = is_truth ? key.stamp_truth : key.stamp_rel;
      auto fail = [&](std::string_view what) {
        const std::string name = p.ref.direct ? fmt::format("{}", p.ref.index) : p.key;
        throw InputError(fmt::format("{} line {}: key {} {}", r.path(), p.line, shown(name), what));
      };
      if (stamp == t + 1) fail(fmt::format("appears twice at window {} trigger {}; the file is damaged", W, t));
      if (p.ref.direct && key.stamp_truth == 0 && key.stamp_rel == 0) keys.count_direct_key();
      if (stamp == 0 && !is_truth) state.count_released();
      stamp = t + 1;
      std::int64_t v = p.v;
      if (run.increments && __builtin_add_overflow(v, is_truth ? key.truth : key.est, &v))
        fail("overflows: its running sum leaves the 64-bit fixed-point range");
      state.set(p.ref, key, is_truth, v);
    }
    pending = 0;
  };

  // Applies the rows of one file at (W, t).
  auto apply = [&](RowReader& r, const RunInfo& run, bool is_truth, std::uint32_t t) {
    for (; r.in(W) && r.trigger() == t; r.next()) {
      std::int64_t v = 0;
      const Field& f = r.column(col);
      switch (parse_fixed_text(f.text, v)) {
        case FixedParse::Ok:
          break;
        case FixedParse::Empty:
          if (!column_seen[is_truth])
            throw ConfigError(
                fmt::format("{} line {}: the {} column is empty: the {} run did not release {} ([query] "
                            "aggregations); choose --column {}",
                            r.path(), r.line(), column_name(col), r.role(), column_name(col),
                            col == EvalColumn::Count ? "sum" : "count"));
          r.fail(fmt::format("the {} column is empty but earlier rows of the window hold it; the file is damaged",
                             column_name(col)));
        case FixedParse::Bad:
          r.fail(fmt::format("{} {} is not a number", column_name(col), shown(f.text)));
        case FixedParse::NonFinite:
          r.fail(fmt::format("{} is {}: NaN and infinity are not release values; the file is damaged", column_name(col),
                             shown(f.text)));
        case FixedParse::OutOfRange:
          r.fail(fmt::format("{} {} is out of range (|value| must be below 2^43)", column_name(col), shown(f.text)));
      }
      column_seen[is_truth] = true;
      const KeyTable::Ref ref = keys.find_or_add(r.key(), [&] { flush(r, run, is_truth, t); });
      keys.prefetch(ref);
      Pending& p = batch[pending++];
      p.ref = ref;
      p.v = v;
      p.line = r.line();
      if (!ref.direct) p.key.assign(r.key().text);  // a direct key's name is its id
      if (pending == kBatch) flush(r, run, is_truth, t);
    }
    flush(r, run, is_truth, t);
  };

  for (std::uint32_t t = 0;; ++t) {
    const bool more = rt.in(W) || rr.in(W);
    if (rt.in(W)) max_trigger_seen = std::max<std::int64_t>(max_trigger_seen, rt.trigger());
    if (rr.in(W)) max_trigger_seen = std::max<std::int64_t>(max_trigger_seen, rr.trigger());
    if (limit ? t > *limit : !more) break;
    // T unknown and every row of the window read: --trigger beyond its last row is refused below, not walked to.
    if (!T && !more && t > max_trigger_seen) break;
    apply(rt, truth, true, t);
    apply(rr, rel, false, t);
    res.per_trigger.push_back(state.metrics(t));
    if (t == std::numeric_limits<std::uint32_t>::max()) break;
  }
  // Whether the window and trigger exist when the summaries cannot say.
  if (max_trigger_seen < 0 && !(first_window && windows))
    throw ConfigError(fmt::format("window {} has no rows in {} nor in {}; choose a window that has rows with --window",
                                  W, truth.releases.string(), rel.releases.string()));
  if (!T && limit && static_cast<std::int64_t>(*limit) > max_trigger_seen)
    throw ConfigError(
        fmt::format("--trigger {} is beyond the last trigger with rows in window {} ({}), and neither "
                    "summary.json states the triggers per window; choose a trigger <= {}",
                    *limit, W, max_trigger_seen, max_trigger_seen));
  if (res.per_trigger.empty())  // no row, no --trigger and no T to say which triggers the window has
    throw ConfigError(
        fmt::format("window {} has no rows and neither summary.json states its triggers; give --trigger I", W));

  res.truth_dir = opt.truth_dir;
  res.released_dir = opt.released_dir;
  res.mode = rel.mode;
  res.release_rows = rel.release_rows;
  res.column = column_name(col);
  res.window = W;
  res.triggers_per_window = T;
  res.trigger = res.per_trigger.back().trigger;
  res.final = res.per_trigger.back();
  state.truth_figures(res);
  if (rel.accepted && rel.dropped && *rel.accepted > 0)
    res.dropped_share = static_cast<double>(*rel.dropped) / static_cast<double>(*rel.accepted);
  res.truth_rows_read = rt.rows();
  res.released_rows_read = rr.rows();
  return res;
}

nlohmann::ordered_json evaluate_json(const EvaluateResult& r) {
  nlohmann::ordered_json per = nlohmann::ordered_json::array();
  for (const auto& m : r.per_trigger)
    per.push_back(
        {{"trigger", m.trigger}, {"keys_released", m.keys_released}, {"linf", m.linf}, {"l1", m.l1}, {"l2", m.l2}});
  nlohmann::ordered_json j;
  j["truth"] = r.truth_dir;
  j["released"] = r.released_dir;
  j["mode"] = r.mode;
  j["release_rows"] = r.release_rows;
  j["column"] = r.column;
  j["window"] = r.window;
  j["trigger"] = r.trigger;
  j["keys_released"] = r.final.keys_released;
  j["linf"] = r.final.linf;
  j["l1"] = r.final.l1;
  j["l2"] = r.final.l2;
  j["truth_keys"] = r.truth_keys;
  j["truth_total"] = r.truth_total;
  j["truth_max"] = r.truth_max;
  j["dropped_share"] = r.dropped_share ? nlohmann::ordered_json(*r.dropped_share) : nlohmann::ordered_json(nullptr);
  j["per_trigger"] = std::move(per);
  return j;
}

std::string evaluate_text(const EvaluateResult& r, bool every_trigger) {
  std::string s;
  auto out = std::back_inserter(s);
  fmt::format_to(out, "dpstream evaluate: released {} against truth {}\n", r.released_dir, r.truth_dir);
  fmt::format_to(out, "  window {}, trigger {}{}, column {}\n", r.window, r.trigger,
                 r.triggers_per_window ? fmt::format(" (of 0..{})", *r.triggers_per_window - 1) : std::string(),
                 r.column);
  fmt::format_to(out, "  released run: mode {}, release_rows {}; rows read: truth {}, released {}\n", r.mode,
                 r.release_rows, r.truth_rows_read, r.released_rows_read);
  fmt::format_to(out, "  keys_released  {}\n", r.final.keys_released);
  fmt::format_to(out, "  linf           {}\n", fmt_num(r.final.linf));
  fmt::format_to(out, "  l1             {}\n", fmt_num(r.final.l1));
  fmt::format_to(out, "  l2             {}\n", fmt_num(r.final.l2));
  fmt::format_to(out, "  truth_keys     {}   (keys with a nonzero true value)\n", r.truth_keys);
  fmt::format_to(out, "  truth_total    {}\n", fmt_num(r.truth_total));
  fmt::format_to(out, "  truth_max      {}\n", fmt_num(r.truth_max));
  fmt::format_to(out, "  dropped_share  {}   (released run: records dropped by contribution bounding / accepted)\n",
                 r.dropped_share ? fmt_num(*r.dropped_share) : std::string("n/a"));
  // Per-trigger table: all, or about 10 evenly spaced and the last.
  const std::size_t n = r.per_trigger.size();
  std::vector<std::size_t> rows;
  if (every_trigger || n <= 11) {
    for (std::size_t i = 0; i < n; ++i) rows.push_back(i);
  } else {
    for (std::size_t k = 0; k <= 10; ++k) rows.push_back((n - 1) * k / 10);
  }
  fmt::format_to(out, "\n  {:>8} {:>14} {:>16} {:>16} {:>16}\n", "trigger", "keys_released", "linf", "l1", "l2");
  for (std::size_t i : rows) {
    const auto& m = r.per_trigger[i];
    fmt::format_to(out, "  {:>8} {:>14} {:>16} {:>16} {:>16}\n", m.trigger, m.keys_released, fmt_num(m.linf),
                   fmt_num(m.l1), fmt_num(m.l2));
  }
  if (!every_trigger && n > 11) fmt::format_to(out, "  ({} triggers; --per-trigger prints all)\n", n);
  return s;
}

}  // namespace dpstream
