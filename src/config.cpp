#include "src/config.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <toml++/toml.h>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

#include "common/record.hpp"
#include "src/errors.hpp"

namespace dpstream {

namespace {

// Where a job's values came from: its spec (a file, or the built-in demo) or a --set that replaced one, so that an
// error names what the user has to change.
class ValueOrigins {
 public:
  explicit ValueOrigins(std::string source) : source_(std::move(source)) {}
  void set_by(const std::string& section, const std::string& key, const std::string& assignment) {
    set_[section + "." + key] = "--set " + assignment;  // the last --set of a key is the one in effect
    if (!first_of_section_.contains(section)) first_of_section_[section] = "--set " + assignment;
  }
  void note_spec_section(const std::string& section) { spec_sections_.insert(section); }
  const std::string& of(const std::string& section, const std::string& key) const {
    const auto it = set_.find(section + "." + key);
    return it != set_.end() ? it->second : source_;
  }
  const std::string& of_section(const std::string& section) const {  // a section only a --set named
    const auto it = first_of_section_.find(section);
    return it != first_of_section_.end() && !spec_sections_.contains(section) ? it->second : source_;
  }

 private:
  std::string source_;
  std::map<std::string, std::string> set_, first_of_section_;
  std::set<std::string> spec_sections_;
};

// Reads typed values from one [section], remembering which keys were consumed so that every
// key left over can be reported as unknown.
class SectionReader {
 public:
  SectionReader(const toml::table& root, std::string section, const ValueOrigins& origins)
      : section_(std::move(section)), origins_(&origins) {
    if (const auto* node = root.get(section_)) {
      table_ = node->as_table();
      if (!table_) fail("", "must be a table ([" + section_ + "])");
    }
  }

  std::int64_t integer(const std::string& key, std::int64_t def, std::int64_t min, std::int64_t max) {
    const toml::node* n = take(key);
    if (!n) return def;
    const auto v = n->value_exact<std::int64_t>();
    if (!v) fail(key, fmt::format("must be an integer, got {}", describe(*n)));
    if (*v < min || *v > max) fail(key, fmt::format("must be in [{}, {}], got {}", min, max, *v));
    return *v;
  }

  std::int64_t required_integer(const std::string& key, std::int64_t min, std::int64_t max) {
    if (!has(key)) fail(key, fmt::format("is required (an integer in [{}, {}])", min, max));
    return integer(key, 0, min, max);
  }

  double real(const std::string& key, double def) {
    const toml::node* n = take(key);
    if (!n) return def;
    const auto v = n->value<double>();  // integers are accepted as reals
    if (!v || !(n->is_floating_point() || n->is_integer()))
      fail(key, fmt::format("must be a number, got {}", describe(*n)));
    if (!std::isfinite(*v)) fail(key, fmt::format("must be finite, got {}", *v));
    return *v;
  }

  std::string string(const std::string& key, const std::string& def) {
    const toml::node* n = take(key);
    if (!n) return def;
    const auto v = n->value_exact<std::string>();
    if (!v) fail(key, fmt::format("must be a string, got {}", describe(*n)));
    return *v;
  }

  std::vector<std::string> strings(const std::string& key, const std::vector<std::string>& def) {
    const toml::node* n = take(key);
    if (!n) return def;
    const auto* arr = n->as_array();
    if (!arr) fail(key, fmt::format("must be an array of strings, got {}", describe(*n)));
    std::vector<std::string> out;
    for (const auto& e : *arr) {
      const auto v = e.value_exact<std::string>();
      if (!v) fail(key, fmt::format("must be an array of strings, got element {}", describe(e)));
      out.push_back(*v);
    }
    return out;
  }

  // One of the spellings of E's table (src/config.hpp).
  template <NamedEnum E>
  E choice(const std::string& key, E def) {
    return choice_of<E>(key, def, enum_names<E>(), [](const std::string& v) { return *parse_enum<E>(v); });
  }

