#include <gtest/gtest.h>

#include <map>
#include <set>

#include "src/config.hpp"
#include "src/errors.hpp"

using namespace dpstream;

namespace {
const char* kMinimal = R"(
[stream]
triggers = 4
[privacy]
max_records_per_user = 3
)";

std::string error_of(const std::string& toml, const std::vector<std::string>& overrides = {}) {
  try {
    parse_job(toml, "job.toml", overrides);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Config, DefaultsAndRequiredKeys) {
  const auto c = parse_job(kMinimal, "job.toml", {});
  EXPECT_EQ(c.input.kind, InputKind::Synthetic);
  EXPECT_EQ(c.stream.window_seconds, 86400);
  EXPECT_EQ(c.stream.triggers, 4u);
  EXPECT_EQ(c.privacy.max_records_per_user, 3u);
  EXPECT_EQ(c.output.format, "csv");
  EXPECT_EQ(c.engine.key_scan, KeyScan::Predicted);
  EXPECT_EQ(parse_job(kMinimal, "job.toml", {"engine.key_scan=full"}).engine.key_scan, KeyScan::Full);
  // Trigger batches: auto is about a fiftieth of T (at least 1); a number is taken as given.
  EXPECT_EQ(c.engine.trigger_batch, 0u);
  EXPECT_EQ(c.engine.triggers_per_batch(4), 1u);
  EXPECT_EQ(c.engine.triggers_per_batch(99), 1u);
  EXPECT_EQ(c.engine.triggers_per_batch(100), 2u);
  EXPECT_EQ(c.engine.triggers_per_batch(149), 2u);
  EXPECT_EQ(c.engine.triggers_per_batch(1000), 20u);
  EXPECT_EQ(parse_job(kMinimal, "job.toml", {"engine.trigger_batch=7"}).engine.triggers_per_batch(1000), 7u);
  // C may be left out only in mode "none" (every record kept: the true histogram); DP modes need it.
  EXPECT_EQ(parse_job("[stream]\ntriggers = 4\n", "t", {}).privacy.max_records_per_user, PrivacyConfig::kUnbounded);
  EXPECT_NE(error_of("[stream]\ntriggers = 4\n[privacy]\nmode = \"dp\"\nepsilon = 1\ndelta = 1e-9\n")
                .find("max_records_per_user is required"),
            std::string::npos);
  EXPECT_NE(error_of("[stream]\ntriggers = 4\n[privacy]\nmode = \"baseline-batch\"\nepsilon = 1\ndelta = 1e-9\n")
                .find("max_records_per_user is required"),
            std::string::npos);
  EXPECT_NE(error_of("[privacy]\nmax_records_per_user = 4\n").find("triggers is required"), std::string::npos);
}

TEST(Config, UnknownKeysAndSectionsAreNamed) {
  EXPECT_NE(error_of(std::string("name = \"x\"\n") + kMinimal).find("name is outside every section"),
            std::string::npos);
  auto e = error_of(std::string(kMinimal) + "[input]\nuser = 5\n");
  EXPECT_NE(e.find("unknown key [input] user"), std::string::npos) << e;
  EXPECT_NE(e.find("users"), std::string::npos) << "should list the known keys: " << e;
  e = error_of(std::string(kMinimal) + "[inptu]\nusers = 5\n");
  EXPECT_NE(e.find("unknown section [inptu]"), std::string::npos) << e;
}

TEST(Config, TypesRangesAndChoices) {
  EXPECT_NE(error_of("[stream]\ntriggers = \"ten\"\n[privacy]\nmax_records_per_user = 3\n").find("must be an integer"),
            std::string::npos);
  EXPECT_NE(
      error_of("[stream]\ntriggers = 0\n[privacy]\nmax_records_per_user = 3\n").find("[stream] triggers must be in"),
      std::string::npos);
  EXPECT_NE(error_of("[stream]\ntriggers = 2.5\n[privacy]\nmax_records_per_user = 3\n").find("must be an integer"),
            std::string::npos);
  EXPECT_NE(error_of(kMinimal, {"input.kind=parquet"}).find("must be one of \"csv\" | \"synthetic\""),
            std::string::npos);
  EXPECT_NE(error_of(kMinimal, {"privacy.clamp_min=2", "privacy.clamp_max=1"}).find("must be >= clamp_min"),
            std::string::npos);
  EXPECT_NE(error_of(kMinimal, {"privacy.clamp_max=nan"}).find("must be finite"), std::string::npos);
  EXPECT_NE(error_of(kMinimal, {"privacy.clamp_max=1e12"}).find("2^31"), std::string::npos);
  EXPECT_NE(error_of(kMinimal, {"input.kind=csv"}).find("[input] path is required"), std::string::npos);
  EXPECT_NE(
      error_of(kMinimal, {"stream.window_seconds=10", "stream.triggers=11"}).find("must not exceed window_seconds"),
      std::string::npos);
  EXPECT_NE(error_of(kMinimal, {"privacy.mode=magic"})
                .find("must be one of \"baseline-batch\" | \"baseline-repeated\" | \"dp\" | \"none\""),
            std::string::npos);
  EXPECT_NE(error_of(kMinimal, {"privacy.composition=basic"}).find("composition"), std::string::npos);  // mode none
  EXPECT_NE(error_of("[stream\n").find("not valid TOML"), std::string::npos);
  EXPECT_NE(error_of(kMinimal, {"engine.key_scan=sometimes"})
                .find("[engine] key_scan must be one of \"full\" | \"predicted\""),
            std::string::npos);
  EXPECT_NE(error_of(kMinimal, {"engine.threads=2"}).find("threads"), std::string::npos);  // unknown key named
  for (const char* bad : {"engine.trigger_batch=-1", "engine.trigger_batch=1025"})
    EXPECT_NE(error_of(kMinimal, {bad}).find("[engine] trigger_batch must be in [0, 1024]"), std::string::npos) << bad;
  EXPECT_NE(error_of(kMinimal, {"engine.trigger_batch=2.5"}).find("trigger_batch"), std::string::npos);
}

TEST(Config, OverridesKeepTheirTypes) {
  const auto c =
      parse_job(kMinimal, "job.toml",
                {"input.users=123", "privacy.clamp_max=2.5", "input.key_distribution=uniform", "output.dir=\"a b\""});
  EXPECT_EQ(c.input.users, 123u);
  EXPECT_DOUBLE_EQ(c.privacy.clamp_max, 2.5);
  EXPECT_EQ(c.input.key_distribution, KeyDistribution::Uniform);
  EXPECT_EQ(c.output.dir, "a b");
  EXPECT_NE(error_of(kMinimal, {"usersequals5"}).find("expected section.key=value"), std::string::npos);
  EXPECT_NE(error_of(kMinimal, {"input.users=-4"}).find("[input] users must be in"), std::string::npos);
}

// An error names what to change: the --set that gave the value, or else the spec's file (the last --set of a key).
TEST(Config, ErrorsNameTheSetThatGaveTheValue) {
  EXPECT_EQ(error_of(kMinimal, {"input.users=abc"}).rfind("--set input.users=abc: [input] users", 0), 0u);
  EXPECT_EQ(error_of(kMinimal, {"input.users=5", "input.users=0"}).rfind("--set input.users=0: ", 0), 0u);
  EXPECT_EQ(error_of(kMinimal, {"input.nokey=1"}).rfind("--set input.nokey=1: unknown key [input] nokey", 0), 0u);
  EXPECT_EQ(error_of(kMinimal, {"nosuch.key=1"}).rfind("--set nosuch.key=1: unknown section [nosuch]", 0), 0u);
  EXPECT_EQ(
      error_of(std::string(kMinimal) + "\n[nosuch]\nkey = 1\n", {"nosuch.key=2"}).rfind("job.toml: unknown section", 0),
      0u);
  EXPECT_EQ(
      error_of(std::string(kMinimal) + "\n[job]\nname = \"\"\n", {"input.users=3"}).rfind("job.toml: [job] name", 0),
      0u);
  EXPECT_EQ(error_of(kMinimal, {"job.name=\"\""}).rfind("--set job.name=\"\": [job] name must not be empty", 0), 0u);
  for (const char* name : {R"("a\u0000b")", R"("a\nb")", R"("\u001b[31m")", R"("a\tb")", R"("a\u007fb")"})
    EXPECT_NE(error_of(kMinimal, {std::string("job.name=") + name}).find("control characters"), std::string::npos)
        << name;
  EXPECT_EQ(error_of(kMinimal, {R"(job.name="Zürich ✓ 2024")"}), "");
}

// An error about several values (the privacy plan's) names the spec and every --set applied over it.
TEST(Config, OriginNamesTheSpecAndItsSets) {
  EXPECT_EQ(parse_job(kMinimal, "job.toml", {}).origin(), "job.toml");
  EXPECT_EQ(parse_job(kMinimal, "job.toml", {"input.users=7", "privacy.max_records_per_user=2"}).origin(),
            "job.toml with --set input.users=7, --set privacy.max_records_per_user=2");
}

// Delta at or above 1 / users (known users) or kLargeDelta (unknown) is warned of; below it, nothing is said.
TEST(Config, LargeDeltaIsWarnedOf) {
  EXPECT_EQ(large_delta_warning(1e-9, 1000), "");
  EXPECT_EQ(large_delta_warning(0.0009, 1000), "");
  EXPECT_NE(large_delta_warning(0.001, 1000).find("at least 1 / users (users = 1000)"), std::string::npos);
  EXPECT_NE(large_delta_warning(0.5, 1000).find("delta = 0.5"), std::string::npos);
  EXPECT_EQ(large_delta_warning(0.0009, 0), "");
  EXPECT_NE(large_delta_warning(kLargeDelta, 0).find("at least 0.001"), std::string::npos);
  EXPECT_NE(large_delta_warning(1e-5, 200000).find("users = 200000"), std::string::npos);
  EXPECT_EQ(large_delta_warning(0.0, 0), "");
}

TEST(Config, DemoJobParses) {
  const auto c = parse_job(demo_job_toml(), "demo", {});
  EXPECT_EQ(c.name, "demo");
  EXPECT_EQ(c.stream.triggers, 10u);
}

TEST(Config, MissingSpecFile) { EXPECT_THROW(load_job("/nonexistent/job.toml", {}), ConfigError); }

// mode = "dp": every privacy parameter is checked before any data is read.
TEST(Config, DpParametersAreValidated) {
  const std::vector<std::string> dp = {"privacy.mode=dp", "privacy.epsilon=6", "privacy.delta=1e-9"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), dp.begin(), dp.end());
    return error_of(kMinimal, extra);
  };
  EXPECT_EQ(with({}), "");
  EXPECT_NE(error_of(kMinimal, {"privacy.mode=dp"}).find("epsilon is required"), std::string::npos);
  EXPECT_NE(error_of(kMinimal, {"privacy.mode=dp", "privacy.epsilon=1"}).find("delta is required"), std::string::npos);
  EXPECT_NE(with({"privacy.epsilon=0"}).find("epsilon must be > 0"), std::string::npos);
  EXPECT_NE(with({"privacy.epsilon=-1"}).find("epsilon must be > 0"), std::string::npos);
  EXPECT_NE(with({"privacy.delta=1"}).find("delta must be in (0, 1)"), std::string::npos);
  EXPECT_NE(with({"privacy.delta=0"}).find("delta must be in (0, 1)"), std::string::npos);
  EXPECT_FALSE(parse_job(kMinimal, "t", dp).privacy.mu.has_value());
  EXPECT_NE(with({"privacy.mu=-1"}).find("mu must be >= 0"), std::string::npos);
  EXPECT_NE(with({"privacy.beta=0"}).find("beta must be in (0, 1)"), std::string::npos);
  EXPECT_NE(with({"privacy.beta=1.5"}).find("beta must be in (0, 1)"), std::string::npos);
  EXPECT_NE(with({"privacy.selection_epsilon_share=1"}).find("selection_epsilon_share must be in (0, 1)"),
            std::string::npos);
  EXPECT_NE(with({"privacy.selection_delta_share=0"}).find("selection_delta_share must be in (0, 1)"),
            std::string::npos);
  EXPECT_NE(with({"privacy.threshold=\"exact\""}).find("must be one of"), std::string::npos);
  EXPECT_NE(with({"privacy.seed=-3"}).find("seed must be in"), std::string::npos);
  EXPECT_NE(with({"query.aggregations=[\"count\", \"median\"]"}).find("unknown column \"median\""), std::string::npos);
  EXPECT_NE(with({"query.aggregations=[\"sum\", \"sum\"]"}).find("lists \"sum\" twice"), std::string::npos);
  EXPECT_NE(with({"query.aggregations=[]"}).find("at least one column"), std::string::npos);
  EXPECT_NE(with({"query.aggregations=\"count\""}).find("array of strings"), std::string::npos);
  EXPECT_NE(error_of(kMinimal, {"checkpoint.seconds=0"}).find("[checkpoint] seconds must be in [0.001, 1e7]"),
            std::string::npos);
  EXPECT_FALSE(parse_job(kMinimal, "t", {}).checkpoint.every.has_value());
  EXPECT_FALSE(parse_job(kMinimal, "t", {"checkpoint.every=0"}).checkpoint.enabled());
  EXPECT_EQ(parse_job(kMinimal, "t", {"checkpoint.every=3"}).checkpoint.every.value(), 3u);
  // The journal bound: a whole number of MiB >= 1; the error names the range and what it bounds.
  EXPECT_EQ(parse_job(kMinimal, "t", {}).checkpoint.journal_mib, 1024u);
  EXPECT_EQ(parse_job(kMinimal, "t", {"checkpoint.journal_mib=1"}).checkpoint.journal_mib, 1u);
  for (const char* bad : {"checkpoint.journal_mib=0", "checkpoint.journal_mib=-5", "checkpoint.journal_mib=2000000"})
    EXPECT_NE(error_of(kMinimal, {bad})
                  .find("[checkpoint] journal_mib must be in [1, 1048576] (MiB of commit journal "
                        "per rank before a commit)"),
              std::string::npos)
        << bad << ": " << error_of(kMinimal, {bad});
  EXPECT_NE(error_of(kMinimal, {"checkpoint.journal_mib=1.5"}).find("[checkpoint] journal_mib must be an integer"),
            std::string::npos);
  EXPECT_NE(error_of(kMinimal, {"checkpoint.journal_mib=\"1\""}).find("[checkpoint] journal_mib must be an integer"),
            std::string::npos);
  // A private CSV job may not stop because of one bad row (a stop is an output); mode none may.
  const std::vector<std::string> csv = {"input.kind=\"csv\"", "input.path=\"in.csv\"", "input.bad_rows=\"fail\""};
  auto csv_with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), csv.begin(), csv.end());
    return error_of(kMinimal, extra);
  };
  EXPECT_NE(with(csv).find("[input] bad_rows = \"fail\" would stop a private job"), std::string::npos) << with(csv);
  EXPECT_NE(csv_with({"privacy.mode=\"baseline-batch\"", "privacy.epsilon=6", "privacy.delta=1e-9"}).find("bad_rows"),
            std::string::npos);
  EXPECT_EQ(csv_with({}), "");
  EXPECT_EQ(with({"input.kind=\"csv\"", "input.path=\"in.csv\"", "input.bad_rows=\"skip\""}), "");
  const auto c = parse_job(kMinimal, "t",
                           {"privacy.mode=dp", "privacy.epsilon=2", "privacy.delta=1e-6",
                            "query.aggregations=[\"count\"]", "privacy.seed=5", "privacy.beta=1e-12"});
  EXPECT_TRUE(c.query.count);
  EXPECT_FALSE(c.query.sum);
  EXPECT_EQ(c.privacy.seed.value(), 5u);
  EXPECT_DOUBLE_EQ(c.privacy.beta.value(), 1e-12);
  EXPECT_DOUBLE_EQ(c.privacy.selection_delta_share, 2.0 / 3.0);
}

