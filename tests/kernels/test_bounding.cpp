#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <unordered_map>

#include "kernels/bounding.hpp"
#include "kernels/key_accumulate.hpp"
#include "tests/scoped_omp_threads.hpp"
#include "tools/naive_reference.hpp"

using namespace dpstream;

namespace {

// A trigger of records with heavy users, ties in time, values outside the clamp range, and
// the records in a scrambled order (arrival order must not matter).
std::vector<Record> random_trigger(std::mt19937_64& rng, int trigger, std::uint64_t& position) {
  std::vector<Record> out;
  std::uniform_int_distribution<int> n_dist(0, 400);
  const int n = n_dist(rng);
  for (int i = 0; i < n; ++i) {
    const std::uint64_t user = (rng() % 4 == 0) ? 7 : rng() % 60;  // user 7 is heavy
    const std::uint64_t key = rng() % 25;
    const double value = std::uniform_real_distribution<double>(-3.0, 5.0)(rng);
    out.push_back(
        Record{user, key, std::int64_t{trigger} * 100 + static_cast<std::int64_t>(rng() % 5), position++, value});
  }
  std::shuffle(out.begin(), out.end(), rng);
  return out;
}

struct Totals {
  std::int64_t count;
  int128 sum;
  std::int64_t users;
  bool operator==(const Totals&) const = default;
};

}  // namespace

TEST(Bounding, MatchesNaiveReferenceOverManyTriggers) {
  const std::uint32_t C = 6;
  const double lo = -1.0, hi = 2.5;
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    std::mt19937_64 rng(12345);
    kernels::UserState users;
    kernels::KeyStateTable keys;
    kernels::BoundingStats stats;
    NaiveReference naive(C, lo, hi);
    naive.begin_window();
    std::uint64_t position = 0, total = 0;
    for (int t = 0; t < 30; ++t) {
      auto records = random_trigger(rng, t, position);
      total += records.size();
      auto partials = kernels::bound_and_aggregate(records, {C, lo, hi}, users, stats);
      const auto got = keys.accumulate(partials);
      const auto want = naive.process(records);
      ASSERT_EQ(got.size(), want.size()) << "trigger " << t;
      for (std::size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].key, want[i].key);
        EXPECT_EQ((Totals{got[i].count, got[i].sum, got[i].users}), (Totals{want[i].count, want[i].sum, want[i].users}))
            << "trigger " << t << " key " << got[i].key;
      }
    }
    EXPECT_EQ(stats.kept + stats.dropped, total);
    users.for_each_user([&](std::uint64_t user, std::uint32_t kept) { EXPECT_LE(kept, C) << "user " << user; });
    EXPECT_GT(stats.dropped, 0u);
    EXPECT_GT(stats.clamped, 0u);
  }
}

TEST(Bounding, KeepsTheFirstCInStreamOrderNotArrivalOrder) {
  kernels::UserState users;
  kernels::BoundingStats stats;
  // One user, 5 records on 5 keys; C = 2. Stream order: (timestamp, position).
  std::vector<Record> records = {
      {1, 50, 10, 4, 1.0}, {1, 40, 10, 3, 1.0}, {1, 30, 5, 9, 1.0}, {1, 20, 7, 0, 1.0}, {1, 10, 12, 1, 1.0}};
  auto partials = kernels::bound_and_aggregate(records, {2, 0.0, 1.0}, users, stats);
  std::sort(partials.begin(), partials.end(), [](auto& a, auto& b) { return a.key < b.key; });
  ASSERT_EQ(partials.size(), 2u);
  EXPECT_EQ(partials[0].key, 20u);  // t = 7
  EXPECT_EQ(partials[1].key, 30u);  // t = 5
  EXPECT_EQ(stats.dropped, 3u);
}

TEST(Bounding, ClampsAndCountsAUserOncePerKey) {
  kernels::UserState users;
  kernels::BoundingStats stats;
  // 1e300 and -1e300 would overflow a fixed-point conversion: clamping comes first.
  std::vector<Record> t0 = {{9, 1, 0, 0, 1e300}, {9, 1, 1, 1, -1e300}, {9, 2, 2, 2, 0.25}};
  auto p0 = kernels::bound_and_aggregate(t0, {10, -1.0, 1.0}, users, stats);
  std::sort(p0.begin(), p0.end(), [](auto& a, auto& b) { return a.key < b.key; });
  ASSERT_EQ(p0.size(), 2u);
  EXPECT_EQ(p0[0].count, 2);
  EXPECT_EQ(p0[0].sum, 0);  // 1 + (-1)
  EXPECT_EQ(p0[0].new_users, 1);
  EXPECT_EQ(p0[1].sum, to_fixed(0.25));
  EXPECT_EQ(stats.clamped, 2u);
  // Next trigger: the same user on key 1 again is not a new user for key 1.
  std::vector<Record> t1 = {{9, 1, 5, 3, 0.5}};
  auto p1 = kernels::bound_and_aggregate(t1, {10, -1.0, 1.0}, users, stats);
  ASSERT_EQ(p1.size(), 1u);
  EXPECT_EQ(p1[0].new_users, 0);
  EXPECT_EQ(users.users(), 1u);
  EXPECT_EQ(users.user_key_pairs(), 2u);
  users.clear();
  EXPECT_EQ(users.users(), 0u);
}

