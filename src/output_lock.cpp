#include "src/output_lock.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

#include "src/errors.hpp"

namespace dpstream {

OutputLock::OutputLock(const std::filesystem::path& dir) {
  std::error_code ec;
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
  if (rc == 0) return;
  const int err = errno;
  if (err == EWOULDBLOCK) {
    ::close(fd_);
    fd_ = -1;
    throw ConfigError(
        fmt::format("output dir {} is in use by another dpstream job (it holds the directory's lock): let that job "
                    "end or stop it, then run again (--resume continues its checkpoint), or choose another --out",
                    dir.string()));
  }
  note_ = fmt::format(
      "cannot lock output dir {} ({}): this file system does not lock directories, so make sure "
      "that no other job writes to it while this one runs",
      dir.string(), errno_text(err));
}

OutputLock::~OutputLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor of the open directory drops its lock
}

}  // namespace dpstream
