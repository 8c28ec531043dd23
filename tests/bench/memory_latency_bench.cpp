// What one random memory access costs on this node, by how many of a page's lines are visited before
// the next page: a pointer chase (each load's address is the previous load's value, so nothing
// overlaps) through the same number of distinct cache lines in every case, flushed from the caches
// before the chase, spread over 1, 8 or 64 lines of each page. "1 line per page" is a hash table
// probe at random (the user table at T = 1000); "64 lines per page" the same number of cache misses
// with each page's address translation reused (and the hardware's neighbour-line prefetch helping).
// What makes a new page dearer (its translation, a DRAM row to open, no neighbour-line prefetch)
// is not told apart: without hardware counters the chase only shows the sum. docs/PERFORMANCE.md round 19.
//
//   bench_memory_latency [REGION_MIB (default 256)]
#include <emmintrin.h>  // _mm_clflush (SSE2)
#include <sys/mman.h>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
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

// A cycle through `lines` distinct lines: `lines_per_page` random lines of each of lines / lines_per_page
// random pages of the region, the pages in random order; each line holds the address of the next.
std::vector<std::size_t> build_chain(const Region& region, std::size_t bytes, std::size_t lines,
                                     std::size_t lines_per_page, std::mt19937_64& rng) {
  std::vector<std::size_t> pages(bytes / kPage);
  std::iota(pages.begin(), pages.end(), std::size_t{0});
  std::shuffle(pages.begin(), pages.end(), rng);
  pages.resize(lines / lines_per_page);
  std::vector<std::size_t> order;  // byte offsets, in visiting order
  std::vector<std::size_t> in_page(kLinesPerPage);
  for (std::size_t page : pages) {
    std::iota(in_page.begin(), in_page.end(), std::size_t{0});
    std::shuffle(in_page.begin(), in_page.end(), rng);
    for (std::size_t i = 0; i < lines_per_page; ++i) order.push_back(page * kPage + in_page[i] * kLine);
  }
  char* base = region.base();
  for (std::size_t i = 0; i < order.size(); ++i)
    *reinterpret_cast<char**>(base + order[i]) = base + order[(i + 1) % order.size()];
  return order;
}

// Nanoseconds per load of one pass through the chain, its lines flushed from the caches first.
double chase_ns(const Region& region, const std::vector<std::size_t>& order) {
  char* base = region.base();
  for (std::size_t at : order) _mm_clflush(base + at);
  _mm_mfence();
  char* p = base + order.front();
  const auto t0 = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < order.size(); ++i) p = *reinterpret_cast<char* volatile*>(p);
  const std::chrono::duration<double, std::nano> elapsed = std::chrono::steady_clock::now() - t0;
  if (p != base + order.front()) throw std::logic_error("the chase lost its way");  // a whole cycle
  return elapsed.count() / static_cast<double>(order.size());
}

}  // namespace

int main(int argc, char** argv) try {
  std::size_t mib = 256;
  CLI::App app{"One dependent load's cost by the lines of a page visited before the next page"};
  app.add_option("region_mib", mib, "Region to chase through, MiB (larger than the caches)")
      ->check(CLI::Range(1, 1 << 20));
  CLI11_PARSE(app, argc, argv);
  const std::size_t bytes = mib << 20;
  const std::size_t lines = bytes / kPage;  // one per page in the 1-line case: every case chases as many
  std::mt19937_64 rng(1);
  for (const bool huge : {true, false}) {
    const Region region(bytes, huge);
    fmt::print("region {} MiB, transparent huge pages {} (AnonHugePages {}), {} loads per case\n", mib,
               huge ? "advised" : "refused", anon_huge_pages(), lines);
    for (const std::size_t lines_per_page : {std::size_t{1}, std::size_t{8}, kLinesPerPage}) {
      const auto chain = build_chain(region, bytes, lines, lines_per_page, rng);
      fmt::print("RESULT bench=memory_latency region_mib={} huge={} lines_per_page={} ns_per_load={:.1f}\n", mib,
                 huge ? "yes" : "no", lines_per_page, chase_ns(region, chain));
    }
  }
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "bench_memory_latency: {}\n", e.what());
  return 2;
}