// Two keys whose 32-bit fingerprints collide (birthday search over consecutive keys: expected near
// 2^16 of them).
std::pair<std::uint64_t, std::uint64_t> colliding_keys() {
  std::unordered_map<std::uint32_t, std::uint64_t> seen;
  for (std::uint64_t k = 1;; ++k) {
    auto [it, added] = seen.emplace(kernels::UserState::key_fingerprint(k), k);
    if (!added) return {it->second, k};
  }
}

std::int64_t new_users_of(const std::vector<KeyPartial>& partials, std::uint64_t key) {
  std::int64_t n = 0;
  for (const auto& p : partials)
    if (p.key == key) n += p.new_users;
  return n;
}

TEST(Bounding, FirstTouchFingerprintsNeverOverCountAndOnlyUnderCountTheSameUser) {
  const auto [k1, k2] = colliding_keys();
  ASSERT_NE(k1, k2);
  ASSERT_EQ(kernels::UserState::key_fingerprint(k1), kernels::UserState::key_fingerprint(k2));
  const kernels::BoundingParams params{32, 0.0, 1.0};
  kernels::UserState users;
  kernels::BoundingStats stats;
  // User 1 touches k1, then (next trigger) k2: the collision hides k2's first touch of user 1 only:
  // its record still counts, its user count is under-counted by one (privacy-safe).
  auto p0 = kernels::bound_and_aggregate({{1, k1, 0, 0, 0.5}}, params, users, stats);
  EXPECT_EQ(new_users_of(p0, k1), 1);
  auto p1 =
      kernels::bound_and_aggregate({{1, k2, 1, 1, 0.5}, {2, k2, 1, 2, 0.5}, {3, k1, 1, 3, 0.5}}, params, users, stats);
  EXPECT_EQ(new_users_of(p1, k2), 1);  // user 2 only: another user's collision never hides a user
  EXPECT_EQ(new_users_of(p1, k1), 1);  // user 3
  std::int64_t records_k2 = 0;
  for (const auto& p : p1) records_k2 += p.key == k2 ? p.count : 0;
  EXPECT_EQ(records_k2, 2);
  // Both keys in one trigger of a new user: counted once in all (never twice).
  auto p2 = kernels::bound_and_aggregate({{4, k1, 2, 4, 0.5}, {4, k2, 2, 5, 0.5}}, params, users, stats);
  EXPECT_EQ(new_users_of(p2, k1) + new_users_of(p2, k2), 1);
  // No false negative: a user's 32 distinct keys (distinct fingerprints) each count once, and
  // never again when revisited, across triggers.
  std::vector<Record> first, again;
  std::set<std::uint32_t> fingerprints;
  for (std::uint64_t i = 0; i < 32; ++i) {
    const std::uint64_t key = 1000003 * (i + 1);
    fingerprints.insert(kernels::UserState::key_fingerprint(key));
    (i % 2 ? first : again).push_back({9, key, 3, 10 + i, 0.5});
  }
  ASSERT_EQ(fingerprints.size(), 32u);
  auto a = kernels::bound_and_aggregate(first, params, users, stats);
  auto b = kernels::bound_and_aggregate(again, params, users, stats);
  std::int64_t total = 0;
  for (const auto& p : a) total += p.new_users;
  for (const auto& p : b) total += p.new_users;
  EXPECT_EQ(total, 32);
  EXPECT_EQ(users.user_key_pairs(), 1u + 1u + 1u + 1u + 32u);  // (1,k1) (2,k2) (3,k1) (4,k1|k2) + 32
  std::size_t listed = 0;
  for (std::size_t s = 0; s < kernels::UserState::kShards; ++s) listed += users.pairs(s).size();
  EXPECT_EQ(listed, users.user_key_pairs());
}