  // One of `allowed`, mapped by `to_value`; the error lists them alphabetically, as it always did.
  template <class T, class F>
  T choice_of(const std::string& key, T def, std::vector<std::string> allowed, F to_value) {
    std::sort(allowed.begin(), allowed.end());
    std::string names;
    for (const auto& name : allowed) names += (names.empty() ? "" : " | ") + ("\"" + name + "\"");
    const toml::node* n = take(key);
    if (!n) return def;
    const auto v = n->value_exact<std::string>();
    if (!v) fail(key, fmt::format("must be one of {}, got {}", names, describe(*n)));
    if (!std::binary_search(allowed.begin(), allowed.end(), *v))
      fail(key, fmt::format("must be one of {}, got \"{}\"", names, *v));
    return to_value(*v);
  }

  bool has(const std::string& key) {
    asked_.insert(key);
    return table_ && table_->contains(key);
  }

  // Every key this section reads must be in job_spec_fields, and every key given must have been read.
  void finish() const {
    const auto known = spec_keys(section_);
    for (const auto& k : asked_)
      if (std::find(known.begin(), known.end(), k) == known.end())
        throw std::logic_error(
            fmt::format("the parser reads [{}] {}, which job_spec_fields (src/config.cpp) lacks", section_, k));
    if (!table_) return;
    for (const auto& [k, _] : *table_) {
      if (!consumed_.count(std::string(k.str()))) {
        std::string list;
        for (const auto& kk : known) list += (list.empty() ? "" : ", ") + kk;
        throw ConfigError(fmt::format("{}: unknown key [{}] {} (known keys of [{}]: {})",
                                      origins_->of(section_, std::string(k.str())), section_, k.str(), section_, list));
      }
    }
  }

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw ConfigError(fmt::format("{}: [{}] {} {}", origins_->of(section_, key), section_, key, what));
  }

 private:
  const toml::node* take(const std::string& key) {
    consumed_.insert(key);
    asked_.insert(key);
    return table_ ? table_->get(key) : nullptr;
  }
  static std::string describe(const toml::node& n) {
    std::ostringstream os;
    n.visit([&](const auto& v) { os << v; });
    os << " (" << n.type() << ")";
    return os.str();
  }

  const toml::table* table_ = nullptr;
  std::string section_;
  const ValueOrigins* origins_;
  std::set<std::string> consumed_;  // read from the TOML
  std::set<std::string> asked_;     // read or tested with has()
};

// "section.key=value": the value is parsed as TOML (so 10, 1.5, true, "x" keep their types);
// text that is not a TOML value is taken as a string.
void apply_override(toml::table& root, const std::string& assignment, ValueOrigins& origins) {
  const auto eq = assignment.find('=');
  const auto dot = assignment.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot > eq || dot == 0 || dot + 1 == eq)
    throw ConfigError(fmt::format("--set {}: expected section.key=value, e.g. --set input.users=1000", assignment));
  const std::string section = assignment.substr(0, dot);
  const std::string key = assignment.substr(dot + 1, eq - dot - 1);
  const std::string text = assignment.substr(eq + 1);
  toml::table parsed;
  try {
    parsed = toml::parse("v = " + text);
  } catch (const toml::parse_error&) {
    parsed = toml::table{{"v", text}};
  }
  if (!root.contains(section)) root.insert(section, toml::table{});
  auto* tbl = root.get(section)->as_table();
  if (!tbl) throw ConfigError(fmt::format("--set {}: [{}] is not a table", assignment, section));
  tbl->insert_or_assign(key, *parsed.get("v"));
  origins.set_by(section, key, assignment);
}

}  // namespace

// ---- the job spec's fields ----------------------------------------------------------------------

