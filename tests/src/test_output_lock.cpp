// OutputLock: one holder of an output directory at a time (the whole-CLI test with two jobs is
// tests/e2e/test_output_lock.py).
#include "src/output_lock.hpp"

#include <gtest/gtest.h>
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
  EXPECT_EQ(refusal(dir), "") << "the lock is dropped with its holder";
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
