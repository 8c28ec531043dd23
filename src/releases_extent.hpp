// How much of releases.csv a commit covers: what a checkpoint records and a resume checks the file against.
#pragma once

#include <cstdint>
#include <optional>

namespace dpstream {

struct ReleasesExtent {
  std::uint64_t bytes = 0;              // the header and every committed row
  std::uint64_t rows = 0;               // committed rows
  std::optional<std::uint64_t> xxh3{};  // XXH3-64 of those bytes; absent in checkpoints written before it was kept
};

}  // namespace dpstream
