#include "src/zipf.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace dpstream {

namespace {
// The table stays in L2 next to the generator's other traffic (96 KB): 2^16 values (1.3 MB, 87% of the
// paper's key draws) made the synthetic input 20% slower than no table, 2^12 (51% of them) 5-8% faster.
constexpr std::size_t kCertifiedValues = std::size_t{1} << 12;
constexpr std::size_t kMaxGuideCells = std::size_t{1} << 13;
// 2^-44 = 256 eps (eps = 2^-52): the error bounds below count a few roundings of eps each.
constexpr double kErrorScale = 0x1p-44;
// The original form is kept while the most likely value's interval of u holds at least this many doubles
// (zipf.hpp): lo's probability resolved to 2^-16 relative or better. The paper's record counts (q = 26,
// s = 6.738, lo = 1) have 5.7e6 (2^22.4), its keys (q = 1000, s = 1.4) 1.1e11; s = 6.738 reaches the
// threshold at q ~ 50, and q = 300 has half a double (the sampler returned 1, 35 or 103 at q = 500).
constexpr double kMinModeLevels = 0x1p16;

// (exp(t) - 1) / t and log(1 + t) / t, accurate near t = 0 (the s -> 1 limit).
double expm1_over(double t) { return std::abs(t) > 1e-8 ? std::expm1(t) / t : 1.0 + t / 2.0 * (1.0 + t / 3.0); }
double log1p_over(double t) { return std::abs(t) > 1e-8 ? std::log1p(t) / t : 1.0 - t * (0.5 - t / 3.0); }
}  // namespace

ZipfMandelbrot::ZipfMandelbrot(std::uint64_t lo, std::uint64_t hi, double q, double s)
    : lo_(static_cast<double>(lo)), hi_(static_cast<double>(hi)), q_(q), s_(s) {
  if (lo > hi) throw std::invalid_argument("ZipfMandelbrot: empty support (lo > hi)");
  if (!(s > 0) || !std::isfinite(s)) throw std::invalid_argument("ZipfMandelbrot: exponent s must be finite and > 0");
  if (!(lo_ + q_ > 0.5) || !std::isfinite(q)) throw std::invalid_argument("ZipfMandelbrot: need lo + q > 1/2");
  h_integral_lo_ = h_integral(lo_ + 0.5) - h(lo_);
  h_integral_hi_ = h_integral(hi_ + 0.5);
  // The original form's resolution at the mode lo (h decreases): h(lo) over the spacing of the doubles
  // near H(lo + 1/2), the width of lo's interval of u in doubles. NaN or 0 (h underflows) also switch.
  const double mode_levels = h(lo_) / (std::numeric_limits<double>::epsilon() *
                                       std::max(std::abs(h_integral_lo_), std::abs(h_integral(lo_ + 0.5))));
  if (!(mode_levels >= kMinModeLevels)) {
    rescaled_ = true;
    c_ = lo_ + q_;
    h_integral_lo_ = h_integral(lo_ + 0.5) - h(lo_);
    h_integral_hi_ = h_integral(hi_ + 0.5);
  }
  s_const_ = lo_ + 1.0 - h_integral_inverse(h_integral(lo_ + 1.5) - h(lo_ + 1.0));
  build_certified_table();
}

