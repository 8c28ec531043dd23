// One job at a time in an output directory. Two jobs writing one directory (a requeued job started
// while the first still runs, or the same job submitted twice) would interleave their commits and
// rows into a releases.csv that looks complete. The first job holds an exclusive flock(2) on the
// directory itself (no file is made in it); the kernel drops it when the job exits, however it ends,
// so a lock is never left behind.
#pragma once

#include <filesystem>
#include <string>

namespace dpstream {

class OutputLock {
 public:
  // Creates `dir` if it is missing and locks it. Throws ConfigError when another process holds the lock,
  // or `dir` cannot be created or opened. Where the file system cannot lock directories (NFS, Lustre
  // without its flock mount option) the job goes on unlocked, and note() says so.
  explicit OutputLock(const std::filesystem::path& dir);
  ~OutputLock();
  OutputLock(const OutputLock&) = delete;
  OutputLock& operator=(const OutputLock&) = delete;

  // Empty when the directory is locked; else why it is not, and what the user must see to.
  const std::string& note() const { return note_; }

 private:
  int fd_ = -1;
  std::string note_;
};

}  // namespace dpstream
