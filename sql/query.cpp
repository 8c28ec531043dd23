// The DP SQL parser (sql/query.hpp): a tokenizer, then a recursive-descent parser over the tokens, then
// the rules beyond the grammar. Every error is a QueryError "column N ('TOKEN'): what is wrong; what to
// write instead". A token's column is its byte offset in the whole text + 1, also when the text spans
// lines: columns then count from the start of the text, not of the line (N is one number, easy to test).
#include "sql/query.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <map>
#include <utility>

namespace dpstream::sql {

namespace {

constexpr double kMaxBound = 1099511627776.0;  // 2^40, the header's limit on |L| and |U|
constexpr double kMaxCountBound = 1048576.0;   // 2^20, the header's limit on ANON_COUNT's U
constexpr int kMaxDepth = 200;                 // nesting of WHERE: bounds the recursion on hostile input
constexpr std::size_t kMaxShownToken = 40;     // longer tokens are cut in messages

// ---------------------------------------------------------------------------------------------------
// Errors

// The token as shown in a message: its text, cut when long.
std::string shown(std::string_view token) {
  if (token.size() <= kMaxShownToken) return "'" + std::string(token) + "'";
  return "'" + std::string(token.substr(0, kMaxShownToken)) + "...'";
}

[[noreturn]] void fail_at(std::size_t column, std::string_view token, std::string_view what, std::string_view hint) {
  throw QueryError(fmt::format("column {} ({}): {}; {}", column, shown(token), what, hint), column);
}

// ---------------------------------------------------------------------------------------------------
// Tokens

struct Token {
  enum class Kind { Word, QuotedName, Number, String, Symbol, End } kind = Kind::End;
  std::string src;    // the text as written ("end of query" for End)
  std::string value;  // the name of a Word or QuotedName, the value of a String
  double number = 0;  // Number
  std::size_t column = 0;
};

[[noreturn]] void fail(const Token& t, std::string_view what, std::string_view hint) {
  fail_at(t.column, t.src, what, hint);
}

std::string upper(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

bool is_word_start(char c) { return std::isalpha(static_cast<unsigned char>(c)) != 0 || c == '_'; }
bool is_word_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

// Splits the text into tokens; the last one is End.
class Lexer {
 public:
  explicit Lexer(std::string_view text) : text_(text) {}

  std::vector<Token> run() {
    std::vector<Token> out;
    for (skip_blanks(); pos_ < text_.size(); skip_blanks()) out.push_back(token());
    Token end;
    end.src = "end of query";
    end.column = text_.size() + 1;
    out.push_back(end);
    return out;
  }

 private:
  char at(std::size_t i) const { return i < text_.size() ? text_[i] : '\0'; }

  // Whitespace and -- comments separate tokens.
  void skip_blanks() {
    while (pos_ < text_.size()) {
      if (std::isspace(static_cast<unsigned char>(text_[pos_])) != 0) {
        ++pos_;
      } else if (text_[pos_] == '-' && at(pos_ + 1) == '-') {
        while (pos_ < text_.size() && text_[pos_] != '\n') ++pos_;
      } else {
        return;
      }
    }
  }

  Token token() {
    const char c = text_[pos_];
    if (is_word_start(c)) return word();
    if (c == '"') return quoted(Token::Kind::QuotedName, '"', "quoted name", "close it with \"");
    if (c == '\'') return quoted(Token::Kind::String, '\'', "string", "close it with '");
    if (is_digit(c) || ((c == '-' || c == '+') && is_digit(at(pos_ + 1)))) return number();
    return symbol();
  }

  Token make(Token::Kind kind, std::size_t start) {
    Token t;
    t.kind = kind;
    t.src = std::string(text_.substr(start, pos_ - start));
    t.column = start + 1;
    return t;
  }

  Token word() {
    const std::size_t start = pos_;
    while (is_word_char(at(pos_))) ++pos_;
    Token t = make(Token::Kind::Word, start);
    t.value = t.src;
    return t;
  }

  // '...' or "...", a doubled quote standing for one.
  Token quoted(Token::Kind kind, char q, std::string_view what, std::string_view hint) {
    const std::size_t start = pos_++;
    std::string value;
    for (;;) {
      if (pos_ >= text_.size()) fail_at(start + 1, text_.substr(start), fmt::format("unterminated {}", what), hint);
      if (text_[pos_] == q && at(pos_ + 1) == q) {
        value += q;
        pos_ += 2;
      } else if (text_[pos_] == q) {
        ++pos_;
        break;
      } else {
        value += text_[pos_++];
      }
    }
    Token t = make(kind, start);
    if (kind == Token::Kind::QuotedName && value.empty())
      fail(t, "a quoted name cannot be empty", "write the column's name between the double quotes");
    t.value = std::move(value);
    return t;
  }

  // Skips digits; false when there were none.
  bool digits() {
    const std::size_t start = pos_;
    while (is_digit(at(pos_))) ++pos_;
    return pos_ > start;
  }

  // [sign] digits [. digits] [e [sign] digits], not glued to a following letter, digit or '.'.
  Token number() {
    const std::size_t start = pos_;
    if (text_[pos_] == '-' || text_[pos_] == '+') ++pos_;
    bool ok = digits();
    if (at(pos_) == '.') {
      ++pos_;
      ok = digits() && ok;
    }
    if (at(pos_) == 'e' || at(pos_) == 'E') {
      ++pos_;
      if (at(pos_) == '-' || at(pos_) == '+') ++pos_;
      ok = digits() && ok;
    }
    if (!ok || is_word_char(at(pos_)) || at(pos_) == '.') bad_number(start);
    Token t = make(Token::Kind::Number, start);
    t.number = to_double(t);
    return t;
  }

  [[noreturn]] void bad_number(std::size_t start) {
    while (is_word_char(at(pos_)) || at(pos_) == '.' || at(pos_) == '+' || at(pos_) == '-') ++pos_;
    fail_at(start + 1, text_.substr(start, pos_ - start), "malformed number",
            "write [sign] digits [. digits] [e [sign] digits], e.g. -2.5 or 1e6");
  }

  static double to_double(const Token& t) {
    std::string_view s = t.src;
    if (s.front() == '+') s.remove_prefix(1);  // from_chars takes '-' only
    double v = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || end != s.data() + s.size() || !std::isfinite(v))
      fail(t, "number out of the range of a double", "write 0 or a magnitude between 1e-307 and 1e308");
    return v;
  }

  // Punctuation: ( ) , ; * = != <> < <= > >=.
  Token symbol() {
    const std::size_t start = pos_;
    const char c = text_[pos_++];
    const char n = at(pos_);
    if ((c == '!' && n == '=') || (c == '<' && (n == '>' || n == '=')) || (c == '>' && n == '=')) ++pos_;
    while ((static_cast<unsigned char>(at(pos_)) & 0xC0U) == 0x80U) ++pos_;  // the rest of a UTF-8 character
    Token t = make(Token::Kind::Symbol, start);
    static constexpr std::array<std::string_view, 12> kSymbols = {"(",  ")",  ",", ";",  "*", "=",
                                                                  "!=", "<>", "<", "<=", ">", ">="};
    if (std::find(kSymbols.begin(), kSymbols.end(), t.src) != kSymbols.end()) return t;
    if (c == '-' || c == '+')
      fail(t, "a sign must be followed by digits", "write the sign right before the number, e.g. -5");
    fail(t, "unexpected character",
         "the query language has names, numbers, 'strings', -- comments and ( ) , ; * = != <> < <= > >=");
  }

  std::string_view text_;
  std::size_t pos_ = 0;
};

// ---------------------------------------------------------------------------------------------------
// Aggregates

struct FunctionSpec {
  std::string_view name;
  AggKind kind;
  double p;                    // Ntile: the fixed quantile (ANON_NTILE reads it)
  std::string_view signature;  // for messages: what the call takes, with an example
};

constexpr std::string_view kBoundedSig = "takes (column, lower, upper), e.g. {}(price, 0, 100)";

constexpr std::array<FunctionSpec, 9> kFunctions = {{
    {"ANON_COUNT", AggKind::Count, 0, "takes (*), (*, U), (column, U) or (DISTINCT uid), e.g. ANON_COUNT(*, 5)"},
    {"ANON_SUM", AggKind::Sum, 0, kBoundedSig},
    {"ANON_AVG", AggKind::Avg, 0, kBoundedSig},
    {"ANON_VAR", AggKind::Var, 0, kBoundedSig},
    {"ANON_STDDEV", AggKind::Stddev, 0, kBoundedSig},
    {"ANON_MIN", AggKind::Ntile, 0, kBoundedSig},
    {"ANON_MAX", AggKind::Ntile, 1, kBoundedSig},
    {"ANON_MEDIAN", AggKind::Ntile, 0.5, kBoundedSig},
    {"ANON_NTILE", AggKind::Ntile, 0, "takes (column, p, lower, upper), e.g. ANON_NTILE(price, 0.9, 0, 100)"},
}};

const FunctionSpec* find_function(std::string_view upper_name) {
  for (const auto& f : kFunctions)
    if (f.name == upper_name) return &f;
  return nullptr;
}

// "ANON_SUM takes (column, lower, upper), e.g. ANON_SUM(price, 0, 100)".
std::string usage(const FunctionSpec& f) {
  return fmt::format("{} {}", f.name, fmt::format(fmt::runtime(f.signature), f.name));
}

// The ANON_ counterpart of a plain SQL aggregate, or empty.
std::string_view dp_counterpart(std::string_view upper_name) {
  static const std::map<std::string_view, std::string_view> kPlain = {
      {"COUNT", "ANON_COUNT(*), ANON_COUNT(col, U) or ANON_COUNT(DISTINCT uid)"},
      {"SUM", "ANON_SUM(col, lower, upper)"},
      {"AVG", "ANON_AVG(col, lower, upper)"},
      {"MEAN", "ANON_AVG(col, lower, upper)"},
      {"VAR", "ANON_VAR(col, lower, upper)"},
      {"VARIANCE", "ANON_VAR(col, lower, upper)"},
      {"VAR_POP", "ANON_VAR(col, lower, upper)"},
      {"VAR_SAMP", "ANON_VAR(col, lower, upper)"},
      {"STDDEV", "ANON_STDDEV(col, lower, upper)"},
      {"STDEV", "ANON_STDDEV(col, lower, upper)"},
      {"STDDEV_POP", "ANON_STDDEV(col, lower, upper)"},
      {"STDDEV_SAMP", "ANON_STDDEV(col, lower, upper)"},
      {"MIN", "ANON_MIN(col, lower, upper)"},
      {"MAX", "ANON_MAX(col, lower, upper)"},
      {"MEDIAN", "ANON_MEDIAN(col, lower, upper)"},
      {"NTILE", "ANON_NTILE(col, p, lower, upper)"},
      {"PERCENTILE", "ANON_NTILE(col, p, lower, upper)"},
      {"PERCENTILE_CONT", "ANON_NTILE(col, p, lower, upper)"},
      {"QUANTILE", "ANON_NTILE(col, p, lower, upper)"},
  };
  const auto it = kPlain.find(upper_name);
  return it == kPlain.end() ? std::string_view() : it->second;
}

// Reserved words: a name spelled like one must be quoted ("from"), so that clauses stay unambiguous.
bool is_reserved(std::string_view upper_word) {
  static constexpr std::array<std::string_view, 16> kKeywords = {
      "SELECT", "WITH", "ANONYMIZATION", "OPTIONS", "FROM",    "WHERE", "GROUP",   "BY", "AS",
      "AND",    "OR",   "NOT",           "IN",      "BETWEEN", "IS",    "DISTINCT"};
  return std::find(kKeywords.begin(), kKeywords.end(), upper_word) != kKeywords.end() ||
         find_function(upper_word) != nullptr;
}

std::string supported_functions() {
  std::string out;
  for (const auto& f : kFunctions) out += (out.empty() ? "" : ", ") + std::string(f.name);
  return out;
}

// One argument of an aggregate call as written.
struct Arg {
  enum class Kind { Star, Distinct, Name, Number } kind = Kind::Name;
  const Token* token = nullptr;  // the name of Distinct
  const Token* where = nullptr;  // the first token, for messages
  std::string text;              // as written, for Aggregate::text
};

std::string_view describe(Arg::Kind k) {
  switch (k) {
    case Arg::Kind::Star:
      return "*";
    case Arg::Kind::Distinct:
      return "DISTINCT uid";
    case Arg::Kind::Name:
      return "a column name";
    case Arg::Kind::Number:
      return "a number";
  }
  return "";
}

// A call's arguments against the one shape allowed: arity errors point at the function name.
void match(const FunctionSpec& f, const Token& name, const std::vector<Arg>& args, std::vector<Arg::Kind> want) {
  if (args.size() != want.size())
    fail(name, usage(f), fmt::format("{} argument{} given", args.size(), args.size() == 1 ? "" : "s"));
  for (std::size_t i = 0; i < args.size(); ++i)
    if (args[i].kind != want[i])
      fail(*args[i].where, fmt::format("argument {} of {} must be {}", i + 1, f.name, describe(want[i])), usage(f));
}

void check_bound(const Token& t) {
  if (std::fabs(t.number) > kMaxBound)
    fail(t, "bound beyond 2^40 in magnitude", "use bounds within [-1099511627776, 1099511627776]");
}

void check_bounds(Aggregate& a, const Token& lo, const Token& hi) {
  check_bound(lo);
  check_bound(hi);
  if (lo.number > hi.number)
    fail(hi, fmt::format("upper bound {} is below lower bound {}", hi.src, lo.src),
         fmt::format("write the lower bound first: ..., {}, {})", hi.src, lo.src));
  a.has_bounds = true;
  a.lower = lo.number;
  a.upper = hi.number;
}

void check_count_bound(Aggregate& a, const Token& u) {
  if (!(u.number >= 1 && u.number <= kMaxCountBound && std::floor(u.number) == u.number))
    fail(u, "ANON_COUNT's bound U must be a positive integer <= 1048576 (2^20)",
         "write the most rows one user may add to a group, e.g. ANON_COUNT(*, 5)");
  a.has_bounds = true;
  a.upper = u.number;
}

// ANON_COUNT: the first argument decides the shape.
void build_count(const FunctionSpec& f, const Token& name, const std::vector<Arg>& args, Aggregate& a) {
  if (args.empty()) fail(name, usage(f), "0 arguments given");
  switch (args[0].kind) {
    case Arg::Kind::Star:
      if (args.size() == 1) return;
      match(f, name, args, {Arg::Kind::Star, Arg::Kind::Number});
      return check_count_bound(a, *args[1].token);
    case Arg::Kind::Distinct:
      match(f, name, args, {Arg::Kind::Distinct});
      a.kind = AggKind::CountDistinct;
      a.column = args[0].token->value;
      return;
    case Arg::Kind::Name:
      match(f, name, args, {Arg::Kind::Name, Arg::Kind::Number});
      a.column = args[0].token->value;
      return check_count_bound(a, *args[1].token);
    case Arg::Kind::Number:
      fail(*args[0].token, "argument 1 of ANON_COUNT must be *, a column name or DISTINCT uid", usage(f));
  }
}

// ANON_NTILE(col, p, L, U).
void build_ntile(const FunctionSpec& f, const Token& name, const std::vector<Arg>& args, Aggregate& a) {
  using K = Arg::Kind;
  match(f, name, args, {K::Name, K::Number, K::Number, K::Number});
  const Token& p = *args[1].token;
  if (!(p.number >= 0 && p.number <= 1))
    fail(p, "the quantile p must be in [0, 1]", "write it as a fraction, e.g. 0.9 for the 90th percentile");
  a.column = args[0].token->value;
  a.p = p.number;
  check_bounds(a, *args[2].token, *args[3].token);
}

// ANON_SUM, AVG, VAR, STDDEV, MIN, MAX, MEDIAN: (col, L, U).
void build_bounded(const FunctionSpec& f, const Token& name, const std::vector<Arg>& args, Aggregate& a) {
  match(f, name, args, {Arg::Kind::Name, Arg::Kind::Number, Arg::Kind::Number});
  a.column = args[0].token->value;
  a.p = f.p;
  check_bounds(a, *args[1].token, *args[2].token);
}

Aggregate build_aggregate(const FunctionSpec& f, const Token& name, const std::vector<Arg>& args) {
  Aggregate a;
  a.kind = f.kind;
  a.column_pos = name.column;
  if (f.kind == AggKind::Count) {
    build_count(f, name, args, a);
  } else if (f.name == "ANON_NTILE") {
    build_ntile(f, name, args, a);
  } else {
    build_bounded(f, name, args, a);
  }
  a.text = std::string(f.name) + "(";
  for (std::size_t i = 0; i < args.size(); ++i) a.text += (i == 0 ? "" : ", ") + args[i].text;
  a.text += ")";
  return a;
}

// ---------------------------------------------------------------------------------------------------
// Conditions as text

// A name as the parser reads it back: quoted unless a plain word that is no keyword.
std::string name_text(const std::string& name) {
  const bool plain = !name.empty() && is_word_start(name[0]) && std::all_of(name.begin(), name.end(), is_word_char) &&
                     !is_reserved(upper(name));
  if (plain) return name;
  std::string out = "\"";
  for (char c : name) out += (c == '"') ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

std::string literal_text(const Literal& l) {
  if (!l.is_string) return l.text;
  std::string out = "'";
  for (char c : l.text) out += (c == '\'') ? std::string("''") : std::string(1, c);
  return out + "'";
}

std::string_view op_text(CmpOp op) {
  switch (op) {
    case CmpOp::Eq:
      return "=";
    case CmpOp::Ne:
      return "!=";
    case CmpOp::Lt:
      return "<";
    case CmpOp::Le:
      return "<=";
    case CmpOp::Gt:
      return ">";
    case CmpOp::Ge:
      return ">=";
  }
  return "?";
}

std::string joined(const std::vector<Condition>& children, std::string_view sep) {
  std::string out = "(";
  for (std::size_t i = 0; i < children.size(); ++i) out += (i == 0 ? "" : std::string(sep)) + to_string(children[i]);
  return out + ")";
}

std::string in_text(const Condition& c) {
  std::string out = name_text(c.column) + (c.negated ? " NOT IN (" : " IN (");
  for (std::size_t i = 0; i < c.values.size(); ++i) out += (i == 0 ? "" : ", ") + literal_text(c.values[i]);
  return out + ")";
}

// ---------------------------------------------------------------------------------------------------
// The parser

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  Query query() {
    Query q;
    header();
    if (at_keyword("OPTIONS")) options(q);
    select_list(q);
    from(q);
    if (at_keyword("WHERE")) {
      next();
      q.where = condition();
    }
    if (at_keyword("GROUP")) group_by(q);
    finish();
    return q;
  }

  // Where each output name was given (the alias, else the item), parallel to Query::select.
  const std::vector<const Token*>& name_tokens() const { return name_tokens_; }

 private:
  // --- token access

  const Token& peek(std::size_t ahead = 0) const { return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)]; }
  const Token& next() {
    const Token& t = peek();
    if (pos_ + 1 < tokens_.size()) ++pos_;
    return t;
  }
  static bool is_keyword(const Token& t, std::string_view kw) {
    return t.kind == Token::Kind::Word && upper(t.src) == kw;
  }
  static bool is_reserved_word(const Token& t) { return t.kind == Token::Kind::Word && is_reserved(upper(t.src)); }
  static bool is_name(const Token& t) {
    return t.kind == Token::Kind::QuotedName || (t.kind == Token::Kind::Word && !is_reserved_word(t));
  }
  bool at_keyword(std::string_view kw, std::size_t ahead = 0) const { return is_keyword(peek(ahead), kw); }
  bool at_symbol(std::string_view s, std::size_t ahead = 0) const {
    return peek(ahead).kind == Token::Kind::Symbol && peek(ahead).src == s;
  }

