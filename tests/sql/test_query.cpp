// The DP SQL parser (sql/query.hpp): every aggregate form, names, WHERE trees, options, GROUP BY, the
// lexical details, and malformed queries refused with their column, the offending token and a hint.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "sql/query.hpp"

namespace dpstream::sql {
namespace {

const std::string kHead = "SELECT WITH ANONYMIZATION ";

// A query with the given select list, table t and optional tail (WHERE ..., GROUP BY ...).
Query parse(const std::string& items, const std::string& tail = "") {
  return parse_query(kHead + items + " FROM t" + (tail.empty() ? "" : " " + tail));
}

const Aggregate& only_aggregate(const Query& q) {
  EXPECT_EQ(q.aggregates.size(), 1U);
  return q.aggregates.at(0);
}

Condition where(const std::string& cond) {
  const Query q = parse("ANON_COUNT(*)", "WHERE " + cond);
  EXPECT_TRUE(q.where.has_value());
  return q.where.value_or(Condition{});
}

// 1-based column of the n-th occurrence of `needle` in `text`.
std::size_t col(const std::string& text, const std::string& needle, int nth = 0) {
  std::size_t at = text.find(needle);
  for (int i = 0; i < nth; ++i) at = text.find(needle, at + 1);
  EXPECT_NE(at, std::string::npos) << needle;
  return at + 1;
}

// ---------------------------------------------------------------------------------------------------
// Aggregates

TEST(QueryAggregates, CountStar) {
  const Query q = parse("ANON_COUNT(*)");
  const Aggregate& a = only_aggregate(q);
  EXPECT_EQ(a.kind, AggKind::Count);
  EXPECT_EQ(a.column, "");
  EXPECT_FALSE(a.has_bounds);
  EXPECT_EQ(a.lower, 0);
  EXPECT_EQ(a.upper, 0);
  EXPECT_EQ(a.text, "ANON_COUNT(*)");
  EXPECT_EQ(a.column_pos, kHead.size() + 1);
  EXPECT_EQ(q.table, "t");
}

TEST(QueryAggregates, CountStarWithBound) {
  const Aggregate a = only_aggregate(parse("anon_count( * ,5 )"));
  EXPECT_EQ(a.kind, AggKind::Count);
  EXPECT_TRUE(a.has_bounds);
  EXPECT_EQ(a.lower, 0);
  EXPECT_EQ(a.upper, 5);
  EXPECT_EQ(a.column, "");
  EXPECT_EQ(a.text, "ANON_COUNT(*, 5)");
}

TEST(QueryAggregates, CountColumnWithBound) {
  const Aggregate a = only_aggregate(parse("ANON_COUNT(visits, 3)"));
  EXPECT_EQ(a.kind, AggKind::Count);
  EXPECT_EQ(a.column, "visits");
  EXPECT_TRUE(a.has_bounds);
  EXPECT_EQ(a.lower, 0);
  EXPECT_EQ(a.upper, 3);
  EXPECT_EQ(a.text, "ANON_COUNT(visits, 3)");
}

TEST(QueryAggregates, CountDistinct) {
  const Aggregate a = only_aggregate(parse("ANON_COUNT(distinct uid)"));
  EXPECT_EQ(a.kind, AggKind::CountDistinct);
  EXPECT_EQ(a.column, "uid");
  EXPECT_FALSE(a.has_bounds);
  EXPECT_EQ(a.text, "ANON_COUNT(DISTINCT uid)");
}

TEST(QueryAggregates, CountBoundLimits) {
  EXPECT_EQ(only_aggregate(parse("ANON_COUNT(*, 1)")).upper, 1);
  EXPECT_EQ(only_aggregate(parse("ANON_COUNT(*, 1048576)")).upper, 1048576);
  const Aggregate a = only_aggregate(parse("ANON_COUNT(*, 5.0)"));  // an integer value, written as a real
  EXPECT_EQ(a.upper, 5);
  EXPECT_EQ(a.text, "ANON_COUNT(*, 5.0)");
}

TEST(QueryAggregates, BoundedKinds) {
  const struct {
    const char* call;
    AggKind kind;
  } cases[] = {{"ANON_SUM", AggKind::Sum},
               {"ANON_AVG", AggKind::Avg},
               {"ANON_VAR", AggKind::Var},
               {"ANON_STDDEV", AggKind::Stddev}};
  for (const auto& c : cases) {
    const Aggregate a = only_aggregate(parse(std::string(c.call) + "(price, 0, 100)"));
    EXPECT_EQ(a.kind, c.kind) << c.call;
    EXPECT_EQ(a.column, "price");
    EXPECT_TRUE(a.has_bounds);
    EXPECT_EQ(a.lower, 0);
    EXPECT_EQ(a.upper, 100);
    EXPECT_EQ(a.text, std::string(c.call) + "(price, 0, 100)");
  }
}

TEST(QueryAggregates, NumbersKeepTheirSpelling) {
  const Aggregate a = only_aggregate(parse("Anon_Sum(Price,-1e3,+2.5E2)"));
  EXPECT_EQ(a.column, "Price");
  EXPECT_EQ(a.lower, -1000);
  EXPECT_EQ(a.upper, 250);
  EXPECT_EQ(a.text, "ANON_SUM(Price, -1e3, +2.5E2)");
}

TEST(QueryAggregates, BoundLimitsAndEqualBounds) {
  const Aggregate a = only_aggregate(parse("ANON_SUM(x, -1099511627776, 1099511627776)"));
  EXPECT_EQ(a.lower, -1099511627776.0);
  EXPECT_EQ(a.upper, 1099511627776.0);
  const Aggregate b = only_aggregate(parse("ANON_AVG(x, 7, 7)"));
  EXPECT_EQ(b.lower, 7);
  EXPECT_EQ(b.upper, 7);
}

TEST(QueryAggregates, MinMaxMedianAreNtiles) {
  const struct {
    const char* call;
    double p;
    const char* text;
  } cases[] = {{"anon_min(x, 0, 5)", 0, "ANON_MIN(x, 0, 5)"},
               {"ANON_MAX(x, -5, 5)", 1, "ANON_MAX(x, -5, 5)"},
               {"ANON_MEDIAN(x, 0, 10)", 0.5, "ANON_MEDIAN(x, 0, 10)"}};
  for (const auto& c : cases) {
    const Aggregate a = only_aggregate(parse(c.call));
    EXPECT_EQ(a.kind, AggKind::Ntile) << c.call;
    EXPECT_EQ(a.p, c.p);
    EXPECT_EQ(a.column, "x");
    EXPECT_TRUE(a.has_bounds);
    EXPECT_EQ(a.text, c.text);
  }
}

TEST(QueryAggregates, Ntile) {
  const Aggregate a = only_aggregate(parse("ANON_NTILE(x, 0.9, 0, 10)"));
  EXPECT_EQ(a.kind, AggKind::Ntile);
  EXPECT_EQ(a.column, "x");
  EXPECT_EQ(a.p, 0.9);
  EXPECT_EQ(a.lower, 0);
  EXPECT_EQ(a.upper, 10);
  EXPECT_EQ(a.text, "ANON_NTILE(x, 0.9, 0, 10)");
  EXPECT_EQ(only_aggregate(parse("ANON_NTILE(x, 0, 0, 1)")).p, 0);
  EXPECT_EQ(only_aggregate(parse("ANON_NTILE(x, 1, 0, 1)")).p, 1);
}

// ---------------------------------------------------------------------------------------------------
// The select list

TEST(QuerySelect, ItemsInOrderWithDefaultNames) {
  const std::string text =
      kHead + "region, ANON_COUNT(*), day, ANON_SUM(price, 0, 100) FROM sales GROUP BY region, day";
  const Query q = parse_query(text);
  ASSERT_EQ(q.select.size(), 4U);
  ASSERT_EQ(q.aggregates.size(), 2U);
  EXPECT_FALSE(q.select[0].is_aggregate);
  EXPECT_EQ(q.select[0].column, "region");
  EXPECT_EQ(q.select[0].name, "region");
  EXPECT_EQ(q.select[0].column_pos, col(text, "region"));
  EXPECT_TRUE(q.select[1].is_aggregate);
  EXPECT_EQ(q.select[1].aggregate, 0U);
  EXPECT_EQ(q.select[1].name, "ANON_COUNT(*)");
  EXPECT_EQ(q.select[1].column_pos, col(text, "ANON_COUNT"));
  EXPECT_EQ(q.select[2].name, "day");
  EXPECT_EQ(q.select[3].aggregate, 1U);
  EXPECT_EQ(q.select[3].name, "ANON_SUM(price, 0, 100)");
  EXPECT_EQ(q.aggregates[1].column_pos, col(text, "ANON_SUM"));
  EXPECT_EQ(q.table, "sales");
  EXPECT_EQ(q.group_by, (std::vector<std::string>{"region", "day"}));
  EXPECT_FALSE(q.where.has_value());
  EXPECT_TRUE(q.options.empty());
}

TEST(QuerySelect, AliasesWithAndWithoutAs) {
  const Query q = parse("region AS r, ANON_COUNT(*) n, ANON_SUM(x, 0, 1) as Total, day d", "GROUP BY region, day");
  ASSERT_EQ(q.select.size(), 4U);
  EXPECT_EQ(q.select[0].name, "r");
  EXPECT_EQ(q.select[0].column, "region");
  EXPECT_EQ(q.select[1].name, "n");
  EXPECT_EQ(q.aggregates[0].text, "ANON_COUNT(*)");
  EXPECT_EQ(q.select[2].name, "Total");
  EXPECT_EQ(q.select[3].name, "d");
  EXPECT_EQ(q.select[3].column, "day");
}

TEST(QuerySelect, QuotedAliasMayHoldAnyText) {
  const Query q = parse(R"(ANON_COUNT(*) AS "users ""seen"" -- today")");
  EXPECT_EQ(q.select[0].name, "users \"seen\" -- today");
}

TEST(QuerySelect, SameColumnTwiceWithDistinctAliases) {
  const Query q = parse("region, region AS r2, ANON_COUNT(*)", "GROUP BY region");
  EXPECT_EQ(q.select[0].name, "region");
  EXPECT_EQ(q.select[1].name, "r2");
}

TEST(QuerySelect, GroupByColumnNotSelected) {
  const Query q = parse("ANON_COUNT(*)", "GROUP BY region");
  EXPECT_EQ(q.group_by, std::vector<std::string>{"region"});
}

TEST(QuerySelect, NoGroupBy) {
  const Query q = parse("ANON_COUNT(*), ANON_AVG(x, 0, 1)");
  EXPECT_TRUE(q.group_by.empty());
  EXPECT_EQ(q.select.size(), 2U);
}

// ---------------------------------------------------------------------------------------------------
// Options

TEST(QueryOptions, NamesLowerCasedValuesInOrder) {
  const std::string text =
      kHead + "OPTIONS(Epsilon = 1.5, selection = 'laplace', max_groups_contributed=-3) ANON_COUNT(*) FROM t";
  const Query q = parse_query(text);
  ASSERT_EQ(q.options.size(), 3U);
  EXPECT_EQ(q.options[0].name, "epsilon");
  EXPECT_FALSE(q.options[0].value.is_string);
  EXPECT_EQ(q.options[0].value.number, 1.5);
  EXPECT_EQ(q.options[0].value.text, "1.5");
  EXPECT_EQ(q.options[0].column_pos, col(text, "Epsilon"));
  EXPECT_EQ(q.options[1].name, "selection");
  EXPECT_TRUE(q.options[1].value.is_string);
  EXPECT_EQ(q.options[1].value.text, "laplace");
  EXPECT_EQ(q.options[2].name, "max_groups_contributed");
  EXPECT_EQ(q.options[2].value.number, -3);
}

TEST(QueryOptions, KeywordCaseAndQuotedName) {
  const Query q = parse_query(kHead + R"(options ("Delta" = 1e-6) ANON_COUNT(*) FROM t)");
  ASSERT_EQ(q.options.size(), 1U);
  EXPECT_EQ(q.options[0].name, "delta");
  EXPECT_EQ(q.options[0].value.number, 1e-6);
}

// ---------------------------------------------------------------------------------------------------
// WHERE

TEST(QueryWhere, EveryComparisonOperator) {
  const struct {
    const char* op;
    CmpOp want;
    const char* normal;
  } cases[] = {{"=", CmpOp::Eq, "="},   {"!=", CmpOp::Ne, "!="}, {"<>", CmpOp::Ne, "!="}, {"<", CmpOp::Lt, "<"},
               {"<=", CmpOp::Le, "<="}, {">", CmpOp::Gt, ">"},   {">=", CmpOp::Ge, ">="}};
  for (const auto& c : cases) {
    const Condition w = where(std::string("price") + c.op + "10");
    EXPECT_EQ(w.kind, Condition::Kind::Compare) << c.op;
    EXPECT_EQ(w.column, "price");
    EXPECT_EQ(w.op, c.want) << c.op;
    ASSERT_EQ(w.values.size(), 1U);
    EXPECT_EQ(w.values[0].number, 10);
    EXPECT_EQ(to_string(w), std::string("price ") + c.normal + " 10");
  }
}

TEST(QueryWhere, NumericLiterals) {
  const struct {
    const char* text;
    double value;
  } cases[] = {{"0", 0},       {"007", 7},   {"-5", -5},    {"+5", 5},           {"2.25", 2.25},
               {"-0.5", -0.5}, {"1e3", 1e3}, {"1E+3", 1e3}, {"-2.5e-2", -0.025}, {"+4.0E2", 400}};
  for (const auto& c : cases) {
    const Condition w = where(std::string("x >= ") + c.text);
    ASSERT_EQ(w.values.size(), 1U);
    EXPECT_FALSE(w.values[0].is_string);
    EXPECT_EQ(w.values[0].text, c.text);
    EXPECT_DOUBLE_EQ(w.values[0].number, c.value) << c.text;
  }
}

TEST(QueryWhere, SignGluedToOperator) {
  const Condition w = where("x>-5");
  EXPECT_EQ(w.op, CmpOp::Gt);
  EXPECT_EQ(w.values[0].number, -5);
}

TEST(QueryWhere, StringLiteralsWithEscapes) {
  const Condition w = where("name = 'O''Brien -- not a comment'");
  ASSERT_EQ(w.values.size(), 1U);
  EXPECT_TRUE(w.values[0].is_string);
  EXPECT_EQ(w.values[0].text, "O'Brien -- not a comment");
  EXPECT_EQ(to_string(w), "name = 'O''Brien -- not a comment'");
  EXPECT_EQ(where("name = ''").values[0].text, "");
  EXPECT_EQ(where("name = ''''").values[0].text, "'");
}

TEST(QueryWhere, NotBindsTighterThanAndTighterThanOr) {
  const Condition w = where("a = 1 OR b = 2 AND NOT c = 3");
  ASSERT_EQ(w.kind, Condition::Kind::Or);
  ASSERT_EQ(w.children.size(), 2U);
  EXPECT_EQ(w.children[0].kind, Condition::Kind::Compare);
  const Condition& conj = w.children[1];
  ASSERT_EQ(conj.kind, Condition::Kind::And);
  ASSERT_EQ(conj.children.size(), 2U);
  EXPECT_EQ(conj.children[0].column, "b");
  ASSERT_EQ(conj.children[1].kind, Condition::Kind::Not);
  ASSERT_EQ(conj.children[1].children.size(), 1U);
  EXPECT_EQ(conj.children[1].children[0].column, "c");
  EXPECT_EQ(to_string(w), "(a = 1 OR (b = 2 AND NOT c = 3))");
}

TEST(QueryWhere, ParenthesesOverridePrecedence) {
  const Condition w = where("(a = 1 OR b = 2) AND NOT (c = 3 AND d = 4)");
  ASSERT_EQ(w.kind, Condition::Kind::And);
  ASSERT_EQ(w.children.size(), 2U);
  EXPECT_EQ(w.children[0].kind, Condition::Kind::Or);
  ASSERT_EQ(w.children[1].kind, Condition::Kind::Not);
  EXPECT_EQ(w.children[1].children[0].kind, Condition::Kind::And);
  EXPECT_EQ(to_string(w), "((a = 1 OR b = 2) AND NOT (c = 3 AND d = 4))");
}

TEST(QueryWhere, ChainsAreOneNode) {
  const Condition w = where("a = 1 AND b = 2 AND c = 3");
  ASSERT_EQ(w.kind, Condition::Kind::And);
  EXPECT_EQ(w.children.size(), 3U);
  const Condition o = where("a = 1 OR b = 2 OR c = 3 OR d = 4");
  ASSERT_EQ(o.kind, Condition::Kind::Or);
  EXPECT_EQ(o.children.size(), 4U);
}

TEST(QueryWhere, RedundantParenthesesAndDoubleNot) {
  const Condition w = where("((a = 1))");
  EXPECT_EQ(w.kind, Condition::Kind::Compare);
  const Condition n = where("NOT NOT a = 1");
  ASSERT_EQ(n.kind, Condition::Kind::Not);
  EXPECT_EQ(n.children[0].kind, Condition::Kind::Not);
  EXPECT_EQ(to_string(n), "NOT NOT a = 1");
}

TEST(QueryWhere, InAndNotIn) {
  const Condition w = where("region IN ('EU', 'US')");
  ASSERT_EQ(w.kind, Condition::Kind::In);
  EXPECT_FALSE(w.negated);
  ASSERT_EQ(w.values.size(), 2U);
  EXPECT_EQ(w.values[0].text, "EU");
  EXPECT_EQ(w.values[1].text, "US");
  const Condition n = where("code not in (-1)");
  ASSERT_EQ(n.kind, Condition::Kind::In);
  EXPECT_TRUE(n.negated);
  ASSERT_EQ(n.values.size(), 1U);
  EXPECT_EQ(n.values[0].number, -1);
  EXPECT_EQ(to_string(n), "code NOT IN (-1)");
  EXPECT_EQ(to_string(w), "region IN ('EU', 'US')");
}

TEST(QueryWhere, NotInVersusNotOfIn) {
  const Condition w = where("NOT region IN ('EU')");
  ASSERT_EQ(w.kind, Condition::Kind::Not);
  EXPECT_FALSE(w.children[0].negated);
}

TEST(QueryWhere, BetweenAndNotBetween) {
  const Condition w = where("price BETWEEN 1 AND 1e2 AND qty NOT BETWEEN -3 AND +3");
  ASSERT_EQ(w.kind, Condition::Kind::And);
  ASSERT_EQ(w.children.size(), 2U);
  const Condition& b = w.children[0];
  EXPECT_EQ(b.kind, Condition::Kind::Between);
  EXPECT_FALSE(b.negated);
  ASSERT_EQ(b.values.size(), 2U);
  EXPECT_EQ(b.values[0].number, 1);
  EXPECT_EQ(b.values[1].number, 100);
  const Condition& nb = w.children[1];
  EXPECT_EQ(nb.kind, Condition::Kind::Between);
  EXPECT_TRUE(nb.negated);
  EXPECT_EQ(to_string(w), "(price BETWEEN 1 AND 1e2 AND qty NOT BETWEEN -3 AND +3)");
  const Condition s = where("d BETWEEN '2024-01-01' AND '2024-12-31'");
  EXPECT_TRUE(s.values[0].is_string);
  EXPECT_EQ(s.values[1].text, "2024-12-31");
}

TEST(QueryWhere, IsNullAndIsNotNull) {
  const Condition w = where("price IS NULL");
  EXPECT_EQ(w.kind, Condition::Kind::IsNull);
  EXPECT_EQ(w.column, "price");
  EXPECT_FALSE(w.negated);
  EXPECT_TRUE(w.values.empty());
  EXPECT_TRUE(w.children.empty());
  EXPECT_EQ(to_string(w), "price IS NULL");
  const Condition n = where("Price is not null");  // keywords in any case, the column keeps its case
  EXPECT_EQ(n.kind, Condition::Kind::IsNull);
  EXPECT_EQ(n.column, "Price");
  EXPECT_TRUE(n.negated);
  EXPECT_TRUE(n.values.empty());
  EXPECT_EQ(to_string(n), "Price IS NOT NULL");
  const std::string text = kHead + "ANON_COUNT(*) FROM t WHERE a = 1 AND\n  bee IS NOT NULL";
  const Query q = parse_query(text);
  ASSERT_TRUE(q.where.has_value());
  ASSERT_EQ(q.where->children.size(), 2U);
  EXPECT_EQ(q.where->children[1].column_pos, col(text, "bee"));
}

TEST(QueryWhere, IsNullWithAndOrNot) {
  const Condition w = where("a IS NULL OR b IS NOT NULL AND NOT c IS NULL");
  ASSERT_EQ(w.kind, Condition::Kind::Or);
  ASSERT_EQ(w.children.size(), 2U);
  EXPECT_EQ(w.children[0].kind, Condition::Kind::IsNull);
  EXPECT_EQ(w.children[0].column, "a");
  EXPECT_FALSE(w.children[0].negated);
  const Condition& conj = w.children[1];
  ASSERT_EQ(conj.kind, Condition::Kind::And);
  ASSERT_EQ(conj.children.size(), 2U);
  EXPECT_EQ(conj.children[0].kind, Condition::Kind::IsNull);
  EXPECT_EQ(conj.children[0].column, "b");
  EXPECT_TRUE(conj.children[0].negated);
  ASSERT_EQ(conj.children[1].kind, Condition::Kind::Not);
  ASSERT_EQ(conj.children[1].children.size(), 1U);
  EXPECT_EQ(conj.children[1].children[0].kind, Condition::Kind::IsNull);
  EXPECT_EQ(conj.children[1].children[0].column, "c");
  EXPECT_EQ(to_string(w), "(a IS NULL OR (b IS NOT NULL AND NOT c IS NULL))");
  const Condition p = where("(x = 1 OR y IS NULL) AND z IN (2)");
  ASSERT_EQ(p.kind, Condition::Kind::And);
  ASSERT_EQ(p.children[0].kind, Condition::Kind::Or);
  EXPECT_EQ(p.children[0].children[1].kind, Condition::Kind::IsNull);
  EXPECT_EQ(to_string(p), "((x = 1 OR y IS NULL) AND z IN (2))");
}

// NOT applies to the whole predicate: NOT x IS NULL is NOT (x IS NULL), not x IS NOT NULL.
TEST(QueryWhere, NotOfIsNullVersusIsNotNull) {
  const Condition w = where("NOT x IS NULL");
  ASSERT_EQ(w.kind, Condition::Kind::Not);
  ASSERT_EQ(w.children.size(), 1U);
  EXPECT_EQ(w.children[0].kind, Condition::Kind::IsNull);
  EXPECT_EQ(w.children[0].column, "x");
  EXPECT_FALSE(w.children[0].negated);
  EXPECT_EQ(to_string(w), "NOT x IS NULL");
  const Condition n = where("NOT x IS NOT NULL");
  ASSERT_EQ(n.kind, Condition::Kind::Not);
  EXPECT_TRUE(n.children[0].negated);
  EXPECT_EQ(to_string(n), "NOT x IS NOT NULL");
}

TEST(QueryWhere, NullIsAKeywordOnlyAfterIs) {
  const Condition w = where("null IS NULL");  // a column named null
  EXPECT_EQ(w.kind, Condition::Kind::IsNull);
  EXPECT_EQ(w.column, "null");
  EXPECT_EQ(to_string(where(R"("is" IS NOT NULL)")), R"("is" IS NOT NULL)");  // IS is reserved: quoted
}

TEST(QueryWhere, ColumnPositions) {
  const std::string text = kHead + "ANON_COUNT(*) FROM t WHERE a = 1 AND\n  bee IN (2)";
  const Query q = parse_query(text);
  ASSERT_TRUE(q.where.has_value());
  EXPECT_EQ(q.where->children[0].column_pos, col(text, "a = 1"));
  EXPECT_EQ(q.where->children[1].column_pos, col(text, "bee"));  // offset in the whole text + 1
}

TEST(QueryWhere, ToStringExample) {
  EXPECT_EQ(to_string(where("region = 'EU' and not price < 10")), "(region = 'EU' AND NOT price < 10)");
}

// Wrapping a condition's text in a query gives back the same text.
TEST(QueryWhere, RoundTrip) {
  const char* conditions[] = {
      "a = 1",
      "a <> 'x' OR b >= -2.5e-3 AND NOT c IN (1, 2, 'three')",
      "NOT (a BETWEEN 1 AND 2 OR b NOT BETWEEN 'a' AND 'b') AND c NOT IN ('it''s')",
      "((a = 1 AND b = 2) AND c = 3) OR (d < 4)",
      R"("select" = 1 AND "my col" != 'v' AND "quote""d" > +1 AND "9lives" <= 9)",
      "NOT NOT NOT x IN ('')",
      "price IS NULL",
      "price is not null",
      "NOT x IS NULL AND (y IS NOT NULL OR z = 1)",
      R"("is" IS NULL OR "my col" IS NOT NULL OR null IS NULL)",
  };
  for (const char* c : conditions) {
    const std::string once = to_string(where(c));
    const std::string twice = to_string(where(once));
    EXPECT_EQ(once, twice) << c;
  }
}

TEST(QueryWhere, ToStringQuotesNamesThatNeedIt) {
  EXPECT_EQ(to_string(where(R"("from" = 1)")), R"("from" = 1)");
  EXPECT_EQ(to_string(where(R"("a b""c" = 1)")), R"("a b""c" = 1)");
  EXPECT_EQ(to_string(where(R"("plain" = 1)")), "plain = 1");
}

// ---------------------------------------------------------------------------------------------------
// Lexical details

TEST(QueryLexical, KeywordsAnyCaseIdentifiersKeepCase) {
  const Query q = parse_query(
      "select With anonymization Region, Anon_Count(*) AS N from Sales wHeRe Region In ('EU') group BY Region;");
  EXPECT_EQ(q.table, "Sales");
  EXPECT_EQ(q.select[0].column, "Region");
  EXPECT_EQ(q.select[1].name, "N");
  EXPECT_EQ(q.group_by, std::vector<std::string>{"Region"});
  ASSERT_TRUE(q.where.has_value());
  EXPECT_EQ(q.where->column, "Region");
}

TEST(QueryLexical, QuotedIdentifiers) {
  const Query q = parse_query(kHead + R"("Unit Price", ANON_SUM("unit ""price""", 0, 9), ANON_COUNT(DISTINCT "User") )"
                                      R"(FROM "my table" WHERE "where" = 1 GROUP BY "Unit Price")");
  EXPECT_EQ(q.select[0].column, "Unit Price");
  EXPECT_EQ(q.select[0].name, "Unit Price");
  EXPECT_EQ(q.aggregates[0].column, "unit \"price\"");
  EXPECT_EQ(q.aggregates[0].text, R"(ANON_SUM("unit ""price""", 0, 9))");
  EXPECT_EQ(q.aggregates[1].column, "User");
  EXPECT_EQ(q.aggregates[1].text, R"(ANON_COUNT(DISTINCT "User"))");
  EXPECT_EQ(q.table, "my table");
  EXPECT_EQ(q.where->column, "where");
  EXPECT_EQ(q.group_by, std::vector<std::string>{"Unit Price"});
}

TEST(QueryLexical, QuotedAndBareNamesAreTheSameColumn) {
  const Query q = parse(R"("region", ANON_COUNT(*))", "GROUP BY region");
  EXPECT_EQ(q.select[0].column, "region");
}

TEST(QueryLexical, CommentsAndLineBreaks) {
  const std::string text =
      "-- daily revenue\nSELECT WITH ANONYMIZATION -- the DP form\n"
      "  ANON_SUM(price, 0, 100) AS revenue, -- per user clamped\n"
      "  day\nFROM sales\nWHERE price > 0 -- drop refunds\nGROUP BY day -- one row per day";
  const Query q = parse_query(text);
  ASSERT_EQ(q.select.size(), 2U);
  EXPECT_EQ(q.select[0].name, "revenue");
  EXPECT_EQ(q.select[0].column_pos, col(text, "ANON_SUM"));
  EXPECT_EQ(q.select[1].column_pos, col(text, "day"));
  EXPECT_EQ(q.group_by, std::vector<std::string>{"day"});
}

TEST(QueryLexical, SemicolonAndWhitespace) {
  EXPECT_NO_THROW(parse_query(kHead + "ANON_COUNT(*) FROM t;"));
  EXPECT_NO_THROW(parse_query("\n\t " + kHead + "ANON_COUNT(*) FROM t ; -- done\n\n"));
}

TEST(QueryLexical, ColumnsNamedLikePlainFunctions) {
  // COUNT, SUM... are not keywords: only a call of them is refused.
  const Query q = parse("count, ANON_SUM(sum, 0, 1)", "GROUP BY count");
  EXPECT_EQ(q.select[0].column, "count");
  EXPECT_EQ(q.aggregates[0].column, "sum");
}

// ---------------------------------------------------------------------------------------------------
// Malformed queries

struct Bad {
  std::string text;
  std::size_t column;  // expected QueryError::column()
  std::string token;   // shown in what() as 'token'
  std::string hint;    // part of what() after the token
};

void expect_refused(const Bad& b) {
  SCOPED_TRACE(b.text);
  try {
    parse_query(b.text);
    ADD_FAILURE() << "accepted";
  } catch (const QueryError& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.column(), b.column) << what;
    EXPECT_NE(what.find("column " + std::to_string(b.column) + " ('" + b.token + "'): "), std::string::npos) << what;
    EXPECT_NE(what.find(b.hint), std::string::npos) << what;
    EXPECT_NE(what.find("; "), std::string::npos) << what;  // what is wrong; what to write instead
  }
}

