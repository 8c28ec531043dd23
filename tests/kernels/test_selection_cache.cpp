#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <stdexcept>
#include <vector>

#include "kernels/selection_cache.hpp"

using namespace dpstream;

namespace {
struct Marker {  // stands for a selection noise state
  std::uint64_t value = 0;
};
using Cache = kernels::SelectionCache<Marker>;

constexpr std::uint32_t kNoVisit = 0xffffffffu;
struct Expected {
  std::uint32_t number;
  std::uint32_t next_visit = kNoVisit;
  std::int64_t quiet = -1;  // a fresh entry skips nothing
  std::uint64_t marker = 0;
};
}  // namespace

// due()'s word test against a byte-by-byte compare: every byte value at every place, against words of bytes
// that differ from it in one bit, of equal bytes (neighbours that a carry would disturb), and random ones.
TEST(SelectionCache, BytesEqualFindsExactlyTheEqualBytes) {
  std::mt19937_64 rng(17);
  const auto check = [](std::uint64_t word, std::uint8_t byte) {
    std::uint64_t want = 0;
    for (int i = 0; i < 8; ++i)
      if (static_cast<std::uint8_t>(word >> (8 * i)) == byte) want |= std::uint64_t{0x80} << (8 * i);
    ASSERT_EQ(Cache::bytes_equal(word, byte), want) << std::hex << "word " << word << " byte " << int{byte};
  };
  for (int b = 0; b < 256; ++b) {
    const auto byte = static_cast<std::uint8_t>(b);
    for (int place = 0; place < 8; ++place)
      for (int bit = 0; bit < 8; ++bit) {
        std::uint64_t word = 0;
        for (int i = 0; i < 8; ++i) word |= std::uint64_t{static_cast<std::uint8_t>(byte ^ (1u << bit))} << (8 * i);
        ASSERT_NO_FATAL_FAILURE(check(word, byte));
        word = (word & ~(std::uint64_t{0xff} << (8 * place))) | std::uint64_t{byte} << (8 * place);
        ASSERT_NO_FATAL_FAILURE(check(word, byte));
      }
    ASSERT_NO_FATAL_FAILURE(check(byte * 0x0101010101010101ULL, byte));
    for (int i = 0; i < 200; ++i) ASSERT_NO_FATAL_FAILURE(check(rng(), byte));
  }
}

