// The [query] section of a job spec (TOML): the options of `dpstream query` in a file, for SLURM jobs
// and repeated runs. Keys are the option names without the dashes, with underscores (user_column,
// max_groups_per_user, ...), plus `sql` for the query; `windows = [A, B]`. Command-line options win.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace dpstream::sql {

// (option name, value as the command line would spell it), e.g. ("--epsilon", "0.5"), ("sql", "SELECT ...").
// Throws ConfigError naming the file, the key and what to write (unknown keys, wrong types, no [query]).
std::vector<std::pair<std::string, std::string>> read_query_section(const std::string& path);

}  // namespace dpstream::sql