// A refused query: the column is that of the nth `at` in the text.
Bad bad(const std::string& text, const std::string& at, const std::string& hint, int nth = 0) {
  return {text, col(text, at, nth), at, hint};
}

// A query refused at its end.
Bad bad_end(const std::string& text, const std::string& hint) { return {text, text.size() + 1, "end of query", hint}; }

TEST(QueryErrors, BriefExamples) {
  expect_refused({"SELECT WITH ANONYMIZATION ANON_COUNT(*) FORM t", 41, "FORM", "expected FROM after the select list"});
  expect_refused({"SELECT WITH ANONYMISATION ANON_COUNT(*) FROM t", 13, "ANONYMISATION",
                  "expected ANONYMIZATION after SELECT WITH; dpstream only runs anonymized queries"});
  expect_refused({"SELECT WITH ANONYMIZATION ANON_SUM(price, 0) FROM t", 27, "ANON_SUM",
                  "ANON_SUM takes (column, lower, upper), e.g. ANON_SUM(price, 0, 100)"});
  expect_refused({"SELECT WITH ANONYMIZATION COUNT(*) FROM t", 27, "COUNT",
                  "COUNT is not a DP aggregate; use ANON_COUNT(*), ANON_COUNT(col, U) or ANON_COUNT(DISTINCT uid)"});
  expect_refused({"SELECT WITH ANONYMIZATION region, ANON_COUNT(*) FROM t", 27, "region",
                  "region is in SELECT but not in GROUP BY; add it to GROUP BY or remove it"});
  expect_refused({"SELECT WITH ANONYMIZATION ANON_COUNT(*) AS total, ANON_SUM(x, 0, 1) total FROM t", 69, "total",
                  "output name total is used twice (columns 44 and 69); give one of them another alias"});
}

