// A scratch path in the temporary directory that every rank of a test names alike and no other test
// process does: the same test runs concurrently from other builds (the sanitizer builds of CI) or
// other checkouts, and a shared fixed path let two runs append to one releases.csv.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>

#include "shuffle/comm.hpp"

namespace dpstream::testing {

// The test program's scratch directory, temp/dpstream_tests_np<ranks>_<pid of rank 0> (empty until
// mpi_scratch_path names it). mpi_gtest_main removes it when every test passed on every rank, and
// keeps it for a look when one failed.
inline std::filesystem::path& scratch_root() {
  static std::filesystem::path root;
  return root;
}

// scratch_root()/<name>: the directory is created, the path itself is not (nor removed).
// Collective: every rank calls it alike.
inline std::filesystem::path mpi_scratch_path(const shuffle::Comm& comm, const std::string& name) {
  if (scratch_root().empty()) {
    const auto pid0 = comm.allgather(static_cast<std::uint64_t>(getpid())).at(0);
    scratch_root() = std::filesystem::temp_directory_path() /
                     ("dpstream_tests_np" + std::to_string(comm.size()) + "_" + std::to_string(pid0));
  }
  std::error_code ignored;  // another rank may create it first; a failure shows at the path's first use
  std::filesystem::create_directories(scratch_root(), ignored);
  return scratch_root() / name;
}

}  // namespace dpstream::testing
