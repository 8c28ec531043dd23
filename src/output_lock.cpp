#include "src/output_lock.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

#include "src/errors.hpp"

namespace dpstream {

namespace {

// File systems of one node (statfs f_type), where a lock taken by one process holds for every other: a job on
// another node cannot reach them. Elsewhere flock(2) may hold on this node only: NFS keeps directory locks on the
// client, Lustre and BeeGFS do unless mounted for cluster-wide locks, which statfs does not tell.
constexpr long kOneNodeFileSystems[] = {0xEF53 /* ext2-4 */,
                                        0x58465342 /* xfs */,
                                        0x9123683E /* btrfs */,
                                        0x01021994 /* tmpfs */,
                                        0x794C7630 /* overlayfs */,
                                        0x2FC12FC1 /* zfs */,
                                        0xF2F52010 /* f2fs */};

bool on_one_node(int fd) {
  struct statfs fs {};
  if (::fstatfs(fd, &fs) != 0) return false;
  for (const long type : kOneNodeFileSystems)
    if (static_cast<long>(fs.f_type) == type) return true;
  return false;
}

// The lock of the last holder that ended: its open directory (closing it drops the lock) and the directory's
// identity. One at most: a later lock ends the job that left it (only rank 0 of a job locks, once a job).
struct KeptLock {
  int fd = -1;
  dev_t dev = 0;
  ino_t ino = 0;
};
KeptLock& kept_lock() {
  static KeptLock kept;
  return kept;
}

// The kept lock when it is `fd`'s directory's (fd is closed: the kept descriptor holds the lock); else -1, and the
// kept lock, of another directory, is dropped. The kept descriptor holds its directory's inode, so no new directory
// can have its number: equal (device, inode) is the same directory.
int take_kept_lock(int fd) {
  KeptLock& kept = kept_lock();
  if (kept.fd < 0) return -1;
  struct stat st {};
  const bool same = ::fstat(fd, &st) == 0 && st.st_dev == kept.dev && st.st_ino == kept.ino;
  const int taken = kept.fd;
  kept = KeptLock{};
  if (same) {
    ::close(fd);
    return taken;
  }
  ::close(taken);
  return -1;
}

}  // namespace

OutputLock::OutputLock(const std::filesystem::path& dir, bool create) {
  std::error_code ec;
  if (!create && !std::filesystem::exists(dir, ec)) return;  // nothing there to guard, and nothing made
  std::filesystem::create_directories(dir, ec);
  if (ec)
    throw ConfigError(
        fmt::format("cannot create output dir {}: {}; set [output] dir or --out", dir.string(), ec.message()));
  fd_ = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd_ < 0)
    throw ConfigError(fmt::format("cannot open output dir {}: {}; set [output] dir or --out to a directory",
                                  dir.string(), errno_text(errno)));
  int rc = 0;
  if (const int kept = take_kept_lock(fd_); kept >= 0)  // this process's last job locked it: still locked
    fd_ = kept;
  else
    do {
      rc = ::flock(fd_, LOCK_EX | LOCK_NB);
    } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) {
      ::close(fd_);
      fd_ = -1;
      throw ConfigError(fmt::format(
          "output dir {} is in use by another dpstream job (or another process locked it, e.g. flock(1)): let that "
          "job end or stop it, then run again (--resume continues its checkpoint), or choose another --out",
          dir.string()));
    }
    note_ = fmt::format("cannot lock output dir {} ({}): make sure that no other job writes to it while this one runs",
                        dir.string(), errno_text(err));
    ::close(fd_);  // it holds no lock: nothing to keep
    fd_ = -1;
    return;
  }
  if (!on_one_node(fd_))
    note_ = fmt::format(
        "output dir {} is on a shared file system whose locks may hold on this node only (NFS; "
        "Lustre or BeeGFS without cluster-wide flock): make sure that no job on another node writes "
        "to it while this one runs",
        dir.string());
}

void refuse_unwritable_dir(const std::filesystem::path& dir, std::string_view fix) {
  if (::access(dir.c_str(), W_OK) != 0)
    throw ConfigError(fmt::format("output dir {} is not writable ({}); {}", dir.string(), errno_text(errno), fix));
}

OutputLock::~OutputLock() {
  if (fd_ < 0) return;
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    ::close(fd_);  // closing the last descriptor of the open directory drops its lock
    return;
  }
  KeptLock& kept = kept_lock();
  if (kept.fd >= 0) ::close(kept.fd);  // only where two holders lived at once: the one ending last is kept
  kept = KeptLock{fd_, st.st_dev, st.st_ino};
}

}  // namespace dpstream