TEST(QueryErrors, Header) {
  expect_refused(bad_end("", "empty query; write SELECT WITH ANONYMIZATION"));
  expect_refused(bad_end("  -- nothing but a comment\n", "empty query"));
  expect_refused(bad("SELEC WITH ANONYMIZATION ANON_COUNT(*) FROM t", "SELEC", "a query starts with SELECT"));
  expect_refused(bad("SELECT ANON_COUNT(*) FROM t", "ANON_COUNT", "expected WITH after SELECT"));
  expect_refused(bad_end("SELECT WITH", "expected ANONYMIZATION"));
}

TEST(QueryErrors, SelectList) {
  expect_refused(bad(kHead + "FROM t", "FROM", "the select list is missing; list at least one aggregate"));
  expect_refused(bad_end("SELECT WITH ANONYMIZATION", "the select list is missing"));
  expect_refused(bad_end(kHead + "ANON_COUNT(*)", "expected FROM after the select list"));
  expect_refused(
      bad(kHead + "region ANON_COUNT(*) FROM t GROUP BY region", "ANON_COUNT", "separate select items with ','"));
  expect_refused(bad(kHead + "ANON_COUNT(*), FROM t", "FROM", "remove the ','"));
  expect_refused(bad(kHead + "ANON_COUNT FROM t", "ANON_COUNT", "ANON_COUNT takes (*), (*, U)"));
  expect_refused(bad(kHead + "ANON_COUNT(*) AS FROM t", "FROM", "write AS <name>"));
  expect_refused(bad(kHead + "'x', ANON_COUNT(*) FROM t", "'x'", "at least one aggregate"));
  expect_refused(bad(kHead + R"("f"(x), ANON_COUNT(*) FROM t)", "\"f\"", "unquoted"));
  expect_refused(bad(kHead + "region FROM t GROUP BY region", "region", "add one, e.g. ANON_COUNT(*)"));
  expect_refused(bad(kHead + "ANON_COUNT(*), ANON_COUNT(*) FROM t", "ANON_COUNT(*)",
                     "is used twice (columns 27 and 42); give one of them another alias", 1));
  expect_refused(bad(kHead + "region, region, ANON_COUNT(*) FROM t GROUP BY region", "region", "used twice", 1));
}

