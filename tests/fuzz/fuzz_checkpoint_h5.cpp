// Fuzzes the readers of the checkpoint's HDF5 files (src/checkpoint.cpp over src/h5.cpp): read_job
// (job.h5) and read_segment (a commit's segment), and applies a decoded segment to a rank's tables as
// a resume does. Damage may only end in CheckpointError.
//
// Structure-aware: the input does not hold HDF5 bytes but choices, from which the target builds a
// well-formed HDF5 file with the project's layout, each attribute and dataset written as the engine
// writes it or in another form a file can hold (missing, another integer or real type, a fixed or
// variable-length string, an array, an empty or scalar shape, a huge extent without storage), with
// fuzzed values and lengths. The checks before HDF5 (size and XXH3 from the manifest) are made to
// pass, so the target tests what the project does with whatever HDF5 hands back. Raw damaged bytes
// are not given to HDF5 here: the project never parses a file that its manifest does not vouch for,
// and libhdf5 1.10 itself is not memory-safe on arbitrary bytes.
// An exhausted input makes every choice "as the engine writes it": seeds are short byte strings.
#include <fuzzer/FuzzedDataProvider.h>
#include <hdf5.h>
#include <xxhash.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernels/bounding.hpp"
#include "kernels/key_accumulate.hpp"
#include "src/checkpoint.hpp"
#include "src/errors.hpp"
#include "src/h5.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using namespace dpstream;

namespace {

enum class Form : std::uint8_t {
  Engine,  // as the engine writes it
  Missing,
  SmallInteger,  // int8, maybe negative
  Real,          // float64
  FixedString,
  VariableString,
  Array,  // attribute: 1-D of several values; dataset: 2-D
  Empty,  // null dataspace (dataset: scalar)
  Huge,   // dataset: 2^40 elements, chunked, no storage written
  kCount
};

class Builder {
 public:
  explicit Builder(FuzzedDataProvider& in) : in_(in) {}

  // Half of the byte values keep the engine's form, so that most files are only slightly damaged.
  Form form() {
    const auto b = in_.ConsumeIntegral<std::uint8_t>();
    return b < 128 ? Form::Engine : static_cast<Form>(1 + b % (static_cast<int>(Form::kCount) - 1));
  }
  std::string text(std::size_t max = 24) { return in_.ConsumeRandomLengthString(max); }

  void uint_attribute(hid_t loc, const char* name, std::uint64_t value) {
    const Form f = form();
    if (f == Form::Engine || f == Form::Huge) return scalar_attribute(loc, name, H5T_NATIVE_UINT64, &value);
    other_attribute(loc, name, f);
  }
  void string_attribute(hid_t loc, const char* name, const std::string& value) {
    const Form f = form();
    if (f == Form::Engine || f == Form::Huge) return h5::write_attribute(loc, name, value);
    other_attribute(loc, name, f);
  }

  // A 1-D dataset of n values of `type` (`size` bytes each) as the engine writes it, or another form.
  void dataset(hid_t loc, const char* name, hid_t type, std::size_t size, std::size_t n) {
    switch (form()) {
      case Form::Engine: {
        const auto bytes = in_.ConsumeBytes<std::uint8_t>(n * size);
        std::vector<std::uint8_t> data(n * size);
        std::copy(bytes.begin(), bytes.end(), data.begin());
        return h5::write_dataset_raw(loc, name, type, data.data(), n);
      }
      case Form::Missing:
        return;
      case Form::SmallInteger:
        return simple_dataset(loc, name, H5T_NATIVE_INT8, 1, {n});
      case Form::Real:
        return simple_dataset(loc, name, H5T_NATIVE_DOUBLE, 8, {n});
      case Form::FixedString: {
        h5::Id t(H5Tcopy(H5T_C_S1), H5Tclose, "string type");
        H5Tset_size(t.get(), 4);
        return simple_dataset(loc, name, t.get(), 4, {n});
      }
      case Form::VariableString: {
        h5::Id t(H5Tcopy(H5T_C_S1), H5Tclose, "string type");
        H5Tset_size(t.get(), H5T_VARIABLE);
        std::vector<std::string> s(n);
        std::vector<const char*> p(n);
        for (std::size_t i = 0; i < n; ++i) p[i] = (s[i] = text(8)).c_str();
        return write_dataset(loc, name, t.get(), {n}, p.data());
      }
      case Form::Array:
        return simple_dataset(loc, name, type, size, {2, n});
      case Form::Empty: {
        h5::Id space(H5Screate(in_.ConsumeBool() ? H5S_NULL : H5S_SCALAR), H5Sclose, "dataspace");
        h5::Id ds(H5Dcreate2(loc, name, type, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Dclose, name);
        return;
      }
      case Form::Huge: {
        const hsize_t dims[1] = {hsize_t{1} << 40}, chunk[1] = {1024};
        h5::Id space(H5Screate_simple(1, dims, nullptr), H5Sclose, "dataspace");
        h5::Id dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose, "dcpl");
        H5Pset_chunk(dcpl.get(), 1, chunk);
        h5::Id ds(H5Dcreate2(loc, name, type, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT), H5Dclose, name);
        return;
      }
      case Form::kCount:
        return;
    }
  }

