// GoogleTest main for tests that may run under mpirun: every rank runs the tests, and all ranks
// exit non-zero if any rank failed (failures are tagged with the rank).
#include <gtest/gtest.h>
#include <mpi.h>

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <system_error>

#include "shuffle/comm.hpp"
#include "tests/mpi_scratch.hpp"

namespace {
class RankTagger : public testing::EmptyTestEventListener {
  void OnTestPartResult(const testing::TestPartResult& r) override {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (r.failed())
      std::fprintf(stderr, "[rank %d] failure in %s:%d\n", rank, r.file_name() ? r.file_name() : "?", r.line_number());
  }
};
}  // namespace

int main(int argc, char** argv) {
  dpstream::shuffle::MpiSession mpi(argc, argv);
  testing::InitGoogleTest(&argc, argv);
  testing::UnitTest::GetInstance()->listeners().Append(new RankTagger);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {  // one copy of the report is enough; failures still print with their rank
    delete testing::UnitTest::GetInstance()->listeners().Release(
        testing::UnitTest::GetInstance()->listeners().default_result_printer());
  }
  // One scratch directory per test program, named alike on every rank (rank 0's pid).
  std::uint64_t pid0 = static_cast<std::uint64_t>(getpid());
  MPI_Bcast(&pid0, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  int ranks = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  dpstream::testing::scratch_root() = std::filesystem::temp_directory_path() /
                                      ("dpstream_tests_np" + std::to_string(ranks) + "_" + std::to_string(pid0));
  int local = RUN_ALL_TESTS();
  int global = 0;
  MPI_Allreduce(&local, &global, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  // Scratch of a passing run goes, from each node's temporary directory; a failing run's stays for a look.
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  int node_rank = 0;
  MPI_Comm_rank(node, &node_rank);
  MPI_Comm_free(&node);
  if (global == 0 && node_rank == 0) {
    std::error_code ignored;
    std::filesystem::remove_all(dpstream::testing::scratch_root(), ignored);
  }
  return global;
}
