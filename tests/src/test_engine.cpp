// The whole trigger loop under MPI (run at 1-4 ranks) against the naive single-threaded oracle.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sched.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "kernels/aes_blocks.hpp"
#include "partition/hash.hpp"
#include "src/config.hpp"
#include "src/csv_input.hpp"
#include "src/engine.hpp"
#include "src/errors.hpp"
#include "src/id_prf.hpp"
#include "src/release_writer.hpp"
#include "src/workload.hpp"
#include "tests/mpi_scratch.hpp"
#include "tools/bench_result.hpp"
#include "tools/naive_reference.hpp"

using namespace dpstream;
namespace fs = std::filesystem;

namespace {
// A fresh directory per test (an earlier, interrupted run must not leave a checkpoint to refuse).
fs::path out_dir(const shuffle::Comm& comm, const std::string& name) {
  auto dir = dpstream::testing::mpi_scratch_path("engine_" + name);
  comm.barrier();
  if (comm.rank() == 0) fs::remove_all(dir);
  comm.barrier();
  return dir;
}

std::string read_file(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The expected releases.csv, from the naive reference over the same stream.
std::string expected_releases(const JobConfig& c, std::vector<std::vector<Record>> triggers,
                              const std::function<std::string(std::uint64_t)>& name, bool sort_by_name) {
  std::ostringstream out;
  out << "window,trigger,key,count,sum\n";
  NaiveReference naive(c.privacy.max_records_per_user, c.privacy.clamp_min, c.privacy.clamp_max);
  std::size_t g = 0;
  for (std::uint32_t w = 0; w < c.stream.windows; ++w) {
    naive.begin_window();
    for (std::uint32_t t = 0; t < c.stream.triggers; ++t) {
      auto rows = naive.process(std::move(triggers[g++]));
      if (sort_by_name)
        std::sort(rows.begin(), rows.end(), [&](auto& a, auto& b) { return name(a.key) < name(b.key); });
      for (const auto& r : rows)
        out << c.stream.first_window + w << ',' << t << ',' << name(r.key) << ',' << r.count << ','
            << format_fixed(r.sum) << '\n';
    }
  }
  return out.str();
}
}  // namespace

namespace {
// `batch` triggers go through each step together ([engine] trigger_batch; 4 of 9: batches 4, 4, 1 a window):
// the same rows as one trigger at a time.
// `calls`: summary.json's collective_calls (rank 0).
void synthetic_job_matches_naive_reference(std::uint32_t batch, std::uint64_t* calls = nullptr) {
  shuffle::Comm comm;
  const auto dir = out_dir(comm, fmt::format("synthetic_batch{}", batch));
  auto c = parse_job(demo_job_toml(), "demo",
                     {"input.users=5000", "stream.triggers=9", "stream.windows=2", "privacy.max_records_per_user=4",
                      fmt::format("engine.trigger_batch={}", batch), "output.progress=\"never\"",
                      "output.dir=\"" + dir.string() + "\""});
  const auto report = run_job(c, comm, {});
  if (comm.rank() != 0) return;
  SyntheticSource all(c, 0, 1);
  std::vector<std::vector<Record>> triggers;
  for (std::uint32_t w = 0; w < 2; ++w)
    for (std::uint32_t t = 0; t < 9; ++t) triggers.push_back(all.take_trigger(w, t));
  const auto want = expected_releases(
      c, triggers, [](std::uint64_t k) { return std::to_string(k); }, false);
  EXPECT_EQ(read_file(dir / "releases.csv"), want);
  EXPECT_TRUE(fs::exists(dir / "summary.json"));
  EXPECT_FALSE(fs::exists(dir / ".releases.csv.partial"));
  // Every rank's wall and seconds inside collectives, the latter a part of the former.
  const auto per_rank = nlohmann::json::parse(read_file(dir / "summary.json")).at("seconds_per_rank");
  ASSERT_EQ(per_rank.at("wall").size(), static_cast<std::size_t>(comm.size()));
  ASSERT_EQ(per_rank.at("in_collectives").size(), static_cast<std::size_t>(comm.size()));
  for (int r = 0; r < comm.size(); ++r) {
    EXPECT_GT(per_rank["wall"][r].get<double>(), 0.0);
    EXPECT_GT(per_rank["in_collectives"][r].get<double>(), 0.0);  // every trigger shuffles, even at one rank
    EXPECT_LE(per_rank["in_collectives"][r].get<double>(), per_rank["wall"][r].get<double>());
  }
  // Every stage per rank, each rank's stages within its wall; their maxima are the summary's stage maxima.
  const auto summary = nlohmann::json::parse(read_file(dir / "summary.json"));
  const auto& stages = per_rank.at("stages");
  ASSERT_EQ(stages.size(), summary.at("stage_seconds_max_over_ranks").size());
  std::vector<double> summed(static_cast<std::size_t>(comm.size()), 0.0);
  for (const auto& [name, ranks] : stages.items()) {
    ASSERT_EQ(ranks.size(), static_cast<std::size_t>(comm.size())) << name;
    double most = 0;
    for (int r = 0; r < comm.size(); ++r) {
      most = std::max(most, ranks[r].get<double>());
      summed[static_cast<std::size_t>(r)] += ranks[r].get<double>();
    }
    EXPECT_NEAR(most, summary["stage_seconds_max_over_ranks"][name].get<double>(), 1.5e-6) << name;
  }
  for (int r = 0; r < comm.size(); ++r)
    EXPECT_LE(summed[static_cast<std::size_t>(r)], per_rank["wall"][r].get<double>() + 1e-5);
  const auto n_calls = summary.at("collective_calls").get<std::uint64_t>();
  EXPECT_DOUBLE_EQ(summary.at("collective_calls_per_trigger").get<double>(), static_cast<double>(n_calls) / 18);
  if (calls) *calls = n_calls;
  // Every rank's cipher engine counted once: this CPU's, on every rank of this one machine.
  const auto& cipher = summary.at("noise_cipher_ranks");
  const bool vaes = dpstream::noise::Aes256Blocks::best_engine() == dpstream::noise::Aes256Blocks::Engine::Vaes512;
  EXPECT_EQ(cipher.at("vaes512").get<int>(), vaes ? comm.size() : 0);
  EXPECT_EQ(cipher.at("openssl").get<int>(), vaes ? 0 : comm.size());
}
}  // namespace

TEST(Engine, SyntheticJobMatchesNaiveReference) { synthetic_job_matches_naive_reference(1); }
// Batches of 4 of 9 triggers (4, 4, 1 a window) share each step's exchange and agreement: at most half the
// collectives of one trigger at a time (6 batches against 18 triggers, plus the job's set-up and summary).
TEST(Engine, SyntheticJobInBatchesOfTriggersMatchesNaiveReference) {
  std::uint64_t batched = 0, single = 0;
  synthetic_job_matches_naive_reference(4, &batched);
  synthetic_job_matches_naive_reference(1, &single);
  if (shuffle::Comm().rank() == 0) {
    EXPECT_GT(batched, 0U);
    EXPECT_LE(2 * batched, single) << batched << " collectives in batches, " << single;
  }
}

// `bench --repeats`: the summary line's fastest, median and slowest, read back from the line and computed here.
TEST(BenchRepeats, LineGivesFastestMedianAndSlowest) {
  const auto field = [](const std::string& line, const std::string& name) {
    std::smatch m;
    EXPECT_TRUE(std::regex_search(line, m, std::regex(" " + name + "=([0-9.]+)"))) << name << " in " << line;
    return std::stod(m[1]);
  };
  // Four repeats (an even count: the median is the mean of the middle two), given out of order.
  const std::vector<BenchRepeat> runs{{0.9, 2e6}, {0.3, 6e6}, {0.6, 3e6}, {0.4, 4.5e6}};
  const std::string line = bench_repeats_line("job", 2, 1, runs);
  EXPECT_EQ(line.rfind("RESULT_REPEATS job=job ranks=2 threads=1 repeats=4 ", 0), 0U) << line;
  EXPECT_DOUBLE_EQ(field(line, "engine_seconds_min"), 0.3);
  EXPECT_DOUBLE_EQ(field(line, "engine_seconds_median"), 0.5);
  EXPECT_DOUBLE_EQ(field(line, "engine_seconds_max"), 0.9);
  EXPECT_DOUBLE_EQ(field(line, "engine_records_per_s_per_core_best"), 6e6);
  EXPECT_DOUBLE_EQ(field(line, "engine_records_per_s_per_core_median"), 3.75e6);
  EXPECT_DOUBLE_EQ(field(line, "engine_records_per_s_per_core_worst"), 2e6);
  // An odd count: the middle one.
  EXPECT_DOUBLE_EQ(field(bench_repeats_line("job", 1, 1, {runs[0], runs[1], runs[2]}), "engine_seconds_median"), 0.6);
  // A repeat as the engine's summary gives it: the rate over the cores.
  const BenchRepeat r = bench_repeat(R"({"engine_path_seconds": 0.5, "engine_records_per_second": 8e6})", 4);
  EXPECT_DOUBLE_EQ(r.engine_seconds, 0.5);
  EXPECT_DOUBLE_EQ(r.records_per_s_per_core, 2e6);
}

// summary.json names the CPU each rank's main thread ran its batches on: here each rank's main thread is bound to
// one CPU (a different one per rank where there are enough), which the summary must give with a share of 1.
TEST(Engine, SummaryNamesTheCpuEachRankRanOn) {
  shuffle::Comm comm;
  cpu_set_t before;
  CPU_ZERO(&before);
  std::vector<int> allowed;
  if (sched_getaffinity(0, sizeof before, &before) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &before)) allowed.push_back(c);
  const int mine = allowed.empty() ? -1 : allowed[static_cast<std::size_t>(comm.rank()) % allowed.size()];
  cpu_set_t one;
  CPU_ZERO(&one);
  if (mine >= 0) CPU_SET(mine, &one);
    // This thread only: OpenMP's workers, started first so that they do not inherit the one-CPU mask, keep theirs
    // (and later tests of this process find them unbound). A bind is taken when the thread then runs there. Every
    // rank learns whether all could bind before the job's collectives, so that one rank's failure skips the test
    // everywhere instead of leaving the others waiting.
#pragma omp parallel
  {}
  const bool bound = mine >= 0 && sched_setaffinity(0, sizeof one, &one) == 0 && sched_getcpu() == mine;
  if (comm.sum(std::uint64_t{bound ? 0u : 1u}) != 0) {
    sched_setaffinity(0, sizeof before, &before);
    GTEST_SKIP() << "a rank could not bind its thread to one CPU here";
  }
  const std::vector<std::uint64_t> want = comm.allgather(static_cast<std::uint64_t>(mine));
  const auto dir = out_dir(comm, "cpus");
  auto c = parse_job(demo_job_toml(), "demo",
                     {"input.users=2000", "stream.triggers=9", "engine.trigger_batch=2", "output.progress=\"never\"",
                      "output.dir=\"" + dir.string() + "\""});
  run_job(c, comm, {});
  EXPECT_EQ(sched_setaffinity(0, sizeof before, &before), 0);
  if (comm.rank() != 0) return;
  const auto cpus = nlohmann::json::parse(read_file(dir / "summary.json")).at("main_cpu_per_rank");
  ASSERT_EQ(cpus.at("cpu").size(), static_cast<std::size_t>(comm.size()));
  ASSERT_EQ(cpus.at("share_of_batches").size(), static_cast<std::size_t>(comm.size()));
  for (int r = 0; r < comm.size(); ++r) {
    EXPECT_EQ(cpus["cpu"][r].get<std::int64_t>(), static_cast<std::int64_t>(want[static_cast<std::size_t>(r)])) << r;
    EXPECT_DOUBLE_EQ(cpus["share_of_batches"][r].get<double>(), 1.0) << r;
  }
}

