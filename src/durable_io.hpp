// Durable file writes: every file the engine commits goes through here (temporary file, fsync,
// rename, fsync of the directory), so a crash leaves either the old file or the new one.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

struct XXH3_state_s;  // xxhash.h

namespace dpstream {

// write(2) of all `size` bytes (retries short writes and EINTR); false with errno set on failure.
bool write_all(int fd, const void* data, std::size_t size);

// Makes `path` an empty file that did not exist (O_EXCL: of two racing makers one fails, and a maker never touches
// another's file); 0, or the errno (EEXIST: it exists).
int create_new_file(const std::filesystem::path& path, mode_t mode);

// fsync of a directory, so that a rename inside it survives a crash.
void fsync_dir(const std::filesystem::path& dir);

struct AtomicWriteOptions {
  mode_t mode = 0644;                // permissions of a new file (0600 for checkpoint files)
  const char* fault_half = nullptr;  // fault point after half of the bytes (tests)
  const char* fault_before_rename = nullptr;
};

// Writes `size` bytes to `path` atomically: `path`.tmp, fsync, rename, fsync of the directory.
// Throws std::runtime_error naming the file and the system error. The temporary is made by this call (whatever lay
// at its name is unlinked first, and O_EXCL | O_NOFOLLOW refuse a link put back): a planted link is not written
// through.
void write_file_atomically(const std::filesystem::path& path, const void* data, std::size_t size,
                           const AtomicWriteOptions& options = {});
inline void write_file_atomically(const std::filesystem::path& path, const std::string& text,
                                  const AtomicWriteOptions& options = {}) {
  write_file_atomically(path, text.data(), text.size(), options);
}

// The same for a file that another writer (HDF5) fills: `prepare_temporary` creates `path`.tmp
// empty with `mode` (made fresh, as above) and returns its name; `commit_temporary` fsyncs it, renames it onto
// `path` and fsyncs the directory. Both throw std::runtime_error naming the file. The other writer opens the name
// again, so a link planted in between is followed: use it in a directory no one else writes (the checkpoint's, 0700).
std::filesystem::path prepare_temporary(const std::filesystem::path& path, mode_t mode);
void commit_temporary(const std::filesystem::path& path, const char* fault_before_rename = nullptr);

// Appends `size` bytes to an existing file, fsynced unless `sync` is false; `fault_half` is a fault
// point after half of the bytes (tests). Throws std::runtime_error naming the file.
void append_to_file(const std::filesystem::path& path, const void* data, std::size_t size, bool sync = true,
                    const char* fault_half = nullptr);

// What a failed write should say besides the system's error, a full file system being the usual cause:
// " (X GiB free on the file system of `dir`)", with ": it is full; free space there" and `then` (what to do
// next) below 0.25 GiB free. Empty when the file system cannot be asked.
std::string free_space_note(const std::filesystem::path& dir, const std::string& then);

// Whole file into memory; throws std::runtime_error naming the file.
std::vector<std::byte> read_file_bytes(const std::filesystem::path& path);

// Feeds the first `limit` bytes of a file (all of it by default) into a running XXH3-64 state, read in 1 MiB pieces
// (a file may be gigabytes); returns how many bytes it held up to `limit`. Throws std::runtime_error naming the file.
std::uint64_t hash_file_into(const std::filesystem::path& path, XXH3_state_s* state, std::uint64_t limit = UINT64_MAX);

}  // namespace dpstream