TEST(QueryErrors, Functions) {
  expect_refused(bad(kHead + "SUM(x) FROM t", "SUM", "use ANON_SUM(col, lower, upper)"));
  expect_refused(bad(kHead + "median(x) FROM t", "median", "use ANON_MEDIAN"));
  expect_refused(bad(kHead + "ANON_TOTAL(x, 0, 1) FROM t", "ANON_TOTAL",
                     "the supported aggregates are ANON_COUNT, ANON_SUM, ANON_AVG, ANON_VAR, ANON_STDDEV, ANON_MIN, "
                     "ANON_MAX, ANON_MEDIAN, ANON_NTILE"));
  expect_refused(bad(kHead + "ANON_SUM(price, 'a', 100) FROM t", "'a'", "ANON_SUM takes (column, lower, upper)"));
  expect_refused(bad(kHead + "ANON_SUM(price, lo, 100) FROM t", "lo", "argument 2 of ANON_SUM must be a number"));
  expect_refused(bad(kHead + "ANON_SUM(*, 0, 100) FROM t", "*", "argument 1 of ANON_SUM must be a column name"));
  expect_refused(bad(kHead + "ANON_AVG(DISTINCT x, 0, 1) FROM t", "DISTINCT", "must be a column name"));
  expect_refused(bad(kHead + "ANON_SUM(price, 0, 100 FROM t", "FROM", "expected ',' or ')' in the ANON_SUM call"));
  expect_refused(bad(kHead + "ANON_SUM() FROM t", "ANON_SUM", "0 arguments given"));
  expect_refused(bad(kHead + "ANON_NTILE(x, 0, 1) FROM t", "ANON_NTILE", "takes (column, p, lower, upper)"));
  expect_refused(bad(kHead + "ANON_MAX(x, 0, 1, 2) FROM t", "ANON_MAX", "ANON_MAX takes (column, lower, upper)"));
}