namespace {
// String keys: each rank's rows sorted by name, merged on rank 0 per trigger, also from batches of triggers.
void csv_job_with_string_keys_matches_naive_reference(std::uint32_t batch) {
  shuffle::Comm comm;
  const auto dir = out_dir(comm, fmt::format("csv_batch{}", batch));
  const auto csv = dpstream::testing::mpi_scratch_path("engine_input") += ".csv";
  // Rank 0 writes the input; the others wait for it.
  std::ostringstream text;
  text << "user_id,key,value,timestamp\n";
  std::vector<std::vector<Record>> triggers(6);
  std::map<std::uint64_t, std::string> names;
  std::uint64_t state = 99;
  IdPrf ids(noise::secret_from_seed(23));  // the job's [privacy] seed below
  auto next = [&] { return state = state * 6364136223846793005ULL + 1442695040888963407ULL, state >> 33; };
  for (int i = 0; i < 3000; ++i) {
    const std::string user = "user " + std::to_string(next() % 40);
    const std::string key = (next() % 3 ? "key" : "k,\"") + std::to_string(next() % 30);
    const double value = static_cast<double>(next() % 1000) / 100.0 - 3.0;
    const std::int64_t ts = static_cast<std::int64_t>(next() % 600);
    const std::string quoted = fmt::format("\"{}\"", std::regex_replace(key, std::regex("\""), "\"\""));
    const std::size_t offset = text.str().size();
    text << '"' << user << "\"," << quoted << ',' << value << ',' << ts << '\n';
    triggers[static_cast<std::size_t>(ts * 6 / 600)].push_back(
        Record{ids(IdDomain::User, user).id, ids(IdDomain::Key, key).id, ts, offset, value});
    names[ids(IdDomain::Key, key).id] = key;
  }
  if (comm.rank() == 0) std::ofstream(csv) << text.str();
  comm.barrier();
  auto c =
      parse_job("[input]\nkind = \"csv\"\npath = \"" + csv.string() +
                    "\"\n[stream]\nwindow_seconds = 600\ntriggers = 6\n[privacy]\nseed = 23\nmax_records_per_user = 7\n"
                    "clamp_min = -1.5\nclamp_max = 4\n[engine]\ntrigger_batch = " +
                    std::to_string(batch) + "\n[output]\nprogress = \"never\"\ndir = \"" + dir.string() + "\"\n",
                "csv-test", {});
  run_job(c, comm, {});
  if (comm.rank() != 0) return;
  const auto want = expected_releases(
      c, triggers,
      [&](std::uint64_t k) {
        const auto& n = names.at(k);
        if (n.find_first_of(",\"") == std::string::npos) return n;
        return "\"" + std::regex_replace(n, std::regex("\""), "\"\"") + "\"";
      },
      true);
  EXPECT_EQ(read_file(dir / "releases.csv"), want);
}
}  // namespace

