// A scratch path in the temporary directory that every rank of a test names alike and no other test
// process does: the same test runs concurrently from other builds (the sanitizer builds of CI) or
// other checkouts, and a shared fixed path let two runs append to one releases.csv.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>

#include "shuffle/comm.hpp"

namespace dpstream::testing {

// temp/dpstream_<name>_np<ranks>_<pid of rank 0>; nothing is created or removed.
inline std::filesystem::path mpi_scratch_path(const shuffle::Comm& comm, const std::string& name) {
  const auto pid0 = comm.allgather(static_cast<std::uint64_t>(getpid())).at(0);
  return std::filesystem::temp_directory_path() /
         ("dpstream_" + name + "_np" + std::to_string(comm.size()) + "_" + std::to_string(pid0));
}

}  // namespace dpstream::testing
