#include "sql/table.hpp"

#include <absl/strings/string_view.h>
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>

#include "partition/hash.hpp"
#include "sql/plan.hpp"
#include "src/csv_input.hpp"
#include "src/errors.hpp"

namespace dpstream::sql {

namespace {

std::size_t column_index(const std::vector<std::string>& header, const std::string& name, const std::string& path,
                         std::size_t pos, const char* role) {
  const auto it = std::find(header.begin(), header.end(), name);
  if (it == header.end())
    throw QueryError(fmt::format("column {} ('{}'): {} has no column {} (its header: {}); name one of its columns", pos,
                                 quoted_row(name), path, quoted_row(name), quoted_header(header)),
                     pos);
  (void)role;
  refuse_repeated_column(path, header, name);  // which of two columns of this name the query means is ambiguous
  return static_cast<std::size_t>(it - header.begin());
}

// Columns a WHERE compares with a number: typed numeric like the value columns.
void numeric_where_columns(const Condition& c, std::vector<std::string>& out) {
  for (const Condition& ch : c.children) numeric_where_columns(ch, out);
  if (c.kind == Condition::Kind::And || c.kind == Condition::Kind::Or || c.kind == Condition::Kind::Not) return;
  if (std::any_of(c.values.begin(), c.values.end(), [](const Literal& l) { return !l.is_string; }) &&
      std::find(out.begin(), out.end(), c.column) == out.end())
    out.push_back(c.column);
}

// A column that WHERE compares with a number is read as a number (a row whose field is not one is bad), so the same
// column compared with a string elsewhere made every row bad or unmatched without a word: refused before reading.
void refuse_mixed_comparisons(const Condition& c, const std::vector<std::string>& numeric) {
  for (const Condition& ch : c.children) refuse_mixed_comparisons(ch, numeric);
  if (c.column.empty() || std::none_of(c.values.begin(), c.values.end(), [](const Literal& l) { return l.is_string; }))
    return;
  if (std::find(numeric.begin(), numeric.end(), c.column) != numeric.end())
    throw QueryError(fmt::format("column {} ('{}'): WHERE compares {} with a number and with a string; a row's field "
                                 "is read as a number once it is compared with one: compare it with numbers only, or "
                                 "with strings only",
                                 c.column_pos, quoted_row(c.column), quoted_row(c.column)),
                     c.column_pos);
}

// A WHERE condition bound to field indices.
struct BoundCondition {
  const Condition* c = nullptr;
  std::size_t field = 0;
  std::vector<BoundCondition> children;
};

// Not named `bind`: called unqualified with std arguments, that name also finds std::bind by argument-dependent
// lookup, which won for a non-const header, so that table_layout's check built a bind object and checked nothing.
BoundCondition bind_condition(const Condition& c, const std::vector<std::string>& header, const std::string& path) {
  BoundCondition b{&c, 0, {}};
  for (const Condition& ch : c.children) b.children.push_back(bind_condition(ch, header, path));
  if (!c.column.empty()) b.field = column_index(header, c.column, path, c.column_pos, "WHERE");
  return b;
}

// One row's fields: text, and the number of each numeric field (nullopt when NULL or not numeric).
struct RowView {
  const std::vector<std::string>* text;
  const std::vector<std::optional<double>>* number;
};

// -1, 0, 1 comparing the field with a literal; nullopt when a number comparison meets NULL.
std::optional<int> compare(const RowView& row, std::size_t field, const Literal& lit) {
  if (lit.is_string) {
    const int r = (*row.text)[field].compare(lit.text);
    return (r > 0) - (r < 0);
  }
  const auto& v = (*row.number)[field];
  if (!v) return std::nullopt;
  return (*v > lit.number) - (*v < lit.number);
}

bool holds(CmpOp op, int r) {
  switch (op) {
    case CmpOp::Eq:
      return r == 0;
    case CmpOp::Ne:
      return r != 0;
    case CmpOp::Lt:
      return r < 0;
    case CmpOp::Le:
      return r <= 0;
    case CmpOp::Gt:
      return r > 0;
    case CmpOp::Ge:
      return r >= 0;
  }
  return false;
}

// Two-valued: a comparison with NULL is false (docs/SQL.md).
bool eval(const BoundCondition& b, const RowView& row) {
  const Condition& c = *b.c;
  switch (c.kind) {
    case Condition::Kind::And:
      return std::all_of(b.children.begin(), b.children.end(), [&](const auto& ch) { return eval(ch, row); });
    case Condition::Kind::Or:
      return std::any_of(b.children.begin(), b.children.end(), [&](const auto& ch) { return eval(ch, row); });
    case Condition::Kind::Not:
      return !eval(b.children[0], row);
    case Condition::Kind::Compare: {
      const auto r = compare(row, b.field, c.values[0]);
      return r && holds(c.op, *r);
    }
    case Condition::Kind::In: {
      const bool in = std::any_of(c.values.begin(), c.values.end(), [&](const Literal& l) {
        const auto r = compare(row, b.field, l);
        return r && *r == 0;
      });
      return in != c.negated;
    }
    case Condition::Kind::IsNull:
      return (*row.text)[b.field].empty() != c.negated;  // NULL is the empty field
    case Condition::Kind::Between: {
      const auto lo = compare(row, b.field, c.values[0]), hi = compare(row, b.field, c.values[1]);
      if (!lo || !hi) return false;
      return (*lo >= 0 && *hi <= 0) != c.negated;
    }
  }
  return false;
}

void put_le32(std::string& out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// floor(ts / seconds) of an integer timestamp field; nullopt when the field is not an integer.
std::optional<std::int64_t> window_of(const std::string& text, std::int64_t seconds) {
  std::int64_t ts = 0;
  const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), ts);
  if (ec != std::errc() || p != text.data() + text.size() || text.empty()) return std::nullopt;
  return ts / seconds - (ts % seconds < 0 ? 1 : 0);
}

// Per (user, group) partial aggregation of this rank's rows. Users and groups get dense local indices
// (one hash probe each on a 128-bit id or the group text), and a partial is found by the 64-bit pair of
// indices: small slots, and the distinct ids for the collision check come for free.
class PartialBuilder {
 public:
  static constexpr std::size_t kMaxIndex = 0xffffffffu;  // dense indices are 32-bit: never wrap (two users merged)