TEST(QueryErrors, CountForms) {
  expect_refused(bad(kHead + "ANON_COUNT(x) FROM t", "ANON_COUNT", "(column, U) or (DISTINCT uid)"));
  expect_refused(bad(kHead + "ANON_COUNT(DISTINCT uid, 3) FROM t", "ANON_COUNT", "2 arguments given"));
  expect_refused(bad(kHead + "ANON_COUNT(5) FROM t", "5", "must be *, a column name or DISTINCT uid"));
  expect_refused(bad(kHead + "ANON_COUNT(DISTINCT *) FROM t", "*", "ANON_COUNT(DISTINCT uid)"));
  expect_refused(bad(kHead + "ANON_COUNT(*, 0) FROM t", "0", "positive integer"));
  expect_refused(bad(kHead + "ANON_COUNT(*, 2.5) FROM t", "2.5", "e.g. ANON_COUNT(*, 5)"));
  expect_refused(bad(kHead + "ANON_COUNT(x, 1048577) FROM t", "1048577", "<= 1048576"));
  expect_refused(bad(kHead + "ANON_COUNT(*, -1) FROM t", "-1", "positive integer"));
}

TEST(QueryErrors, Bounds) {
  expect_refused(bad(kHead + "ANON_SUM(price, 10, 5) FROM t", "5",
                     "upper bound 5 is below lower bound 10; write the lower bound first: ..., 5, 10)"));
  expect_refused(bad(kHead + "ANON_SUM(price, 0, 2e12) FROM t", "2e12", "within [-1099511627776, 1099511627776]"));
  expect_refused(bad(kHead + "ANON_AVG(price, -1099511627777, 0) FROM t", "-1099511627777", "2^40"));
  expect_refused(
      bad(kHead + "ANON_SUM(price, 0, 1e999) FROM t", "1e999", "out of the range of a double; write 0 or a magnitude"));
  expect_refused(bad(kHead + "ANON_NTILE(x, 1.5, 0, 1) FROM t", "1.5", "e.g. 0.9"));
  expect_refused(bad(kHead + "ANON_NTILE(x, -0.1, 0, 1) FROM t", "-0.1", "[0, 1]"));
}

