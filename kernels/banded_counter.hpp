// A continual counter from a banded-inverse matrix factorization, with exact continuous Gaussian
// noise: the alternative to the binary tree (kernels/dp_tree.hpp) for the per-key counters.
//
// Prefix sums are A x with A the lower-triangular ones matrix. Factor A = B C with C^{-1} the
// lower-triangular Toeplitz matrix of a band m_0 = 1, m_1, ..., m_{b-1} (zero below the band) and
// B = A C^{-1}. The mechanism releases u = C x + sigma Z (Z i.i.d. standard normal: the Gaussian
// mechanism on C x, whose L2 sensitivity for one unit at any one step is at most ||C e_1||, the
// norm of C's first column over the horizon) and the counter's estimate is B u: the true prefix plus
//   N_t = sigma sum_{r <= t} M_{t-r} Z_r,   M_j = m_0 + ... + m_min(j, b-1)   (the prefix noise),
// Var N_t = sigma^2 sum_{j < t} M_j^2. Only the running sum of the Z's and the last b - 1 of them
// are needed: noise is a pure function of (secret, window, key, family, round, step) and the state
// is a sum (arXiv 2404.16706 and the banded-inverse constructions it compares, cited in
// docs/PRIVACY.md section 9).
//
// Exactness: m_k is a multiple of 2^-30 and sigma of 2^-32, and Z's digits are exact and lazy
// (kernels/exact_normal.hpp), so the released round(q N_t) (on an output grid of q units per unit)
// is computed exactly: an interval from 56 kept bits of each Z first, more digits in the rare case the
// interval straddles a rounding boundary. A released prefix is the true prefix plus this rounding,
// i.e. the same rounding of B u: post-processing of the Gaussian mechanism, with no floating point
// on the noisy path. (A discrete Gaussian would not do: C x is not on its lattice, and the release
// would reveal C x modulo the lattice.)
#pragma once

#include <absl/container/inlined_vector.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "common/int128.hpp"
#include "kernels/exact_normal.hpp"

namespace dpstream::kernels::banded {

inline constexpr int kCoefBits = 30;         // m_k and M_j are multiples of 2^-30
inline constexpr int kSigmaBits = 32;        // sigma is a multiple of 2^-32
inline constexpr std::size_t kMaxBand = 16;  // b
inline constexpr std::uint32_t kMaxSteps = 1u << 20;

// One counter family's mechanism: the band of C^{-1} and sigma (in the counter's units).
class BandedPlan {
 public:
  // m[0] must be 2^30 (m_0 = 1); 1 <= b <= 16; every partial sum M_j within [-2, 2] (keeps the fixed
  // point exact); sigma is rounded up to a multiple of 2^-32 and must lie in [2^-20, 2^30].
  BandedPlan(std::vector<std::int64_t> band, double sigma);

  std::size_t band() const { return m_.size(); }
  const std::vector<std::int64_t>& coefficients() const { return m_; }  // numerators of m_k
  std::int64_t cumulative(std::uint32_t j) const { return j < cum_.size() ? cum_[j] : cum_.back(); }  // of M_j
  double sigma() const;  // exactly sigma_numerator() 2^-32
  // Every partial sum M_j >= 0: the prefix noise is non-decreasing in every Z (the thresholds need it).
  bool monotone() const;
  // M_j >= M_(b-1) >= 0 for every j < b - 1 (b >= 2): then N_t = sigma (M_(b-1) S_t + sum_{j < b-1} D_j Z_(t-j))
  // with S_t the running sum of every Z and D_j = M_j - M_(b-1) >= 0, which BandedNoise::run_bounds bounds.
  bool dominated() const { return dominance_sum_ >= 0; }
  std::int64_t dominance_sum() const { return dominance_sum_; }  // sum_j D_j numerator; -1 when not dominated
  std::uint64_t sigma_numerator() const { return sigma_num_; }
  // (at - 1) mod (b - 1) for b >= 2, at >= 1: BandedNoise's ring slot of step `at`, by a multiplication
  // (Lemire, Kaser and Kurz, "Faster remainder by direct computation", arXiv 1902.01961): a division
  // per step was a tenth of a simulation's time.
  std::size_t ring_slot(std::uint32_t at) const {
    const std::uint64_t low = ring_magic_ * (at - 1u);
    return static_cast<std::size_t>((static_cast<uint128>(low) * (m_.size() - 1)) >> 64);
  }
  // Var(N_t) / sigma^2 = sum_{j < t} M_j^2.
  double variance_factor(std::uint32_t t) const;
  // sum_{j < t} |M_j| 2^30: the error bound of the kept estimate, in units of 2^-86 (< 2^20 2^31 = 2^51:
  // exact in a double too).
  std::uint64_t abs_cumulative_sum(std::uint32_t t) const {
    return t < abs_cum_.size() ? abs_cum_[t] : abs_cum_.back() + (t - (abs_cum_.size() - 1)) * abs_tail_;
  }