// h_integral_inverse computes t = u (1 - s), y = log1p(t) / t * u = log(x + q) and x = exp(y) - q. Rounding t
// moves y by |u| eps / (1 + t) = |u| eps (x + q)^(s - 1); log1p, the division and the product add a few eps |y|;
// exp turns y's error into a relative one of x + q and adds its own eps; subtracting q rounds at the scale of
// |x| (far above x + q when q < 0), and so do the step's x + 1/2, k - x and the table's k +- 1/2 +- e, hence the
// last term (without it, q = 1 - lo with lo = 10^4 certified values the step rejects: a review's counterexample).
//
// Rescaled (c = lo + q, y = (x + q) / c, L = log y): t = u (1 - s) / c (two roundings: 2 eps |t|),
// w = log1p(t) / t * (u / c) = L and x = lo + c expm1(w). t's rounding moves w by 2 eps |u / c| y^(s - 1) (the
// same derivative as above; in x, times x + q = c y: 2 eps |u| y^s = 2 eps |H| / h), log1p, the division,
// u / c and the product a few eps |L| (times x + q in x, bounded by |x - lo| + c); expm1 and the product by c
// round at the scale of |x - lo|, adding lo and the step's x + 1/2, k - x and the table's k +- 1/2 +- e at
// the scale of |x|. Near lo, L is near 0, so no term grows with q: the form's point.
double ZipfMandelbrot::inverse_error(double x) const {
  if (rescaled_) {
    return kErrorScale * (2.0 * std::abs(h_integral(x)) / h(x) + 8.0 * (std::abs(x - lo_) + c_) * std::abs(log_y(x)) +
                          4.0 * (std::abs(x) + std::abs(x - lo_)) + 4.0);
  }
  const double xq = x + q_;
  return kErrorScale * (xq * (std::abs(h_integral(x)) * std::pow(xq, s_ - 1.0) + 4.0 * std::abs(std::log(xq)) + 4.0) +
                        4.0 * (std::abs(x) + std::abs(q_)));
}

// h_integral computes lx = log(x + q) (x + q rounded: eps (x + q) h(x) on H; log: eps |lx|), a = (1 - s) lx
// and expm1(a) / a * lx, whose relative error is |a| + 1 times lx's plus a few eps.
//
// Rescaled: d = (x - lo) / c (two roundings: 2 eps |d|), L = log1p(d) (off by 2 eps |d| / (1 + d) + eps |L|),
// a = (1 - s) L and c expm1(a) / a * L: L's error times dH/dL = c e^a = c expm1_over(a) (a + ...) <=
// c expm1_over(a) (|a| + 1), plus a few eps of H for expm1, the division and the two products.
double ZipfMandelbrot::integral_error(double x) const {
  if (rescaled_) {
    const double d = (x - lo_) / c_;
    const double lx = std::log1p(d);
    const double a = (1.0 - s_) * lx;
    const double log_error = 2.0 * std::abs(d) / (1.0 + d) + std::abs(lx);
    return kErrorScale * (c_ * expm1_over(a) * (std::abs(a) + 1.0) * 4.0 * log_error + 8.0 * std::abs(h_integral(x)));
  }
  const double lx = std::log(x + q_);
  return kErrorScale * (std::abs(h_integral(x)) * (std::abs((1.0 - s_) * lx) + 4.0) + (x + q_) * h(x));
}

