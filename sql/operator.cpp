#include "sql/operator.hpp"

#include <fmt/format.h>

#include <absl/container/flat_hash_map.h>
#include <absl/container/flat_hash_set.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <memory>
#include <numeric>

#include "common/elapsed.hpp"
#include "common/fault_injection.hpp"
#include "partition/hash.hpp"
#include "sql/table.hpp"
#include "src/csv_input.hpp"
#include "src/durable_io.hpp"
#include "src/errors.hpp"
#include "src/id_prf.hpp"
#include "src/ledger.hpp"

namespace dpstream::sql {

namespace {

using What = Component::What;
namespace fs = std::filesystem;

template <class T>
void release(std::vector<T>& v) {
  std::vector<T>().swap(v);  // clear() keeps the capacity
}

int128 words_to_int128(const std::uint64_t* w) { return from_words(w[0], static_cast<std::int64_t>(w[1])); }
void int128_to_words(int128 v, std::uint64_t* w) {
  w[0] = low_word(v), w[1] = static_cast<std::uint64_t>(high_word(v));
}

// Rows of `words` (stride s) regrouped by destination rank; returns the words and their offsets.
template <class Dest>
std::vector<std::uint64_t> by_destination(const std::vector<std::uint64_t>& words, std::size_t s, int ranks,
                                          Dest&& dest, std::vector<std::uint64_t>& offsets) {
  const std::size_t n = s == 0 ? 0 : words.size() / s;
  std::vector<int> to(n);
  offsets.assign(static_cast<std::size_t>(ranks) + 1, 0);
  for (std::size_t i = 0; i < n; ++i) ++offsets[static_cast<std::size_t>(to[i] = dest(&words[i * s])) + 1];
  for (int r = 0; r < ranks; ++r) offsets[static_cast<std::size_t>(r) + 1] += offsets[static_cast<std::size_t>(r)];
  std::vector<std::uint64_t> out(words.size());
  std::vector<std::uint64_t> next(offsets.begin(), offsets.end() - 1);
  for (std::size_t i = 0; i < n; ++i) std::copy_n(&words[i * s], s, &out[next[static_cast<std::size_t>(to[i])]++ * s]);
  for (auto& o : offsets) o *= s;
  return out;
}

// Partials of one (user, group) merged at the user's owner, sorted by (user, group).
std::vector<std::uint64_t> merge_partials(const std::vector<std::uint64_t>& words, std::size_t s) {
  struct Key {
    std::uint64_t user, group, index;
    bool operator<(const Key& o) const { return std::tie(user, group) < std::tie(o.user, o.group); }
  };
  std::vector<Key> keys(words.size() / s);
  for (std::size_t i = 0; i < keys.size(); ++i) keys[i] = {words[i * s], words[i * s + 1], i};
  std::sort(keys.begin(), keys.end());  // the keys themselves: no indirect reads while sorting
  std::vector<std::uint64_t> out;
  out.reserve(words.size());
  for (const Key& k : keys) {
    const std::uint64_t* p = &words[k.index * s];
    if (!out.empty() && out[out.size() - s] == p[0] && out[out.size() - s + 1] == p[1]) {
      std::uint64_t* q = &out[out.size() - s];
      q[2] += p[2];
      for (std::size_t c = 3; c < s; c += 3) {
        q[c] += p[c];
        int128_to_words(words_to_int128(q + c + 1) + words_to_int128(p + c + 1), q + c + 1);
      }
    } else {
      out.insert(out.end(), p, p + s);
    }
  }
  return out;
}

// K_s = HMAC-SHA256(secret, "dpstream sql sample")[0..16); r(u, g) = LE64 of SipHash-2-4-128(K_s, LE64(u) ||
// LE64(g))[0..8): a PRF (src/id_prf.hpp's KeyedSipHash, as for the ids) at ~40 ns a pair.
class SampleRank {
 public:
  explicit SampleRank(const noise::Secret& secret) : mac_(secret, "dpstream sql sample") {}
  std::uint64_t operator()(std::uint64_t user, std::uint64_t group) const {
    std::array<unsigned char, 16> msg{};
    for (std::size_t i = 0; i < 8; ++i)
      msg[i] = static_cast<unsigned char>(user >> (8 * i)), msg[8 + i] = static_cast<unsigned char>(group >> (8 * i));
    return mac_(msg.data(), msg.size()).first;
  }

