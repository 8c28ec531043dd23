// Binary-tree aggregation (DP-SQLP Algorithm 1) with bottom-up Honaker estimates, in the form
// "true prefix + noise of the nodes used", so that a tree needs no stored node values.
//
// Leaves are steps 1..n. The node of height j and index k covers [k 2^j + 1, (k+1) 2^j]; only
// nodes that end at or before the current step exist, so one leaf lies on at most
// levels(n) = floor(log2 n) + 1 nodes. The prefix [1, i] is the disjoint union of the nodes given by
// the set bits of i (bit j set -> one node of height j).
//
// Honaker (bottom-up) estimate of a node of height j from its noisy value y and its children:
//   z_j = (2^j y + (2^j - 1)(z_left + z_right)) / (2^(j+1) - 1),  variance v_j = s^2 2^j / (2^(j+1) - 1).
// It is linear and unbiased, so z_j = true_j + N_j / (2^(j+1) - 1) with the integer "noise numerator"
//   N_leaf = n_leaf,   N_j = 2^j n_node + N_left + N_right          (n = the node's own noise).
// A released prefix is true prefix + sum over its nodes of round(N_j q / (2^(j+1) - 1)), where q is
// the output grid per noise unit. Because every true node value is a multiple of q, this equals the
// same rounding applied to the noisy node values themselves: the output is an exact function of
// the exactly sampled noisy nodes (post-processing), with no floating point on the noisy path.
#pragma once

#include <absl/container/inlined_vector.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <stdexcept>

#include "common/record.hpp"

namespace dpstream::kernels::dptree {

inline constexpr std::uint32_t kMaxSteps = 1u << 20;  // PRF node ids hold 20-bit indices

// floor(log2 n) + 1: the number of nodes one leaf lies on.
inline std::uint32_t levels(std::uint32_t n) { return static_cast<std::uint32_t>(std::bit_width(n)); }

// Var(Honaker prefix [1, i]) / s^2 = sum over set bits j of i of 2^j / (2^(j+1) - 1).
inline double prefix_variance_factor(std::uint32_t i) {
  double v = 0;
  for (std::uint32_t j = 0; j < 32; ++j)
    if (i >> j & 1u) v += std::ldexp(1.0, static_cast<int>(j)) / (std::ldexp(1.0, static_cast<int>(j) + 1) - 1.0);
  return v;
}

// round(num / den) to the nearest integer, ties away from zero; den > 0. Exact.
inline int128 round_div(int128 num, int128 den) {
  constexpr int128 kFast = int128{1} << 62;  // both fit in 64 bits: the same quotient by one 64-bit division
  if (num > -kFast && num < kFast && den < kFast) {
    const auto n = static_cast<std::int64_t>(num), d = static_cast<std::int64_t>(den), h = d / 2;
    return n >= 0 ? (n + h) / d : -((-n + h) / d);
  }
  const int128 half = den / 2;
  return num >= 0 ? (num + half) / den : -((-num + half) / den);
}

// floor(x / (2^(j+1) - 1)) for 0 <= x < 2^63 and j < 32, without a division instruction: with
// d = 2^(j+1) - 1 and M = floor(2^64 / d), q' = floor(x M / 2^64) satisfies x/d - 2 < q' <= x/d
// (M >= 2^64/d - 1 and x < 2^64), so at most two corrections make it exact.
inline std::uint64_t div_honaker_den(std::uint64_t x, std::uint32_t j) {
  if (j == 0) return x;  // d = 1
  static constexpr auto kMagic = [] {
    std::array<std::uint64_t, 32> m{};
    for (std::uint32_t i = 1; i < 32; ++i)
      m[i] = ~std::uint64_t{0} / ((std::uint64_t{2} << i) - 1);  // = floor(2^64 / d): d is not a power of two
    return m;
  }();
  const std::uint64_t d = (std::uint64_t{2} << j) - 1;
  std::uint64_t q = static_cast<std::uint64_t>((static_cast<uint128>(x) * kMagic[j]) >> 64);
  while (x - q * d >= d) ++q;
  return q;
}

// round(num / (2^(j+1) - 1)), ties away from zero, as round_div; exact.
inline int128 round_honaker(int128 num, std::uint32_t j) {
  constexpr int128 kFast = int128{1} << 62;
  if (num <= -kFast || num >= kFast) return round_div(num, (int128{1} << (j + 1)) - 1);
  const std::uint64_t half = ((std::uint64_t{2} << j) - 1) / 2;
  const auto n = static_cast<std::int64_t>(num);
  return n >= 0 ? int128{static_cast<std::int64_t>(div_honaker_den(static_cast<std::uint64_t>(n) + half, j))}
                : -int128{static_cast<std::int64_t>(div_honaker_den(static_cast<std::uint64_t>(-n) + half, j))};
}

// Noise of the Honaker prefix [1, at] as the stack of its nodes' noise numerators (one per set bit
// of `at`, highest first). `advance` adds leaves one at a time and draws each node's noise once, when
// the node completes: ctz(i) + 1 draws for leaf i, 2 per leaf on average.
class PrefixNoise {
 public:
  std::uint32_t at() const { return at_; }
  void reset() {
    at_ = 0;
    numer_.clear();
  }