  void expect_keyword(std::string_view kw, std::string_view what, std::string_view hint) {
    if (!at_keyword(kw)) fail(peek(), what, hint);
    next();
  }
  void expect_symbol(std::string_view s, std::string_view what, std::string_view hint) {
    if (!at_symbol(s)) fail(peek(), what, hint);
    next();
  }

  // A column, table, option or alias name; `what` says which, for messages.
  const Token& name(std::string_view what, std::string_view hint) {
    const Token& t = peek();
    if (is_reserved_word(t))
      fail(t, fmt::format("expected {}, found the keyword {}", what, upper(t.src)),
           fmt::format("{}, or write \"{}\" if it is a name", hint, t.src));
    if (!is_name(t)) fail(t, fmt::format("expected {}", what), hint);
    return next();
  }

  // --- clauses

  void header() {
    if (peek().kind == Token::Kind::End)
      fail(peek(), "empty query", "write SELECT WITH ANONYMIZATION <aggregates> FROM <table>");
    expect_keyword("SELECT", "expected SELECT", "a query starts with SELECT WITH ANONYMIZATION");
    expect_keyword("WITH", "expected WITH after SELECT",
                   "dpstream only runs anonymized queries: SELECT WITH ANONYMIZATION ...");
    expect_keyword("ANONYMIZATION", "expected ANONYMIZATION after SELECT WITH",
                   "dpstream only runs anonymized queries");
  }