 private:
  std::vector<std::int64_t> m_, cum_;
  std::vector<std::uint64_t> abs_cum_;  // abs_cumulative_sum(t) for t <= b
  std::uint64_t abs_tail_ = 0;          // |M_(b-1)| 2^30: each step beyond b adds it
  std::uint64_t sigma_num_ = 0;
  std::uint64_t ring_magic_ = 0;  // 2^64 / (b - 1) rounded up: exact remainders of 32-bit numerators
  std::int64_t dominance_sum_ = -1;
};

// ||C e_1||^2 = sum_{k < T} c_k^2 for C = (C^{-1})^{-1}, c the power-series inverse of the band,
// computed in long double and checked against double (std::domain_error if they disagree beyond
// 1e-9 relative: a numerically unstable band), then raised by 1e-9 relative: an upper bound.
double sensitivity_squared(const std::vector<std::int64_t>& band, std::uint32_t T);

// A band of width b for horizon T: a deterministic Hooke-Jeeves pattern search (from the truncated
// square-root factorization) minimizing sensitivity_squared(T') * sum_{j < T'} M_j^2, the last
// step's variance at a fixed privacy cost, with T' = min(T, 1024); numerators on the 2^-30 grid.
// Every partial sum M_j is >= 0, so the prefix noise is non-decreasing in every Z (docs/PRIVACY.md
// section 6 needs it for the thresholds' union bound).
std::vector<std::int64_t> optimized_band(std::uint32_t T, std::size_t b);

// A counter's state without its ring (20 bytes, aligned to 4, where BandedNoise holds 88): its step, the
// steps its running sum holds as blocks (BandedNoise::start_blocked) and the running sum. The ring's samples
// are a pure function of the secret and the counter's node, so BandedNoise::restore draws them again; for
// caches that keep many counters between visits (a key selection cache entry is its key, this and 4 bytes:
// 32, kernels/selection_cache.hpp).
struct BandedFrontier {
  std::uint32_t at = 0;
  std::uint32_t blocked = 0;
  Int96Words32 older;  // |older| < 2^20 steps x 2^63 < 2^95
};
static_assert(sizeof(BandedFrontier) == 20 && alignof(BandedFrontier) == 4);

// The blocked prefix (issue 16: a key's first test at step t draws the t - b + 1 steps before its ring as
// about 15 samples instead of one each). Block (level L, index j) covers steps j 4^L + 1 .. (j + 1) 4^L and
// stands for their sum, 2^L zeta with zeta one standard normal of node (key, family, round, L, j): a sum of
// 4^L i.i.d. N(0, 1) is N(0, 4^L), and the scale is a power of two, exact in the fixed point. Level 0 is
// the step's own node. Every output at a step t >= p + b - 1 depends on steps 1..p only through their sum
// (they all carry M_(b-1)), so drawing that sum as blocks leaves the joint law of every such output as it is.
// Not used by key selection yet: there p + b - 1 is a key's first test, fixed by the data, and a counter's
// p must then survive a checkpoint and a resume on another rank count (the selection caches do not), or
// a resumed job would draw the prefix again as other blocks (docs/PERFORMANCE.md round 35).
struct PrefixBlock {
  std::uint32_t level, index;
};
inline constexpr std::uint32_t kMaxBlockLevel = 10;  // 4^10 = 2^20 = kMaxSteps
// The aligned blocks that cover steps 1..p exactly, largest first (p's base-4 digits: at most 3 per level).
absl::InlinedVector<PrefixBlock, 32> prefix_blocks(std::uint32_t p);

// round(q N) known to lie in [lo, hi] on the output grid; lo > hi (the default) when doubles cannot
// bound it (|q N| near 2^50) and the caller needs the exact value. A plain pair, not an optional: a
// simulation reads one per step.
struct NoiseInterval {
  std::int64_t lo = 1, hi = 0;
  bool known() const { return lo <= hi; }
};

// A NoiseInterval before its bounds are rounded to the grid: round(q N) lies in [floor(below) - 1,
// ceil(above) + 1]; NaN edges where doubles cannot bound it (interval() also gives edges beyond 2^50 as
// unknown). A simulation decides most steps on the edges alone (kernels/plain_steps.hpp) and rounds only
// the others'.
struct NoiseEdges {
  double below = std::numeric_limits<double>::quiet_NaN(), above = std::numeric_limits<double>::quiet_NaN();
  NoiseInterval interval() const;  // exactly the interval prefix_interval() gives for the same estimate
};

// The prefix noise of one counter: the steps' normal samples enter one at a time as Z~ (Z truncated
// toward zero to 56 fraction bits, noise::normal_fixed56); prefix_noise gives round(q N_t) exactly.
class BandedNoise {
 public:
  // draw(index) -> the step's standard normal sample Z (index = step - 1, from its node stream).
  using Draw = std::function<noise::NormalSample(std::uint32_t index, std::size_t words)>;
  // draw_block(level, index, words) -> zeta of block (level, index) (PrefixBlock), for a blocked counter.
  using DrawBlock = std::function<noise::NormalSample(std::uint32_t level, std::uint32_t index, std::size_t words)>;