  std::size_t length(std::size_t engine) {  // a column's length: the engine's, or another one
    return in_.ConsumeBool() ? in_.ConsumeIntegralInRange<std::size_t>(0, 40) : engine;
  }

 private:
  void scalar_attribute(hid_t loc, const char* name, hid_t type, const void* value) {
    h5::Id space(H5Screate(H5S_SCALAR), H5Sclose, "dataspace");
    h5::Id a(H5Acreate2(loc, name, type, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose, name);
    H5Awrite(a.get(), type, value);
  }
  void other_attribute(hid_t loc, const char* name, Form f) {
    switch (f) {
      case Form::SmallInteger: {
        const auto v = in_.ConsumeIntegral<std::int8_t>();
        return scalar_attribute(loc, name, H5T_NATIVE_INT8, &v);
      }
      case Form::Real: {
        const double v = in_.ConsumeFloatingPoint<double>();
        return scalar_attribute(loc, name, H5T_NATIVE_DOUBLE, &v);
      }
      case Form::FixedString:
        return h5::write_attribute(loc, name, text());
      case Form::VariableString: {
        h5::Id t(H5Tcopy(H5T_C_S1), H5Tclose, "string type");
        H5Tset_size(t.get(), H5T_VARIABLE);
        const std::string s = text();
        const char* p = s.c_str();
        return scalar_attribute(loc, name, t.get(), &p);
      }
      case Form::Array: {
        const hsize_t dims[1] = {in_.ConsumeIntegralInRange<hsize_t>(2, 64)};
        std::vector<std::uint64_t> v(dims[0], 7);
        h5::Id space(H5Screate_simple(1, dims, nullptr), H5Sclose, "dataspace");
        h5::Id a(H5Acreate2(loc, name, H5T_NATIVE_UINT64, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose, name);
        H5Awrite(a.get(), H5T_NATIVE_UINT64, v.data());
        return;
      }
      case Form::Empty: {
        h5::Id space(H5Screate(H5S_NULL), H5Sclose, "dataspace");
        h5::Id a(H5Acreate2(loc, name, H5T_NATIVE_UINT64, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose, name);
        return;
      }
      default:
        return;  // missing
    }
  }
  void simple_dataset(hid_t loc, const char* name, hid_t type, std::size_t size, std::vector<hsize_t> dims) {
    std::size_t n = 1;
    for (auto d : dims) n *= d;
    const auto bytes = in_.ConsumeBytes<std::uint8_t>(n * size);
    std::vector<std::uint8_t> data(n * size);
    std::copy(bytes.begin(), bytes.end(), data.begin());
    write_dataset(loc, name, type, dims, data.data());
  }
  static void write_dataset(hid_t loc, const char* name, hid_t type, std::vector<hsize_t> dims, const void* data) {
    h5::Id space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose, "dataspace");
    h5::Id ds(H5Dcreate2(loc, name, type, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Dclose, name);
    std::size_t n = 1;
    for (auto d : dims) n *= d;
    if (n > 0) H5Dwrite(ds.get(), type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data);
  }

  FuzzedDataProvider& in_;
};

std::vector<std::byte> job_file(Builder& b) {
  h5::MemoryFile f(1 << 16);
  const hid_t root = f.get();
  b.string_attribute(root, "format", "dpstream-checkpoint-job");
  b.uint_attribute(root, "version", 4);
  b.string_attribute(root, "job_id", b.text());
  b.string_attribute(root, "job_name", b.text());
  b.string_attribute(root, "started_at", b.text());
  const std::string k = b.text(), v = b.text();
  const std::string fields = nlohmann::json{{k, v}}.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  b.string_attribute(root, "fields", b.length(0) ? b.text(64) : fields);
  b.dataset(root, "secret", H5T_NATIVE_UINT8, 1, b.length(32));
  return f.image();
}

std::vector<std::byte> segment_file(Builder& b, const checkpoint::SegmentRef& ref, const std::string& job_id) {
  h5::MemoryFile f(1 << 16);
  const hid_t root = f.get();
  b.string_attribute(root, "format", "dpstream-checkpoint-segment");
  b.uint_attribute(root, "version", 4);
  b.string_attribute(root, "job_id", job_id);
  b.uint_attribute(root, "seq", ref.seq);
  b.uint_attribute(root, "rank", static_cast<std::uint64_t>(ref.rank));
  b.uint_attribute(root, "ranks", static_cast<std::uint64_t>(ref.ranks));
  for (const char* name : {"window_index", "first_trigger", "next_trigger"}) b.uint_attribute(root, name, 0);
  for (const char* g : {"users", "pairs", "keys", "releases"}) h5::create_group(root, g);
  const std::size_t nu = b.length(3), np = b.length(4), nk = b.length(5);
  b.dataset(root, "users/id", H5T_NATIVE_UINT64, 8, nu);
  b.dataset(root, "users/kept", H5T_NATIVE_UINT32, 4, b.length(nu));
  b.dataset(root, "pairs/user", H5T_NATIVE_UINT64, 8, np);
  b.dataset(root, "pairs/key_fingerprint", H5T_NATIVE_UINT32, 4, b.length(np));
  b.dataset(root, "keys/id", H5T_NATIVE_UINT64, 8, nk);
  b.dataset(root, "keys/sum_low", H5T_NATIVE_UINT64, 8, b.length(nk));
  for (const char* name : {"keys/count", "keys/sum_high", "keys/users", "keys/round_base_users"})
    b.dataset(root, name, H5T_NATIVE_INT64, 8, b.length(nk));
  for (const char* name : {"keys/round", "keys/round_start"}) b.dataset(root, name, H5T_NATIVE_UINT32, 4, b.length(nk));
  b.dataset(root, "releases/csv", H5T_NATIVE_UINT8, 1, b.length(20));
  return f.image();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  Builder b(in);
  const auto& dir = fuzz::scratch_dir();

  // job.h5, read as a resume does: vouched for by a manifest holding its size and checksum.
  {
    const auto image = job_file(b);
    fuzz::write_file(dir / "job.h5", image.data(), image.size());
    checkpoint::Manifest vouching;
    vouching.job_file_bytes = image.size();
    vouching.job_file_xxh3 = XXH3_64bits(image.data(), image.size());
    try {
      const checkpoint::JobRecord job = checkpoint::read_job(dir / "job.h5", &vouching);
      if (job.bytes != image.size()) fuzz::property_failed("read_job reports another size than the file's");
    } catch (const CheckpointError&) {
    }
  }

  // A segment of commit `seq` by `rank` of a job, read against a manifest entry that may disagree.
  const auto seq = in.ConsumeIntegral<std::uint64_t>();
  const int rank = in.ConsumeIntegralInRange<int>(0, 3);
  const std::string job_id = "0123456789abcdef0123456789abcdef";
  checkpoint::SegmentRef ref{seq, rank, 4, "w0/s000001-r0000.h5", 0, 0};
  const auto image = segment_file(b, ref, job_id);
  if (in.ConsumeBool()) ref.seq ^= 1;
  if (in.ConsumeBool()) ref.rank ^= 1;
  ref.bytes = image.size();
  ref.xxh3 = XXH3_64bits(image.data(), image.size());
  std::filesystem::create_directories(dir / "w0");
  fuzz::write_file(dir / ref.file, image.data(), image.size());
  try {
    const checkpoint::Segment seg = checkpoint::read_segment(dir, ref, job_id);
    const std::size_t nk = seg.key_id.size();
    if (seg.user_kept.size() != seg.user_id.size() || seg.pair_fingerprint.size() != seg.pair_user.size() ||
        seg.key_count.size() != nk || seg.key_sum_low.size() != nk || seg.key_sum_high.size() != nk ||
        seg.key_users.size() != nk || seg.key_round_base_users.size() != nk || seg.key_round.size() != nk ||
        seg.key_round_start.size() != nk)
      fuzz::property_failed("read_segment returned columns of different lengths");
    for (const std::uint32_t f : seg.pair_fingerprint)
      if (f >> kernels::UserState::kFingerprintBits != 0)
        fuzz::property_failed("read_segment returned a key fingerprint wider than UserState keeps");
    kernels::UserState users;
    kernels::KeyStateTable keys;
    checkpoint::apply(seg, users, keys, 1, 2, /*filter=*/true);
    checkpoint::apply(seg, users, keys, 0, 1, /*filter=*/false);
  } catch (const CheckpointError&) {
  }
  return 0;
}