TEST(QueryErrors, Options) {
  expect_refused(bad(kHead + "OPTIONS(epsilon = 1, Epsilon = 2) ANON_COUNT(*) FROM t", "Epsilon",
                     "option epsilon is given twice (columns 35 and 48); give each option once"));
  expect_refused(bad(kHead + "OPTIONS epsilon = 1 ANON_COUNT(*) FROM t", "epsilon", "expected '(' after OPTIONS"));
  expect_refused(bad(kHead + "OPTIONS(epsilon 1) ANON_COUNT(*) FROM t", "1", "write name = value"));
  expect_refused(bad(kHead + "OPTIONS(epsilon = high) ANON_COUNT(*) FROM t", "high", "number or a 'string'"));
  expect_refused(bad(kHead + "OPTIONS() ANON_COUNT(*) FROM t", ")", "expected an option name"));
  expect_refused(bad(kHead + "OPTIONS(a = 1 ANON_COUNT(*) FROM t", "ANON_COUNT", "expected ',' or ')' in OPTIONS"));
}

TEST(QueryErrors, FromAndTail) {
  expect_refused(bad(kHead + "ANON_COUNT(*) FROM WHERE x = 1", "WHERE", "or write \"WHERE\" if it is a name"));
  expect_refused(bad_end(kHead + "ANON_COUNT(*) FROM", "write FROM <table>"));
  expect_refused(bad(kHead + "ANON_COUNT(*) FROM t u", "u", "the query ends after FROM <table>"));
  expect_refused(bad(kHead + "ANON_COUNT(*) FROM t; SELECT", "SELECT", "remove what follows ';'", 1));
  expect_refused(bad(kHead + "ANON_COUNT(*) FROM t;;", ";", "remove what follows ';'", 1));
  expect_refused(bad(kHead + "ANON_COUNT(*) FROM t GROUP region", "region", "expected BY after GROUP"));
  expect_refused(bad_end(kHead + "ANON_COUNT(*) FROM t GROUP BY", "write GROUP BY column"));
  expect_refused(bad(kHead + "ANON_COUNT(*) FROM t GROUP BY a, b, a", "a", "a is listed twice in GROUP BY", 1));
  expect_refused(bad(kHead + "ANON_COUNT(*) FROM t GROUP BY a WHERE a = 1", "WHERE", "write WHERE before GROUP BY"));
  expect_refused(bad_end(kHead + "ANON_COUNT(*) FROM t GROUP BY a,", "write GROUP BY column"));
}

