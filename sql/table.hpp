// The table of a DP SQL query: a CSV file with a header of any columns, typed on read (docs/SQL.md,
// "Read"). Each rank parses the lines that start in its byte range, keeps the rows its WHERE accepts and
// aggregates them per (user, group) at once: the partials are mergeable (rows, and per value column
// the non-NULL count and the fixed-point sum), so a rank ships one partial per (user, group) it saw.
#pragma once

#include <absl/container/flat_hash_map.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/int128.hpp"
#include "shuffle/comm.hpp"
#include "sql/plan.hpp"
#include "sql/query.hpp"
#include "src/config.hpp"
#include "src/id_prf.hpp"

namespace dpstream::sql {

// The column indices a query reads in the header.
struct TableLayout {
  std::size_t fields = 0;  // columns in the header
  std::size_t user = 0;
  std::vector<std::size_t> groups;  // GROUP BY, in order
  std::vector<std::size_t> values;  // QueryPlan::value_columns, in order
  std::vector<std::string> header;
  std::optional<std::size_t> window;  // the window column, when the query reads windows
  WindowSpec windows;
};

// The header's columns for the query; throws QueryError naming a column the file lacks and listing the header.
TableLayout table_layout(const std::string& path, const Query& query, const std::string& user_column,
                         const std::vector<std::string>& value_columns, const WindowSpec& windows = {});
// Reads only the header line (cheap: every rank checks before the first collective).
std::vector<std::string> read_header(const std::string& path);

// With per-window releases, the group's first field is the window (decimal) and the user's id is the keyed id of
// LE64(window) || user text: a user in two windows is two privacy units.
// The group of a row: for each GROUP BY field, LE32(byte length) || bytes (docs/SQL.md). Decoded for output.
std::string encode_group(const std::vector<std::string_view>& fields);
void append_group_field(std::string& encoded, std::string_view field);  // one field of encode_group
std::vector<std::string> decode_group(std::string_view encoded);

// Partials as flat words: [uid, gid, rows, (non-NULL count, sum low, sum high) per value column].
struct Partials {
  std::size_t value_columns = 0;
  std::size_t stride() const { return 3 + 3 * value_columns; }
  std::size_t size() const { return stride() == 0 ? 0 : words.size() / stride(); }
  std::vector<std::uint64_t> words;
};

// Raw counters of the read (not DP: they depend on every row).
struct ReadStats {
  std::uint64_t rows = 0, bad = 0, filtered_out = 0, kept = 0;
  std::string first_bad;  // "line N: why" of this rank's first bad row (skipped), empty if none
};

struct LocalTable {
  Partials partials;  // ids already separated from colliding ones (after separate_table_ids)
  absl::flat_hash_map<std::uint64_t, std::string> group_names;  // gid -> encoded group, for groups seen here
  ReadStats stats;
};

// Parses this rank's share of the file, then moves colliding ids apart. Collective: a bad row under policy
// fail (or any read error) on one rank throws InputError on every rank, before the collective step.
LocalTable read_local_table(const std::string& path, const Query& query, const TableLayout& layout, BadRowPolicy policy,
                            IdPrf& ids, const shuffle::Comm& comm);

}  // namespace dpstream::sql
