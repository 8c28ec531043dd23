// The stop-signal handler's states, each in a child process of its own (the handlers are process-wide).
// The whole clean stop under mpirun is tests/e2e/test_signal_stop.py.
#include "src/stop_request.hpp"

#include <gtest/gtest.h>
#include <signal.h>

#include <unistd.h>

#include <cstdlib>

namespace {

using dpstream::stop_request::ending;
using dpstream::stop_request::install;
using dpstream::stop_request::signal_received;

TEST(StopRequestDeathTest, ASignalIsRecordedAndAnnounced) {
  EXPECT_EXIT(
      {
        install();
        ::raise(SIGTERM);
        ::_exit(signal_received() == SIGTERM ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "SIGTERM received: stopping after the current trigger");
}

// A one-shot release (a query, choose-c) finishes what it may have charged a ledger for instead of dying.
TEST(StopRequestDeathTest, AOneShotReleaseIsNotStoppedBySignal) {
  EXPECT_EXIT(
      {
        install(dpstream::stop_request::Stops::AfterRelease);
        ::raise(SIGUSR1);
        ::_exit(signal_received() == SIGUSR1 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "SIGUSR1 received: finishing the release first");
}

// After an error: mpirun signals the ranks still running once one has exited non-zero, and a rank that is itself
// exiting with the agreed error must not announce a stop.
TEST(StopRequestDeathTest, ASignalWhileEndingAfterAnErrorIsSilent) {
  EXPECT_EXIT(
      {
        install();
        ending();
        ::raise(SIGTERM);
        ::raise(SIGTERM);  // within the repeat window: the same request, not a second one
        ::_exit(3);        // the process goes on to its own exit code
      },
      ::testing::ExitedWithCode(3), "^$");
}

// ... while a second signal later than the repeat window still ends a rank stuck on its way out.
TEST(StopRequestDeathTest, ALaterSecondSignalStillAbortsWhileEnding) {
  EXPECT_EXIT(
      {
        ::setenv("DPSTREAM_STOP_REPEAT_SECONDS", "0", 1);  // NOLINT(concurrency-mt-unsafe): the child alone
        install();
        ending();
        ::raise(SIGTERM);
        ::raise(SIGTERM);
        ::_exit(3);
      },
      ::testing::KilledBySignal(SIGTERM), "aborting now");
}

}  // namespace
