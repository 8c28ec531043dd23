// Exactly-once checkpoints (docs/CHECKPOINTS.md). DIR/checkpoint holds
//   job.h5                     the job's identity (output-defining fields) and the noise secret;
//   w<window>/s<seq>-r<rank>.h5 one HDF5 file per rank per commit (written straight to disk): the state that rank
//   changed
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
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "kernels/bounding.hpp"
#include "kernels/dp_release.hpp"
#include "kernels/key_accumulate.hpp"
#include "kernels/noise.hpp"
#include "shuffle/comm.hpp"
#include "src/config.hpp"
#include "src/releases_extent.hpp"

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
  int ranks = 0;     // the rank count that wrote it: its users and keys are partitioned by that count
  std::string file;  // relative to the checkpoint directory
  std::uint64_t bytes = 0;
  std::uint64_t xxh3 = 0;
};

struct Manifest {
  std::uint64_t seq = 0;  // commit number: 0 is the empty start
  std::string job_id, job_name, fingerprint;
  int ranks = 0;                   // rank count of the last commit (a log may mix counts after a resume)
  std::uint32_t window_index = 0;  // window of the job (0-based) that the log belongs to
  std::uint32_t next_trigger = 0;  // triggers [0, next_trigger) of that window are committed; T: window done
  bool complete = false;
  ReleasesExtent releases;         // releases.csv as committed, this commit's rows included
  std::uint64_t staged_bytes = 0;  // this commit's rows, kept in rank 0's segment
  std::uint64_t job_file_bytes = 0, job_file_xxh3 = 0;
  std::vector<SegmentRef> segments;                    // the window's log in commit order (rank order within a commit)
  nlohmann::json counters = nlohmann::json::object();  // global sums carried over a resume
  nlohmann::json privacy = nlohmann::json::object();   // the budget ledger
  nlohmann::json summary = nullptr;                    // the job's last commit: summary.json
};

// One rank's state changes since its previous commit.
struct Segment {
  std::vector<std::uint64_t> user_id;  // users whose kept count changed, with the new count (in order:
                                       // with every > 1 a user may repeat, and the last entry holds)
  std::vector<std::uint32_t> user_kept;
  std::vector<std::uint64_t> pair_user;  // (user, key fingerprint) pairs counted for the first time
  std::vector<std::uint32_t> pair_fingerprint;
  std::vector<std::uint64_t> key_id;  // keys whose state changed, with the new state
  std::vector<std::int64_t> key_count, key_users, key_round_base_users;
  std::vector<std::uint64_t> key_sum_low;  // the 128-bit sum as two words (record.hpp)
  std::vector<std::int64_t> key_sum_high;
  std::vector<std::uint32_t> key_round, key_round_start;
  // Keys first tested in their round since the previous commit (kernels::FirstTest: their selection
  // counter may begin with a blocked prefix, fixed by that step): key, round, step. A resume seeks them there.
  std::vector<std::uint64_t> first_test_key;
  std::vector<std::uint32_t> first_test_round, first_test_step;
  std::string releases_csv;  // rank 0: the commit's release rows as they go into releases.csv
  // Where it lies in the job, from its own attributes: triggers [first_trigger, next_trigger) of window
  // window_index. Store::load checks them against the manifest (read_segment checks commit, rank and ranks).
  std::uint32_t window_index = 0, first_trigger = 0, next_trigger = 0;

  // Payload bytes per entry of each table.
  static constexpr std::uint64_t kKeptBytes = 12, kPairBytes = 12, kKeyBytes = 56, kFirstTestBytes = 16;
  std::uint64_t user_bytes() const { return user_id.size() * kKeptBytes + pair_user.size() * kPairBytes; }
  std::uint64_t key_bytes() const { return key_id.size() * kKeyBytes + first_test_key.size() * kFirstTestBytes; }
};