  void options(Query& q) {
    next();
    expect_symbol("(", "expected '(' after OPTIONS", "write OPTIONS(name = value, ...)");
    q.options.push_back(option(q));
    while (at_symbol(",")) {
      next();
      q.options.push_back(option(q));
    }
    expect_symbol(")", "expected ',' or ')' in OPTIONS", "write OPTIONS(name = value, ...)");
  }

  Option option(const Query& q) {
    const Token& n = name("an option name", "write OPTIONS(name = value, ...)");
    Option o;
    o.name = lower(n.value);
    o.column_pos = n.column;
    for (const Option& prior : q.options)
      if (prior.name == o.name)
        fail(n, fmt::format("option {} is given twice (columns {} and {})", o.name, prior.column_pos, n.column),
             "give each option once");
    expect_symbol("=", fmt::format("expected '=' after option {}", n.src), "write name = value");
    const Token& v = peek();
    if (v.kind != Token::Kind::Number && v.kind != Token::Kind::String)
      fail(v, fmt::format("the value of option {} must be a number or a 'string'", n.src),
           "write e.g. epsilon = 1 or selection = 'laplace'");
    o.value = literal();
    return o;
  }

  void select_list(Query& q) {
    if (at_keyword("FROM") || peek().kind == Token::Kind::End)
      fail(peek(), "the select list is missing", "list at least one aggregate before FROM, e.g. ANON_COUNT(*)");
    item(q, "the select list needs at least one aggregate, e.g. ANON_COUNT(*)");
    while (at_symbol(",")) {
      next();
      item(q, "remove the ',' before FROM or add an item");
    }
    if (!at_keyword("FROM"))
      fail(peek(), "expected FROM after the select list",
           "separate select items with ',' and end the list with FROM <table>");
  }

