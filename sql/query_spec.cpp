#include "sql/query_spec.hpp"

#include <fmt/format.h>
#include <toml++/toml.h>

#include <algorithm>
#include <array>
#include <filesystem>

#include "src/errors.hpp"

namespace dpstream::sql {

namespace {

enum class Kind { Text, Number, Integer, Bool, Range };

struct Key {
  const char* name;    // in the TOML section
  const char* option;  // on the command line ("sql": the positional query)
  Kind kind;
};

constexpr std::array kKeys = {
    Key{"sql", "sql", Kind::Text},
    Key{"input", "--input", Kind::Text},
    Key{"user_column", "--user-column", Kind::Text},
    Key{"epsilon", "--epsilon", Kind::Number},
    Key{"delta", "--delta", Kind::Number},
    Key{"max_groups_per_user", "--max-groups-per-user", Kind::Integer},
    Key{"max_rows_per_group", "--max-rows-per-group", Kind::Integer},
    Key{"selection", "--selection", Kind::Text},
    Key{"public_groups", "--public-groups", Kind::Text},
    Key{"noise", "--noise", Kind::Text},
    Key{"selection_share", "--selection-share", Kind::Number},
    Key{"window_column", "--window-column", Kind::Text},
    Key{"window_seconds", "--window-seconds", Kind::Integer},
    Key{"per_window", "--per-window", Kind::Bool},
    Key{"windows", "--windows", Kind::Range},
    Key{"ledger", "--ledger", Kind::Text},
    Key{"bad_rows", "--bad-rows", Kind::Text},
    Key{"out", "--out", Kind::Text},
};

std::string known_keys() {
  std::string out;
  for (const Key& k : kKeys) out += (out.empty() ? "" : ", ") + std::string(k.name);
  return out;
}

// The value as the command line spells it; nullopt when the node has the wrong type.
std::optional<std::string> spelled(const toml::node& n, Kind kind) {
  switch (kind) {
    case Kind::Text:
      if (const auto v = n.value_exact<std::string>()) return *v;
      return std::nullopt;
    case Kind::Number:
      if (!n.is_number()) return std::nullopt;
      return fmt::format("{}", *n.value<double>());
    case Kind::Integer:
      if (const auto v = n.value_exact<std::int64_t>()) return fmt::format("{}", *v);
      return std::nullopt;
    case Kind::Bool:
      if (const auto v = n.value_exact<bool>()) return *v ? "true" : "false";
      return std::nullopt;
    case Kind::Range: {
      const auto* a = n.as_array();
      if (!a || a->size() != 2 || !(*a)[0].value_exact<std::int64_t>() || !(*a)[1].value_exact<std::int64_t>())
        return std::nullopt;
      return fmt::format("{}:{}", *(*a)[0].value_exact<std::int64_t>(), *(*a)[1].value_exact<std::int64_t>());
    }
  }
  return std::nullopt;
}

const char* expected(Kind kind) {
  switch (kind) {
    case Kind::Text:
      return "a string";
    case Kind::Number:
      return "a number";
    case Kind::Integer:
      return "an integer";
    case Kind::Bool:
      return "true or false";
    case Kind::Range:
      return "two window numbers, e.g. [20, 26]";
  }
  return "?";
}

}  // namespace

std::vector<SpecValue> read_query_section(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw ConfigError(fmt::format("--job {} is a directory; give a job spec file (TOML) with a [query] table", path));
  if (!std::filesystem::exists(path, ec))
    throw ConfigError(fmt::format("--job {}: no such file; give a job spec file (TOML) with a [query] table", path));
  toml::table root;
  try {
    root = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    throw ConfigError(fmt::format("{}: not valid TOML: {} (line {})", path, e.description(), e.source().begin.line));
  }
  const auto* section = root["query"].as_table();
  if (!section) throw ConfigError(fmt::format("{}: no [query] table; put the query's keys under [query]", path));
  for (const auto& [k, _] : root)
    if (k.str() != "query")
      throw ConfigError(fmt::format("{}: unknown table [{}]; a query spec has only [query]", path, k.str()));
  std::vector<SpecValue> out;
  for (const auto& [k, node] : *section) {
    const std::string_view name = k.str();  // a structured binding cannot be captured before C++20 in clang 14
    const auto key = std::find_if(kKeys.begin(), kKeys.end(), [&](const Key& x) { return name == x.name; });
    if (key == kKeys.end())
      throw ConfigError(fmt::format("{}: unknown key [query] {} (known keys: {})", path, k.str(), known_keys()));
    const auto value = spelled(node, key->kind);
    if (!value) throw ConfigError(fmt::format("{}: [query] {} must be {}", path, k.str(), expected(key->kind)));
    out.push_back({.key = std::string(name), .option = key->option, .value = *value});
  }
  return out;
}

}  // namespace dpstream::sql
