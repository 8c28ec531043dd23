// Secure, reproducible noise: every tree node's noise is an exact discrete Gaussian sample drawn
// from a keyed PRF stream of (secret, window, key, family, round, level, index). Nothing is stored;
// the same node gives the same noise on any rank or thread.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/int128.hpp"
#include "kernels/aes_blocks.hpp"

namespace dpstream::noise {

using u128 = dpstream::uint128;  // common/int128.hpp

using Secret = std::array<std::uint8_t, 32>;
Secret secret_from_os();                      // OpenSSL RAND_priv_bytes; throws std::runtime_error
Secret secret_from_seed(std::uint64_t seed);  // test mode: SHA-256("dpstream test seed" || seed LE8)

// DP-SQLP's trees, and the baselines' one-shot releases (round = trigger, level = index = 0).
enum class Family : std::uint32_t {
  KeySelection = 0,
  Count = 1,
  Sum = 2,
  BaselineSelection = 3,
  BaselineCount = 4,
  BaselineSum = 5,
  BandedSelection = 6,  // banded-inverse counters (kernels/banded_counter.hpp): level 0, index = step - 1;
                        // key selection's blocked prefixes also levels 1-10 (banded::PrefixBlock)
  BandedCount = 7,
  BandedSum = 8,
  SqlSelection = 9,   // the SQL operator's partition selection: one stream per group (sql/selection.hpp)
  SqlAggregate = 10,  // the SQL operator's aggregate noise: one stream per (group, aggregate)
  SqlQuantile = 11    // the SQL operator's quantile trees (ANON_MEDIAN, ANON_NTILE)
};

struct NodeId {
  std::uint64_t key;
  Family family;        // < 16
  std::uint32_t round;  // key-selection round (0 for value trees); < 2^20
  std::uint32_t level;  // height j (0 = leaf); < 32
  std::uint32_t index;  // covers leaves [index*2^level + 1, (index+1)*2^level]; < 2^20
};

// pack(n) = key(64) | family(4) | round(20) | level(5) | index(20) | 15 zero bits for the block
// counter, as a 128-bit integer; throws std::invalid_argument on out-of-range fields.
u128 pack(const NodeId& id);
inline constexpr unsigned kIndexShift = 15;  // the index field's lowest bit in pack(); the block counter below
inline constexpr unsigned kIndexBits = 20;   // the index field's width: node indices below 2^20

// AES-256 (ECB on counter blocks; kernels/aes_blocks.hpp) keyed with K_w = HMAC-SHA256(secret, "dpstream window" ||
// window LE8).
// Block i of node n = AES_{K_w}(big-endian 128-bit pack(n) | i), i < 2^15. One per thread.
class WindowPrf {
 public:
  static constexpr std::uint32_t kBlocksPerNode = 1u << kIndexShift;

  WindowPrf(const Secret& secret, std::int64_t window);
  WindowPrf(WindowPrf&&) noexcept;  // a moved-from WindowPrf must not be used
  WindowPrf& operator=(WindowPrf&&) noexcept;
  ~WindowPrf();

  // `blocks` 16-byte blocks of node `id` starting at block `first`; throws std::out_of_range past 2^15.
  void blocks(const NodeId& id, std::uint32_t first, std::uint32_t blocks, std::uint8_t* out);
  void blocks_packed(u128 packed, std::uint32_t first, std::uint32_t blocks, std::uint8_t* out);  // packed = pack(id)
  // Blocks 0..per_node-1 of each of `n` nodes, node after node, in one cipher call (n per_node <= 64).
  void first_blocks(const u128* packed, std::size_t n, std::uint32_t per_node, std::uint8_t* out);
  // Block 0 of each of `n` <= 64 consecutive nodes, pack(first) with index + 0, 1, ..., n - 1, in one cipher call;
  // std::invalid_argument where the last index would pass 2^20 - 1 (a carry into the level field) or a block
  // counter is set.
  void first_blocks_of_run(u128 first_packed, std::size_t n, std::uint8_t* out);

 private:
  Aes256Blocks cipher_;  // keyed with K_w, which lives on only inside it
};

// Uniform random words and bits of one node. Blocks are fetched lazily, kFirstBlocks on the first
// fetch (most samples need no more) and kMoreBlocks per later fetch; bits come from a 64-bit pool.
class NodeStream {
 public:
  static constexpr std::uint32_t kFirstBlocks = 2;
  static constexpr std::uint32_t kMoreBlocks = 8;

  // `first_blocks`: blocks of the first fetch (the stream is the same whatever the fetch sizes).
  NodeStream(WindowPrf& prf, const NodeId& id, std::uint32_t first_blocks = kFirstBlocks);
  // A stream whose first `first_blocks` blocks were fetched already (WindowPrf::first_blocks).
  NodeStream(WindowPrf& prf, u128 packed, std::uint32_t first_blocks, const std::uint8_t* fetched);
  std::uint64_t next_u64() {
    if (pos_ == end_) refill();
    return buf_[pos_++];
  }
  bool next_bit() {
    if (pool_bits_ == 0) pool_ = next_u64(), pool_bits_ = 64;
    const bool b = pool_ & 1;
    pool_ >>= 1, --pool_bits_;
    return b;
  }
  std::uint64_t uniform_below(std::uint64_t n);  // exact, rejection sampling, n >= 1
  u128 uniform_below_u128(u128 n);               // exact, n >= 1
  bool bernoulli(u128 num, u128 den);            // exact P = num/den, 0 <= num <= den
  std::uint32_t blocks_used() const { return next_block_; }

