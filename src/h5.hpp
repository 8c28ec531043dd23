// A thin RAII layer over HDF5's C API: owned ids, 1-D datasets of integers (stored at full width or
// as narrow as their values allow) and bytes,
// scalar attributes, files built in memory (core driver) so that the engine writes, checksums
// and renames the exact bytes itself, and files on disk for the large ones. HDF5's own error printing is turned off;
// failures throw std::runtime_error naming the object.
#pragma once

#include <hdf5.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace dpstream::h5 {

// HDF5 prints its error stack on stderr unless told not to, per thread (Debian's build is thread-safe: each thread
// has its own stack). Failures are reported by exceptions: a thread that calls HDF5 silences its stack first (the
// loading thread's is silenced for it).
void silence_errors_on_this_thread();

class Id {
 public:
  Id() = default;
  Id(hid_t id, herr_t (*closer)(hid_t), const std::string& what);
  ~Id() { reset(); }
  Id(Id&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = H5I_INVALID_HID; }
  Id& operator=(Id&& o) noexcept;
  Id(const Id&) = delete;
  Id& operator=(const Id&) = delete;
  hid_t get() const { return id_; }
  void reset();
  bool close();  // reset() that tells whether HDF5 closed it

 private:
  hid_t id_ = H5I_INVALID_HID;
  herr_t (*close_)(hid_t) = nullptr;
};

template <class T>
hid_t native_type() {
  if constexpr (std::is_same_v<T, std::uint64_t>)
    return H5T_NATIVE_UINT64;
  else if constexpr (std::is_same_v<T, std::int64_t>)
    return H5T_NATIVE_INT64;
  else if constexpr (std::is_same_v<T, std::uint32_t>)
    return H5T_NATIVE_UINT32;
  else if constexpr (std::is_same_v<T, std::uint8_t>)
    return H5T_NATIVE_UINT8;
  else
    static_assert(sizeof(T) == 0, "no HDF5 type for T");
}

// The little-endian integer file type of 1, 2, 4 or 8 bytes, signed or not as asked, that holds every
// value in [lo, hi] (lo < 0 only when signed): a column is stored as narrow as its values allow.
hid_t narrowest_type(bool is_signed, std::int64_t lo, std::uint64_t hi);

// A file that lives in memory until `image()` hands out its bytes.
class MemoryFile {
 public:
  explicit MemoryFile(std::size_t expected_bytes = 1 << 20);  // new, empty file of about this size
  explicit MemoryFile(const std::vector<std::byte>& image);   // opens an image read-only
  hid_t get() const { return file_.get(); }
  std::vector<std::byte> image() const;  // flushes and copies the file's bytes

 private:
  Id fapl_, file_;
};

// A file on disk (HDF5's default driver), created or truncated for writing, or opened read-only:
// large checkpoint segments go straight to disk instead of through an in-memory image.
class DiskFile {
 public:
  enum class Mode { Create, Read };
  DiskFile(const std::string& path, Mode mode);
  hid_t get() const { return file_.get(); }
  void close();  // flushes and closes; throws when HDF5 cannot write the file out

 private:
  Id file_;
};

void create_group(hid_t loc, const std::string& name);

void write_dataset_raw(hid_t loc, const std::string& name, hid_t type, const void* data, std::size_t n);
std::size_t dataset_size(hid_t loc, const std::string& name);  // throws when missing or not 1-D
// Reads into memory type `type`; an integer dataset must be stored in a type whose every value it
// holds (same signedness and as wide or narrower, or unsigned and narrower than a signed type; never a
// signed type into an unsigned one), else it throws.
void read_dataset_raw(hid_t loc, const std::string& name, hid_t type, void* data, std::size_t n);

// `file_type` may be narrower than the memory `type` when every value fits it (HDF5 converts).
void write_dataset_raw(hid_t loc, const std::string& name, hid_t type, const void* data, std::size_t n,
                       hid_t file_type);

template <class T>
void write_dataset(hid_t loc, const std::string& name, const std::vector<T>& v) {
  write_dataset_raw(loc, name, native_type<T>(), v.data(), v.size());
}
// The same column stored in the narrowest integer type that holds its values (read_dataset<T> widens
// it back): ids below 2^32 take 4 bytes, small counts 1 or 2, an all-zero column 1.
template <class T>
void write_narrowest_dataset(hid_t loc, const std::string& name, const std::vector<T>& v) {
  std::int64_t lo = 0;
  std::uint64_t hi = 0;
  for (const T x : v) {
    if constexpr (std::is_signed_v<T>) {
      lo = std::min<std::int64_t>(lo, x);
      if (x > 0) hi = std::max<std::uint64_t>(hi, static_cast<std::uint64_t>(x));
    } else {
      hi = std::max<std::uint64_t>(hi, x);
    }
  }
  write_dataset_raw(loc, name, native_type<T>(), v.data(), v.size(), narrowest_type(std::is_signed_v<T>, lo, hi));
}
template <class T>
std::vector<T> read_dataset(hid_t loc, const std::string& name) {
  std::vector<T> v(dataset_size(loc, name));
  read_dataset_raw(loc, name, native_type<T>(), v.data(), v.size());
  return v;
}

void write_attribute(hid_t loc, const std::string& name, std::uint64_t v);
void write_attribute(hid_t loc, const std::string& name, const std::string& v);
std::uint64_t read_uint_attribute(hid_t loc, const std::string& name);
std::string read_string_attribute(hid_t loc, const std::string& name);
bool exists(hid_t loc, const std::string& path);

}  // namespace dpstream::h5
