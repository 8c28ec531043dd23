// Key selection's cache of tested keys (kernels/dp_release.cpp), one per key shard: per key its
// selection noise (a pure function of its node: a cache, never needed for privacy), its quiet bound and
// its scheduled visit.
//
// Layout, for memory: entries are dense, numbered in the order keys are added, in chunks of 16 (a
// shard's slack is at most 15 entries); an open-addressing index of 4-byte slots finds them (8 bits of
// the key's hash as a tag, so that a probe reads another entry only on a tag match, and the entry's
// number); the scheduled visits are a dense array of one byte per entry, scanned at each trigger for the
// visits due. 32 + 1 + 4 / load bytes per tested key with the banded counter's frontier, where an absl
// index of 16-byte values (48 B at its load), 32-byte noise entries and a calendar of key lists (18 B)
// cost ~98.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <utility>
#include <vector>

#include "common/prefetch.hpp"
#include "kernels/table_memory.hpp"
#include "partition/hash.hpp"

namespace dpstream::kernels {

template <class State>
class SelectionCache {
 public:
  static constexpr std::uint32_t kNone = 0xffffffffu;  // find(): no entry
  // A visit is scheduled 1 to kMaxAhead triggers ahead, and release() runs at every trigger, where the
  // due scan visits it (which unschedules or reschedules it): so trigger mod 128 names it (one byte).
  // (One left behind would be wrong with any encoding: its key would go untested until it came due.)
  static constexpr std::uint32_t kMaxAhead = 127;
  enum class Visit { None, Due, Later };  // an entry's scheduled visit, seen from a trigger
  // Entry numbers fit the index's 24 bits: 2^24 tested keys per shard, 4.3e9 per rank (about 200 GB of
  // entries: memory runs out first).
  static constexpr std::uint32_t kMaxEntries = (1u << 24) - 1;

  // A tested key. It belongs to the key's current round: a release resets it, a window's start clears all.
  // 32 bytes with the banded counter's 20-byte frontier.
  struct Entry {
    static constexpr std::int64_t kMaxQuietUsers = (1 << 24) - 1;

    std::uint64_t key = 0;
    State noise{};

    // Every simulated step before the scheduled visit fails with quiet_users() round users or fewer.
    std::int64_t quiet_users() const { return static_cast<std::int64_t>(quiet_plus_one_) - 1; }
    // Stored clamped to [-1, kMaxQuietUsers], never above `bound`: a lower bound only skips fewer keys,
    // each then visited, and round users are >= 0, so -1 skips none.
    void set_quiet_users(std::int64_t bound) {
      quiet_plus_one_ = static_cast<std::uint32_t>(std::clamp<std::int64_t>(bound, -1, kMaxQuietUsers) + 1);
    }

   private:
    std::uint32_t quiet_plus_one_ = 0;
  };

  std::uint32_t size() const { return size_; }

  // The key table's hash (partition::key_hash: its shard and owner rank in the other bits): bits 8-39 pick
  // the home slot, bits 40-47 the tag. The *_hashed members take it computed once for the several calls of one key.
  static std::uint64_t hash_of(std::uint64_t key) { return partition::key_hash(key); }

  std::uint32_t find(std::uint64_t key) const { return find_hashed(key, hash_of(key)); }
  std::uint32_t find_hashed(std::uint64_t key, std::uint64_t hash) const {
    if (slots_.empty()) return kNone;
    const std::uint32_t tag = tag_of(hash);
    for (std::size_t i = home(hash);; i = next_slot(i, slots_.size())) {
      const std::uint32_t s = slots_[i];
      if (s == kFree) return kNone;
      if ((s & kTagMask) == tag && entry(number(s)).key == key) return number(s);
    }
  }
  // The key's entry number and whether it was added now (a fresh entry: noise reset, no visit scheduled).
  std::pair<std::uint32_t, bool> find_or_add(std::uint64_t key) {
    if (const std::uint32_t found = find(key); found != kNone) return {found, false};
    if (size_ >= kMaxEntries)
      throw std::length_error("key selection: more than 2^24 tested keys in one shard of a rank; run on more ranks");
    // Every allocation first: one that fails leaves the cache as it was.
    if (table_full(size_, slots_.size())) rehash(grown_capacity(slots_.size()));
    if (next_visit_.size() == next_visit_.capacity()) next_visit_.reserve(next_visit_.size() * 9 / 8 + 64);
    if (chunks_.size() * kChunk == size_) chunks_.push_back(std::make_unique<Entry[]>(kChunk));
    const std::uint32_t n = size_++;
    next_visit_.push_back(kUnscheduled);
    entry(n).key = key;
    place(n, hash_of(key));
    return {n, true};
  }

  Entry& entry(std::uint32_t n) { return chunks_[n / kChunk][n % kChunk]; }
  const Entry& entry(std::uint32_t n) const { return chunks_[n / kChunk][n % kChunk]; }
  Visit visit(std::uint32_t n, std::uint32_t trigger) const {
    if (next_visit_[n] == kUnscheduled) return Visit::None;
    return next_visit_[n] == residue(trigger) ? Visit::Due : Visit::Later;
  }
  // Entry n's visit at trigger `at`, 1 to kMaxAhead triggers after `now`.
  void schedule(std::uint32_t n, std::uint32_t at, std::uint32_t now) {
    if (at <= now || at - now > kMaxAhead) throw std::logic_error("SelectionCache: a visit beyond 127 triggers ahead");
    next_visit_[n] = residue(at);
  }
  void unschedule(std::uint32_t n) { next_visit_[n] = kUnscheduled; }

