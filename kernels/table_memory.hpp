// Growth and memory of the kernels' open-addressing tables (the user table, kernels/bounding.hpp, and
// the key table, kernels/key_accumulate.hpp), whose slots are most of the state's memory.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/huge_pages.hpp"
#include "common/prefetch.hpp"

namespace dpstream::kernels {

inline constexpr std::size_t kMinTableCapacity = 16;

// A table's load limit, num / den of its slots.
struct MaxLoad {
  std::size_t num, den;
};
// At most 5/6 full. Linear probing reads (1 + 1/(1 - load)) / 2 slots to find an item: 3.5 at 5/6,
// within the two cache lines a probe prefetches (4/5 cost 1.5 B more per key and saved 0.5 slots).
inline constexpr MaxLoad kMaxLoad{5, 6};
// A table in its slab piece (a reservation) grows at 7/8: a reservation holds its share n plus
// kSpareSigmas = 2 standard deviations (sqrt(n), Poisson) at 5/6, so it leaves its piece, which stays
// mapped, only past n + 2 sqrt(n) + n/20: with probability about 6e-5 at 1,200 keys per shard, where 4
// standard deviations at 5/6 cost 5% more bytes. Probes of such a shard read more slots.
inline constexpr MaxLoad kMaxLoadInPiece{7, 8};
inline constexpr double kSpareSigmas = 2;

// Whether a table of `capacity` slots holding `items` grows before one more is added.
constexpr bool table_full(std::size_t items, std::size_t capacity, MaxLoad limit = kMaxLoad) {
  return (items + 1) * limit.den > capacity * limit.num;
}

// The home slot of a hash's bits 8-39 (the low 8 bits pick the shard) in a table of `capacity` slots:
// a multiplication, not a modulo (capacities are not powers of two).
constexpr std::size_t home_slot(std::uint64_t hash, std::size_t capacity) {
  return ((hash >> 8) & 0xffffffffu) * capacity >> 32;
}

// Linear probing's next slot after `i`, wrapping at the end.
constexpr std::size_t next_slot(std::size_t i, std::size_t capacity) { return i + 1 == capacity ? 0 : i + 1; }

// Prefetches what a lookup probing from slot `home` reads first: the home slot's cache line and the next
// one. At a load of 0.4-0.8, linear probing reads (1 + 1/(1 - load)) / 2 = 1.3-3 slots to find an item
// (more to add one), so the next line was a demand miss about half the time (bounding 0.66-0.70 ->
// 0.58-0.62 s at 2M users with both lines). No wrap: past the end, the probe's miss is left to it.
template <class Slots>
void prefetch_probe(const Slots& slots, std::size_t home) {
  const auto* at = reinterpret_cast<const char*>(slots.data() + home);
  dpstream::prefetch(at);
  if (home + kCacheLine / sizeof(slots[0]) < slots.size()) dpstream::prefetch(at + kCacheLine);
}

// Never 2x: by 1/4 (67-83% full) and, once large, by 1/8 (74-83% full: a billion-key job holds ~1e6
// keys per shard); rehashing stays amortised O(1) per item.
constexpr std::size_t grown_capacity(std::size_t capacity) {
  return std::max(kMinTableCapacity, capacity + capacity / (capacity < (std::size_t{1} << 16) ? 4 : 8));
}

// The capacity for `items` expected in a table (a shard's share of items hashed to shards): at most 5/6
// full with kSpareSigmas standard deviations of the share to spare; a table holds its share 79-83% full,
// where one that grew step by step is 67-83% full. jobs/memory_model.py repeats this rule.
inline std::size_t reserved_capacity(std::size_t items) {
  const auto spare = static_cast<std::size_t>(std::ceil(kSpareSigmas * std::sqrt(static_cast<double>(items))));
  std::size_t capacity = (items + spare) * 6 / 5;
  while (table_full(items + spare, capacity)) ++capacity;  // a step or two
  return std::max(kMinTableCapacity, capacity);
}

// Equal pieces of one mapping, for the tables a store sizes together (its 256 shards' tables, of
// 10-200 KiB each at a few million users or keys per rank). Taken one by one from the heap, they lie in
// 4 KiB pages, and a probe of a table larger than the TLB's reach pays a page walk on top of its miss;
// in one mapping aligned to 2 MiB they share transparent huge pages (bounding's stage -12% at 2M users,
// docs/PERFORMANCE.md round 10). A piece given up (its table grew past it) stays mapped until the slab
// goes: the store's clear() (giving its pages back would split the huge pages that its neighbours are on:
// accumulation +12% with 2M users).
class TableSlab {
 public:
  static constexpr std::size_t kHugePage = kHugePageBytes;
  TableSlab() = default;
  // Maps `pieces` pieces of `piece_bytes`, each starting on a cache line; throws std::bad_alloc when it cannot.
  TableSlab(std::size_t pieces, std::size_t piece_bytes)
      : piece_bytes_(piece_bytes), stride_((piece_bytes + 63) / 64 * 64) {
    claims_.reset(new std::atomic<bool>[pieces]());  // (make_shared of an array copies its elements)
    bytes_ = pieces * stride_;
    mapped_ = bytes_ + kHugePage;  // room to start on a huge page
    void* p = ::mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    map_ = static_cast<char*>(p);
    base_ = map_ + bytes_to_huge_page(map_);
    ::madvise(base_, bytes_, MADV_HUGEPAGE);  // advice only: no error if THP is off
  }
  TableSlab(const TableSlab&) = delete;
  TableSlab& operator=(const TableSlab&) = delete;
  TableSlab(TableSlab&& o) noexcept { swap(o); }
  TableSlab& operator=(TableSlab&& o) noexcept {
    TableSlab gone(std::move(*this));
    swap(o);
    return *this;
  }
  ~TableSlab() {
    if (map_ != nullptr) ::munmap(map_, mapped_);
  }
  std::size_t bytes() const { return bytes_; }  // what the pieces hold (the mapping's unused head is never touched)
  std::size_t piece_bytes() const { return piece_bytes_; }
  void* piece(std::size_t i) const { return base_ + i * stride_; }
  // Whether piece i holds an array: shared with the allocators that may hand it out, so that an array
  // which outlives the slab (a store's defaulted move) still finds it when it lets its piece go.
  std::shared_ptr<std::atomic<bool>> claim(std::size_t i) const { return {claims_, &claims_[i]}; }
  bool holds(const void* p) const {
    const auto* c = static_cast<const char*>(p);
    return c >= base_ && c < base_ + bytes_;
  }