  std::uint32_t at() const { return at_; }
  std::uint32_t blocked() const { return blocked_; }  // steps 1..blocked() are held as blocks (start_blocked)
  void reset() {
    at_ = 0;
    blocked_ = 0;
    older_ = int128{0};
  }

  // Starts a fresh counter (at() == 0) at step p + b - 1 with steps 1..p held as the blocks of
  // prefix_blocks(p): `blocks_kept` is blocks_kept_sum() of their zeta~ (each truncated as Z~ is, so a
  // block's 2^L zeta~ errs by less than 2^L <= 4^L units of 2^-56: every error bound stated for its 4^L
  // steps still holds), `ring` Z~ of steps p + 1 .. p + b - 1. Steps up to p + b - 1 are then neither
  // estimated nor rewound or restored to: their samples are not defined one by one.
  void start_blocked(const BandedPlan& plan, std::uint32_t p, int128 blocks_kept, const std::int64_t* ring);
  // sum of 2^L zeta~ over `blocks`, from kept(level, index) -> zeta~ (noise::normal_fixed56 of the block's node).
  template <class Kept>
  static int128 blocks_kept_sum(const absl::InlinedVector<PrefixBlock, 32>& blocks, Kept&& kept) {
    int128 sum = 0;
    for (const PrefixBlock& blk : blocks) sum += int128{kept(blk.level, blk.index)} * (std::int64_t{1} << blk.level);
    return sum;
  }

  // Adds steps at()+1 .. to; `draw_kept(index)` returns Z~ of step index + 1 (noise::normal_fixed56).
  template <class DrawKept>
  void advance(const BandedPlan& plan, std::uint32_t to, DrawKept&& draw_kept) {
    while (at_ < to) push(plan, draw_kept(at_));
  }
  // Adds step at()+1 with its Z~.
  void push(const BandedPlan& plan, std::int64_t kept);
  void push(const BandedPlan& plan, int128 z) = delete;  // a 64-bit fixed-point Z is not a Z~: convert it
  // Back to step `to` <= at(), exactly the state advance(to) reaches: `draw_kept(index)` (as for
  // advance) gives Z~ of steps max(1, to - b + 2) .. max(to, at - b + 1): the steps that left the band
  // since `to` come out of the running sum, and the ring gets the last b - 1 of `to`. Costs at most
  // at() - to + b - 1 draws, so a counter need not keep its state at each step it was tested at.
  template <class DrawKept>
  void rewind(const BandedPlan& plan, std::uint32_t to, DrawKept&& draw_kept) {
    if (to > at_) throw std::logic_error("banded counter: rewind ahead of the counter");
    const std::uint32_t keep = static_cast<std::uint32_t>(plan.band()) - 1;
    if (blocked_ > 0 && to < blocked_ + keep) throw std::logic_error("banded counter: rewind into a blocked prefix");
    const auto [first, last] = rewind_steps(plan, at_, to);
    for (std::uint32_t r = first; r <= last; ++r) {
      const std::int64_t kept = draw_kept(r - 1);
      static_assert(std::is_same_v<decltype(draw_kept(r - 1)), std::int64_t>, "draw_kept returns Z~");
      if (r + keep <= at_ && r + keep > to) older_ = int128(older_) - kept;  // in the sum now, not at `to`
      if (r <= to && keep > 0) recent_slot(plan, r) = kept;
    }
    at_ = to;
  }
  // The steps whose samples rewind(plan, to) asks for of a counter at step `at`, [first, last]
  // (1-based): the ring's at `to` and those that entered the running sum since.
  static std::pair<std::uint32_t, std::uint32_t> rewind_steps(const BandedPlan& plan, std::uint32_t at,
                                                              std::uint32_t to) {
    const std::uint32_t keep = static_cast<std::uint32_t>(plan.band()) - 1;
    return {to > keep ? to - keep + 1 : 1, std::max(to, at > keep ? at - keep : 0)};
  }