  // The entries whose visit is scheduled at `trigger`, ascending, into `out`: a scan of each entry's byte,
  // where visits come at least every kMaxAhead = 127 triggers (kernels/dp_release.cpp) and each draws
  // its steps' noise (~20 ns a step): the scan stays a few percent of the visits' work. The bytes are tested
  // eight at a time: most words hold no due entry (a shard has a few a trigger at T = 1000), and a byte's
  // compare and branch cost about as much as a word's test (perf: the byte loop was a sixth of
  // release_with's own time at T = 1000).
  void due(std::uint32_t trigger, std::vector<std::uint32_t>& out) const {
    out.clear();
    const std::uint8_t* visits = next_visit_.data();  // locals: out's stores cannot alias them
    const std::uint8_t want = residue(trigger);
    const std::uint32_t size = size_;
    std::uint32_t n = 0;
    for (; n + 8 <= size; n += 8) {
      std::uint64_t word;
      std::memcpy(&word, visits + n, sizeof word);
      for (std::uint64_t equal = bytes_equal(word, want); equal != 0; equal &= equal - 1)
        out.push_back(n + static_cast<std::uint32_t>(std::countr_zero(equal)) / 8);  // ascending
    }
    for (; n < size; ++n)
      if (visits[n] == want) out.push_back(n);
  }
  // Bit 8i + 7 set where byte i of `word` (little-endian) equals `byte`, no other bit. Per byte of x (zero where
  // equal): (x & 0x7f) + 0x7f carries into no other byte (at most 0xfe) and has its high bit set unless x's low
  // seven bits are zero; or-ed with x, unless x is zero. Exact, where the borrow trick (x - 0x01..) & ~x & 0x80..
  // also flags bytes above a zero one.
  static std::uint64_t bytes_equal(std::uint64_t word, std::uint8_t byte) {
    static_assert(std::endian::native == std::endian::little, "due() reads the entries' bytes as words");
    constexpr std::uint64_t kLow7 = 0x7F7F7F7F7F7F7F7FULL;
    const std::uint64_t x = word ^ (byte * 0x0101010101010101ULL);  // zero bytes where equal
    return ~(((x & kLow7) + kLow7) | x | kLow7);
  }

  void prefetch_hashed(std::uint64_t hash) const {
    if (!slots_.empty()) prefetch_probe(slots_, home(hash));
  }
  // The entry find(key) most likely reads, with its scheduled visit: that of the probe's first slot whose tag
  // matches (a tag of 8 bits: another key's about once in 256 slots passed). It stops there: a walk on to the
  // next free slot read up to a dozen more slots at the table's highest load, for the rare other match.
  // The slots themselves should be in cache (prefetch_hashed earlier).
  void prefetch_entry_of_hashed(std::uint64_t hash) const {
    if (slots_.empty()) return;
    for (std::size_t i = home(hash); slots_[i] != kFree; i = next_slot(i, slots_.size()))
      if ((slots_[i] & kTagMask) == tag_of(hash)) {
        prefetch_entry(number(slots_[i]));
        return;
      }
  }
  void prefetch_entry(std::uint32_t n) const {
    dpstream::prefetch_object(&entry(n));
    dpstream::prefetch(&next_visit_[n]);
  }

  void clear() { *this = SelectionCache{}; }
  std::uint64_t memory_bytes() const {
    return slots_.capacity() * sizeof(std::uint32_t) + chunks_.capacity() * sizeof(chunks_[0]) +
           chunks_.size() * kChunk * sizeof(Entry) + next_visit_.capacity();
  }

 private:
  static constexpr std::uint32_t kChunk = 16;
  static constexpr std::uint8_t kUnscheduled = 0;  // else 0x80 | trigger mod 128
  static std::uint8_t residue(std::uint32_t trigger) { return static_cast<std::uint8_t>(0x80 | (trigger & 0x7f)); }
  static constexpr std::uint32_t kFree = 0;  // a slot holds tag | (number + 1)
  static constexpr std::uint32_t kTagMask = 0xffu << 24;
  static std::uint32_t tag_of(std::uint64_t hash) { return static_cast<std::uint32_t>(hash >> 40 & 0xff) << 24; }
  static std::uint32_t number(std::uint32_t slot) { return (slot & ~kTagMask) - 1; }
  std::size_t home(std::uint64_t hash) const { return home_slot(hash, slots_.size()); }

  void place(std::uint32_t n, std::uint64_t hash) {
    std::size_t i = home(hash);
    while (slots_[i] != kFree) i = next_slot(i, slots_.size());
    slots_[i] = tag_of(hash) | (n + 1);
  }
  // Every entry placed again from its key's hash (not stored: a rehash is rare, growth by 1/4 or 1/8).
  void rehash(std::size_t capacity) {
    std::vector<std::uint32_t>(capacity, kFree).swap(slots_);  // the entries hold every key: none is lost
    for (std::uint32_t n = 0; n < size_; ++n) place(n, hash_of(entry(n).key));
  }

  std::vector<std::uint32_t> slots_;
  std::vector<std::unique_ptr<Entry[]>> chunks_;
  std::vector<std::uint8_t> next_visit_;  // per entry: its scheduled visit's trigger mod 128 | 0x80, or kUnscheduled
  std::uint32_t size_ = 0;
};

}  // namespace dpstream::kernels