TEST(QueryErrors, Where) {
  const std::string q = kHead + "ANON_COUNT(*) FROM t WHERE ";
  expect_refused(bad_end(q, "expected a condition"));
  expect_refused(bad_end(q + "x = 1 AND", "expected a condition"));
  expect_refused(bad_end(q + "(x = 1", "expected ')' to close the '(' at column 54"));
  expect_refused(bad(q + "x = 1)", ")", "')' without a matching '('", 1));
  expect_refused(bad(q + "((x = 1) OR y = 2))", ")", "remove it or add the '(' it closes", 3));
  expect_refused(bad(q + "x == 1", "=", "expected a number or a 'string'", 1));
  expect_refused(bad(q + "x = \"EU\"", "\"EU\"", "write text between single quotes, e.g. 'EU'"));
  expect_refused(bad(q + "x = y", "y", "compare a column with a literal"));
  expect_refused(bad(q + "5 < x", "5", "a condition starts with a column name"));
  expect_refused(bad(q + "x NOT LIKE 'a'", "LIKE", "expected IN or BETWEEN after NOT"));
  expect_refused(bad(q + "x LIKE 'a'", "LIKE", "write e.g. x = 1"));
  expect_refused(bad(q + "x BETWEEN 1 5", "5", "write BETWEEN low AND high"));
  expect_refused(bad(q + "x IN ()", ")", "expected a number or a 'string'", 1));
  expect_refused(bad(q + "x IN 1, 2", "1", "write IN (value, ...)"));
  expect_refused(bad_end(q + "x IN (1, 2", "expected ',' or ')' in the IN list"));
  expect_refused(bad(q + "AND x = 1", "AND", "or write \"AND\" if it is a name"));
}