// The tables' journals, drained at a commit: every changed user's kept count and its new pairs (read
// from the per-user change marks, visiting only the cache lines of slots marked since the last drain:
// no log grows between commits) and a snapshot of each changed key's state: 16 bytes for a key with count and
// users only (almost every key of a large key space), the full state for the others. The
// checkpoint's I/O thread writes a segment's columns straight from it, one column at a time, so a
// commit holds the journal and one column, never a second copy of the whole segment.
struct Journal {
  struct CountKey {  // a key whose sum and round state are zero and whose values fit 32 bits
    std::uint64_t id;
    std::uint32_t count, users;
  };
  std::vector<std::vector<std::pair<std::uint64_t, std::uint32_t>>> changed_users;
  std::vector<std::vector<std::pair<std::uint64_t, std::uint32_t>>> new_pairs;
  std::vector<std::vector<CountKey>> count_keys;                                    // per shard, table order
  std::vector<std::vector<std::pair<std::uint64_t, kernels::KeyState>>> full_keys;  // per shard, table order
  std::vector<kernels::FirstTest> first_tests;                                      // key selection's (Segment)
  std::uint64_t user_bytes() const;  // what the segment will hold, in Segment's payload bytes
  std::uint64_t key_bytes() const;
  std::uint64_t memory_bytes() const;  // what the journal itself holds
  Segment to_segment() const;          // the segment it writes, whole in memory (tests)
};
Journal drain_journal(kernels::UserState& users, kernels::KeyStateTable& keys,
                      std::vector<kernels::FirstTest> first_tests = {});
// The journal's size now, from counts kept as the changes happen (O(shards): no pass over the users
// or keys), for the commit cadence's byte bound. `users` and `keys`: what drain_journal would hold,
// as Journal::memory_bytes() counts it; exact for the users; for the keys an upper bound (the drain
// reserves no more): per marked key 88 bytes when the table tracks sums (56 for a key journaled in
// full, 32 for a zero-sum key's entry in a vector grown by doubling), else 16, plus 56 for as many as
// its shard keeps in full state (released keys). The marks themselves live in the key slots.
struct JournalEstimate {
  std::uint64_t users = 0, keys = 0;
  std::uint64_t bytes() const { return users + keys; }
};
JournalEstimate estimate_journal(const kernels::UserState& users, const kernels::KeyStateTable& keys);
// Applies a segment to this rank's tables; with `filter`, only the users and keys it owns.
// `first_tests`: where the segment's key selection entries go (of this rank's keys, with `filter`).
void apply(const Segment& segment, kernels::UserState& users, kernels::KeyStateTable& keys, int rank, int ranks,
           bool filter, std::vector<kernels::FirstTest>* first_tests = nullptr);

// Readers of the checkpoint's files, as Store::open and Store::load use them (also tests and fuzzing).
// A manifest, verified against its own checksum: false with `why` when unreadable, damaged or of
// another format.
bool read_manifest(const std::filesystem::path& path, Manifest& out, std::string& why);
// job.h5: the job's identity and noise secret; throws CheckpointError when missing or damaged. With
// `expected`, its bytes must match the size and XXH3 that manifest holds, checked before HDF5 parses them.
struct JobRecord {
  std::string job_id, job_name, started_at;
  Fields fields;
  std::optional<noise::Secret> secret;
  std::uint64_t bytes = 0, xxh3 = 0;  // of the file, for the manifests' check
};
JobRecord read_job(const std::filesystem::path& path, const Manifest* expected = nullptr);
// One segment of a commit's log (dir / ref.file), verified against `ref` (size, XXH3, commit number, rank, rank
// count) and `job_id`, its trigger span not running backwards; throws CheckpointError when missing, damaged or not
// this job's. Its window and span are checked against the manifest by Store::load.
Segment read_segment(const std::filesystem::path& dir, const SegmentRef& ref, const std::string& job_id);

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
  std::uint64_t segment_bytes = 0;  // this rank's file of the previous commit
  double wait_seconds = 0;          // waiting for the I/O thread and agreeing that every rank's files are durable
  double gather_seconds = 0;        // sizes and checksums to rank 0
  double background_seconds = 0;    // the I/O thread's time for the previous commit (off the loop's path):
                                    // HDF5 file, checksum, fsync, rename; rank 0 also the manifest and rows
  double encode_seconds = 0;        // of which: the segment's columns gathered from the journal
  double write_seconds = 0;         // of which: the HDF5 file, its checksum, fsync, rename (columns included)
};

