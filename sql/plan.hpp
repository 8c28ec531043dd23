// The privacy plan of one DP SQL query: which noisy quantities (components) each aggregate needs, one
// user's effect on each (its sensitivity per group), how the budget is split, the lattice and the noise
// of every component, and the accounting that justifies them (docs/SQL.md "Noise", docs/PRIVACY.md
// section 12). Pure: no MPI, no data.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/int128.hpp"
#include "kernels/noise.hpp"
#include "sql/query.hpp"
#include "sql/selection.hpp"

namespace dpstream::sql {

enum class NoiseKind { Gaussian, Laplace };

// Fixed point of values: integers of 2^-32 (docs/SQL.md, "Read").
inline constexpr int kFractionBits = 32;
inline constexpr double kValueLimit = 0x1p50;     // a value is clamped to [-2^50, 2^50] on read
inline constexpr double kBoundLimit = 0x1p40;     // |L|, |U| of an aggregate
inline constexpr double kVarRangeLimit = 0x1p30;  // U - L of ANON_VAR / ANON_STDDEV (squares fit in int128)
inline constexpr int kTreeDepth = 4;              // quantile tree: 16^4 leaves over [L, U]
inline constexpr int kTreeBranching = 16;
int128 to_fixed(double v);  // round-half-even(clamp(v, +-2^50) 2^32)

// One noisy quantity released per group.
struct Component {
  enum class What {
    Count,            // sum over users of min(rows, U)
    Users,            // distinct users (shared by ANON_COUNT(DISTINCT) and the denominators of AVG / VAR)
    Sum,              // sum over users of clamp(sum, L, U)
    CenteredSum,      // sum over users of (x - m), x the clamped mean
    CenteredSquares,  // sum over users of ((x - m)^2 >> 32) - h / 2
    Tree              // the quantile tree's node counts (one count per level per user)
  } what = What::Count;
  std::size_t aggregate = 0;  // Query::aggregates index (Users: the first aggregate that needs it)
  int128 delta_units = 0;     // one user's largest |change| of the quantity in one group, in 2^-32 units
  bool count_like = false;    // true values are multiples of 2^32 units (counts)
  double share = 0;           // of the aggregates' budget
  // Set by the plan:
  double rho = 0, eps = 0;         // what the component costs (zCDP or pure eps)
  int lattice_exp = 0;             // granularity g = 2^lattice_exp units
  std::int64_t delta_lattice = 0;  // sensitivity per group in lattice units: exact, or floor(Delta / g) + 1
  double noise_param = 0;          // sigma (Gaussian) or b (Laplace) in lattice units, as rounded by the sampler
  std::shared_ptr<const noise::DiscreteGaussian> gauss;
  std::shared_ptr<const noise::DiscreteLaplace> lap;
  double noise_sd_value() const;  // standard deviation of the noise in value units
  std::int64_t sample(noise::NodeStream& rng) const;
};

// How each aggregate reads the components (indices into QueryPlan::components; -1 = none).
struct AggregateSlots {
  int main = -1;                            // Count / Sum / Tree / CenteredSum
  int users = -1;                           // Users component; -1 with users_from_selection
  int squares = -1;                         // CenteredSquares (VAR, STDDEV)
  bool users_from_selection = false;        // the selection's noisy count is N
  int value_column = -1;                    // index into QueryPlan::value_columns (-1: none)
  int128 lower = 0, upper = 0, center = 0;  // in units (clamped mean / sum bounds); center m = floor((L + U) / 2)
  int128 half_square = 0;                   // h / 2 in units (VAR)
  std::int64_t count_cap = 0;               // U of a count
};

// Event-time windows of the table (docs/SQL.md "Windows"): an integer-seconds column cut into windows of
// `seconds` (the ledger's blocks). per_window: one release per window, privacy unit user x window;
// else one release over every window read, privacy unit the user. `first`..`last` (inclusive) restricts
// the rows read to those windows (required with a ledger: the blocks charged are declared, not found).
struct WindowSpec {
  std::string column;
  std::int64_t seconds = 86400;
  bool per_window = false;
  std::optional<std::int64_t> first, last;
  bool active() const { return !column.empty(); }
};

struct QueryOptions {
  double epsilon = 0, delta = 0;
  std::uint32_t max_groups_per_user = 1;  // k (the seed's C_u)
  std::uint32_t max_rows_per_group = 1;   // U of ANON_COUNT(*) when not written
  SelectionKind selection = SelectionKind::Gaussian;
  NoiseKind noise = NoiseKind::Gaussian;
  double selection_share = 0.5;  // of eps (or rho) spent on selection when it costs anything
  std::string user_column;
  WindowSpec windows;
  // One release of a schedule (sql/growing.hpp): spend exactly this zCDP rho (Gaussian noise, Gaussian or
  // public selection) and this threshold delta; epsilon and delta are then the whole schedule's budget.
  std::optional<double> release_rho;
  double release_delta_selection = 0;
};

struct QueryPlan {
  Query query;
  QueryOptions options;
  std::vector<std::string> value_columns;  // numeric columns the aggregates read, in first-use order
  std::vector<Component> components;
  std::vector<AggregateSlots> slots;  // one per aggregate
  Selection selection;
  // Accounting: the zCDP part (rho), converted with CKS20, plus pure eps and deltas, composed basically.
  double rho_total = 0, eps_pure = 0, delta_threshold = 0, delta_conversion = 0;
  double eps_total = 0, delta_total = 0;  // <= options' epsilon, delta
};

// Builds and checks the plan; throws QueryError (query rules) or std::invalid_argument (options) with a
// message saying what to change.
QueryPlan plan_query(const Query& query, const QueryOptions& options);

nlohmann::json plan_json(const QueryPlan& plan);  // the report's "accounting", "selection", "aggregates"
std::string plan_text(const QueryPlan& plan);     // the same for people

}  // namespace dpstream::sql