TEST(QueryErrors, IsNull) {
  const std::string q = kHead + "ANON_COUNT(*) FROM t WHERE ";
  expect_refused(
      bad_end(q + "price IS", "expected NULL or NOT NULL after IS; write price IS NULL or price IS NOT NULL"));
  expect_refused(bad_end(q + "price IS NOT", "expected NULL after IS NOT; write price IS NOT NULL"));
  expect_refused(bad(q + "price IS 5", "5", "expected NULL or NOT NULL after IS"));
  expect_refused(bad(q + "price IS NUL", "NUL", "expected NULL or NOT NULL after IS"));
  expect_refused(bad(q + "price IS NOT 'x'", "'x'", "expected NULL after IS NOT"));
  expect_refused(bad(q + "price IS NULL NULL", "NULL", "the query ends after FROM <table>", 1));
  expect_refused(bad(q + "price NULL", "NULL", "expected IS before NULL; write price IS NULL"));
  expect_refused(
      bad(q + "price NOT NULL", "NULL", "expected IN or BETWEEN after NOT; to test for NULL write price IS NOT NULL"));
  expect_refused(bad(q + "price NOT IS NULL", "IS", "write price IS NOT NULL"));
  expect_refused(
      bad(q + "price = NULL", "NULL", "NULL is not a value to compare with; to test for NULL write col IS NULL"));
  expect_refused(bad(q + "x IN (1, null)", "null", "NULL is not a value to compare with"));
  expect_refused(bad(q + "IS NULL", "IS", "expected a condition, found the keyword IS"));
  expect_refused(bad(q + "x LIKE 'a'", "LIKE", "expected =, !=, <>, <, <=, >, >=, IN, BETWEEN or IS after x"));
  expect_refused(bad(kHead + "ANON_COUNT(*) FROM is", "is", "or write \"is\" if it is a name"));
}

// The brief's example: the offending token's column, what was expected, what to write.
TEST(QueryErrors, IsNullBriefExample) {
  const std::string text = "SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM t WHERE price IS NUL";
  try {
    parse_query(text);
    ADD_FAILURE() << "accepted";
  } catch (const QueryError& e) {
    EXPECT_EQ(std::string(e.what()),
              "column 63 ('NUL'): expected NULL or NOT NULL after IS; write price IS NULL or price IS NOT NULL");
    EXPECT_EQ(e.column(), 63U);
  }
}

TEST(QueryErrors, Lexical) {
  const std::string q = kHead + "ANON_COUNT(*) FROM t WHERE x = ";
  expect_refused(bad(q + "'abc", "'abc", "unterminated string; close it with '"));
  expect_refused(bad(kHead + "ANON_COUNT(*) FROM \"abc", "\"abc", "unterminated quoted name"));
  expect_refused(bad(kHead + "ANON_COUNT(*) FROM \"\"", "\"\"", "a quoted name cannot be empty"));
  expect_refused(bad(q + "1.", "1.", "malformed number; write [sign] digits"));
  expect_refused(bad(q + "1e", "1e", "e.g. -2.5 or 1e6"));
  expect_refused(bad(q + "5abc", "5abc", "malformed number"));
  expect_refused(bad(q + "1.2.3", "1.2.3", "malformed number"));
  expect_refused(bad(q + ".5", ".", "unexpected character"));
  expect_refused(bad(q + "- 5", "-", "a sign must be followed by digits"));
  expect_refused(bad(q + "1e-400", "1e-400", "out of the range of a double"));
  expect_refused(bad(kHead + "ANON_COUNT(*) FROM t WHERE x # 1", "#", "unexpected character"));
  expect_refused(bad(kHead + "ANON_COUNT(*) FROM t WHERE x = 1 ! 2", "!", "unexpected character"));
  expect_refused(bad(kHead + "ANON_COUNT(*) FROM t WHERE x = 'é' AND ü = 1", "ü", "unexpected character"));
}

TEST(QueryErrors, ColumnsCountTheWholeTextAcrossLines) {
  const std::string text = "SELECT WITH ANONYMIZATION\n  ANON_COUNT(*),\n  ANON_SUM(price, 0)\nFROM t";
  expect_refused({text, 46, "ANON_SUM", "ANON_SUM takes (column, lower, upper)"});
  EXPECT_EQ(text.find("ANON_SUM") + 1, 46U);
}

TEST(QueryErrors, DeepNestingRefused) {
  const std::string text =
      kHead + "ANON_COUNT(*) FROM t WHERE " + std::string(500, '(') + "x = 1" + std::string(500, ')');
  try {
    parse_query(text);
    ADD_FAILURE() << "accepted";
  } catch (const QueryError& e) {
    EXPECT_NE(std::string(e.what()).find("nests too deeply; simplify it"), std::string::npos) << e.what();
    EXPECT_GT(e.column(), col(text, "("));
  }
  const std::string nots = kHead + "ANON_COUNT(*) FROM t WHERE ";
  std::string deep = nots;
  for (int i = 0; i < 1000; ++i) deep += "NOT ";
  EXPECT_THROW(parse_query(deep + "x = 1"), QueryError);
  std::string fine = nots;
  for (int i = 0; i < 100; ++i) fine += "NOT ";
  EXPECT_NO_THROW(parse_query(fine + "x = 1"));
}

TEST(QueryErrors, ErrorIsInvalidArgument) { EXPECT_THROW(parse_query("SELECT"), std::invalid_argument); }

}  // namespace
}  // namespace dpstream::sql
