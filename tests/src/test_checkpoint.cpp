// Checkpoint pieces under MPI (1-3 ranks): HDF5 images, journals, re-partitioning on load, the
// commit log through the Store, fall-back and identity. The kill-and-resume tests of the whole
// CLI are tests/e2e/test_checkpoint_kill.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <tuple>

#include <fmt/format.h>
#include <xxhash.h>

#include "kernels/bounding.hpp"
#include "kernels/key_accumulate.hpp"
#include "partition/hash.hpp"
#include "src/checkpoint.hpp"
#include "src/config.hpp"
#include "src/errors.hpp"
#include "src/h5.hpp"
#include "src/release_writer.hpp"
#include "tests/mpi_scratch.hpp"

using namespace dpstream;
namespace fs = std::filesystem;

namespace {

fs::path shared_dir(const shuffle::Comm& comm, const std::string& name) {
  auto dir = dpstream::testing::mpi_scratch_path("ckpt_" + name);
  comm.barrier();
  if (comm.rank() == 0) fs::remove_all(dir);
  comm.barrier();
  return dir;
}

// A random trigger of records for users 0..U-1 and keys 0..K-1 (the same on every rank; each rank
// keeps the users it owns, as after the user shuffle).
std::vector<Record> owned_records(std::mt19937_64& rng, int rank, int ranks, int n, std::uint64_t U, std::uint64_t K) {
  std::vector<Record> all;
  all.reserve(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i)
    all.push_back(Record{rng() % U, rng() % K, static_cast<std::int64_t>(i), static_cast<std::uint64_t>(i),
                         static_cast<double>(rng() % 1000) / 999.0});
  std::vector<Record> mine;
  for (const auto& r : all)
    if (partition::user_owner(r.user, ranks) == rank) mine.push_back(r);
  return mine;
}

// Flattened state for comparisons: user -> kept, (user, key fingerprint) pairs, key -> state.
struct Flat {
  std::map<std::uint64_t, std::uint32_t> kept;
  std::set<std::pair<std::uint64_t, std::uint32_t>> pairs;
  std::map<std::uint64_t, std::tuple<std::int64_t, int128, std::int64_t, std::int64_t, std::uint32_t, std::uint32_t>>
      keys;
  bool operator==(const Flat&) const = default;
};
Flat flatten(const kernels::UserState& u, const kernels::KeyStateTable& k) {
  Flat f;
  u.for_each_user([&](std::uint64_t user, std::uint32_t kept) { f.kept[user] = kept; });
  for (std::size_t s = 0; s < kernels::UserState::kShards; ++s) {
    const auto pairs = u.pairs(s);
    f.pairs.insert(pairs.begin(), pairs.end());
  }
  k.for_each([&](std::uint64_t key, const kernels::KeyState& st) {
    f.keys[key] = {st.count, st.sum, st.users, st.round_base_users, st.round, st.round_start};
  });
  return f;
}

// Runs `triggers` triggers of bounding + accumulation with the journal on; a fake release bumps the
// round of every 7th key so that the release fields change too, and moves its sum by +-2^100 so that
// both words of the 128-bit sum travel. Returns one journal per trigger.
std::vector<checkpoint::Journal> drive(kernels::UserState& users, kernels::KeyStateTable& keys, int triggers, int rank,
                                       int ranks, std::uint64_t seed,
                                       std::vector<checkpoint::JournalEstimate>* estimates = nullptr) {
  std::mt19937_64 rng(seed);
  users.journal = keys.journal = true;
  const kernels::BoundingParams params{5, 0.0, 1.0, 1};
  kernels::BoundingStats stats;
  std::vector<checkpoint::Journal> out;
  for (int t = 0; t < triggers; ++t) {
    const auto recs = owned_records(rng, rank, ranks, 3000, 400, 90);
    auto partials = kernels::bound_and_aggregate(recs, params, users, stats);
    // Single-process key shuffle: keep only this rank's keys (the test feeds every rank the same stream).
    std::erase_if(partials, [&](const KeyPartial& p) { return partition::key_owner(p.key, ranks) != rank; });
    keys.accumulate(partials, kernels::KeyStateTable::Report::Nothing);
    for (std::size_t s = 0; s < kernels::KeyStateTable::kShards; ++s)
      keys.for_each_in(s, [&](std::uint64_t key, kernels::KeyState st) {
        if ((key + static_cast<std::uint64_t>(t)) % 7 != 0) return;
        ++st.round;
        st.round_start = static_cast<std::uint32_t>(t + 1);
        st.round_base_users = st.users;
        st.sum += (key & 1 ? 1 : -1) * (int128{1} << 100);
        keys.put(key, st);
        keys.mark_changed(key);
      });
    if (estimates) estimates->push_back(checkpoint::estimate_journal(users, keys));
    out.push_back(checkpoint::drain_journal(users, keys));
  }
  return out;
}

JobConfig small_job() { return parse_job(demo_job_toml(), "demo", {"output.progress=\"never\""}); }

// A checkpoint in `dir` of `job` that was started (commit 0) and never finished.
// Writes manifest `j` to `path` with its checksum made to match (an edit a damaged file would not pass, a forger's
// would).
void write_forged_manifest(nlohmann::json j, const fs::path& path) {
  j.erase("checksum");
  const std::string body = j.dump();
  j["checksum"] = fmt::format("{:016x}", XXH3_64bits(body.data(), body.size()));
  std::ofstream(path, std::ios::trunc) << j.dump(1) << "\n";
}

// A new job's start in `store`: opened, its job record and commit 0 written.
void begin_job(checkpoint::Store& store, const JobConfig& job, const checkpoint::Fields& fields) {
  store.open(job.name, fields, checkpoint::StartMode::Start);
  store.begin(job.name, fields, nullptr);
  store.commit_start({.bytes = 10}, nlohmann::json::object());
}

void start_unfinished_job(const fs::path& dir, const JobConfig& job, const checkpoint::Fields& fields,
                          const shuffle::Comm& comm) {
  checkpoint::Store store(dir, comm);
  begin_job(store, job, fields);
}

}  // namespace

