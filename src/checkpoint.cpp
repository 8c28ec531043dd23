#include "src/checkpoint.hpp"

#include "dpstream_version.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <malloc.h>
#include <omp.h>
#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <optional>
#include <regex>
#include <set>
#include <utility>

#include "common/bounded_json.hpp"
#include "common/fault_injection.hpp"
#include "common/printable.hpp"
#include "kernels/banded_counter.hpp"
#include "partition/hash.hpp"
#include "src/csv_input.hpp"
#include "src/durable_io.hpp"
#include "src/errors.hpp"
#include "src/h5.hpp"
#include "src/zipf.hpp"

namespace dpstream::checkpoint {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kSegmentFormat = "dpstream-checkpoint-segment";
constexpr const char* kJobFormat = "dpstream-checkpoint-job";
// 2: key sums in 128 bits (keys/sum_low, keys/sum_high); 3: pairs as (user, key fingerprint); 4: key
// fingerprints of 16 bits (UserState::kFingerprintBits)
constexpr std::uint64_t kFormatVersion = 5;  // 5: key selection's first tests (blocked prefixes)
constexpr std::uint64_t kTrimJournalBytes = std::uint64_t{64} << 20;  // see Store::commit
constexpr mode_t kFileMode = 0600;
constexpr const char* kJobFile = "job.h5";

std::string hex64(std::uint64_t v) { return fmt::format("{:016x}", v); }
std::uint64_t xxh3(const std::vector<std::byte>& b) { return XXH3_64bits(b.data(), b.size()); }

// Size and XXH3 of a file's bytes, read in 1 MiB pieces (a segment may be gigabytes); throws
// std::runtime_error naming the file.
struct FileDigest {
  std::uint64_t bytes = 0, xxh3 = 0;
};
FileDigest digest_file(const fs::path& path) {
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(), XXH3_freeState);
  if (!state || XXH3_64bits_reset(state.get()) != XXH_OK)
    throw std::runtime_error("cannot start a checksum (out of memory)");
  FileDigest d;
  d.bytes = hash_file_into(path, state.get());
  d.xxh3 = XXH3_64bits_digest(state.get());
  return d;
}

std::string manifest_name(std::uint64_t seq) { return fmt::format("MANIFEST-{:06}.json", seq); }

// mkdir -p with mode 0700; a new directory's entry is made durable (fsync of its parent).
void make_private_dir(const fs::path& path) {
  const fs::path dir = path.has_filename() ? path : path.parent_path();  // "a/b/" is "a/b"
  std::error_code ec;
  if (!dir.parent_path().empty()) fs::create_directories(dir.parent_path(), ec);
  if (ec) throw std::runtime_error(fmt::format("cannot create {}: {}", dir.parent_path().string(), ec.message()));
  // Born private (mode 0700 at mkdir): a kill between a mkdir and a chmod must not leave it open to others.
  const bool created = ::mkdir(dir.c_str(), 0700) == 0;
  if (!created && errno != EEXIST)
    throw std::runtime_error(fmt::format("cannot create {}: {}", dir.string(), errno_text(errno)));
  if (::chmod(dir.c_str(), 0700) != 0)
    throw std::runtime_error(fmt::format("cannot make {} private (chmod 0700): {}", dir.string(), errno_text(errno)));
  if (created) fsync_dir(dir.parent_path());
}

// What a checkpoint directory holds: the job record, manifests, window directories w<N> (a checkpoint whose job record
// and manifests are gone) and *.tmp files of writes cut short (a start interrupted before its job record was in place).
bool is_checkpoint_entry(const std::string& name) {
  static const std::regex window_dir(R"(w\d+)");  // a window's segments
  return name == kJobFile || name.starts_with("MANIFEST-") || std::regex_match(name, window_dir) ||
         name.ends_with(".tmp");
}

// Removes the checkpoint entries a directory holds, not the directory: a symbolic link there (a checkpoint kept on
// other storage) still leads where the user put it, and make_private_dir then makes its target private (removing the
// link made a directory in its place: the job's secret went to the output's storage). Anything else stays
// (refuse_foreign_path refused a start over it).
void empty_dir(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;  // absent (refuse_foreign_path refused anything else)
  try {
    for (const auto& entry : fs::directory_iterator(dir))
      if (is_checkpoint_entry(entry.path().filename().string())) fs::remove_all(entry.path());  // a link: the link
  } catch (const fs::filesystem_error& e) {
    throw std::runtime_error(fmt::format("cannot empty {}: {}", dir.string(), e.code().message()));
  }
}

// ---- manifest <-> JSON ----------------------------------------------------------------------

json to_json(const Manifest& m) {
  json segs = json::array();
  for (const auto& s : m.segments)
    segs.push_back({{"seq", s.seq},
                    {"rank", s.rank},
                    {"ranks", s.ranks},
                    {"file", s.file},
                    {"bytes", s.bytes},
                    {"xxh3", hex64(s.xxh3)}});
  json j = {{"format", "dpstream-checkpoint-manifest"},
            {"version", kFormatVersion},
            {"written_by", kVersionLine},
            {"seq", m.seq},
            {"job_id", m.job_id},
            {"job_name", m.job_name},
            {"fingerprint", m.fingerprint},
            {"ranks", m.ranks},
            {"window_index", m.window_index},
            {"next_trigger", m.next_trigger},
            {"complete", m.complete},
            {"releases_bytes", m.releases.bytes},
            {"release_rows", m.releases.rows},
            {"staged_bytes", m.staged_bytes},
            {"job_file", {{"bytes", m.job_file_bytes}, {"xxh3", hex64(m.job_file_xxh3)}}},
            {"segments", segs},
            {"counters", m.counters},
            {"privacy", m.privacy},
            {"summary", m.summary}};
  if (m.releases.xxh3) j["releases_xxh3"] = hex64(*m.releases.xxh3);
  return j;
}

// An integer member of a manifest in T's range. Anything else is refused, not converted: a damaged
// or hand-edited manifest may hold any JSON value there (a real number, a negative count).
template <class T>
T integer_at(const json& j, const char* key) {
  const json& v = j.at(key);
  if (v.is_number_unsigned()) {
    if (const auto u = v.get<std::uint64_t>(); std::in_range<T>(u)) return static_cast<T>(u);
  } else if (v.is_number_integer()) {
    if (const auto i = v.get<std::int64_t>(); std::in_range<T>(i)) return static_cast<T>(i);
  }
  throw std::runtime_error(fmt::format(
      "\"{}\" must be an integer in [{}, {}], not {}", key, std::numeric_limits<T>::min(),
      std::numeric_limits<T>::max(), printable(v.dump(-1, ' ', false, json::error_handler_t::replace).substr(0, 40))));
}

