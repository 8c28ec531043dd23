// The privacy budget ledger shared by every job that reads a stream (Sage's block composition:
// Lecuyer et al., "Privacy accounting and quality control in the Sage differentially private ML
// platform", SOSP 2019, arXiv 1909.01502, sections 3-4). The stream is split into blocks, the
// event-time windows of `block_seconds` (the privacy unit is one user's records in one block); each
// block has a ceiling (epsilon_g, delta_g). A job asks for its budget on every block it reads before
// it releases anything, and is admitted only if every block stays within its ceiling; admission and
// charge are one SQLite transaction (BEGIN IMMEDIATE), so jobs starting at once on a cluster cannot
// overspend. Nothing is refunded; retired blocks are refused; a new block starts with its full
// ceiling. docs/LEDGER.md states the accounting, the file systems and the guarantees.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dpstream::ledger {

struct Ceiling {
  double epsilon = 0, delta = 0;   // per block
  std::int64_t block_seconds = 0;  // a block is the event-time window [b s, (b + 1) s)
  // Block b's event time [b s, (b + 1) s) in seconds, its end cut to INT64_MAX (then included) where (b + 1) s leaves
  // int64; nullopt where b s does (no record's time falls in the block).
  std::optional<std::pair<std::int64_t, std::int64_t>> block_time(std::int64_t block) const;
  std::string block_time_text(std::int64_t block) const;  // "[start, end) s", or "outside int64 seconds"
};

// What one job asks of each block it reads. A zCDP job (composition "zcdp") is a rho-zCDP mechanism
// N, post-processed, except on "bad" events of probability at most `coupled` on each of two
// neighbouring inputs (DP-SQLP: a threshold test erring by more than tau, C T beta; docs/PRIVACY.md
// section 6) plus `delta_extra` on one side only (the baselines' singleton keys). Every job also
// states the (epsilon, delta) it guarantees on its own.
struct Request {
  std::string run_id;     // one release: the same id is admitted once (a resume is not charged again)
  std::string job;        // the job's name
  std::string mechanism;  // e.g. "dp (DP-SQLP), composition zcdp, counters banded/banded, T = 100, C = 32"
  bool zcdp = false;
  double rho = 0, delta_extra = 0, coupled = 0;  // zcdp only
  double epsilon = 0, delta = 0;
  std::vector<std::int64_t> blocks;
};

struct Charge {
  std::int64_t seq = 0, block = 0;
  std::string run_id, job, at, mechanism;
  bool zcdp = false;
  double rho = 0, delta_extra = 0, coupled = 0, epsilon = 0, delta = 0;
  std::string stored_digest;  // the row's link in the chain of digests
};

// A block's spending. Every charge zCDP: the block is (eps, delta_g)-DP whenever
//   need(eps) = zcdp_delta(sum rho, eps) + sum delta_extra + (e^eps + 1) sum coupled <= delta_g
// (docs/LEDGER.md); within its ceiling when a search finds a qualifying eps <= eps_g; `epsilon` qualifies.
// Otherwise, or when it proves a smaller epsilon within delta_g, basic composition of each charge's own
// (epsilon, delta).
struct BlockSpend {
  std::int64_t block = 0;
  bool retired = false;
  std::vector<Charge> charges;
  bool zcdp = true;                              // the accounting in use
  double rho = 0, delta_extra = 0, coupled = 0;  // zcdp sums
  double epsilon = 0, delta = 0;                 // spent, as accounted (zcdp: delta = delta_g once charged)
  double epsilon_left = 0, delta_left = 0;       // zcdp: delta_g - min need(eps), eps <= eps_g
  double rho_left = 0;                           // zcdp: rho another zCDP job may still charge alone
};

enum class Outcome { Admitted, AlreadyAdmitted, Refused };
struct Admission {
  Outcome outcome = Outcome::Refused;
  std::string message;  // refused: the block, what was asked, what remains, what to change
};

// A release's id: HMAC-SHA256(key, "dpstream ledger run" || job fingerprint), 128 bits in hex. With the
// job's noise secret as key, a resume has the same id and another secret (a new release) another.
std::string run_id(const unsigned char* key, std::size_t key_bytes, const std::string& fingerprint);

// What a job or tool does with its request: opens the ledger at `path`, checks that its blocks are
// windows of `window_seconds`, admits and charges, and says so on stderr; throws std::runtime_error
// with what to change on a refusal (called by rank 0 before anything is released). `resume`: the job's checkpoint
// exists, so the ledger that admitted it holds the run's charge; a ledger without it is another one (another file
// at the path, or one initialized anew) and is refused rather than charged.
Outcome charge_or_refuse(const std::string& path, std::int64_t window_seconds, const Request& request,
                         bool resume = false);

// Whether the ledger at `path` would admit `request` now, charging nothing, in a read transaction (`dpstream
// budget`; `run` before it reads its input); throws as charge_or_refuse does when the ledger cannot be used, its
// blocks are not windows of `window_seconds`, or (`resume`) it holds no charge of the run.
Admission preview_admission(const std::string& path, std::int64_t window_seconds, const Request& request,
                            bool resume = false);

// Creates a new ledger at `path` (refuses an existing file).
void init(const std::string& path, const Ceiling& ceiling);

class Ledger {
 public:
  // Opens and verifies an existing ledger: supported file system, format and version, SQLite's
  // quick_check and every row's digest (std::runtime_error naming what is wrong).
  explicit Ledger(const std::string& path);
  ~Ledger();
  Ledger(const Ledger&) = delete;
  Ledger& operator=(const Ledger&) = delete;

  const Ceiling& ceiling() const { return ceiling_; }
  std::optional<std::int64_t> retired_through() const;
  // Every charged block (and `extra` blocks too, uncharged), ascending.
  std::vector<BlockSpend> blocks(const std::vector<std::int64_t>& extra = {}) const;
  // Admission and charge in one transaction; `charge` false: the admission alone, nothing written (a preview).
  Admission admit(const Request& request, bool charge = true);
  // Retires every block <= through (never undone).
  void retire_through(std::int64_t through);

 private:
  struct Db;
  Db* db_ = nullptr;
  Ceiling ceiling_;
};

// The spending of a block with `charges` under `ceiling` (the admission rule, exposed for tests);
// rho_left is computed only when asked (256 conversions: kept out of the admission's lock).
BlockSpend account(std::int64_t block, std::vector<Charge> charges, const Ceiling& ceiling, bool with_rho_left = true);

}  // namespace dpstream::ledger