  explicit PartialBuilder(std::size_t value_columns) { partials_.value_columns = value_columns; }
  // Room for about `partials` partials up front: no rehash of a large table while reading.
  void reserve(std::size_t partials) {
    index_.reserve(partials);
    keys_.reserve(partials);
    partials_.words.reserve(partials * partials_.stride());
  }

  std::uint32_t user(const Id128& id) {
    if (users_.size() >= kMaxIndex)
      throw InputError("more than 2^32 - 1 distinct users on one rank: run on more ranks");
    const auto [it, fresh] = user_index_.try_emplace(id, static_cast<std::uint32_t>(users_.size()));
    if (fresh) users_.push_back(id);
    return it->second;
  }
  // The group of an encoding; `ids` maps a new one (the encoding is copied only then).
  std::uint32_t group(std::string_view encoded, IdPrf& ids) {
    auto it = group_index_.find(absl::string_view(encoded.data(), encoded.size()));  // no copy
    if (it == group_index_.end()) {
      if (groups_.size() >= kMaxIndex)
        throw InputError("more than 2^32 - 1 distinct groups on one rank: run on more ranks");
      it = group_index_.emplace(std::string(encoded), static_cast<std::uint32_t>(groups_.size())).first;
      groups_.push_back(ids(IdDomain::Key, encoded));
      group_names_.emplace_back(encoded);
    }
    return it->second;
  }