 private:
  std::uint64_t bits(unsigned count);  // count in [1, 64] uniform bits
  void refill();

  WindowPrf& prf_;
  u128 packed_;
  std::uint32_t first_blocks_;
  std::uint32_t next_block_ = 0;
  std::uint32_t pos_ = 0, end_ = 0;  // word cursor in buf_
  std::uint64_t pool_ = 0;
  unsigned pool_bits_ = 0;
  std::array<std::uint64_t, std::size_t{2} * kMoreBlocks> buf_;  // filled before read
};

// N_Z(0, sigma^2) with sigma^2 = n / 2^k exactly, n in [2^51, 2^52), rounded up from the double
// sigma^2; integer arithmetic only while sampling. Two samplers of the same distribution:
//  - sigma <= kTableMaxSigma: inverse CDF of |Y| on a table of 192-bit fixed-point probabilities
//    computed once in 320-bit floating point (boost::multiprecision) up to |y| <= 17 sigma + 2; one
//    64-bit word of the stream decides almost always (a tie with an entry's top word, probability
//    < 2^-50, reads two more), a 4096-entry guide table starts the search. Its output is within
//    2^-170 of N_Z in total variation (docs/PRIVACY.md section 3);
//  - larger sigma (and sample_exact): CKS20 (arXiv 2004.00010) Algorithm 3, exact.
struct CdfTable;  // kernels/cdf_table.hpp

class DiscreteGaussian {
 public:
  static constexpr double kTableMaxSigma = 4096.0;
  static constexpr unsigned kGuideBits = 12;

  explicit DiscreteGaussian(double sigma);  // sigma in [2^-10, 2^24]; else std::invalid_argument
  // sigma^2 rounded up to n / 2^k, as the constructor does, without building anything.
  static double rounded_sigma(double sigma);
  double sigma() const { return sigma_; }            // sqrt(n / 2^k) >= requested
  std::int64_t sample(NodeStream& rng) const;        // the table when there is one, else sample_exact
  std::int64_t sample_exact(NodeStream& rng) const;  // CKS20 Algorithm 3
  double variance() const;                           // sum of y^2 pmf(y) over the integers
  std::uint64_t sigma2_num() const { return n_; }    // sigma^2 = sigma2_num() * 2^-sigma2_exp()
  int sigma2_exp() const { return k_; }
  std::uint64_t t() const { return t_; }  // DLap proposal scale floor(sigma) + 1

  // The table: entry m is round(2^192 P[|Y| <= m]) as three words, most significant first; the last
  // entry (all ones) takes every U above the previous one.
  bool tabulated() const { return table_ != nullptr; }
  std::size_t table_size() const;
  std::array<std::uint64_t, 3> table_entry(std::size_t m) const;

  struct Gamma {
    std::uint64_t whole;  // gamma = whole + num / den exactly, 0 <= num < den
    u128 num, den;
  };
  Gamma gamma(std::uint64_t y) const;  // (y - sigma^2/t)^2 / (2 sigma^2) for 0 <= y <= 2^11 t

 private:
  static std::shared_ptr<const CdfTable> build_table(std::uint64_t n, int k, double sigma);
  Gamma gamma(std::uint64_t y, std::uint64_t v, std::uint64_t u) const;  // y = v t + u, 0 <= u < t
  std::int64_t sample_table(NodeStream& rng) const;

  double sigma_;
  std::uint64_t n_;
  int k_;
  std::uint64_t t_, cut_;  // cut_ = 2^11 t
  u128 cd_, d_, e_, n2_;
  std::shared_ptr<const CdfTable> table_;  // shared by copies: immutable
};

// DLap(b): P(x) proportional to exp(-|x| / b) on the integers, exact (CKS20, arXiv 2004.00010, Algorithm 2),
// with b rounded up to n / 2^k exactly (n in [2^51, 2^52)), like DiscreteGaussian's sigma^2.
class DiscreteLaplace {
 public:
  explicit DiscreteLaplace(double scale);         // scale in [2^-10, 2^40]; else std::invalid_argument
  static double rounded_scale(double scale);      // the rounding, without building anything
  double scale() const { return scale_; }         // n / 2^k >= requested
  std::uint64_t scale_num() const { return n_; }  // b = scale_num() * 2^-scale_exp()
  int scale_exp() const { return k_; }
  std::int64_t sample(NodeStream& rng) const;
  // P[X >= m] for m >= 1: exp(-m/b) / (1 + exp(-1/b)), in long double (for thresholds and tests);
  // for m <= 0, 1 - P[X >= 1 - m] by symmetry.
  long double upper_tail(std::int64_t m) const;

 private:
  double scale_;
  std::uint64_t n_;
  int k_;
};

std::int64_t node_noise(WindowPrf& prf, const NodeId& id, const DiscreteGaussian& dg);
// node_noise of n nodes (the same values), their first blocks fetched together: many AES blocks in
// flight instead of one per node.
void node_noises(WindowPrf& prf, const NodeId* ids, std::size_t n, const DiscreteGaussian& dg, std::int64_t* out);

}  // namespace dpstream::noise
