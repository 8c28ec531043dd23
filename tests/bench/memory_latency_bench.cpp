// What one random memory access costs on this node, by how many of a page's lines are visited before
// the next page: a pointer chase (each load's address is the previous load's value, so nothing
// overlaps) over distinct cache lines of a region larger than the caches. "1 line per page" is a
// hash table probe at random (the user table at T = 1000); "64 lines per page" is the same DRAM
// misses with the address translation reused. Under a hypervisor whose guest memory is backed by
// 4 KiB pages, the difference is the nested page walk that every new page costs, with or without
// the guest's transparent huge pages (docs/PERFORMANCE.md round 19).
//
//   bench_memory_latency [REGION_MIB (default 256)] [HOPS (default 2000000)]
#include <sys/mman.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr std::size_t kPage = 4096, kLine = 64, kLinesPerPage = kPage / kLine;

// A mapping of `bytes`, with or without the kernel's transparent huge pages (advice only).
class Region {
 public:
  Region(std::size_t bytes, bool huge) : bytes_(bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error(fmt::format("cannot map {} MiB; ask for less", bytes >> 20));
    base_ = static_cast<char*>(p);
    ::madvise(base_, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    for (std::size_t at = 0; at < bytes; at += kPage) base_[at] = 1;  // touched: the chase times no fault
  }
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  ~Region() { ::munmap(base_, bytes_); }
  char* base() const { return base_; }

 private:
  char* base_ = nullptr;
  std::size_t bytes_;
};

// The process's transparent huge pages, from /proc (Linux), as the kernel reports them.
std::string anon_huge_pages() {
  std::ifstream f("/proc/self/smaps_rollup");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("AnonHugePages:", 0) == 0) return line.substr(line.find_first_not_of(' ', 14));
  return "unknown";
}

// Nanoseconds per load of a chase through `lines_per_page` random lines of each of the region's pages,
// the pages in random order.
double chase_ns(const Region& region, std::size_t bytes, std::size_t lines_per_page, std::size_t hops,
                std::mt19937_64& rng) {
  std::vector<std::size_t> pages(bytes / kPage);
  std::iota(pages.begin(), pages.end(), std::size_t{0});
  std::shuffle(pages.begin(), pages.end(), rng);
  std::vector<std::size_t> order;  // byte offsets, in visiting order
  std::vector<std::size_t> lines(kLinesPerPage);
  for (std::size_t page : pages) {
    std::iota(lines.begin(), lines.end(), std::size_t{0});
    std::shuffle(lines.begin(), lines.end(), rng);
    for (std::size_t i = 0; i < lines_per_page; ++i) order.push_back(page * kPage + lines[i] * kLine);
    if (order.size() >= hops) break;
  }
  char* base = region.base();
  for (std::size_t i = 0; i < order.size(); ++i)  // each line holds the address of the next
    *reinterpret_cast<char**>(base + order[i]) = base + order[(i + 1) % order.size()];
  char* p = base + order.front();
  const std::size_t n = std::min(hops, order.size());
  const auto t0 = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < n; ++i) p = *reinterpret_cast<char* volatile*>(p);
  const std::chrono::duration<double, std::nano> elapsed = std::chrono::steady_clock::now() - t0;
  if (p == nullptr) throw std::logic_error("the chase lost its way");  // uses p: the loads stay
  return elapsed.count() / static_cast<double>(n);
}

}  // namespace

int main(int argc, char** argv) try {
  const std::size_t mib = argc > 1 ? std::stoull(argv[1]) : 256;
  const std::size_t hops = argc > 2 ? std::stoull(argv[2]) : 2000000;
  if (mib < 1 || hops < 1) throw std::invalid_argument("REGION_MIB and HOPS must be at least 1");
  const std::size_t bytes = mib << 20;
  std::mt19937_64 rng(1);
  for (const bool huge : {true, false}) {
    const Region region(bytes, huge);
    fmt::print("region {} MiB, transparent huge pages {} (AnonHugePages {})\n", mib, huge ? "advised" : "refused",
               anon_huge_pages());
    for (const std::size_t lines_per_page : {std::size_t{1}, std::size_t{8}, kLinesPerPage})
      fmt::print("RESULT bench=memory_latency region_mib={} huge={} lines_per_page={} ns_per_load={:.1f}\n", mib,
                 huge ? "yes" : "no", lines_per_page, chase_ns(region, bytes, lines_per_page, hops, rng));
  }
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "bench_memory_latency: {}\n", e.what());
  return 2;
}
