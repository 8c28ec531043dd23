// The [query] section of a job spec (TOML): the options of `dpstream query` in a file, for SLURM jobs
// and repeated runs. Keys are the option names without the dashes, with underscores (user_column,
// max_groups_per_user, ...), plus `sql` for the query; `windows = [A, B]`. Command-line options win.
#pragma once

#include <string>
#include <vector>

namespace dpstream::sql {

struct SpecValue {
  std::string key;     // as the spec names it, e.g. "windows"
  std::string option;  // the option it gives, e.g. "--windows" ("sql": the query text)
  std::string value;   // as the command line would spell it, e.g. "20:26"
};
// Throws ConfigError naming the file, the key and what to write (unknown keys, wrong types, no [query]).
std::vector<SpecValue> read_query_section(const std::string& path);

}  // namespace dpstream::sql