namespace {
// Each spelling parses back to its value, and no two values share one.
template <class E>
void expect_round_trip(std::size_t enumerators) {
  const auto table = names_of(E{});
  EXPECT_EQ(table.size(), enumerators);
  for (const auto& [value, name] : table) {
    EXPECT_EQ(to_string(value), name);
    EXPECT_EQ(parse_enum<E>(name), value) << name;
  }
  EXPECT_FALSE(parse_enum<E>("no-such-value").has_value());
}
}  // namespace

TEST(Config, EveryEnumHasOneSpellingPerValue) {
  expect_round_trip<InputKind>(2);
  expect_round_trip<KeyDistribution>(2);
  expect_round_trip<BadRowPolicy>(2);
  expect_round_trip<PrivacyMode>(4);
  expect_round_trip<Composition>(3);
  expect_round_trip<ThresholdTail>(2);
  expect_round_trip<ProgressMode>(3);
  expect_round_trip<KeyScan>(2);
}

namespace {
// A value for every key of the job spec (a DP job on a CSV file, so that every key is allowed).
const std::map<std::string, std::string> kEveryKey = {{"job.name", "\"x\""},
                                                      {"input.kind", "\"csv\""},
                                                      {"input.path", "\"in.csv\""},
                                                      {"input.bad_rows", "\"skip\""},
                                                      {"input.users", "10"},
                                                      {"input.keys", "10"},
                                                      {"input.key_distribution", "\"uniform\""},
                                                      {"input.seed", "2"},
                                                      {"input.records_per_user_q", "1"},
                                                      {"input.records_per_user_s", "2"},
                                                      {"input.records_per_user_min", "0"},
                                                      {"input.records_per_user_max", "5"},
                                                      {"input.key_q", "1"},
                                                      {"input.key_s", "2"},
                                                      {"stream.window_seconds", "100"},
                                                      {"stream.triggers", "4"},
                                                      {"stream.first_window", "0"},
                                                      {"stream.windows", "1"},
                                                      {"privacy.mode", "\"dp\""},
                                                      {"privacy.max_records_per_user", "3"},
                                                      {"privacy.composition", "\"zcdp\""},
                                                      {"privacy.clamp_min", "0"},
                                                      {"privacy.clamp_max", "1"},
                                                      {"privacy.epsilon", "1"},
                                                      {"privacy.delta", "1e-9"},
                                                      {"privacy.mu", "1"},
                                                      {"privacy.beta", "1e-10"},
                                                      {"privacy.seed", "3"},
                                                      {"privacy.selection_epsilon_share", "0.5"},
                                                      {"privacy.selection_delta_share", "0.5"},
                                                      {"privacy.threshold", "\"subgaussian\""},
                                                      {"privacy.selection_counter", "\"banded\""},
                                                      {"privacy.value_counter", "\"banded\""},
                                                      {"privacy.counter_band", "6"},
                                                      {"privacy.ledger", "\"budget.ledger\""},
                                                      {"query.aggregations", "[\"count\"]"},
                                                      {"output.dir", "\"o\""},
                                                      {"output.format", "\"csv\""},
                                                      {"output.progress", "\"never\""},
                                                      {"checkpoint.every", "2"},
                                                      {"checkpoint.seconds", "5"},
                                                      {"checkpoint.journal_mib", "64"},
                                                      {"engine.key_scan", "\"full\""},
                                                      {"engine.trigger_batch", "3"}};
}  // namespace

