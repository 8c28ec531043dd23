#include "src/ledger.hpp"

#include <fmt/format.h>
#include <openssl/hmac.h>
#include <sqlite3.h>
#include <sys/vfs.h>
#include <unistd.h>
#include <xxhash.h>
#include <cerrno>

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <stdexcept>
#include <system_error>

#include "src/accounting.hpp"
#include "src/durable_io.hpp"
#include "src/errors.hpp"

namespace dpstream::ledger {

namespace {
constexpr const char* kFormat = "dpstream-ledger";
constexpr int kVersion = 1;
constexpr int kBusyMs = 120000;  // a job waits this long for another's admission to finish

// SQLite's locking needs POSIX advisory locks that work: local file systems, and the cluster file
// systems whose locks are coherent across nodes. NFS and SMB locks are known to be unreliable
// (sqlite.org/faq.html#q5): refused.
struct FsType {
  long magic;
  const char* name;
};
constexpr FsType kSupported[] = {{0xEF53, "ext2/3/4"},  {0x58465342, "xfs"},       {0x9123683E, "btrfs"},
                                 {0x01021994, "tmpfs"}, {0x794C7630, "overlayfs"}, {0x2FC12FC1, "zfs"},
                                 {0x47504653, "gpfs"},  {0x0BD00BD0, "lustre"}};

// The file system where the file lies: through every symbolic link (a link on ext4 to a ledger on NFS is on NFS).
void check_file_system(const std::filesystem::path& path) {
  std::error_code ec;
  std::filesystem::path real = std::filesystem::weakly_canonical(path, ec);
  if (ec) real = path;
  const auto dir = real.has_parent_path() ? real.parent_path() : std::filesystem::path(".");
  struct statfs fs {};
  if (::statfs(dir.c_str(), &fs) != 0)
    throw std::runtime_error(fmt::format("ledger {}: cannot stat the file system of {}", path.string(), dir.string()));
  for (const auto& t : kSupported)
    if (static_cast<long>(fs.f_type) == t.magic) return;
  throw std::runtime_error(fmt::format(
      "ledger {}: its file system (type 0x{:X}) is not supported: the ledger's atomic admission needs POSIX locks "
      "that work (supported: ext4, xfs, btrfs, tmpfs, overlayfs, zfs, GPFS, Lustre mounted with -o flock; not NFS "
      "or SMB); put the ledger on one of those, reachable by every job's rank 0",
      path.string(), static_cast<unsigned long>(fs.f_type)));
}

std::string now_utc() {
  const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// A row's digest: XXH3 of its fields in a canonical text (floats as %a) and the previous row's
// digest, a chain whose last link is kept in meta ('head'): an edited, inserted or deleted row breaks
// it. It detects accidents and careless edits, not an adversary who recomputes it (the ledger is
// trusted storage, like the checkpoints).
std::string digest(const Charge& c, const std::string& previous) {
  const std::string text = fmt::format("{}|{}|{}|{}|{}|{}|{}|{:a}|{:a}|{:a}|{:a}|{:a}|{}", c.seq, c.run_id, c.block,
                                       c.job, c.at, c.mechanism, c.zcdp ? "zcdp" : "approx", c.rho, c.delta_extra,
                                       c.coupled, c.epsilon, c.delta, previous);
  return fmt::format("{:016x}", XXH3_64bits(text.data(), text.size()));
}

// The digest of the ledger's settings (the ceiling, the block length, the retirement): the chain's
// first link, refreshed when blocks are retired.
std::string meta_digest(const std::map<std::string, std::string>& meta) {
  std::string text;
  for (const char* k : {"format", "version", "epsilon", "delta", "block_seconds", "created", "retired_through"})
    text += std::string(k) + "=" + (meta.count(k) ? meta.at(k) : "") + "|";
  return fmt::format("{:016x}", XXH3_64bits(text.data(), text.size()));
}

constexpr const char* kCorrupt =
    "dpstream refuses it. Never replace a ledger by an older copy (the charges made since would be "
    "forgotten and blocks spent twice): repair it only from a copy that holds every charge";

std::string hex_double(double v) { return fmt::format("{:a}", v); }
double parse_double(const std::string& s) {
  std::size_t used = 0;
  const double v = std::stod(s, &used);
  if (used != s.size()) throw std::invalid_argument(s);
  return v;
}
}  // namespace

// ---- SQLite, minimally wrapped -------------------------------------------------------------

namespace {
// The 16 bytes every SQLite database file starts with (sqlite.org/fileformat.html, section 1.3.1). Checked before
// SQLite opens the file: it would report another file only once a statement ran, quoting that statement.
bool has_sqlite_header(const std::string& path) {
  static constexpr char kMagic[16] = {'S', 'Q', 'L', 'i', 't', 'e', ' ', 'f', 'o', 'r', 'm', 'a', 't', ' ', '3', '\0'};
  std::array<char, sizeof kMagic> head{};
  std::ifstream f(path, std::ios::binary);
  return f.read(head.data(), head.size()) && std::equal(head.begin(), head.end(), std::begin(kMagic));
}

void exec_sql(sqlite3* db, const std::string& path, const char* sql) {
  char* err = nullptr;
  if (sqlite3_exec(db, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    const std::string msg = err ? err : "?";
    sqlite3_free(err);
    throw std::runtime_error(fmt::format("ledger {}: {}: {}", path, sql, msg));
  }
}
}  // namespace

struct Ledger::Db {
  sqlite3* handle = nullptr;
  std::string path;
  void exec(const char* sql) const { exec_sql(handle, path, sql); }
};

namespace {
class Statement {
 public:
  Statement(sqlite3* db, const char* sql, const std::string& path) : db_(db), path_(path) {
    if (sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr) != SQLITE_OK)
      throw std::runtime_error(fmt::format("ledger {}: {}: {}", path, sql, sqlite3_errmsg(db)));
  }
  ~Statement() { sqlite3_finalize(stmt_); }
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;