TEST(H5, MemoryFileRoundTripsDatasetsAndAttributes) {
  std::vector<std::byte> image;
  {
    h5::MemoryFile f;
    h5::create_group(f.get(), "g");
    h5::write_dataset(f.get(), "g/u64", std::vector<std::uint64_t>{1, 2, std::uint64_t{1} << 63});
    h5::write_dataset(f.get(), "g/i64", std::vector<std::int64_t>{-5, 7});
    h5::write_dataset(f.get(), "g/empty", std::vector<std::uint32_t>{});
    h5::write_attribute(f.get(), "n", std::uint64_t{42});
    h5::write_attribute(f.get(), "s", std::string("hello"));
    h5::write_attribute(f.get(), "blank", std::string());
    image = f.image();
  }
  h5::MemoryFile g(image);
  EXPECT_EQ(h5::read_dataset<std::uint64_t>(g.get(), "g/u64"),
            (std::vector<std::uint64_t>{1, 2, std::uint64_t{1} << 63}));
  EXPECT_EQ(h5::read_dataset<std::int64_t>(g.get(), "g/i64"), (std::vector<std::int64_t>{-5, 7}));
  EXPECT_TRUE(h5::read_dataset<std::uint32_t>(g.get(), "g/empty").empty());
  EXPECT_EQ(h5::read_uint_attribute(g.get(), "n"), 42u);
  EXPECT_EQ(h5::read_string_attribute(g.get(), "s"), "hello");
  EXPECT_EQ(h5::read_string_attribute(g.get(), "blank"), "");
  EXPECT_FALSE(h5::exists(g.get(), "g/missing"));
  EXPECT_THROW(h5::read_dataset<std::uint64_t>(g.get(), "g/missing"), std::runtime_error);
  std::vector<std::byte> garbage(image.size(), std::byte{0x5a});
  EXPECT_THROW(h5::MemoryFile{garbage}, std::runtime_error);
}

// Segment columns are stored in the narrowest integer type that holds their values and read back
// widened; every width boundary is checked on both sides, and a column stored wider than its reader's
// type (or negative into an unsigned one) is refused, not clipped.
TEST(H5, NarrowestColumnsRoundTripExactlyAndWiderOnesAreRefused) {
  struct Case {
    std::vector<std::int64_t> values;
    std::size_t bytes;
  };
  const std::vector<Case> signed_cases = {{{}, 1},
                                          {{0, 0}, 1},
                                          {{127, -128}, 1},
                                          {{128}, 2},
                                          {{-129}, 2},
                                          {{32767, -32768}, 2},
                                          {{32768}, 4},
                                          {{-32769}, 4},
                                          {{2147483647, -2147483648LL}, 4},
                                          {{2147483648LL}, 8},
                                          {{-2147483649LL}, 8},
                                          {{INT64_MAX, INT64_MIN}, 8}};
  const std::vector<std::pair<std::vector<std::uint64_t>, std::size_t>> unsigned_cases = {
      {{0, 255}, 1},        {{256}, 2},           {{65535}, 2},        {{65536}, 4},
      {{4294967295ULL}, 4}, {{4294967296ULL}, 8}, {{UINT64_MAX, 0}, 8}};
  std::vector<std::byte> image;
  {
    h5::MemoryFile f;
    for (std::size_t i = 0; i < signed_cases.size(); ++i)
      h5::write_narrowest_dataset(f.get(), fmt::format("s{}", i), signed_cases[i].values);
    for (std::size_t i = 0; i < unsigned_cases.size(); ++i)
      h5::write_narrowest_dataset(f.get(), fmt::format("u{}", i), unsigned_cases[i].first);
    h5::write_dataset(f.get(), "wide_u64", std::vector<std::uint64_t>{1, 2});
    h5::write_dataset(f.get(), "wide_i64", std::vector<std::int64_t>{-1});
    image = f.image();
  }
  h5::MemoryFile g(image);
  auto stored_bytes = [&](const std::string& name) {
    h5::Id ds(H5Dopen2(g.get(), name.c_str(), H5P_DEFAULT), H5Dclose, name);
    h5::Id type(H5Dget_type(ds.get()), H5Tclose, name);
    return H5Tget_size(type.get());
  };
  for (std::size_t i = 0; i < signed_cases.size(); ++i) {
    const std::string name = fmt::format("s{}", i);
    EXPECT_EQ(h5::read_dataset<std::int64_t>(g.get(), name), signed_cases[i].values) << name;
    EXPECT_EQ(stored_bytes(name), signed_cases[i].bytes) << name;
  }
  for (std::size_t i = 0; i < unsigned_cases.size(); ++i) {
    const std::string name = fmt::format("u{}", i);
    EXPECT_EQ(h5::read_dataset<std::uint64_t>(g.get(), name), unsigned_cases[i].first) << name;
    EXPECT_EQ(stored_bytes(name), unsigned_cases[i].second) << name;
  }
  EXPECT_EQ(h5::read_dataset<std::uint32_t>(g.get(), "u2"), (std::vector<std::uint32_t>{65535}));       // 2 -> 4 bytes
  EXPECT_EQ(h5::read_dataset<std::int64_t>(g.get(), "u4"), (std::vector<std::int64_t>{4294967295LL}));  // 4 -> 8
  EXPECT_THROW(h5::read_dataset<std::uint32_t>(g.get(), "wide_u64"), std::runtime_error);  // 8 bytes into 4
  EXPECT_THROW(h5::read_dataset<std::int64_t>(g.get(), "wide_u64"), std::runtime_error);   // 2^64 - 1 would not fit
  EXPECT_THROW(h5::read_dataset<std::uint64_t>(g.get(), "wide_i64"), std::runtime_error);  // a negative value
  EXPECT_THROW(h5::read_dataset<std::uint32_t>(g.get(), "s1"), std::runtime_error);        // signed into unsigned
}

