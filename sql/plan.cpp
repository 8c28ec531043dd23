#include "sql/plan.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "src/accounting.hpp"

namespace dpstream::sql {

namespace {

using What = Component::What;

constexpr double kMaxEpsilon = 1e6;
constexpr std::uint32_t kMaxK = 1u << 20;
constexpr int kLatticeBits = 20;  // sigma / g is about 2^20: the rounding of S to the lattice is invisible

double to_double(int128 v) { return static_cast<double>(static_cast<long double>(v)); }

int128 max_abs(int128 a, int128 b) { return std::max(a < 0 ? -a : a, b < 0 ? -b : b); }

void check_windows(const WindowSpec& w) {
  if (!w.active()) {
    if (w.per_window || w.first || w.last)
      throw std::invalid_argument("--per-window and --windows need --window-column: the table's time column");
    return;
  }
  if (w.seconds <= 0) throw std::invalid_argument(fmt::format("--window-seconds {} must be > 0", w.seconds));
  if (w.first.has_value() != w.last.has_value() || (w.first && *w.first > *w.last))
    throw std::invalid_argument("--windows A:B needs A <= B (window numbers, floor(time / window-seconds))");
}

void check_options(const QueryOptions& o) {
  if (!(o.epsilon > 0 && o.epsilon <= kMaxEpsilon))
    throw std::invalid_argument(fmt::format("--epsilon {} must be in (0, {:g}]", o.epsilon, kMaxEpsilon));
  if (!(o.delta >= 0 && o.delta < 1)) throw std::invalid_argument(fmt::format("--delta {} must be in [0, 1)", o.delta));
  if (o.max_groups_per_user < 1 || o.max_groups_per_user > kMaxK)
    throw std::invalid_argument(fmt::format("--max-groups-per-user must be in [1, {}]", kMaxK));
  if (o.max_rows_per_group < 1 || o.max_rows_per_group > kMaxK)
    throw std::invalid_argument(fmt::format("--max-rows-per-group must be in [1, {}]", kMaxK));
  if (!(o.selection_share > 0 && o.selection_share < 1))
    throw std::invalid_argument(fmt::format("--selection-share {} must be in (0, 1)", o.selection_share));
  check_windows(o.windows);
  if (o.user_column.empty()) throw std::invalid_argument("--user-column is required: the column naming the user");
  if (o.release_rho && (o.noise != NoiseKind::Gaussian ||
                        (o.selection != SelectionKind::Gaussian && o.selection != SelectionKind::Public)))
    throw std::invalid_argument(
        "a growing-stream schedule composes releases in zCDP: use --noise gaussian and --selection gaussian or public");
  const bool needs_delta = o.selection != SelectionKind::Public || o.noise == NoiseKind::Gaussian;
  if (needs_delta && o.delta == 0)
    throw std::invalid_argument(
        "--delta must be > 0: thresholding and Gaussian noise need it (or use --selection public --noise laplace)");
}

std::string position(const Aggregate& a) { return fmt::format("column {} ('{}')", a.column_pos, a.text); }

// Rules that need the options: the user column, VAR's range.
void check_aggregate(const Aggregate& a, const QueryOptions& o) {
  if (a.kind == AggKind::CountDistinct && a.column != o.user_column)
    throw QueryError(fmt::format("{}: ANON_COUNT(DISTINCT {}) counts users only; write ANON_COUNT(DISTINCT {}) "
                                 "(the --user-column), since another column's distinct values are not bounded per user",
                                 position(a), a.column, o.user_column),
                     a.column_pos);
  if ((a.kind == AggKind::Var || a.kind == AggKind::Stddev) && a.upper - a.lower > kVarRangeLimit)
    throw QueryError(
        fmt::format("{}: U - L = {:g} exceeds 2^30 for a variance; narrow the bounds", position(a), a.upper - a.lower),
        a.column_pos);
}

int value_column_of(std::vector<std::string>& cols, const std::string& name) {
  const auto it = std::find(cols.begin(), cols.end(), name);
  if (it != cols.end()) return static_cast<int>(it - cols.begin());
  cols.push_back(name);
  return static_cast<int>(cols.size()) - 1;
}

int add(std::vector<Component>& comps, What what, std::size_t agg, int128 delta, bool count_like) {
  Component c;
  c.what = what, c.aggregate = agg, c.delta_units = delta, c.count_like = count_like;
  comps.push_back(std::move(c));
  return static_cast<int>(comps.size()) - 1;
}

// The components and slots of every aggregate (docs/SQL.md, "Aggregates").
void build_components(QueryPlan& p) {
  const SelectionKind sk = p.options.selection;  // Laplace and Gaussian selection give a noisy user count
  const bool selection_counts = sk == SelectionKind::Laplace || sk == SelectionKind::Gaussian;
  int users = -1;
  auto users_slot = [&](std::size_t agg) {
    if (users < 0) users = add(p.components, What::Users, agg, int128{1} << kFractionBits, true);
    return users;
  };
  for (std::size_t i = 0; i < p.query.aggregates.size(); ++i) {
    const Aggregate& a = p.query.aggregates[i];
    AggregateSlots s;
    if (a.kind != AggKind::CountDistinct && !a.column.empty())
      s.value_column = value_column_of(p.value_columns, a.column);
    s.lower = to_fixed(a.lower), s.upper = to_fixed(a.upper);
    s.center = (s.lower + s.upper) >> 1;  // floor
    const int128 dev = std::max(s.upper - s.center, s.center - s.lower);
    switch (a.kind) {
      case AggKind::Count:
        s.count_cap = a.has_bounds ? static_cast<std::int64_t>(a.upper) : p.options.max_rows_per_group;
        s.main = add(p.components, What::Count, i, int128{s.count_cap} << kFractionBits, true);
        break;
      case AggKind::CountDistinct:
        s.users_from_selection = selection_counts;
        if (!selection_counts) s.users = users_slot(i);
        break;
      case AggKind::Sum:
        s.main = add(p.components, What::Sum, i, max_abs(s.lower, s.upper), false);
        break;
      case AggKind::Avg:
      case AggKind::Var:
      case AggKind::Stddev: {
        s.main = add(p.components, What::CenteredSum, i, dev, false);
        s.users_from_selection = selection_counts;
        if (!selection_counts) s.users = users_slot(i);
        if (a.kind != AggKind::Avg) {
          const int128 h = (dev * dev) >> kFractionBits;
          s.half_square = h >> 1;
          s.squares = add(p.components, What::CenteredSquares, i, h - s.half_square, false);
        }
        break;
      }
      case AggKind::Ntile:
        s.main = add(p.components, What::Tree, i, int128{1} << kFractionBits, true);
        break;
    }
    p.slots.push_back(s);
  }
}

// Equal shares: one per aggregate with components of its own (split among them), one for the shared Users.
void assign_shares(std::vector<Component>& comps, std::size_t aggregates) {
  std::vector<int> own(aggregates, 0);
  bool users = false;
  for (const Component& c : comps) c.what == What::Users ? void(users = true) : void(++own[c.aggregate]);
  const double items =
      static_cast<double>(std::count_if(own.begin(), own.end(), [](int n) { return n > 0; })) + (users ? 1.0 : 0.0);
  for (Component& c : comps) c.share = c.what == What::Users ? 1 / items : 1 / (items * own[c.aggregate]);
}

// L2 (Gaussian) or L1 (Laplace) sensitivity per group of a component in units of its lattice.
double lattice_sensitivity(const Component& c, NoiseKind noise) {
  const double d = static_cast<double>(c.delta_lattice);
  if (c.what != What::Tree) return d;
  return noise == NoiseKind::Gaussian ? d * std::sqrt(double{kTreeDepth}) : d * kTreeDepth;  // one count per level
}

// A budget so small that the noise it needs is beyond the samplers (or not finite: epsilon near 5e-324).
[[noreturn]] void refuse_noise_beyond_samplers(double scale) {
  throw std::invalid_argument(
      fmt::format("the budget is too small for this query: its noise (scale {:g}) is beyond what the samplers draw; "
                  "raise --epsilon or --delta, or lower --max-groups-per-user",
                  scale));
}

// g = 2^e with sigma / g ~ 2^20, never finer than a unit, never below one count for counts; the sensitivity
// in lattice steps is exact when the lattice holds every true value, else floor(Delta / g) + 1.

void choose_lattice(Component& c, double noise_per_unit_delta) {
  const double est = to_double(c.delta_units) * noise_per_unit_delta;
  if (!std::isfinite(est)) refuse_noise_beyond_samplers(est);  // floor(log2(inf)) cast to int is undefined
  int e = est > 0 ? static_cast<int>(std::floor(std::log2(est))) - kLatticeBits : 0;
  e = std::clamp(e, c.count_like ? kFractionBits : 0, 100);
  const bool exact = e == 0 || (c.count_like && e == kFractionBits);
  c.lattice_exp = e;
  c.delta_lattice = static_cast<std::int64_t>(c.delta_units >> e) + (exact ? 0 : 1);
}

constexpr double kMinScale = 0x1p-10;  // the samplers' smallest scale; more noise is always safe

void gaussian_noise(Component& c, double rho, std::uint32_t k) {
  const double per_unit = std::sqrt(k / (2 * rho)) * (c.what == What::Tree ? std::sqrt(double{kTreeDepth}) : 1.0);
  choose_lattice(c, per_unit);
  const double l2 = lattice_sensitivity(c, NoiseKind::Gaussian);
  const double sigma = std::max(l2 * std::sqrt(k / (2 * rho)), kMinScale);
  if (!(sigma <= 0x1p24)) refuse_noise_beyond_samplers(sigma);
  c.gauss = std::make_shared<noise::DiscreteGaussian>(sigma);
  c.noise_param = c.gauss->sigma();
  c.rho = k * l2 * l2 / (2 * c.noise_param * c.noise_param);  // what the rounded-up sigma costs
}

void laplace_noise(Component& c, double eps, std::uint32_t k) {
  const double per_unit = k / eps * (c.what == What::Tree ? double{kTreeDepth} : 1.0);
  choose_lattice(c, per_unit);
  const double l1 = lattice_sensitivity(c, NoiseKind::Laplace);
  const double scale = std::max(k * l1 / eps, kMinScale);
  if (!(scale <= 0x1p40)) refuse_noise_beyond_samplers(scale);  // noise::DiscreteLaplace's range
  c.lap = std::make_shared<noise::DiscreteLaplace>(scale);
  c.noise_param = c.lap->scale();
  c.eps = k * l1 / c.noise_param;
}

// The budget of the aggregates and of the selection (docs/SQL.md, "Budget").
struct Split {
  double rho_agg = 0, eps_agg = 0;                 // the aggregates' zCDP or pure-eps budget
  double rho_sel = 0, eps_sel = 0, delta_sel = 0;  // the selection's
  double delta_conversion = 0;                     // delta of the zCDP -> (eps, delta) conversion
};

// One release of a schedule: its rho and threshold delta are given.
Split release_split(const QueryOptions& o, bool has_components) {
  Split s;
  const double share = has_components ? o.selection_share : 1.0;
  const double rho = *o.release_rho;
  if (o.selection == SelectionKind::Gaussian)
    s.rho_sel = share * rho, s.rho_agg = rho - s.rho_sel, s.delta_sel = o.release_delta_selection;
  else
    s.rho_agg = rho;
  return s;
}

Split split_budget(const QueryOptions& o, bool has_components) {
  if (o.release_rho) return release_split(o, has_components);
  Split s;
  const double share = has_components ? o.selection_share : 1.0;
  const bool gauss_noise = o.noise == NoiseKind::Gaussian;
  switch (o.selection) {
    case SelectionKind::Public:
      if (gauss_noise)
        s.delta_conversion = o.delta, s.rho_agg = accounting::zcdp_rho_tight(o.epsilon, o.delta);
      else
        s.eps_agg = o.epsilon;
      break;
    case SelectionKind::Gaussian: {
      s.delta_sel = o.delta / 2, s.delta_conversion = o.delta / 2;
      if (gauss_noise) {
        const double rho = accounting::zcdp_rho_tight(o.epsilon, s.delta_conversion);
        s.rho_sel = share * rho, s.rho_agg = rho - s.rho_sel;
      } else {
        s.rho_sel = accounting::zcdp_rho_tight(share * o.epsilon, s.delta_conversion);
        s.eps_agg = o.epsilon - share * o.epsilon;
      }
      break;
    }
    case SelectionKind::Laplace:
    case SelectionKind::Magic:
      s.eps_sel = share * o.epsilon;
      s.delta_sel = gauss_noise && has_components ? o.delta / 2 : o.delta;
      if (gauss_noise && has_components) {
        s.delta_conversion = o.delta - s.delta_sel;
        s.rho_agg = accounting::zcdp_rho_tight(o.epsilon - s.eps_sel, s.delta_conversion);
      } else {
        s.eps_agg = o.epsilon - s.eps_sel;
      }
      break;
  }
  return s;
}

Selection build_selection(const QueryOptions& o, const Split& s) {
  const std::uint32_t k = o.max_groups_per_user;
  switch (o.selection) {
    case SelectionKind::Laplace:
      return Selection::laplace(s.eps_sel, s.delta_sel, k);
    case SelectionKind::Gaussian:
      return Selection::gaussian(s.rho_sel, s.delta_sel, k);
    case SelectionKind::Magic:
      return Selection::magic(s.eps_sel, s.delta_sel, k);
    case SelectionKind::Public:
      break;
  }
  return Selection::public_groups();
}

// Totals from what each part actually costs (rounded-up noise costs at most its share).
void account(QueryPlan& p, const Split& s) {
  const std::uint32_t k = p.options.max_groups_per_user;
  p.rho_total = 0, p.eps_pure = 0;
  for (const Component& c : p.components) p.rho_total += c.rho, p.eps_pure += c.eps;
  switch (p.options.selection) {
    case SelectionKind::Gaussian: {
      const double sigma = p.selection.noise_scale();
      p.rho_total += k / (2 * sigma * sigma);
      break;
    }
    case SelectionKind::Laplace:
      p.eps_pure += k / p.selection.noise_scale();
      break;
    case SelectionKind::Magic:
      p.eps_pure += s.eps_sel;
      break;
    case SelectionKind::Public:
      break;
  }
  p.delta_threshold = s.delta_sel;
  if (p.options.release_rho) {  // one release of a schedule: the schedule converts the sum of its rhos
    if (p.rho_total > *p.options.release_rho * (1 + 1e-12))
      throw std::logic_error(
          fmt::format("internal: the release spends rho {} above its {}", p.rho_total, *p.options.release_rho));
    // Alone, this run is (eps, delta)-DP with the schedule's conversion delta (a ledger's basic accounting).
    p.delta_conversion = p.rho_total > 0 ? p.options.delta / 2 : 0;
    p.eps_total = p.rho_total > 0 ? accounting::zcdp_eps_tight(p.rho_total, p.delta_conversion) : 0;
    p.delta_total = p.delta_conversion + p.delta_threshold;
    return;
  }
  p.delta_conversion = p.rho_total > 0 ? s.delta_conversion : 0;
  const double eps_z = p.rho_total > 0 ? accounting::zcdp_eps_tight(p.rho_total, p.delta_conversion) : 0;
  p.eps_total = eps_z + p.eps_pure;
  p.delta_total = p.delta_conversion + p.delta_threshold;
  if (p.eps_total > p.options.epsilon * (1 + 1e-9) || p.delta_total > p.options.delta * (1 + 1e-12))
    throw std::logic_error(fmt::format("internal: the plan spends ({}, {}) above the budget ({}, {})", p.eps_total,
                                       p.delta_total, p.options.epsilon, p.options.delta));
  // The split adds back what it subtracted (eps_sel + (eps - eps_sel)): an ulp over is rounding, not spending.
  p.eps_total = std::min(p.eps_total, p.options.epsilon);
  p.delta_total = std::min(p.delta_total, p.options.delta);
}

std::string privacy_unit(const WindowSpec& w) {
  if (!w.active()) return "user";
  const std::string range = w.first ? fmt::format(", windows {}..{}", *w.first, *w.last) : "";
  return w.per_window
             ? fmt::format("user x window ({} / {} s{})", w.column, w.seconds, range)
             : fmt::format("user (one release over the windows read: {} / {} s{})", w.column, w.seconds, range);
}

const char* what_name(What w) {
  switch (w) {
    case What::Count:
      return "count";
    case What::Users:
      return "users";
    case What::Sum:
      return "sum";
    case What::CenteredSum:
      return "centered sum";
    case What::CenteredSquares:
      return "centered squares";
    case What::Tree:
      return "quantile tree counts";
  }
  return "?";
}

const char* selection_name(SelectionKind k) {
  switch (k) {
    case SelectionKind::Laplace:
      return "laplace";
    case SelectionKind::Gaussian:
      return "gaussian";
    case SelectionKind::Magic:
      return "magic";
    case SelectionKind::Public:
      return "public";
  }
  return "?";
}

}  // namespace

int128 to_fixed(double v) {
  const double c = std::clamp(v, -kValueLimit, kValueLimit);
  return static_cast<int128>(std::nearbyint(std::ldexp(c, kFractionBits)));  // ldexp is exact; ties to even
}

double Component::noise_sd_value() const {
  double sd = noise_param;  // the Gaussian's sigma (its discrete sd is at most sigma)
  if (lap) {
    const double t = std::exp(-1 / noise_param);
    sd = std::sqrt(2 * t) / (1 - t);  // DLap: Var = 2t / (1 - t)^2
  }
  return std::ldexp(sd, lattice_exp - kFractionBits);
}

std::int64_t Component::sample(noise::NodeStream& rng) const { return gauss ? gauss->sample(rng) : lap->sample(rng); }

QueryPlan plan_query(const Query& query, const QueryOptions& options) {
  check_options(options);
  for (const Aggregate& a : query.aggregates) check_aggregate(a, options);
  QueryPlan p;
  p.query = query;
  p.options = options;
  build_components(p);
  assign_shares(p.components, query.aggregates.size());
  const Split s = split_budget(options, !p.components.empty());
  p.selection = build_selection(options, s);
  for (Component& c : p.components)
    options.noise == NoiseKind::Gaussian ? gaussian_noise(c, s.rho_agg * c.share, options.max_groups_per_user)
                                         : laplace_noise(c, s.eps_agg * c.share, options.max_groups_per_user);
  account(p, s);
  return p;
}

nlohmann::json plan_json(const QueryPlan& p) {
  nlohmann::json aggs = nlohmann::json::array();
  for (std::size_t i = 0; i < p.query.aggregates.size(); ++i) {
    nlohmann::json comps = nlohmann::json::array(), scales = nlohmann::json::array();
    const AggregateSlots& s = p.slots[i];
    for (int idx : {s.main, s.users, s.squares}) {
      if (idx < 0) continue;
      const Component& c = p.components[static_cast<std::size_t>(idx)];
      comps.push_back({{"quantity", what_name(c.what)},
                       {"sensitivity_per_group", to_double(c.delta_units) / 0x1p32},
                       {"granularity", std::ldexp(1.0, c.lattice_exp - kFractionBits)},
                       {"noise", c.gauss ? "discrete gaussian" : "discrete laplace"},
                       {"noise_scale", c.noise_sd_value()},
                       {"rho", c.rho},
                       {"epsilon", c.eps},
                       {"shared", c.what == What::Users}});
      scales.push_back(c.noise_sd_value());
    }
    if (s.users_from_selection) {
      comps.push_back({{"quantity", "users"}, {"from_selection", true}});
      scales.push_back(p.selection.kind() == SelectionKind::Gaussian ? p.selection.noise_scale()
                                                                     : std::sqrt(2.0) * p.selection.noise_scale());
    }
    const Aggregate& a = p.query.aggregates[i];
    std::string name;
    for (const SelectItem& it : p.query.select)
      if (it.is_aggregate && it.aggregate == i) name = it.name;
    aggs.push_back({{"name", name}, {"text", a.text}, {"components", comps}, {"noise_scale", scales}});
  }
  const Selection& sel = p.selection;
  return {{"options",
           {{"epsilon", p.options.epsilon},
            {"delta", p.options.delta},
            {"max_groups_per_user", p.options.max_groups_per_user},
            {"max_rows_per_group", p.options.max_rows_per_group},
            {"noise", p.options.noise == NoiseKind::Gaussian ? "gaussian" : "laplace"},
            {"selection_share", p.options.selection_share},
            {"privacy_unit", privacy_unit(p.options.windows)}}},
          {"selection",
           {{"kind", selection_name(sel.kind())},
            {"threshold", sel.threshold()},
            {"noise_scale", sel.noise_scale()},
            {"single_user_keep_bound", sel.single_user_keep_bound()},
            {"describe", sel.describe()}}},
          {"aggregates", aggs},
          {"accounting",
           {{"rho_total", p.rho_total},
            {"eps_pure", p.eps_pure},
            {"delta_threshold", p.delta_threshold},
            {"delta_conversion", p.delta_conversion},
            {"epsilon", p.eps_total},
            {"delta", p.delta_total},
            {"conversion", "zCDP to (eps, delta): Canonne, Kamath & Steinke 2020; parts composed basically"}}}};
}

std::string plan_text(const QueryPlan& p) {
  std::string out = fmt::format("selection: {}\n", p.selection.describe());
  for (std::size_t i = 0; i < p.query.aggregates.size(); ++i) {
    out += fmt::format("{}:", p.query.aggregates[i].text);
    const AggregateSlots& s = p.slots[i];
    for (int idx : {s.main, s.users, s.squares}) {
      if (idx < 0) continue;
      const Component& c = p.components[static_cast<std::size_t>(idx)];
      out += fmt::format(" [{}: sd {:.4g}, {}]", what_name(c.what), c.noise_sd_value(),
                         c.gauss ? fmt::format("rho {:.4g}", c.rho) : fmt::format("eps {:.4g}", c.eps));
    }
    if (s.users_from_selection) out += " [users: the selection's noisy count]";
    out += "\n";
  }
  out += fmt::format("total: rho {:.6g} + eps {:.6g} -> ({:.6g}, {:.3g})-DP (budget ({}, {}))\n", p.rho_total,
                     p.eps_pure, p.eps_total, p.delta_total, p.options.epsilon, p.options.delta);
  return out;
}

}  // namespace dpstream::sql