  Statement& bind(int i, const std::string& v) {
    sqlite3_bind_text(stmt_, i, v.c_str(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
    return *this;
  }
  Statement& bind(int i, std::int64_t v) {
    sqlite3_bind_int64(stmt_, i, v);
    return *this;
  }
  bool step() {  // true: a row
    const int rc = sqlite3_step(stmt_);
    if (rc == SQLITE_ROW) return true;
    if (rc == SQLITE_DONE) return false;
    throw std::runtime_error(fmt::format("ledger {}: {}", path_, sqlite3_errmsg(db_)));
  }
  std::string text(int col) const {
    const auto* p = sqlite3_column_text(stmt_, col);
    return p ? reinterpret_cast<const char*>(p) : "";
  }
  std::int64_t integer(int col) const { return sqlite3_column_int64(stmt_, col); }

 private:
  sqlite3* db_;
  sqlite3_stmt* stmt_ = nullptr;
  const std::string& path_;
};

constexpr const char* kSchema = R"sql(
CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE charges(
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  run_id TEXT NOT NULL, block INTEGER NOT NULL, job TEXT NOT NULL, at TEXT NOT NULL, mechanism TEXT NOT NULL,
  accounting TEXT NOT NULL CHECK (accounting IN ('zcdp', 'approx')),
  rho TEXT NOT NULL, delta_extra TEXT NOT NULL, coupled TEXT NOT NULL, epsilon TEXT NOT NULL, delta TEXT NOT NULL,
  digest TEXT NOT NULL,
  UNIQUE (run_id, block));
CREATE INDEX charges_by_block ON charges(block);
)sql";

// `path` is a file name, never a URI: SQLite built with URIs on (Debian's) reads a name that begins with "file:"
// as one, whose parameters may open another file than the one checked (?vfs=, ...) or turn locking off
// (vfs=unix-none: concurrent admissions overspend). As an absolute path it begins with '/'.
sqlite3* open_db(const std::string& path, int flags) {
  sqlite3* db = nullptr;
  const std::string file = std::filesystem::absolute(path).string();
  if (sqlite3_open_v2(file.c_str(), &db, flags, nullptr) != SQLITE_OK) {
    const std::string msg = db ? sqlite3_errmsg(db) : "out of memory";
    sqlite3_close(db);
    throw std::runtime_error(fmt::format("ledger {}: cannot open: {}", path, msg));
  }
  sqlite3_busy_timeout(db, kBusyMs);
  sqlite3_extended_result_codes(db, 1);
  return db;
}

std::vector<Charge> read_charges(sqlite3* db, const std::string& path, const char* where = "", std::int64_t block = 0) {
  const std::string sql = std::string(
                              "SELECT seq, run_id, block, job, at, mechanism, accounting, rho, delta_extra, coupled, "
                              "epsilon, delta, digest FROM charges ") +
                          where + " ORDER BY seq";
  Statement s(db, sql.c_str(), path);
  if (*where) s.bind(1, block);
  std::vector<Charge> out;
  while (s.step()) {
    Charge c;
    c.seq = s.integer(0);
    c.run_id = s.text(1);
    c.block = s.integer(2);
    c.job = s.text(3);
    c.at = s.text(4);
    c.mechanism = s.text(5);
    c.zcdp = s.text(6) == "zcdp";
    c.stored_digest = s.text(12);
    try {
      c.rho = parse_double(s.text(7));
      c.delta_extra = parse_double(s.text(8));
      c.coupled = parse_double(s.text(9));
      c.epsilon = parse_double(s.text(10));
      c.delta = parse_double(s.text(11));
    } catch (const std::exception&) {
      throw std::runtime_error(fmt::format("ledger {}: charge {} has an unreadable number: the ledger is damaged; {}",
                                           path, c.seq, kCorrupt));
    }
    out.push_back(std::move(c));
  }
  return out;
}

std::map<std::string, std::string> read_meta(sqlite3* db, const std::string& path) {
  std::map<std::string, std::string> meta;
  Statement s(db, "SELECT key, value FROM meta", path);
  while (s.step()) meta[s.text(0)] = s.text(1);
  return meta;
}

// Every charge in order, the chain from the settings' digest to meta's head: throws when broken.
void verify_chain(sqlite3* db, const std::string& path) {
  const auto meta = read_meta(db, path);
  std::string link = meta_digest(meta);
  if (!meta.count("settings_digest") || meta.at("settings_digest") != link)
    throw std::runtime_error(
        fmt::format("ledger {}: its settings (ceiling, block length, retirement) fail their digest: the ledger was "
                    "modified outside dpstream or is damaged; {}",
                    path, kCorrupt));
  std::int64_t expected_seq = 1;
  for (const Charge& c : read_charges(db, path)) {
    if (c.seq != expected_seq || c.stored_digest != digest(c, link))
      throw std::runtime_error(
          fmt::format("ledger {}: charge {} (block {}, job '{}') breaks the chain of digests (a row edited, inserted "
                      "or removed outside dpstream, or damage); {}",
                      path, c.seq, c.block, c.job, kCorrupt));
    link = c.stored_digest;
    ++expected_seq;
  }
  if (!meta.count("head") || meta.at("head") != link)
    throw std::runtime_error(fmt::format(
        "ledger {}: its last charges are missing (the chain ends before its recorded head); {}", path, kCorrupt));
}

void put_meta(sqlite3* db, const std::string& path, const std::string& key, const std::string& value) {
  Statement s(db, "INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", path);
  s.bind(1, key).bind(2, value).step();
}
}  // namespace

std::string run_id(const unsigned char* key, std::size_t key_bytes, const std::string& fingerprint) {
  const std::string msg = "dpstream ledger run" + fingerprint;
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), key, static_cast<int>(key_bytes), reinterpret_cast<const unsigned char*>(msg.data()),
            msg.size(), mac, &len))
    throw std::runtime_error("ledger: HMAC failed");
  std::string hex;
  for (unsigned i = 0; i < 16; ++i) hex += fmt::format("{:02x}", mac[i]);
  return hex;
}