  void add(std::uint32_t user, std::uint32_t group, const std::vector<std::optional<double>>& values) {
    const std::uint64_t key = (std::uint64_t{user} << 32) | group;
    const auto [it, fresh] = index_.try_emplace(key, partials_.size());
    if (fresh) {
      partials_.words.resize(partials_.words.size() + partials_.stride(), 0);
      keys_.push_back(key);
    }
    std::uint64_t* p = partials_.words.data() + it->second * partials_.stride();
    ++p[2];
    for (std::size_t j = 0; j < values.size(); ++j) {
      if (!values[j]) continue;
      std::uint64_t* col = p + 3 + 3 * j;
      ++col[0];
      const int128 sum = from_words(col[1], static_cast<std::int64_t>(col[2])) + to_fixed(*values[j]);
      col[1] = low_word(sum), col[2] = static_cast<std::uint64_t>(high_word(sum));
    }
  }

  // Moves colliding ids apart (collective) and writes the final 64-bit ids into the partials.
  Partials finish(const shuffle::Comm& comm, absl::flat_hash_map<std::uint64_t, std::string>& names) {
    const auto user_moves = separate_colliding_ids(users_, partition::kUserSalt, comm);
    const auto group_moves = separate_colliding_ids(groups_, partition::kKeySalt, comm);
    std::vector<std::uint64_t> user_ids(users_.size()), group_ids(groups_.size());
    for (std::size_t i = 0; i < users_.size(); ++i) user_ids[i] = moved(users_[i], user_moves);
    for (std::size_t i = 0; i < groups_.size(); ++i) {
      group_ids[i] = moved(groups_[i], group_moves);
      names.emplace(group_ids[i], std::move(group_names_[i]));
    }
    for (std::size_t i = 0; i < keys_.size(); ++i) {
      partials_.words[i * partials_.stride()] = user_ids[keys_[i] >> 32];
      partials_.words[i * partials_.stride() + 1] = group_ids[keys_[i] & 0xffffffffu];
    }
    return std::move(partials_);
  }

 private:
  static std::uint64_t moved(const Id128& id, const absl::flat_hash_map<Id128, std::uint64_t>& moves) {
    const auto it = moves.find(id);
    return it == moves.end() ? id.id : it->second;
  }

  Partials partials_;
  absl::flat_hash_map<Id128, std::uint32_t> user_index_;
  absl::flat_hash_map<std::string, std::uint32_t> group_index_;
  absl::flat_hash_map<std::uint64_t, std::size_t> index_;  // (user index, group index) -> partial
  std::vector<std::uint64_t> keys_;                        // of each partial
  std::vector<Id128> users_, groups_;
  std::vector<std::string> group_names_;
};

}  // namespace

std::vector<std::string> read_header(const std::string& path) {
  refuse_non_regular_input(path, "give --input a CSV file");
  std::ifstream f(path, std::ios::binary);
  if (!f)
    throw InputError(
        fmt::format("cannot open input file {}: {}; give --input an existing CSV file", path, errno_text(errno)));
  std::string line;
  if (!std::getline(f, line))
    throw InputError(fmt::format("{}: the file is empty; it needs a header naming its columns", path));
  std::vector<std::string> header;
  if (!split_csv_header(line, header))
    throw InputError(fmt::format("{}: the header line is not valid CSV (unbalanced quotes)", path));
  return header;
}

