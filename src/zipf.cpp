#include "src/zipf.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace dpstream {

namespace {
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
  s_const_ = lo_ + 1.0 - h_integral_inverse(h_integral(lo_ + 1.5) - h(lo_ + 1.0));
}

double ZipfMandelbrot::h(double x) const { return std::exp(-s_ * std::log(x + q_)); }

double ZipfMandelbrot::h_integral(double x) const {
  const double lx = std::log(x + q_);
  return expm1_over((1.0 - s_) * lx) * lx;
}

double ZipfMandelbrot::h_integral_inverse(double u) const {
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