// job_spec_fields is the one list of keys: the parser accepts exactly its keys (reading one that is
// not listed is a logic_error in every parse), and each says whether a resume may change it.
TEST(SpecFields, AreExactlyTheKeysTheParserAccepts) {
  std::set<std::string> names;
  for (const auto& f : job_spec_fields()) {
    EXPECT_TRUE(names.insert(std::string(f.name)).second) << "listed twice: " << f.name;
    EXPECT_EQ(f.on_resume == OnResume::MustMatch, f.identity != nullptr)
        << f.name << ": a MustMatch field needs its identity";
    EXPECT_TRUE(f.on_resume == OnResume::MustMatch || f.applies == AppliesTo::All) << f.name;
  }
  std::set<std::string> every_key;
  std::vector<std::string> overrides;
  for (const auto& [k, v] : kEveryKey) {
    every_key.insert(k);
    overrides.push_back(std::string(k).append("=").append(v));
  }
  EXPECT_EQ(names, every_key) << "give every key of job_spec_fields a value in kEveryKey";
  EXPECT_NO_THROW(parse_job("", "t", overrides));  // each listed key is read by the parser
  EXPECT_NO_THROW(parse_job(kMinimal, "t", {}));   // keys only tested with has() are listed too
}

TEST(SpecFields, UnknownKeyMessagesListTheTable) {
  EXPECT_EQ(spec_sections(),
            (std::vector<std::string>{"job", "input", "stream", "privacy", "query", "output", "checkpoint", "engine"}));
  const auto e = error_of(std::string(kMinimal) + "[output]\ncolour = 1\n");
  EXPECT_NE(e.find("unknown key [output] colour (known keys of [output]: dir, format, progress)"), std::string::npos)
      << e;
  EXPECT_NE(error_of(std::string(kMinimal) + "[x]\n")
                .find("(known: [job], [input], [stream], [privacy], [query], [output], [checkpoint], [engine])"),
            std::string::npos);
}
