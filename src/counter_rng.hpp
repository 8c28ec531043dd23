// Deterministic counter-based generator for the synthetic workload (not for DP noise: noise
// comes from the keyed cryptographic generator). A stream is a pure function of its
// coordinates (seed, window, user, ...), so any rank can draw it and get the same numbers.
#pragma once

#include <cstdint>

#include "partition/hash.hpp"

namespace dpstream {

class CounterRng {
 public:
  CounterRng(std::uint64_t seed, std::uint64_t a, std::uint64_t b = 0, std::uint64_t c = 0)
      : state_(child(child(root(seed), a), b) ^ c) {}

  // The same state from a prefix hashed once: callers drawing many streams of one (seed, a, b) hash it
  // once, and each stream c costs one XOR: CounterRng(s, a, b, c) == at(child(child(root(s), a), b), c).
  static constexpr std::uint64_t root(std::uint64_t seed) { return partition::mix64(seed ^ 0x6A09E667F3BCC909ULL); }
  static constexpr std::uint64_t child(std::uint64_t node, std::uint64_t coord) {
    return partition::mix64(node ^ coord);
  }
  static CounterRng at(std::uint64_t node, std::uint64_t c) { return CounterRng(node ^ c); }

  // SplitMix64 step.
  std::uint64_t next() {
    state_ += 0x9E3779B97F4A7C15ULL;
    return partition::mix64(state_);
  }
  // Skips n draws (SplitMix64's state is a counter: no hashing needed).
  void discard(std::uint64_t n) { state_ += n * 0x9E3779B97F4A7C15ULL; }
  // Uniform on [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  // Uniform on (0, 1].
  double uniform_pos() { return static_cast<double>((next() >> 11) + 1) * 0x1.0p-53; }
  // Uniform integer in [0, n), unbiased (Lemire's multiply-and-reject).
  std::uint64_t below(std::uint64_t n) {
    uint128 m = static_cast<uint128>(next()) * n;
    auto low = static_cast<std::uint64_t>(m);
    if (low < n) {
      const std::uint64_t threshold = -n % n;
      while (low < threshold) {
        m = static_cast<uint128>(next()) * n;
        low = static_cast<std::uint64_t>(m);
      }
    }
    return static_cast<std::uint64_t>(m >> 64);
  }

 private:
  explicit CounterRng(std::uint64_t state) : state_(state) {}
  std::uint64_t state_;
};

}  // namespace dpstream