// Value k's certified interval: every double u in it makes exact_step(u) return k. With x = H^-1(u) exact and
// x~ the computed one (|x~ - x| < e, inverse_error), k is the rounded value where k - 1/2 + e <= x <= k + 1/2 - e,
// i.e. u in [H(k - 1/2 + e), H(k + 1/2 - e)], each end moved inwards by H's own error (integral_error). The step
// accepts there when s_const >= 1/2 (then k - x~ <= 1/2 <= s_const), else where x >= k - s_const + e or
// u >= h_integral(k + 1/2) - h(k), the step's own bound computed by the same calls (compared exactly).
// The table stops at the first value whose bounds are not small and finite (far in a steep tail).
void ZipfMandelbrot::build_certified_table() {
  const double last = std::min(hi_, lo_ + static_cast<double>(kCertifiedValues - 1));
  double below_error = inverse_error(lo_ - 0.5);
  for (double k = lo_; k <= last; k += 1.0) {
    const double above_error = inverse_error(k + 0.5);
    if (!(below_error < 0.25 && above_error < 0.25)) break;
    const double right = h_integral(k + 0.5 - above_error) - integral_error(k + 0.5);
    double left = h_integral(k - 0.5 + below_error) + integral_error(k - 0.5);
    if (s_const_ < 0.5) {
      const double x_accepts = k - s_const_ + inverse_error(k - s_const_);
      left = std::max(left, std::min(h_integral(k + 0.5) - h(k), h_integral(x_accepts) + integral_error(x_accepts)));
    }
    // Disjoint and increasing (what the lookup's scan relies on to stop at u's own interval).
    if (!std::isfinite(left) || !std::isfinite(right) || !(left <= right) ||
        (!interval_.empty() && !(left > interval_.back().right)))
      break;
    interval_.push_back({right, left});
    below_error = above_error;
  }
  if (interval_.empty()) return;
  table_first_ = interval_.front().left;
  table_last_ = interval_.back().right;
  const std::size_t cells = std::min(kMaxGuideCells, 2 * std::bit_ceil(interval_.size()));
  guide_.assign(cells, 0);
  guide_scale_ = table_last_ > table_first_ ? static_cast<double>(cells) / (table_last_ - table_first_) : 0.0;
  // A lookup is right whatever the guide says (it returns only u's own certified interval); a good guide is fast.
  std::uint32_t i = 0;
  for (std::size_t c = 1; c < cells && guide_scale_ > 0.0; ++c) {
    const double start = table_first_ + static_cast<double>(c) / guide_scale_;
    while (i + 1 < interval_.size() && interval_[i].right < start) ++i;
    guide_[c] = i;
  }
}

// The original form's operations are exactly the ones that defined the stream before the rescaled form.
double ZipfMandelbrot::log_y(double x) const { return rescaled_ ? std::log1p((x - lo_) / c_) : std::log(x + q_); }

double ZipfMandelbrot::h(double x) const { return std::exp(-s_ * log_y(x)); }

double ZipfMandelbrot::h_integral(double x) const {
  const double lx = log_y(x);
  const double integral = expm1_over((1.0 - s_) * lx) * lx;
  return rescaled_ ? c_ * integral : integral;
}

double ZipfMandelbrot::h_integral_inverse(double u) const {
  if (rescaled_) {
    double t = u * (1.0 - s_) / c_;
    if (t < -1.0) t = -1.0;
    return lo_ + c_ * std::expm1(log1p_over(t) * (u / c_));
  }
  double t = u * (1.0 - s_);
  if (t < -1.0) t = -1.0;  // rounding guard at the lower end of the support
  return std::exp(log1p_over(t) * u) - q_;
}

double ZipfMandelbrot::normalizer() const {
  double z = 0.0;
  for (double x = hi_; x >= lo_; x -= 1.0) z += h(x);  // smallest terms first
  return z;
}

double ZipfMandelbrot::pmf(std::uint64_t x) const {
  const double xd = static_cast<double>(x);
  if (xd < lo_ || xd > hi_) return 0.0;
  return h(xd) / normalizer();
}

double ZipfMandelbrot::expected_distinct(double draws) const {
  // sum over runs [x, x + n): n f(x + (n - 1) / 2), n = max(1, floor(x / 1000)).
  const auto sum_runs = [&](auto&& f) {
    double total = 0.0;
    for (double x = lo_; x <= hi_;) {
      const double n = std::min(std::max(1.0, std::floor(x / 1000.0)), hi_ - x + 1.0);
      total += n * f(x + (n - 1.0) / 2.0);
      x += n;
    }
    return total;
  };
  const double z = sum_runs([&](double x) { return h(x); });
  return sum_runs([&](double x) { return -std::expm1(draws * std::log1p(-h(x) / z)); });  // 1 - (1 - p)^n
}

double ZipfMandelbrot::mean_of_min(double shift, double cap) const {
  double z = 0.0, m = 0.0;
  for (double x = hi_; x >= lo_; x -= 1.0) {
    z += h(x);
    m += std::min(x + shift, cap) * h(x);
  }
  return m / z;
}

double ZipfMandelbrot::mean() const { return mean_of_min(0.0, std::numeric_limits<double>::infinity()); }

}  // namespace dpstream