  // draw(level, index) -> the node's integer noise (a pure function of the node id).
  template <class Draw>
  void advance(std::uint32_t to, Draw&& draw) {
    if (to > kMaxSteps) throw std::length_error("tree step beyond 2^20");
    for (std::uint32_t i = at_ + 1; i <= to; ++i) {
      std::int64_t n = draw(0u, i - 1);  // the leaf [i, i]
      for (std::uint32_t j = 1; j <= static_cast<std::uint32_t>(std::countr_zero(i)); ++j) {
        // The node of height j ending at i: its left child is the top of the stack, its right child is n.
        const std::int64_t left = numer_.back();
        numer_.pop_back();
        n = (draw(j, (i >> j) - 1) << j) + left + n;
      }
      numer_.push_back(n);
    }
    at_ = std::max(at_, to);
  }

  // Noise of the prefix estimate on an output grid of q per noise unit (exact rounding per node), in
  // 128 bits: numerators below 2^61 (checked at plan time, privacy_plan.cpp) times q < 2^63.
  int128 prefix_noise(std::int64_t q) const {
    int128 total = 0;
    std::size_t k = 0;
    for (std::uint32_t j = 32; j-- > 0;)
      if (at_ >> j & 1u) total += round_honaker(static_cast<int128>(numer_[k++]) * q, j);
    return total;
  }

  std::size_t memory_bytes() const { return sizeof(*this) + (numer_.capacity() > 8 ? numer_.capacity() * 8 : 0); }

  // The numerator of the node that ends at at() (height ctz(at())); at() > 0.
  std::int64_t top() const { return numer_.back(); }
  // The numerators, highest node first (one per set bit of at()).
  const absl::InlinedVector<std::int64_t, 7>& numerators() const { return numer_; }

 private:
  std::uint32_t at_ = 0;
  absl::InlinedVector<std::int64_t, 7> numer_;
};

// prefix_noise(q) of a stack that advances one step at a time, updated from the entries that change:
// step i removes the ctz(i) nodes it merges and adds its node of height ctz(i), so only those terms
// are rounded again. Equal to stack.prefix_noise(q) after every step (integer sums, any order).
class PrefixTotal {
 public:
  PrefixTotal(const PrefixNoise& stack, std::int64_t q) : q_(q) {
    std::size_t k = 0;
    for (std::uint32_t j = 32; j-- > 0;)
      if (stack.at() >> j & 1u) push(round_honaker(static_cast<int128>(stack.numerators()[k++]) * q_, j));
  }
  // After stack.advance(i) from i - 1.
  void stepped(const PrefixNoise& stack, std::uint32_t i) {
    const auto merged = static_cast<std::uint32_t>(std::countr_zero(i));
    for (std::uint32_t m = 0; m < merged; ++m) {
      total_ -= parts_.back();
      parts_.pop_back();
    }
    push(round_honaker(static_cast<int128>(stack.top()) * q_, merged));
  }
  int128 total() const { return total_; }

 private:
  void push(int128 part) {
    parts_.push_back(part);
    total_ += part;
  }
  std::int64_t q_;
  int128 total_ = 0;
  absl::InlinedVector<int128, 8> parts_;
};

}  // namespace dpstream::kernels::dptree