  BandedFrontier frontier() const { return {at_, blocked_, int128{older_}}; }
  // The counter at step `to` <= f.at of the counter that frontier() returned as `f`, exactly what
  // advance(to) reaches: f's running sum less the steps that entered it after `to`, and the ring of
  // `to`, from `draw_kept(index)` (as for advance) for steps rewind_steps(plan, f.at, to) only.
  template <class DrawKept>
  void restore(const BandedPlan& plan, const BandedFrontier& f, std::uint32_t to, DrawKept&& draw_kept) {
    at_ = f.at;
    blocked_ = f.blocked;
    older_ = int128{f.older};
    recent_.assign(plan.band() - 1, 0);  // rewind writes every slot of the ring of `to` it holds
    rewind(plan, to, std::forward<DrawKept>(draw_kept));
  }

  // For a simulation: prefix_interval(plan, q) at each of the steps at()+1 .. at()+n that push() of
  // kept[0..n) would reach, without pushing them (unknown where that gives none). Intervals hold
  // round(q N) as prefix_interval's do, wider by the drift term (a fraction of a grid unit at the
  // engine's sigma and grid; more only costs exact computations): with a full ring the samples
  // are laid out in step order and every step's estimate computed in one pass, the running sum in a
  // double whose drift is bounded, a few multiply-adds a step instead of push() and prefix_interval().
  void intervals_ahead(const BandedPlan& plan, std::int64_t q, const std::int64_t* kept, std::size_t n,
                       std::vector<NoiseEdges>& out) const;
  // For a simulation: edges that hold round(q N) at every one of the steps at()+1 .. at()+n that push() of
  // kept[0..n) would reach, from one pass of a running sum and extremes instead of each step's estimate
  // (about two times wider than the steps' own extremes: most runs of a key far from its threshold still
  // fail everywhere inside them). Unknown (NaN) unless the plan is dominated(), the ring is full (at() >=
  // b - 1), 1 <= n <= kMaxRunBound and the edges lie within 2^50.
  static constexpr std::size_t kMaxRunBound = 255;
  NoiseEdges run_bounds(const BandedPlan& plan, std::int64_t q, const std::int64_t* kept, std::size_t n) const;
  // push() of kept[0..n), in order.
  void push_all(const BandedPlan& plan, const std::int64_t* kept, std::size_t n);

  // round(q N_at) on the output grid, ties away from zero (a tie has probability 0); q in [1, 2^62].
  // `redraw` is called only when 64 bits per sample leave the rounding undecided (probability about
  // the interval's width in grid units, ~2^-22 here): it must return the same samples with more digits;
  // `redraw_block` likewise the blocks' of a blocked counter (std::logic_error without it).
  template <class Redraw>
  int128 prefix_noise(const BandedPlan& plan, std::int64_t q, Redraw&& redraw) const {
    return prefix_noise(plan, q, std::forward<Redraw>(redraw), DrawBlock{});
  }
  template <class Redraw, class RedrawBlock>
  int128 prefix_noise(const BandedPlan& plan, std::int64_t q, Redraw&& redraw, RedrawBlock&& redraw_block) const {
    if (const auto fast = fast_prefix_noise(plan, q)) return *fast;
    return interval_prefix_noise(plan, q, Draw(std::forward<Redraw>(redraw)),
                                 DrawBlock(std::forward<RedrawBlock>(redraw_block)));
  }