 private:
  KeyedSipHash mac_;
};

// Public selection: only the listed groups' partials go on (counted as unlisted (user, group) pairs).
std::vector<std::uint64_t> keep_listed(const std::vector<std::uint64_t>& merged, std::size_t s,
                                       const absl::flat_hash_map<std::uint64_t, std::string>& listed,
                                       QueryCounters& counters) {
  std::vector<std::uint64_t> out;
  for (std::size_t i = 0; i < merged.size(); i += s)
    if (listed.contains(merged[i + 1]))
      out.insert(out.end(), &merged[i], &merged[i] + s);
    else
      ++counters.user_groups_unlisted;
  return out;
}

// Stability bounding (seed 003): a user in more than k groups keeps the k with the smallest (rank, gid).
// Input sorted by (user, group); output rows [gid, rows, values...] (the user dropped).
std::vector<std::uint64_t> bound_users(const std::vector<std::uint64_t>& merged, std::size_t s, std::uint32_t k,
                                       const SampleRank& rank, QueryCounters& counters) {
  std::vector<std::uint64_t> out;
  const std::size_t n = merged.size() / s;
  std::vector<std::pair<std::pair<std::uint64_t, std::uint64_t>, std::size_t>> ranked;
  for (std::size_t i = 0; i < n;) {
    std::size_t j = i;
    while (j < n && merged[j * s] == merged[i * s]) ++j;
    ++counters.users;
    counters.user_groups += j - i;
    ranked.clear();
    for (std::size_t g = i; g < j; ++g) {
      const std::uint64_t gid = merged[g * s + 1];
      ranked.push_back({{j - i > k ? rank(merged[i * s], gid) : 0, gid}, g});
    }
    if (j - i > k) {
      std::nth_element(ranked.begin(), ranked.begin() + k, ranked.end());
      counters.user_groups_dropped += j - i - k;
      ranked.resize(k);
    }
    for (const auto& [key, g] : ranked) out.insert(out.end(), &merged[g * s + 1], &merged[g * s + s]);
    i = j;
  }
  return out;
}

// Per-group accumulators of the second stage.
struct GroupAcc {
  std::uint64_t users = 0;
  std::vector<int128> sums;                        // one per component (Tree: unused)
  std::vector<std::vector<std::uint16_t>> leaves;  // one per component (Tree only)
};

double fixed_to_double(int128 units) { return static_cast<double>(static_cast<long double>(units) / 0x1p32L); }

// A user's partial value of the aggregate's column: the clamped mean (nullopt without a non-NULL value).
std::optional<int128> clamped_mean(const AggregateSlots& s, const std::uint64_t* contrib) {
  const std::uint64_t* col = contrib + 2 + 3 * static_cast<std::size_t>(s.value_column);
  if (col[0] == 0) return std::nullopt;
  const int128 sum = words_to_int128(col + 1), n = static_cast<int128>(col[0]);
  int128 q = sum / n;
  if ((sum % n != 0) && (sum < 0)) --q;  // floor
  return std::clamp(q, s.lower, s.upper);
}

std::uint16_t leaf_of(double x, double lo, double hi) {
  if (!(hi > lo)) return 0;
  const double f = std::floor((x - lo) / (hi - lo) * 65536.0);
  return static_cast<std::uint16_t>(std::clamp(f, 0.0, 65535.0));
}

// Adds one user's contribution (row [gid, rows, values...]) to its group.
void accumulate(const QueryPlan& plan, const std::uint64_t* contrib, GroupAcc& g) {
  ++g.users;
  for (std::size_t a = 0; a < plan.query.aggregates.size(); ++a) {
    const AggregateSlots& s = plan.slots[a];
    if (s.users >= 0) g.sums[static_cast<std::size_t>(s.users)] = int128{static_cast<std::int64_t>(g.users)} << 32;
    if (s.main < 0) continue;
    const Component& c = plan.components[static_cast<std::size_t>(s.main)];
    int128& sum = g.sums[static_cast<std::size_t>(s.main)];
    if (c.what == What::Count) {
      const std::uint64_t n =
          s.value_column < 0 ? contrib[1] : contrib[2 + 3 * static_cast<std::size_t>(s.value_column)];
      sum += int128{static_cast<std::int64_t>(std::min<std::uint64_t>(n, static_cast<std::uint64_t>(s.count_cap)))}
             << 32;
      continue;
    }
    if (c.what == What::Sum) {
      const std::uint64_t* col = contrib + 2 + 3 * static_cast<std::size_t>(s.value_column);
      if (col[0] > 0) sum += std::clamp(words_to_int128(col + 1), s.lower, s.upper);
      continue;
    }
    const auto x = clamped_mean(s, contrib);
    if (!x) continue;
    if (c.what == What::Tree) {
      g.leaves[static_cast<std::size_t>(s.main)].push_back(
          leaf_of(fixed_to_double(*x), fixed_to_double(s.lower), fixed_to_double(s.upper)));
      continue;
    }
    sum += *x - s.center;  // CenteredSum
    if (s.squares >= 0)
      g.sums[static_cast<std::size_t>(s.squares)] += (((*x - s.center) * (*x - s.center)) >> 32) - s.half_square;
  }
}

// (round(S / g) + X) g in units, X the component's noise for this group.
int128 noisy_units(const Component& c, int128 true_units, noise::NodeStream& rng) {
  const int e = c.lattice_exp;
  const int128 sg = e == 0 ? true_units : (true_units + (int128{1} << (e - 1))) >> e;
  return (sg + c.sample(rng)) << e;
}

struct Released {
  std::vector<std::string> text;  // one per aggregate
};

std::string format_count(int128 units) { return fmt::format("{}", static_cast<std::int64_t>(units >> 32)); }
std::string format_value(double v) { return fmt::format("{}", v); }

// The noisy count of the tree node covering leaves [first, first + span): true count from the sorted leaves.
double node_count(const Component& c, const std::vector<std::uint16_t>& leaves, std::uint32_t first, std::uint32_t span,
                  noise::NodeStream&& rng) {
  const auto lo = std::lower_bound(leaves.begin(), leaves.end(), first);
  const auto hi = std::lower_bound(lo, leaves.end(), first + span);
  const int128 n = static_cast<int128>(hi - lo) << 32;
  return std::max(0.0, fixed_to_double(noisy_units(c, n, rng)));
}

// The quantile descent of docs/SQL.md over noisy node counts.
double quantile(const Component& c, std::size_t comp, std::uint64_t gid, const std::vector<std::uint16_t>& leaves,
                double p, double lo, double hi, noise::WindowPrf& prf) {
  std::uint32_t first = 0, span = 65536;
  double q = p;
  for (std::uint32_t level = 1; level <= static_cast<std::uint32_t>(kTreeDepth); ++level) {
    span /= kTreeBranching;
    std::array<double, kTreeBranching> cnt{};
    double total = 0;
    for (std::uint32_t j = 0; j < kTreeBranching; ++j) {
      const std::uint32_t start = first + j * span;
      const noise::NodeId id{gid, noise::Family::SqlQuantile, static_cast<std::uint32_t>(comp), level, start / span};
      total += cnt[j] = node_count(c, leaves, start, span, noise::NodeStream(prf, id));
    }
    if (total <= 0) {
      span *= kTreeBranching;
      break;
    }
    const double target = q * total;
    double before = 0;
    std::uint32_t j = 0;
    for (; j < kTreeBranching; ++j)
      if (cnt[j] > 0 && before + cnt[j] >= target)
        break;
      else
        before += cnt[j];
    if (j == kTreeBranching) {  // rounding: the last non-empty child
      j = kTreeBranching - 1;
      while (cnt[j] <= 0) --j;
      before = total - cnt[j];
    }
    q = std::clamp((target - before) / cnt[j], 0.0, 1.0);
    first += j * span;
  }
  const double width = (hi - lo) / 65536.0;
  return lo + (first + q * span) * width;
}

// Released aggregates of one kept group.
std::vector<std::string> release_group(const QueryPlan& plan, std::uint64_t gid, GroupAcc& g,
                                       std::int64_t selection_count, noise::WindowPrf& prf) {
  std::vector<std::optional<int128>> noisy(plan.components.size());
  auto component = [&](int idx) {
    auto& v = noisy[static_cast<std::size_t>(idx)];
    if (!v) {
      const noise::NodeId id{gid, noise::Family::SqlAggregate, static_cast<std::uint32_t>(idx), 0, 0};
      noise::NodeStream rng(prf, id);
      const int128 truth = plan.components[static_cast<std::size_t>(idx)].what == What::Users
                               ? int128{static_cast<std::int64_t>(g.users)} << 32
                               : g.sums[static_cast<std::size_t>(idx)];
      v = noisy_units(plan.components[static_cast<std::size_t>(idx)], truth, rng);
    }
    return *v;
  };
  std::vector<std::string> out;
  for (std::size_t a = 0; a < plan.query.aggregates.size(); ++a) {
    const Aggregate& agg = plan.query.aggregates[a];
    const AggregateSlots& s = plan.slots[a];
    const double users = s.users_from_selection ? static_cast<double>(selection_count)
                         : s.users >= 0         ? fixed_to_double(component(s.users))
                                                : 0;
    const double n = std::max(1.0, users);
    const double lo = fixed_to_double(s.lower), hi = fixed_to_double(s.upper), m = fixed_to_double(s.center);
    switch (agg.kind) {
      case AggKind::Count:
        out.push_back(format_count(component(s.main)));
        break;
      case AggKind::CountDistinct:
        out.push_back(s.users_from_selection ? fmt::format("{}", selection_count) : format_count(component(s.users)));
        break;
      case AggKind::Sum:
        out.push_back(format_value(fixed_to_double(component(s.main))));
        break;
      case AggKind::Avg:
        out.push_back(format_value(std::clamp(m + fixed_to_double(component(s.main)) / n, lo, hi)));
        break;
      case AggKind::Var:
      case AggKind::Stddev: {
        const double mean = fixed_to_double(component(s.main)) / n;
        const double h = fixed_to_double(s.half_square) * 2;
        const double sq = (fixed_to_double(component(s.squares)) + n * fixed_to_double(s.half_square)) / n;
        const double var = std::clamp(sq - mean * mean, 0.0, h);
        out.push_back(format_value(agg.kind == AggKind::Var ? var : std::sqrt(var)));
        break;
      }
      case AggKind::Ntile: {
        auto& leaves = g.leaves[static_cast<std::size_t>(s.main)];
        out.push_back(format_value(quantile(plan.components[static_cast<std::size_t>(s.main)],
                                            static_cast<std::size_t>(s.main), gid, leaves, agg.p, lo, hi, prf)));
        break;
      }
    }
  }
  return out;
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\r\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char ch : s) out += ch == '"' ? std::string("\"\"") : std::string(1, ch);
  return out + "\"";
}

// Groups listed for public selection: their encodings (each rank reads the file).
std::vector<std::string> read_public_groups(const std::string& path, const Query& q, bool windowed) {
  refuse_non_regular_input(path, "give --public-groups a CSV file that lists the groups to release");
  if (!std::filesystem::exists(path))
    throw InputError(
        fmt::format("--public-groups {}: no such file; give a CSV file that lists the groups to release", path));
  MappedFile file(path);
  const std::string_view all = file.view();
  const std::size_t header_end = std::min(all.find('\n'), all.size());
  std::vector<std::string> header, fields, out;
  split_csv_header(all.substr(0, header_end), header);
  std::vector<std::size_t> idx;
  std::vector<std::string> columns = q.group_by;
  if (windowed) columns.insert(columns.begin(), "window");  // per window: (window, group) pairs are listed
  for (const std::string& g : columns) {
    const auto it = std::find(header.begin(), header.end(), g);
    if (it == header.end())
      throw InputError(
          fmt::format("{}: no column {} in the public groups' header ({}); it needs the GROUP BY columns "
                      "(and a column window, the window numbers, with --per-window)",
                      path, g, quoted_header(header)));
    idx.push_back(static_cast<std::size_t>(it - header.begin()));
  }
  for_each_csv_line(
      all, std::min(header_end + 1, all.size()), all.size(), [&](std::size_t offset, std::string_view line) {
        if (!split_csv_line(line, fields) || fields.size() != header.size())
          throw InputError(
              fmt::format("{}:{}: malformed row '{}'", path, line_number_of(all, offset), quoted_row(line)));
        if (windowed) {  // the window as the data spells it: a canonical integer
          std::int64_t w = 0;
          const std::string& t = fields[idx[0]];
          const auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), w);
          if (ec != std::errc() || p != t.data() + t.size() || t.empty())
            throw InputError(fmt::format("{}:{}: window '{}' is not an integer window number", path,
                                         line_number_of(all, offset), t));
          fields[idx[0]] = std::to_string(w);
        }
        std::vector<std::string_view> g(idx.size());
        for (std::size_t j = 0; j < idx.size(); ++j) g[j] = fields[idx[j]];
        out.push_back(encode_group(g));
      });
  return out;
}