// Found by tests/fuzz/fuzz_checkpoint_h5: an array attribute read as one integer overran the stack,
// a variable-length string was read as a pointer, and a dataset's extent sized a buffer unchecked.
TEST(H5, RefusesAttributesAndDatasetsOfAnotherShape) {
  std::vector<std::byte> image;
  {
    h5::MemoryFile f;
    {
      const hsize_t eight[1] = {8};
      const std::vector<std::uint64_t> values(8, 1);
      h5::Id space(H5Screate_simple(1, eight, nullptr), H5Sclose, "a dataspace");
      h5::Id array(H5Acreate2(f.get(), "array", H5T_NATIVE_UINT64, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose,
                   "array");
      ASSERT_GE(H5Awrite(array.get(), H5T_NATIVE_UINT64, values.data()), 0);
      h5::Id vstring(H5Tcopy(H5T_C_S1), H5Tclose, "a string type");
      ASSERT_GE(H5Tset_size(vstring.get(), H5T_VARIABLE), 0);
      h5::Id scalar(H5Screate(H5S_SCALAR), H5Sclose, "a dataspace");
      h5::Id text(H5Acreate2(f.get(), "vstring", vstring.get(), scalar.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose,
                  "vstring");
      const char* p = "text";
      ASSERT_GE(H5Awrite(text.get(), vstring.get(), &p), 0);
      // 2^40 elements in chunks that were never written: a small file with a huge extent.
      const hsize_t huge[1] = {hsize_t{1} << 40}, chunk[1] = {1024};
      h5::Id huge_space(H5Screate_simple(1, huge, nullptr), H5Sclose, "a dataspace");
      h5::Id dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose, "a dataset creation list");
      ASSERT_GE(H5Pset_chunk(dcpl.get(), 1, chunk), 0);
      h5::Id ds(H5Dcreate2(f.get(), "huge", H5T_NATIVE_UINT64, huge_space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT),
                H5Dclose, "huge");
    }
    h5::write_attribute(f.get(), "name", std::string("abc"));
    image = f.image();
  }
  h5::MemoryFile g(image);
  auto message = [](auto&& read) {
    try {
      read();
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { h5::read_uint_attribute(g.get(), "array"); }).find("not a single value"), std::string::npos);
  EXPECT_NE(message([&] { h5::read_string_attribute(g.get(), "array"); }).find("not a single value"),
            std::string::npos);
  EXPECT_NE(message([&] { h5::read_string_attribute(g.get(), "vstring"); }).find("not a fixed-length string"),
            std::string::npos);
  EXPECT_NE(message([&] { h5::read_uint_attribute(g.get(), "name"); }).find("not an integer"), std::string::npos);
  EXPECT_NE(message([&] { h5::read_dataset<std::uint64_t>(g.get(), "huge"); }).find("do not fit in the file"),
            std::string::npos);
  EXPECT_EQ(h5::read_string_attribute(g.get(), "name"), "abc");
}

TEST(Journal, SegmentsReplayToTheSameState) {
  shuffle::Comm comm;
  kernels::UserState users;
  kernels::KeyStateTable keys;
  const auto segments = drive(users, keys, 6, comm.rank(), comm.size(), 11);
  ASSERT_EQ(segments.size(), 6u);
  kernels::UserState u2;
  kernels::KeyStateTable k2;
  for (const auto& s : segments) checkpoint::apply(s.to_segment(), u2, k2, comm.rank(), comm.size(), /*filter=*/false);
  EXPECT_TRUE(flatten(users, keys) == flatten(u2, k2));
  // A journal that missed one trigger does not reproduce the state (the test can fail).
  kernels::UserState u3;
  kernels::KeyStateTable k3;
  for (std::size_t i = 0; i + 1 < segments.size(); ++i)
    checkpoint::apply(segments[i].to_segment(), u3, k3, comm.rank(), comm.size(), false);
  EXPECT_FALSE(flatten(users, keys) == flatten(u3, k3));
  // The journal was drained.
  EXPECT_TRUE(users.journal_empty());
  EXPECT_EQ(keys.changed_key_count(), 0u);
  // The restored users bound the next trigger as the originals do (kept counts and first touches found where
  // bounding looks for them: a user restored into another shard would count its keys as new again). A larger
  // C than drive()'s, so that the restored users keep records of keys they have touched.
  {
    std::mt19937_64 rng(11);  // drive()'s records once more, as one trigger
    std::vector<Record> next;
    for (int t = 0; t < 6; ++t) {
      const auto again = owned_records(rng, comm.rank(), comm.size(), 3000, 400, 90);
      next.insert(next.end(), again.begin(), again.end());
    }
    const kernels::BoundingParams more{1000, 0.0, 1.0, 1};
    kernels::BoundingStats s1, s2;
    auto p1 = kernels::bound_and_aggregate(next, more, users, s1);
    auto p2 = kernels::bound_and_aggregate(next, more, u2, s2);
    const auto by_key = [](const KeyPartial& a, const KeyPartial& b) {
      return std::tie(a.key, a.count, a.sum, a.new_users) < std::tie(b.key, b.count, b.sum, b.new_users);
    };
    std::sort(p1.begin(), p1.end(), by_key);
    std::sort(p2.begin(), p2.end(), by_key);
    ASSERT_EQ(p1.size(), p2.size());
    std::int64_t repeated = 0;  // partials of pairs touched before: the check's subject
    for (std::size_t i = 0; i < p1.size(); ++i) {
      EXPECT_EQ(p1[i].key, p2[i].key);
      EXPECT_EQ(p1[i].new_users, p2[i].new_users) << "key " << p1[i].key;
      repeated += p1[i].new_users == 0 ? 1 : 0;
    }
    EXPECT_GT(repeated, 100);
    EXPECT_EQ(s1.kept, s2.kept);
    EXPECT_EQ(s1.new_users, s2.new_users);
    EXPECT_EQ(users.digest(3), u2.digest(3));
  }
}

// A key with count and users only travels in 16 bytes; any other field (a sum, a round, a value of
// 2^32 or more) keeps the full state. Both kinds replay exactly.
TEST(Journal, CountOnlyKeysAreCompactAndEveryKeyReplaysExactly) {
  kernels::UserState users;
  kernels::KeyStateTable keys;
  keys.journal = true;
  const std::uint64_t big = std::uint64_t{1} << 32;
  std::map<std::uint64_t, kernels::KeyState> expected;
  auto set = [&](std::uint64_t key, std::int64_t count, std::int64_t users_, std::int64_t sum, std::uint32_t round) {
    kernels::KeyState st;
    st.count = count;
    st.users = users_;
    st.sum = sum;
    st.round = round;
    st.round_start = round;
    st.round_base_users = round ? users_ : 0;
    keys.put(key, st);
    keys.mark_changed(key);
    expected[key] = st;
  };
  for (std::uint64_t k = 1; k <= 300; ++k) set(k, static_cast<std::int64_t>(k * 3), static_cast<std::int64_t>(k), 0, 0);
  set(1001, static_cast<std::int64_t>(big - 1), 7, 0, 0);  // the largest count-only value
  set(1002, static_cast<std::int64_t>(big), 7, 0, 0);      // count needs 33 bits
  set(1003, 5, static_cast<std::int64_t>(big + 4), 0, 0);  // users need 33 bits
  set(1004, 5, 2, -(std::int64_t{1} << 40), 0);            // a sum
  set(1005, 5, 2, 0, 3);                                   // a round
  // The key table packs users below 2^31 (its top bit is the journal mark): either side of it.
  set(1006, 5, (std::int64_t{1} << 31) - 1, 0, 0);
  set(1007, 5, std::int64_t{1} << 31, 0, 0);
  keys.mark_changed(1006);  // marked twice: journaled once
  EXPECT_EQ(keys.changed_key_count(), 307u);
  const auto j = checkpoint::drain_journal(users, keys);
  std::size_t count_only = 0, full = 0;
  for (const auto& shard : j.count_keys) count_only += shard.size();
  for (const auto& shard : j.full_keys) full += shard.size();
  EXPECT_EQ(count_only, 303u);
  EXPECT_EQ(full, 4u);
  EXPECT_EQ(j.key_bytes(), 307 * checkpoint::Segment::kKeyBytes);
  EXPECT_LE(j.memory_bytes(),
            2 * (303 * sizeof(checkpoint::Journal::CountKey) + std::size_t{4} * 64 + std::size_t{256} * 64));
  EXPECT_EQ(keys.changed_key_count(), 0u);
  EXPECT_EQ(checkpoint::drain_journal(users, keys).key_bytes(), 0u) << "the drain cleared the marks";
  kernels::UserState u2;
  kernels::KeyStateTable k2;
  checkpoint::apply(j.to_segment(), u2, k2, 0, 1, false);
  EXPECT_EQ(k2.keys(), expected.size());
  for (const auto& [key, st] : expected) EXPECT_EQ(k2.at(key), st) << "key " << key;
}

// The key journal's marks live in the key slots: accumulation marks the keys it changes (only with the
// journal on), a mark survives the table's growth and a store that widens the key, and the drain returns
// exactly the marked keys, each once, with their state now.
TEST(Journal, KeyMarksNameEachChangedKeyOnceThroughGrowth) {
  kernels::KeyStateTable keys(/*track_sums=*/false);
  keys.accumulate({{1, 1, 0, 1}, {2, 1, 0, 1}});  // journal off: no mark
  EXPECT_EQ(keys.changed_key_count(), 0u);
  keys.journal = true;
  std::vector<KeyPartial> partials;
  for (std::uint64_t k = 1; k <= 1000; ++k) partials.push_back({k, 2, 0, 1});
  keys.accumulate(partials, kernels::KeyStateTable::Report::Nothing);
  keys.accumulate({{5, 1, 0, 1}, {7, 1, 0, 0}}, kernels::KeyStateTable::Report::Nothing);  // again: counted once
  EXPECT_EQ(keys.changed_key_count(), 1000u);
  for (std::uint64_t k = 100000; k < 120000; ++k)
    keys.put(k, kernels::KeyState{.count = 1, .sum = {}, .users = 1});  // grows
  kernels::KeyState released = keys.at(9);
  released.round = 1;
  keys.put(9, released);  // widened: its mark stays
  kernels::UserState users;
  const auto j = checkpoint::drain_journal(users, keys);
  std::map<std::uint64_t, kernels::KeyState> drained;
  for (const auto& shard : j.count_keys)
    for (const auto& k : shard)
      EXPECT_TRUE(drained.emplace(k.id, kernels::KeyState{.count = k.count, .sum = {}, .users = k.users}).second);
  for (const auto& shard : j.full_keys)
    for (const auto& [id, st] : shard) EXPECT_TRUE(drained.emplace(id, st).second);
  ASSERT_EQ(drained.size(), 1000u);
  for (const auto& [key, st] : drained) EXPECT_EQ(st, keys.at(key)) << "key " << key;
  EXPECT_EQ(drained.at(5).count, 3);  // 2 + 1: the state at the drain
  EXPECT_EQ(drained.at(9).round, 1u);
  EXPECT_EQ(keys.changed_key_count(), 0u);
}

// The commit cadence's byte bound reads estimate_journal after every trigger, without a pass over
// the state; it must tell what drain_journal then holds: exactly for the users, and for the keys an
// upper bound within 2x here (the fake release marks every 7th key again, which counts it once, and
// keeps its full state: with sums every key is journaled in full, without only the released ones).
TEST(Journal, EstimateBeforeTheDrainTellsWhatTheDrainHolds) {
  for (const bool sums : {true, false}) {
    SCOPED_TRACE(sums ? "sums" : "counts only");
    kernels::UserState users;
    kernels::KeyStateTable keys(sums);
    std::vector<checkpoint::JournalEstimate> estimates;
    const auto journals = drive(users, keys, 5, 0, 1, 23, &estimates);
    for (std::size_t t = 0; t < journals.size(); ++t) {
      const checkpoint::Journal& j = journals[t];
      const checkpoint::JournalEstimate& e = estimates[t];
      std::uint64_t user_memory = 0;
      for (const auto& shard : j.changed_users) user_memory += shard.capacity() * sizeof(shard[0]);
      for (const auto& shard : j.new_pairs) user_memory += shard.capacity() * sizeof(shard[0]);
      const std::uint64_t key_memory = j.memory_bytes() - user_memory;
      if (t == 0) {
        ASSERT_GT(user_memory, 0u);  // later triggers find most users at C already
      }
      ASSERT_GT(key_memory, 0u);
      EXPECT_EQ(e.users, user_memory) << "trigger " << t;
      EXPECT_GE(e.keys, key_memory) << "trigger " << t;
      EXPECT_LE(e.keys, 2 * key_memory) << "trigger " << t;
    }
    const checkpoint::JournalEstimate after = checkpoint::estimate_journal(users, keys);
    EXPECT_EQ(after.bytes(), 0u) << "a drained journal holds nothing";
  }
}

TEST(Journal, RepartitioningSplitsTheStateByOwner) {
  // State of one rank-count-1 run, loaded onto 3 owners: the union is the whole, the parts disjoint.
  kernels::UserState users;
  kernels::KeyStateTable keys;
  const auto segments = drive(users, keys, 4, 0, 1, 5);
  const Flat whole = flatten(users, keys);
  Flat merged;
  std::size_t parts_users = 0, parts_keys = 0;
  for (int r = 0; r < 3; ++r) {
    kernels::UserState u;
    kernels::KeyStateTable k;
    for (const auto& s : segments) checkpoint::apply(s.to_segment(), u, k, r, 3, /*filter=*/true);
    const Flat part = flatten(u, k);
    for (const auto& [user, _] : part.kept) EXPECT_EQ(partition::user_owner(user, 3), r);
    for (const auto& [key, _] : part.keys) EXPECT_EQ(partition::key_owner(key, 3), r);
    parts_users += part.kept.size();
    parts_keys += part.keys.size();
    merged.kept.insert(part.kept.begin(), part.kept.end());
    merged.pairs.insert(part.pairs.begin(), part.pairs.end());
    merged.keys.insert(part.keys.begin(), part.keys.end());
  }
  EXPECT_TRUE(merged == whole);
  EXPECT_EQ(parts_users, whole.kept.size());
  EXPECT_EQ(parts_keys, whole.keys.size());
}

TEST(Identity, EveryOutputDefiningFieldChangesTheFingerprint) {
  const auto base = small_job();
  const auto fp = checkpoint::fingerprint(checkpoint::identity_fields(base, ""));
  const std::vector<std::string> changes = {"job.name=\"other\"",
                                            "input.users=20001",
                                            "input.keys=2001",
                                            "input.seed=8",
                                            "input.key_distribution=\"uniform\"",
                                            "input.records_per_user_q=25",
                                            "input.records_per_user_s=6.7",
                                            "input.records_per_user_max=99999",
                                            "input.key_q=999",
                                            "input.key_s=1.3",
                                            "stream.window_seconds=86401",
                                            "stream.triggers=11",
                                            "stream.first_window=1",
                                            "stream.windows=2",
                                            "privacy.max_records_per_user=15",
                                            "privacy.clamp_min=-1",
                                            "privacy.clamp_max=2",
                                            "query.aggregations=[\"count\"]"};
  for (const auto& c : changes) {
    auto job = parse_job(demo_job_toml(), "demo", {"output.progress=\"never\"", c});
    EXPECT_NE(checkpoint::fingerprint(checkpoint::identity_fields(job, "")), fp) << c;
  }
  // DP fields, against a DP base.
  const std::vector<std::string> dp = {"privacy.mode=\"dp\"", "privacy.epsilon=6", "privacy.delta=1e-9"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), dp.begin(), dp.end());
    return checkpoint::fingerprint(checkpoint::identity_fields(parse_job(demo_job_toml(), "demo", extra), ""));
  };
  const auto dp_fp = with({});
  for (const auto& c : {"privacy.epsilon=5", "privacy.delta=1e-8", "privacy.mu=3", "privacy.beta=1e-12",
                        "privacy.seed=4", "privacy.selection_epsilon_share=0.4", "privacy.selection_delta_share=0.5",
                        "privacy.threshold=\"gaussian-quantile\""})
    EXPECT_NE(with({c}), dp_fp) << c;
  // What does not change the output does not change the identity.
  for (const auto& c : {"checkpoint.every=3", "output.dir=\"elsewhere\"", "output.progress=\"auto\""})
    EXPECT_EQ(with({c}), dp_fp) << c;
  // A CSV input is identified by its content, not by its path.
  auto csv = [](const std::string& path) {
    return parse_job(demo_job_toml(), "demo", {"input.kind=\"csv\"", "input.path=\"" + path + "\"", "input.users=1"});
  };
  EXPECT_NE(checkpoint::fingerprint(checkpoint::identity_fields(csv("x.csv"), "a")),
            checkpoint::fingerprint(checkpoint::identity_fields(csv("x.csv"), "b")));
  EXPECT_EQ(checkpoint::fingerprint(checkpoint::identity_fields(csv("x.csv"), "a")),
            checkpoint::fingerprint(checkpoint::identity_fields(csv("elsewhere/x.csv"), "a")));
}

