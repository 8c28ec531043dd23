#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "src/config.hpp"
#include "src/stream_clock.hpp"
#include "src/workload.hpp"

using namespace dpstream;

namespace {
JobConfig small_job(std::uint64_t users = 3000, std::uint32_t triggers = 7) {
  return parse_job("[input]\nusers = " + std::to_string(users) +
                       "\nkeys = 500\nseed = 11\n[stream]\ntriggers = " + std::to_string(triggers) +
                       "\nwindows = 2\nfirst_window = 3\n[privacy]\nmax_records_per_user = 4\n",
                   "test", {});
}

bool same_record(const Record& a, const Record& b) {
  return a.user == b.user && a.key == b.key && a.timestamp == b.timestamp && a.position == b.position &&
         a.value == b.value;
}
bool record_less(const Record& a, const Record& b) { return a.position < b.position; }

std::vector<std::vector<Record>> all_triggers(const JobConfig& c, int ranks) {
  std::vector<std::vector<Record>> out;
  std::vector<std::unique_ptr<SyntheticSource>> sources;
  sources.reserve(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) sources.push_back(std::make_unique<SyntheticSource>(c, r, ranks));
  for (std::uint32_t w = 0; w < c.stream.windows; ++w)
    for (std::uint32_t t = 0; t < c.stream.triggers; ++t) {
      std::vector<Record> merged;
      for (auto& s : sources) {
        auto part = s->take_trigger(c.stream.first_window + w, t);
        merged.insert(merged.end(), part.begin(), part.end());
      }
      std::sort(merged.begin(), merged.end(), record_less);
      out.push_back(std::move(merged));
    }
  return out;
}
}  // namespace

TEST(Workload, SameStreamForAnyRankCount) {
  const auto c = small_job();
  const auto one = all_triggers(c, 1);
  for (int ranks : {2, 3, 5}) {
    const auto many = all_triggers(c, ranks);
    ASSERT_EQ(one.size(), many.size());
    for (std::size_t t = 0; t < one.size(); ++t) {
      ASSERT_EQ(one[t].size(), many[t].size()) << "trigger " << t << " ranks " << ranks;
      for (std::size_t i = 0; i < one[t].size(); ++i) ASSERT_TRUE(same_record(one[t][i], many[t][i]));
    }
  }
}

TEST(Workload, RecordsFallInTheirTriggerAndFollowEachUsersStream) {
  const auto c = small_job();
  const StreamClock clock{c.stream.window_seconds, c.stream.triggers};
  const auto triggers = all_triggers(c, 1);
  SyntheticSource source(c, 0, 1);
  std::vector<std::vector<Record>> per_user(c.input.users);
  for (std::size_t g = 0; g < c.stream.triggers; ++g)  // first window only
    for (const auto& r : triggers[g]) {
      EXPECT_EQ(clock.window_of(r.timestamp), c.stream.first_window);
      EXPECT_EQ(clock.trigger_of(r.timestamp), g);
      EXPECT_GE(r.key, 1u);
      EXPECT_LE(r.key, c.input.keys);
      per_user[r.user].push_back(r);
    }
  for (std::uint64_t u = 0; u < c.input.users; ++u) {
    const auto want = source.user_records(c.stream.first_window, u);
    ASSERT_EQ(per_user[u].size(), want.size()) << "user " << u;
    for (std::size_t i = 0; i < want.size(); ++i) {
      EXPECT_TRUE(same_record(per_user[u][i], want[i])) << "user " << u << " record " << i;
      if (i) {
        EXPECT_LE(want[i - 1].timestamp, want[i].timestamp);  // sorted event times
      }
    }
  }
}

TEST(Workload, WindowsAreIndependentDraws) {
  const auto c = small_job(200);
  SyntheticSource s(c, 0, 1);
  int differ = 0;
  for (std::uint64_t u = 0; u < 200; ++u) differ += s.user_records(3, u).size() != s.user_records(4, u).size();
  EXPECT_GT(differ, 100);  // P[same count] = sum p^2 ~ 0.1
}