namespace {

template <class T>
std::string str(const T& v) {
  return fmt::format("{}", v);
}
std::string optional_str(const std::optional<double>& v) { return v ? str(*v) : "default"; }

constexpr auto MustMatch = OnResume::MustMatch;
constexpr auto MayChange = OnResume::MayChange;
using enum AppliesTo;

// The identity strings are those of the checkpoints written so far: changing one refuses their resume.
// clang-format off: one line per field reads as a table
constexpr SpecField kSpecFields[] = {
    {"job.name", MustMatch, All, [](const JobConfig& c) { return c.name; }},
    {"input.kind", MustMatch, All, [](const JobConfig& c) { return to_string(c.input.kind); }},
    {"input.path", MayChange},  // the file may move: its content is recorded instead (input.content)
    {"input.bad_rows", MustMatch, Csv, [](const JobConfig& c) { return to_string(c.input.bad_rows); }},
    {"input.users", MustMatch, Synthetic, [](const JobConfig& c) { return str(c.input.users); }},
    {"input.keys", MustMatch, Synthetic, [](const JobConfig& c) { return str(c.input.keys); }},
    {"input.key_distribution", MustMatch, Synthetic,
     [](const JobConfig& c) { return to_string(c.input.key_distribution); }},
    {"input.seed", MustMatch, Synthetic, [](const JobConfig& c) { return str(c.input.seed); }},
    {"input.records_per_user_q", MustMatch, Synthetic,
     [](const JobConfig& c) { return str(c.input.records_per_user_q); }},
    {"input.records_per_user_s", MustMatch, Synthetic,
     [](const JobConfig& c) { return str(c.input.records_per_user_s); }},
    {"input.records_per_user_min", MustMatch, Synthetic,
     [](const JobConfig& c) { return str(c.input.records_per_user_min); }},
    {"input.records_per_user_max", MustMatch, Synthetic,
     [](const JobConfig& c) { return str(c.input.records_per_user_max); }},
    {"input.key_q", MustMatch, Synthetic, [](const JobConfig& c) { return str(c.input.key_q); }},
    {"input.key_s", MustMatch, Synthetic, [](const JobConfig& c) { return str(c.input.key_s); }},
    {"stream.window_seconds", MustMatch, All, [](const JobConfig& c) { return str(c.stream.window_seconds); }},
    {"stream.triggers", MustMatch, All, [](const JobConfig& c) { return str(c.stream.triggers); }},
    {"stream.first_window", MustMatch, All, [](const JobConfig& c) { return str(c.stream.first_window); }},
    {"stream.windows", MustMatch, All, [](const JobConfig& c) { return str(c.stream.windows); }},
    {"privacy.mode", MustMatch, All, [](const JobConfig& c) { return to_string(c.privacy.mode); }},
    {"privacy.max_records_per_user", MustMatch, All,
     [](const JobConfig& c) { return str(c.privacy.max_records_per_user); }},
    {"privacy.composition", MustMatch, Private, [](const JobConfig& c) { return to_string(c.privacy.composition); }},
    {"privacy.clamp_min", MustMatch, All, [](const JobConfig& c) { return str(c.privacy.clamp_min); }},
    {"privacy.clamp_max", MustMatch, All, [](const JobConfig& c) { return str(c.privacy.clamp_max); }},
    {"privacy.epsilon", MustMatch, Private, [](const JobConfig& c) { return str(c.privacy.epsilon); }},
    {"privacy.delta", MustMatch, Private, [](const JobConfig& c) { return str(c.privacy.delta); }},
    {"privacy.mu", MustMatch, Private, [](const JobConfig& c) { return optional_str(c.privacy.mu); }},
    {"privacy.beta", MustMatch, Private, [](const JobConfig& c) { return optional_str(c.privacy.beta); }},
    {"privacy.seed", MustMatch, Private,
     [](const JobConfig& c) { return c.privacy.seed ? str(*c.privacy.seed) : "secret from the OS"; }},
    {"privacy.selection_epsilon_share", MustMatch, Private,
     [](const JobConfig& c) { return str(c.privacy.selection_epsilon_share); }},
    {"privacy.selection_delta_share", MustMatch, Private,
     [](const JobConfig& c) { return str(c.privacy.selection_delta_share); }},
    {"privacy.threshold", MustMatch, Private, [](const JobConfig& c) { return to_string(c.privacy.threshold); }},
    {"privacy.selection_counter", MustMatch, BandedCounters,
     [](const JobConfig& c) { return to_string(c.privacy.selection_counter); }},
    {"privacy.value_counter", MustMatch, BandedCounters,
     [](const JobConfig& c) { return to_string(c.privacy.value_counter); }},
    {"privacy.counter_band", MustMatch, BandedCounters, [](const JobConfig& c) { return str(c.privacy.counter_band); }},
    // A resume is not charged again (the run id) and may not add, drop or change the ledger: the
    // charge is made before the first commit, never after.
    {"privacy.ledger", MustMatch, Ledger, [](const JobConfig& c) { return c.privacy.ledger; }},
    {"query.aggregations", MustMatch, All,
     [](const JobConfig& c) {
       return std::string(c.query.count ? "count" : "") + (c.query.count && c.query.sum ? "," : "") +
              (c.query.sum ? "sum" : "");
     }},
    {"output.dir", MayChange},
    {"output.format", MustMatch, All, [](const JobConfig& c) { return c.output.format; }},
    {"output.progress", MayChange},
    {"checkpoint.every", MayChange},  // commits do not change the output (docs/CHECKPOINTS.md)
    {"checkpoint.seconds", MayChange},
    {"checkpoint.journal_mib", MayChange},
    {"engine.key_scan", MayChange},       // both scans release the same rows (kernels/key_scan.hpp)
    {"engine.trigger_batch", MayChange},  // batches release the same rows (kernels/bounding.hpp)
};
// clang-format on

std::string_view section_of(const SpecField& f) { return f.name.substr(0, f.name.find('.')); }

}  // namespace

