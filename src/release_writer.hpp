// Release rows as CSV text and the writer of DIR/releases.csv.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/huge_pages.hpp"
#include "common/record.hpp"
#include "src/releases_extent.hpp"

struct XXH3_state_s;  // xxhash.h

namespace dpstream {

struct ReleaseRow {
  std::uint64_t key;
  std::string name;  // key as printed (the CSV string, or the integer id)
  int128 count;      // fixed point (exact integers in mode "none", noisy estimates in mode "dp")
  int128 sum;        // fixed point
};

// Which of the count and sum columns hold values; a column not released is left empty.
struct ReleaseColumns {
  bool count = true;
  bool sum = true;
};

// Shortest decimal text that reads back to the same fixed-point value (e.g. "11.21", "-3",
// "0.5"): at most 7 decimals, since 1e-7 is below half the 2^-20 grid step. From |value| >= 2^33
// (2^53 grid steps, where doubles no longer hold every step) the exact decimal.
std::string format_fixed(int128 fixed);

// Quotes a CSV field when it holds a comma, quote or line break (RFC 4180).
std::string csv_field(const std::string& s);

// Appends one CSV line per row (in the given order) to `text`, and each line's end offset in `text`
// to `ends`: the rows of releases.csv, formatted by whichever rank owns the keys.
void format_rows(std::int64_t window, std::uint32_t trigger, const std::vector<ReleaseRow>& rows,
                 ReleaseColumns columns, std::string& text, std::vector<std::uint64_t>& ends);
// The same for keys printed as their integer ids (no name to build or quote): the same text as
// format_rows with each row's name std::to_string(key).
void format_id_rows(std::int64_t window, std::uint32_t trigger, const std::vector<KeyRelease>& rows,
                    ReleaseColumns columns, std::string& text, std::vector<std::uint64_t>& ends);

// DIR/releases.csv on rank 0, grown by rows of committed triggers (docs/CHECKPOINTS.md): rows are
// formatted into a pending buffer, handed to the checkpoint with their commit, and appended once the
// commit is durable (the job's last rows: just before its last commit, which a resume undoes). After a crash the file
// is cut back to its committed length and the last commit's rows are appended again, so no row is ever lost or
// duplicated. Every byte handed to a commit goes into a running XXH3, which the commit records: a resume checks the
// file's committed bytes against it, so rows edited or replaced after the run are refused, not continued.
class ReleaseWriter {
 public:
  static constexpr std::string_view kHeader = "window,trigger,key,count,sum\n";

  // `unchecked`: a job without checkpoints writes a hidden partial file and renames it at the end
  // (finish), so a failed run leaves no releases.csv.
  ReleaseWriter(const std::filesystem::path& dir, ReleaseColumns columns, bool unchecked = false);
  ~ReleaseWriter();  // removes an unfinished partial file
  ReleaseWriter(const ReleaseWriter&) = delete;
  ReleaseWriter& operator=(const ReleaseWriter&) = delete;

  // New job: releases.csv holds the header only (written atomically).
  void start();
  // Resume: cut releases.csv to `committed.bytes - staged.size()` bytes, then append `staged` (the rows of the last
  // commit). Throws CheckpointError, the file untouched, when it holds fewer bytes than that or when those bytes and
  // `staged` are not what the commit recorded (committed.xxh3, when the checkpoint has it).
  void restore(const ReleasesExtent& committed, const std::string& staged);

  // Formats one trigger's rows (sorted by key) into the pending buffer.
  void stage(std::int64_t window, std::uint32_t trigger, const std::vector<ReleaseRow>& rows);
  // Adds `rows` rows, `bytes` of text already formatted by format_rows (in output order) that
  // `append(std::string& pending)` appends to the pending buffer; when the buffer must grow, it is
  // reserved for `expected_more` bytes beyond them (rows likely to follow before the next commit).
  template <class Append>
  void stage_with(std::uint64_t rows, std::uint64_t bytes, std::uint64_t expected_more, Append&& append) {
    if (pending_.capacity() - pending_.size() < bytes) {
      pending_.reserve(pending_.size() + bytes + expected_more);
      advise_huge_pages(pending_.data() + pending_.size(), pending_.capacity() - pending_.size());
    }
    const std::size_t before = pending_.size();
    try {
      append(pending_);
    } catch (...) {
      pending_.resize(before);  // no half-staged trigger
      throw;
    }
    pending_rows_ += rows;
  }
  ReleaseColumns columns() const { return columns_; }
  // Hands the pending rows to a commit; from now on they count in bytes() and rows().
  std::string take_pending();
  std::uint64_t pending_rows() const { return pending_rows_; }
  // Without checkpoints: appends the pending rows to releases.csv at once (they count in bytes() and
  // rows() from then on); the buffer keeps its capacity for the next trigger's rows.
  void append_pending(bool sync);
  // Appends rows to releases.csv and fsyncs. Touches nothing but the file, so the checkpoint's
  // I/O thread may call it while the trigger loop stages the next rows.
  void append(const std::string& text, bool sync = true) const;
  // Without checkpoints: renames the partial file to releases.csv.
  void finish();

  std::filesystem::path final_path() const { return final_; }
  std::uint64_t bytes() const { return bytes_; }  // header and rows handed to commits
  std::uint64_t rows() const { return rows_; }    // rows handed to commits
  ReleasesExtent committed() const;               // bytes(), rows() and the XXH3 of those bytes

 private:
  struct FreeHash {
    void operator()(XXH3_state_s* s) const;
  };
  void count_in(const std::string& text, std::uint64_t rows);  // text handed to a commit (or written at once)
  std::filesystem::path final_, target_;                       // target_: final_, or the partial file
  ReleaseColumns columns_;
  std::string pending_;
  std::uint64_t pending_rows_ = 0, bytes_ = 0, rows_ = 0;
  std::unique_ptr<XXH3_state_s, FreeHash> hash_;  // of the bytes_ bytes
};

}  // namespace dpstream