  void item(Query& q, std::string_view hint) {
    const Token& t = peek();
    if (t.kind == Token::Kind::Word && at_symbol("(", 1)) return aggregate_item(q);
    if (t.kind == Token::Kind::Word && find_function(upper(t.src)) != nullptr)
      fail(t, fmt::format("{} is an aggregate and needs its arguments", upper(t.src)),
           usage(*find_function(upper(t.src))));
    if (t.kind == Token::Kind::QuotedName && at_symbol("(", 1))
      fail(t, "a quoted name cannot be called", "write the aggregate's name unquoted, e.g. ANON_COUNT(*)");
    const Token& c = name("a select item (a group column or an ANON_ aggregate)", hint);
    SelectItem s;
    s.column = c.value;
    s.name = c.value;
    s.column_pos = c.column;
    add_item(q, s, c);
  }

  void aggregate_item(Query& q) {
    const Token& fn = peek();
    q.aggregates.push_back(aggregate());
    SelectItem s;
    s.is_aggregate = true;
    s.aggregate = q.aggregates.size() - 1;
    s.name = q.aggregates.back().text;
    s.column_pos = fn.column;
    add_item(q, s, fn);
  }

  // Adds the item with its alias, if any.
  void add_item(Query& q, SelectItem s, const Token& first) {
    const Token* name_token = &first;
    if (at_keyword("AS")) {
      next();
      name_token = &name("an alias after AS", "write AS <name>");
    } else if (is_name(peek()) && (at_symbol(",", 1) || at_keyword("FROM", 1))) {
      name_token = &next();  // an alias without AS; a name followed by anything else is a typo, told later
    }
    if (name_token != &first) s.name = name_token->value;
    q.select.push_back(std::move(s));
    name_tokens_.push_back(name_token);
  }