Manifest from_json(const json& j) {
  Manifest m;
  m.seq = integer_at<std::uint64_t>(j, "seq");
  m.job_id = j.at("job_id").get<std::string>();
  m.job_name = j.at("job_name").get<std::string>();
  m.fingerprint = j.at("fingerprint").get<std::string>();
  m.ranks = integer_at<int>(j, "ranks");
  m.window_index = integer_at<std::uint32_t>(j, "window_index");
  m.next_trigger = integer_at<std::uint32_t>(j, "next_trigger");
  m.complete = j.at("complete").get<bool>();
  m.releases.bytes = integer_at<std::uint64_t>(j, "releases_bytes");
  m.releases.rows = integer_at<std::uint64_t>(j, "release_rows");
  if (j.contains("releases_xxh3")) m.releases.xxh3 = std::stoull(j.at("releases_xxh3").get<std::string>(), nullptr, 16);
  m.staged_bytes = integer_at<std::uint64_t>(j, "staged_bytes");
  m.job_file_bytes = integer_at<std::uint64_t>(j.at("job_file"), "bytes");
  m.job_file_xxh3 = std::stoull(j.at("job_file").at("xxh3").get<std::string>(), nullptr, 16);
  // Segment files are named as commit() names them: never a path outside the checkpoint directory.
  static const std::regex segment_file(R"(w\d+/s\d{6,}-r\d{4,}\.h5)");
  for (const auto& s : j.at("segments")) {
    m.segments.push_back({integer_at<std::uint64_t>(s, "seq"), integer_at<int>(s, "rank"),
                          s.contains("ranks") ? integer_at<int>(s, "ranks") : m.ranks, s.at("file").get<std::string>(),
                          integer_at<std::uint64_t>(s, "bytes"),
                          std::stoull(s.at("xxh3").get<std::string>(), nullptr, 16)});
    if (!std::regex_match(m.segments.back().file, segment_file))
      throw std::runtime_error(fmt::format("segment file \"{}\" is not of the form w<window>/s<commit>-r<rank>.h5",
                                           printable(m.segments.back().file.substr(0, 80))));
  }
  // Counters are sums carried over a resume; the ledger and the summary are objects.
  m.counters = j.at("counters");
  if (!m.counters.is_object()) throw std::runtime_error("\"counters\" must be an object");
  for (const auto& [name, value] : m.counters.items())
    if (!value.is_number_unsigned())
      throw std::runtime_error(
          fmt::format("counter \"{}\" must be a non-negative integer", printable(name.substr(0, 40))));
  m.privacy = j.at("privacy");
  if (!m.privacy.is_object()) throw std::runtime_error("\"privacy\" must be an object");
  m.summary = j.contains("summary") ? j.at("summary") : json(nullptr);
  if (!m.summary.is_null() && !m.summary.is_object()) throw std::runtime_error("\"summary\" must be an object or null");
  return m;
}

// The manifest text carries the XXH3 of its own content without the "checksum" member.
std::string manifest_text(const Manifest& m) {
  json j = to_json(m);
  j["checksum"] = hex64(XXH3_64bits(j.dump().data(), j.dump().size()));
  return j.dump(1) + "\n";
}

}  // namespace

bool read_manifest(const fs::path& path, Manifest& out, std::string& why) {
  try {
    const auto bytes = read_file_bytes(path);
    json j = parse_bounded_json({reinterpret_cast<const char*>(bytes.data()), bytes.size()});
    const std::string stated = j.at("checksum").get<std::string>();
    j.erase("checksum");
    const std::string text = j.dump();
    if (stated != hex64(XXH3_64bits(text.data(), text.size()))) {
      why = fmt::format("{} is damaged (checksum mismatch)", path.filename().string());
      return false;
    }
    if (j.at("format") != "dpstream-checkpoint-manifest" || integer_at<std::uint64_t>(j, "version") != kFormatVersion) {
      why = fmt::format("{} is not a dpstream checkpoint manifest of format version {}", path.filename().string(),
                        kFormatVersion);
      return false;
    }
    out = from_json(j);
    return true;
  } catch (const std::exception& e) {
    why = fmt::format("{} is damaged or unreadable ({})", path.filename().string(), printable(e.what()));
    return false;
  }
}

