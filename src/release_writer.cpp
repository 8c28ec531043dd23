#include "src/release_writer.hpp"

#include <fmt/format.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "src/durable_io.hpp"
#include "src/errors.hpp"
#include "src/record.hpp"

namespace dpstream {

std::string format_fixed(std::int64_t fixed) {
  const double v = from_fixed(fixed);
  for (int decimals = 0; decimals < 7; ++decimals) {
    std::string text = fmt::format("{:.{}f}", v, decimals);
    if (to_fixed(std::strtod(text.c_str(), nullptr)) == fixed) return text == "-0" ? "0" : text;
  }
  return fmt::format("{:.7f}", v);
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
    : final_(dir / "releases.csv"), target_(unchecked ? dir / ".releases.csv.partial" : final_), columns_(columns) {}

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
  bytes_ = kHeader.size();
  rows_ = 0;
}

void ReleaseWriter::restore(std::uint64_t committed_bytes, const std::string& staged, std::uint64_t committed_rows) {
  const std::uint64_t before = committed_bytes - staged.size();
  std::error_code ec;
  const auto size = std::filesystem::file_size(final_, ec);
  if (ec || size < before)
    throw CheckpointError(fmt::format(
        "{} holds {} bytes but the checkpoint committed {} bytes of rows before its last trigger: the file was "
        "removed, truncated or replaced after the run; restore it, or start over with --fresh",
        final_.string(), ec ? 0 : size, before));
  if (::truncate(final_.c_str(), static_cast<off_t>(before)) != 0)
    throw std::runtime_error(fmt::format("cannot truncate {}: {}", final_.string(), std::strerror(errno)));
  append(staged);
  bytes_ = committed_bytes;
  rows_ = committed_rows;
}

void ReleaseWriter::stage(std::int64_t window, std::uint32_t trigger, const std::vector<ReleaseRow>& rows) {
  for (const auto& r : rows)
    fmt::format_to(std::back_inserter(pending_), "{},{},{},{},{}\n", window, trigger, csv_field(r.name),
                   columns_.count ? format_fixed(r.count) : "", columns_.sum ? format_fixed(r.sum) : "");
  pending_rows_ += rows.size();
}

std::string ReleaseWriter::take_pending() {
  std::string out;
  out.swap(pending_);
  bytes_ += out.size();
  rows_ += pending_rows_;
  pending_rows_ = 0;
  return out;
}

void ReleaseWriter::append(const std::string& text, bool sync) const {
  append_to_file(target_, text.data(), text.size(), sync, "publish_half");  // the tests kill the job mid-append
}

}  // namespace dpstream