  // --- aggregates

  Aggregate aggregate() {
    const Token& fn = next();
    const std::string up = upper(fn.src);
    const FunctionSpec* f = find_function(up);
    if (f == nullptr) unknown_function(fn, up);
    next();  // '('
    return build_aggregate(*f, fn, arguments(*f));
  }

  [[noreturn]] static void unknown_function(const Token& fn, const std::string& up) {
    const std::string_view dp = dp_counterpart(up);
    if (!dp.empty()) fail(fn, fmt::format("{} is not a DP aggregate", up), fmt::format("use {}", dp));
    fail(fn, fmt::format("unknown function {}", fn.src),
         fmt::format("the supported aggregates are {}", supported_functions()));
  }

  std::vector<Arg> arguments(const FunctionSpec& f) {
    std::vector<Arg> args;
    if (at_symbol(")")) return (next(), args);
    args.push_back(argument(f));
    while (at_symbol(",")) {
      next();
      args.push_back(argument(f));
    }
    expect_symbol(")", fmt::format("expected ',' or ')' in the {} call", f.name), usage(f));
    return args;
  }

  Arg argument(const FunctionSpec& f) {
    const Token& t = peek();
    Arg a;
    a.token = &t;
    a.where = &t;
    a.text = t.src;
    if (at_symbol("*")) {
      a.kind = Arg::Kind::Star;
    } else if (is_keyword(t, "DISTINCT")) {
      next();
      a.kind = Arg::Kind::Distinct;
      a.token = &name("the user column after DISTINCT", "write ANON_COUNT(DISTINCT uid)");
      a.text = "DISTINCT " + a.token->src;
      return a;
    } else if (t.kind == Token::Kind::Number) {
      a.kind = Arg::Kind::Number;
    } else if (!is_name(t)) {
      fail(t, fmt::format("expected an argument of {}", f.name), usage(f));
    }
    next();
    return a;
  }