  // An interval [lo, hi] (a few grid units wide) that holds round(q N_at), from double arithmetic alone:
  // the estimate's terms in doubles, whose error is bounded by 2^-43 of the sum of their magnitudes,
  // plus the kept samples' error A. Enough to decide a threshold test that is not within a few grid
  // units of its boundary (a simulation's steps, nearly always). Unknown where |q N| nears 2^50.
  NoiseInterval prefix_interval(const BandedPlan& plan, std::int64_t q) const {
    return prefix_edges(plan, q).interval();
  }
  NoiseEdges prefix_edges(const BandedPlan& plan, std::int64_t q) const;  // prefix_interval's, unrounded

  // The estimate sum_r M_{at-r} Z~_r, Z~ = Z truncated toward zero to 56 fraction bits, in units of
  // 2^-86 (exposed for tests).
  int128 estimate_units(const BandedPlan& plan) const;

 private:
  // round(q N_at) when the long double estimate decides it (almost always), else nothing.
  std::optional<int128> fast_prefix_noise(const BandedPlan& plan, std::int64_t q) const;
  // The same from the exact interval of the kept 56 bits, then from more digits.
  int128 interval_prefix_noise(const BandedPlan& plan, std::int64_t q, const Draw& redraw,
                               const DrawBlock& redraw_block) const;

  // f(M_j numerator, Z~ of step at - j) for the ring's steps, newest first (j = 0 .. min(at, b - 1) - 1).
  template <class F>
  void for_each_recent(const BandedPlan& plan, F&& f) const {
    const std::size_t keep = plan.band() - 1;
    const std::uint32_t kept = std::min<std::uint32_t>(at_, static_cast<std::uint32_t>(keep));
    if (kept == 0) return;
    std::size_t slot = plan.ring_slot(at_);  // step at - j sits at slot (at - 1 - j) mod keep
    for (std::uint32_t j = 0; j < kept; ++j) {
      f(plan.cumulative(j), recent_[slot]);
      slot = slot == 0 ? keep - 1 : slot - 1;
    }
  }
  std::int64_t& recent_slot(const BandedPlan& plan, std::uint32_t step) {  // Z~ of one of the last b - 1 steps
    if (recent_.size() != plan.band() - 1) recent_.resize(plan.band() - 1);
    return recent_[plan.ring_slot(step)];
  }

  std::uint32_t at_ = 0;
  std::uint32_t blocked_ = 0;  // steps 1..blocked_ entered older_ as blocks
  Int128Words older_;          // sum of Z~_r for r <= at - (b - 1), units 2^-56 (8-byte aligned: a smaller cache entry)
  // Z~ of the last min(at, b - 1) steps: a ring of b - 1 slots, step r at recent_[(r - 1) % (b - 1)]
  // (inline up to b = 8: a released key keeps one per value counter; key selection keeps the frontier only).
  absl::InlinedVector<std::int64_t, 7> recent_;
};

// round(q N_t) from samples of `words` digits each, or the same with any number of digits: exact
// (used by prefix_noise when 64 bits do not decide, and by tests as the reference). With `blocked` > 0
// (a counter started by start_blocked, t >= blocked + b - 1) steps 1..blocked come from the blocks of
// prefix_blocks(blocked), drawn by `redraw_block`.
int128 exact_prefix_noise(const BandedPlan& plan, std::int64_t q, std::uint32_t t, const BandedNoise::Draw& redraw,
                          std::uint32_t blocked = 0, const BandedNoise::DrawBlock& redraw_block = {});

// The extremes over a run of samples z_0 .. z_(n-1) (BandedNoise::run_bounds) of the partial sums
// p_k = sum_(j <= k) floor(z_j / 256), and of the samples and 0. |z| < 2^63 and n <= kMaxRunBound: no sum
// overflows. Avx512 (eight samples a step, an in-register scan) where cpu_runs_avx512f(), else Scalar: the
// same values.
struct RunExtremes {
  std::int64_t p_max = std::numeric_limits<std::int64_t>::min(), p_min = std::numeric_limits<std::int64_t>::max();
  std::int64_t z_max = 0, z_min = 0;
  bool operator==(const RunExtremes&) const = default;
};
enum class RunPath { Scalar, Avx512, Best };
RunExtremes run_extremes(const std::int64_t* z, std::size_t n, RunPath path = RunPath::Best);

}  // namespace dpstream::kernels::banded
