// The DP SQL grammar of one table (seed 003, Wilson et al., "Differentially Private SQL with Bounded
// User Contribution", arXiv 1909.01917, section 4): its syntax tree and a recursive-descent parser.
//
//   query      := SELECT WITH ANONYMIZATION [OPTIONS '(' option (',' option)* ')']
//                 item (',' item)* FROM ident [WHERE cond] [GROUP BY ident (',' ident)*] [';']
//   option     := ident '=' (number | string)
//   item       := (ident | aggregate) [[AS] ident]
//   aggregate  := ANON_COUNT '(' '*' [',' number] ')' | ANON_COUNT '(' ident ',' number ')'
//               | ANON_COUNT '(' DISTINCT ident ')'            -- the user column only
//               | (ANON_SUM | ANON_AVG | ANON_VAR | ANON_STDDEV | ANON_MIN | ANON_MAX | ANON_MEDIAN)
//                   '(' ident ',' number ',' number ')'
//               | ANON_NTILE '(' ident ',' number ',' number ',' number ')'   -- (col, p, L, U)
//   cond       := conj (OR conj)*          conj := neg (AND neg)*
//   neg        := NOT neg | '(' cond ')' | ident cmp literal | ident [NOT] IN '(' literal (',' literal)* ')'
//               | ident [NOT] BETWEEN literal AND literal | ident IS [NOT] NULL
//   cmp        := '=' | '!=' | '<>' | '<' | '<=' | '>' | '>='
//   literal    := number | string            number := ['-' | '+'] digits ['.' digits] [e ['-'|'+'] digits]
//   string     := '...' ('' escapes a quote)  ident := [A-Za-z_][A-Za-z0-9_]* | "..." (quoted, any text)
// Keywords are case-insensitive; identifiers keep their case. Comments: -- to the end of the line.
// NULL is a keyword only after IS (it is not reserved: elsewhere it is a name, e.g. a column "null").
#pragma once

#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace dpstream::sql {

// A query the grammar or its rules refuse. what() names the offending token, its 1-based column
// in the query text and what to write instead, e.g.
//   column 31 ('FORM'): expected FROM after the select list
class QueryError : public std::invalid_argument {
 public:
  QueryError(const std::string& message, std::size_t column) : std::invalid_argument(message), column_(column) {}
  std::size_t column() const { return column_; }  // 1-based; 0 when the error has no position

 private:
  std::size_t column_;
};

enum class AggKind {
  Count,          // ANON_COUNT(*[, U]) or ANON_COUNT(col, U): per-user count in the group, clamped to [0, U]
  CountDistinct,  // ANON_COUNT(DISTINCT uid): distinct users of the group
  Sum,            // ANON_SUM(col, L, U): per-user sum in the group, clamped to [L, U]
  Avg,            // ANON_AVG(col, L, U): mean over users of the per-user mean, clamped to [L, U]
  Var,            // ANON_VAR(col, L, U): variance over users of the per-user mean, clamped to [L, U]
  Stddev,         // ANON_STDDEV(col, L, U): sqrt of ANON_VAR
  Ntile           // ANON_NTILE(col, p, L, U), ANON_MIN (p = 0), ANON_MAX (p = 1), ANON_MEDIAN (p = 0.5)
};

struct Aggregate {
  AggKind kind = AggKind::Count;
  std::string column;          // empty for ANON_COUNT(*); the user column for CountDistinct
  bool has_bounds = false;     // false only for ANON_COUNT(*) without U (the query option applies)
  double lower = 0;            // L (0 for counts)
  double upper = 0;            // U
  double p = 0;                // Ntile: the quantile in [0, 1]
  std::string text;            // the call as normalized text, e.g. "ANON_SUM(price, 0, 100)"
  std::size_t column_pos = 0;  // 1-based column of the call in the query (for messages)
};

struct Literal {
  bool is_string = false;
  std::string text;   // the string's value, or the number as written
  double number = 0;  // when !is_string
};

enum class CmpOp { Eq, Ne, Lt, Le, Gt, Ge };

// A WHERE condition on the raw (non-aggregated) columns of a row. IsNull is `column IS NULL`, or
// `column IS NOT NULL` when negated (NOT column IS NULL is instead a Not over a plain IsNull).
struct Condition {
  enum class Kind { And, Or, Not, Compare, In, Between, IsNull } kind = Kind::Compare;
  std::vector<Condition> children;  // And, Or: two or more; Not: one
  std::string column;               // Compare, In, Between, IsNull
  CmpOp op = CmpOp::Eq;             // Compare
  std::vector<Literal> values;      // Compare: 1; In: 1 or more; Between: 2 (low, high); IsNull: none
  bool negated = false;             // NOT IN, NOT BETWEEN, IS NOT NULL
  std::size_t column_pos = 0;       // 1-based column of the column name in the query
};

// One output column: a group column or an aggregate, in SELECT order.
struct SelectItem {
  bool is_aggregate = false;
  std::string column;          // a group column (when !is_aggregate)
  std::size_t aggregate = 0;   // index into Query::aggregates (when is_aggregate)
  std::string name;            // output header: the alias, else the column name or Aggregate::text
  std::size_t column_pos = 0;  // 1-based
};

struct Option {
  std::string name;  // lower-cased
  Literal value;
  std::size_t column_pos = 0;
};

struct Query {
  std::vector<SelectItem> select;
  std::vector<Aggregate> aggregates;
  std::string table;  // the FROM name (any identifier; the input is given by --input)
  std::optional<Condition> where;
  std::vector<std::string> group_by;  // may be empty: one group holding every row
  std::vector<Option> options;        // OPTIONS(...) in order
};

// Parses and checks `text`; throws QueryError. Rules beyond the grammar, all checked here:
//  - at least one aggregate; a bare column in SELECT must be in GROUP BY; GROUP BY columns distinct;
//  - output names distinct (an alias or a default name used twice is refused, naming both);
//  - bounds finite, L <= U, |L| and |U| <= 2^40; ANON_COUNT's U a positive integer <= 2^20; NTILE's p in [0, 1];
//  - option names distinct.
// Which columns exist, which one is the user column and the options' meaning are checked by the caller.
Query parse_query(std::string_view text);

// The normalized text of a condition (for the report), e.g. "(region = 'EU' AND NOT price < 10)".
std::string to_string(const Condition& c);

}  // namespace dpstream::sql