noise::Secret job_secret(const QueryJob& job, const shuffle::Comm& comm) {
  noise::Secret secret{};
  if (job.seed) return noise::secret_from_seed(*job.seed);
  if (comm.rank() == 0) secret = noise::secret_from_os();
  comm.broadcast(secret.data(), secret.size());
  return secret;
}

constexpr std::size_t kNoContribution = ~std::size_t{0};  // a listed group's entry in the release order

void reset(GroupAcc& g) {
  g.users = 0;
  std::fill(g.sums.begin(), g.sums.end(), 0);
  for (auto& l : g.leaves) l.clear();
}

GroupAcc empty_acc(const QueryPlan& plan) {
  GroupAcc g;
  g.sums.assign(plan.components.size(), 0);
  g.leaves.resize(plan.components.size());
  return g;
}

// Every (gid, name) to the group's owner.
void ship_names(const absl::flat_hash_map<std::uint64_t, std::string>& local,
                absl::flat_hash_map<std::uint64_t, std::string>& owned, const shuffle::Comm& comm) {
  const int P = comm.size();
  std::vector<shuffle::ByteWriter> to(static_cast<std::size_t>(P));
  for (const auto& [gid, name] : local) {
    auto& w = to[static_cast<std::size_t>(partition::key_owner(gid, P))];
    w.put(gid);
    w.put_string(name);
  }
  std::vector<std::byte> send;
  std::vector<std::uint64_t> offsets{0};
  for (auto& w : to) send.insert(send.end(), w.bytes().begin(), w.bytes().end()), offsets.push_back(send.size());
  std::vector<std::uint64_t> recv_offsets;
  const auto bytes = comm.alltoallv_bytes(send.data(), offsets, recv_offsets);
  shuffle::ByteReader r(bytes.data(), bytes.size());
  while (!r.done()) {
    const auto gid = r.get<std::uint64_t>();
    owned.try_emplace(gid, r.get_string());
  }
}

