// A scratch path in the temporary directory that every rank of a test names alike and no other test
// process does: the same test runs concurrently from other builds (the sanitizer builds of CI) or
// other checkouts, and a shared fixed path let two runs append to one releases.csv.
#pragma once

#include <filesystem>
#include <string>
#include <system_error>

namespace dpstream::testing {

// The test program's scratch directory, temp/dpstream_tests_np<ranks>_<pid of rank 0>: named by
// mpi_gtest_main on every rank before the tests run; removed there when every test passed on every
// rank, kept for a look when one failed.
inline std::filesystem::path& scratch_root() {
  static std::filesystem::path root;
  return root;
}

// scratch_root()/<name>: the directory is created, the path itself is not (nor removed).
inline std::filesystem::path mpi_scratch_path(const std::string& name) {
  std::error_code ignored;  // another rank may create it first; a failure shows at the path's first use
  std::filesystem::create_directories(scratch_root(), ignored);
  return scratch_root() / name;
}

}  // namespace dpstream::testing
