#include "src/release_writer.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <vector>

#include "common/record.hpp"
#include "src/durable_io.hpp"
#include "src/errors.hpp"

namespace dpstream {

namespace {

// Exact decimal text of fixed / 2^20: integer digits, then the fraction as frac * 5^20 / 10^20
// (at most 20 digits, trailing zeros dropped).
std::string exact_decimal(int128 fixed) {
  const uint128 magnitude = fixed < 0 ? -static_cast<uint128>(fixed) : static_cast<uint128>(fixed);
  std::string text;
  for (uint128 whole = magnitude >> kValueFracBits; text.empty() || whole != 0; whole /= 10)
    text.insert(text.begin(), static_cast<char>('0' + static_cast<int>(whole % 10)));
  const uint128 frac = magnitude & ((uint128{1} << kValueFracBits) - 1);
  if (frac != 0) {
    std::string digits(20, '0');
    uint128 scaled = frac * 95367431640625u;  // 5^20: frac / 2^20 = scaled / 10^20
    for (int i = 19; i >= 0; --i, scaled /= 10)
      digits[static_cast<std::size_t>(i)] = static_cast<char>('0' + static_cast<int>(scaled % 10));
    text += '.' + digits.substr(0, digits.find_last_not_of('0') + 1);
  }
  return fixed < 0 ? "-" + text : text;
}

// Beyond 2^53 grid steps a double no longer holds every grid value: the exact decimal is printed.
constexpr int128 kDoubleExact = int128{1} << 53;

// Writes a whole-number fixed-point value's text (what {:.0f} prints) at `out` and returns its end;
// nullptr for any other value, and from 2^53 grid steps on.
char* put_whole(char* out, int128 wide) {
  if (wide >= kDoubleExact || wide <= -kDoubleExact) return nullptr;
  const auto fixed = static_cast<std::int64_t>(wide);
  if ((fixed & ((std::int64_t{1} << kValueFracBits) - 1)) != 0) return nullptr;
  const fmt::format_int whole(fixed >> kValueFracBits);
  std::memcpy(out, whole.data(), whole.size());
  return out + whole.size();
}

// format_fixed's text appended to `out`, without temporaries (the output stage formats millions).
void append_fixed(std::string& out, int128 wide) {
  char whole[24];
  if (char* end = put_whole(whole, wide)) {
    out.append(whole, end);
    return;
  }
  if (wide >= kDoubleExact || wide <= -kDoubleExact) {
    out += exact_decimal(wide);
    return;
  }
  const auto fixed = static_cast<std::int64_t>(wide);
  const double v = from_fixed(fixed);
  char text[64];
  for (int decimals = 1; decimals < 7; ++decimals) {
    const auto end = fmt::format_to_n(text, sizeof text - 1, "{:.{}f}", v, decimals).out;
    *end = '\0';
    if (to_fixed(std::strtod(text, nullptr)) == fixed) {  // (never "-0": zero is a whole number)
      out.append(text, end);
      return;
    }
  }
  fmt::format_to(std::back_inserter(out), "{:.7f}", v);
}

// "window,trigger," of every row of one trigger.
std::string row_prefix(std::int64_t window, std::uint32_t trigger) {
  const fmt::format_int w(window), t(trigger);
  std::string prefix(w.data(), w.size());
  prefix += ',';
  prefix.append(t.data(), t.size());
  prefix += ',';
  return prefix;
}

// Appends one line "window,trigger,key,count,sum\n" (`prefix` holds its first two fields). A name
// that needs no quoting and whole-number values (mode none's counts, counting data's sums) are written
// into a local buffer and appended in one piece: millions of rows a run, and a dozen small appends cost
// ~40 ns a row.
void append_row(std::string& text, std::string_view prefix, std::string_view name, bool may_need_quotes, int128 count,
                int128 sum, ReleaseColumns columns) {
  const bool plain_name = !may_need_quotes || name.find_first_of(",\"\r\n") == std::string_view::npos;
  constexpr std::size_t kWhole = 21;  // a 64-bit integer's text
  char line[256];
  if (plain_name && prefix.size() + name.size() + 2 * kWhole + 3 <= sizeof line) {
    char* p = line;
    std::memcpy(p, prefix.data(), prefix.size());
    p += prefix.size();
    std::memcpy(p, name.data(), name.size());
    p += name.size();
    *p++ = ',';
    if (columns.count) p = put_whole(p, count);
    if (p != nullptr) {
      *p++ = ',';
      if (columns.sum) p = put_whole(p, sum);
    }
    if (p != nullptr) {
      *p++ = '\n';
      text.append(line, p);
      return;
    }
  }
  text += prefix;
  if (plain_name)
    text += name;
  else
    text += csv_field(std::string(name));
  text += ',';
  if (columns.count) append_fixed(text, count);
  text += ',';
  if (columns.sum) append_fixed(text, sum);
  text += '\n';
}

}  // namespace

std::string format_fixed(int128 wide) {
  std::string out;
  append_fixed(out, wide);
  return out;
}

void format_rows(std::int64_t window, std::uint32_t trigger, const std::vector<ReleaseRow>& rows,
                 ReleaseColumns columns, std::string& text, std::vector<std::uint64_t>& ends) {
  const std::string prefix = row_prefix(window, trigger);
  for (const auto& r : rows) {
    append_row(text, prefix, r.name, /*may_need_quotes=*/true, r.count, r.sum, columns);
    ends.push_back(text.size());
  }
}

void format_id_rows(std::int64_t window, std::uint32_t trigger, const std::vector<KeyRelease>& rows,
                    ReleaseColumns columns, std::string& text, std::vector<std::uint64_t>& ends) {
  const std::string prefix = row_prefix(window, trigger);
  for (const auto& r : rows) {
    const fmt::format_int id(r.key);
    append_row(text, prefix, {id.data(), id.size()}, /*may_need_quotes=*/false, r.count, r.sum, columns);
    ends.push_back(text.size());
  }
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\r\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

ReleaseWriter::ReleaseWriter(const std::filesystem::path& dir, ReleaseColumns columns, bool unchecked)
    : final_(dir / "releases.csv"),
      target_(unchecked ? dir / ".releases.csv.partial" : final_),
      columns_(columns),
      hash_(XXH3_createState()) {
  if (!hash_) throw std::bad_alloc();
  XXH3_64bits_reset(hash_.get());
}

void ReleaseWriter::FreeHash::operator()(XXH3_state_s* s) const { XXH3_freeState(s); }

ReleasesExtent ReleaseWriter::committed() const {
  return {.bytes = bytes_, .rows = rows_, .xxh3 = XXH3_64bits_digest(hash_.get())};
}

void ReleaseWriter::count_in(const std::string& text, std::uint64_t rows) {
  XXH3_64bits_update(hash_.get(), text.data(), text.size());
  bytes_ += text.size();
  rows_ += rows;
}

ReleaseWriter::~ReleaseWriter() {
  if (target_ != final_) {
    std::error_code ec;
    std::filesystem::remove(target_, ec);
  }
}

void ReleaseWriter::finish() {
  if (target_ == final_) return;
  std::filesystem::rename(target_, final_);
  fsync_dir(final_.parent_path());
  target_ = final_;
}

void ReleaseWriter::start() {
  std::error_code ec;
  std::filesystem::remove(final_.parent_path() / "summary.json", ec);  // an older run's completion marker
  write_file_atomically(target_, std::string(kHeader));
  XXH3_64bits_reset(hash_.get());
  bytes_ = rows_ = 0;
  count_in(std::string(kHeader), 0);
}

void ReleaseWriter::restore(const ReleasesExtent& committed, const std::string& staged) {
  if (committed.bytes < kHeader.size() + staged.size())
    throw CheckpointError(
        fmt::format("the checkpoint's last commit is inconsistent: it holds {} bytes of rows but "
                    "counts {} bytes of {} in all; start over with --fresh",
                    staged.size(), committed.bytes, final_.string()));
  const std::uint64_t before = committed.bytes - staged.size();
  std::error_code ec;
  const auto size = std::filesystem::file_size(final_, ec);
  if (!ec && size >= before) {
    XXH3_64bits_reset(hash_.get());  // the running hash restarts over the committed bytes
    try {
      if (hash_file_into(final_, hash_.get(), before) != before) ec = std::make_error_code(std::errc::io_error);
    } catch (const std::runtime_error&) {  // unreadable: refused as a damaged file, as a missing one is
      ec = std::make_error_code(std::errc::io_error);
    }
  }
  if (ec || size < before)
    throw CheckpointError(fmt::format(
        "{} holds {} bytes but the checkpoint committed {} bytes of rows before its last trigger: the file was "
        "removed, truncated or replaced after the run; restore it, or start over with --fresh",
        final_.string(), ec ? 0 : size, before));
  XXH3_64bits_update(hash_.get(), staged.data(), staged.size());
  if (committed.xxh3 && XXH3_64bits_digest(hash_.get()) != *committed.xxh3)
    throw CheckpointError(fmt::format(
        "{}: its first {} bytes are not the rows the checkpoint committed (their XXH3 differs): the file was edited "
        "or replaced after the run; put back the job's own file, or start over with --fresh",
        final_.string(), before));
  if (::truncate(final_.c_str(), static_cast<off_t>(before)) != 0)
    throw std::runtime_error(fmt::format("cannot truncate {}: {}", final_.string(), errno_text(errno)));
  append(staged);
  bytes_ = committed.bytes;
  rows_ = committed.rows;
}

void ReleaseWriter::stage(std::int64_t window, std::uint32_t trigger, const std::vector<ReleaseRow>& rows) {
  std::vector<std::uint64_t> ends;
  format_rows(window, trigger, rows, columns_, pending_, ends);
  pending_rows_ += rows.size();
}

std::string ReleaseWriter::take_pending() {
  std::string out;
  out.swap(pending_);
  count_in(out, pending_rows_);
  pending_rows_ = 0;
  return out;
}

void ReleaseWriter::append_pending(bool sync) {
  append(pending_, sync);
  count_in(pending_, pending_rows_);
  pending_.clear();
  pending_rows_ = 0;
}

void ReleaseWriter::append(const std::string& text, bool sync) const {
  try {
    append_to_file(target_, text.data(), text.size(), sync, "publish_half");  // the tests kill the job mid-append
  } catch (const std::runtime_error& e) {
    if (target_ == final_) throw;  // checkpointed: the commit publishing the rows (or the resume) says what to do
    throw std::runtime_error(e.what() + free_space_note(final_.parent_path(), " and run the job again"));
  }
}

}  // namespace dpstream
