#pragma once

#include <cstdint>

namespace dpstream {
// Peak resident set size of this process, in bytes (getrusage).
std::uint64_t peak_rss_bytes();
}  // namespace dpstream