// ---- accounting ------------------------------------------------------------------------------

namespace {
// delta a zCDP block needs at eps: zcdp_delta(rho, eps) + delta_extra + (e^eps + 1) coupled.
double needed_delta(const BlockSpend& b, double eps) {
  return (b.rho > 0 ? accounting::zcdp_delta(b.rho, eps) : 0.0) + b.delta_extra +
         (b.coupled > 0 ? (std::exp(eps) + 1) * b.coupled : 0.0);
}
}  // namespace

namespace {
// A low point of need() on [0, hi] by golden-section search, or hi itself if lower: need falls then
// rises but is not convex everywhere, so this is a good point, not always the least; callers use only
// that it qualifies (docs/LEDGER.md: a miss can only refuse).
template <class F>
double low_point(F&& f, double hi) {
  const double r = (std::sqrt(5.0) - 1) / 2;
  double a = 0, b = hi;
  double c = b - r * (b - a), d = a + r * (b - a), fc = f(c), fd = f(d);
  for (int i = 0; i < 200 && b - a > 1e-13 * hi; ++i) {
    if (fc <= fd) {
      b = d, d = c, fd = fc, c = b - r * (b - a), fc = f(c);
    } else {
      a = c, c = d, fc = fd, d = a + r * (b - a), fd = f(d);
    }
  }
  const double mid = (a + b) / 2;
  return f(hi) < f(mid) ? hi : mid;
}
}  // namespace