TEST(Workload, RecordsPerUserMeanAndUniformTimes) {
  // 40000 users: mean records per user 6.1149 (sd 6.93, SE 0.035; 6 SE bound), and the
  // trigger of each record is uniform over T = 8 slices (chi-square, 7 dof, bound 40: p < 1e-6).
  const auto c = small_job(40000, 8);
  SyntheticSource s(c, 0, 1);
  std::vector<double> per_trigger(8, 0);
  double total = 0;
  for (std::uint32_t t = 0; t < 8; ++t) total += per_trigger[t] = static_cast<double>(s.take_trigger(3, t).size());
  EXPECT_NEAR(total / 40000, 6.114885, 6 * 6.925 / std::sqrt(40000.0));
  double chi2 = 0;
  for (double x : per_trigger) chi2 += (x - total / 8) * (x - total / 8) / (total / 8);
  EXPECT_LT(chi2, 40.0);
}

// The sizing hints: every user has a record in every window, and the expected distinct keys is close
// to what a window's kept records (each user's first C = 4) hold (Zipf keys over 500, and uniform keys
// over a space larger than the records, where counting every record instead would be 1.5x too many).
TEST(Workload, SizingHintsMatchAWindow) {
  for (const char* keys : {"keys = 500\n", "key_distribution = \"uniform\"\nkeys = 100000\n"}) {
    const auto c = parse_job("[input]\nusers = 20000\nseed = 11\n" + std::string(keys) +
                                 "[stream]\ntriggers = 4\n[privacy]\nmax_records_per_user = 4\n",
                             "test", {});
    SyntheticSource s(c, 0, 1);
    std::vector<Record> window;
    for (std::uint32_t t = 0; t < 4; ++t)
      for (const Record& r : s.take_trigger(0, t)) window.push_back(r);
    std::sort(window.begin(), window.end(), [](const Record& a, const Record& b) {
      return std::tie(a.user, a.timestamp, a.position) < std::tie(b.user, b.timestamp, b.position);
    });
    std::set<std::uint64_t> users, distinct;
    std::uint64_t user = 0, kept = 0;
    for (const Record& r : window) {  // stream order within each user: its first 4 are kept
      if (users.insert(r.user).second) user = r.user, kept = 0;
      if (r.user == user && kept++ < 4) distinct.insert(r.key);
    }
    EXPECT_EQ(s.users_per_window(), users.size());
    EXPECT_NEAR(static_cast<double>(s.keys_per_window()), static_cast<double>(distinct.size()),
                0.02 * static_cast<double>(distinct.size()) + 2)
        << keys;
  }
}

