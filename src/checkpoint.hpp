// Exactly-once checkpoints (docs/CHECKPOINTS.md). DIR/checkpoint holds
//   job.h5                     the job's identity (output-defining fields) and the noise secret;
//   w<window>/s<seq>-r<rank>.h5 one HDF5 file per rank per commit: the state that rank changed
//                              since its previous commit (a log of deltas, reset every window),
//                              plus, in rank 0's file, the commit's release rows;
//   MANIFEST-<seq>.json         the commit record, written last (temporary file, fsync, rename):
//                              the window's log with sizes and XXH3 checksums, the position in
//                              the stream, releases.csv's committed length, and the counters.
// A commit is visible exactly when its manifest is; the newest two manifests are kept so that a
// damaged latest commit falls back to the one before. All files are mode 0600, the directory 0700:
// they hold raw aggregates and the secret.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernels/bounding.hpp"
#include "kernels/key_accumulate.hpp"
#include "kernels/noise.hpp"
#include "shuffle/comm.hpp"
#include "src/config.hpp"

namespace dpstream::checkpoint {

// The job fields that define the output, as "section.key" -> value text. A checkpoint resumes only
// a job with the same fields; `input_digest` identifies a CSV input's content (file_digest).
using Fields = std::map<std::string, std::string>;
Fields identity_fields(const JobConfig& config, const std::string& input_digest);
std::string fingerprint(const Fields& fields);
// "<bytes> bytes, xxh3 <hex>" of a file's content; throws InputError when it cannot be read.
std::string file_digest(const std::string& path);

struct SegmentRef {
  std::uint64_t seq = 0;
  int rank = 0;
  std::string file;  // relative to the checkpoint directory
  std::uint64_t bytes = 0;
  std::uint64_t xxh3 = 0;
};

struct Manifest {
  std::uint64_t seq = 0;           // commit number: 0 is the empty start
  std::string job_id, job_name, fingerprint;
  int ranks = 0;                   // rank count that wrote the segments
  std::uint32_t window_index = 0;  // window of the job (0-based) that the log belongs to
  std::uint32_t next_trigger = 0;  // triggers [0, next_trigger) of that window are committed; T: window done
  bool complete = false;
  std::uint64_t releases_bytes = 0;  // committed length of releases.csv, this commit's rows included
  std::uint64_t release_rows = 0;    // committed rows
  std::uint64_t staged_bytes = 0;    // this commit's rows, kept in rank 0's segment
  std::uint64_t job_file_bytes = 0, job_file_xxh3 = 0;
  std::vector<SegmentRef> segments;  // the window's log in commit order (rank order within a commit)
  nlohmann::json counters = nlohmann::json::object();  // global sums carried over a resume
  nlohmann::json privacy = nlohmann::json::object();   // the budget ledger
};

// One rank's state changes since its previous commit.
struct Segment {
  std::vector<std::uint64_t> user_id;  // users whose kept count changed, with the new count
  std::vector<std::uint32_t> user_kept;
  std::vector<std::uint64_t> pair_user, pair_key;  // (user, key) pairs counted for the first time
  std::vector<std::uint64_t> key_id;               // keys whose state changed, with the new state
  std::vector<std::int64_t> key_count, key_sum, key_users, key_round_base_users;
  std::vector<std::uint32_t> key_round, key_round_start;
  std::string releases_csv;  // rank 0: the commit's release rows as they go into releases.csv

  std::uint64_t user_bytes() const { return user_id.size() * 12 + pair_user.size() * 16; }
  std::uint64_t key_bytes() const { return key_id.size() * 48; }
};

// Drains the tables' journals into a segment (each changed user and key once, current values).
Segment take_journal(kernels::UserState& users, kernels::KeyStateTable& keys);
// Applies a segment to this rank's tables; with `filter`, only the users and keys it owns.
void apply(const Segment& segment, kernels::UserState& users, kernels::KeyStateTable& keys, int rank, int ranks,
           bool filter);

enum class StartMode {
  Start,   // new job; refuse if DIR holds an unfinished one
  Resume,  // continue from the last committed checkpoint
  Fresh,   // discard whatever DIR holds and start over
};

struct Opened {
  enum class Kind { New, Resume, Complete } kind = Kind::New;
  std::vector<std::string> notes;  // lines for the log (e.g. a fall-back to the previous commit)
};

struct CommitStats {
  std::uint64_t segment_bytes = 0;  // this rank's file
  double seconds = 0;
};

class Store {
 public:
  Store(std::filesystem::path dir, const shuffle::Comm& comm);

  // Collective. Finds the newest usable commit and checks that it belongs to this job; throws
  // CheckpointError (on every rank) saying what to change.
  Opened open(const std::string& job_name, const Fields& fields, StartMode mode);
  // Resume: the secret stored with the job (collective; all ranks get it).
  noise::Secret secret() const;
  // Resume: loads this rank's share of the state of the opened commit (re-partitioned when the rank
  // count changed) unless `window_done`; returns the commit's staged release rows on rank 0.
  std::string load(kernels::UserState& users, kernels::KeyStateTable& keys, bool window_done);

  // New job, collective: empties DIR/checkpoint and writes job.h5 (with the secret, if any).
  void begin(const std::string& job_name, const Fields& fields, const noise::Secret* secret);
  // New job, after releases.csv holds its header: commit 0, the empty start.
  void commit_start(std::uint64_t releases_bytes, const nlohmann::json& privacy);

  struct Position {
    std::uint32_t window_index;
    std::uint32_t first_trigger, next_trigger;  // triggers [first, next) are in this commit
    bool complete;
  };
  // Collective: every rank writes its segment, then rank 0 the manifest (the commit point).
  // `releases_csv`, `releases_bytes` and `release_rows` matter on rank 0 only.
  CommitStats commit(Segment segment, const Position& position, const nlohmann::json& counters,
                     std::uint64_t releases_bytes, std::uint64_t release_rows);
  // Rank 0, after the commit's rows were published: removes files no kept manifest refers to.
  void collect_garbage();

  const Manifest& manifest() const { return manifest_; }  // segments: rank 0 only
  const std::filesystem::path& dir() const { return dir_; }

 private:
  Opened open_on_root(const std::string& job_name, const Fields& fields, StartMode mode);
  std::filesystem::path dir_;
  const shuffle::Comm& comm_;
  Manifest manifest_, previous_;
};

}  // namespace dpstream::checkpoint