namespace {

// MANIFEST-<seq>.json files, newest first.
std::vector<std::pair<std::uint64_t, fs::path>> list_manifests(const fs::path& dir) {
  std::vector<std::pair<std::uint64_t, fs::path>> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  static const std::regex name(R"(MANIFEST-(\d{6,})\.json)");
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::smatch m;
    const std::string f = e.path().filename().string();
    if (std::regex_match(f, m, name)) out.emplace_back(std::stoull(m[1].str()), e.path());
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

// A fresh start empties the checkpoint directory: refuses a path there that dpstream did not make (a file of that
// name, or a directory holding anything but checkpoint entries, also beside a checkpoint: a link may lead to a
// directory the user shares with other data), so that no user file is deleted. A resume deletes nothing: it only
// needs a directory.
void refuse_foreign_path(const fs::path& dir, bool emptied) {
  std::error_code ec;
  const fs::file_status status = fs::status(dir, ec);  // a link to a directory is used as one
  if (!fs::exists(status)) return;
  if (!fs::is_directory(status))
    throw CheckpointError(
        fmt::format("{} is not a directory: dpstream keeps its checkpoint there and would replace "
                    "it; move the file, or choose another --out",
                    dir.string()));
  if (!emptied) return;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (const std::string name = e.path().filename().string(); !is_checkpoint_entry(name))
      throw CheckpointError(
          fmt::format("{} holds files dpstream did not write ({} among them): starting would delete them; move "
                      "them, or choose another --out",
                      dir.string(), printable(name)));
}

// ---- job file ---------------------------------------------------------------------------------

std::vector<std::byte> encode_job(const JobRecord& job) {
  h5::MemoryFile f;
  h5::write_attribute(f.get(), "format", kJobFormat);
  h5::write_attribute(f.get(), "version", kFormatVersion);
  h5::write_attribute(f.get(), "job_id", job.job_id);
  h5::write_attribute(f.get(), "job_name", job.job_name);
  h5::write_attribute(f.get(), "started_at", job.started_at);
  h5::write_attribute(f.get(), "fields", json(job.fields).dump());
  if (job.secret) {
    std::vector<std::uint8_t> s(job.secret->begin(), job.secret->end());
    h5::write_dataset(f.get(), "secret", s);
    OPENSSL_cleanse(s.data(), s.size());
  }
  return f.image();
}

}  // namespace

JobRecord read_job(const fs::path& path, const Manifest* expected) {
  std::error_code ec;
  if (!fs::exists(path, ec))
    throw CheckpointError(
        fmt::format("{} is missing: the checkpoint cannot be used; start over with --fresh", path.string()));
  JobRecord job;
  try {
    auto bytes = read_file_bytes(path);
    job.bytes = bytes.size();
    job.xxh3 = xxh3(bytes);
    if (expected && (job.bytes != expected->job_file_bytes || job.xxh3 != expected->job_file_xxh3)) {
      OPENSSL_cleanse(bytes.data(), bytes.size());
      throw CheckpointError(
          fmt::format("{} does not match its size and checksum in commit {}'s manifest ({} of {} bytes): "
                      "it is damaged; start over with --fresh",
                      path.string(), expected->seq, job.bytes, expected->job_file_bytes));
    }
    h5::MemoryFile f(bytes);
    OPENSSL_cleanse(bytes.data(), bytes.size());  // holds the secret
    if (h5::read_string_attribute(f.get(), "format") != kJobFormat) throw std::runtime_error("not a dpstream job file");
    if (h5::read_uint_attribute(f.get(), "version") != kFormatVersion)
      throw std::runtime_error("unknown format version");
    job.job_id = h5::read_string_attribute(f.get(), "job_id");
    job.job_name = h5::read_string_attribute(f.get(), "job_name");
    job.started_at = h5::read_string_attribute(f.get(), "started_at");
    job.fields = json::parse(h5::read_string_attribute(f.get(), "fields")).get<Fields>();
    if (h5::exists(f.get(), "secret")) {
      auto s = h5::read_dataset<std::uint8_t>(f.get(), "secret");
      if (s.size() != 32) throw std::runtime_error("the secret is not 32 bytes");
      job.secret.emplace();
      std::copy(s.begin(), s.end(), job.secret->begin());
      OPENSSL_cleanse(s.data(), s.size());
    }
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    throw CheckpointError(
        fmt::format("{} is damaged or not a dpstream job file ({}): the checkpoint cannot be used; "
                    "start over with --fresh",
                    path.string(), e.what()));
  }
  return job;
}

namespace {

std::string now_utc() {
  const auto t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string random_job_id() {
  unsigned char b[16];
  if (RAND_bytes(b, sizeof b) != 1) throw std::runtime_error("cannot draw a job id (OpenSSL RAND_bytes failed)");
  std::string s;
  for (unsigned char c : b) s += fmt::format("{:02x}", c);
  return s;
}

// ---- segments ---------------------------------------------------------------------------------

struct SegmentHeader {
  std::string job_id;
  std::uint64_t seq;
  int rank, ranks;
  std::uint32_t window_index, first_trigger, next_trigger;
};

// Every column of a segment with its dataset name, for reading a file and for Journal::to_segment
// (the writer names the same columns in for_each_column; the Store test reads written files back).
template <class F>
void visit_columns(Segment& s, F&& f) {
  f("users/id", s.user_id);
  f("users/kept", s.user_kept);
  f("pairs/user", s.pair_user);
  f("pairs/key_fingerprint", s.pair_fingerprint);
  f("keys/id", s.key_id);
  f("keys/count", s.key_count);
  f("keys/sum_low", s.key_sum_low);
  f("keys/sum_high", s.key_sum_high);
  f("keys/users", s.key_users);
  f("keys/round_base_users", s.key_round_base_users);
  f("keys/round", s.key_round);
  f("keys/round_start", s.key_round_start);
  f("first_tests/key", s.first_test_key);
  f("first_tests/round", s.first_test_round);
  f("first_tests/step", s.first_test_step);
}

// The columns of a journal's tables, one at a time, in the order the segment lists them: users and
// pairs in shard order; keys in shard order, a shard's count-only keys before its full ones.
template <class T, class Field>
std::vector<T> user_column(const std::vector<std::vector<std::pair<std::uint64_t, std::uint32_t>>>& shards,
                           Field field) {
  std::size_t n = 0;
  for (const auto& shard : shards) n += shard.size();
  std::vector<T> out;
  out.reserve(n);
  for (const auto& shard : shards)
    for (const auto& entry : shard) out.push_back(field(entry));
  return out;
}
template <class T, class Field>  // field(const KeyState&) -> T, and the key id from `id`
std::vector<T> key_column(const Journal& j, Field field) {
  std::size_t n = 0;
  for (std::size_t s = 0; s < j.count_keys.size(); ++s) n += j.count_keys[s].size() + j.full_keys[s].size();
  std::vector<T> out;
  out.reserve(n);
  for (std::size_t s = 0; s < j.count_keys.size(); ++s) {
    for (const auto& k : j.count_keys[s]) {
      kernels::KeyState st;
      st.count = k.count;
      st.users = k.users;
      out.push_back(field(k.id, st));
    }
    for (const auto& [id, st] : j.full_keys[s]) out.push_back(field(id, st));
  }
  return out;
}

// Calls put(name, column) for every column of the journal's segment, gathering each just before;
// `done(table)` after the last column of a table ("users", "pairs", "keys").
template <class Put, class Done>
void for_each_column(const Journal& j, Put&& put, Done&& done) {
  using KS = kernels::KeyState;
  using Entry = std::pair<std::uint64_t, std::uint32_t>;
  put("users/id", user_column<std::uint64_t>(j.changed_users, [](const Entry& e) { return e.first; }));
  put("users/kept", user_column<std::uint32_t>(j.changed_users, [](const Entry& e) { return e.second; }));
  done("users");
  put("pairs/user", user_column<std::uint64_t>(j.new_pairs, [](const Entry& e) { return e.first; }));
  put("pairs/key_fingerprint", user_column<std::uint32_t>(j.new_pairs, [](const Entry& e) { return e.second; }));
  done("pairs");
  put("keys/id", key_column<std::uint64_t>(j, [](std::uint64_t id, const KS&) { return id; }));
  put("keys/count", key_column<std::int64_t>(j, [](std::uint64_t, const KS& st) { return st.count; }));
  put("keys/sum_low", key_column<std::uint64_t>(j, [](std::uint64_t, const KS& st) { return st.sum.low; }));
  put("keys/sum_high", key_column<std::int64_t>(j, [](std::uint64_t, const KS& st) { return st.sum.high; }));
  put("keys/users", key_column<std::int64_t>(j, [](std::uint64_t, const KS& st) { return st.users; }));
  put("keys/round_base_users",
      key_column<std::int64_t>(j, [](std::uint64_t, const KS& st) { return st.round_base_users; }));
  put("keys/round", key_column<std::uint32_t>(j, [](std::uint64_t, const KS& st) { return st.round; }));
  put("keys/round_start", key_column<std::uint32_t>(j, [](std::uint64_t, const KS& st) { return st.round_start; }));
  done("keys");
  const auto first_test_column = [&j](auto field) {
    std::vector<decltype(field(j.first_tests.front()))> out;
    out.reserve(j.first_tests.size());
    for (const auto& t : j.first_tests) out.push_back(field(t));
    return out;
  };
  put("first_tests/key", first_test_column([](const kernels::FirstTest& t) { return t.key; }));
  put("first_tests/round", first_test_column([](const kernels::FirstTest& t) { return t.round; }));
  put("first_tests/step", first_test_column([](const kernels::FirstTest& t) { return t.step; }));
  done("first_tests");
}

// Writes a journal's segment into an open HDF5 file, a column at a time, freeing each table of the
// journal once written: a segment may hold gigabytes, so it is never whole in memory. Returns the
// seconds spent gathering columns. `fault_half`: a fault point halfway (tests).
double write_segment_tables(hid_t root, Journal& j, const std::string& rows, const SegmentHeader& h,
                            const char* fault_half) {
  h5::write_attribute(root, "format", kSegmentFormat);
  h5::write_attribute(root, "version", kFormatVersion);
  h5::write_attribute(root, "job_id", h.job_id);
  h5::write_attribute(root, "seq", h.seq);
  h5::write_attribute(root, "rank", static_cast<std::uint64_t>(h.rank));
  h5::write_attribute(root, "ranks", static_cast<std::uint64_t>(h.ranks));
  h5::write_attribute(root, "window_index", h.window_index);
  h5::write_attribute(root, "first_trigger", h.first_trigger);
  h5::write_attribute(root, "next_trigger", h.next_trigger);
  for (const char* g : {"users", "pairs", "keys", "first_tests", "releases"}) h5::create_group(root, g);
  double gather_seconds = 0;
  auto t = std::chrono::steady_clock::now();
  for_each_column(
      j,
      [&](const char* name, auto column) {
        const auto t_write = std::chrono::steady_clock::now();
        gather_seconds += std::chrono::duration<double>(t_write - t).count();
        h5::write_narrowest_dataset(root, name, column);  // ids < 2^32 and small counts take 1-4 bytes
        t = std::chrono::steady_clock::now();
      },
      [&](const std::string& table) {
        if (table == "users") decltype(j.changed_users)().swap(j.changed_users);
        if (table == "pairs") {
          decltype(j.new_pairs)().swap(j.new_pairs);
          if (fault_half) fault::point(fault_half);
        }
        if (table == "keys") {
          decltype(j.count_keys)().swap(j.count_keys);
          decltype(j.full_keys)().swap(j.full_keys);
        }
        if (table == "first_tests") decltype(j.first_tests)().swap(j.first_tests);
      });
  h5::write_dataset_raw(root, "releases/csv", H5T_NATIVE_UINT8, rows.data(), rows.size());
  return gather_seconds;
}

Segment read_segment_tables(hid_t root, const SegmentRef& ref, const std::string& job_id) {
  if (h5::read_string_attribute(root, "format") != kSegmentFormat ||
      h5::read_uint_attribute(root, "version") != kFormatVersion)
    throw std::runtime_error("not a dpstream checkpoint segment of this format version");
  if (h5::read_string_attribute(root, "job_id") != job_id) throw std::runtime_error("it belongs to another job");
  if (h5::read_uint_attribute(root, "seq") != ref.seq ||
      h5::read_uint_attribute(root, "rank") != static_cast<std::uint64_t>(ref.rank) ||
      h5::read_uint_attribute(root, "ranks") != static_cast<std::uint64_t>(ref.ranks))
    throw std::runtime_error("its commit number, rank or rank count differs from the manifest's");
  Segment s;
  const auto trigger_attribute = [root](const char* name) {
    const std::uint64_t v = h5::read_uint_attribute(root, name);
    if (v > std::numeric_limits<std::uint32_t>::max())
      throw std::runtime_error(fmt::format("its {} ({}) is beyond 2^32 - 1", name, v));
    return static_cast<std::uint32_t>(v);
  };
  s.window_index = trigger_attribute("window_index");
  s.first_trigger = trigger_attribute("first_trigger");
  s.next_trigger = trigger_attribute("next_trigger");
  if (s.first_trigger > s.next_trigger)
    throw std::runtime_error(fmt::format("its triggers [{}, {}) run backwards", s.first_trigger, s.next_trigger));
  visit_columns(s, [root](const char* name, auto& column) {
    column = h5::read_dataset<typename std::decay_t<decltype(column)>::value_type>(root, name);
  });
  s.releases_csv.resize(h5::dataset_size(root, "releases/csv"));
  h5::read_dataset_raw(root, "releases/csv", H5T_NATIVE_UINT8, s.releases_csv.data(), s.releases_csv.size());
  const std::size_t nu = s.user_id.size(), np = s.pair_user.size(), nk = s.key_id.size();
  if (s.user_kept.size() != nu || s.pair_fingerprint.size() != np || s.key_count.size() != nk ||
      s.key_sum_low.size() != nk || s.key_sum_high.size() != nk || s.key_users.size() != nk ||
      s.key_round_base_users.size() != nk || s.key_round.size() != nk || s.key_round_start.size() != nk ||
      s.first_test_round.size() != s.first_test_key.size() || s.first_test_step.size() != s.first_test_key.size())
    throw std::runtime_error("its columns have different lengths");
  for (const std::uint32_t step : s.first_test_step)
    if (step == 0 || step > kernels::banded::kMaxSteps)
      throw std::runtime_error(fmt::format("a key's first test step ({}) is outside [1, 2^20]", step));
  for (const std::uint32_t f : s.pair_fingerprint)
    if (f >> kernels::UserState::kFingerprintBits != 0)
      throw std::runtime_error(
          fmt::format("a key fingerprint ({}) has more than {} bits", f, kernels::UserState::kFingerprintBits));
  return s;
}

}  // namespace

Segment read_segment(const fs::path& dir, const SegmentRef& ref, const std::string& job_id) {
  const fs::path path = dir / ref.file;
  std::error_code ec;
  if (!fs::exists(path, ec))
    throw CheckpointError(
        fmt::format("checkpoint file {} is missing; it is part of the committed state, so the "
                    "checkpoint cannot be used: restore the file or start over with --fresh",
                    path.string()));
  FileDigest d;
  try {
    d = digest_file(path);
  } catch (const std::exception& e) {
    throw CheckpointError(
        fmt::format("checkpoint file {} cannot be read ({}); start over with --fresh", path.string(), e.what()));
  }
  if (d.bytes != ref.bytes || d.xxh3 != ref.xxh3)
    throw CheckpointError(
        fmt::format("checkpoint file {} is truncated or corrupted (size {} of {} bytes, checksum {} "
                    "where the manifest says {}); it is part of the committed state, so the checkpoint "
                    "cannot be used: restore the file or start over with --fresh",
                    path.string(), d.bytes, ref.bytes, hex64(d.xxh3), hex64(ref.xxh3)));
  try {  // checked before HDF5 parses a byte of it
    h5::DiskFile f(path.string(), h5::DiskFile::Mode::Read);
    return read_segment_tables(f.get(), ref, job_id);
  } catch (const std::exception& e) {
    throw CheckpointError(
        fmt::format("checkpoint file {} cannot be used: {}; start over with --fresh", path.string(), e.what()));
  }
}

namespace {

// Why the commit `m` is unusable ("" when usable): its own segments must be intact, older ones present.
std::string check_commit(const fs::path& dir, const Manifest& m) {
  for (const auto& ref : m.segments) {
    const fs::path path = dir / ref.file;
    std::error_code ec;
    const auto size = fs::file_size(path, ec);
    if (ec) return fmt::format("checkpoint file {} is missing", ref.file);
    if (size != ref.bytes)
      return fmt::format("checkpoint file {} is truncated or damaged ({} of {} bytes; checksum cannot match)", ref.file,
                         size, ref.bytes);
    if (ref.seq == m.seq) {
      try {
        if (digest_file(path).xxh3 != ref.xxh3)
          return fmt::format("checkpoint file {} is corrupted (checksum mismatch)", ref.file);
      } catch (const std::exception& e) {
        return e.what();
      }
    }
  }
  return "";
}

// The manifest's log against its segments. The manifest is checksummed, but one edited with its checksum made to
// match must still not skip a commit's state or replay triggers (a rank's kept counts or (user, key) pairs lost would
// let its users contribute again). The list: commits in ascending order, each naming ranks 0..P-1 of one count P once,
// the newest being the manifest's. The segments one rank reads, in that order: the manifest's window, each commit's
// segments one span of triggers, the rank's log covering [0, next_trigger): each span beginning where the one before
// ended, the newest ending at next_trigger (commit, rank and rank count: read_segment).
class SegmentSpans {
 public:
  explicit SegmentSpans(const Manifest& m) : m_(m) { check_list(); }
  // `in_log`: the segment is replayed (the rank's log read from its start), not only read for its staged rows.
  void check(const SegmentRef& ref, const Segment& s, bool in_log) {
    if (s.window_index != m_.window_index)
      refuse(ref, fmt::format("holds window {} where the manifest's log is of window {}", s.window_index + 1,
                              m_.window_index + 1));
    if (ref.seq == m_.seq && s.next_trigger != m_.next_trigger)
      refuse(ref,
             fmt::format("ends at trigger {} where the manifest's commit ends at {}", s.next_trigger, m_.next_trigger));
    if (!in_log) return;
    if (seen_ && ref.seq == seq_) {
      if (s.first_trigger != first_ || s.next_trigger != next_)
        refuse(ref, fmt::format("holds triggers [{}, {}) where its commit's other segments hold [{}, {})",
                                s.first_trigger, s.next_trigger, first_, next_));
      return;
    }
    if (s.first_trigger != next_)
      refuse(ref, fmt::format("begins at trigger {} where the log before it ends at {}", s.first_trigger, next_));
    seen_ = true;
    seq_ = ref.seq;
    first_ = s.first_trigger;
    next_ = s.next_trigger;
  }
  // After a rank read its log: it reached the manifest's commit and trigger.
  void check_log_end() const {
    if (next_ != m_.next_trigger || (seen_ && seq_ != m_.seq))
      throw CheckpointError(
          fmt::format("commit {}'s log ends at trigger {} where its manifest says {}: the manifest "
                      "does not describe its segments; start over with --fresh",
                      m_.seq, next_, m_.next_trigger));
  }