// A result row with its sort key: by window (numerically), then by the group values.
struct SortedRow {
  std::int64_t window;
  std::vector<std::string> group;
  std::string line;
  bool operator<(const SortedRow& o) const { return std::tie(window, group) < std::tie(o.window, o.group); }
};

void write_outputs(const QueryJob& job, const std::vector<SortedRow>& rows, const nlohmann::json& report) {
  std::string csv;
  std::vector<std::string> names;
  if (job.plan.options.windows.per_window) names.emplace_back("window");
  for (const SelectItem& s : job.plan.query.select) names.push_back(csv_field(s.name));
  csv += fmt::format("{}\n", fmt::join(names, ","));
  for (const auto& r : rows) csv += r.line;
  // Both texts before either file (the query's text may hold invalid UTF-8: replaced in the report, not fatal), and
  // both files or neither: a report that cannot be written takes the result with it.
  const std::string report_text = report.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  fs::create_directories(job.out_dir);
  const fs::path result = fs::path(job.out_dir) / "result.csv";
  write_file_atomically(result, csv);
  try {
    write_file_atomically(fs::path(job.out_dir) / "report.json", report_text);
  } catch (...) {
    std::error_code ec;
    fs::remove(result, ec);  // refuse_existing_outputs saw none there, and --out is this query's (locked)
    throw;
  }
}

