// OutputLock: one holder of an output directory at a time (the whole-CLI test with two jobs is
// tests/e2e/test_output_lock.py).
#include "src/output_lock.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "src/errors.hpp"

namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("dpstream-output-lock-" + std::to_string(::getpid()));
  TempDir() { fs::remove_all(path); }
  ~TempDir() { fs::remove_all(path); }
};

std::string refusal(const fs::path& dir) {
  try {
    dpstream::OutputLock lock(dir, true);
  } catch (const dpstream::ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(OutputLock, ASecondHolderIsRefusedUntilTheFirstIsGone) {
  TempDir tmp;
  const fs::path dir = tmp.path / "out";
  {
    const dpstream::OutputLock first(dir, true);  // creates the missing directory
    EXPECT_TRUE(fs::is_directory(dir));
    if (!first.note().empty()) GTEST_SKIP() << first.note();  // the temporary directory is on a shared file system
    const std::string why = refusal(dir);                     // another open of the directory: flock(2) locks it apart
    EXPECT_NE(why.find("is in use by another dpstream job"), std::string::npos) << why;
    EXPECT_NE(why.find(dir.string()), std::string::npos) << why;
    EXPECT_TRUE(fs::is_empty(dir)) << "the lock makes no file in the directory";
  }
  EXPECT_EQ(refusal(dir), "") << "the same process, a later holder: the kept lock is taken over";
}

// flock(2) on a new open description of `dir`, as another job's would be; true if it got the lock (then dropped).
bool lockable_by_another(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool got = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
  ::close(fd);
  return got;
}

// Rank 0's holder ends with its engine while other ranks may still write on an error path: the process keeps the lock
// until it exits, or until it locks again (a later job, after every rank left this one). Locking the same directory
// again takes the kept lock over; another directory drops it; a new directory of a removed one's name is locked.
TEST(OutputLock, TheProcessKeepsTheLockUntilItLocksAgain) {
  TempDir tmp;
  const fs::path a = tmp.path / "a", b = tmp.path / "b";
  {
    const dpstream::OutputLock first(a, true);
    if (!first.note().empty()) GTEST_SKIP() << first.note();
  }
  EXPECT_FALSE(lockable_by_another(a)) << "the lock was dropped with its holder";
  {
    const dpstream::OutputLock again(a, true);  // the same process, a later job: taken over, not refused
    EXPECT_FALSE(lockable_by_another(a));
  }
  { const dpstream::OutputLock other(b, true); }
  EXPECT_TRUE(lockable_by_another(a)) << "locking another directory keeps the first one's lock";
  EXPECT_FALSE(lockable_by_another(b));
  fs::remove_all(b);
  fs::create_directories(b);  // a new directory of the same name
  {
    const dpstream::OutputLock fresh(b, true);
    EXPECT_FALSE(lockable_by_another(b)) << "the new directory is not locked";
  }
  { const dpstream::OutputLock last(a, true); }  // drops b's
  EXPECT_TRUE(lockable_by_another(b));
}

TEST(OutputLock, AResumeMakesNoDirectory) {
  TempDir tmp;
  const dpstream::OutputLock none(tmp.path / "missing", false);
  EXPECT_FALSE(fs::exists(tmp.path / "missing"));
}

TEST(OutputLock, AFileWhereTheDirectoryShouldBeIsRefused) {
  TempDir tmp;
  fs::create_directories(tmp.path);
  std::ofstream(tmp.path / "file") << "x";
  const std::string why = refusal(tmp.path / "file");
  EXPECT_NE(why.find("output dir"), std::string::npos) << why;
  EXPECT_NE(why.find("--out"), std::string::npos) << why;
}

}  // namespace