std::span<const SpecField> job_spec_fields() { return kSpecFields; }

std::vector<std::string> spec_sections() {
  std::vector<std::string> out;
  for (const auto& f : kSpecFields)
    if (out.empty() || out.back() != section_of(f)) out.emplace_back(section_of(f));
  return out;
}

std::vector<std::string> spec_keys(std::string_view section) {
  std::vector<std::string> out;
  for (const auto& f : kSpecFields)
    if (section_of(f) == section) out.emplace_back(f.name.substr(section.size() + 1));
  return out;
}

bool in_identity(const SpecField& field, const JobConfig& c) {
  if (field.on_resume != OnResume::MustMatch) return false;
  switch (field.applies) {
    case AppliesTo::Synthetic:
      return c.input.kind == InputKind::Synthetic;
    case AppliesTo::Csv:
      return c.input.kind == InputKind::Csv;
    case AppliesTo::Private:
      return is_private(c.privacy.mode);
    case AppliesTo::Ledger:
      return !c.privacy.ledger.empty();
    case AppliesTo::BandedCounters:
      return c.privacy.mode == PrivacyMode::Dp &&  // the baselines have no continual counters
             (c.privacy.selection_counter == CounterKind::Banded || c.privacy.value_counter == CounterKind::Banded);
    default:
      return true;
  }
}

std::string JobConfig::origin() const {
  std::string out = source;
  for (const std::string& s : sets) out += (&s == &sets.front() ? " with --set " : ", --set ") + s;
  return out;
}