// Against a std::map: entries numbered in the order keys are added, every field kept through the index's
// growth, visit() telling a visit due now from one later, and due() listing exactly the entries scheduled
// at a trigger, ascending, as triggers pass (each due visit consumed, as release() does).
TEST(SelectionCache, AgreesWithAMapThroughGrowth) {
  for (const std::uint64_t seed : {1u, 2u, 3u}) {
    std::mt19937_64 rng(seed);
    Cache cache;
    std::map<std::uint64_t, Expected> model;
    // Keys of one shard of the key space and random ones, so that probes run through slots of both.
    std::uniform_int_distribution<std::uint64_t> pick(0, 60000);
    std::uint32_t now = 1000;  // the trigger
    const auto expected_visit = [&](const Expected& e) {
      if (e.next_visit == kNoVisit) return Cache::Visit::None;
      return e.next_visit == now ? Cache::Visit::Due : Cache::Visit::Later;
    };
    const auto key_of = [&](std::uint64_t i) { return i % 2 == 0 ? i * 256 : i * 0x9E3779B97F4A7C15ULL; };
    for (int op = 0; op < 200000; ++op) {
      const std::uint64_t key = key_of(pick(rng));
      const auto [n, added] = cache.find_or_add(key);
      const auto it = model.find(key);
      ASSERT_EQ(added, it == model.end()) << "key " << key;
      if (added) {
        ASSERT_EQ(n, model.size()) << "entries are numbered in the order keys are added";
        EXPECT_EQ(cache.visit(n, now), Cache::Visit::None);
        EXPECT_EQ(cache.entry(n).noise.value, 0u);
        model[key] = Expected{n};
      } else {
        ASSERT_EQ(n, it->second.number);
      }
      Expected& e = model[key];
      ASSERT_EQ(cache.entry(n).key, key);
      // The quiet bound as stored: clamped to [-1, 2^24 - 1], never above what was set.
      ASSERT_EQ(cache.entry(n).quiet_users(), std::clamp<std::int64_t>(e.quiet, -1, (1 << 24) - 1));
      ASSERT_EQ(cache.entry(n).noise.value, e.marker);
      ASSERT_EQ(cache.visit(n, now), expected_visit(e));
      // 1 to 127 triggers ahead, most often a few.
      e.next_visit =
          rng() % 3 == 0 ? kNoVisit : now + 1 + static_cast<std::uint32_t>(rng() % (rng() % 8 == 0 ? 127 : 8));
      // Bounds on both sides of the stored range.
      e.quiet = rng() % 4 == 0 ? static_cast<std::int64_t>(rng() % (1u << 26)) - 3
                               : static_cast<std::int64_t>(rng() % 1000) - 1;
      e.marker = rng();
      if (e.next_visit == kNoVisit)
        cache.unschedule(n);
      else
        cache.schedule(n, e.next_visit, now);
      cache.entry(n).set_quiet_users(e.quiet);
      cache.entry(n).noise.value = e.marker;
      if (op % 200 == 0) {  // the next trigger: its due visits, each consumed
        ++now;
        std::vector<std::uint32_t> due, want;
        cache.due(now, due);
        for (auto& [k, x] : model)
          if (x.next_visit == now) {
            want.push_back(x.number);
            ASSERT_EQ(cache.visit(x.number, now), Cache::Visit::Due);
            cache.unschedule(x.number);
            x.next_visit = kNoVisit;
          } else {
            ASSERT_EQ(cache.visit(x.number, now), expected_visit(x));
          }
        std::sort(want.begin(), want.end());
        ASSERT_EQ(due, want) << "trigger " << now;
      }
    }
    ASSERT_EQ(cache.size(), model.size());
    for (const auto& [key, e] : model) {
      const std::uint32_t n = cache.find(key);
      ASSERT_EQ(n, e.number) << "key " << key;
      ASSERT_EQ(cache.entry(n).noise.value, e.marker);
    }
    EXPECT_THROW(cache.schedule(0, now + 128, now), std::logic_error);  // its residue would name two triggers
    EXPECT_THROW(cache.schedule(0, now, now), std::logic_error);
    for (std::uint64_t i = 60001; i < 70000; ++i) ASSERT_EQ(cache.find(key_of(i)), Cache::kNone);
    // The documented cost: the entry, its visit and its index slot at a load of at least 0.64, with at
    // most 15 entries of slack per cache and the visits' array grown by 1/8.
    const double per_entry = static_cast<double>(cache.memory_bytes()) / static_cast<double>(cache.size());
    EXPECT_LE(per_entry, sizeof(Cache::Entry) * 1.01 + 1.13 + 4 / 0.64 + 1) << per_entry;
    cache.clear();
    EXPECT_EQ(cache.size(), 0u);
    EXPECT_EQ(cache.find(key_of(0)), Cache::kNone);
  }
}

// A prefetch never reads past the slots or changes what a lookup finds.
TEST(SelectionCache, PrefetchesAreHintsOnly) {
  Cache cache;
  cache.prefetch_hashed(Cache::hash_of(7)), cache.prefetch_entry_of_hashed(Cache::hash_of(7));  // empty: no slots
  for (std::uint64_t k = 0; k < 1000; ++k) cache.find_or_add(k * 256);
  for (std::uint64_t k = 0; k < 2000; ++k) {
    cache.prefetch_hashed(Cache::hash_of(k * 256)), cache.prefetch_entry_of_hashed(Cache::hash_of(k * 256));
    ASSERT_EQ(cache.find(k * 256), k < 1000 ? static_cast<std::uint32_t>(k) : Cache::kNone);
  }
}
