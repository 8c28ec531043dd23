// Contribution bounding on the user owner: at most C records per user per window, chosen by
// stream order; values clamped; per-(user, key) aggregation with a first-touch flag; and a
// per-key pre-reduction before the key shuffle.
#pragma once

#include <absl/container/flat_hash_map.h>
#include <absl/container/flat_hash_set.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "src/record.hpp"

namespace dpstream::kernels {

struct BoundingParams {
  std::uint32_t max_records_per_user;  // C
  double clamp_min;                    // values are clamped (as doubles, so any magnitude is
  double clamp_max;                    // safe) and then rounded to fixed point
  std::int64_t value_quantum = 1;      // DP: fixed values are rounded to multiples of the sum noise grid
  // KeyPartial::new_users counts a user once per key per window (false), or once per key in every
  // trigger where the user has kept records of the key (true: the per-batch baseline's user counts).
  bool users_per_trigger = false;
};

// Nearest multiple of q (ties away from zero); monotone, so clamped values stay within the rounded bounds.
inline std::int64_t quantize(std::int64_t fixed, std::int64_t q) {
  if (q <= 1) return fixed;
  const std::int64_t r = (fixed >= 0 ? fixed + q / 2 : fixed - q / 2) / q;
  return r * q;
}

struct BoundingStats {
  std::uint64_t kept = 0;
  std::uint64_t dropped = 0;  // over the per-user limit C
  std::uint64_t clamped = 0;  // kept records whose value was clamped
  std::uint64_t new_users = 0;  // users seen for the first time in the window
};

// Per-user state of one window, owned by the rank that owns the user. Sharded by the low bits
// of the user hash so that OpenMP threads own disjoint shards.
//
// First touches: a user adds at most 1 to a key's user count. The set holds, per shard, one 64-bit
// code per counted (user, key) pair: the user's index in its shard (exact, dense, in order of
// arrival) and a 32-bit fingerprint of the key. Two keys of the same user with equal fingerprints
// (probability <= C / 2^32 per new key) count that user once for both: an under-count of that
// user's own contribution only, never another user's, and never an over-count (a false negative
// is impossible: a key always has its fingerprint). docs/PRIVACY.md section 4.
class UserState {
 public:
  static constexpr std::size_t kShards = 256;
  struct Slot {
    std::uint32_t kept = 0;   // records kept so far in the window
    std::uint32_t index = 0;  // the user's number in its shard (< 2^32 users per shard and rank)
  };

  void clear();         // also clears the journal
  void clear_journal();
  std::uint64_t users() const;
  std::uint64_t user_key_pairs() const;
  std::uint64_t memory_bytes() const;  // estimate from the tables' capacities

  static std::uint32_t key_fingerprint(std::uint64_t key);
  static std::uint64_t pair_code(std::uint32_t index, std::uint32_t fingerprint) {
    return std::uint64_t{index} << 32 | fingerprint;
  }
  // The user's slot in `shard`, added with kept = 0 and the next index when new (second: added).
  std::pair<Slot*, bool> find_or_add(std::size_t shard, std::uint64_t user);
  // Counts (user, key fingerprint) in the user's first-touch set; false if it was there.
  bool add_pair(std::size_t shard, const Slot& slot, std::uint32_t fingerprint) {
    return touched[shard].insert(pair_code(slot.index, fingerprint)).second;
  }
  // Every counted pair as (user, key fingerprint), per shard in no particular order.
  std::vector<std::pair<std::uint64_t, std::uint32_t>> pairs(std::size_t shard) const;

  std::vector<absl::flat_hash_map<std::uint64_t, Slot>> kept{kShards};
  std::vector<absl::flat_hash_set<std::uint64_t>> touched{kShards};  // pair codes

  // Journal of the changes since the last checkpoint (kept only when `journal` is on), per shard:
  // (user, new kept count) in the order of the changes (a user may repeat: the last entry holds)
  // and (user, key fingerprint) pairs added to `touched`.
  bool journal = false;
  std::vector<std::vector<std::pair<std::uint64_t, std::uint32_t>>> changed_users{kShards};
  std::vector<std::vector<std::pair<std::uint64_t, std::uint32_t>>> new_pairs{kShards};
};

// Bounds and aggregates one trigger's records of the users this rank owns (any order).
// Returns per-key partials, pre-reduced per thread (a key may appear more than once).
std::vector<KeyPartial> bound_and_aggregate(const std::vector<Record>& records, const BoundingParams& params,
                                            UserState& state, BoundingStats& stats);

}  // namespace dpstream::kernels