  // --- WHERE

  Condition condition() { return chain("OR", Condition::Kind::Or, &Parser::conjunction); }
  Condition conjunction() { return chain("AND", Condition::Kind::And, &Parser::negation); }

  // part (KW part)*: one node with every part of the chain as a child.
  Condition chain(std::string_view kw, Condition::Kind kind, Condition (Parser::*part)()) {
    Condition first = (this->*part)();
    if (!at_keyword(kw)) return first;
    Condition c;
    c.kind = kind;
    c.column_pos = first.column_pos;
    c.children.push_back(std::move(first));
    while (at_keyword(kw)) {
      next();
      c.children.push_back((this->*part)());
    }
    return c;
  }

  Condition negation() {
    const Token& t = peek();
    if (++depth_ > kMaxDepth) fail(t, "the condition nests too deeply", "simplify it");
    Condition c;
    if (is_keyword(t, "NOT")) {
      next();
      c.kind = Condition::Kind::Not;
      c.column_pos = t.column;
      c.children.push_back(negation());
    } else if (at_symbol("(")) {
      next();
      c = condition();
      expect_symbol(")", fmt::format("expected ')' to close the '(' at column {}", t.column),
                    "balance the parentheses of the condition");
    } else {
      c = predicate();
    }
    --depth_;
    return c;
  }