BlockSpend account(std::int64_t block, std::vector<Charge> charges, const Ceiling& g, bool with_rho_left) {
  BlockSpend b;
  b.block = block;
  b.zcdp = std::all_of(charges.begin(), charges.end(), [](const Charge& c) { return c.zcdp; });
  if (b.zcdp) {
    for (const auto& c : charges) b.rho += c.rho, b.delta_extra += c.delta_extra, b.coupled += c.coupled;
    const auto need = [&](double eps) { return needed_delta(b, eps); };
    // The block is (eps, delta_g)-DP for every eps with need(eps) <= delta_g. Within its ceiling when
    // a low point of need on [0, eps_g] qualifies; spent: a bisection towards 0 that keeps qualifying.
    const double best = low_point(need, g.epsilon);
    b.delta_left = g.delta - need(best);
    if (charges.empty()) {
      b.epsilon = b.delta = 0;
    } else if (need(best) <= g.delta) {
      double lo = 0, hi = best;  // hi always qualifies: the reported eps is a guarantee
      for (int i = 0; i < 200 && hi - lo > 1e-13 * g.epsilon; ++i) {
        const double mid = (lo + hi) / 2;
        (need(mid) <= g.delta ? hi : lo) = mid;
      }
      b.epsilon = hi;
      b.delta = g.delta;
    } else {
      b.epsilon = INFINITY;  // beyond the ceiling (never admitted)
      b.delta = g.delta;
    }
    b.epsilon_left = g.epsilon - b.epsilon;
    // rho another charge with no failure mass could add: the best over eps <= eps_g of
    // rho_tight(eps, delta_g - one-sided - (e^eps + 1) coupled) - rho (a grid: a lower bound).
    for (int i = 1; with_rho_left && i <= 256; ++i) {
      const double eps = g.epsilon * i / 256;
      const double room = g.delta - b.delta_extra - (b.coupled > 0 ? (std::exp(eps) + 1) * b.coupled : 0.0);
      if (room > 0) b.rho_left = std::max(b.rho_left, accounting::zcdp_rho_tight(eps, room) - b.rho);
    }
  }
  // Basic composition of every charge's own (epsilon, delta) is valid whatever the charges; a zCDP block
  // uses it when it proves a smaller epsilon (at large epsilon the coupled mass costs (e^eps + 1) each).
  double eps_basic = 0, delta_basic = 0;
  for (const auto& c : charges) eps_basic += c.epsilon, delta_basic += c.delta;
  if (!b.zcdp || (!charges.empty() && delta_basic <= g.delta && eps_basic < b.epsilon)) {
    b.zcdp = false;
    b.epsilon = eps_basic, b.delta = delta_basic;
    b.epsilon_left = g.epsilon - b.epsilon;
    b.delta_left = g.delta - b.delta;
    b.rho_left = 0;
  }
  b.charges = std::move(charges);
  return b;
}