 private:
  void swap(TableSlab& o) noexcept {
    std::swap(map_, o.map_);
    std::swap(base_, o.base_);
    std::swap(mapped_, o.mapped_);
    std::swap(bytes_, o.bytes_);
    std::swap(piece_bytes_, o.piece_bytes_);
    std::swap(stride_, o.stride_);
    std::swap(claims_, o.claims_);
  }
  char* map_ = nullptr;
  char* base_ = nullptr;
  std::size_t mapped_ = 0, bytes_ = 0, piece_bytes_ = 0, stride_ = 0;
  std::shared_ptr<std::atomic<bool>[]> claims_;
};

// A table's slot array: in a slab's piece when it was given one, asks for exactly the piece's size (a
// reservation) and no other array holds the piece; else from the heap, or mapped when it is 1 MiB or
// more: the process keeps freed heap memory (src/main.cpp's mallopt), and tables that grow in small steps
// would otherwise leave a trail of freed smaller arrays behind. A mapped array goes back to the system
// when its table grows, and asks for transparent huge pages (fewer TLB misses on random probes where THP
// is "madvise"). A piece is never freed, only given back to its slab (its claim). The allocator travels
// with its array on swap and move; a copy, or an array moved from and reused, finds the piece claimed.
template <class T>
struct TableAllocator {
  using value_type = T;
  using propagate_on_container_swap = std::true_type;
  using propagate_on_container_move_assignment = std::true_type;
  using propagate_on_container_copy_assignment = std::false_type;
  static constexpr std::size_t kMapBytes = std::size_t{1} << 20;
  void* piece = nullptr;
  std::size_t piece_bytes = 0;
  std::shared_ptr<std::atomic<bool>> claim;  // the piece is in use

  TableAllocator() = default;
  TableAllocator(void* p, std::size_t bytes, std::shared_ptr<std::atomic<bool>> c)
      : piece(p), piece_bytes(bytes), claim(std::move(c)) {}
  // Copied, never moved from: an allocator moved from must still equal its copy (a vector moved from
  // keeps it, and may allocate again).
  TableAllocator(const TableAllocator&) = default;
  TableAllocator& operator=(const TableAllocator&) = default;
  ~TableAllocator() = default;
  template <class U>
  explicit TableAllocator(const TableAllocator<U>& other)
      : piece(other.piece), piece_bytes(other.piece_bytes), claim(other.claim) {}
  TableAllocator select_on_container_copy_construction() const { return {}; }  // a copy wants no piece