// The ledger's charge for the query on each window it reads (Sage's block composition: a query over the
// union of blocks is (eps, delta)-DP for one user's rows in any one block). Gaussian-only plans charge
// zCDP: rho, plus the selection's delta on one side only (a group of the added user alone released).
ledger::Request ledger_request(const QueryJob& job, const noise::Secret& secret) {
  const QueryPlan& p = job.plan;
  const WindowSpec& w = p.options.windows;
  ledger::Request r;
  r.job = "query";
  r.mechanism =
      fmt::format("dpstream query (DP SQL): selection {}, noise {}, k = {}, {}", p.selection.describe(),
                  p.options.noise == NoiseKind::Gaussian ? "gaussian" : "laplace", p.options.max_groups_per_user,
                  w.per_window ? "per window" : "one release over the windows");
  // One release over several blocks: a block's unit (one user's rows in it) is only part of the user's rows,
  // and removing it turns the user into a smaller one (re-clamped partials, re-sampled groups), i.e. a
  // replacement: group privacy of 2. zCDP: 4 rho, and the thresholds' bad event may occur on either input
  // (coupled); basic: (2 eps, (1 + e^eps) delta). Per window or one block: a block's unit is a whole unit.
  const bool spans = !w.per_window && *w.last > *w.first;
  r.zcdp = p.eps_pure == 0;
  r.rho = r.zcdp ? (spans ? 4 : 1) * p.rho_total : 0;
  r.delta_extra = r.zcdp && !spans ? p.delta_threshold : 0;
  r.coupled = r.zcdp && spans ? p.delta_threshold : 0;
  r.epsilon = spans ? 2 * p.eps_total : p.eps_total;
  r.delta = spans ? (1 + std::exp(p.eps_total)) * p.delta_total : p.delta_total;
  if (spans) r.mechanism += " (group privacy 2 per block: a block holds part of a user's rows)";
  // From first to last without ++ past the last (last may be INT64_MAX); check_query_job bounds the span.
  for (std::int64_t b = *w.first;; ++b) {
    r.blocks.push_back(b);
    if (b == *w.last) break;
  }
  const std::string fingerprint =
      fmt::format("query\n{}\n{}\n{}\n{}", job.text, job.input,
                  plan_json(p).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), w.per_window);
  r.run_id = ledger::run_id(secret.data(), secret.size(), fingerprint);
  return r;
}