// A user's fingerprints live in a block that grows 1 -> 3 -> 7 -> ... -> 63 and then spills into the
// exact overflow set: every key counts once whatever the size, across triggers and after a journal
// drain; the journal returns each new pair once and each changed user's last kept count.
TEST(Bounding, ManyKeysPerUserGrowBlocksAndOverflowExactly) {
  const kernels::BoundingParams params{100000, 0.0, 1.0};
  kernels::UserState users;
  users.journal = true;
  kernels::BoundingStats stats;
  std::set<std::pair<std::uint64_t, std::uint32_t>> journaled_pairs;
  std::map<std::uint64_t, std::uint32_t> journaled_kept;
  auto drain = [&] {
    for (std::size_t s = 0; s < kernels::UserState::kShards; ++s) {
      std::vector<kernels::UserState::UserFingerprint> changed, added;
      users.drain_journal(s, changed, added);
      for (const auto& [u, kept] : changed) journaled_kept[u] = kept;
      for (const auto& p : added) EXPECT_TRUE(journaled_pairs.insert(p).second) << "pair journaled twice";
    }
    EXPECT_TRUE(users.journal_empty());
  };
  // Users 1..40 get i * 5 distinct keys over 5 triggers (user 40: 200 keys, beyond one block); every
  // trigger also repeats the previous trigger's keys, which must not count again.
  std::int64_t counted = 0;
  std::uint64_t ts = 0;
  std::vector<Record> previous;
  for (std::uint64_t t = 0; t < 5; ++t) {
    std::vector<Record> batch = previous;
    for (auto& r : batch) r.timestamp = static_cast<std::int64_t>(t), r.position = ++ts;
    std::vector<Record> fresh;
    for (std::uint64_t u = 1; u <= 40; ++u)
      for (std::uint64_t i = 0; i < u; ++i)
        fresh.push_back({u, u * 1000003 + t * 101 + i, static_cast<std::int64_t>(t), ++ts, 0.5});
    batch.insert(batch.end(), fresh.begin(), fresh.end());
    for (const auto& p : kernels::bound_and_aggregate(batch, params, users, stats)) counted += p.new_users;
    EXPECT_EQ(counted, std::int64_t{20} * 41 * (t + 1)) << "trigger " << t;
    if (t % 2 == 1) drain();
    previous = fresh;
  }
  drain();
  EXPECT_EQ(users.user_key_pairs(), 20u * 41u * 5u);
  std::set<std::pair<std::uint64_t, std::uint32_t>> listed;
  for (std::size_t s = 0; s < kernels::UserState::kShards; ++s)
    for (const auto& p : users.pairs(s)) EXPECT_TRUE(listed.insert(p).second);
  EXPECT_EQ(listed, journaled_pairs);
  for (std::uint64_t u = 1; u <= 40; ++u) EXPECT_EQ(journaled_kept[u], u * 5 + (u * 4)) << "user " << u;
  // Fingerprint words dominate: 4 bytes per pair plus slack, not a hash set of 8-byte codes.
  EXPECT_LT(users.memory_bytes(), 256u * 2048 + 20u * 41u * 5u * 16u);
}

TEST(Bounding, SumsBeyondInt64NeverAbortAndStayExact) {
  // 6000 users with C = 2 records of the largest value on key 7, and as many of the smallest on key 8:
  // each key's sum is 12000 * 2^51 ~ 2^64.6 in fixed point, beyond int64 within one trigger.
  const std::uint32_t C = 2;
  const double lo = -kMaxAbsClamp, hi = kMaxAbsClamp;
  std::vector<Record> records;
  std::uint64_t position = 0;
  for (std::uint64_t u = 0; u < 6000; ++u)
    for (int i = 0; i < 3; ++i) {  // the third record of each user is dropped by bounding
      records.push_back({u, 7, static_cast<std::int64_t>(position), position, 1e12});  // clamped to 2^31
      ++position;
      records.push_back({100000 + u, 8, static_cast<std::int64_t>(position), position, -hi});
      ++position;
    }
  const int128 one_record = int128{1} << 51;  // 2^31 in 2^-20 fixed point
  for (const int threads : {1, 2}) {
    dpstream::testing::ScopedOmpThreads scoped(threads);
    kernels::UserState users;
    kernels::KeyStateTable keys;
    kernels::BoundingStats stats;
    const auto partials = kernels::bound_and_aggregate(records, {C, lo, hi}, users, stats);
    const auto got = keys.accumulate(partials);
    ASSERT_EQ(got.size(), 2u);
    EXPECT_EQ(got[0].key, 7u);
    EXPECT_EQ(got[0].count, 12000);
    EXPECT_EQ(got[0].users, 6000);
    EXPECT_TRUE(got[0].sum == 12000 * one_record) << static_cast<double>(got[0].sum);
    EXPECT_TRUE(got[1].sum == -12000 * one_record) << static_cast<double>(got[1].sum);
    EXPECT_EQ(stats.dropped, 12000u);
    // The same trigger again (new positions do not matter: C is reached): the running sums hold.
    const auto again = keys.accumulate(kernels::bound_and_aggregate(records, {C, lo, hi}, users, stats));
    EXPECT_TRUE(again.empty());
  }
}