namespace {
bool within(const BlockSpend& b, const Ceiling& g) { return b.epsilon <= g.epsilon && b.delta <= g.delta; }

// account() of blocks whose charges agree in everything it reads (the jobs that read a stream charge runs of
// consecutive blocks alike), computed once: a block's accounting is hundreds of tight conversions, and a ledger of
// 20 000 daily blocks took about a minute to show. Keyed on the values' bits, in charge order: equal keys are equal
// inputs, so the cached spend is the one account() would return (NaN bits compare too).
class SpendCache {
 public:
  SpendCache(const Ceiling& g, bool with_rho_left) : ceiling_(g), with_rho_left_(with_rho_left) {}
  BlockSpend operator()(std::int64_t block, std::vector<Charge> charges) {
    Key key;
    key.reserve(charges.size());
    for (const Charge& c : charges)
      key.push_back({c.zcdp ? 1U : 0U, std::bit_cast<std::uint64_t>(c.rho), std::bit_cast<std::uint64_t>(c.delta_extra),
                     std::bit_cast<std::uint64_t>(c.coupled), std::bit_cast<std::uint64_t>(c.epsilon),
                     std::bit_cast<std::uint64_t>(c.delta)});
    auto it = spent_.find(key);
    if (it == spent_.end()) {
      BlockSpend alike = account(block, charges, ceiling_, with_rho_left_);
      alike.charges.clear();  // the cache keeps the figures only
      it = spent_.emplace(std::move(key), std::move(alike)).first;
    }
    BlockSpend b = it->second;
    b.block = block;
    b.charges = std::move(charges);
    return b;
  }

 private:
  using Key = std::vector<std::array<std::uint64_t, 6>>;
  Ceiling ceiling_;
  bool with_rho_left_;
  std::map<Key, BlockSpend> spent_;
};

std::string describe_ask(const Request& r) {
  return r.zcdp ? fmt::format(
                      "rho {:.6g}, failure mass {:.3g} coupled and {:.3g} one-sided (alone: (epsilon, delta) = "
                      "({:.6g}, {:.3g}))",
                      r.rho, r.coupled, r.delta_extra, r.epsilon, r.delta)
                : fmt::format("(epsilon, delta) = ({:.6g}, {:.3g})", r.epsilon, r.delta);
}

std::string describe_left(const BlockSpend& b) {
  if (b.zcdp)
    return fmt::format(
        "it has spent epsilon {:.6g} of its ceiling under zCDP (rho {:.6g}); left: rho {:.6g} for a job "
        "with no failure mass",
        b.epsilon, b.rho, b.rho_left);
  return fmt::format("it has spent (epsilon, delta) = ({:.6g}, {:.3g}) by basic composition; left: ({:.6g}, {:.3g})",
                     b.epsilon, b.delta, std::max(0.0, b.epsilon_left), std::max(0.0, b.delta_left));
}
}  // namespace

// ---- the ledger ------------------------------------------------------------------------------

void init(const std::string& path, const Ceiling& g) {
  if (!(g.epsilon > 0) || !std::isfinite(g.epsilon))
    throw std::invalid_argument(fmt::format("ledger init: --epsilon must be > 0, got {}", g.epsilon));
  if (!(g.delta > 0 && g.delta < 1))
    throw std::invalid_argument(fmt::format("ledger init: --delta must be in (0, 1), got {}", g.delta));
  if (g.block_seconds < 1)
    throw std::invalid_argument(fmt::format("ledger init: --block-seconds must be >= 1, got {}", g.block_seconds));
  if (g.epsilon > 100)
    throw std::invalid_argument(fmt::format("ledger init: --epsilon {} is above 100: not a privacy budget", g.epsilon));
  check_file_system(std::filesystem::absolute(path));
  // Created exclusively: two inits racing on one path cannot both succeed, and a failed init removes
  // only the file it created.
  if (const int err = create_new_file(path, 0600); err != 0)
    throw std::invalid_argument(
        err == EEXIST ? fmt::format("ledger init: {} exists; a ledger is never re-initialized (its charges would be "
                                    "lost): choose another path",
                                    path)
                      : fmt::format("ledger init: cannot create {}: {}", path, errno_text(err)));
  sqlite3* db = open_db(path, SQLITE_OPEN_READWRITE);
  try {
    exec_sql(db, path, "PRAGMA journal_mode = DELETE; PRAGMA synchronous = FULL;");
    exec_sql(db, path, "BEGIN IMMEDIATE");
    exec_sql(db, path, kSchema);
    const std::pair<std::string, std::string> meta[] = {{"format", kFormat},
                                                        {"version", std::to_string(kVersion)},
                                                        {"epsilon", hex_double(g.epsilon)},
                                                        {"delta", hex_double(g.delta)},
                                                        {"block_seconds", std::to_string(g.block_seconds)},
                                                        {"created", now_utc()}};
    std::map<std::string, std::string> settings;
    for (const auto& [k, v] : meta) {
      put_meta(db, path, k, v);
      settings[k] = v;
    }
    put_meta(db, path, "settings_digest", meta_digest(settings));
    put_meta(db, path, "head", meta_digest(settings));  // no charge yet: the chain starts at the settings
    exec_sql(db, path, "COMMIT");
  } catch (...) {
    sqlite3_close(db);
    std::filesystem::remove(path);
    throw;
  }
  sqlite3_close(db);
}