TEST(StreamClock, WindowsAndTriggers) {
  const StreamClock clock{100, 7};
  EXPECT_EQ(clock.window_of(0), 0);
  EXPECT_EQ(clock.window_of(99), 0);
  EXPECT_EQ(clock.window_of(100), 1);
  EXPECT_EQ(clock.window_of(-1), -1);
  EXPECT_EQ(clock.trigger_of(0), 0u);
  EXPECT_EQ(clock.trigger_of(14), 0u);  // 14 * 7 / 100 = 0.98
  EXPECT_EQ(clock.trigger_of(15), 1u);  // 1.05
  EXPECT_EQ(clock.trigger_of(99), 6u);
  EXPECT_EQ(clock.trigger_of(115), 1u);
  const StreamClock big{std::int64_t{1} << 40, 1'000'000};
  EXPECT_EQ(big.trigger_of((std::int64_t{1} << 40) - 1), 999'999u);  // no overflow in offset * T
}

TEST(Workload, RecordsPerUserOnePlusXVariant) {
  // records_per_user_min = 0: records = 1 + X, X ~ Zipf-Mandelbrot on {0..1e5} (the data behind the
  // core paper's Table 1): mean 1 + 4.9047 from the reference file; every user has >= 1 record.
  std::ifstream f(std::string(DPSTREAM_REFERENCE_DIR) + "/zipf_mandelbrot.json");
  ASSERT_TRUE(f) << "missing tests/reference/zipf_mandelbrot.json";
  const auto ref = nlohmann::json::parse(f)["records_per_user"]["support_from_0"];
  auto c = small_job(40000, 8);
  c.input.records_per_user_min = 0;
  SyntheticSource s(c, 0, 1);
  double total = 0;
  std::uint64_t ones = 0;
  for (std::uint64_t u = 0; u < 40000; ++u) {
    const auto n = s.user_records(3, u).size();
    ASSERT_GE(n, 1u);
    total += static_cast<double>(n);
    ones += n == 1;
  }
  // 6 standard errors: false failure < 1e-8 per check.
  EXPECT_NEAR(total / 40000, 1 + ref["mean"].get<double>(), 6 * ref["std"].get<double>() / std::sqrt(40000.0));
  const double p1 = ref["P_X_eq_min"].get<double>();  // P[records = 1] = P[X = 0]
  EXPECT_NEAR(static_cast<double>(ones) / 40000, p1, 6 * std::sqrt(p1 * (1 - p1) / 40000));
}

TEST(Workload, UsersWithMoreRecordsThanTheCursorCachesFollowTheirStream) {
  // s = 1.2, q = 0: heavy-tailed record counts, many above the 2047 a cursor keeps (n_u drawn again).
  auto c = small_job(300, 5);
  c.input.records_per_user_s = 1.2;
  c.input.records_per_user_q = 0.0;
  const auto triggers = all_triggers(c, 2);
  SyntheticSource source(c, 0, 1);
  std::vector<std::vector<Record>> per_user(c.input.users);
  for (std::size_t g = 0; g < c.stream.triggers; ++g)
    for (const auto& r : triggers[g]) per_user[r.user].push_back(r);
  std::size_t big = 0;
  for (std::uint64_t u = 0; u < c.input.users; ++u) {
    const auto want = source.user_records(c.stream.first_window, u);
    big += want.size() > 2047;
    ASSERT_EQ(per_user[u].size(), want.size()) << "user " << u;
    for (std::size_t i = 0; i < want.size(); ++i) ASSERT_TRUE(same_record(per_user[u][i], want[i])) << "user " << u;
  }
  EXPECT_GT(big, 10u);
}

TEST(CounterRng, PrefixHashedOnceGivesTheSameStreams) {
  for (std::uint64_t s : {0ull, 5ull, ~0ull})
    for (std::uint64_t c : {0ull, 1ull, 77ull}) {
      CounterRng a(s, 3, 12345, c);
      CounterRng b = CounterRng::at(CounterRng::child(CounterRng::child(CounterRng::root(s), 3), 12345), c);
      CounterRng skipped = b;
      skipped.discard(2);  // = two draws thrown away
      for (int i = 0; i < 4; ++i) {
        const std::uint64_t x = a.next();
        EXPECT_EQ(x, b.next());
        if (i >= 2) {
          EXPECT_EQ(x, skipped.next());
        }
      }
    }
}

// next_position returns v for a user's last record where the stream was defined by pow(v, 1): the same
// only if this libm's pow is exact there. glibc's pow is within 0.52 ulp, which leaves v itself as the
// only double in reach, except below a power of two, where the next double down is half an ulp away:
// uniform_pos gives multiples of 2^-53 in (0, 1], so all 54 powers of two among them are checked, and a
// million random others.
TEST(Workload, PowOfOneIsExact) {
  for (int e = -53; e <= 0; ++e) {
    const double v = std::ldexp(1.0, e);
    ASSERT_EQ(std::pow(v, 1.0), v) << "2^" << e;
  }
  CounterRng rng(3, 4);
  for (int i = 0; i < 1'000'000; ++i) {
    const double v = rng.uniform_pos();
    ASSERT_EQ(std::pow(v, 1.0), v) << v;
  }
}
