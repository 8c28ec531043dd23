#include "src/durable_io.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "common/fault_injection.hpp"
#include "src/errors.hpp"

namespace dpstream {

std::string free_space_note(const std::filesystem::path& dir, const std::string& then) {
  struct statvfs fs {};
  if (statvfs(dir.empty() ? "." : dir.c_str(), &fs) != 0) return "";
  const double free_gib = static_cast<double>(fs.f_bavail) * static_cast<double>(fs.f_frsize) / (1u << 30);
  return fmt::format(" ({:.2f} GiB free on the file system of {}{})", free_gib, dir.string(),
                     free_gib < 0.25 ? ": it is full; free space there" + then : "");
}

namespace {
[[noreturn]] void fail(const char* what, const std::filesystem::path& path, int err) {
  throw std::runtime_error(fmt::format("cannot {} {}: {}", what, path.string(), errno_text(err)));
}
}  // namespace

int create_new_file(const std::filesystem::path& path, mode_t mode) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (fd < 0) return errno;
  ::close(fd);
  return 0;
}

bool write_all(int fd, const void* data, std::size_t size) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += n;
    size -= static_cast<std::size_t>(n);
  }
  return true;
}

void fsync_dir(const std::filesystem::path& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail("open directory", dir, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL) fail("fsync directory", dir, err);  // EINVAL: the file system cannot sync directories
}

namespace {

// A new file at `tmp`, made by this call: whatever lay there (an interrupted write's file, or a symbolic link planted
// to make the write land elsewhere) is unlinked first, and O_EXCL | O_NOFOLLOW refuse anything put back meanwhile.
int create_fresh(const std::filesystem::path& tmp, mode_t mode) {
  if (::unlink(tmp.c_str()) != 0 && errno != ENOENT) fail("remove the stale", tmp, errno);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
  if (fd < 0) fail("create", tmp, errno);
  return fd;
}

}  // namespace

void write_file_atomically(const std::filesystem::path& path, const void* data, std::size_t size,
                           const AtomicWriteOptions& options) {
  const auto tmp = std::filesystem::path(path.string() + ".tmp");
  const int fd = create_fresh(tmp, options.mode);
  ::fchmod(fd, options.mode);  // the umask may have narrowed the mode
  const auto* bytes = static_cast<const char*>(data);
  const std::size_t half = size / 2;
  bool ok = write_all(fd, bytes, half);
  if (ok && options.fault_half) fault::point(options.fault_half);
  ok = ok && write_all(fd, bytes + half, size - half) && ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok) {
    ::unlink(tmp.c_str());
    fail("write", tmp, err);
  }
  if (options.fault_before_rename) fault::point(options.fault_before_rename);
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("rename into place", path, errno);
  fsync_dir(path.parent_path());
}

std::filesystem::path prepare_temporary(const std::filesystem::path& path, mode_t mode) {
  auto tmp = std::filesystem::path(path.string() + ".tmp");
  const int fd = create_fresh(tmp, mode);
  const int rc = ::fchmod(fd, mode);  // the umask may have narrowed `mode`
  const int err = errno;
  ::close(fd);
  if (rc != 0) fail("set the permissions of", tmp, err);
  return tmp;
}

void commit_temporary(const std::filesystem::path& path, const char* fault_before_rename) {
  const auto tmp = std::filesystem::path(path.string() + ".tmp");
  const int fd = ::open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("open", tmp, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) {
    ::unlink(tmp.c_str());
    fail("fsync", tmp, err);
  }
  if (fault_before_rename) fault::point(fault_before_rename);
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("rename into place", path, errno);
  fsync_dir(path.parent_path());
}

void append_to_file(const std::filesystem::path& path, const void* data, std::size_t size, bool sync,
                    const char* fault_half) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd < 0) fail("open", path, errno);
  const auto* bytes = static_cast<const char*>(data);
  const std::size_t half = size / 2;
  bool ok = write_all(fd, bytes, half);
  if (ok && fault_half) fault::point(fault_half);
  ok = ok && write_all(fd, bytes + half, size - half) && (!sync || ::fsync(fd) == 0);
  const int err = errno;
  ::close(fd);
  if (!ok) fail("append to", path, err);
}

std::vector<std::byte> read_file_bytes(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("open", path, errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail("stat", path, err);
  }
  std::vector<std::byte> out(static_cast<std::size_t>(st.st_size));
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::read(fd, out.data() + done, out.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      ::close(fd);
      fail("read", path, err);
    }
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
  return out;
}

std::uint64_t hash_file_into(const std::filesystem::path& path, XXH3_state_s* state, std::uint64_t limit) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(fmt::format("cannot open {}: {}", path.string(), errno_text(errno)));
  std::vector<char> buffer(std::size_t{1} << 20);
  std::uint64_t read = 0;
  while (read < limit) {
    const ssize_t n =
        ::read(fd, buffer.data(), static_cast<std::size_t>(std::min<std::uint64_t>(limit - read, buffer.size())));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      throw std::runtime_error(fmt::format("cannot read {}: {}", path.string(), errno_text(err)));
    }
    if (n == 0) break;
    XXH3_64bits_update(state, buffer.data(), static_cast<std::size_t>(n));
    read += static_cast<std::uint64_t>(n);
  }
  ::close(fd);
  return read;
}

}  // namespace dpstream