TEST(Engine, CsvJobWithStringKeysMatchesNaiveReference) { csv_job_with_string_keys_matches_naive_reference(1); }
TEST(Engine, CsvJobInBatchesOfTriggersMatchesNaiveReference) { csv_job_with_string_keys_matches_naive_reference(4); }

TEST(Engine, BadRowWithFailPolicyStopsEveryRankAndWritesNothing) {
  shuffle::Comm comm;
  const auto dir = out_dir(comm, "fail");
  const auto csv = dpstream::testing::mpi_scratch_path("engine_bad") += ".csv";
  if (comm.rank() == 0) {
    fs::remove_all(dir);
    std::ofstream f(csv);
    f << "user_id,key,value,timestamp\n";
    for (int i = 0; i < 500; ++i) f << "u" << i << ",k,1," << i << "\n";
    f << "u1,k,oops,3\n";
  }
  comm.barrier();
  auto c = parse_job(
      "[input]\nkind = \"csv\"\nbad_rows = \"fail\"\npath = \"" + csv.string() +
          "\"\n[stream]\ntriggers = 3\n[privacy]\nmax_records_per_user = 2\n[output]\nprogress = \"never\"\ndir = \"" +
          dir.string() + "\"\n",
      "bad", {});
  EXPECT_THROW(run_job(c, comm, {}), InputError);  // on every rank, not only where the row was
  comm.barrier();
  EXPECT_FALSE(fs::exists(dir / "releases.csv"));
  EXPECT_FALSE(fs::exists(dir / ".releases.csv.partial"));
  EXPECT_FALSE(fs::exists(dir / "summary.json"));
}

