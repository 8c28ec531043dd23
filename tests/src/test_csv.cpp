#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "src/config.hpp"
#include "src/csv_input.hpp"
#include "src/errors.hpp"

using namespace dpstream;

namespace {
std::string write_temp(const std::string& name, const std::string& text) {
  const auto path = std::filesystem::temp_directory_path() / ("dpstream_test_" + name);
  std::ofstream(path) << text;
  return path.string();
}
JobConfig csv_job(const std::string& path, const std::string& policy = "skip") {
  return parse_job("[input]\nkind = \"csv\"\npath = \"" + path + "\"\nbad_rows = \"" + policy +
                       "\"\n[stream]\nwindow_seconds = 100\ntriggers = 4\n[privacy]\nmax_records_per_user = 4\n",
                   "test", {});
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
  CsvSource src(csv_job(path), 0, 1);
  const auto& s = src.stats();
  EXPECT_EQ(s.rows, 11u);
  EXPECT_EQ(s.non_finite, 2u);
  EXPECT_EQ(s.malformed, 4u);
  EXPECT_EQ(s.out_of_window, 2u);
  EXPECT_EQ(s.accepted(), 3u);
  const auto t0 = src.take_trigger(0, 0);
  ASSERT_EQ(t0.size(), 1u);
  EXPECT_EQ(t0[0].user, csv_user_id("alice"));
  EXPECT_EQ(t0[0].key, csv_key_id("k1"));
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
  for (int i = 0; i < 1000; ++i) text += "u" + std::to_string(i % 37) + ",k" + std::to_string(i % 11) + "," + std::to_string(i) + "," + std::to_string(i % 100) + "\n";
  const auto path = write_temp("split.csv", text);
  std::vector<std::uint64_t> positions_one, positions_many;
  CsvSource one(csv_job(path), 0, 1);
  for (std::uint32_t t = 0; t < 4; ++t)
    for (auto& r : one.take_trigger(0, t)) positions_one.push_back(r.position);
  for (int P : {2, 3, 7}) {
    positions_many.clear();
    for (int r = 0; r < P; ++r) {
      CsvSource part(csv_job(path), r, P);
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
    CsvSource src(csv_job(path, "fail"), 0, 1);
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

#include "src/release_writer.hpp"

TEST(ReleaseFormat, ShortestDecimalThatRoundTrips) {
  EXPECT_EQ(format_fixed(to_fixed(11.21)), "11.21");
  EXPECT_EQ(format_fixed(to_fixed(12.0)), "12");
  EXPECT_EQ(format_fixed(to_fixed(-0.75)), "-0.75");
  EXPECT_EQ(format_fixed(0), "0");
  EXPECT_EQ(format_fixed(-1), "-0.000001");  // one grid step below zero still reads back
  for (std::int64_t f : {1LL, 3LL, 12345678LL, -987654321LL, (1LL << 50) + 7})
    EXPECT_EQ(to_fixed(std::strtod(format_fixed(f).c_str(), nullptr)), f) << f;
  EXPECT_EQ(csv_field("plain"), "plain");
  EXPECT_EQ(csv_field("a,b"), "\"a,b\"");
  EXPECT_EQ(csv_field("say \"x\""), "\"say \"\"x\"\"\"");
}