JobConfig parse_job(const std::string& toml_text, const std::string& source,
                    const std::vector<std::string>& overrides) {
  toml::table root;
  try {
    root = toml::parse(toml_text, source);
  } catch (const toml::parse_error& e) {
    std::ostringstream os;
    os << source << ": not valid TOML: " << e.description() << " (line " << e.source().begin.line << ", column "
       << e.source().begin.column << ")";
    throw ConfigError(os.str());
  }
  ValueOrigins origins(source);
  for (const auto& [k, _] : root) origins.note_spec_section(std::string(k.str()));
  for (const auto& o : overrides) apply_override(root, o, origins);

  const auto sections = spec_sections();
  for (const auto& [k, node] : root) {
    if (std::find(sections.begin(), sections.end(), k.str()) != sections.end()) continue;
    if (!node.is_table())  // `name = "x"` above every [section]
      throw ConfigError(
          fmt::format("{}: {} is outside every section: put it under its section (e.g. [job] name, "
                      "[stream] triggers)",
                      origins.of_section(std::string(k.str())), k.str()));
    throw ConfigError(fmt::format("{}: unknown section [{}] (known: [{}])", origins.of_section(std::string(k.str())),
                                  k.str(), fmt::join(sections, "], [")));
  }

  constexpr auto kMaxI64 = std::numeric_limits<std::int64_t>::max();
  JobConfig c;
  c.source = source;
  c.sets = overrides;

  SectionReader job(root, "job", origins);
  c.name = job.string("name", c.name);
  if (c.name.empty())
    job.fail("name", "must not be empty (it names the job in summary.json and in a ledger's charges)");
  // Control characters (a NUL cut the name where the checkpoint stores it: the job could never be resumed; others
  // garble the log lines and ledger listings that print it).
  if (std::any_of(c.name.begin(), c.name.end(),
                  [](char ch) { return static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f; }))
    job.fail("name", "must not hold control characters (tab, newline, NUL, escape, ...): use printable text");
  job.finish();

  SectionReader in(root, "input", origins);
  c.input.kind = in.choice("kind", InputKind::Synthetic);
  c.input.path = in.string("path", "");
  c.input.bad_rows = in.choice("bad_rows", BadRowPolicy::Skip);
  c.input.users = static_cast<std::uint64_t>(
      in.integer("users", static_cast<std::int64_t>(c.input.users), 1, std::int64_t{1} << 43));
  c.input.keys =
      static_cast<std::uint64_t>(in.integer("keys", static_cast<std::int64_t>(c.input.keys), 1, std::int64_t{1} << 62));
  c.input.key_distribution = in.choice("key_distribution", KeyDistribution::ZipfMandelbrot);
  c.input.seed = static_cast<std::uint64_t>(in.integer("seed", 1, 0, kMaxI64));
  c.input.records_per_user_q = in.real("records_per_user_q", c.input.records_per_user_q);
  c.input.records_per_user_s = in.real("records_per_user_s", c.input.records_per_user_s);
  c.input.records_per_user_min = static_cast<std::uint64_t>(in.integer("records_per_user_min", 1, 0, 1));
  c.input.records_per_user_max = static_cast<std::uint64_t>(
      in.integer("records_per_user_max", static_cast<std::int64_t>(c.input.records_per_user_max), 1, 1 << 20));
  c.input.key_q = in.real("key_q", c.input.key_q);
  c.input.key_s = in.real("key_s", c.input.key_s);
  if (c.input.kind == InputKind::Csv && c.input.path.empty())
    in.fail("path", "is required when kind = \"csv\" (the CSV file with header user_id,key,value,timestamp)");
  if (c.input.kind == InputKind::Synthetic && in.has("path"))
    in.fail("path", "is only used with kind = \"csv\"; remove it or set kind = \"csv\"");
  if (c.input.records_per_user_q < 0) in.fail("records_per_user_q", "must be >= 0");
  if (c.input.records_per_user_s <= 0) in.fail("records_per_user_s", "must be > 0");
  if (c.input.key_q < 0) in.fail("key_q", "must be >= 0");
  if (c.input.key_s <= 0) in.fail("key_s", "must be > 0");
  in.finish();

  SectionReader st(root, "stream", origins);
  c.stream.window_seconds = st.integer("window_seconds", c.stream.window_seconds, 1, std::int64_t{1} << 40);
  c.stream.triggers = static_cast<std::uint32_t>(st.required_integer("triggers", 1, 1'000'000));
  if (c.stream.triggers > c.stream.window_seconds)
    st.fail("triggers", fmt::format("({}) must not exceed window_seconds ({}): a trigger is at least one second",
                                    c.stream.triggers, c.stream.window_seconds));
  c.stream.first_window = st.integer("first_window", 0, 0, StreamConfig::kMaxWindow);
  c.stream.windows_from_input = c.input.kind == InputKind::Csv && !st.has("first_window") && !st.has("windows");
  c.stream.windows = static_cast<std::uint32_t>(st.integer("windows", 1, 1, 100'000));
  st.finish();

  SectionReader pr(root, "privacy", origins);
  c.privacy.mode = pr.choice("mode", PrivacyMode::None);
  if (c.privacy.mode == PrivacyMode::None && !pr.has("max_records_per_user"))
    c.privacy.max_records_per_user = PrivacyConfig::kUnbounded;  // the true totals: nothing dropped
  else
    c.privacy.max_records_per_user =
        static_cast<std::uint32_t>(pr.required_integer("max_records_per_user", 1, 1'000'000));
  c.privacy.composition = pr.choice("composition", Composition::Zcdp);
  if (c.privacy.composition == Composition::Basic && c.privacy.mode != PrivacyMode::Dp)
    pr.fail("composition",
            "= \"basic\" is for mode = \"dp\" (key selection and aggregation converted separately); "
            "use \"zcdp\" or, for a baseline, \"optimal\"");
  if (c.privacy.composition == Composition::Optimal && !is_baseline(c.privacy.mode))
    pr.fail("composition",
            "= \"optimal\" is for the baseline modes (per-release budgets composed over the triggers); "
            "use \"zcdp\" or, for mode = \"dp\", \"basic\"");
  c.privacy.clamp_min = pr.real("clamp_min", c.privacy.clamp_min);
  c.privacy.clamp_max = pr.real("clamp_max", c.privacy.clamp_max);
  if (!(c.privacy.clamp_min <= c.privacy.clamp_max))
    pr.fail("clamp_max", fmt::format("({}) must be >= clamp_min ({})", c.privacy.clamp_max, c.privacy.clamp_min));
  if (std::abs(c.privacy.clamp_min) > kMaxAbsClamp || std::abs(c.privacy.clamp_max) > kMaxAbsClamp)
    pr.fail("clamp_min", fmt::format("and clamp_max must lie in [-2^31, 2^31] (got [{}, {}])", c.privacy.clamp_min,
                                     c.privacy.clamp_max));
  const bool dp = is_private(c.privacy.mode);
  const std::string mode_name = to_string(c.privacy.mode);
  if (dp && !pr.has("epsilon"))
    pr.fail("epsilon", fmt::format("is required with mode = \"{}\" (the per-window budget, e.g. 6)", mode_name));
  if (dp && !pr.has("delta"))
    pr.fail("delta", fmt::format("is required with mode = \"{}\" (e.g. 1e-9; well below 1 / users)", mode_name));
  c.privacy.epsilon = pr.real("epsilon", 0);
  c.privacy.delta = pr.real("delta", 0);
  if (pr.has("mu")) c.privacy.mu = pr.real("mu", 0);
  if (pr.has("beta")) c.privacy.beta = pr.real("beta", 0);
  if (pr.has("seed")) c.privacy.seed = static_cast<std::uint64_t>(pr.integer("seed", 0, 0, kMaxI64));
  c.privacy.selection_epsilon_share = pr.real("selection_epsilon_share", c.privacy.selection_epsilon_share);
  c.privacy.selection_delta_share = pr.real("selection_delta_share", c.privacy.selection_delta_share);
  c.privacy.threshold = pr.choice("threshold", ThresholdTail::Subgaussian);
  c.privacy.selection_counter = pr.choice("selection_counter", c.privacy.selection_counter);
  c.privacy.value_counter = pr.choice("value_counter", c.privacy.value_counter);
  c.privacy.counter_band = static_cast<std::uint32_t>(pr.integer("counter_band", c.privacy.counter_band, 1, 16));
  if (pr.has("epsilon") && !(c.privacy.epsilon > 0))
    pr.fail("epsilon", fmt::format("must be > 0, got {}", c.privacy.epsilon));
  if (pr.has("delta") && !(c.privacy.delta > 0 && c.privacy.delta < 1))
    pr.fail("delta", fmt::format("must be in (0, 1), got {}", c.privacy.delta));
  c.privacy.ledger = pr.string("ledger", "");
  if (pr.has("ledger") && c.privacy.ledger.empty())
    pr.fail("ledger", "is empty: give the ledger's path (dpstream ledger init PATH ...) or remove the key");
  if (pr.has("ledger") && !dp)
    pr.fail("ledger", "charges privacy budget, and mode = \"none\" spends none: remove it or set a private mode");
  if (pr.has("ledger") && c.stream.windows_from_input)
    pr.fail("ledger",
            "needs the windows before any record is read: set [stream] first_window and windows (the windows "
            "found in the data would depend on it)");
  for (const char* key : {"mu", "beta", "selection_counter", "value_counter", "counter_band"})
    if (is_baseline(c.privacy.mode) && pr.has(key))
      pr.fail(key, fmt::format("is a DP-SQLP parameter; mode = \"{}\" thresholds each one-shot release by its own rule "
                               "(docs/PRIVACY.md section 8): remove it",
                               mode_name));
  if (c.privacy.mu && *c.privacy.mu < 0) pr.fail("mu", fmt::format("must be >= 0, got {}", *c.privacy.mu));
  if (c.privacy.beta && !(*c.privacy.beta > 0 && *c.privacy.beta < 1))
    pr.fail("beta", fmt::format("must be in (0, 1), got {}", *c.privacy.beta));
  for (const auto& [key, share] : {std::pair{"selection_epsilon_share", c.privacy.selection_epsilon_share},
                                   std::pair{"selection_delta_share", c.privacy.selection_delta_share}})
    if (!(share > 0 && share < 1)) pr.fail(key, fmt::format("must be in (0, 1), got {}", share));
  if (dp && c.input.kind == InputKind::Csv && c.input.bad_rows == BadRowPolicy::Fail)
    in.fail("bad_rows", fmt::format("= \"fail\" would stop a private job (mode = \"{}\") because of one row: the stop "
                                    "is an output that depends on the data. Use \"skip\" (skipped rows are counted on "
                                    "stderr and in summary.json), or check the input first with mode = \"none\"",
                                    mode_name));
  pr.finish();

  SectionReader q(root, "query", origins);
  const auto aggregations = q.strings("aggregations", {"count", "sum"});
  c.query.count = c.query.sum = false;
  for (const auto& a : aggregations) {
    bool& column =
        a == "count" ? c.query.count
        : a == "sum" ? c.query.sum
                     : (q.fail("aggregations", fmt::format("has unknown column \"{}\" (known: \"count\", \"sum\")", a)),
                        c.query.count);
    if (column) q.fail("aggregations", fmt::format("lists \"{}\" twice", a));
    column = true;
  }
  if (aggregations.empty()) q.fail("aggregations", "must name at least one column: [\"count\"], [\"sum\"] or both");
  q.finish();

  SectionReader out(root, "output", origins);
  c.output.dir = out.string("dir", c.output.dir);
  if (c.output.dir.empty()) out.fail("dir", "must not be empty");
  c.output.format = out.choice_of<std::string>("format", "csv",
                                               {std::begin(OutputConfig::kFormats), std::end(OutputConfig::kFormats)},
                                               [](const std::string& v) { return v; });
  c.output.progress = out.choice("progress", ProgressMode::Always);
  out.finish();

  SectionReader ck(root, "checkpoint", origins);
  if (ck.has("every")) c.checkpoint.every = static_cast<std::uint32_t>(ck.integer("every", 1, 0, 1'000'000));
  c.checkpoint.seconds = ck.real("seconds", c.checkpoint.seconds);
  if (!(c.checkpoint.seconds >= 0.001 && c.checkpoint.seconds <= 1e7))
    ck.fail("seconds", fmt::format("must be in [0.001, 1e7] (seconds between commits), got {}", c.checkpoint.seconds));
  constexpr std::int64_t kMaxJournalMib = std::int64_t{1} << 20;  // 1 TiB
  using Limits = std::numeric_limits<std::int64_t>;
  const std::int64_t journal_mib = ck.integer("journal_mib", c.checkpoint.journal_mib, Limits::min(), Limits::max());
  if (journal_mib < 1 || journal_mib > kMaxJournalMib)
    ck.fail("journal_mib", fmt::format("must be in [1, {}] (MiB of commit journal per rank before a commit), got {}",
                                       kMaxJournalMib, journal_mib));
  c.checkpoint.journal_mib = static_cast<std::uint32_t>(journal_mib);
  ck.finish();

  SectionReader en(root, "engine", origins);
  c.engine.key_scan = en.choice("key_scan", KeyScan::Predicted);
  using EngineLimits = std::numeric_limits<std::int64_t>;
  const std::int64_t batch = en.integer("trigger_batch", 0, EngineLimits::min(), EngineLimits::max());
  if (batch < 0 || batch > EngineConfig::kMaxTriggerBatch)
    en.fail("trigger_batch", fmt::format("must be in [0, {}] (triggers bounded in one pass over the user state; 0: "
                                         "about a fiftieth of [stream] triggers), got {}",
                                         EngineConfig::kMaxTriggerBatch, batch));
  c.engine.trigger_batch = static_cast<std::uint32_t>(batch);
  en.finish();
  return c;
}

std::string large_delta_warning(double delta, std::uint64_t users) {
  const double limit = users > 0 ? 1.0 / static_cast<double>(users) : kLargeDelta;
  if (!(delta >= limit)) return {};
  return fmt::format(
      "delta = {} is {}: a mechanism may then publish one user's records outright with probability "
      "delta; use a delta well below 1 / users (e.g. 1e-9)",
      delta,
      users > 0 ? fmt::format("at least 1 / users (users = {})", users) : fmt::format("at least {}", kLargeDelta));
}

JobConfig load_job(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(path, ec);
  if (std::filesystem::is_directory(st))
    throw ConfigError(
        fmt::format("job spec {} is a directory; give a job spec file (TOML), e.g. jobs/demo.toml", path));
  // A device (/dev/zero would never end) or socket; a FIFO is read as it comes (`dpstream budget <(envsubst < t)`).
  if (std::filesystem::is_character_file(st) || std::filesystem::is_block_file(st) || std::filesystem::is_socket(st))
    throw ConfigError(fmt::format(
        "job spec {} is a device or socket, not a file; give a job spec file (TOML), e.g. jobs/demo.toml", path));
  std::ifstream f(path, std::ios::binary);
  if (!f) throw ConfigError(fmt::format("cannot open job spec {}: check the path (job specs live under jobs/)", path));
  std::ostringstream ss;
  ss << f.rdbuf();
  return parse_job(ss.str(), path, overrides);
}

std::string demo_job_toml() {
  return R"(# Built-in demo: the core paper's synthetic workload, scaled down to run in seconds.
[job]
name = "demo"

[input]
kind = "synthetic"
users = 20000
keys = 2000
key_distribution = "zipf-mandelbrot"
seed = 7

[stream]
window_seconds = 86400
triggers = 10

[privacy]
mode = "none"
max_records_per_user = 16
clamp_min = 0.0
clamp_max = 1.0

[output]
dir = "dpstream-demo-out"
format = "csv"
)";
}

}  // namespace dpstream