// Separation of colliding ids across ranks: every rank holds an overlapping share of 2000 distinct ids
// packed into 16 values of `id`; afterwards one original has one id everywhere, distinct originals
// have distinct ids, and the result equals a separation done by one process alone.
TEST(SeparateCollidingIds, DistinctEverywhereAndIndependentOfRanks) {
  const shuffle::Comm comm;
  std::vector<Id128> all;
  for (std::uint64_t i = 0; i < 2000; ++i) all.push_back({i % 16, partition::mix64(i + 1)});
  std::vector<Id128> mine;
  for (std::size_t i = 0; i < all.size(); ++i)
    if (i % static_cast<std::size_t>(comm.size()) == static_cast<std::size_t>(comm.rank()) || i % 7 == 0)
      mine.push_back(all[i]);
  const auto moved = separate_colliding_ids(mine, partition::kUserSalt, comm);
  const auto alone = separate_colliding_ids(all, partition::kUserSalt, shuffle::Comm(MPI_COMM_SELF));
  auto final_id = [](const absl::flat_hash_map<Id128, std::uint64_t>& m, const Id128& x) {
    const auto it = m.find(x);
    return it == m.end() ? x.id : it->second;
  };
  std::set<std::uint64_t> ids;
  for (const auto& x : all) ids.insert(final_id(alone, x));
  EXPECT_EQ(ids.size(), all.size());
  for (const auto& x : mine) EXPECT_EQ(final_id(moved, x), final_id(alone, x));
  EXPECT_EQ(alone.size(), all.size() - 16);  // the smallest check of each of the 16 groups keeps its id
}
