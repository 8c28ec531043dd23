// One job at a time in an output directory. Two jobs writing one directory (a requeued job started
// while the first still runs, or the same job submitted twice) would interleave their commits and
// rows into a releases.csv that looks complete. The first job holds an exclusive flock(2) on the
// directory itself (no file is made in it); the kernel drops it when the job exits, however it ends,
// so a lock is never left behind.
//
// Rank 0's holder ends with its engine, and on an error path other ranks may still be finishing a write there
// (a checkpoint segment), so the lock is not dropped with its holder: the process keeps it until it exits (after
// MPI_Finalize) or until it locks a directory again, which it does only in a later job, once every rank has left
// this one (the later job's start is collective). Locking the same directory again takes the kept lock over.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

namespace dpstream {

class OutputLock {
 public:
  // Locks `dir`, made first if it is missing and `create` (a resume makes nothing: without the directory it is
  // refused anyway). Throws ConfigError when another process holds the lock, or `dir` cannot be made or opened.
  // Where the file system cannot lock directories the job goes on unlocked, and where its locks may hold on one
  // node only (NFS; Lustre or BeeGFS without cluster-wide flock) it goes on locked there; note() says so.
  OutputLock(const std::filesystem::path& dir, bool create);
  ~OutputLock();  // the lock is kept by the process (see above)
  OutputLock(const OutputLock&) = delete;
  OutputLock& operator=(const OutputLock&) = delete;

  // Empty when the directory is locked for every job that could reach it; else what the user must see to.
  const std::string& note() const { return note_; }

 private:
  int fd_ = -1;
  std::string note_;
};

// Refuses (ConfigError) an output directory this process cannot write to, saying `fix`: a job finds it before a
// ledger is charged, not when its first file is written.
void refuse_unwritable_dir(const std::filesystem::path& dir, std::string_view fix);

}  // namespace dpstream