// Rank 0 charges the ledger before any record is read; a refusal stops every rank (exit 2).
void charge_ledger(const QueryJob& job, const noise::Secret& secret, const shuffle::Comm& comm) {
  if (job.ledger.empty()) return;
  std::string error;
  if (comm.rank() == 0) try {
      ledger::charge_or_refuse(job.ledger, job.plan.options.windows.seconds, ledger_request(job, secret));
    } catch (const std::exception& e) {
      error = e.what();
    }
  if (error = comm.agree_on_error(error); !error.empty()) throw ConfigError(error);
  fault::point("query_charged");  // tests: a stop signal from here on must not cost the charge its output
}

// On rank 0, the first non-empty string of the ranks in rank order (ranks read the file's parts in order); collective.
std::string first_of_ranks(const std::string& mine, const shuffle::Comm& comm) {
  shuffle::ByteWriter w;
  w.put_string(mine);
  const std::vector<std::byte> all = comm.gather_bytes_to_root(w.bytes());
  shuffle::ByteReader r(all.data(), all.size());
  while (!r.done())
    if (std::string s = r.get_string(); !s.empty()) return s;
  return {};
}

}  // namespace

void check_query_job(const QueryJob& job) {
  const auto& plan = job.plan;
  table_layout(job.input, plan.query, plan.options.user_column, plan.value_columns, plan.options.windows);
  if (plan.options.selection == SelectionKind::Public) {
    if (job.public_groups.empty())
      throw ConfigError("--selection public needs --public-groups FILE: a CSV listing the groups to release");
    read_public_groups(job.public_groups, plan.query, plan.options.windows.per_window);
  } else if (!job.public_groups.empty()) {
    throw ConfigError("--public-groups is only for --selection public");
  }
  if (job.out_dir.empty()) throw ConfigError("--out DIR is required: where result.csv and report.json go");
  if (job.bad_rows == BadRowPolicy::Fail && !job.seed)
    throw ConfigError(
        "--bad-rows fail would stop a private query because of one row: the stop is an output that depends on the "
        "data. Use --bad-rows skip (skipped rows are counted), or check the input first with --seed S (not private)");
  if (!job.ledger.empty()) {
    const WindowSpec& w = plan.options.windows;
    if (!w.active() || !w.first)
      throw ConfigError(
          "--ledger needs --window-column and --windows A:B: the blocks charged are declared before "
          "reading, never found in the data");
    if (job.seed)
      throw ConfigError("--ledger with --seed: a seeded query is not private (its noise is known); drop one of them");
    std::int64_t span = 0;  // B - A (plan_query checked A <= B), which may leave int64: A far below 0, B far above
    if (__builtin_sub_overflow(*w.last, *w.first, &span) || span >= 100000)
      throw ConfigError("--windows A:B spans more than 100000 windows");
  }
  refuse_existing_outputs(job.out_dir);
}

void refuse_existing_outputs(const std::string& out_dir, std::initializer_list<const char*> names) {
  for (const char* f : names)
    if (fs::exists(fs::path(out_dir) / f))
      throw ConfigError(fmt::format("{} exists already; remove it or choose another --out (nothing is overwritten)",
                                    (fs::path(out_dir) / f).string()));
}