  Condition predicate() {
    const Token& t = peek();
    if (t.kind == Token::Kind::Number || t.kind == Token::Kind::String)
      fail(t, "a condition starts with a column name", "write column op literal, e.g. price < 10");
    const Token& col = name("a condition", "write column op literal, e.g. price < 10, or NOT, or (");
    Condition c;
    c.column = col.value;
    c.column_pos = col.column;
    if (at_keyword("IS")) return is_null(std::move(c), col);
    c.negated = at_keyword("NOT");
    if (c.negated) next();
    if (at_keyword("IN")) return in_list(std::move(c));
    if (at_keyword("BETWEEN")) return between(std::move(c));
    if (c.negated && (at_keyword("NULL") || at_keyword("IS")))
      fail(peek(), "expected IN or BETWEEN after NOT", fmt::format("to test for NULL write {} IS NOT NULL", col.src));
    if (c.negated)
      fail(peek(), "expected IN or BETWEEN after NOT", "write col NOT IN (...) or col NOT BETWEEN a AND b");
    return comparison(std::move(c), col);
  }

  // col IS [NOT] NULL: IS is the current token.
  Condition is_null(Condition c, const Token& col) {
    next();
    c.kind = Condition::Kind::IsNull;
    c.negated = at_keyword("NOT");
    if (c.negated) next();
    if (!at_keyword("NULL"))
      fail(peek(), c.negated ? "expected NULL after IS NOT" : "expected NULL or NOT NULL after IS",
           c.negated ? fmt::format("write {} IS NOT NULL", col.src)
                     : fmt::format("write {0} IS NULL or {0} IS NOT NULL", col.src));
    next();
    return c;
  }

  Condition comparison(Condition c, const Token& col) {
    static const std::map<std::string_view, CmpOp> kOps = {{"=", CmpOp::Eq}, {"!=", CmpOp::Ne}, {"<>", CmpOp::Ne},
                                                           {"<", CmpOp::Lt}, {"<=", CmpOp::Le}, {">", CmpOp::Gt},
                                                           {">=", CmpOp::Ge}};
    const Token& t = peek();
    const auto it = t.kind == Token::Kind::Symbol ? kOps.find(t.src) : kOps.end();
    if (it == kOps.end() && is_keyword(t, "NULL"))
      fail(t, "expected IS before NULL", fmt::format("write {} IS NULL", col.src));
    if (it == kOps.end())
      fail(t, fmt::format("expected =, !=, <>, <, <=, >, >=, IN, BETWEEN or IS after {}", col.src),
           fmt::format("write e.g. {} = 1", col.src));
    next();
    c.kind = Condition::Kind::Compare;
    c.op = it->second;
    c.values.push_back(literal());
    return c;
  }

  Condition in_list(Condition c) {
    next();
    c.kind = Condition::Kind::In;
    expect_symbol("(", "expected '(' after IN", "write IN (value, ...)");
    c.values.push_back(literal());
    while (at_symbol(",")) {
      next();
      c.values.push_back(literal());
    }
    expect_symbol(")", "expected ',' or ')' in the IN list", "write IN (value, ...)");
    return c;
  }

  Condition between(Condition c) {
    next();
    c.kind = Condition::Kind::Between;
    c.values.push_back(literal());
    expect_keyword("AND", "expected AND in BETWEEN", "write BETWEEN low AND high");
    c.values.push_back(literal());
    return c;
  }

  Literal literal() {
    const Token& t = peek();
    if (t.kind == Token::Kind::QuotedName)
      fail(t, fmt::format("{} is a quoted name, not a string", t.src),
           fmt::format("write text between single quotes, e.g. '{}'", t.value));
    if (is_keyword(t, "NULL"))
      fail(t, "NULL is not a value to compare with", "to test for NULL write col IS NULL or col IS NOT NULL");
    if (t.kind != Token::Kind::Number && t.kind != Token::Kind::String)
      fail(t, "expected a number or a 'string'", "compare a column with a literal, e.g. price < 10 or region = 'EU'");
    next();
    Literal l;
    l.is_string = t.kind == Token::Kind::String;
    l.text = l.is_string ? t.value : t.src;
    l.number = t.number;
    return l;
  }

