// Transparent huge pages for large buffers that are written once, front to back.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>

namespace dpstream {

inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;  // x86-64's transparent huge page

// Bytes from `p` to the next huge page boundary (0 when `p` is on one).
inline std::size_t bytes_to_huge_page(const void* p) {
  return (kHugePageBytes - reinterpret_cast<std::uintptr_t>(p) % kHugePageBytes) % kHugePageBytes;
}

// Asks the kernel to back the 2 MiB-aligned part of [p, p + bytes) with huge pages when it is first
// written: one page fault per 2 MiB instead of one per 4 KiB (a fault cost a few microseconds on the
// virtual machines measured, where writing 100 MB of release rows into fresh memory spent half its time
// faulting). Advice only: nothing happens where transparent huge pages are off or the range holds no
// aligned 2 MiB, and the memory is freed as usual.
inline void advise_huge_pages(void* p, std::size_t bytes) {
  auto* const at = static_cast<char*>(p);
  const std::size_t head = bytes_to_huge_page(at);
  if (bytes <= head) return;
  const std::size_t body = (bytes - head) & ~(kHugePageBytes - 1);
  if (body > 0) ::madvise(at + head, body, MADV_HUGEPAGE);
}

}  // namespace dpstream