QueryCounters run_query(const QueryJob& job, const shuffle::Comm& comm) {
  const QueryPlan& plan = job.plan;
  const int P = comm.size();
  const auto start = SteadyClock::now();
  auto lap = [t = start]() mutable {
    const double s = seconds_since(t);
    t = SteadyClock::now();
    return s;
  };
  const noise::Secret secret = job_secret(job, comm);
  charge_ledger(job, secret, comm);
  IdPrf ids(secret);
  const TableLayout layout =
      table_layout(job.input, plan.query, plan.options.user_column, plan.value_columns, plan.options.windows);
  LocalTable local = read_local_table(job.input, plan.query, layout, job.bad_rows, ids, comm);
  QueryCounters counters;
  counters.read_s = lap();
  counters.rows = local.stats.rows, counters.bad = local.stats.bad, counters.filtered_out = local.stats.filtered_out;
  counters.kept = local.stats.kept;
  const std::string first_bad = first_of_ranks(local.stats.first_bad, comm);

  // Public selection: the listed groups, known to every rank, so that bounding samples among them only.
  const bool is_public = plan.options.selection == SelectionKind::Public;
  absl::flat_hash_map<std::uint64_t, std::string> listed;
  if (is_public)
    for (std::string& enc : read_public_groups(job.public_groups, plan.query, plan.options.windows.per_window))
      listed.try_emplace(ids(IdDomain::Key, enc).id, std::move(enc));

  // Stage 1: to the user's owner, merge, (public: drop unlisted groups), bound. Each buffer is freed as
  // soon as the next stage holds its data (peak memory: about two copies of the partials).
  const std::size_t s = local.partials.stride();
  std::vector<std::uint64_t> offsets;
  auto send = by_destination(
      local.partials.words, s, P, [&](const std::uint64_t* p) { return partition::user_owner(p[0], P); }, offsets);
  release(local.partials.words);
  auto received = comm.alltoallv(send, offsets);
  release(send);
  auto merged = merge_partials(received, s);
  release(received);
  if (is_public) merged = keep_listed(merged, s, listed, counters);
  counters.by_user_s = lap();
  auto bounded = bound_users(merged, s, plan.options.max_groups_per_user, SampleRank(secret), counters);
  release(merged);
  counters.bound_s = lap();

  // Stage 2: to the group's owner, aggregate.
  const std::size_t cs = s - 1;
  send = by_destination(
      bounded, cs, P, [&](const std::uint64_t* p) { return partition::key_owner(p[0], P); }, offsets);
  release(bounded);
  const auto contribs = comm.alltoallv(send, offsets);
  release(send);
  absl::flat_hash_map<std::uint64_t, std::string> names;  // of the groups this rank owns
  ship_names(local.group_names, names, comm);
  std::vector<std::pair<std::uint64_t, std::size_t>> order;  // (gid, offset) of every contribution, then listed groups
  order.reserve(contribs.size() / cs);
  for (std::size_t i = 0; i < contribs.size(); i += cs) order.emplace_back(contribs[i], i);
  for (const auto& [gid, enc] : listed) {
    if (partition::key_owner(gid, P) != comm.rank()) continue;
    names.try_emplace(gid, enc);
    order.emplace_back(gid, kNoContribution);  // released even when empty
  }
  std::sort(order.begin(), order.end());
  counters.by_group_s = lap();

  // Aggregation, selection and release, one group at a time in gid order (one accumulator, reused).
  noise::WindowPrf prf(secret, job.noise_stream);
  shuffle::ByteWriter rows;
  GroupAcc g = empty_acc(plan);
  for (std::size_t i = 0; i < order.size();) {
    const std::uint64_t gid = order[i].first;
    reset(g);
    for (; i < order.size() && order[i].first == gid; ++i)
      if (order[i].second != kNoContribution) accumulate(plan, &contribs[order[i].second], g);
    if (g.users > 0) ++counters.groups;
    for (auto& l : g.leaves) std::sort(l.begin(), l.end());
    noise::NodeStream rng(prf, noise::NodeId{gid, noise::Family::SqlSelection, 0, 0, 0});
    const auto decision = plan.options.selection == SelectionKind::Public
                              ? Selection::Decision{true, static_cast<std::int64_t>(g.users)}
                              : plan.selection.decide(g.users, rng);
    if (!decision.keep) continue;
    ++counters.groups_released;
    const auto values = release_group(plan, gid, g, decision.noisy_count, prf);
    const std::string& enc = names.at(gid);
    std::vector<std::string> line;
    auto fields = decode_group(enc);
    if (plan.options.windows.per_window) {  // the window leads the group's fields and the row
      line.push_back(fields.front());
      fields.erase(fields.begin());
    }
    for (const SelectItem& it : plan.query.select) {
      if (it.is_aggregate) {
        line.push_back(values[it.aggregate]);
        continue;
      }
      const auto pos = std::find(plan.query.group_by.begin(), plan.query.group_by.end(), it.column);
      line.push_back(csv_field(fields[static_cast<std::size_t>(pos - plan.query.group_by.begin())]));
    }
    rows.put_string(enc);
    rows.put_string(fmt::format("{}\n", fmt::join(line, ",")));
  }

  counters.release_s = lap();

  // Rank 0 sorts the rows by their group values and writes both files.
  const auto all = comm.gather_bytes_to_root(rows.bytes());
  const auto sums =
      comm.sum(std::vector<std::uint64_t>{counters.rows, counters.bad, counters.filtered_out, counters.kept,
                                          counters.user_groups, counters.user_groups_dropped, counters.users,
                                          counters.groups, counters.groups_released, counters.user_groups_unlisted});
  const QueryCounters times = counters;
  counters = QueryCounters{sums[0], sums[1], sums[2], sums[3], sums[4], sums[5], sums[6], sums[7], sums[8], sums[9]};
  counters.read_s = times.read_s, counters.by_user_s = times.by_user_s, counters.bound_s = times.bound_s;
  counters.by_group_s = times.by_group_s, counters.release_s = times.release_s;
  counters.first_bad = first_bad;
  std::string error;
  if (comm.rank() == 0) try {
      std::vector<SortedRow> sorted;
      shuffle::ByteReader r(all.data(), all.size());
      while (!r.done()) {
        auto fields = decode_group(r.get_string());
        const bool windowed = plan.options.windows.per_window;
        const std::int64_t window = windowed ? std::stoll(fields.front()) : 0;
        if (windowed) fields.erase(fields.begin());
        sorted.push_back({window, std::move(fields), r.get_string()});
      }
      std::sort(sorted.begin(), sorted.end());
      nlohmann::json report = plan_json(plan);
      report["query"] = job.text;
      report["seeded"] = job.seed.has_value();
      report["not_dp"] = {{"note",
                           "raw counters of the input: not differentially private; for the data holder running the "
                           "query, not part of the release (publish result.csv and this file without not_dp)"},
                          {"rows_read", counters.rows},
                          {"rows_bad", counters.bad},
                          {"rows_filtered_out", counters.filtered_out},
                          {"rows_kept", counters.kept},
                          {"users", counters.users},
                          {"user_groups", counters.user_groups},
                          {"user_groups_dropped_by_bounding", counters.user_groups_dropped},
                          {"user_groups_not_listed", counters.user_groups_unlisted},
                          {"groups", counters.groups},
                          {"groups_released", counters.groups_released}};
      counters.write_s = lap();
      counters.total_s = seconds_since(start);
      report["not_dp"]["timings_seconds"] = {{"read", counters.read_s},
                                             {"exchange_by_user", counters.by_user_s},
                                             {"bound", counters.bound_s},
                                             {"exchange_by_group", counters.by_group_s},
                                             {"release", counters.release_s},
                                             {"gather_and_sort", counters.write_s},
                                             {"total_before_write", counters.total_s},
                                             {"ranks", comm.size()}};
      try {
        write_outputs(job, sorted, report);
      } catch (const std::exception& e) {  // the file system's refusal (full, read-only): both files are absent
        error = fmt::format("W{}", e.what());
      }
    } catch (const std::exception& e) {
      error = fmt::format("X{}", e.what());
    }
  if (error = comm.agree_on_error(error); !error.empty()) {
    if (error[0] != 'W') throw std::runtime_error(error.substr(1));  // not the data's: a bug (MPI_Abort)
    throw ConfigError(
        fmt::format("cannot write the query's output to {}: {}; neither result.csv nor report.json was "
                    "written (free space, or choose another --out)",
                    job.out_dir, error.substr(1)));
  }
  return counters;
}

}  // namespace dpstream::sql
