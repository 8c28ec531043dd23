// Growth and memory of the kernels' open-addressing tables (the user table, kernels/bounding.hpp, and
// the key table, kernels/key_accumulate.hpp), whose slots are most of the state's memory.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <new>
#include <stdexcept>
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

}  // namespace dpstream::kernels