// The user-state digest depends on the contents only: any thread count, and the digests of a state
// split by user (as over ranks) add up to the whole's; one more (user, key) pair or kept record changes it.
TEST(Bounding, StateDigestIsOrderFreeAndAddsOverAPartitionByUser) {
  std::mt19937_64 rng(77);
  std::uint64_t position = 0;
  std::vector<std::vector<Record>> triggers;
  triggers.reserve(20);
  for (int t = 0; t < 20; ++t) triggers.push_back(random_trigger(rng, t, position));
  // Users with many keys, so that blocks grow and overflow (kBlockCapacity) take part too.
  for (std::uint64_t k = 0; k < 200; ++k)
    triggers.back().push_back(Record{1000 + k % 3, 5000 + k, 1999, position++, 1.0});
  auto digest_of = [&](int threads, const std::function<bool(std::uint64_t)>& owns) {
    dpstream::testing::ScopedOmpThreads scoped(threads);
    kernels::UserState users;
    kernels::BoundingStats stats;
    for (const auto& records : triggers) {
      std::vector<Record> mine;
      for (const Record& r : records)
        if (owns(r.user)) mine.push_back(r);
      kernels::bound_and_aggregate(mine, {200, -1.0, 2.5}, users, stats);
    }
    return users.digest(9);
  };
  const auto all = [](std::uint64_t) { return true; };
  const std::uint64_t d = digest_of(1, all);
  EXPECT_EQ(digest_of(2, all), d);
  EXPECT_EQ(digest_of(1, [](std::uint64_t u) { return u % 2 == 0; }) +
                digest_of(2, [](std::uint64_t u) { return u % 2 == 1; }),
            d);
  triggers.back().push_back(Record{1000, 999999, 1999, position++, 1.0});  // a new key of a user with many
  EXPECT_NE(digest_of(1, all), d);
  triggers.back().pop_back();
  triggers.back().push_back(Record{1000, 5000, 1999, position++, 1.0});  // a key it has: one more kept record
  EXPECT_NE(digest_of(1, all), d);
  EXPECT_EQ(kernels::UserState().digest(9), 0u);
}

// The per-shard tables grow by a quarter while users arrive: every user is found again with its own
// kept count and fingerprints, whatever the arrival order (equal digests), and the tables stay at
// least 64% full once grown (memory per user).
TEST(Bounding, UserTablesGrowAndFindEveryUserInAnyOrder) {
  std::vector<std::uint64_t> ids(60000);
  std::mt19937_64 rng(3);
  for (auto& id : ids) id = rng();
  auto build = [](const std::vector<std::uint64_t>& order) {
    kernels::UserState users;
    for (const std::uint64_t id : order) {
      const std::size_t shard = id % kernels::UserState::kShards;
      auto [slot, added] = users.find_or_add(shard, id);
      EXPECT_TRUE(added);
      slot->kept = static_cast<std::uint32_t>(id % 1000);
      for (std::uint32_t k = 0; k < id % 9; ++k)  // 0-8 keys: inline only, and inline plus a block
        EXPECT_TRUE(users.add_pair(shard, id, *slot, static_cast<std::uint32_t>(id >> 32) + k));
    }
    return users;
  };
  const kernels::UserState forward = build(ids);
  std::vector<std::uint64_t> reversed(ids.rbegin(), ids.rend());
  kernels::UserState backward = build(reversed);
  EXPECT_EQ(forward.users(), ids.size());
  EXPECT_EQ(forward.digest(11), backward.digest(11));
  for (const std::uint64_t id : ids) {
    const std::size_t shard = id % kernels::UserState::kShards;
    auto [slot, added] = backward.find_or_add(shard, id);
    ASSERT_FALSE(added);
    EXPECT_EQ(slot->kept, id % 1000);
    EXPECT_FALSE(backward.add_pair(shard, id, *slot, static_cast<std::uint32_t>(id >> 32)) && id % 9 != 0);
  }
  EXPECT_EQ(backward.users(), ids.size());
  std::map<std::uint64_t, std::uint32_t> kept;
  forward.for_each_user([&](std::uint64_t user, std::uint32_t k) { EXPECT_TRUE(kept.emplace(user, k).second); });
  EXPECT_EQ(kept.size(), ids.size());
  EXPECT_LT(forward.memory_bytes(), ids.size() * (sizeof(kernels::UserState::Slot) * 100 / 64 + 5 * 4) + 256 * 8192);
}
