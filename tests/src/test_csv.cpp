#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <system_error>
#include <vector>

#include "shuffle/comm.hpp"
#include "src/config.hpp"
#include "src/csv_input.hpp"
#include "src/errors.hpp"
#include "src/id_prf.hpp"

#include <map>
#include <set>

using namespace dpstream;

namespace {
// The program's temporary files, removed when it exits.
struct TempFiles {
  std::vector<std::filesystem::path> paths;
  ~TempFiles() {
    std::error_code ignored;
    for (const auto& p : paths) std::filesystem::remove(p, ignored);
  }
} temp_files;
std::string write_temp(const std::string& name, const std::string& text) {
  const auto path = std::filesystem::temp_directory_path() / ("dpstream_test_" + std::to_string(getpid()) + "_" + name);
  std::ofstream(path) << text;
  temp_files.paths.push_back(path);
  return path.string();
}
JobConfig csv_job(const std::string& path, const std::string& policy = "skip") {
  return parse_job(
      "[input]\nkind = \"csv\"\npath = \"" + path + "\"\nbad_rows = \"" + policy +
          "\"\n[stream]\nwindow_seconds = 100\ntriggers = 4\nwindows = 1\n[privacy]\nmax_records_per_user = 4\n",
      "test", {});
}
IdPrf test_ids(int id_bits = 64) { return IdPrf(noise::secret_from_seed(17), id_bits); }
// A parsed and separated source of one process (the test runs on one rank).
CsvSource parsed(const JobConfig& job, int rank, int ranks, IdPrf ids = test_ids()) {
  CsvSource src(job, rank, ranks, ids);
  src.separate_ids(shuffle::Comm());
  return src;
}
}  // namespace

TEST(CsvSplit, QuotingRules) {
  std::vector<std::string> f;
  ASSERT_TRUE(split_csv_line("a,b,,d", f));
  EXPECT_EQ(f, (std::vector<std::string>{"a", "b", "", "d"}));
  ASSERT_TRUE(split_csv_line("\"x,y\",\"he said \"\"hi\"\"\",3", f));
  EXPECT_EQ(f, (std::vector<std::string>{"x,y", "he said \"hi\"", "3"}));
  ASSERT_TRUE(split_csv_line("", f));
  EXPECT_EQ(f.size(), 1u);
  EXPECT_FALSE(split_csv_line("\"open,b", f));
  EXPECT_FALSE(split_csv_line("\"a\"b,c", f));
  EXPECT_FALSE(split_csv_line("a\"b,c", f));
}

// A header as spreadsheets write it: a UTF-8 byte order mark before the first column, CRLF line ends. Only a mark
// at the very start is removed, and only the mark.
TEST(CsvSplit, HeaderWithoutByteOrderMarkOrCarriageReturn) {
  const std::vector<std::string> want{"user_id", "key", "value", "timestamp"};
  std::vector<std::string> f;
  for (const std::string line : {"user_id,key,value,timestamp", "\xEF\xBB\xBFuser_id,key,value,timestamp",
                                 "user_id,key,value,timestamp\r", "\xEF\xBB\xBFuser_id,key,value,timestamp\r"}) {
    ASSERT_TRUE(split_csv_header(line, f)) << line;
    EXPECT_EQ(f, want) << line;
  }
  ASSERT_TRUE(
      split_csv_header("a,\xEF\xBB\xBF"
                       "b",
                       f));
  EXPECT_EQ(f, (std::vector<std::string>{"a",
                                         "\xEF\xBB\xBF"
                                         "b"}));
  ASSERT_TRUE(
      split_csv_header("\xEF\xBB"
                       "a",
                       f));  // not a whole mark
  EXPECT_EQ(f, (std::vector<std::string>{"\xEF\xBB"
                                         "a"}));
}

