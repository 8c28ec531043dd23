#include "kernels/banded_counter.hpp"

#include <boost/multiprecision/cpp_int.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "common/simd_clones.hpp"
#include "kernels/cpu_features.hpp"

namespace dpstream::kernels::banded {

namespace mp = boost::multiprecision;

namespace {
constexpr std::int64_t kOneCoef = std::int64_t{1} << kCoefBits;
// Fraction bits of Z kept per step: Z~ (noise::normal_fixed56) is an int64 since |Z| < 2^7 (P[|Z| >= 128]
// < 10^-3500; the noise layer refuses larger ones), which keeps every fixed-point sum inside int128.
constexpr int kKeptBits = 56;
constexpr std::uint32_t kMaxSearchHorizon = 1024;  // the band search's horizon: T beyond it changes the band little

// floor(x) and ceil(x) for |x| < 2^62, without libm's calls (no SSE4.1 rounding in the baseline ISA):
// the conversion truncates toward zero, exactly, and the comparison steps it the rest of the way.
std::int64_t floor_to_int(double x) {
  const auto t = static_cast<std::int64_t>(x);
  return t - static_cast<std::int64_t>(static_cast<double>(t) > x);
}
std::int64_t ceil_to_int(double x) {
  const auto t = static_cast<std::int64_t>(x);
  return t + static_cast<std::int64_t>(static_cast<double>(t) < x);
}

// sigma q 2^-118 in double (within 2^-52 of it; the power of two is exact): grid units per estimate unit
// of 2^-86, for a grid q in [1, 2^62].
double grid_scale(const BandedPlan& plan, std::int64_t q) {
  static_assert(kKeptBits + kCoefBits + kSigmaBits == 118);  // 2^-118: the estimate's unit times sigma's
  if (q < 1 || q > (std::int64_t{1} << 62)) throw std::invalid_argument("banded counter: grid outside [1, 2^62]");
  return static_cast<double>(plan.sigma_numerator()) * static_cast<double>(q) * 0x1p-118;
}

// The edges of round(q N) from an estimate y and an error bound `error_units` (both in units of 2^-86):
// every value within scale error_units of scale y, rounded (NoiseEdges::interval adds 1 each side for the
// bounds' own roundings); unknown where |q N| nears 2^50. Branch-free: a simulation's loop vectorizes.
NoiseEdges rounded_edges(double scale, double y, double error_units) {
  const double v = scale * y;
  const double error = scale * error_units + 0.5;
  const bool known = std::abs(v) + error < 0x1p50;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  return {known ? v - error : nan, known ? v + error : nan};
}

// round(x / 2^shift), ties away from zero.
mp::cpp_int round_shift(const mp::cpp_int& x, unsigned shift) {
  const mp::cpp_int half = mp::cpp_int(1) << (shift - 1);
  return x >= 0 ? mp::cpp_int((x + half) >> shift) : mp::cpp_int(-((-x + half) >> shift));
}

int128 to_int128(const mp::cpp_int& v);

// round(scale Y / 2^shift) when it is the same at both ends of Y in [y - a, y + a], else nothing.
std::optional<int128> rounding_of_interval(const mp::cpp_int& scale, const mp::cpp_int& y, const mp::cpp_int& a,
                                           unsigned shift) {
  const mp::cpp_int lo = round_shift(scale * (y - a), shift), hi = round_shift(scale * (y + a), shift);
  if (lo == hi) return to_int128(lo);
  return std::nullopt;
}

int128 to_int128(const mp::cpp_int& v) {
  if (mp::abs(v) >= (mp::cpp_int(1) << 126)) throw std::range_error("banded counter: rounded noise beyond int128");
  const auto mag = static_cast<uint128>(mp::abs(v) >> 64) << 64 |
                   static_cast<uint128>(static_cast<std::uint64_t>(mp::abs(v) & ~std::uint64_t{0}));
  return v < 0 ? -static_cast<int128>(mag) : static_cast<int128>(mag);
}

mp::cpp_int to_cpp(int128 v) {
  const uint128 mag = v < 0 ? -static_cast<uint128>(v) : static_cast<uint128>(v);
  mp::cpp_int r = mp::cpp_int(static_cast<std::uint64_t>(mag >> 64)) << 64;
  r += static_cast<std::uint64_t>(mag);
  return v < 0 ? mp::cpp_int(-r) : r;
}

// The power-series inverse c of each of N bands of one width over T terms and sum c_k^2, in floating type F.
// Each band's operations are the same whatever N: more bands interleave independent chains, where one
// chain's latency bounds the loop (the band search evaluates two candidates at once).
template <class F, std::size_t N>
std::array<F, N> inverse_norms_squared(const std::array<const std::vector<std::int64_t>*, N>& bands, std::uint32_t T) {
  const std::size_t n = bands[0]->size();
  std::array<std::vector<F>, N> m, c;
  for (std::size_t j = 0; j < N; ++j) {
    if (bands[j]->size() != n) throw std::logic_error("banded counter: bands of two widths");
    m[j].resize(n), c[j].resize(T);
    for (std::size_t i = 0; i < n; ++i) m[j][i] = static_cast<F>((*bands[j])[i]) / static_cast<F>(kOneCoef);
  }
  std::array<F, N> total{}, v{};
  for (std::uint32_t k = 0; k < T; ++k) {
    v.fill(k == 0 ? F(1) : F(0));
    // c_(k-1) last: the chain through the newest coefficient is one multiply-subtract per k.
    for (std::size_t i = std::min<std::size_t>(n - 1, k); i >= 1; --i)
      for (std::size_t j = 0; j < N; ++j) v[j] -= m[j][i] * c[j][k - i];
    for (std::size_t j = 0; j < N; ++j) {
      c[j][k] = v[j];
      total[j] += v[j] * v[j];
    }
  }
  return total;
}

// sum_j M_j^2 over j < horizon for a band n on the grid (M_j: the prefix sums of n 2^-kCoefBits), or infinity when
// a prefix leaves [0, 2] (monotone). Not inlined: inlined into the band search, GCC kept `var` in memory, and its
// additions took half of the search's time (perf). n_j 2^-kCoefBits is a product, exact as ldexp is for these
// integers.
[[gnu::noinline]] double band_variance(const std::vector<std::int64_t>& n, std::uint32_t horizon) {
  constexpr double kCoefUnit = 1.0 / static_cast<double>(std::int64_t{1} << kCoefBits);
  double acc = 0, var = 0;
  for (std::uint32_t j = 0; j < horizon; ++j) {
    if (j < n.size()) acc += static_cast<double>(n[j]) * kCoefUnit;
    if (acc < 0 || acc > 2) return std::numeric_limits<double>::infinity();
    var += acc * acc;
  }
  return var;
}

template <class F>
F inverse_norm_squared(const std::vector<std::int64_t>& band, std::uint32_t T) {
  return inverse_norms_squared<F, 1>({&band}, T)[0];
}
}  // namespace

BandedPlan::BandedPlan(std::vector<std::int64_t> band, double sigma) : m_(std::move(band)) {
  if (m_.empty() || m_.size() > kMaxBand || m_[0] != kOneCoef)
    throw std::invalid_argument("banded counter: need 1 to 16 coefficients with m_0 = 1");
  std::int64_t acc = 0;
  for (const std::int64_t v : m_) {
    if (v <= -(std::int64_t{4} << kCoefBits) || v >= (std::int64_t{4} << kCoefBits))
      throw std::invalid_argument("banded counter: a coefficient outside (-4, 4)");
    acc += v;
    if (acc < -(std::int64_t{2} << kCoefBits) || acc > (std::int64_t{2} << kCoefBits))
      throw std::invalid_argument("banded counter: a partial sum of the band outside [-2, 2]");
    cum_.push_back(acc);
  }
  abs_cum_.push_back(0);
  for (const std::int64_t m : cum_) abs_cum_.push_back(abs_cum_.back() + static_cast<std::uint64_t>(std::abs(m)));
  abs_tail_ = static_cast<std::uint64_t>(std::abs(cum_.back()));
  if (!(sigma >= 0x1p-20 && sigma <= 0x1p30))
    throw std::invalid_argument("banded counter: sigma " + std::to_string(sigma) + " outside [2^-20, 2^30]");
  sigma_num_ = static_cast<std::uint64_t>(std::ceil(std::ldexp(sigma, kSigmaBits)));  // exact: < 2^62
  if (m_.size() >= 2) ring_magic_ = ~std::uint64_t{0} / (m_.size() - 1) + 1;
  const std::size_t keep = m_.size() - 1;
  if (keep > 0 && cum_[keep] >= 0) {
    std::int64_t d = 0;  // < 15 x 2^32: no overflow
    for (std::size_t j = 0; j < keep && d >= 0; ++j) d = cum_[j] >= cum_[keep] ? d + (cum_[j] - cum_[keep]) : -1;
    dominance_sum_ = d;
  }
}

bool BandedPlan::monotone() const {
  return std::all_of(cum_.begin(), cum_.end(), [](std::int64_t m) { return m >= 0; });
}

double BandedPlan::sigma() const { return std::ldexp(static_cast<double>(sigma_num_), -kSigmaBits); }

double BandedPlan::variance_factor(std::uint32_t t) const {
  long double v = 0;
  for (std::uint32_t j = 0; j < t && j < cum_.size(); ++j) v += std::pow(static_cast<long double>(cum_[j]), 2);
  if (t > cum_.size())
    v += static_cast<long double>(t - cum_.size()) * std::pow(static_cast<long double>(cum_.back()), 2);
  return static_cast<double>(v / std::pow(static_cast<long double>(kOneCoef), 2));
}

double sensitivity_squared(const std::vector<std::int64_t>& band, std::uint32_t T) {
  if (T < 1 || T > kMaxSteps) throw std::invalid_argument("banded counter: horizon outside [1, 2^20]");
  const long double precise = inverse_norm_squared<long double>(band, T);
  const double rough = inverse_norm_squared<double>(band, T);
  if (!std::isfinite(precise) || std::abs(static_cast<long double>(rough) - precise) > 1e-9L * precise)
    throw std::domain_error("banded counter: the band's inverse is numerically unstable over the horizon");
  return static_cast<double>(precise * (1 + 1e-9L));
}

std::vector<std::int64_t> optimized_band(std::uint32_t T, std::size_t b) {
  if (b < 1 || b > kMaxBand) throw std::invalid_argument("banded counter: band width outside [1, 16]");
  const std::uint32_t horizon = std::min<std::uint32_t>(T, kMaxSearchHorizon);
  static std::mutex mutex;  // the search costs ~0.3 s; a job plans several times
  static std::map<std::pair<std::uint32_t, std::size_t>, std::vector<std::int64_t>> memo;
  const std::lock_guard lock(mutex);
  if (const auto it = memo.find({horizon, b}); it != memo.end()) return it->second;
  std::vector<double> m{1.0};  // m_0 = 1 (b >= 1)
  m.resize(b);
  for (std::size_t k = 1; k < b; ++k) m[k] = m[k - 1] * (static_cast<double>(k) - 1.5) / static_cast<double>(k);
  const auto grid = [](const std::vector<double>& v) {
    std::vector<std::int64_t> n(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) n[i] = std::llround(std::ldexp(v[i], kCoefBits));
    return n;
  };
  constexpr double kInfinite = std::numeric_limits<double>::infinity();
  const auto objective = [&](const std::vector<double>& v) {
    const auto n = grid(v);
    const double var = band_variance(n, horizon);
    if (!std::isfinite(var)) return kInfinite;
    const double sens = inverse_norm_squared<double>(n, horizon);
    return std::isfinite(sens) ? sens * var : kInfinite;
  };
  // objective() of two candidates, their sensitivities computed together: the same values.
  const auto objective_pair = [&](const std::vector<double>& first, const std::vector<double>& second) {
    const std::array<std::vector<std::int64_t>, 2> n{grid(first), grid(second)};
    const std::array<double, 2> var{band_variance(n[0], horizon), band_variance(n[1], horizon)};
    std::array<double, 2> f{kInfinite, kInfinite};
    if (!std::isfinite(var[0]) && !std::isfinite(var[1])) return f;
    const std::array<double, 2> sens = inverse_norms_squared<double, 2>({&n[0], &n[1]}, horizon);
    for (std::size_t j = 0; j < 2; ++j)
      if (std::isfinite(var[j]) && std::isfinite(sens[j])) f[j] = sens[j] * var[j];
    return f;
  };
  // Hooke-Jeeves pattern search: exploratory moves of +-step per coordinate, then pattern moves
  // along the last improvement while they pay, then half the step (a plain coordinate search needed
  // ~60k evaluations, 0.4 s, at T = 1000; this ~5k for the same objective within 1e-5).
  // A coordinate's move is +step if it improves, else -step if that does: both candidates are evaluated
  // together (objective_pair), the choice is the one a plain evaluation in that order makes.
  const auto explore = [&](std::vector<double> x, double& fx, double step) {
    for (std::size_t i = 1; i < b; ++i) {
      auto up = x, down = x;
      up[i] += step;
      down[i] -= step;
      const std::array<double, 2> f = objective_pair(up, down);
      if (f[0] < fx)
        fx = f[0], x = std::move(up);
      else if (f[1] < fx)
        fx = f[1], x = std::move(down);
    }
    return x;
  };
  double best = objective(m);
  for (double step = 0.125; step >= 0x1p-16; step /= 2) {
    for (;;) {
      double f = best;
      auto next = explore(m, f, step);
      if (!(f < best)) break;
      auto base = std::exchange(m, std::move(next));
      best = f;
      for (;;) {  // pattern moves: from m, go on by m - base and explore there
        std::vector<double> pattern(b);
        for (std::size_t i = 0; i < b; ++i) pattern[i] = 2 * m[i] - base[i];
        double fp = objective(pattern);
        auto moved = explore(std::move(pattern), fp, step);
        if (!(fp < best)) break;
        base = std::exchange(m, std::move(moved));
        best = fp;
      }
    }
  }
  return memo[{horizon, b}] = grid(m);
}

absl::InlinedVector<PrefixBlock, 32> prefix_blocks(std::uint32_t p) {
  if (p > kMaxSteps) throw std::invalid_argument("banded counter: a blocked prefix beyond 2^20 steps");
  absl::InlinedVector<PrefixBlock, 32> blocks;
  std::uint32_t covered = 0;  // a multiple of 4^level below: every block is aligned
  for (std::uint32_t level = kMaxBlockLevel + 1; level-- > 0;)
    for (const std::uint32_t size = 1u << (2 * level); p - covered >= size; covered += size)
      blocks.push_back({level, covered >> (2 * level)});
  return blocks;
}

// The blocked steps' ring slots hold zeros: as the first b - 1 pushes take them out of the ring they add
// nothing to older_, which holds their blocks already.
void BandedNoise::start_blocked(const BandedPlan& plan, std::uint32_t p, int128 blocks_kept, const std::int64_t* ring) {
  const std::size_t keep = plan.band() - 1;
  if (at_ != 0) throw std::logic_error("banded counter: a blocked prefix starts a fresh counter");
  if (p == 0 || p + keep > kMaxSteps)
    throw std::invalid_argument("banded counter: a blocked prefix of 0 or beyond 2^20");
  at_ = p;
  blocked_ = p;
  older_ = blocks_kept;
  recent_.assign(keep, 0);
  for (std::size_t i = 0; i < keep; ++i) push(plan, ring[i]);
}

void BandedNoise::push(const BandedPlan& plan, std::int64_t kept) {
  if (at_ >= kMaxSteps) throw std::length_error("banded counter: step beyond 2^20");
  ++at_;
  if (plan.band() == 1) {
    older_ += kept;
    return;
  }
  std::int64_t& slot = recent_slot(plan, at_);
  if (at_ > plan.band() - 1) older_ += slot;  // step at - keep leaves the band
  slot = kept;
}

// With a full ring and n >= b - 1: the steps leaving the band are the ring's b - 1 and z[0 .. n - b + 1),
// and the ring ends with the last b - 1 of z.
// Before that, the ring's first turn goes one step at a time; only its steps: a key's first test pushes its
// whole prefix from step 0 (a third of key selection's draws), and push() costs twice the bulk path a step.
void BandedNoise::push_all(const BandedPlan& plan, const std::int64_t* z, std::size_t n) {
  const std::size_t keep = plan.band() - 1;
  for (; n > 0 && keep > 0 && at_ < keep; ++z, --n) push(plan, *z);
  if (keep == 0 || n < keep) {
    for (std::size_t i = 0; i < n; ++i) push(plan, z[i]);
    return;
  }
  if (at_ + n > kMaxSteps) throw std::length_error("banded counter: step beyond 2^20");
  int128 older = older_;
  for (const std::int64_t r : recent_) older += r;
  for (std::size_t i = 0; i < n - keep; ++i) older += z[i];
  for (std::size_t i = 0; i < keep; ++i)
    recent_[plan.ring_slot(static_cast<std::uint32_t>(at_ + n - keep + i + 1))] = z[n - keep + i];
  older_ = older;
  at_ += static_cast<std::uint32_t>(n);
}

// With a full ring: wd holds Z~ of steps at - keep + 1 .. at + n in order, so the recent terms of
// step at + k + 1 are wd[k + 1 .. k + keep], the newest last. The running sum of the steps that left
// the band goes on in a double od: each addition rounds once and each sample converts once (each
// within 2^-53 of its magnitude), so |od - older| <= drift with drift grown by 2^-52 (|od| + |sample|)
// a step; its term adds |M_(b-1)| drift to prefix_interval's error, whose other terms are unchanged.
// Built for AVX2 as well (common/simd_clones.hpp): a fifth of key selection's instructions run here.
DPSTREAM_AVX2_CLONES void BandedNoise::intervals_ahead(const BandedPlan& plan, std::int64_t q, const std::int64_t* z,
                                                       std::size_t n, std::vector<NoiseEdges>& out) const {
  const double scale = grid_scale(plan, q);
  out.resize(n);
  const std::size_t keep = plan.band() - 1;
  std::size_t done = 0;
  BandedNoise partial;  // band 1 and the ring's first turn: step by step on a copy
  const BandedNoise* base = this;
  if (keep == 0 || at_ < keep) {
    partial = *this;
    base = &partial;
    for (; done < n && (keep == 0 || partial.at_ < keep); ++done) {
      partial.push(plan, z[done]);
      out[done] = partial.prefix_edges(plan, q);
    }
  }
  if (done == n) return;
  if (base->at_ + (n - done) > kMaxSteps) throw std::length_error("banded counter: step beyond 2^20");
  const std::size_t m = n - done;
  thread_local std::vector<double> wd, y, magnitude, bound;
  wd.resize(keep + m), y.resize(m), magnitude.resize(m), bound.resize(m);
  std::size_t slot = plan.ring_slot(base->at_ - static_cast<std::uint32_t>(keep) + 1);  // the oldest step's
  for (std::size_t k = 0; k < keep; ++k) {
    wd[k] = static_cast<double>(base->recent_[slot]);
    slot = slot + 1 == keep ? 0 : slot + 1;
  }
  for (std::size_t k = 0; k < m; ++k) wd[keep + k] = static_cast<double>(z[done + k]);
  const double tail = static_cast<double>(plan.cumulative(static_cast<std::uint32_t>(keep))), abs_tail = std::abs(tail);
  // A_t of the steps ahead (t >= b: A grows by |M_(b-1)| a step), an integer below 2^51: exact in doubles,
  // and no 64-bit unsigned conversion per step (a dozen instructions each without AVX-512).
  const auto first = static_cast<std::uint32_t>(base->at_ + 1);
  double a = static_cast<double>(plan.abs_cumulative_sum(first));
  const double a_step = static_cast<double>(plan.abs_cumulative_sum(first + 1) - plan.abs_cumulative_sum(first));
  double od = to_double(base->older_), e = std::abs(od) * 0x1p-52;
  for (std::size_t k = 0; k < m; ++k) {  // step at + k + 1: step at + k + 1 - keep leaves the band
    od += wd[k];
    e += (std::abs(od) + std::abs(wd[k])) * 0x1p-52;
    y[k] = tail * od;
    magnitude[k] = std::abs(y[k]);
    bound[k] = a + abs_tail * e;  // the error bound but for the terms' roundings (their magnitude, below)
    a += a_step;
  }
  for (std::size_t j = 0; j < keep; ++j) {  // M_j Z~ of step at + k + 1 - j, for every k at once
    const double mj = static_cast<double>(plan.cumulative(static_cast<std::uint32_t>(j)));
    const double* zj = wd.data() + keep - j;
    for (std::size_t k = 0; k < m; ++k) {
      const double term = mj * zj[k];
      y[k] += term;
      magnitude[k] += std::abs(term);
    }
  }
  for (std::size_t k = 0; k < m; ++k) out[done + k] = rounded_edges(scale, y[k], bound[k] + magnitude[k] * 0x1p-43);
}

// With D_j = M_j - M_K >= 0 (K = b - 1; dominated()) and S_t the running sum of every Z~ up to step t, the
// estimate at step t is y_t = M_K S_t + sum_{j < K} D_j Z~_(t-j) (units 2^-86), so over the run
//   M_K min S + D min(0, min Z~) <= y_t <= M_K max S + D max(0, max Z~),   D = sum_j D_j,
// the extremes of Z~ taken over the ring and the run (every Z~ a step's terms read). S over the run is S_at
// (the running sum older_ plus the ring) plus the run's partial sums, kept exactly as sums of Z~ >> 8 (floor:
// Z~ = 256 (Z~ >> 8) + r, 0 <= r < 256, so a sum of k of them lies in [256 P', 256 P' + 255 k]; |P'| < 2^63 for
// n <= 255). The true noise's estimate differs from y_t by at most A_t = abs_cumulative_sum(t), largest at the
// run's last step. Every int128 stays below 2^116. The doubles: the estimate's conversion and the product with
// the grid's scale (itself up to two roundings) err by at most 4 x 2^-53 relative, covered by 2^-50 of the
// magnitude; the rounding of q N to the grid by 1 (> 1/2).
NoiseEdges BandedNoise::run_bounds(const BandedPlan& plan, std::int64_t q, const std::int64_t* kept,
                                   std::size_t n) const {
  const std::size_t keep = plan.band() - 1;
  if (n == 0 || n > kMaxRunBound || keep == 0 || at_ < keep || recent_.size() != keep || !plan.dominated() ||
      at_ + n > kMaxSteps)
    return {};
  int128 s = int128(older_);
  std::int64_t z_max = 0, z_min = 0;  // already max(0, .) and min(0, .)
  for (std::size_t k = 0; k < keep; ++k) {
    const std::int64_t z = recent_[k];
    s += z;
    z_max = std::max(z_max, z), z_min = std::min(z_min, z);
  }
  const RunExtremes run = run_extremes(kept, n);
  const std::int64_t p_max = run.p_max, p_min = run.p_min;
  z_max = std::max(z_max, run.z_max), z_min = std::min(z_min, run.z_min);
  const int128 tail = plan.cumulative(static_cast<std::uint32_t>(keep)), d = plan.dominance_sum();
  const int128 kept_error = plan.abs_cumulative_sum(static_cast<std::uint32_t>(at_ + n));
  const int128 s_max = s + int128{p_max} * 256 + int128{255} * static_cast<std::int64_t>(n),
               s_min = s + int128{p_min} * 256;
  const int128 y_max = tail * s_max + d * z_max + kept_error, y_min = tail * s_min + d * z_min - kept_error;
  const double scale = grid_scale(plan, q);
  const double hi = scale * to_double(y_max), lo = scale * to_double(y_min);
  const NoiseEdges e{lo - std::abs(lo) * 0x1p-50 - 1, hi + std::abs(hi) * 0x1p-50 + 1};
  if (!(std::abs(e.below) < 0x1p50 && std::abs(e.above) < 0x1p50)) return {};
  return e;
}

NoiseInterval NoiseEdges::interval() const {
  if (!(std::abs(below) < 0x1p50 && std::abs(above) < 0x1p50)) return {};  // NaN, or beyond rounded_edges' range
  return {floor_to_int(below) - 1, ceil_to_int(above) + 1};
}

int128 BandedNoise::estimate_units(const BandedPlan& plan) const {
  // |older| < 2^20 2^63 (Z~ is an int64), |M| <= 2^31 units: each term < 2^114, b <= 16 terms < 2^118.
  const std::size_t keep = plan.band() - 1;
  int128 y = static_cast<int128>(plan.cumulative(static_cast<std::uint32_t>(keep))) * int128(older_);
  for_each_recent(plan, [&](std::int64_t m, std::int64_t z) { y += static_cast<int128>(m) * z; });
  return y;
}

// Double: v = sigma q Y~ with relative error < 2^-50 (four roundings; the power-of-two scaling is
// exact), w >= sigma q A. Every value of the interval rounds to round(v) when v is farther than
// w + |v| 2^-48 + 2^-40 from the nearest rounding boundary (a half-integer); else the exact path.
std::optional<int128> BandedNoise::fast_prefix_noise(const BandedPlan& plan, std::int64_t q) const {
  const double scale = grid_scale(plan, q);
  if (at_ == 0) return int128{0};
  const double v = scale * static_cast<double>(estimate_units(plan));
  const double w = scale * static_cast<double>(plan.abs_cumulative_sum(at_)) * (1 + 0x1p-48);  // exact conversion
  if (!(std::abs(v) < 0x1p50)) return std::nullopt;
  const double r = v >= 0 ? std::floor(v + 0.5) : -std::floor(-v + 0.5);  // ties away; a wrong r fails the margin
  if (0.5 - std::abs(v - r) > w + std::abs(v) * 0x1p-48 + 0x1p-40)
    return static_cast<int128>(static_cast<std::int64_t>(r));
  return std::nullopt;
}

// With S = sum |M_j Z~_j| (units 2^-86): the double sum y is within (b + 3) 2^-53 S < 2^-45 S of Y~
// (the running sum converts with one rounding; every product and sum rounds once), scale within
// 2^-52 of sigma q 2^-118, so sigma q Y~ 2^-118 is within scale 2^-43 S of v; the true value within
// scale A more, and the rounding moves it by 1/2. The bounds' own roundings are inside the final +-1.
NoiseEdges BandedNoise::prefix_edges(const BandedPlan& plan, std::int64_t q) const {
  const double scale = grid_scale(plan, q);
  if (at_ == 0) return {1, -1};  // the interval [0, 0]: no noise yet
  const std::size_t keep = plan.band() - 1;
  double y = static_cast<double>(plan.cumulative(static_cast<std::uint32_t>(keep))) * to_double(older_);
  double magnitude = std::abs(y);
  for_each_recent(plan, [&](std::int64_t m, std::int64_t z) {
    const double term = static_cast<double>(m) * static_cast<double>(z);
    y += term;
    magnitude += std::abs(term);
  });
  return rounded_edges(scale, y, static_cast<double>(plan.abs_cumulative_sum(at_)) + magnitude * 0x1p-43);
}

// N q = sigma q Y, Y in (Y~ - A, Y~ + A) with Y~ = estimate and A = sum |M_j| (units 2^-86).
int128 BandedNoise::interval_prefix_noise(const BandedPlan& plan, std::int64_t q, const Draw& redraw,
                                          const DrawBlock& redraw_block) const {
  const mp::cpp_int scale = mp::cpp_int(plan.sigma_numerator()) * q;  // sigma q, units 2^-32
  const mp::cpp_int y = to_cpp(estimate_units(plan));
  const mp::cpp_int a = plan.abs_cumulative_sum(at_);
  constexpr unsigned kShift = kKeptBits + kCoefBits + kSigmaBits;
  if (const auto r = rounding_of_interval(scale, y, a, kShift)) return *r;
  return exact_prefix_noise(plan, q, at_, redraw, blocked_, redraw_block);
}

// A blocked step r <= blocked has t - r >= b - 1: its coefficient is M_(b-1), and its block's 2^L zeta enters once.
int128 exact_prefix_noise(const BandedPlan& plan, std::int64_t q, std::uint32_t t, const BandedNoise::Draw& redraw,
                          std::uint32_t blocked, const BandedNoise::DrawBlock& redraw_block) {
  const std::uint32_t keep = static_cast<std::uint32_t>(plan.band()) - 1;
  if (blocked > 0 && (!redraw_block || t < blocked + keep))
    throw std::logic_error("banded counter: a blocked prefix needs its blocks and t >= blocked + b - 1");
  const auto blocks = prefix_blocks(blocked);
  const mp::cpp_int scale = mp::cpp_int(plan.sigma_numerator()) * q;
  const mp::cpp_int a = plan.abs_cumulative_sum(t);
  for (std::size_t words = 2; words <= 64; ++words) {
    const unsigned frac = static_cast<unsigned>(64 * words);
    const auto value = [&](const noise::NormalSample& z) {  // z in units 2^-frac
      mp::cpp_int v = mp::cpp_int(z.k) << frac;
      for (std::size_t w = 0; w < words; ++w) v += mp::cpp_int(z.fraction.at(w)) << (frac - 64 * (w + 1));
      return z.negative ? mp::cpp_int(-v) : v;
    };
    mp::cpp_int y = 0;
    for (std::uint32_t r = blocked + 1; r <= t; ++r) y += value(redraw(r - 1, words)) * plan.cumulative(t - r);
    for (const PrefixBlock& blk : blocks)
      y += (value(redraw_block(blk.level, blk.index, words)) << blk.level) * plan.cumulative(keep);
    const unsigned shift = frac + kCoefBits + kSigmaBits;
    if (const auto r = rounding_of_interval(scale, y, a, shift)) return *r;
  }
  throw std::range_error("banded counter: the rounding is undecided after 4096 bits per sample");
}

namespace {
RunExtremes run_extremes_scalar(const std::int64_t* z, std::size_t n) {
  RunExtremes e;
  std::int64_t p = 0;
  for (std::size_t k = 0; k < n; ++k) {
    p += z[k] >> 8;  // arithmetic shift: floor(z / 256)
    e.p_max = std::max(e.p_max, p), e.p_min = std::min(e.p_min, p);
    e.z_max = std::max(e.z_max, z[k]), e.z_min = std::min(e.z_min, z[k]);
  }
  return e;
}

#if DPSTREAM_HAVE_AVX512_CODE
// GCC 12's unmasked AVX-512 intrinsics pass _mm512_undefined_epi32() as the masked-off source, which
// -Wmaybe-uninitialized reports at every call; every lane here is written.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// Eight samples a step: their partial sums by an inclusive scan in the register (lane i gains lane i - 1,
// then i - 2, then i - 4) plus the sum so far in every lane. The last step's lanes past n load as 0: each
// repeats the last partial sum and adds a sample of 0, which change no extreme (the samples' start at 0).
DPSTREAM_AVX512_TARGET RunExtremes run_extremes_avx512(const std::int64_t* z, std::size_t n) {
  const __m512i zero = _mm512_setzero_si512();
  __m512i p_max = _mm512_set1_epi64(std::numeric_limits<std::int64_t>::min());
  __m512i p_min = _mm512_set1_epi64(std::numeric_limits<std::int64_t>::max());
  __m512i z_max = zero, z_min = zero, carry = zero;
  const __m512i last_lane = _mm512_set1_epi64(7);
  for (std::size_t k = 0; k < n; k += 8) {
    const auto mask = static_cast<__mmask8>(n - k >= 8 ? 0xff : (1u << (n - k)) - 1);
    const __m512i x = _mm512_maskz_loadu_epi64(mask, z + k);
    __m512i p = _mm512_srai_epi64(x, 8);
    p = _mm512_add_epi64(p, _mm512_alignr_epi64(p, zero, 7));
    p = _mm512_add_epi64(p, _mm512_alignr_epi64(p, zero, 6));
    p = _mm512_add_epi64(p, _mm512_alignr_epi64(p, zero, 4));
    p = _mm512_add_epi64(p, carry);
    carry = _mm512_permutexvar_epi64(last_lane, p);
    p_max = _mm512_max_epi64(p_max, p), p_min = _mm512_min_epi64(p_min, p);
    z_max = _mm512_max_epi64(z_max, x), z_min = _mm512_min_epi64(z_min, x);
  }
  alignas(64) std::array<std::int64_t, 32> lanes{};  // each vector's lanes, folded below (no target attribute needed)
  _mm512_store_si512(lanes.data(), p_max);
  _mm512_store_si512(lanes.data() + 8, p_min);
  _mm512_store_si512(lanes.data() + 16, z_max);
  _mm512_store_si512(lanes.data() + 24, z_min);
  const auto part = [&](std::size_t i) { return lanes.begin() + static_cast<std::ptrdiff_t>(8 * i); };
  return {*std::max_element(part(0), part(1)), *std::min_element(part(1), part(2)), *std::max_element(part(2), part(3)),
          *std::min_element(part(3), part(4))};
}
#pragma GCC diagnostic pop
#endif
}  // namespace

RunExtremes run_extremes(const std::int64_t* z, std::size_t n, RunPath path) {
  static const bool avx512 = noise::cpu_runs_avx512f();
  if (path == RunPath::Best) path = avx512 && DPSTREAM_HAVE_AVX512_CODE ? RunPath::Avx512 : RunPath::Scalar;
  if (path == RunPath::Scalar) return run_extremes_scalar(z, n);
#if DPSTREAM_HAVE_AVX512_CODE
  if (avx512) return run_extremes_avx512(z, n);
#endif
  throw std::invalid_argument("run_extremes: this CPU has no AVX-512F");
}

}  // namespace dpstream::kernels::banded
