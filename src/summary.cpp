#include "src/summary.hpp"

#include <sys/resource.h>

namespace dpstream {
std::uint64_t peak_rss_bytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<std::uint64_t>(ru.ru_maxrss) * 1024;  // Linux reports KiB
}
}  // namespace dpstream