TableLayout table_layout(const std::string& path, const Query& query, const std::string& user_column,
                         const std::vector<std::string>& value_columns, const WindowSpec& windows) {
  TableLayout t;
  t.header = read_header(path);
  t.fields = t.header.size();
  const auto it = std::find(t.header.begin(), t.header.end(), user_column);
  if (it == t.header.end())
    throw InputError(
        fmt::format("{} has no column {} for --user-column (its header: {}); name the column that "
                    "identifies the user",
                    path, user_column, quoted_header(t.header)));
  t.user = static_cast<std::size_t>(it - t.header.begin());
  refuse_repeated_column(path, t.header, user_column);
  for (const std::string& g : query.group_by) {
    std::size_t pos = 0;
    for (const SelectItem& s : query.select)
      if (!s.is_aggregate && s.column == g) pos = s.column_pos;
    t.groups.push_back(column_index(t.header, g, path, pos, "GROUP BY"));
  }
  for (const std::string& v : value_columns) {
    std::size_t pos = 0;
    for (const Aggregate& a : query.aggregates)
      if (a.column == v && pos == 0) pos = a.column_pos;
    t.values.push_back(column_index(t.header, v, path, pos, "aggregate"));
  }
  if (query.where) {
    bind_condition(*query.where, t.header, path);  // every WHERE column exists
    std::vector<std::string> numeric;
    numeric_where_columns(*query.where, numeric);
    refuse_mixed_comparisons(*query.where, numeric);
  }
  if (windows.active()) {
    const auto w = std::find(t.header.begin(), t.header.end(), windows.column);
    if (w == t.header.end())
      throw InputError(fmt::format("{} has no column {} for --window-column (its header: {})", path, windows.column,
                                   quoted_header(t.header)));
    t.window = static_cast<std::size_t>(w - t.header.begin());
    refuse_repeated_column(path, t.header, windows.column);
    t.windows = windows;
  }
  return t;
}

// Rows in [begin, end) estimated from the mean length of its first lines.
std::size_t estimated_rows(std::string_view all, std::size_t begin, std::size_t end) {
  std::size_t lines = 0, pos = begin;
  while (lines < 256 && pos < end) {
    const std::size_t nl = all.find('\n', pos);
    if (nl == std::string_view::npos) break;
    ++lines, pos = nl + 1;
  }
  return lines == 0 || pos == begin ? 0 : (end - begin) / ((pos - begin) / lines);
}

void append_group_field(std::string& encoded, std::string_view field) {
  put_le32(encoded, static_cast<std::uint32_t>(field.size()));
  encoded.append(field);
}

std::string encode_group(const std::vector<std::string_view>& fields) {
  std::string out;
  for (std::string_view f : fields) append_group_field(out, f);
  return out;
}

std::vector<std::string> decode_group(std::string_view encoded) {
  std::vector<std::string> out;
  while (encoded.size() >= 4) {
    std::uint32_t n = 0;
    for (int i = 0; i < 4; ++i) n |= static_cast<std::uint32_t>(static_cast<unsigned char>(encoded[i])) << (8 * i);
    out.emplace_back(encoded.substr(4, n));
    encoded.remove_prefix(std::min<std::size_t>(encoded.size(), 4 + std::size_t{n}));
  }
  return out;
}