Ledger::Ledger(const std::string& path) {
  if (std::filesystem::is_directory(path))
    throw std::runtime_error(fmt::format("ledger {}: is a directory; give the ledger's file", path));
  if (!std::filesystem::is_regular_file(path))
    throw std::runtime_error(fmt::format(
        "ledger {}: no such file; create it with dpstream ledger init {} --epsilon E --delta D", path, path));
  if (!has_sqlite_header(path))
    throw std::runtime_error(fmt::format(
        "ledger {}: not a dpstream ledger (not an SQLite database); give the file made by dpstream ledger init", path));
  check_file_system(std::filesystem::absolute(path));
  db_ = new Db{open_db(path, SQLITE_OPEN_READWRITE), path};
  try {
    db_->exec("PRAGMA journal_mode = DELETE; PRAGMA synchronous = FULL;");
    {
      Statement check(db_->handle, "PRAGMA quick_check", path);
      if (!check.step() || check.text(0) != "ok")
        throw std::runtime_error(
            fmt::format("ledger {}: SQLite finds it damaged ({}); {}", path, check.text(0), kCorrupt));
    }
    const auto meta = read_meta(db_->handle, path);
    if (!meta.count("format") || meta.at("format") != kFormat)
      throw std::runtime_error(fmt::format("ledger {}: not a dpstream ledger", path));
    if (meta.at("format") == kFormat && (!meta.count("version") || meta.at("version") != std::to_string(kVersion)))
      throw std::runtime_error(fmt::format("ledger {}: version {} (this dpstream reads version {})", path,
                                           meta.count("version") ? meta.at("version") : "?", kVersion));
    try {
      ceiling_.epsilon = parse_double(meta.at("epsilon"));
      ceiling_.delta = parse_double(meta.at("delta"));
      ceiling_.block_seconds = std::stoll(meta.at("block_seconds"));
    } catch (const std::exception&) {
      throw std::runtime_error(fmt::format("ledger {}: its ceiling is missing or unreadable; {}", path, kCorrupt));
    }
    if (!(ceiling_.epsilon > 0 && ceiling_.epsilon <= 100) || !(ceiling_.delta > 0 && ceiling_.delta < 1) ||
        ceiling_.block_seconds < 1)
      throw std::runtime_error(fmt::format("ledger {}: its ceiling is invalid; {}", path, kCorrupt));
  } catch (...) {
    sqlite3_close(db_->handle);
    delete db_;
    throw;
  }
}

Ledger::~Ledger() {
  sqlite3_close(db_->handle);
  delete db_;
}

std::optional<std::int64_t> Ledger::retired_through() const {
  Statement s(db_->handle, "SELECT value FROM meta WHERE key = 'retired_through'", db_->path);
  if (!s.step()) return std::nullopt;
  return std::stoll(s.text(0));
}

std::vector<BlockSpend> Ledger::blocks(const std::vector<std::int64_t>& extra) const {
  verify_chain(db_->handle, db_->path);  // every row, in order, to the recorded head
  std::map<std::int64_t, std::vector<Charge>> by_block;
  for (auto& c : read_charges(db_->handle, db_->path)) by_block[c.block].push_back(std::move(c));
  for (const std::int64_t b : extra) by_block[b];
  const auto retired = retired_through();
  std::vector<BlockSpend> out;
  SpendCache spend(ceiling_, /*with_rho_left=*/true);
  for (auto& [block, charges] : by_block) {
    out.push_back(spend(block, std::move(charges)));
    out.back().retired = retired && block <= *retired;
  }
  return out;
}

std::optional<std::pair<std::int64_t, std::int64_t>> Ceiling::block_time(std::int64_t block) const {
  std::int64_t start = 0, end = 0;
  if (__builtin_mul_overflow(block, block_seconds, &start)) return std::nullopt;
  if (__builtin_add_overflow(start, block_seconds, &end)) end = std::numeric_limits<std::int64_t>::max();
  return std::pair{start, end};
}

