// Zipf-Mandelbrot distribution on the integers {lo..hi}: P[X = x] proportional to (x + q)^-s.
// Sampled by rejection-inversion (Hoermann & Derflinger 1996): O(1) expected time for any support
// size, so it serves both 1e5 record counts and billion-key supports. The first values also have a
// table of certified intervals of the inversion's argument u, which returns what the inversion step
// would without its exp and log1p (docs/PERFORMANCE.md, synthetic generation).
//
// Two forms of h and H (rejection-inversion works with any positive multiple of h and its integral,
// shifted by any constant). The original one, h(x) = (x + q)^-s and H(x) = ((x + q)^(1-s) - 1) / (1-s),
// defines the stream wherever it resolves the distribution. When (x + q)^(1-s) is tiny next to 1
// (large q and/or large s) or x + q is huge next to the support (q >> hi - lo), that H is constant to the
// last bits over the support and the sampler collapses onto a few values. The constructor then switches to
// the rescaled form about c = lo + q: with y = (x + q) / c = 1 + (x - lo) / c, h(x) = y^-s and
// H(x) = c (y^(1-s) - 1) / (1-s), log y taken as log1p((x - lo) / c). The switch: fewer than
// kMinModeLevels (2^16) doubles of u in the original form's interval of the most likely value lo,
// [H(lo + 1/2) - h(lo), H(lo + 1/2)], i.e. lo's probability resolved to worse than 2^-16 relative.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

namespace dpstream {

class ZipfMandelbrot {
 public:
  // Requires lo <= hi, s > 0, lo + q > 0.5 (h must be positive on [lo - 1/2, hi + 1/2]).
  ZipfMandelbrot(std::uint64_t lo, std::uint64_t hi, double q, double s);

  // `uniform` is a function returning doubles on [0, 1).
  template <class Uniform>
  std::uint64_t sample(Uniform&& uniform) const {
    for (;;) {
      const double u = h_integral_hi_ + uniform() * (h_integral_lo_ - h_integral_hi_);
      if (const std::uint64_t k = certified_step(u); k != kUncertified) return k;
      if (const auto k = exact_step(u)) return *k;
    }
  }

  // One rejection-inversion step at u: the value, or nothing when the step rejects. Defines the stream.
  std::optional<std::uint64_t> exact_step(double u) const {
    const double x = h_integral_inverse(u);
    // floor(x + 0.5) for x > 0 (Hoermann and Derflinger); lround would differ at x+0.5 rounding up and
    // change the stream. NOLINTNEXTLINE(bugprone-incorrect-roundings)
    double k = static_cast<double>(static_cast<std::int64_t>(x + 0.5));
    if (k < lo_) k = lo_;
    if (k > hi_) k = hi_;
    if (k - x <= s_const_ || u >= h_integral(k + 0.5) - h(k)) return static_cast<std::uint64_t>(k);
    return std::nullopt;
  }

  // exact_step(u)'s value where u lies in a certified interval (exact_step accepts that value there,
  // with room for the libm functions' error), else kUncertified: a table lookup, no exp or log.
  static constexpr std::uint64_t kUncertified = std::numeric_limits<std::uint64_t>::max();
  std::uint64_t certified_step(double u) const {
    if (!(u >= table_first_ && u <= table_last_)) return kUncertified;  // also NaN
    const auto cell = static_cast<std::size_t>((u - table_first_) * guide_scale_);
    std::uint32_t i = guide_[cell < guide_.size() ? cell : guide_.size() - 1];
    while (interval_[i].right < u) ++i;  // stops: u <= table_last_, the last interval's right end
    return u >= interval_[i].left ? static_cast<std::uint64_t>(lo_) + i : kUncertified;
  }
  std::size_t certified_values() const { return interval_.size(); }
  // The certified interval [left, right] of value lo + i, i < certified_values() (tests).
  std::pair<double, double> certified_interval(std::size_t i) const { return {interval_[i].left, interval_[i].right}; }
  // sample()'s u runs over [first, second] (tests).
  std::pair<double, double> argument_range() const { return {h_integral_lo_, h_integral_hi_}; }

  // Exact pmf and mean by direct summation (tests and reports; O(hi - lo)).
  double pmf(std::uint64_t x) const;
  double mean() const;
  // E[min(X + shift, cap)] by direct summation (O(hi - lo)).
  double mean_of_min(double shift, double cap) const;
  // Expected number of distinct values among `draws` independent samples, sum_x 1 - (1 - p_x)^draws,
  // by the midpoint rule over runs of x at most 1/1000 of x long (p varies by < 0.2% along one):
  // within 1e-6 relative of direct summation, in O(1000 log(hi / 1000)) steps (for table sizing).
  double expected_distinct(double draws) const;

  std::uint64_t lo() const { return static_cast<std::uint64_t>(lo_); }
  std::uint64_t hi() const { return static_cast<std::uint64_t>(hi_); }
  // True when the original form could not resolve the distribution and the rescaled one (about c = lo + q)
  // samples it (see the top of this file); false keeps the original stream.
  bool rescaled() const { return rescaled_; }

 private:
  // In the rescaled form each of h, H and H^-1 is the original one with x + q replaced by y = (x + q) / c
  // and H multiplied by c (c = 1 and y = x + q in the original form).
  double log_y(double x) const;               // log(x + q), or log1p((x - lo) / c) rescaled
  double h(double x) const;                   // y^-s
  double h_integral(double x) const;          // H(x) = c (y^(1-s) - 1) / (1 - s), c log(y) at s = 1
  double h_integral_inverse(double u) const;  // H^-1
  double normalizer() const;
  double inverse_error(double x) const;   // bounds |h_integral_inverse(u) - H^-1(u)| near H^-1(u) = x
  double integral_error(double x) const;  // bounds |h_integral(x) - H(x)|
  void build_certified_table();

  double lo_, hi_, q_, s_;
  bool rescaled_ = false;
  double c_ = 1.0;  // lo + q when rescaled
  double h_integral_lo_, h_integral_hi_, s_const_;
  // Certified intervals [left, right] of u for the values lo, lo + 1, ...: disjoint, increasing (H grows).
  // guide_[c] is the first value whose interval ends at or after the start of cell c (cells of equal width).
  struct Interval {
    double right, left;
  };
  std::vector<Interval> interval_;
  std::vector<std::uint32_t> guide_;
  double table_first_ = 1.0, table_last_ = 0.0, guide_scale_ = 0.0;  // an empty table certifies nothing
};

}  // namespace dpstream
