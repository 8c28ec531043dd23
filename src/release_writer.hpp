// releases.csv on rank 0: written to a hidden partial file and renamed into place only when the
// run completes, so a failed run never leaves a partial output file.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

namespace dpstream {

struct ReleaseRow {
  std::uint64_t key;
  std::string name;  // key as printed (the CSV string, or the integer id)
  std::int64_t count;  // fixed point (exact integers in mode "none", noisy estimates in mode "dp")
  std::int64_t sum;    // fixed point
};

// Which of the count and sum columns hold values; a column not released is left empty.
struct ReleaseColumns {
  bool count = true;
  bool sum = true;
};

// Shortest decimal text that reads back to the same fixed-point value (e.g. "11.21", "-3",
// "0.5"): at most 7 decimals, since 1e-7 is below half the 2^-20 grid step.
std::string format_fixed(std::int64_t fixed);

// Quotes a CSV field when it holds a comma, quote or line break (RFC 4180).
std::string csv_field(const std::string& s);

class ReleaseWriter {
 public:
  ReleaseWriter(const std::filesystem::path& dir, ReleaseColumns columns);  // throws std::runtime_error
  ~ReleaseWriter();                                          // removes the partial file unless committed
  ReleaseWriter(const ReleaseWriter&) = delete;
  ReleaseWriter& operator=(const ReleaseWriter&) = delete;

  // Rows of one trigger, already sorted by key.
  void write(std::int64_t window, std::uint32_t trigger, const std::vector<ReleaseRow>& rows);
  // Flush, fsync and atomically rename to releases.csv.
  void commit();
  std::filesystem::path final_path() const { return final_; }
  std::uint64_t rows_written() const { return rows_; }

 private:
  std::filesystem::path final_, partial_;
  ReleaseColumns columns_;
  std::FILE* file_ = nullptr;
  std::uint64_t rows_ = 0;
  std::string buffer_;
};

// Writes `text` to `path` atomically (temporary file, fsync, rename).
void write_file_atomically(const std::filesystem::path& path, const std::string& text);

}  // namespace dpstream