LocalTable read_local_table(const std::string& path, const Query& query, const TableLayout& layout, BadRowPolicy policy,
                            IdPrf& ids, const shuffle::Comm& comm) {
  MappedFile file(path);
  const std::string_view all = file.view();
  const std::size_t header_end = std::min(all.find('\n'), all.size());
  const auto [begin, end] = csv_share_of(all, header_end, comm.rank(), comm.size());

  std::vector<std::string> numeric_names;
  if (query.where) numeric_where_columns(*query.where, numeric_names);
  // A value column that only ANON_COUNT(col, U) reads needs its NULLs alone: any text counts (COUNT of a text column).
  std::vector<bool> presence_only(layout.values.size());
  std::vector<std::size_t> numeric;
  for (std::size_t j = 0; j < layout.values.size(); ++j) {
    const std::string& name = layout.header[layout.values[j]];
    presence_only[j] = std::find(numeric_names.begin(), numeric_names.end(), name) == numeric_names.end() &&
                       std::all_of(query.aggregates.begin(), query.aggregates.end(), [&](const Aggregate& a) {
                         return a.column != name || a.kind == AggKind::Count ||
                                a.kind == AggKind::CountDistinct;  // the user column's: not its values
                       });
    if (!presence_only[j]) numeric.push_back(layout.values[j]);
  }
  for (const std::string& n : numeric_names)
    numeric.push_back(
        static_cast<std::size_t>(std::find(layout.header.begin(), layout.header.end(), n) - layout.header.begin()));
  std::optional<BoundCondition> where;
  if (query.where) where = bind_condition(*query.where, layout.header, path);

  LocalTable out;
  PartialBuilder builder(layout.values.size());
  std::vector<std::string> fields;
  std::vector<std::optional<double>> number(layout.fields), values(layout.values.size());
  std::string encoded;  // the row's group, reused
  // `reason` (`why` when empty) names the column and the problem without the row's bytes: the query is private, and
  // the first skipped row's reason goes to stderr (policy fail, only for a seeded query, quotes the row: `why`).
  auto bad = [&](std::size_t offset, std::string_view line, const std::string& why, const std::string& reason = {}) {
    if (out.stats.bad++ == 0)
      out.stats.first_bad = fmt::format("line {}: {}", line_number_of(all, offset), reason.empty() ? why : reason);
    if (policy == BadRowPolicy::Fail)
      throw InputError(fmt::format("{}:{}: {} in row '{}' (use --bad-rows skip to count and skip such rows)", path,
                                   line_number_of(all, offset), why, quoted_row(line)));
  };
  std::string error;
  try {
    // Rows of a (user, group): usually 1-3; capped (short first lines must not reserve a huge table).
    builder.reserve(std::min(estimated_rows(all, begin, end) / 2, (end - begin) / 16));
    for_each_csv_line(all, begin, end, [&](std::size_t offset, std::string_view line) {
      ++out.stats.rows;
      if (!split_csv_line(line, fields)) return bad(offset, line, "unbalanced quotes");
      if (fields.size() != layout.fields)
        return bad(offset, line, fmt::format("{} fields where the header has {}", fields.size(), layout.fields),
                   fmt::format("not the header's {} fields", layout.fields));
      if (fields[layout.user].empty()) return bad(offset, line, fmt::format("empty {}", layout.header[layout.user]));
      for (std::size_t f : numeric) {
        number[f].reset();
        if (fields[f].empty()) continue;  // NULL
        double v = 0;
        if (const NumberCheck c = parse_finite_number(fields[f], v); c != NumberCheck::Ok)
          return bad(offset, line, fmt::format("{} '{}' {}", layout.header[f], fields[f], number_problem(c)),
                     fmt::format("{} {}", layout.header[f], number_problem(c)));
        number[f] = v;
      }
      std::string window_text, user = fields[layout.user];
      if (layout.window) {
        const WindowSpec& ws = layout.windows;
        const auto w = window_of(fields[*layout.window], ws.seconds);
        if (!w)
          return bad(offset, line,
                     fmt::format("{} '{}' is not an integer number of seconds", layout.header[*layout.window],
                                 fields[*layout.window]),
                     fmt::format("{} is not an integer number of seconds", layout.header[*layout.window]));
        if (ws.first && (*w < *ws.first || *w > *ws.last)) return void(++out.stats.filtered_out);
        if (ws.per_window) {  // the privacy unit is (window, user): its id is that of LE64(window) || user
          window_text = std::to_string(*w);
          std::string unit(8, '\0');
          for (std::size_t i = 0; i < 8; ++i)
            unit[i] = static_cast<char>((static_cast<std::uint64_t>(*w) >> (8 * i)) & 0xff);
          user = unit + user;
        }
      }
      if (where && !eval(*where, RowView{&fields, &number})) return void(++out.stats.filtered_out);
      ++out.stats.kept;
      encoded.clear();
      if (layout.windows.per_window) append_group_field(encoded, window_text);
      for (std::size_t g : layout.groups) append_group_field(encoded, fields[g]);
      for (std::size_t j = 0; j < layout.values.size(); ++j)
        values[j] = !presence_only[j]                  ? number[layout.values[j]]
                    : fields[layout.values[j]].empty() ? std::nullopt
                                                       : std::optional<double>(0.0);
      builder.add(builder.user(ids(IdDomain::User, user)), builder.group(encoded, ids), values);
    });
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (error = comm.agree_on_error(error); !error.empty()) throw InputError(error);
  out.partials = builder.finish(comm, out.group_names);
  return out;
}

}  // namespace dpstream::sql