// A sampler in its rescaled form (zipf.hpp) draws another stream than binaries without it did for the same
// parameters: the identity says so, and only then (the demo's and paper workload's streams are unchanged).
TEST(Identity, RescaledSamplersAreRecorded) {
  const auto fields_of = [](std::vector<std::string> sets) {
    sets.insert(sets.begin(), "output.progress=\"never\"");
    return checkpoint::identity_fields(parse_job(demo_job_toml(), "demo", sets), "");
  };
  EXPECT_EQ(fields_of({}).count("input.zipf_form"), 0u);
  EXPECT_EQ(fields_of({"input.records_per_user_q=500", "input.records_per_user_max=1000"}).at("input.zipf_form"),
            "records_per_user rescaled");
  EXPECT_EQ(fields_of({"input.key_q=1e15", "input.keys=100"}).at("input.zipf_form"), "keys rescaled");
  EXPECT_EQ(
      fields_of({"input.key_q=1e15", "input.keys=100", "input.key_distribution=\"uniform\""}).count("input.zipf_form"),
      0u);
}

// Checkpoints written by earlier binaries are compared field by field: the keys and value spellings
// must not drift (pinned here from the identity_fields of commit c20ec49).
TEST(Identity, FieldsKeepTheirKeysAndSpellings) {
  const std::string mechanism =
      "noise AES-256-CTR/HMAC-SHA256 + discrete Gaussian by 192-bit inverse CDF (sigma <= 4096) or CKS20, values "
      "2^-20, checkpoint v1, CSV ids SipHash-2-4-128 separated";
  const checkpoint::Fields stream = {{"stream.window_seconds", "86400"},  {"stream.triggers", "10"},
                                     {"stream.first_window", "0"},        {"stream.windows", "1"},
                                     {"query.aggregations", "count,sum"}, {"output.format", "csv"},
                                     {"engine.mechanism", mechanism},     {"job.name", "demo"}};
  auto with = [&](checkpoint::Fields f) {
    f.insert(stream.begin(), stream.end());
    return f;
  };
  const checkpoint::Fields synthetic = {{"input.kind", "synthetic"},
                                        {"input.users", "20000"},
                                        {"input.keys", "2000"},
                                        {"input.key_distribution", "zipf-mandelbrot"},
                                        {"input.seed", "7"},
                                        {"input.records_per_user_q", "26"},
                                        {"input.records_per_user_s", "6.738"},
                                        {"input.records_per_user_min", "1"},
                                        {"input.records_per_user_max", "100000"},
                                        {"input.key_q", "1000"},
                                        {"input.key_s", "1.4"},
                                        {"stream.windows_from_input", "no"}};
  auto none = with(synthetic);
  none.insert({{"privacy.mode", "none"},
               {"privacy.max_records_per_user", "16"},
               {"privacy.clamp_min", "0"},
               {"privacy.clamp_max", "1"}});
  EXPECT_EQ(checkpoint::identity_fields(small_job(), "ignored"), none);

  auto dp = with(synthetic);
  dp.insert({{"privacy.mode", "dp"},
             {"privacy.max_records_per_user", "16"},
             {"privacy.clamp_min", "0"},
             {"privacy.clamp_max", "1"},
             {"privacy.composition", "zcdp"},
             {"privacy.epsilon", "6"},
             {"privacy.delta", "1e-09"},
             {"privacy.mu", "3"},
             {"privacy.beta", "default"},
             {"privacy.seed", "4"},
             {"privacy.selection_epsilon_share", "0.5"},
             {"privacy.selection_delta_share", "0.6666666666666666"},
             {"privacy.threshold", "gaussian-quantile"}});
  const std::vector<std::string> dp_overrides = {"privacy.mode=\"dp\"", "privacy.epsilon=6",
                                                 "privacy.delta=1e-9",  "privacy.mu=3",
                                                 "privacy.seed=4",      "privacy.threshold=\"gaussian-quantile\""};
  // Trees: no counter fields (a tree job's identity is as before the banded counters existed).
  auto tree_overrides = dp_overrides;
  tree_overrides.insert(tree_overrides.end(), {"privacy.selection_counter=\"tree\"", "privacy.value_counter=\"tree\""});
  EXPECT_EQ(checkpoint::identity_fields(parse_job(demo_job_toml(), "demo", tree_overrides), "ignored"), dp);
  // The default, banded counters: the counters, the band width, the band this build computes, its sampler.
  auto banded = dp;
  banded.insert(
      {{"privacy.selection_counter", "banded"}, {"privacy.value_counter", "banded"}, {"privacy.counter_band", "8"}});
  auto fields = checkpoint::identity_fields(parse_job(demo_job_toml(), "demo", dp_overrides), "ignored");
  for (const char* engine_key : {"engine.banded_band", "engine.banded_mechanism"}) {
    ASSERT_TRUE(fields.count(engine_key)) << engine_key;
    EXPECT_FALSE(fields.at(engine_key).empty());
    fields.erase(engine_key);
  }
  EXPECT_EQ(fields, banded);

  auto csv = with({{"input.kind", "csv"},
                   {"input.content", "12 bytes, xxh3 0123"},
                   {"input.bad_rows", "skip"},
                   {"stream.windows_from_input", "yes"}});
  csv.insert({{"privacy.mode", "baseline-batch"},
              {"privacy.max_records_per_user", "16"},
              {"privacy.clamp_min", "-1"},
              {"privacy.clamp_max", "2.5"},
              {"privacy.composition", "optimal"},
              {"privacy.epsilon", "1"},
              {"privacy.delta", "1e-06"},
              {"privacy.mu", "default"},
              {"privacy.beta", "default"},
              {"privacy.seed", "secret from the OS"},
              {"privacy.selection_epsilon_share", "0.5"},
              {"privacy.selection_delta_share", "0.6666666666666666"},
              {"privacy.threshold", "subgaussian"}});
  csv["query.aggregations"] = "sum";
  EXPECT_EQ(checkpoint::identity_fields(
                parse_job(demo_job_toml(), "demo",
                          {"input.kind=\"csv\"", "input.path=\"x.csv\"", "privacy.mode=\"baseline-batch\"",
                           "privacy.composition=\"optimal\"", "privacy.epsilon=1", "privacy.delta=1e-6",
                           "privacy.clamp_min=-1", "privacy.clamp_max=2.5", "query.aggregations=[\"sum\"]"}),
                "12 bytes, xxh3 0123"),
            csv);
}