 private:
  void check_list() const {
    const auto& segs = m_.segments;
    const auto bad = [&](const std::string& why) {
      throw CheckpointError(fmt::format(
          "commit {}'s manifest {}: it does not describe its segments; start over with --fresh", m_.seq, why));
    };
    if (m_.seq == 0 ? !segs.empty() : segs.empty() || segs.back().seq != m_.seq)
      bad(fmt::format("lists {} as its newest commit", segs.empty() ? "no segment" : std::to_string(segs.back().seq)));
    if (!segs.empty() && segs.back().ranks != m_.ranks)
      bad(fmt::format("names {} rank(s) but its newest segments {}", m_.ranks, segs.back().ranks));
    for (std::size_t i = 0; i < segs.size();) {  // one commit's segments: ranks 0..P-1 of one count P, in order
      const SegmentRef& first = segs[i];
      if (i > 0 && first.seq <= segs[i - 1].seq)
        bad(fmt::format("lists commit {} after commit {}", first.seq, segs[i - 1].seq));
      for (int r = 0; r < first.ranks; ++r, ++i)
        if (i == segs.size() || segs[i].seq != first.seq || segs[i].ranks != first.ranks || segs[i].rank != r)
          bad(fmt::format("does not list rank {} of {} of commit {} once, in order", r, first.ranks, first.seq));
      if (first.ranks < 1) bad(fmt::format("lists commit {} with {} ranks", first.seq, first.ranks));
    }
  }
  [[noreturn]] static void refuse(const SegmentRef& ref, const std::string& why) {
    throw CheckpointError(
        fmt::format("checkpoint file {} {}: the manifest does not describe its segments; start over "
                    "with --fresh",
                    ref.file, why));
  }
  const Manifest& m_;
  bool seen_ = false;
  std::uint64_t seq_ = 0;
  std::uint32_t first_ = 0, next_ = 0;  // the last commit's span read
};

}  // namespace

// ---- identity ---------------------------------------------------------------------------------

namespace {

// The synthetic stream's Zipf-Mandelbrot samplers that take the rescaled form (src/zipf.hpp): for the same parameters
// a binary without that form drew another stream, so a checkpoint records it (empty when neither does: the identity
// of every job that uses the original form is unchanged).
std::string rescaled_samplers(const JobConfig& c) {
  if (c.input.kind != InputKind::Synthetic) return "";
  std::string forms;
  if (ZipfMandelbrot(c.input.records_per_user_min, c.input.records_per_user_max, c.input.records_per_user_q,
                     c.input.records_per_user_s)
          .rescaled())
    forms = "records_per_user rescaled";
  if (c.input.key_distribution == KeyDistribution::ZipfMandelbrot &&
      ZipfMandelbrot(1, c.input.keys, c.input.key_q, c.input.key_s).rescaled())
    forms += forms.empty() ? "keys rescaled" : ", keys rescaled";
  return forms;
}

}  // namespace

Fields identity_fields(const JobConfig& c, const std::string& input_digest) {
  Fields f;
  // The engine's own output-defining choices (noise generator and sampler, fixed-point grid,
  // checkpoint format): a binary that changes them must not resume an older job's checkpoint.
  f["engine.mechanism"] =
      "noise AES-256-CTR/HMAC-SHA256 + discrete Gaussian by 192-bit inverse CDF (sigma <= 4096) or CKS20, values "
      "2^-20, checkpoint v1, CSV ids SipHash-2-4-128 separated";
  for (const auto& field : job_spec_fields())  // the spec's output-defining keys (src/config.cpp)
    if (in_identity(field, c)) f[std::string(field.name)] = field.identity(c);
  if (f.count("privacy.counter_band")) {  // banded counters: their sampler and the band define the noise
    // The band and its norm as this binary computes them: a build whose search or long double differs
    // (another architecture, FMA contraction) must not resume with another factorization.
    const auto band = kernels::banded::optimized_band(c.stream.triggers, c.privacy.counter_band);
    std::string numerators;
    for (const std::int64_t m : band) numerators += (numerators.empty() ? "" : ",") + std::to_string(m);
    f["engine.banded_band"] = fmt::format("{}; ||C e_1||^2 = {:a}", numerators,
                                          kernels::banded::sensitivity_squared(band, c.stream.triggers));
    f["engine.banded_mechanism"] =
        "normal by a 2^-7 cell table (192-bit) and exact in-cell rejection, 56 kept bits, first attempt laid out in "
        "two blocks (cell; U 49, V 14, sign; U 15; V 50); band by Hooke-Jeeves "
        "search v2 (steps to 2^-16, horizon <= 1024) on the 2^-30 grid; sigma on the 2^-32 grid";
  }
  // Not spec keys, but they define the output too.
  if (c.input.kind == InputKind::Csv) f["input.content"] = input_digest;  // the file's content, wherever it lives
  if (const std::string forms = rescaled_samplers(c); !forms.empty()) f["input.zipf_form"] = forms;
  f["stream.windows_from_input"] = c.stream.windows_from_input ? "yes" : "no";  // then the content fixes them
  return f;
}

std::string fingerprint(const Fields& fields) {
  std::string text;
  for (const auto& [k, v] : fields) text.append(k).append("=").append(v).append("\n");
  const XXH128_hash_t h = XXH3_128bits(text.data(), text.size());
  return fmt::format("{:016x}{:016x}", h.high64, h.low64);
}

std::string file_digest(const std::string& path) {
  const MappedFile file(path);
  const auto data = file.view();
  return fmt::format("{} bytes, xxh3 {}", data.size(), hex64(XXH3_64bits(data.data(), data.size())));
}

// ---- journal <-> state ------------------------------------------------------------------------

Journal drain_journal(kernels::UserState& users, kernels::KeyStateTable& keys,
                      std::vector<kernels::FirstTest> first_tests) {
  Journal j;
  j.first_tests = std::move(first_tests);
  j.changed_users.resize(kernels::UserState::kShards);
  j.new_pairs.resize(kernels::UserState::kShards);
#pragma omp parallel for schedule(dynamic, 8)
  for (std::size_t s = 0; s < kernels::UserState::kShards; ++s)
    users.drain_journal(s, j.changed_users[s], j.new_pairs[s]);
  constexpr std::size_t S = kernels::KeyStateTable::kShards;
  j.count_keys.resize(S);
  j.full_keys.resize(S);
  constexpr std::int64_t kMax32 = std::numeric_limits<std::uint32_t>::max();
#pragma omp parallel for schedule(dynamic, 8)
  for (std::size_t s = 0; s < S; ++s) {
    const std::size_t changed = keys.changed_keys(s);
    // Room for every key in the kind almost all of them take (estimate_journal counts the same).
    if (keys.tracks_sums()) {
      j.full_keys[s].reserve(changed);
    } else {
      j.count_keys[s].reserve(changed);
      j.full_keys[s].reserve(std::min(changed, keys.full_state_keys(s)));
    }
    keys.drain_changed(s, [&](std::uint64_t k, const kernels::KeyState& st) {
      if (int128(st.sum) == 0 && st.round_base_users == 0 && st.round == 0 && st.round_start == 0 && st.count >= 0 &&
          st.count <= kMax32 && st.users >= 0 && st.users <= kMax32)
        j.count_keys[s].push_back({k, static_cast<std::uint32_t>(st.count), static_cast<std::uint32_t>(st.users)});
      else
        j.full_keys[s].emplace_back(k, st);
    });
  }
  return j;
}

namespace {
// What drain_journal's key snapshots will hold: with sums, every key in full (reserved) and, for keys
// whose sum is zero, a 16-byte entry in a vector grown by doubling (at most twice its size); without,
// 16 bytes per key and the full state for at most as many as the shard keeps in full.
std::uint64_t estimate_key_journal(const kernels::KeyStateTable& keys) {
  constexpr std::uint64_t kCount = sizeof(Journal::CountKey);
  constexpr std::uint64_t kFull = sizeof(std::pair<std::uint64_t, kernels::KeyState>);
  std::uint64_t bytes = 0;
  for (std::size_t s = 0; s < kernels::KeyStateTable::kShards; ++s) {
    const std::uint64_t entries = keys.changed_keys(s);
    bytes += keys.tracks_sums() ? entries * (kFull + 2 * kCount)
                                : entries * kCount + std::min<std::uint64_t>(entries, keys.full_state_keys(s)) * kFull;
  }
  return bytes;
}
}  // namespace

JournalEstimate estimate_journal(const kernels::UserState& users, const kernels::KeyStateTable& keys) {
  using UserEntry = kernels::UserState::UserFingerprint;  // changed_users and new_pairs hold these
  const auto u = users.journal_size();
  return {(u.changed_users + u.new_pairs) * sizeof(UserEntry), estimate_key_journal(keys)};
}

std::uint64_t Journal::user_bytes() const {
  std::uint64_t b = 0;
  for (const auto& shard : changed_users) b += shard.size() * Segment::kKeptBytes;
  for (const auto& shard : new_pairs) b += shard.size() * Segment::kPairBytes;
  return b;
}

std::uint64_t Journal::key_bytes() const {
  std::uint64_t b = 0;
  for (std::size_t s = 0; s < count_keys.size(); ++s)
    b += (count_keys[s].size() + full_keys[s].size()) * Segment::kKeyBytes;
  return b + first_tests.size() * Segment::kFirstTestBytes;
}

std::uint64_t Journal::memory_bytes() const {
  std::uint64_t b = 0;
  for (const auto& shard : changed_users) b += shard.capacity() * sizeof(shard[0]);
  for (const auto& shard : new_pairs) b += shard.capacity() * sizeof(shard[0]);
  for (const auto& shard : count_keys) b += shard.capacity() * sizeof(CountKey);
  for (const auto& shard : full_keys) b += shard.capacity() * sizeof(shard[0]);
  return b + first_tests.capacity() * sizeof(kernels::FirstTest);
}

Segment Journal::to_segment() const {
  Segment seg;
  for_each_column(
      *this,
      [&seg](const char* name, auto column) {
        using Column = decltype(column);  // named out here: g++ 12 misjudges it inside the inner lambda
        visit_columns(seg, [&](const char* n, auto& target) {
          if constexpr (std::is_same_v<std::decay_t<decltype(target)>, Column>)
            if (std::strcmp(n, name) == 0) target = std::move(column);
        });
      },
      [](const std::string&) {});
  return seg;
}

void apply(const Segment& seg, kernels::UserState& users, kernels::KeyStateTable& keys, int rank, int ranks,
           bool filter, std::vector<kernels::FirstTest>* first_tests) {
  using kernels::UserState;
  using partition::kKeySalt;
  using partition::owner_rank;
  using partition::salted_hash;
  using partition::user_owner;
  for (std::size_t i = 0; i < seg.user_id.size(); ++i) {
    if (filter && user_owner(seg.user_id[i], ranks) != rank) continue;
    const std::size_t shard = UserState::shard_of(seg.user_id[i]);
    users.set_kept(shard, users.find_or_add(shard, seg.user_id[i]).first, seg.user_kept[i]);
  }
  for (std::size_t i = 0; i < seg.pair_user.size(); ++i) {
    if (filter && user_owner(seg.pair_user[i], ranks) != rank) continue;
    const std::size_t shard = UserState::shard_of(seg.pair_user[i]);
    auto user = users.find_or_add(shard, seg.pair_user[i]).first;
    users.add_pair(shard, seg.pair_user[i], user, seg.pair_fingerprint[i]);
  }
  for (std::size_t i = 0; i < seg.key_id.size(); ++i) {
    const std::uint64_t h = salted_hash(seg.key_id[i], kKeySalt);
    if (filter && owner_rank(h, ranks) != rank) continue;
    kernels::KeyState st;
    st.count = seg.key_count[i];
    st.sum = from_words(seg.key_sum_low[i], seg.key_sum_high[i]);
    st.users = seg.key_users[i];
    st.round_base_users = seg.key_round_base_users[i];
    st.round = seg.key_round[i];
    st.round_start = seg.key_round_start[i];
    keys.put(seg.key_id[i], st);
  }
  for (std::size_t i = 0; first_tests && i < seg.first_test_key.size(); ++i) {
    if (filter && owner_rank(salted_hash(seg.first_test_key[i], kKeySalt), ranks) != rank) continue;
    first_tests->push_back({seg.first_test_key[i], seg.first_test_round[i], seg.first_test_step[i]});
  }
}

// ---- the store --------------------------------------------------------------------------------

Store::Store(fs::path dir, const shuffle::Comm& comm) : dir_(std::move(dir)), comm_(comm) {}

Store::~Store() {
  if (io_.valid()) io_.wait();
}

Opened Store::open(const std::string& job_name, const Fields& fields, StartMode mode) {
  std::string payload;
  shuffle::on_all_ranks<CheckpointError>(comm_, [&] {
    if (comm_.rank() != 0) return;
    const Opened o = open_on_root(job_name, fields, mode);
    // Notes may quote bytes of a damaged file: invalid UTF-8 is replaced, not fatal.
    payload = json{{"kind", static_cast<int>(o.kind)}, {"notes", o.notes}, {"manifest", to_json(latest_)}}.dump(
        -1, ' ', false, json::error_handler_t::replace);
  });
  shuffle::broadcast_string(comm_, payload);
  const json j = json::parse(payload);
  latest_ = from_json(j.at("manifest"));
  visible_ = latest_;
  visible_prev_ = Manifest{};
  pending_ = false;
  Opened o;
  o.kind = static_cast<Opened::Kind>(j.at("kind").get<int>());
  o.notes = j.at("notes").get<std::vector<std::string>>();
  return o;
}

Opened Store::open_on_root(const std::string& job_name, const Fields& fields, StartMode mode) {
  Opened o;
  refuse_foreign_path(dir_, mode != StartMode::Resume);
  const auto manifests = list_manifests(dir_);
  if (mode == StartMode::Fresh) return o;
  if (manifests.empty()) {
    if (mode == StartMode::Resume)
      throw CheckpointError(
          fmt::format("no checkpoint to resume in {} (no MANIFEST-*.json): run without --resume to "
                      "start the job",
                      dir_.string()));
    return o;
  }
  if (mode == StartMode::Start) {
    Manifest newest;
    std::string why;
    if (!read_manifest(manifests.front().second, newest, why))
      throw CheckpointError(
          fmt::format("{} holds a checkpoint whose newest manifest is unusable ({}): pass --resume to "
                      "continue from the last good commit, or --fresh to discard it and start over",
                      dir_.string(), why));
    if (newest.complete) {  // a finished job's output is simply replaced: a private one's, with a word about it
      if (newest.privacy.contains("epsilon_per_window") && newest.privacy.value("private", true))
        o.notes.push_back(fmt::format(
            "warning: {} holds the finished private job '{}': this run replaces its release by a new one, and "
            "releasing the same windows again spends their privacy budget again (a [privacy] ledger charges it)",
            dir_.parent_path().string(), printable(newest.job_name)));
      return o;
    }
    throw CheckpointError(
        fmt::format("{} holds an unfinished checkpoint of job '{}' (commit {}: window {}, {} trigger(s) "
                    "committed): pass --resume to continue it, or --fresh to discard it and start over",
                    dir_.string(), newest.job_name, newest.seq, newest.window_index + 1, newest.next_trigger));
  }

  // Resume: the job record first (identity), then the newest usable commit. The job file is parsed
  // only once the newest readable manifest vouches for its bytes: HDF5 never reads a damaged file.
  std::vector<std::string> reasons;
  const Manifest* vouching = nullptr;
  Manifest newest_readable;
  for (const auto& [seq, path] : manifests) {
    std::string why;
    if (read_manifest(path, newest_readable, why)) {
      vouching = &newest_readable;
      break;
    }
    reasons.push_back(why);
  }
  if (!vouching)
    throw CheckpointError(
        fmt::format("the checkpoint in {} cannot be used: {}; restore the file or start over with --fresh",
                    dir_.string(), fmt::join(reasons, "; ")));
  reasons.clear();
  const JobRecord job = read_job(dir_ / kJobFile, vouching);
  if (job.job_name != job_name)
    throw CheckpointError(
        fmt::format("the checkpoint in {} belongs to another job ('{}', started {}), not '{}': choose "
                    "another --out, or pass --fresh to discard it",
                    dir_.string(), job.job_name, job.started_at, job_name));
  // The spec's keys first, what the engine derives from them after (engine.banded_band follows stream.triggers),
  // long values cut: the user changes the former.
  std::vector<std::string> changed, derived;
  const auto spec_keys = job_spec_fields();
  const auto note = [&](const std::string& key, std::string change) {
    const bool spec_key = std::any_of(spec_keys.begin(), spec_keys.end(), [&](const auto& f) { return f.name == key; });
    (spec_key || !key.starts_with("engine.") ? changed : derived).push_back(key + " (" + std::move(change) + ")");
  };
  const auto cut = [](const std::string& v) { return v.size() > 60 ? v.substr(0, 57) + "..." : v; };
  for (const auto& [k, v] : fields) {
    const auto it = job.fields.find(k);
    if (it == job.fields.end())
      note(k, "now " + cut(v));
    else if (it->second != v)
      note(k, cut(it->second) + " -> " + cut(v));
  }
  for (const auto& [k, v] : job.fields)
    if (!fields.count(k)) note(k, "was " + cut(v));
  for (std::string& d : derived) changed.push_back(std::move(d) + ", derived from the spec");
  if (!changed.empty())
    throw CheckpointError(
        fmt::format("the job spec changed since the checkpoint in {} was written: {}; resume with the "
                    "original spec, or pass --fresh to start over",
                    dir_.string(), fmt::join(changed, ", ")));

  for (const auto& [seq, path] : manifests) {
    Manifest m;
    std::string why;
    if (!read_manifest(path, m, why)) {
      reasons.push_back(why);
      continue;
    }
    if (m.job_id != job.job_id || m.fingerprint != fingerprint(job.fields))
      throw CheckpointError(
          fmt::format("{} belongs to another job than {}/{} (job id {} vs {}): the directory mixes "
                      "files of two jobs; start over with --fresh",
                      path.string(), dir_.string(), kJobFile, m.job_id, job.job_id));
    if (m.job_file_bytes != job.bytes || m.job_file_xxh3 != job.xxh3)
      throw CheckpointError(
          fmt::format("{}/{} does not match its checksum in {}: it is damaged; start over with --fresh", dir_.string(),
                      kJobFile, path.filename().string()));
    why = check_commit(dir_, m);
    if (!why.empty()) {
      reasons.push_back(fmt::format("commit {}: {}", m.seq, why));
      continue;
    }
    if (!reasons.empty())
      o.notes.push_back(
          fmt::format("warning: the latest checkpoint is damaged ({}); falling back to the previous "
                      "committed checkpoint (commit {}: window {}, {} trigger(s) committed)",
                      fmt::join(reasons, "; "), m.seq, m.window_index + 1, m.next_trigger));
    latest_ = std::move(m);
    o.kind = latest_.complete ? Opened::Kind::Complete : Opened::Kind::Resume;
    return o;
  }
  throw CheckpointError(
      fmt::format("the checkpoint in {} cannot be used: {}; restore the file or start over with --fresh", dir_.string(),
                  fmt::join(reasons, "; ")));
}

noise::Secret Store::secret() const {
  noise::Secret s{};
  shuffle::on_all_ranks<CheckpointError>(comm_, [&] {
    if (comm_.rank() != 0) return;
    JobRecord job = read_job(dir_ / kJobFile, &latest_);
    if (!job.secret) throw CheckpointError(fmt::format("{}/{} holds no noise secret", dir_.string(), kJobFile));
    s = *job.secret;
    OPENSSL_cleanse(job.secret->data(), job.secret->size());
  });
  comm_.broadcast(s.data(), s.size());
  return s;
}

std::string Store::load(kernels::UserState& users, kernels::KeyStateTable& keys, bool window_done,
                        std::vector<kernels::FirstTest>* first_tests) {
  const bool root = comm_.rank() == 0;
  std::string staged;
  shuffle::on_all_ranks<CheckpointError>(comm_, [&] {
    SegmentSpans spans(latest_);
    for (const auto& ref : latest_.segments) {
      // A segment written with this rank count holds exactly one rank's users and keys; one written
      // with another count (before a resume that changed it) is read by every rank and filtered. Rank 0
      // reads its segment of the newest commit in any case: it holds the staged rows, and its span is checked
      // (a window's last commit carries no state: a small file).
      const bool same_ranks = ref.ranks == comm_.size();
      const bool holds_staged = root && ref.seq == latest_.seq && ref.rank == 0;
      const bool mine = !window_done && (!same_ranks || ref.rank == comm_.rank());
      if (!mine && !holds_staged) continue;
      Segment seg = read_segment(dir_, ref, latest_.job_id);
      spans.check(ref, seg, mine);
      if (mine) apply(seg, users, keys, comm_.rank(), comm_.size(), !same_ranks, first_tests);
      if (holds_staged) staged = std::move(seg.releases_csv);
    }
    if (!window_done) spans.check_log_end();
    if (root && staged.size() != latest_.staged_bytes)
      throw CheckpointError(
          fmt::format("commit {} should stage {} bytes of release rows but holds {}; start over with --fresh",
                      latest_.seq, latest_.staged_bytes, staged.size()));
  });
  return staged;
}

void Store::remove_temporaries() {
  shuffle::on_all_ranks<CheckpointError>(comm_, [&] {
    if (comm_.rank() != 0) return;
    // Non-throwing steps: the resume is accepted and releases.csv restored; an unreadable entry only stays.
    std::error_code ec;
    for (auto it = fs::recursive_directory_iterator(dir_, ec); !ec && it != fs::recursive_directory_iterator();
         it.increment(ec))
      if (it->path().extension() == ".tmp") {
        std::error_code ignored;
        fs::remove(it->path(), ignored);
      }
  });
}

void Store::begin(const std::string& job_name, const Fields& fields, const noise::Secret* secret) {
  std::string job_id;
  shuffle::on_all_ranks<CheckpointError>(comm_, [&] {
    if (comm_.rank() != 0) return;
    empty_dir(dir_);
    make_private_dir(dir_);
    JobRecord job{random_job_id(), job_name, now_utc(), fields, {}, 0, 0};
    if (secret) job.secret = *secret;
    auto image = encode_job(job);
    write_file_atomically(dir_ / kJobFile, image.data(), image.size(), {.mode = kFileMode});
    latest_ = Manifest{};
    latest_.job_id = job.job_id;
    latest_.job_name = job_name;
    latest_.fingerprint = fingerprint(fields);
    latest_.job_file_bytes = image.size();
    latest_.job_file_xxh3 = xxh3(image);
    OPENSSL_cleanse(image.data(), image.size());
    if (job.secret) OPENSSL_cleanse(job.secret->data(), job.secret->size());
    job_id = job.job_id;
  });
  shuffle::broadcast_string(comm_, job_id);
  latest_.job_id = job_id;
  latest_.ranks = comm_.size();
  visible_ = visible_prev_ = Manifest{};
  pending_ = false;
}

void Store::commit_start(const ReleasesExtent& releases, const json& privacy) {
  shuffle::on_all_ranks<CheckpointError>(comm_, [&] {
    if (comm_.rank() != 0) return;
    latest_.releases = releases;
    latest_.privacy = privacy;
    write_file_atomically(dir_ / manifest_name(0), manifest_text(latest_), {.mode = kFileMode});
    visible_ = latest_;
  });
}

void Store::await_io(CommitStats& stats) {
  auto t0 = std::chrono::steady_clock::now();
  std::string err;
  Written written;
  const bool in_flight = io_.valid();  // false once awaited: the files are known already
  if (in_flight) {
    try {
      written = io_.get();
    } catch (const std::exception& e) {
      err = e.what() + free_space_note(dir_, " and resume with --resume");
    }
  }
  err = comm_.agree_on_error(err);
  if (!err.empty()) throw CheckpointError("writing the checkpoint failed: " + err);
  stats.segment_bytes = written.bytes;
  stats.background_seconds = written.seconds;
  stats.encode_seconds = written.encode_seconds;
  stats.write_seconds = written.write_seconds;
  stats.wait_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!pending_ || !in_flight) return;
  t0 = std::chrono::steady_clock::now();
  std::vector<std::byte> mine(2 * sizeof(std::uint64_t));
  std::memcpy(mine.data(), &written.bytes, sizeof(std::uint64_t));
  std::memcpy(mine.data() + sizeof(std::uint64_t), &written.xxh3, sizeof(std::uint64_t));
  const auto refs = comm_.gather_bytes_to_root(mine);
  if (comm_.rank() == 0) {
    shuffle::ByteReader in(refs.data(), refs.size());
    for (int r = 0; r < comm_.size(); ++r) {
      const auto bytes = in.get<std::uint64_t>();
      const auto hash = in.get<std::uint64_t>();
      latest_.segments.push_back({latest_.seq, r, comm_.size(),
                                  fmt::format("w{}/s{:06}-r{:04}.h5", latest_.window_index, latest_.seq, r), bytes,
                                  hash});
    }
  }
  stats.gather_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Store::make_visible(const Manifest& m, const std::string& rows) {
  write_file_atomically(dir_ / manifest_name(m.seq), manifest_text(m),
                        {.mode = kFileMode, .fault_before_rename = "manifest_before_rename"});
  fault::point("committed");
  visible_prev_ = std::move(visible_);
  visible_ = m;
  if (publish_ && !rows.empty()) publish_(rows);
  fault::point("published");
  collect_garbage();
}

CommitStats Store::commit(std::shared_ptr<Journal> journal, std::string rows, const Position& pos, const json& counters,
                          const ReleasesExtent& releases) {
  CommitStats stats;
  const int rank = comm_.rank(), P = comm_.size();
  const bool root = rank == 0;
  // Every rank's file of the previous commit is durable; rank 0 completes its manifest.
  await_io(stats);
  const bool previous_pending = pending_;
  Manifest previous = latest_;

  const std::uint64_t seq = latest_.seq + 1;
  Manifest next = latest_;
  next.seq = seq;
  next.ranks = P;
  if (pos.window_index != latest_.window_index) next.segments.clear();
  next.window_index = pos.window_index;
  next.next_trigger = pos.next_trigger;
  next.complete = pos.complete;
  next.releases = releases;
  // The job's last rows go to releases.csv before its last commit instead of through rank 0's segment:
  // written once, not twice (0.2 s of a 2 s job that releases 4.3M rows). A crash before the manifest
  // leaves them beyond the committed length, where the resume cuts them and derives them again.
  std::string final_rows;
  if (root && pos.complete && publish_) final_rows.swap(rows);
  next.staged_bytes = rows.size();
  next.counters = counters;
  if (next.privacy.contains("epsilon_per_window")) next.privacy["windows_charged"] = pos.window_index + 1;
  const SegmentHeader header{latest_.job_id, seq, rank, P, pos.window_index, pos.first_trigger, pos.next_trigger};
  const fs::path path = dir_ / fmt::format("w{}/s{:06}-r{:04}.h5", pos.window_index, seq, rank);

  // The I/O thread: first the previous commit's manifest and rows (rank 0: every rank's file of it
  // is durable), then this commit's segment.
  std::string launch_error;
  try {
    io_ = std::async(std::launch::async, [this, root, previous_pending, previous = std::move(previous),
                                          previous_rows = std::move(pending_rows_), journal = std::move(journal), rows,
                                          final_rows = std::move(final_rows), header, path]() mutable {
      h5::silence_errors_on_this_thread();  // a failed write is this task's exception, not HDF5's printout
      using Clock = std::chrono::steady_clock;
      const auto t = Clock::now();
      if (root && previous_pending) make_visible(previous, previous_rows);
      if (publish_ && !final_rows.empty()) publish_(final_rows);  // after the previous commit's rows
      fault::point("ckpt_begin");
      Written w;
      const auto t_write = Clock::now();
      // Straight to a temporary file, column by column from the journal; then fsync, checksum (from
      // the page cache), rename: a crash at any point leaves no file or the whole one.
      make_private_dir(path.parent_path());
      const fs::path tmp = prepare_temporary(path, kFileMode);
      {
        h5::DiskFile f(tmp.string(), h5::DiskFile::Mode::Create);
        const std::uint64_t journal_bytes = journal->memory_bytes();
        w.encode_seconds = write_segment_tables(f.get(), *journal, rows, header, "ckpt_half_written");
        journal.reset();  // the trigger loop holds no reference: its memory goes now
        // main() keeps freed memory in the process (fewer page faults per trigger); a large
        // journal's pages go back to the system, or a job at scale keeps its largest commit's
        // journal resident until the end.
        if (journal_bytes >= kTrimJournalBytes) malloc_trim(0);
        f.close();
      }
      const FileDigest d = digest_file(tmp);
      w.bytes = d.bytes;
      w.xxh3 = d.xxh3;
      commit_temporary(path, "ckpt_before_rename");
      fault::point("ckpt_after_rename");
      w.write_seconds = std::chrono::duration<double>(Clock::now() - t_write).count() - w.encode_seconds;
      w.seconds = std::chrono::duration<double>(Clock::now() - t).count();
      return w;
    });
  } catch (const std::exception& e) {  // no thread: every rank must learn it before the next collective
    launch_error = fmt::format("cannot start the checkpoint I/O thread: {}", e.what());
  }
  launch_error = comm_.agree_on_error(launch_error);
  if (!launch_error.empty()) throw CheckpointError(launch_error);
  latest_ = std::move(next);
  pending_rows_ = std::move(rows);
  pending_ = true;
  return stats;
}

CommitStats Store::finish(const json& summary) {
  CommitStats stats;
  await_io(stats);
  if (!pending_) return stats;
  latest_.summary = summary;
  const auto t0 = std::chrono::steady_clock::now();
  shuffle::on_all_ranks<CheckpointError>(comm_, [&] {
    if (comm_.rank() == 0) make_visible(latest_, pending_rows_);
  });
  pending_ = false;
  pending_rows_.clear();
  stats.background_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

void Store::collect_garbage() {
  std::set<std::string> keep;
  for (const Manifest* m : {&visible_, &visible_prev_})
    for (const auto& ref : m->segments) keep.insert(ref.file);
  const std::uint64_t oldest_kept = std::min(visible_.seq, visible_prev_.seq);
  std::error_code ec;
  for (const auto& [seq, path] : list_manifests(dir_))
    if (seq < oldest_kept) fs::remove(path, ec);
  static const std::regex segment_name(R"(s(\d{6,})-r\d{4,}\.h5)");
  for (const auto& dir : fs::directory_iterator(dir_, ec)) {
    if (!dir.is_directory()) continue;
    const std::string wname = dir.path().filename().string();
    bool empty = true;
    for (const auto& e : fs::directory_iterator(dir.path(), ec)) {
      std::smatch m;
      const std::string f = e.path().filename().string();
      // Only finished files of visible commits: a later commit's files may be in flight.
      if (std::regex_match(f, m, segment_name) && std::stoull(m[1].str()) <= visible_.seq &&
          !keep.count(fmt::format("{}/{}", wname, f)))
        fs::remove(e.path(), ec);
      else
        empty = false;
    }
    // Only windows before both kept commits: another rank may be starting the next window's files.
    std::smatch wm;
    static const std::regex window_name(R"(w(\d+))");
    if (empty && std::regex_match(wname, wm, window_name) &&
        std::stoull(wm[1].str()) < std::min(visible_.window_index, visible_prev_.window_index))
      fs::remove(dir.path(), ec);
  }
}

}  // namespace dpstream::checkpoint