  T* allocate(std::size_t n) {
    const std::size_t bytes = n * sizeof(T);
    if (piece != nullptr && bytes == piece_bytes && !claim->exchange(true)) return static_cast<T*>(piece);
    if (bytes < kMapBytes) return static_cast<T*>(::operator new (bytes, std::align_val_t{alignof(T)}));
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    ::madvise(p, bytes, MADV_HUGEPAGE);  // advice only: no error if THP is off
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t n) noexcept {
    const std::size_t bytes = n * sizeof(T);
    if (p == piece) {
      claim->store(false);
      return;
    }
    if (bytes < kMapBytes)
      ::operator delete (p, std::align_val_t{alignof(T)});
    else
      ::munmap(p, bytes);
  }
  friend bool operator==(const TableAllocator& a, const TableAllocator& b) { return a.piece == b.piece; }
};

template <class T>
using TableSlots = std::vector<T, TableAllocator<T>>;

// Maps `slab` for `shards` tables of `capacity` slots of T, sized together: true if it did, false when
// the store holds a slab already (its pieces may be in use until its clear()), when the tables would not
// fill a huge page, or when the mapping fails (the tables then come from TableAllocator's other paths).
template <class T>
bool map_slab(TableSlab& slab, std::size_t shards, std::size_t capacity) {
  if (slab.bytes() != 0 || shards * capacity * sizeof(T) < TableSlab::kHugePage) return false;
  try {
    slab = TableSlab(shards, capacity * sizeof(T));
  } catch (const std::bad_alloc&) {
    return false;
  }
  return true;
}

// The allocator of shard `i`'s table in `slab`, or the default one when `use` is false.
template <class T>
TableAllocator<T> slab_piece(const TableSlab& slab, std::size_t i, bool use) {
  return use ? TableAllocator<T>(slab.piece(i), slab.piece_bytes(), slab.claim(i)) : TableAllocator<T>();
}

// Sizes a store's `shards` tables for `capacity` slots of T each: rehash(s, alloc) for every table s
// that holds fewer (size_of(s) < capacity), in parallel, in the pieces of a slab mapped for them
// (map_slab; none when no table would move, e.g. a resumed state already above the reservation). A
// reservation is a hint: one that fails (no memory) leaves its shard to grow as before.
template <class T, class SizeOf, class Rehash>
void reserve_shards(TableSlab& slab, std::size_t shards, std::size_t capacity, SizeOf&& size_of, Rehash&& rehash) {
  bool below = false;
  for (std::size_t s = 0; s < shards && !below; ++s) below = size_of(s) < capacity;
  const bool use = below && map_slab<T>(slab, shards, capacity);
#pragma omp parallel for schedule(dynamic, 8)
  for (std::size_t s = 0; s < shards; ++s) {
    try {
      if (size_of(s) < capacity) rehash(s, slab_piece<T>(slab, s, use));
    } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): a hint, see above
    }
  }
}

// Bytes of an absl flat hash map or set: one control byte plus the slot per capacity entry.
template <class Table>
std::uint64_t hash_table_bytes(const Table& t) {
  return t.capacity() * (1 + sizeof(typename Table::value_type));
}

// A journal's index over a table's slots: a bit per group of Group slots (a cache line) that may hold
// a slot its owner marked, so that a drain reads only those groups instead of the whole table (a commit
// every few triggers of the billion-key job changes a few percent of the slots). The owner's own mark
// in the slot decides; a group's bit only says where to look. A rehash moves slots anywhere: every
// group then counts as marked until the next drain.
template <std::size_t Group>
class GroupMarks {
 public:
  void note(std::size_t slot) {
    const std::size_t g = slot / Group;
    bits_[g / 64] |= std::uint64_t{1} << (g % 64);
  }
  void clear() { std::fill(bits_.begin(), bits_.end(), 0); }
  // The table now has `capacity` slots at new places (a rehash).
  void rehash(std::size_t capacity) {
    const bool had = std::any_of(bits_.begin(), bits_.end(), [](std::uint64_t w) { return w != 0; });
    bits_.assign((capacity / Group + 64) / 64, had ? ~std::uint64_t{0} : 0);
  }
  // visit(i) for every slot i < capacity of a marked group, ascending; clears the bits. The next word's
  // groups are prefetched (prefetch(i), their first slots) while this word's are visited: the marked
  // lines are scattered, and perf put 77% of a drain on their first load without it.
  template <class Prefetch, class Visit>
  void drain(std::size_t capacity, Prefetch&& prefetch, Visit&& visit) {
    const auto ahead = [&](std::size_t w) {
      for (std::uint64_t bits = bits_[w]; bits != 0; bits &= bits - 1)
        if (const std::size_t i = first_slot(w, bits); i < capacity) prefetch(i);
    };
    if (!bits_.empty()) ahead(0);
    for (std::size_t w = 0; w < bits_.size(); ++w) {
      if (w + 1 < bits_.size()) ahead(w + 1);
      for (std::uint64_t bits = std::exchange(bits_[w], 0); bits != 0; bits &= bits - 1)
        for (std::size_t i = first_slot(w, bits); i < std::min(first_slot(w, bits) + Group, capacity); ++i) visit(i);
    }
  }

 private:
  static std::size_t first_slot(std::size_t word, std::uint64_t bits) {
    return (word * 64 + static_cast<std::size_t>(std::countr_zero(bits))) * Group;
  }
  std::vector<std::uint64_t> bits_;
};

}  // namespace dpstream::kernels