// Rows quoted in error messages: control bytes (a terminal's escape sequences among them) never reach the terminal.
TEST(CsvSplit, QuotedRowsShowControlBytesEscaped) {
  EXPECT_EQ(quoted_row("u1,k1,0.5,100"), "u1,k1,0.5,100");
  EXPECT_EQ(quoted_row("u\x1b[31m,\t\x7f"), "u\\x1b[31m,\\x09\\x7f");
  EXPECT_EQ(quoted_row("Nord\xc3\xa9"), "Nord\xc3\xa9");  // UTF-8 text stays as it is
  EXPECT_EQ(quoted_row(std::string(300, 'a')), std::string(200, 'a') + "...");
  // The C1 controls in UTF-8 (U+009B, CSI on some terminals); the letters around them (U+00A0 and up) stay.
  EXPECT_EQ(quoted_row("a\xc2\x9b"
                       "2J\xc2\x80\xc2\xa0"),
            "a\\xc2\\x9b2J\\xc2\\x80\xc2\xa0");
  // Messages keep their line breaks and tabs (dpstream::terminal_safe), not the rest.
  EXPECT_EQ(dpstream::terminal_safe("one\n\ttwo\x1b[0m\x7f\xc2\x9f"), "one\n\ttwo\\x1b[0m\\x7f\\xc2\\x9f");
  EXPECT_EQ(quoted_row(std::string(200, 'a')), std::string(200, 'a'));
  const std::vector<std::string> wide(60, "column");  // 419 bytes: a header is listed whole
  EXPECT_EQ(quoted_header(wide).size(), 60 * 7 - 1);
  const std::vector<std::string> huge(2000, "column");  // 13 999 bytes: a file of rows read as one header line
  EXPECT_EQ(quoted_header(huge).size(), kQuotedHeaderBytes + 3);  // its first 4096 bytes and "..."
  EXPECT_TRUE(quoted_header(huge).ends_with("..."));
}

// The reader behind split_csv_line and `dpstream evaluate`: which field failed, and how.
TEST(CsvSplit, FieldReaderSaysWhereQuotingFails) {
  auto fields = [](std::string_view line, CsvFieldReader::Error& error) {
    CsvFieldReader r(line);
    CsvField f;
    std::vector<std::string> out;
    while (r.next(f)) out.push_back(unescape(f) + (f.quoted ? "|q" : ""));
    error = r.error();
    return std::pair{out, r.count()};
  };
  CsvFieldReader::Error e;
  EXPECT_EQ(fields("a,\"b\"\"c\",", e), (std::pair{std::vector<std::string>{"a", "b\"c|q", ""}, 3}));
  EXPECT_EQ(e, CsvFieldReader::Error::None);
  EXPECT_EQ(fields("a,b,\"c", e).second, 3);
  EXPECT_EQ(e, CsvFieldReader::Error::UnterminatedQuote);
  EXPECT_EQ(fields("a,\"b\"x,c", e).second, 2);
  EXPECT_EQ(e, CsvFieldReader::Error::TextAfterQuote);
  EXPECT_EQ(fields("a\"b", e).first, std::vector<std::string>{"a\"b"});  // stray quotes are the caller's to judge
}

TEST(CsvSource, ParsesBucketsAndCountsBadRows) {
  const auto path = write_temp("mixed.csv",
                               "timestamp,key,extra,user_id,value\n"
                               "5,k1,x,alice,1.5\n"
                               "30,\"k,2\",x,bob,2\n"
                               "\n"
                               "31,k1,x,alice,nan\n"
                               "32,k1,x,alice,inf\n"
                               "33,k1,x,alice,abc\n"
                               "3.5,k1,x,alice,1\n"
                               "34,k1,x,,1\n"
                               "35,k1,x,alice\n"
                               "250,k1,x,alice,1\n"
                               "-4,k1,x,alice,1\n"
                               "99,k1,x,carol,-7e-1\r\n");
  auto ids = test_ids();
  auto src = parsed(csv_job(path), 0, 1);
  const auto& s = src.stats();
  EXPECT_EQ(s.rows, 11u);
  EXPECT_EQ(s.non_finite, 2u);
  EXPECT_EQ(s.malformed, 4u);
  EXPECT_EQ(s.out_of_window, 2u);
  EXPECT_EQ(s.accepted(), 3u);
  const auto t0 = src.take_trigger(0, 0);
  ASSERT_EQ(t0.size(), 1u);
  EXPECT_EQ(t0[0].user, ids(IdDomain::User, "alice").id);
  EXPECT_EQ(t0[0].key, ids(IdDomain::Key, "k1").id);
  EXPECT_DOUBLE_EQ(t0[0].value, 1.5);
  const auto t1 = src.take_trigger(0, 1);
  ASSERT_EQ(t1.size(), 1u);
  EXPECT_EQ(src.key_names().at(t1[0].key), "k,2");
  EXPECT_TRUE(src.take_trigger(0, 2).empty());
  const auto t3 = src.take_trigger(0, 3);
  ASSERT_EQ(t3.size(), 1u);
  EXPECT_DOUBLE_EQ(t3[0].value, -0.7);
}