class Store {
 public:
  Store(std::filesystem::path dir, const shuffle::Comm& comm);
  ~Store();  // waits for the I/O thread (an unfinished commit stays invisible)
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Collective. Finds the newest usable commit and checks that it belongs to this job; throws
  // CheckpointError (on every rank) saying what to change.
  Opened open(const std::string& job_name, const Fields& fields, StartMode mode);
  // Resume: the secret stored with the job (collective; all ranks get it).
  noise::Secret secret() const;
  // Resume: loads this rank's share of the state of the opened commit (re-partitioned when the rank
  // count changed) unless `window_done`; returns the commit's staged release rows on rank 0. Also for
  // a complete job (window_done), whose last rows may not have reached releases.csv.
  std::string load(kernels::UserState& users, kernels::KeyStateTable& keys, bool window_done,
                   std::vector<kernels::FirstTest>* first_tests = nullptr);
  // Resume, once accepted (loaded, releases.csv restored) and before any rank writes: deletes the temporary files
  // of an interrupted commit (rank 0). Not earlier: a refused resume leaves the directory as it found it.
  void remove_temporaries();

  // New job, collective: empties DIR/checkpoint and writes job.h5 (with the secret, if any).
  void begin(const std::string& job_name, const Fields& fields, const noise::Secret* secret);
  // New job, after releases.csv holds its header: commit 0, the empty start.
  void commit_start(const ReleasesExtent& releases, const nlohmann::json& privacy);

  struct Position {
    std::uint32_t window_index;
    std::uint32_t first_trigger, next_trigger;  // triggers [first, next) are in this commit
    bool complete;
  };
  // Rank 0: appends a commit's rows to releases.csv once the commit is durable (I/O thread).
  void set_publisher(std::function<void(const std::string&)> publish) { publish_ = std::move(publish); }

  // Collective, pipelined with the trigger loop: a background I/O thread writes the segment of
  // `journal` (freeing it as it goes) and reports its size and checksum; the commit point (rank 0's
  // manifest, then the rows) follows at the next commit() or finish(), once every rank's file is
  // known to be durable. So a commit becomes visible during the next trigger. `rows` (rank 0) are
  // the commit's release rows; `releases` (rank 0) counts them in.
  CommitStats commit(std::shared_ptr<Journal> journal, std::string rows, const Position& position,
                     const nlohmann::json& counters, const ReleasesExtent& releases);
  // Collective: waits until every rank's file of the last commit is durable (its size in the stats);
  // the commit stays invisible until finish().
  CommitStats await_writes() {
    CommitStats stats;
    await_io(stats);
    return stats;
  }
  // Collective: makes the last commit durable and visible (end of job, clean stop); the job's
  // last commit also keeps `summary`, so that a resume can write summary.json again.
  CommitStats finish(const nlohmann::json& summary = nullptr);

  const Manifest& manifest() const { return latest_; }  // the newest (maybe not yet visible); segments: rank 0
  const std::filesystem::path& dir() const { return dir_; }

 private:
  Opened open_on_root(const std::string& job_name, const Fields& fields, StartMode mode);
  // Waits for the I/O thread, agrees that every rank's file is durable, and gives rank 0 the
  // files' sizes and checksums for the pending manifest (collective).
  void await_io(CommitStats& stats);
  // Rank 0 (I/O thread, or finish()): writes a manifest (the commit point), publishes its rows, and
  // removes files no kept manifest refers to.
  void make_visible(const Manifest& manifest, const std::string& rows);
  void collect_garbage();

  std::filesystem::path dir_;
  const shuffle::Comm& comm_;
  Manifest latest_;                  // main thread: the newest commit, written or pending
  bool pending_ = false;             // latest_ is written on every rank but its manifest is not
  std::string pending_rows_;         // rank 0: latest_'s rows, published after its manifest
  Manifest visible_, visible_prev_;  // I/O thread (rank 0): the newest two written manifests
  struct Written {
    std::uint64_t bytes = 0, xxh3 = 0;
    double seconds = 0, encode_seconds = 0, write_seconds = 0;
  };
  std::future<Written> io_;  // the I/O thread's current task
  std::function<void(const std::string&)> publish_;
};

}  // namespace dpstream::checkpoint