  // --- FROM, GROUP BY, the end

  void from(Query& q) {
    next();
    q.table = name("a table name after FROM", "write FROM <table>").value;
  }

  void group_by(Query& q) {
    next();
    expect_keyword("BY", "expected BY after GROUP", "write GROUP BY column, ...");
    std::vector<std::size_t> cols;  // where each GROUP BY column was written
    group_column(q, cols);
    while (at_symbol(",")) {
      next();
      group_column(q, cols);
    }
  }

  void group_column(Query& q, std::vector<std::size_t>& cols) {
    const Token& c = name("a column after GROUP BY", "write GROUP BY column, ...");
    const auto dup = std::find(q.group_by.begin(), q.group_by.end(), c.value);
    if (dup != q.group_by.end()) {
      const std::size_t first = cols[static_cast<std::size_t>(dup - q.group_by.begin())];
      fail(c, fmt::format("{} is listed twice in GROUP BY (columns {} and {})", c.value, first, c.column),
           "list each column once");
    }
    q.group_by.push_back(c.value);
    cols.push_back(c.column);
  }

  void finish() {
    const bool semicolon = at_symbol(";");
    if (semicolon) next();
    const Token& t = peek();
    if (t.kind == Token::Kind::End) return;
    if (at_symbol(")")) fail(t, "')' without a matching '('", "remove it or add the '(' it closes");
    if (is_keyword(t, "WHERE")) fail(t, "WHERE after GROUP BY", "write WHERE before GROUP BY");
    if (semicolon) fail(t, "text after ';'", "a query is one statement; remove what follows ';'");
    fail(t, "unexpected text after the query", "the query ends after FROM <table> [WHERE ...] [GROUP BY ...] [;]");
  }

  std::vector<Token> tokens_;
  std::size_t pos_ = 0;
  int depth_ = 0;
  std::vector<const Token*> name_tokens_;
};

// ---------------------------------------------------------------------------------------------------
// Rules beyond the grammar

void check_has_aggregate(const Query& q, const std::vector<const Token*>& names) {
  if (q.aggregates.empty())
    fail(*names.front(), "the select list has no aggregate",
         "add one, e.g. ANON_COUNT(*); dpstream only releases aggregates");
}

void check_grouped(const Query& q) {
  for (const SelectItem& s : q.select)
    if (!s.is_aggregate && std::find(q.group_by.begin(), q.group_by.end(), s.column) == q.group_by.end())
      fail_at(s.column_pos, s.column, fmt::format("{} is in SELECT but not in GROUP BY", s.column),
              "add it to GROUP BY or remove it");
}

void check_names(const Query& q, const std::vector<const Token*>& names) {
  std::map<std::string, std::size_t> seen;  // name -> column of its first use
  for (std::size_t i = 0; i < q.select.size(); ++i) {
    const auto [it, fresh] = seen.emplace(q.select[i].name, names[i]->column);
    if (!fresh)
      fail_at(names[i]->column, q.select[i].name,
              fmt::format("output name {} is used twice (columns {} and {})", q.select[i].name, it->second,
                          names[i]->column),
              "give one of them another alias");
  }
}

}  // namespace

Query parse_query(std::string_view text) {
  Parser parser(Lexer(text).run());
  Query q = parser.query();
  check_has_aggregate(q, parser.name_tokens());
  check_grouped(q);
  check_names(q, parser.name_tokens());
  return q;
}

std::string to_string(const Condition& c) {
  switch (c.kind) {
    case Condition::Kind::And:
      return joined(c.children, " AND ");
    case Condition::Kind::Or:
      return joined(c.children, " OR ");
    case Condition::Kind::Not:
      return "NOT " + to_string(c.children.at(0));
    case Condition::Kind::Compare:
      return fmt::format("{} {} {}", name_text(c.column), op_text(c.op), literal_text(c.values.at(0)));
    case Condition::Kind::In:
      return in_text(c);
    case Condition::Kind::Between:
      return fmt::format("{}{} BETWEEN {} AND {}", name_text(c.column), c.negated ? " NOT" : "",
                         literal_text(c.values.at(0)), literal_text(c.values.at(1)));
    case Condition::Kind::IsNull:
      return fmt::format("{} IS {}NULL", name_text(c.column), c.negated ? "NOT " : "");
  }
  return "";
}

}  // namespace dpstream::sql
