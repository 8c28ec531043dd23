// GoogleTest main for tests that may run under mpirun: every rank runs the tests, and all ranks
// exit non-zero if any rank failed (failures are tagged with the rank).
#include <gtest/gtest.h>
#include <mpi.h>

#include <filesystem>
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
  int local = RUN_ALL_TESTS();
  int global = 0;
  MPI_Allreduce(&local, &global, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  // Scratch of a passing run goes; a failing run's stays for a look (its path names the pid).
  if (global == 0 && rank == 0 && !dpstream::testing::scratch_root().empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(dpstream::testing::scratch_root(), ignored);
  }
  return global;
}
