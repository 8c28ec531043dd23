#include "src/release_writer.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "src/record.hpp"

namespace dpstream {

namespace {
void fsync_and_close(std::FILE* f, const std::filesystem::path& path) {
  if (std::fflush(f) != 0 || ::fsync(::fileno(f)) != 0) {
    const int err = errno;
    std::fclose(f);
    throw std::runtime_error(fmt::format("cannot write {}: {}", path.string(), std::strerror(err)));
  }
  if (std::fclose(f) != 0) throw std::runtime_error(fmt::format("cannot close {}: {}", path.string(), std::strerror(errno)));
}
}  // namespace

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

ReleaseWriter::ReleaseWriter(const std::filesystem::path& dir, ReleaseColumns columns)
    : final_(dir / "releases.csv"), partial_(dir / ".releases.csv.partial"), columns_(columns) {
  file_ = std::fopen(partial_.c_str(), "wb");
  if (!file_)
    throw std::runtime_error(fmt::format("cannot create {}: {}; choose a writable [output] dir or --out", partial_.string(),
                                         std::strerror(errno)));
  std::fputs("window,trigger,key,count,sum\n", file_);
}

ReleaseWriter::~ReleaseWriter() {
  if (file_) {
    std::fclose(file_);
    std::error_code ec;
    std::filesystem::remove(partial_, ec);
  }
}

void ReleaseWriter::write(std::int64_t window, std::uint32_t trigger, const std::vector<ReleaseRow>& rows) {
  buffer_.clear();
  for (const auto& r : rows)
    fmt::format_to(std::back_inserter(buffer_), "{},{},{},{},{}\n", window, trigger, csv_field(r.name),
                   columns_.count ? format_fixed(r.count) : "", columns_.sum ? format_fixed(r.sum) : "");
  if (std::fwrite(buffer_.data(), 1, buffer_.size(), file_) != buffer_.size())
    throw std::runtime_error(fmt::format("cannot write {}: {}", partial_.string(), std::strerror(errno)));
  rows_ += rows.size();
}

void ReleaseWriter::commit() {
  std::FILE* f = file_;
  file_ = nullptr;
  fsync_and_close(f, partial_);
  std::filesystem::rename(partial_, final_);
}

void write_file_atomically(const std::filesystem::path& path, const std::string& text) {
  const auto tmp = path.parent_path() / ("." + path.filename().string() + ".partial");
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw std::runtime_error(fmt::format("cannot create {}: {}", tmp.string(), std::strerror(errno)));
  if (std::fwrite(text.data(), 1, text.size(), f) != text.size()) {
    std::fclose(f);
    throw std::runtime_error(fmt::format("cannot write {}", tmp.string()));
  }
  fsync_and_close(f, tmp);
  std::filesystem::rename(tmp, path);
}

}  // namespace dpstream