// A commit records releases.csv's length, rows and XXH3; a resume restores the file from them when its committed bytes
// are the job's, and refuses it, untouched, when one was edited (unless the checkpoint predates the XXH3).
TEST(ReleaseWriter, ResumeChecksTheCommittedBytes) {
  shuffle::Comm comm;
  if (comm.rank() != 0) GTEST_SKIP() << "one writer, on rank 0";
  const auto dir = dpstream::testing::mpi_scratch_path("release_writer");
  fs::remove_all(dir);
  fs::create_directories(dir);
  const auto file = dir / "releases.csv";
  const auto read = [&] {
    std::ifstream in(file, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  ReleaseWriter w(dir, {});
  w.start();
  w.stage(0, 0, {{1, "a", 3 << 20, 0}, {2, "b", 5 << 20, 0}});
  const std::string first = w.take_pending();
  w.append(first);
  w.stage(0, 1, {{1, "a", 4 << 20, 0}});
  const std::string staged = w.take_pending();  // the last commit's rows, in its segment, not yet in the file
  const ReleasesExtent committed = w.committed();
  ASSERT_TRUE(committed.xxh3.has_value());
  EXPECT_EQ(committed.bytes, ReleaseWriter::kHeader.size() + first.size() + staged.size());
  EXPECT_EQ(committed.rows, 3u);
  const std::string whole = std::string(ReleaseWriter::kHeader) + first + staged;
  EXPECT_EQ(*committed.xxh3, XXH3_64bits(whole.data(), whole.size()));
  w.append(staged.substr(0, 5));  // killed mid-append

  ReleaseWriter resumed(dir, {});
  resumed.restore(committed, staged);
  EXPECT_EQ(read(), whole);
  EXPECT_EQ(resumed.committed().xxh3, committed.xxh3);

  std::string edited = whole;
  edited[ReleaseWriter::kHeader.size() + 2] ^= 1;  // a byte of the first row
  std::ofstream(file, std::ios::binary | std::ios::trunc) << edited;
  EXPECT_THROW(ReleaseWriter(dir, {}).restore(committed, staged), CheckpointError);
  EXPECT_EQ(read(), edited);               // untouched
  ReleasesExtent short_count = committed;  // counts fewer bytes than its own rows: no wrapped length
  short_count.bytes = staged.size() - 1;
  EXPECT_THROW(ReleaseWriter(dir, {}).restore(short_count, staged), CheckpointError);
  ReleasesExtent unchecked = committed;
  unchecked.xxh3.reset();  // a checkpoint written before the XXH3 was kept: the length alone is checked
  ReleaseWriter(dir, {}).restore(unchecked, staged);
  EXPECT_EQ(read().size(), whole.size());
  fs::remove_all(dir);
}

TEST(Store, CommitsResumeAcrossRankCountsAndFallBack) {
  shuffle::Comm comm;
  const auto dir = shared_dir(comm, "store");
  const auto job = small_job();
  const auto fields = checkpoint::identity_fields(job, "");
  kernels::UserState users;
  kernels::KeyStateTable keys;
  auto segments = drive(users, keys, 3, comm.rank(), comm.size(), 3);
  {
    checkpoint::Store store(dir, comm);
    EXPECT_EQ(store.open(job.name, fields, checkpoint::StartMode::Start).kind, checkpoint::Opened::Kind::New);
    store.begin(job.name, fields, nullptr);
    store.commit_start({.bytes = 10}, nlohmann::json::object());
    for (std::uint32_t t = 0; t < 3; ++t) {
      const std::string rows = comm.rank() == 0 ? "rows of trigger " + std::to_string(t) + "\n" : "";
      store.commit(std::make_shared<checkpoint::Journal>(segments[t]), rows, {0, t, t + 1, false},
                   {{"records", 7 * (t + 1)}}, {.bytes = 10 + 100 * (t + 1), .rows = t + 1});
      // Pipelined: commit t + 1 becomes visible only with the next commit (or finish).
      if (comm.rank() == 0) {
        EXPECT_FALSE(fs::exists(dir / fmt::format("MANIFEST-{:06}.json", t + 1)));
      }
    }
    store.finish();
  }
  comm.barrier();
  const Flat expected = flatten(users, keys);
  // Files are private.
  if (comm.rank() == 0) {
    for (const auto& e : fs::recursive_directory_iterator(dir)) {
      const auto perms = fs::status(e.path()).permissions() & fs::perms::all;
      EXPECT_EQ(perms, e.is_directory() ? fs::perms::owner_all : (fs::perms::owner_read | fs::perms::owner_write))
          << e.path();
    }
    // Two manifests are kept: commits 2 and 3.
    EXPECT_FALSE(fs::exists(dir / "MANIFEST-000001.json"));
    EXPECT_TRUE(fs::exists(dir / "MANIFEST-000002.json"));
  }

  // Resume on the same ranks: the union of the loaded state over ranks equals what was committed.
  auto load_all = [&](checkpoint::Store& store, std::string& staged) {
    kernels::UserState u;
    kernels::KeyStateTable k;
    staged = store.load(u, k, false);
    return flatten(u, k);
  };
  {
    checkpoint::Store store(dir, comm);
    const auto o = store.open(job.name, fields, checkpoint::StartMode::Resume);
    EXPECT_EQ(o.kind, checkpoint::Opened::Kind::Resume);
    EXPECT_TRUE(o.notes.empty());
    EXPECT_EQ(store.manifest().seq, 3u);
    EXPECT_EQ(store.manifest().next_trigger, 3u);
    EXPECT_EQ(store.manifest().counters.at("records").get<int>(), 21);
    std::string staged;
    EXPECT_TRUE(load_all(store, staged) == expected);
    if (comm.rank() == 0) {
      EXPECT_EQ(staged, "rows of trigger 2\n");
    }
  }

  // A damaged latest segment: fall back to commit 2, with a note.
  comm.barrier();
  if (comm.rank() == 0) {
    const auto victim = dir / "w0" / "s000003-r0000.h5";
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x7f');
  }
  comm.barrier();
  {
    checkpoint::Store store(dir, comm);
    const auto o = store.open(job.name, fields, checkpoint::StartMode::Resume);
    ASSERT_EQ(o.notes.size(), 1u);
    EXPECT_NE(o.notes[0].find("falling back"), std::string::npos) << o.notes[0];
    EXPECT_EQ(store.manifest().seq, 2u);
    std::string staged;
    load_all(store, staged);
    if (comm.rank() == 0) {
      EXPECT_EQ(staged, "rows of trigger 1\n");
    }
  }

  // A corrupted older segment (part of both kept commits, same size): opening only stats older
  // files, the ranks that read it verify its checksum and every rank refuses.
  comm.barrier();
  if (comm.rank() == 0) {
    std::fstream f(dir / "w0" / "s000001-r0000.h5", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(200);
    f.put('\x01');
  }
  comm.barrier();
  {
    checkpoint::Store store(dir, comm);
    store.open(job.name, fields, checkpoint::StartMode::Resume);
    kernels::UserState u;
    kernels::KeyStateTable k;
    try {
      store.load(u, k, false);
      ADD_FAILURE() << "a corrupted committed segment was accepted";
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("s000001-r0000.h5"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("checksum"), std::string::npos) << e.what();
    }
  }
  // Truncated: refused when opening, since no kept commit is usable.
  comm.barrier();
  if (comm.rank() == 0) fs::resize_file(dir / "w0" / "s000001-r0000.h5", 50);
  comm.barrier();
  {
    checkpoint::Store store(dir, comm);
    try {
      store.open(job.name, fields, checkpoint::StartMode::Resume);
      ADD_FAILURE() << "a truncated committed segment was accepted";
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("s000001-r0000.h5 is truncated"), std::string::npos) << e.what();
    }
  }
}

// A manifest edited with its checksum made to match (the sweep's forged commit) must describe its segments
// (docs/CHECKPOINTS.md, resume step 3): its list of commits and ranks, their windows and trigger spans. Otherwise a
// resume drops a commit's state (its users contribute again) or reads triggers again (counted twice).
TEST(Store, ManifestMustDescribeItsSegments) {
  shuffle::Comm comm;
  const auto dir = shared_dir(comm, "spans");
  const auto job = small_job();
  const auto fields = checkpoint::identity_fields(job, "");
  {
    kernels::UserState users;
    kernels::KeyStateTable keys;
    const auto segments = drive(users, keys, 4, comm.rank(), comm.size(), 5);
    checkpoint::Store store(dir, comm);
    begin_job(store, job, fields);
    for (std::uint32_t t = 0; t < 4; ++t)  // commit 3 holds triggers [2, 4) (a commit of several triggers)
      if (t != 3)
        store.commit(std::make_shared<checkpoint::Journal>(segments[t]), "", {0, t, t == 2 ? t + 2 : t + 1, false},
                     {{"records", 1}}, {.bytes = 10});
    store.finish();
  }
  comm.barrier();
  const auto manifest = dir / "MANIFEST-000003.json";
  nlohmann::json original;
  if (comm.rank() == 0) original = nlohmann::json::parse(std::ifstream(manifest));
  // Rewrites the newest manifest with `edit` applied and a matching checksum; returns the resume's refusal ("" if
  // none).
  const auto resume_edited = [&](const std::function<void(nlohmann::json&)>& edit, bool window_done = false) {
    if (comm.rank() == 0) {
      nlohmann::json j = original;
      edit(j);
      write_forged_manifest(j, manifest);
    }
    comm.barrier();
    checkpoint::Store store(dir, comm);
    store.open(job.name, fields, checkpoint::StartMode::Resume);
    kernels::UserState u;
    kernels::KeyStateTable k;
    try {
      store.load(u, k, window_done);
    } catch (const CheckpointError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(resume_edited([](nlohmann::json&) {}), "");
  // The segments of commit `seq` from the list: of rank `rank`, or every rank's (-1).
  const auto drop_segments = [](std::uint64_t seq, int rank = -1) {
    return [seq, rank](nlohmann::json& j) {
      auto& segs = j["segments"];
      segs.erase(std::remove_if(segs.begin(), segs.end(),
                                [&](const auto& s) { return s["seq"] == seq && (rank < 0 || s["rank"] == rank); }),
                 segs.end());
    };
  };
  const int last = comm.size() - 1;
  const std::vector<std::pair<std::function<void(nlohmann::json&)>, std::string>> forged = {
      {[](nlohmann::json& j) { j["next_trigger"] = 3; }, "ends at trigger 4 where the manifest's commit ends at 3"},
      {drop_segments(2), "begins at trigger 2 where the log before it ends at 1"},
      {drop_segments(1), "begins at trigger 1 where the log before it ends at 0"},
      {drop_segments(3), "lists 2 as its newest commit"},  // the log would end at 2, the resume start at 4
      {drop_segments(1, last),
       comm.size() == 1 ? "begins at trigger 1" : "does not list rank"},  // that rank's users lose commit 1
      {[](nlohmann::json& j) {
         auto& segs = j["segments"];  // commit 1 listed again after commit 3: triggers replayed
         const nlohmann::json listed = segs;
         for (std::size_t i = 0; i < listed.size() / 3; ++i) segs.push_back(listed[i]);
       },
       "lists 1 as its newest commit"},
      {[](nlohmann::json& j) {
         j["seq"] = 4;  // a commit no segment belongs to, past the log's end
         j["next_trigger"] = 9;
       },
       "lists 3 as its newest commit"},
      {[](nlohmann::json& j) {
         for (auto& s : j["segments"]) s["ranks"] = s["ranks"].get<int>() + 1;
         j["ranks"] = j["ranks"].get<int>() + 1;
       },
       "does not list rank"},
      {[](nlohmann::json& j) { j["ranks"] = j["ranks"].get<int>() + 1; }, "rank(s) but its newest segments"},
  };
  for (const auto& [edit, needle] : forged) {
    const std::string why = resume_edited(edit);
    EXPECT_NE(why.find(needle), std::string::npos) << "expected \"" << needle << "\" in: " << why;
  }
  // A window's end read as such (Store::load's window_done: no state replayed): rank 0 still checks the newest
  // commit's span against the manifest.
  const std::string why = resume_edited([](nlohmann::json& j) { j["next_trigger"] = 9; }, true);
  EXPECT_NE(why.find("ends at trigger 4 where the manifest's commit ends at 9"), std::string::npos) << why;
  EXPECT_EQ(resume_edited([](nlohmann::json&) {}, true), "");
}

TEST(Store, RefusesAnotherJobAndChangedFields) {
  shuffle::Comm comm;
  const auto dir = shared_dir(comm, "identity");
  const auto job = small_job();
  const auto fields = checkpoint::identity_fields(job, "");
  start_unfinished_job(dir, job, fields, comm);
  checkpoint::Store store(dir, comm);
  EXPECT_THROW(store.open(job.name, fields, checkpoint::StartMode::Start),
               CheckpointError);  // unfinished: needs --resume
  try {
    store.open("other", checkpoint::identity_fields(parse_job(demo_job_toml(), "d", {"job.name=\"other\""}), ""),
               checkpoint::StartMode::Resume);
    ADD_FAILURE() << "another job's checkpoint was accepted";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("another job"), std::string::npos) << e.what();
  }
  try {
    auto changed = parse_job(demo_job_toml(), "d", {"input.users=123", "stream.triggers=7"});
    store.open(job.name, checkpoint::identity_fields(changed, ""), checkpoint::StartMode::Resume);
    ADD_FAILURE() << "a changed job spec was accepted";
  } catch (const CheckpointError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("input.users (20000 -> 123)"), std::string::npos) << what;
    EXPECT_NE(what.find("stream.triggers (10 -> 7)"), std::string::npos) << what;
    EXPECT_EQ(what.find("input.keys"), std::string::npos) << what;
  }
  EXPECT_EQ(store.open(job.name, fields, checkpoint::StartMode::Fresh).kind, checkpoint::Opened::Kind::New);
}

// Found by tests/fuzz/fuzz_manifest: a manifest with a valid checksum but a real number where an
// integer belongs was converted with undefined behaviour (and a negative one wrapped around).
// Such manifests, and segment files outside the checkpoint directory, are refused as damaged.
TEST(Store, ManifestValuesOfTheWrongTypeOrRangeAreRefused) {
  shuffle::Comm comm;
  const auto dir = shared_dir(comm, "manifest_values");
  const auto job = small_job();
  const auto fields = checkpoint::identity_fields(job, "");
  start_unfinished_job(dir, job, fields, comm);
  if (comm.rank() != 0) return;
  const auto original = nlohmann::json::parse(std::ifstream(dir / "MANIFEST-000000.json"));
  // Writes the manifest with `edit` applied and its checksum made to match; returns read_manifest's verdict.
  auto read_edited = [&](const std::function<void(nlohmann::json&)>& edit, std::string& why) {
    nlohmann::json j = original;
    edit(j);
    const auto path = dir / "MANIFEST-000001.json";
    write_forged_manifest(j, path);
    checkpoint::Manifest m;
    why.clear();
    return checkpoint::read_manifest(path, m, why);
  };
  std::string why;
  EXPECT_TRUE(read_edited([](nlohmann::json&) {}, why)) << why;
  const nlohmann::json segment = {{"seq", 1},   {"rank", 0},   {"ranks", 1}, {"file", "w0/s000001-r0000.h5"},
                                  {"bytes", 9}, {"xxh3", "00"}};
  EXPECT_TRUE(read_edited([&](nlohmann::json& j) { j["segments"].push_back(segment); }, why)) << why;
  const std::vector<std::pair<std::function<void(nlohmann::json&)>, std::string>> damaged = {
      {[](nlohmann::json& j) { j["ranks"] = 1e300; }, "\"ranks\" must be an integer"},
      {[](nlohmann::json& j) { j["seq"] = 1.5; }, "\"seq\" must be an integer"},
      {[](nlohmann::json& j) { j["window_index"] = -1; }, "\"window_index\" must be an integer in [0, 4294967295]"},
      {[](nlohmann::json& j) { j["next_trigger"] = std::uint64_t{1} << 40; }, "\"next_trigger\" must be an integer"},
      {[](nlohmann::json& j) { j["job_file"]["bytes"] = "12"; }, "\"bytes\" must be an integer"},
      {[&](nlohmann::json& j) {
         auto s = segment;
         s["rank"] = -1e20;
         j["segments"].push_back(s);
       },
       "\"rank\" must be an integer"},
      {[&](nlohmann::json& j) {
         auto s = segment;
         s["file"] = "../../elsewhere.h5";
         j["segments"].push_back(s);
       },
       "is not of the form w<window>/s<commit>-r<rank>.h5"},
      {[](nlohmann::json& j) {
         j["counters"] = {{"records", -3}};
       },
       "counter \"records\" must be a non-negative integer"},
      {[](nlohmann::json& j) {
         j["counters"] = {{"records", 2.5}};
       },
       "counter \"records\" must be a non-negative integer"},
      {[](nlohmann::json& j) { j["counters"] = nlohmann::json::array(); }, "\"counters\" must be an object"},
      {[](nlohmann::json& j) { j["privacy"] = 3; }, "\"privacy\" must be an object"},
      {[](nlohmann::json& j) { j["summary"] = "done"; }, "\"summary\" must be an object or null"},
  };
  for (const auto& [edit, needle] : damaged) {
    EXPECT_FALSE(read_edited(edit, why)) << needle;
    EXPECT_NE(why.find(needle), std::string::npos) << why;
    EXPECT_NE(why.find("MANIFEST-000001.json is damaged"), std::string::npos) << why;
  }
  // 200 000 levels of nesting: dump() and the conversions recurse once a level (a SIGSEGV before the checksum's test).
  const auto deep = dir / "MANIFEST-000001.json";
  std::ofstream(deep) << R"({"checksum": "00", "x": )" << std::string(200000, '[') << std::string(200000, ']') << "}";
  checkpoint::Manifest m;
  EXPECT_FALSE(checkpoint::read_manifest(deep, m, why));
  EXPECT_NE(why.find("MANIFEST-000001.json is damaged or unreadable (JSON nested deeper than 64 levels)"),
            std::string::npos)
      << why;
}

// A resume parses job.h5 only after the newest manifest vouches for its size and checksum, so that
// HDF5 never reads a damaged file (libhdf5 is not memory-safe on arbitrary bytes).
TEST(Store, ResumeChecksTheJobFileBeforeParsingIt) {
  shuffle::Comm comm;
  const auto dir = shared_dir(comm, "job_file");
  const auto job = small_job();
  const auto fields = checkpoint::identity_fields(job, "");
  start_unfinished_job(dir, job, fields, comm);
  comm.barrier();
  {
    checkpoint::Store store(dir, comm);
    EXPECT_EQ(store.open(job.name, fields, checkpoint::StartMode::Resume).kind, checkpoint::Opened::Kind::Resume);
  }
  comm.barrier();
  if (comm.rank() == 0) {
    std::fstream f(dir / "job.h5", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(0);
    f.put('\x7f');  // the HDF5 signature
  }
  comm.barrier();
  checkpoint::Store store(dir, comm);
  try {
    store.open(job.name, fields, checkpoint::StartMode::Resume);
    ADD_FAILURE() << "a damaged job.h5 was accepted";
  } catch (const CheckpointError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("job.h5 does not match its size and checksum in commit 0's manifest"), std::string::npos)
        << what;
    EXPECT_NE(what.find("start over with --fresh"), std::string::npos) << what;
  }
}
