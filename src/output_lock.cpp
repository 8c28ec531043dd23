#include "src/output_lock.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
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
    return;
  }
  if (!on_one_node(fd_))
    note_ = fmt::format(
        "output dir {} is on a shared file system whose locks may hold on this node only (NFS; "
        "Lustre or BeeGFS without cluster-wide flock): make sure that no job on another node writes "
        "to it while this one runs",
        dir.string());
}

OutputLock::~OutputLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor of the open directory drops its lock
}

}  // namespace dpstream
