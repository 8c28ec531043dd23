#include "src/h5.hpp"

#include <fmt/format.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace dpstream::h5 {

namespace {
// Set when HDF5 failed to close an object (a full disk: the file's last writes failed). HDF5 1.10 then keeps the file's
// id with its shared state already freed, and closing the library dereferences it: a crash at exit after the job had
// reported its error (found with a checkpoint on a full file system, tests/e2e/test_disk_full.py).
std::atomic<bool> close_failed{false};

// HDF5's own exit handler closes every object and the library; this one does the same unless a close failed.
void close_library() {
  if (!close_failed.load()) H5close();
}

// Once per process, before any other HDF5 call of this program (none runs in a static initializer): HDF5's exit
// handler replaced by close_library, and HDF5's error stack printing silenced on the loading thread. Were the library
// set up already, H5dont_atexit would fail and HDF5's own handler would stay: close_library then does not register.
const bool kQuiet = [] {
  if (H5dont_atexit() >= 0) std::atexit(close_library);
  silence_errors_on_this_thread();
  return true;
}();

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error("HDF5: cannot " + what); }
void check(herr_t rc, const std::string& what) {
  if (rc < 0) fail(what);
}
std::string unique_name() {  // the core driver needs a name per open file; nothing touches the disk
  static std::atomic<std::uint64_t> n{0};
  return fmt::format("dpstream-memory-file-{}.h5", n.fetch_add(1));
}
}  // namespace

void silence_errors_on_this_thread() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

Id::Id(hid_t id, herr_t (*closer)(hid_t), const std::string& what) : id_(id), close_(closer) {
  (void)kQuiet;
  if (id_ < 0) fail(what);
}

Id& Id::operator=(Id&& o) noexcept {
  if (this != &o) {
    reset();
    id_ = o.id_;
    close_ = o.close_;
    o.id_ = H5I_INVALID_HID;
  }
  return *this;
}

void Id::reset() { (void)close(); }

bool Id::close() {
  const bool closed = id_ < 0 || !close_ || close_(id_) >= 0;
  if (!closed) close_failed.store(true);
  id_ = H5I_INVALID_HID;
  return closed;
}

MemoryFile::MemoryFile(std::size_t expected_bytes) {
  fapl_ = Id(H5Pcreate(H5P_FILE_ACCESS), H5Pclose, "create a file access list");
  // The driver grows its buffer in steps of `expected_bytes`: one step for a file of that size.
  check(H5Pset_fapl_core(fapl_.get(), std::max<std::size_t>(expected_bytes, 1 << 16), /*backing_store=*/0),
        "select the in-memory driver");
  file_ = Id(H5Fcreate(unique_name().c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl_.get()), H5Fclose,
             "create an in-memory file");
}

MemoryFile::MemoryFile(const std::vector<std::byte>& image) {
  fapl_ = Id(H5Pcreate(H5P_FILE_ACCESS), H5Pclose, "create a file access list");
  check(H5Pset_fapl_core(fapl_.get(), 1 << 20, 0), "select the in-memory driver");
  check(H5Pset_file_image(fapl_.get(), const_cast<std::byte*>(image.data()), image.size()), "load a file image");
  file_ =
      Id(H5Fopen(unique_name().c_str(), H5F_ACC_RDONLY, fapl_.get()), H5Fclose, "open the file (not an HDF5 file?)");
}

std::vector<std::byte> MemoryFile::image() const {
  check(H5Fflush(file_.get(), H5F_SCOPE_GLOBAL), "flush an in-memory file");
  const ssize_t n = H5Fget_file_image(file_.get(), nullptr, 0);
  if (n < 0) fail("size a file image");
  std::vector<std::byte> out(static_cast<std::size_t>(n));
  if (H5Fget_file_image(file_.get(), out.data(), out.size()) != n) fail("copy a file image");
  return out;
}

DiskFile::DiskFile(const std::string& path, Mode mode) {
  Id fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose, "create a file access list");
#if H5_VERSION_GE(1, 10, 7)
  // No flock(): parallel file systems often refuse it, and the engine's own protocol (temporary
  // file, rename, one writer per file) already keeps readers and writers apart.
  check(H5Pset_file_locking(fapl.get(), false, true), "turn off file locking");