std::string Ceiling::block_time_text(std::int64_t block) const {
  const auto t = block_time(block);
  if (!t) return "outside int64 seconds";
  const bool to_the_end = t->second == std::numeric_limits<std::int64_t>::max();  // the last second included
  return fmt::format("[{}, {}{} s", t->first, t->second, to_the_end ? "]" : ")");
}

Admission Ledger::admit(const Request& r, bool charge) {
  if (r.blocks.empty()) throw std::invalid_argument("ledger: a request names no block");
  for (const std::int64_t block : r.blocks)
    if (!ceiling_.block_time(block))
      throw std::invalid_argument(fmt::format(
          "ledger {}: block {} of {} s lies outside int64 event time (no record's time can fall in it); read "
          "other windows",
          db_->path, block, ceiling_.block_seconds));
  // A charge takes the write lock first: nobody else admits until COMMIT. A preview reads (a reader who may not write
  // the ledger can ask, and waits for no admission).
  db_->exec(charge ? "BEGIN IMMEDIATE" : "BEGIN");
  try {
    verify_chain(db_->handle, db_->path);  // as of this transaction, not as of the open
    const auto refuse = [&](std::string message) {
      db_->exec("ROLLBACK");
      return Admission{Outcome::Refused, std::move(message)};
    };
    const auto retired = retired_through();
    std::size_t already = 0;
    SpendCache spend_with_request(ceiling_, /*with_rho_left=*/false);
    for (const std::int64_t block : r.blocks) {
      if (retired && block <= *retired)  // a resume too: retired data is never read again
        return refuse(
            fmt::format("ledger {}: block {} is retired (every block <= {} is): its data may not be read "
                        "again; read newer windows",
                        db_->path, block, *retired));
      auto charges = read_charges(db_->handle, db_->path, "WHERE block = ?", block);
      if (std::any_of(charges.begin(), charges.end(), [&](const Charge& c) { return c.run_id == r.run_id; })) {
        ++already;
        continue;
      }
      Charge c;
      c.run_id = r.run_id, c.block = block, c.job = r.job, c.mechanism = r.mechanism, c.zcdp = r.zcdp;
      c.rho = r.rho, c.delta_extra = r.delta_extra, c.coupled = r.coupled, c.epsilon = r.epsilon, c.delta = r.delta;
      auto with_request = charges;
      with_request.push_back(c);
      if (!within(spend_with_request(block, std::move(with_request)), ceiling_))
        return refuse(fmt::format(
            "ledger {}: block {} (event time {}) cannot admit job '{}': it asks {}; {}; the ceiling per block "
            "is (epsilon, delta) = ({:.6g}, {:.3g}). Lower the job's epsilon, or its delta where the delta alone "
            "exceeds what is left ([privacy] of a job spec; --epsilon and --delta of a query), or read other windows",
            db_->path, block, ceiling_.block_time_text(block), r.job, describe_ask(r),
            describe_left(account(block, std::move(charges), ceiling_)), ceiling_.epsilon, ceiling_.delta));
    }
    if (already == r.blocks.size()) {
      db_->exec("ROLLBACK");
      return {Outcome::AlreadyAdmitted, ""};
    }
    if (already != 0)
      throw std::runtime_error(
          fmt::format("ledger {}: run {} was admitted on some of these blocks only", db_->path, r.run_id));
    if (!charge) {
      db_->exec("ROLLBACK");
      return {Outcome::Admitted, ""};
    }
    const std::string at = now_utc();
    std::string link = read_meta(db_->handle, db_->path).at("head");
    std::int64_t seq = 0;
    {
      Statement last(db_->handle, "SELECT COALESCE(MAX(seq), 0) FROM charges", db_->path);
      last.step();
      seq = last.integer(0);
    }
    for (const std::int64_t block : r.blocks) {
      Charge c;
      c.seq = ++seq;
      c.run_id = r.run_id, c.block = block, c.job = r.job, c.at = at, c.mechanism = r.mechanism, c.zcdp = r.zcdp;
      c.rho = r.rho, c.delta_extra = r.delta_extra, c.coupled = r.coupled, c.epsilon = r.epsilon, c.delta = r.delta;
      link = digest(c, link);
      Statement s(db_->handle,
                  "INSERT INTO charges(seq, run_id, block, job, at, mechanism, accounting, rho, delta_extra, coupled, "
                  "epsilon, delta, digest) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                  db_->path);
      s.bind(1, c.seq).bind(2, c.run_id).bind(3, c.block).bind(4, c.job).bind(5, c.at).bind(6, c.mechanism);
      s.bind(7, std::string(c.zcdp ? "zcdp" : "approx")).bind(8, hex_double(c.rho)).bind(9, hex_double(c.delta_extra));
      s.bind(10, hex_double(c.coupled)).bind(11, hex_double(c.epsilon)).bind(12, hex_double(c.delta));
      s.bind(13, link);
      s.step();
    }
    put_meta(db_->handle, db_->path, "head", link);
    db_->exec("COMMIT");  // durable (synchronous = FULL) before the job releases or commits anything
    return {Outcome::Admitted, ""};
  } catch (...) {
    sqlite3_exec(db_->handle, "ROLLBACK", nullptr, nullptr, nullptr);
    throw;
  }
}

namespace {
// What charge_or_refuse and preview_admission refuse before asking for the admission itself.
void check_request(const std::string& path, const Ledger& book, std::int64_t window_seconds, const Request& request,
                   bool resume) {
  if (resume) {
    bool holds = false;
    for (const BlockSpend& b : book.blocks())
      for (const Charge& c : b.charges) holds = holds || c.run_id == request.run_id;
    if (!holds)
      throw std::runtime_error(fmt::format(
          "ledger {} holds no charge of the run being resumed (run {}): it is not the ledger that admitted the job "
          "(another file at that path, or one initialized anew); resume with that ledger, or start over with --fresh "
          "(a new release, charged anew)",
          path, request.run_id));
  }
  if (book.ceiling().block_seconds != window_seconds)
    throw std::runtime_error(fmt::format(
        "ledger {}: its blocks are windows of {} s and this job's windows are {} s: set [stream] window_seconds = {}",
        path, book.ceiling().block_seconds, window_seconds, book.ceiling().block_seconds));
}
}  // namespace

Admission preview_admission(const std::string& path, std::int64_t window_seconds, const Request& request, bool resume) {
  Ledger book(path);
  check_request(path, book, window_seconds, request, resume);
  return book.admit(request, /*charge=*/false);
}

Outcome charge_or_refuse(const std::string& path, std::int64_t window_seconds, const Request& request, bool resume) {
  Ledger book(path);
  check_request(path, book, window_seconds, request, resume);
  const Admission admission = book.admit(request);
  if (admission.outcome == Outcome::Refused) throw std::runtime_error(admission.message);
  std::fprintf(stderr, "dpstream: ledger %s: %s windows %lld..%lld (run %s)\n", path.c_str(),
               admission.outcome == Outcome::Admitted ? "charged" : "already charged for",
               static_cast<long long>(request.blocks.front()), static_cast<long long>(request.blocks.back()),
               request.run_id.c_str());
  return admission.outcome;
}

void Ledger::retire_through(std::int64_t through) {
  db_->exec("BEGIN IMMEDIATE");
  try {
    verify_chain(db_->handle, db_->path);
    const auto now = retired_through();
    if (!now || through > *now) {
      put_meta(db_->handle, db_->path, "retired_through", std::to_string(through));
      const auto meta = read_meta(db_->handle, db_->path);
      // The chain starts at the settings' digest: re-link every row to the new one.
      put_meta(db_->handle, db_->path, "settings_digest", meta_digest(meta));
      std::string link = meta_digest(meta);
      for (const Charge& c : read_charges(db_->handle, db_->path)) {
        link = digest(c, link);
        Statement s(db_->handle, "UPDATE charges SET digest = ? WHERE seq = ?", db_->path);
        s.bind(1, link).bind(2, c.seq).step();
      }
      put_meta(db_->handle, db_->path, "head", link);
    }
    db_->exec("COMMIT");
  } catch (...) {
    sqlite3_exec(db_->handle, "ROLLBACK", nullptr, nullptr, nullptr);
    throw;
  }
}

}  // namespace dpstream::ledger