TEST(CsvSource, RanksSplitTheFileWithoutLosingOrDuplicatingRows) {
  std::string text = "user_id,key,value,timestamp\n";
  for (int i = 0; i < 1000; ++i) text += fmt::format("u{},k{},{},{}\n", i % 37, i % 11, i, i % 100);
  const auto path = write_temp("split.csv", text);
  std::vector<std::uint64_t> positions_one, positions_many;
  auto one = parsed(csv_job(path), 0, 1);
  for (std::uint32_t t = 0; t < 4; ++t)
    for (auto& r : one.take_trigger(0, t)) positions_one.push_back(r.position);
  for (int P : {2, 3, 7}) {
    positions_many.clear();
    for (int r = 0; r < P; ++r) {
      auto part = parsed(csv_job(path), r, P);
      for (std::uint32_t t = 0; t < 4; ++t)
        for (auto& rec : part.take_trigger(0, t)) positions_many.push_back(rec.position);
    }
    std::sort(positions_one.begin(), positions_one.end());
    std::sort(positions_many.begin(), positions_many.end());
    EXPECT_EQ(positions_one, positions_many) << "P=" << P;
  }
  EXPECT_EQ(positions_one.size(), 1000u);
}

TEST(CsvSource, FailPolicyNamesTheLine) {
  const auto path = write_temp("fail.csv", "user_id,key,value,timestamp\na,k,1,1\na,k,zzz,2\n");
  try {
    auto ids = test_ids();
    CsvSource src(csv_job(path, "fail"), 0, 1, ids);
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(":3:"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'zzz' is not a number"), std::string::npos) << e.what();
  }
}

TEST(CsvSource, MissingFileAndColumns) {
  EXPECT_THROW(check_csv_file("/nonexistent/input.csv"), InputError);
  const auto path = write_temp("nocol.csv", "user_id,key,timestamp\na,b,1\n");
  try {
    check_csv_file(path);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("missing column 'value'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(check_csv_file(write_temp("empty.csv", "")), InputError);
}

// Ids are keyed: another secret gives other ids, and user and key ids of one string differ.
TEST(IdPrf, KeyedAndDomainSeparated) {
  IdPrf a(noise::secret_from_seed(1)), b(noise::secret_from_seed(2));
  EXPECT_NE(a(IdDomain::User, "alice@example.com"), b(IdDomain::User, "alice@example.com"));
  EXPECT_NE(a(IdDomain::User, "alice@example.com"), a(IdDomain::Key, "alice@example.com"));
  EXPECT_EQ(a(IdDomain::User, "alice@example.com"), a(IdDomain::User, "alice@example.com"));
  std::set<Id128> seen;
  for (int i = 0; i < 10000; ++i) seen.insert(a(IdDomain::User, fmt::format("u{}", i)));
  EXPECT_EQ(seen.size(), 10000u);
}

// With 4-bit ids 300 users and 40 keys collide all the time: separation keeps every distinct string
// apart (one id per string, no id shared by two strings) and key names stay right.
TEST(CsvSource, CollidingIdsAreKeptApart) {
  std::string text = "user_id,key,value,timestamp\n";
  for (int i = 0; i < 3000; ++i)
    text += "user" + std::to_string(i % 300) + ",key" + std::to_string(i % 40) + ",1," + std::to_string(i % 100) + "\n";
  const auto path = write_temp("collide.csv", text);
  auto src = parsed(csv_job(path), 0, 1, test_ids(4));
  std::map<std::uint64_t, std::set<std::uint64_t>> users_of_id;  // user id -> the user numbers seen with it
  std::set<std::uint64_t> key_ids;
  std::size_t n = 0;
  for (std::uint32_t t = 0; t < 4; ++t)
    for (const auto& r : src.take_trigger(0, t)) {
      const std::size_t i = r.position;  // byte offset: find the row's user in the text
      const std::string line = text.substr(i, text.find('\n', i) - i);
      const std::uint64_t user = std::stoull(line.substr(4, line.find(',') - 4));
      users_of_id[r.user].insert(user);
      const std::string key = line.substr(line.find(',') + 1, line.find(',', line.find(',') + 1) - line.find(',') - 1);
      EXPECT_EQ(src.key_names().at(r.key), key);
      key_ids.insert(r.key);
      ++n;
    }
  EXPECT_EQ(n, 3000u);
  EXPECT_EQ(users_of_id.size(), 300u);
  for (const auto& [id, users] : users_of_id) EXPECT_EQ(users.size(), 1u) << "id " << id << " merges users";
  EXPECT_EQ(key_ids.size(), 40u);
  EXPECT_EQ(src.key_names().size(), 40u);
}

#include "src/release_writer.hpp"

// to_fixed rounds inline as std::llround does (half away from zero) for every double: ties, their
// neighbours, where doubles become whole numbers (2^52, 2^53), the inline range's edge (2^62) and beyond.
TEST(ReleaseFormat, ToFixedRoundsAsLlround) {
  std::vector<double> scaled;  // values of v 2^20
  for (double m = 1; m < 0x1p64; m *= 2)
    for (const double base : {m, m + 0.5, m - 0.5, m * 1.5, m * 1.5 + 0.5, 0.5, 1.5, 2.5})
      for (const double x : {base, std::nextafter(base, 0.0), std::nextafter(base, 1e300)}) {
        scaled.push_back(x);
        scaled.push_back(-x);
      }
  std::mt19937_64 rng(7);
  for (int i = 0; i < 200000; ++i) {
    const double x = std::ldexp(std::uniform_real_distribution<double>(-1, 1)(rng), static_cast<int>(rng() % 66));
    scaled.push_back(x);
    scaled.push_back(std::round(x) + 0.5);
  }
  scaled.push_back(0.0);
  scaled.push_back(-0.0);
  for (const double x : scaled) {
    if (!(std::abs(x) < 0x1p63)) continue;  // llround's result is unspecified there
    EXPECT_EQ(to_fixed(x / kValueScale), std::llround(x)) << fmt::format("{:a}", x);
  }
}

TEST(ReleaseFormat, ShortestDecimalThatRoundTrips) {
  EXPECT_EQ(format_fixed(to_fixed(11.21)), "11.21");
  EXPECT_EQ(format_fixed(to_fixed(12.0)), "12");
  EXPECT_EQ(format_fixed(to_fixed(-0.75)), "-0.75");
  EXPECT_EQ(format_fixed(0), "0");
  EXPECT_EQ(format_fixed(-1), "-0.000001");  // one grid step below zero still reads back
  // Beyond 2^53 grid steps (|value| >= 2^33) the exact decimal: 2^-20 = 0.00000095367431640625.
  EXPECT_EQ(format_fixed(int128{12000} << 51), "25769803776000");
  EXPECT_EQ(format_fixed(-(int128{12000} << 51)), "-25769803776000");
  EXPECT_EQ(format_fixed((int128{1} << 100) + 1), "1208925819614629174706176.00000095367431640625");
  EXPECT_EQ(format_fixed((int128{1} << 53) + (int128{1} << 19)), "8589934592.5");
  EXPECT_EQ(format_fixed((int128{1} << 53) - 1), "8589934591.999999");  // the last value of the double path
  for (std::int64_t f : {1LL, 3LL, 12345678LL, -987654321LL, (1LL << 50) + 7})
    EXPECT_EQ(to_fixed(std::strtod(format_fixed(f).c_str(), nullptr)), f) << f;
  EXPECT_EQ(csv_field("plain"), "plain");
  EXPECT_EQ(csv_field("a,b"), "\"a,b\"");
  EXPECT_EQ(csv_field("say \"x\""), "\"say \"\"x\"\"\"");
}

// A row is its fields joined, whichever path formats it (a whole-number row is built in a local buffer,
// any other value, a quoted name or a long one goes field by field): every row equals the fields
// formatted one by one, under every choice of released columns, and integer ids print as their text.
TEST(ReleaseFormat, RowsAreTheirFieldsJoinedOnEveryPath) {
  const int128 grid_53 = int128{1} << 53;
  const std::vector<int128> values = {0,
                                      int128{7} << kValueFracBits,
                                      -(int128{12} << kValueFracBits),
                                      to_fixed(11.21),
                                      -1,
                                      (int128{5} << kValueFracBits) + 1,        // one grid step above a whole number
                                      grid_53 - (int128{1} << kValueFracBits),  // the largest whole double-path value
                                      grid_53,                                  // the first exact-decimal one
                                      -grid_53,
                                      (int128{1} << 100) + 1};
  const std::vector<std::string> names = {"plain", "a,b", "say \"x\"", "two\nlines", "", std::string(300, 'k')};
  std::vector<ReleaseRow> rows;
  std::vector<KeyRelease> id_rows;
  std::uint64_t key = 1;
  for (const int128 count : values)
    for (const int128 sum : values) {
      rows.push_back({key, names[key % names.size()], count, sum});
      id_rows.push_back({key * 0x9E3779B97F4A7C15ull, count, sum});
      ++key;
    }
  for (const ReleaseColumns columns : {ReleaseColumns{true, true}, ReleaseColumns{true, false},
                                       ReleaseColumns{false, true}, ReleaseColumns{false, false}}) {
    const auto expected = [&](const std::string& name, int128 count, int128 sum) {
      return "-3,17," + csv_field(name) + "," + (columns.count ? format_fixed(count) : "") + "," +
             (columns.sum ? format_fixed(sum) : "") + "\n";
    };
    std::string text, id_text;
    std::vector<std::uint64_t> ends, id_ends;
    format_rows(-3, 17, rows, columns, text, ends);
    format_id_rows(-3, 17, id_rows, columns, id_text, id_ends);
    ASSERT_EQ(ends.size(), rows.size());
    ASSERT_EQ(id_ends.size(), id_rows.size());
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const std::uint64_t begin = i == 0 ? 0 : ends[i - 1], id_begin = i == 0 ? 0 : id_ends[i - 1];
      EXPECT_EQ(text.substr(begin, ends[i] - begin), expected(rows[i].name, rows[i].count, rows[i].sum)) << i;
      EXPECT_EQ(id_text.substr(id_begin, id_ends[i] - id_begin),
                expected(std::to_string(id_rows[i].key), id_rows[i].count, id_rows[i].sum))
          << i;
    }
    EXPECT_EQ(ends.back(), text.size());
  }
}

// A file that shrinks while it is mapped raises SIGBUS where its lost pages are read: while a MappedFile lives, that
// ends the process with the input error's exit code and a line naming the file, not a crash. A SIGBUS elsewhere is
// left to the handler in place before.
TEST(MappedFile, AFileThatShrinksWhileReadIsAnInputError) {
  // One name for the parent and its death-test children (a child may be a new process of the test binary).
  const std::filesystem::path path = std::filesystem::temp_directory_path() / "dpstream-test-mapped-file-shrinks.csv";
  const auto read_after_cut = [&] {
    std::ofstream(path) << std::string(1 << 20, 'x');
    const MappedFile file(path.string());
    std::filesystem::resize_file(path, 100);
    volatile char c = file.view()[600000];  // a page past the new end
    (void)c;
    std::_Exit(0);
  };
  EXPECT_EXIT(read_after_cut(), ::testing::ExitedWithCode(kExitInput),
              "input file .*shrinks.csv shrank while it was read");
  const auto unguarded = [&] {
    std::ofstream(path) << std::string(1 << 20, 'x');
    const int fd = ::open(path.c_str(), O_RDONLY);
    const MappedFile file(path.string());  // installs the handler; the mapping below is not a MappedFile's
    const auto* other = static_cast<const char*>(::mmap(nullptr, 1 << 20, PROT_READ, MAP_PRIVATE, fd, 0));
    std::filesystem::resize_file(path, 100);
    volatile char c = other[600000];
    (void)c;
    std::_Exit(0);
  };
  // Killed by SIGBUS, or (under a sanitizer, whose handler was in place before) its report and exit: not ours.
  const auto not_the_input_error = [](int status) {
    return !(WIFEXITED(status) && (WEXITSTATUS(status) == kExitInput || WEXITSTATUS(status) == 0));
  };
  EXPECT_EXIT(unguarded(), not_the_input_error, "");
  std::filesystem::remove(path);
}