#endif
  file_ =
      mode == Mode::Create
          ? Id(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), H5Fclose, "create " + path)
          : Id(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get()), H5Fclose, "open " + path + " (not an HDF5 file?)");
}

void DiskFile::close() {
  const hid_t id = file_.get();
  if (id < 0) return;
  const herr_t flushed = H5Fflush(id, H5F_SCOPE_GLOBAL);
  const bool closed = file_.close();  // a close writes what is left: its failure is the file's, too
  check(flushed, "write out a file");
  if (!closed) fail("close a file (its last writes failed)");
}

void create_group(hid_t loc, const std::string& name) {
  Id g(H5Gcreate2(loc, name.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose, "create group " + name);
}

void write_dataset_raw(hid_t loc, const std::string& name, hid_t type, const void* data, std::size_t n) {
  write_dataset_raw(loc, name, type, data, n, type);
}

void write_dataset_raw(hid_t loc, const std::string& name, hid_t type, const void* data, std::size_t n,
                       hid_t file_type) {
  const hsize_t dims[1] = {n};
  Id space(H5Screate_simple(1, dims, nullptr), H5Sclose, "create a dataspace for " + name);
  Id ds(H5Dcreate2(loc, name.c_str(), file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Dclose,
        "create dataset " + name);
  if (n > 0) check(H5Dwrite(ds.get(), type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), "write dataset " + name);
}

hid_t narrowest_type(bool is_signed, std::int64_t lo, std::uint64_t hi) {
  if (is_signed) {  // the width whose range [-2^(w-1), 2^(w-1)) holds both ends
    const std::uint64_t need = lo < 0 ? std::max(hi, static_cast<std::uint64_t>(-(lo + 1))) : hi;
    if (need < (1u << 7)) return H5T_STD_I8LE;
    if (need < (1u << 15)) return H5T_STD_I16LE;
    if (need < (1ull << 31)) return H5T_STD_I32LE;
    return H5T_STD_I64LE;
  }
  if (hi < (1u << 8)) return H5T_STD_U8LE;
  if (hi < (1u << 16)) return H5T_STD_U16LE;
  if (hi < (1ull << 32)) return H5T_STD_U32LE;
  return H5T_STD_U64LE;
}

std::size_t dataset_size(hid_t loc, const std::string& name) {
  if (!exists(loc, name)) throw std::runtime_error("HDF5: dataset " + name + " is missing");
  Id ds(H5Dopen2(loc, name.c_str(), H5P_DEFAULT), H5Dclose, "open dataset " + name);
  Id space(H5Dget_space(ds.get()), H5Sclose, "read the shape of " + name);
  if (H5Sget_simple_extent_ndims(space.get()) != 1) fail("read " + name + ": not a 1-D dataset");
  hsize_t dims[1] = {0};
  H5Sget_simple_extent_dims(space.get(), dims, nullptr);
  // Datasets are written whole and uncompressed: a longer one than the file can hold is damaged,
  // and its length must not size a buffer.
  Id type(H5Dget_type(ds.get()), H5Tclose, "read the type of " + name);
  Id file(H5Iget_file_id(loc), H5Fclose, "find the file of " + name);
  hsize_t file_bytes = 0;
  check(H5Fget_filesize(file.get(), &file_bytes), "size the file of " + name);
  const std::size_t element = H5Tget_size(type.get());
  if (element == 0 || dims[0] > file_bytes / element)
    fail(fmt::format("read {}: {} elements of {} bytes do not fit in the file ({} bytes)", name, dims[0], element,
                     file_bytes));
  return static_cast<std::size_t>(dims[0]);
}

void read_dataset_raw(hid_t loc, const std::string& name, hid_t type, void* data, std::size_t n) {
  if (dataset_size(loc, name) != n) fail("read " + name + ": unexpected length");
  Id ds(H5Dopen2(loc, name.c_str(), H5P_DEFAULT), H5Dclose, "open dataset " + name);
  if (H5Tget_class(type) == H5T_INTEGER) {  // HDF5 would clip a value that does not fit: refuse instead
    Id stored(H5Dget_type(ds.get()), H5Tclose, "read the type of " + name);
    const bool fits = [&] {
      if (H5Tget_class(stored.get()) != H5T_INTEGER) return false;
      const std::size_t from = H5Tget_size(stored.get()), to = H5Tget_size(type);
      const bool from_signed = H5Tget_sign(stored.get()) == H5T_SGN_2, to_signed = H5Tget_sign(type) == H5T_SGN_2;
      if (from_signed == to_signed) return from <= to;
      return !from_signed && from < to;  // unsigned into a wider signed type; never signed into unsigned
    }();
    if (!fits) fail("read " + name + ": its stored integer type does not fit the column's");
  }
  if (n > 0) check(H5Dread(ds.get(), type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), "read dataset " + name);
}

void write_attribute(hid_t loc, const std::string& name, std::uint64_t v) {
  Id space(H5Screate(H5S_SCALAR), H5Sclose, "create a scalar dataspace");
  Id a(H5Acreate2(loc, name.c_str(), H5T_NATIVE_UINT64, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose,
       "create attribute " + name);
  check(H5Awrite(a.get(), H5T_NATIVE_UINT64, &v), "write attribute " + name);
}

void write_attribute(hid_t loc, const std::string& name, const std::string& v) {
  Id type(H5Tcopy(H5T_C_S1), H5Tclose, "copy the string type");
  check(H5Tset_size(type.get(), std::max<std::size_t>(1, v.size())), "size a string type");
  check(H5Tset_strpad(type.get(), H5T_STR_NULLPAD), "pad a string type");
  Id space(H5Screate(H5S_SCALAR), H5Sclose, "create a scalar dataspace");
  Id a(H5Acreate2(loc, name.c_str(), type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose,
       "create attribute " + name);
  std::string buf = v.empty() ? std::string(1, '\0') : v;
  check(H5Awrite(a.get(), type.get(), buf.data()), "write attribute " + name);
}

namespace {
// An attribute of one value of the given class, as write_attribute writes it (H5Aread fills the
// whole extent: an array would overrun the caller's buffer).
Id open_single_attribute(hid_t loc, const std::string& name, H5T_class_t cls, const char* what) {
  if (H5Aexists(loc, name.c_str()) <= 0) throw std::runtime_error("HDF5: attribute " + name + " is missing");
  Id a(H5Aopen(loc, name.c_str(), H5P_DEFAULT), H5Aclose, "open attribute " + name);
  Id space(H5Aget_space(a.get()), H5Sclose, "read the shape of attribute " + name);
  if (H5Sget_simple_extent_npoints(space.get()) != 1) fail("read attribute " + name + ": not a single value");
  Id type(H5Aget_type(a.get()), H5Tclose, "read the type of attribute " + name);
  if (H5Tget_class(type.get()) != cls) fail("read attribute " + name + ": not " + what);
  return a;
}
}  // namespace

std::uint64_t read_uint_attribute(hid_t loc, const std::string& name) {
  Id a = open_single_attribute(loc, name, H5T_INTEGER, "an integer");
  std::uint64_t v = 0;
  check(H5Aread(a.get(), H5T_NATIVE_UINT64, &v), "read attribute " + name);
  return v;
}

std::string read_string_attribute(hid_t loc, const std::string& name) {
  Id a = open_single_attribute(loc, name, H5T_STRING, "a string");
  Id type(H5Aget_type(a.get()), H5Tclose, "read the type of " + name);
  // A variable-length string would be read as a pointer into HDF5's memory.
  if (H5Tis_variable_str(type.get()) != 0) fail("read attribute " + name + ": not a fixed-length string");
  std::string buf(H5Tget_size(type.get()), '\0');
  check(H5Aread(a.get(), type.get(), buf.data()), "read attribute " + name);
  return buf.substr(0, buf.find('\0'));
}

bool exists(hid_t loc, const std::string& path) {
  // Checks each component, as H5Lexists requires.
  std::size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    if (H5Lexists(loc, path.substr(0, pos).c_str(), H5P_DEFAULT) <= 0) return false;
  }
  return true;
}

}  // namespace dpstream::h5
