#include "kernels/exact_normal.hpp"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace dpstream::noise {

namespace {
// A uniform deviate in (0, 1) whose base-2^64 digits are drawn only when a comparison needs them.
class Deviate {
 public:
  void reset() { digits_.clear(); }
  std::uint64_t digit(NodeStream& rng, std::size_t i) {
    while (digits_.size() <= i) digits_.push_back(rng.next_u64());
    return digits_[i];
  }
  // this < other, drawing digits of both until they differ (almost always at the first).
  bool less(NodeStream& rng, Deviate& other) {
    for (std::size_t i = 0;; ++i) {
      const std::uint64_t a = digit(rng, i), b = other.digit(rng, i);
      if (a != b) return a < b;
    }
  }
  bool below_half(NodeStream& rng) { return (digit(rng, 0) >> 63) == 0; }
  void swap(Deviate& other) noexcept { digits_.swap(other.digits_); }
  absl::InlinedVector<std::uint64_t, 2>& digits() { return digits_; }

 private:
  absl::InlinedVector<std::uint64_t, 2> digits_;
};

class AlgorithmN {
 public:
  explicit AlgorithmN(NodeStream& rng) : rng_(rng) {}

  NormalSample sample(std::size_t min_words) {
    std::uint32_t k = 0;
    for (;;) {
      k = geometric_half();                                                  // N1
      const std::uint64_t k64 = k;
      if (k64 > 1 && !exp_minus_half_power(k64 * (k64 - 1))) continue;        // N2: exp(-k(k-1)/2)
      x_.reset();                                                            // N3
      std::uint32_t j = 0;
      while (j <= k && algorithm_b(k)) ++j;                                  // N4: exp(-x(2k+x)/2)
      if (j > k) break;
    }
    NormalSample z;
    z.negative = rng_.next_bit();  // N5
    z.k = k;
    auto& d = x_.digits();
    while (d.size() < std::max<std::size_t>(min_words, 1)) d.push_back(rng_.next_u64());
    z.fraction.assign(d.begin(), d.end());
    return z;
  }

 private:
  // Algorithm H: true with probability exp(-1/2) (von Neumann: a decreasing run below 1/2 of even length).
  bool exp_minus_half() {
    p_.reset();
    if (!p_.below_half(rng_)) return true;
    for (;;) {
      q_.reset();
      if (!q_.less(rng_, p_)) return false;
      p_.reset();
      if (!p_.less(rng_, q_)) return true;
    }
  }
  // N1: n >= 0 with probability exp(-n/2) (1 - exp(-1/2)).
  std::uint32_t geometric_half() {
    std::uint32_t n = 0;
    while (exp_minus_half()) {
      if (++n == 0xffffffffu) throw std::range_error("normal sample: integer part out of range");
    }
    return n;
  }
  // true with probability exp(-n/2).
  bool exp_minus_half_power(std::uint64_t n) {
    while (n-- > 0)
      if (!exp_minus_half()) return false;
    return true;
  }
  // Algorithm C: -1, 0, +1 with probabilities 1/m, 1/m, 1 - 2/m.
  int three_way(std::uint64_t m) {
    const std::uint64_t u = rng_.uniform_below(m);
    return u == 0 ? -1 : (u == 1 ? 0 : 1);
  }
  // Algorithm B: true with probability exp(-x (2k + x) / (2k + 2)): a run z1 > z2 > ... below x, each
  // kept with probability (2k + x) / (2k + 2); true when the run has even length.
  bool algorithm_b(std::uint32_t k) {
    const std::uint64_t m = 2 * static_cast<std::uint64_t>(k) + 2;
    std::uint64_t n = 0;
    for (;; ++n) {
      int f = k == 0 ? three_way(m) : 0;  // for k = 0 the choice is made first (it ends the run half the time)
      if (f < 0) break;
      q_.reset();
      if (!q_.less(rng_, n == 0 ? x_ : p_)) break;
      if (k > 0) f = three_way(m);
      if (f < 0) break;
      if (f == 0) {  // keep with probability x: a fresh deviate below x
        p_.reset();
        if (!p_.less(rng_, x_)) break;
      }
      p_.swap(q_);  // the run's last element
    }
    return n % 2 == 0;
  }

  NodeStream& rng_;
  Deviate x_, p_, q_;
};
}  // namespace

NormalSample sample_normal(NodeStream& rng, std::size_t min_words) { return AlgorithmN(rng).sample(min_words); }

int128 normal_fixed64(const NormalSample& z) {
  if (z.k >= (1u << 30)) throw std::range_error("normal sample: integer part too large for fixed point");
  const int128 v = (int128{z.k} << 64) + int128{z.fraction.at(0)};
  return z.negative ? -v : v;
}

}  // namespace dpstream::noise
