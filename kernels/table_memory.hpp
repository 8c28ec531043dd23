// Growth and memory of the kernels' open-addressing tables (the user table, kernels/bounding.hpp, and
// the key table, kernels/key_accumulate.hpp), whose slots are most of the state's memory.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <new>
#include <stdexcept>
#include <utility>
#include <vector>

namespace dpstream::kernels {

inline constexpr std::size_t kMinTableCapacity = 16;

// At most 4/5 full: whether a table of `capacity` slots holding `items` grows before one more is added.
constexpr bool table_full(std::size_t items, std::size_t capacity) { return (items + 1) * 5 > capacity * 4; }

// Linear probing's next slot after `i`, wrapping at the end.
constexpr std::size_t next_slot(std::size_t i, std::size_t capacity) { return i + 1 == capacity ? 0 : i + 1; }

// Never 2x: by 1/4 (64-80% full) and, once large, by 1/8 (71-80% full: a billion-key job holds ~1e6
// keys per shard); rehashing stays amortised O(1) per item.
constexpr std::size_t grown_capacity(std::size_t capacity) {
  return std::max(kMinTableCapacity, capacity + capacity / (capacity < (std::size_t{1} << 16) ? 4 : 8));
}

// The capacity for `items` expected in a table (a shard's share of items hashed to shards): at most 4/5
// full with four standard deviations of the share's spread to spare (sqrt(items), Poisson), so that a
// shard grows with probability about 3e-5 and a table holds its share 75-80% full, where one that grew
// step by step is 64-80% full (a user slot cost 49 B at 2M users instead of ~41). jobs/memory_model.py
// repeats this rule.
inline std::size_t reserved_capacity(std::size_t items) {
  const auto spare = static_cast<std::size_t>(std::ceil(4 * std::sqrt(static_cast<double>(items))));
  std::size_t capacity = (items + spare) * 5 / 4;
  while (table_full(items + spare, capacity)) ++capacity;  // a step or two
  return std::max(kMinTableCapacity, capacity);
}

// Calls reserve(s) for every shard s in parallel. A reservation is a hint: one that fails (no memory)
// leaves its shard to grow as before.
template <class Reserve>
void reserve_shards(std::size_t shards, Reserve&& reserve) {
#pragma omp parallel for schedule(dynamic, 8)
  for (std::size_t s = 0; s < shards; ++s) {
    try {
      reserve(s);
    } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): a hint, see above
    }
  }
}

// Slot arrays of 1 MiB or more are mapped, not taken from the heap: the process keeps freed heap
// memory (src/main.cpp's mallopt), and tables that grow in small steps would otherwise leave a trail
// of freed smaller arrays behind. A mapped array goes back to the system when its table grows, and
// asks for transparent huge pages (fewer TLB misses on random probes where THP is "madvise").
template <class T>
struct TableAllocator {
  using value_type = T;
  static constexpr std::size_t kMapBytes = std::size_t{1} << 20;
  TableAllocator() = default;
  template <class U>
  explicit TableAllocator(const TableAllocator<U>& /*other*/) {}

  T* allocate(std::size_t n) {
    const std::size_t bytes = n * sizeof(T);
    if (bytes < kMapBytes) return static_cast<T*>(::operator new (bytes, std::align_val_t{alignof(T)}));
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    ::madvise(p, bytes, MADV_HUGEPAGE);  // advice only: no error if THP is off
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t n) noexcept {
    const std::size_t bytes = n * sizeof(T);
    if (bytes < kMapBytes)
      ::operator delete (p, std::align_val_t{alignof(T)});
    else
      ::munmap(p, bytes);
  }
  friend bool operator==(const TableAllocator& /*a*/, const TableAllocator& /*b*/) { return true; }
};

template <class T>
using TableSlots = std::vector<T, TableAllocator<T>>;

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
