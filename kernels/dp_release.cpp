#include "kernels/dp_release.hpp"

#include <omp.h>

#include <openssl/crypto.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#ifdef DPSTREAM_TEST_HOOKS
#include <cstdio>
#include <cstdlib>
#endif

#include "common/elapsed.hpp"
#include "common/fault_injection.hpp"
#include "common/prefetch.hpp"

namespace dpstream::kernels {

namespace {
constexpr std::int64_t kOne = std::int64_t{1} << kValueFracBits;  // one user or record in fixed point
// A failed test's look-ahead: the cache's limit, from a key's first test on. A visit costs misses and its
// ring's draws, a longer look-ahead the steps drawn past new records; since most runs are taken on one
// bound (run_bounds) and a draw costs about 3 ns, 127 steps at once beat look-aheads that doubled from 2
// up to 127 or 254 (docs/PERFORMANCE.md round 43; 2 to 64 in rounds 5-32, to 127 in rounds 33-42).
constexpr std::uint32_t kHorizon = 127;
static_assert(kHorizon <= SelectionCache<BandedSelectionNoise>::kMaxAhead);
// Key selection's cache entry, banded (the default): 32 bytes.
static_assert(sizeof(SelectionCache<BandedSelectionNoise>::Entry) == 32);

#ifdef DPSTREAM_TEST_HOOKS
// Test-hooks build only: the target dpstream_test_hooks (tests/e2e/CMakeLists.txt) compiles this file
// with DPSTREAM_TEST_HOOKS; the shipped dpstream contains no such code. DPSTREAM_TEST_NOISE_SCALE = f
// multiplies every noise sigma by f (the thresholds stay the plan's): with f < 1, a deliberately
// broken, non-private mechanism that the privacy audit (tests/e2e/test_privacy_audit.py) must detect.
void apply_test_hooks(DpParams& p) {
  const char* text =
      std::getenv("DPSTREAM_TEST_NOISE_SCALE");  // NOLINT(concurrency-mt-unsafe): at plan time, one thread
  if (text == nullptr || *text == '\0') return;
  char* end = nullptr;
  const double f = std::strtod(text, &end);
  if (*end != '\0' || !(f > 0) || !std::isfinite(f))
    throw std::invalid_argument(std::string("DPSTREAM_TEST_NOISE_SCALE='") + text + "': expected a number > 0");
  p.sigma_selection *= f;
  p.sigma_count *= f;
  p.sigma_sum *= f;
  std::fprintf(stderr,
               "dpstream test-hooks build: DPSTREAM_TEST_NOISE_SCALE = %g scales every noise sigma: NOT private\n", f);
}
#endif
// The nodes of one tree that a PrefixNoise needs to go from step `from` to step `to`, drawn together
// (noise::node_noises: many AES blocks in flight), then handed to advance() in the order it asks.
class NodeBatch {
 public:
  explicit NodeBatch(noise::WindowPrf& prf) : prf_(prf) {}

  // Draws the nodes of steps from+1..to: for step q its leaf, then the ctz(q) nodes that q completes.
  std::size_t prepare(std::uint64_t key, noise::Family family, std::uint32_t round, std::uint32_t from,
                      std::uint32_t to, const noise::DiscreteGaussian& dg) {
    ids_.clear();
    for (std::uint32_t q = from + 1; q <= to; ++q) {
      ids_.push_back({key, family, round, 0, q - 1});
      for (std::uint32_t j = 1; j <= static_cast<std::uint32_t>(std::countr_zero(q)); ++j)
        ids_.push_back({key, family, round, j, (q >> j) - 1});
    }
    values_.resize(ids_.size());
    noise::node_noises(prf_, ids_.data(), ids_.size(), dg, values_.data());
    next_ = 0;
    return ids_.size();
  }

  auto drawer() {
    return [this](std::uint32_t level, std::uint32_t index) {
      if (next_ >= ids_.size() || ids_[next_].level != level || ids_[next_].index != index)
        throw std::logic_error("NodeBatch: the tree asked for a node that was not prepared");
      return values_[next_++];
    };
  }

 private:
  noise::WindowPrf& prf_;
  std::vector<noise::NodeId> ids_;
  std::vector<std::int64_t> values_;
  std::size_t next_ = 0;
};

// Advances a selection stack to `to`, drawing its nodes in batches of at most 32 steps.
std::uint64_t advance_batched(dptree::PrefixNoise& stack, NodeBatch& batch, std::uint64_t key, std::uint32_t round,
                              std::uint32_t to, const noise::DiscreteGaussian& dg) {
  std::uint64_t drawn = 0;
  for (std::uint32_t from = stack.at(); from < to;) {
    const std::uint32_t until = std::min(to, from + 32);
    drawn += batch.prepare(key, noise::Family::KeySelection, round, from, until, dg);
    stack.advance(until, batch.drawer());
    from = until;
  }
  return drawn;
}

// Key selection on binary trees: nodes drawn in batches of many AES blocks, the prefix noise of a
// simulation kept incrementally (PrefixTotal).
class TreeSelection {
 public:
  using Noise = dptree::PrefixNoise;
  using State = TreeSelectionNoise;
  TreeSelection(noise::WindowPrf& prf, const noise::DiscreteGaussian& dg) : batch_(prf), dg_(dg) {}

  static bool untested(const State& st) { return st.tested.at() == 0; }
  static void reset(State& st) {
    st.tested.reset();
    st.ahead.reset();
  }
  // The noise at round step `step`: the simulation's when it stopped there, else drawn on from the last test.
  const Noise& seek(State& st, std::uint64_t key, std::uint32_t round, std::uint32_t step,
                    std::uint32_t /*ahead_until*/ = 0) {
    if (st.tested.at() > step) reset(st);
    if (st.ahead.at() == step) std::swap(st.tested, st.ahead);  // simulated up to here: no redraw
    draws += advance_batched(st.tested, batch_, key, round, step, dg_);
    return st.tested;
  }
  int128 prefix(const Noise& n, std::uint64_t /*key*/, std::uint32_t /*round*/) const { return n.prefix_noise(kOne); }
  // A simulation from the last test up to `until` (all its nodes drawn now), then one step at a time.
  void begin_ahead(State& st, std::uint64_t key, std::uint32_t round, std::uint32_t until) {
    st.ahead = st.tested;
    draws += batch_.prepare(key, noise::Family::KeySelection, round, st.ahead.at(), until, dg_);
    total_.emplace(st.ahead, kOne);
  }
  // The simulation's next step: its prefix noise as an interval, here a single value.
  std::pair<int128, int128> step_ahead(State& st, std::uint32_t q, std::uint64_t /*key*/, std::uint32_t /*round*/) {
    st.ahead.advance(q, batch_.drawer());
    total_->stepped(st.ahead, q);
    return {total_->total(), total_->total()};
  }
  int128 exact_ahead(const State& /*st*/, std::uint64_t /*key*/, std::uint32_t /*round*/) const {
    return total_->total();
  }
  void end_ahead(State& /*st*/) const {}  // the simulation's stack is at its last step already
  // A tree's step is known only once taken (step_ahead): none is taken in bulk.
  template <class Plain>
  static std::uint32_t take_plain(std::uint32_t /*q*/, std::uint32_t /*last*/, Plain&& /*plain*/) {
    return 0;
  }
  static std::int64_t take_all_bounded(std::uint32_t /*q*/, const PlainSteps& /*steps*/, std::int64_t /*users*/) {
    return PlainSteps::kNoCount;
  }
  std::uint64_t draws = 0;

 private:
  NodeBatch batch_;
  const noise::DiscreteGaussian& dg_;
  std::optional<dptree::PrefixTotal> total_;
};

// Key selection on banded-inverse counters: one normal sample per step, drawn in batches of steps. A
// key's cached State is its counter's frontier without the ring; `counter_` is the counter in use,
// restored (its ring drawn again) when a visit seeks the key's noise, and written back to the State by
// every call that moves it.
class BandedSelection {
 public:
  using Noise = banded::BandedNoise;
  using State = BandedSelectionNoise;
  BandedSelection(noise::WindowPrf& prf, const banded::BandedPlan& plan) : prf_(prf), plan_(plan) {}

  static bool untested(const State& st) { return st.frontier.at == 0; }
  static void reset(State& st) { st.frontier = {}; }
  // The noise at round step `step`, from the key's frontier: drawn on from it (with its ring, one
  // batch), or rewound to it (the steps simulated past it drawn again: as many as keeping the state of
  // the last test would cost). The steps up to `ahead_until` (a simulation's end, should the test fail)
  // are drawn in the same batch: a ring of b - 1 samples alone is a short run, at twice the cost a sample.
  const Noise& seek(State& st, std::uint64_t key, std::uint32_t round, std::uint32_t step,
                    std::uint32_t ahead_until = 0) {
    held_.valid = false;        // counter_ changes below
    if (st.frontier.at == 0) {  // the first test: its prefix as blocks (fixed by `step`: a resume seeks it again)
      const std::uint32_t keep = static_cast<std::uint32_t>(plan_.band()) - 1;
      if (step > keep + DpReleaser::kMinBlocked) return seek_blocked(st, key, round, step - keep, step, ahead_until);
    }
    const std::uint32_t at = st.frontier.at, to = std::min(step, at);
    // One batch: the steps restore() reads (the ring of `to`, and for a rewind the steps that entered the
    // running sum since), then those up to `step` when it is ahead of the frontier, then the simulation's.
    const std::pair<std::uint32_t, std::uint32_t> steps = Noise::rewind_steps(plan_, at, to);
    const std::uint32_t first = steps.first;  // a plain variable: clang 14 cannot capture a binding
    prepare(key, round, first - 1, std::max({steps.second, step, ahead_until}));
    counter_.restore(plan_, st.frontier, to, [&](std::uint32_t index) { return values_.at(index + 1 - first); });
    if (step > at) counter_.push_all(plan_, values_.data() + (at + 1 - first), step - at);
    store(st, key, round);
    return counter_;
  }
  int128 prefix(const Noise& n, std::uint64_t key, std::uint32_t round) const {
    return n.prefix_noise(
        plan_, kOne, [this, key, round](std::uint32_t i, std::size_t w) { return sample(prf_, key, round, i, w); },
        [this, key, round](std::uint32_t l, std::uint32_t j, std::size_t w) {
          return sample(prf_, key, round, j, w, noise::Family::BandedSelection, l);
        });
  }
  // A simulation from the frontier (the last test, just sought) up to `until`: its steps drawn now, and
  // the intervals of their prefix noise computed together (BandedNoise::intervals_ahead); the counter
  // catches up with the simulation only where the exact value is needed, and at its end.
  void begin_ahead(State& st, std::uint64_t key, std::uint32_t round, std::uint32_t until) {
    if (!holds(st, key, round)) throw std::logic_error("BandedSelection: simulation of a key not sought");
    from_ = counter_.at();
    if (until < from_) throw std::logic_error("BandedSelection: a simulation that ends before it starts");
    // Drawn by seek() already (values_ holds the key's steps prepared_from_ + 1 ..) or drawn now.
    if (prepared_from_ > from_ || prepared_from_ + values_.size() < until) prepare(key, round, from_, until);
    sim_ = values_.data() + (from_ - prepared_from_);
    sim_size_ = until - from_;
    edges_ready_ = false;  // computed when a step first needs them (take_all_bounded needs none)
    next_ = 0;
  }
  // Takes every step of the simulation at once (q + 1 .. its last) when one bound on their noise
  // (BandedNoise::run_bounds) makes each fail for `users` round users: returns the largest count that fails
  // at all of them (at least `users`), or PlainSteps::kNoCount and takes none. Most runs of keys far below
  // their threshold: neither the steps' intervals nor their tests are computed.
  std::int64_t take_all_bounded(std::uint32_t q, const PlainSteps& steps, std::int64_t users) {
    if (from_ + next_ != q || next_ != 0) throw std::logic_error("BandedSelection: a bounded run starts a simulation");
    const auto n = static_cast<std::uint32_t>(sim_size_);
    const banded::NoiseEdges e = counter_.run_bounds(plan_, kOne, sim_, n);
    const std::int64_t failing = steps.failing_users(e.above, q + 1, q + n);
    if (failing == PlainSteps::kNoCount || failing < users) return PlainSteps::kNoCount;
    next_ = n;
    return failing;
  }
  // The simulation's next step: an interval holding its prefix noise, the exact value when doubles
  // cannot bound it; exact_ahead() gives the value.
  std::pair<int128, int128> step_ahead(State& st, std::uint32_t q, std::uint64_t key, std::uint32_t round) {
    if (next_ >= sim_size_ || from_ + next_ + 1 != q) throw std::logic_error("BandedSelection: step not prepared");
    ensure_edges();
    if (const banded::NoiseInterval interval = edges_[next_++].interval(); interval.known())
      return {interval.lo, interval.hi};
    const int128 exact = exact_ahead(st, key, round);
    return {exact, exact};
  }
  // Takes the simulation's steps q + 1 .. at most `last` while plain(step, edges) holds of each one's
  // interval edges, and stops before the first that it does not; returns how many. For the steps a caller
  // would only pass over: cheaper than step_ahead() one at a time.
  template <class Plain>
  std::uint32_t take_plain(std::uint32_t q, std::uint32_t last, Plain&& plain) {
    if (from_ + next_ != q) throw std::logic_error("BandedSelection: step not prepared");
    ensure_edges();
    const std::size_t end = last > q ? std::min<std::size_t>(edges_.size(), next_ + (last - q)) : next_;
    const std::size_t first = next_;
    while (next_ < end && plain(q + static_cast<std::uint32_t>(next_ - first) + 1, edges_[next_])) ++next_;
    return static_cast<std::uint32_t>(next_ - first);
  }
  int128 exact_ahead(State& st, std::uint64_t key, std::uint32_t round) {
    end_ahead(st);
    return prefix(counter_, key, round);
  }
  // The counter, and the key's State, at the simulation's last step.
  void end_ahead(State& st) {
    const std::size_t pushed = counter_.at() - from_;
    counter_.push_all(plan_, sim_ + pushed, next_ - pushed);
    st.frontier = counter_.frontier();
  }
  std::uint64_t draws = 0;

  // Z of step index + 1 of a banded counter of `family` (or of block (level, index)), with `words` digits.
  static noise::NormalSample sample(noise::WindowPrf& prf, std::uint64_t key, std::uint32_t round, std::uint32_t index,
                                    std::size_t words, noise::Family family = noise::Family::BandedSelection,
                                    std::uint32_t level = 0) {  // level > 0: a blocked prefix's block
    noise::NodeStream s(prf, noise::NodeId{key, family, round, level, index});
    return noise::sample_normal(s, words);
  }

 private:
  // The counter at `step` >= p + b - 1 started blocked at p: the blocks in one batch, then steps p + 1 .. step
  // in another.
  const Noise& seek_blocked(State& st, std::uint64_t key, std::uint32_t round, std::uint32_t p, std::uint32_t step,
                            std::uint32_t ahead_until) {
    const std::uint32_t keep = static_cast<std::uint32_t>(plan_.band()) - 1;
    if (step < p + keep) throw std::logic_error("BandedSelection: a test before its blocked prefix's first");
    const auto blocks = banded::prefix_blocks(p);
    std::array<noise::NodeId, 32> ids;
    std::array<std::int64_t, 32> kept{};
    for (std::size_t i = 0; i < blocks.size(); ++i)
      ids[i] = {key, noise::Family::BandedSelection, round, blocks[i].level, blocks[i].index};
    noise::normal_fixed56_nodes(prf_, ids.data(), blocks.size(), kept.data());
    draws += blocks.size();
    std::size_t next = 0;
    const int128 sum = Noise::blocks_kept_sum(blocks, [&](std::uint32_t, std::uint32_t) { return kept[next++]; });
    prepare(key, round, p, std::max(step, ahead_until));
    counter_.reset();
    counter_.start_blocked(plan_, p, sum, values_.data());
    counter_.push_all(plan_, values_.data() + keep, step - p - keep);
    store(st, key, round);
    return counter_;
  }

  // Z~ of steps from+1..to (node index = step - 1).
  void prepare(std::uint64_t key, std::uint32_t round, std::uint32_t from, std::uint32_t to) {
    prepared_from_ = from;
    values_.resize(to > from ? to - from : 0);
    noise::normal_fixed56_run(prf_, {key, noise::Family::BandedSelection, round, 0, from}, values_.size(),
                              values_.data());
    draws += values_.size();
  }

  // The intervals of every prepared step (BandedNoise::intervals_ahead), from the counter at the simulation's start.
  void ensure_edges() {
    if (edges_ready_) return;
    if (counter_.at() != from_) throw std::logic_error("BandedSelection: intervals of a simulation under way");
    counter_.intervals_ahead(plan_, kOne, sim_, sim_size_, edges_);
    edges_ready_ = true;
  }

  // Whether counter_ is the key's counter at its State's step: the counter is a pure function of
  // (key, round, step) in a window, and its step is counter_.at().
  struct Held {
    std::uint64_t key = 0;
    std::uint32_t round = 0;
    bool valid = false;
  };
  bool holds(const State& st, std::uint64_t key, std::uint32_t round) const {
    return held_.valid && held_.key == key && held_.round == round && counter_.at() == st.frontier.at;
  }
  void store(State& st, std::uint64_t key, std::uint32_t round) {
    st.frontier = counter_.frontier();
    held_ = {key, round, true};
  }

  noise::WindowPrf& prf_;
  const banded::BandedPlan& plan_;
  Noise counter_;
  Held held_;
  std::vector<std::int64_t> values_;  // Z~ of the prepared steps, prepared_from_ + 1 ..
  std::uint32_t prepared_from_ = 0;
  const std::int64_t* sim_ = nullptr;  // the simulation's steps from_ + 1 .., in values_
  std::size_t sim_size_ = 0;
  std::vector<banded::NoiseEdges> edges_;  // of the prepared steps' noise intervals, once edges_ready_
  bool edges_ready_ = false;
  std::uint32_t from_ = 0;  // the frontier's step when the simulation began
  std::size_t next_ = 0;    // steps of the simulation taken
};

// A released value counter's noise at `leaf` on the grid q, banded, from its frontier at the last
// release (kept instead of the counter: 24 bytes, not 88): the ring of b - 1 samples drawn again
// (BandedNoise::restore), the steps since added, the frontier written back. The ring's steps and the
// new ones are one run of indices, drawn together into `z` (a key released again after hundreds of
// triggers draws hundreds of samples).
int128 banded_value_noise(banded::BandedFrontier& frontier, const banded::BandedPlan& plan, noise::WindowPrf& prf,
                          std::uint64_t key, noise::Family family, std::uint32_t leaf, std::int64_t q,
                          std::uint64_t& draws, std::vector<std::int64_t>& z) {
  const std::uint32_t from = frontier.at;
  const std::uint32_t first = banded::BandedNoise::rewind_steps(plan, from, from).first;  // its ring's oldest step
  const std::uint32_t last = std::max(from, leaf);  // steps first..last: the ring's, then the new ones
  z.resize(last + 1 - first);
  noise::normal_fixed56_run(prf, {key, family, 0, 0, first - 1}, z.size(), z.data());
  draws += z.size();
  const auto draw_kept = [&](std::uint32_t i) { return z.at(i + 1 - first); };
  banded::BandedNoise n;
  n.restore(plan, frontier, from, draw_kept);
  n.advance(plan, leaf, draw_kept);
  frontier = n.frontier();
  return n.prefix_noise(
      plan, q, [&](std::uint32_t i, std::size_t w) { return BandedSelection::sample(prf, key, 0, i, w, family); });
}
}  // namespace

DpReleaser::DpReleaser(DpParams params, const noise::Secret& secret, KeyScan scan)
    : params_(std::move(params)), scan_(scan), secret_(secret) {
#ifdef DPSTREAM_TEST_HOOKS
  apply_test_hooks(params_);
#endif
  if (params_.triggers < 1 || params_.triggers > dptree::kMaxSteps || params_.tau.size() != params_.triggers + 1u)
    throw std::invalid_argument("DpParams: need 1 <= T <= 2^20 and tau[0..T]");
  std::vector<double> thresholds(params_.tau.size());
  for (std::size_t s = 0; s < thresholds.size(); ++s) thresholds[s] = threshold(static_cast<std::uint32_t>(s));
  plain_steps_ = PlainSteps(thresholds, kOne);
  const bool banded_values = params_.value_counter == CounterKind::Banded;
  // Only the selection counter in use is built (the tree's sampler table costs a 320-bit computation).
  if (params_.selection_counter == CounterKind::Banded)
    selection_band_.emplace(params_.band, params_.sigma_selection);
  else
    selection_noise_.emplace(params_.sigma_selection);
  if (params_.release_count) {
    if (banded_values)
      count_band_.emplace(params_.band, params_.sigma_count);
    else
      count_noise_.emplace(params_.sigma_count);
  }
  if (params_.release_sum) {
    if (banded_values)
      sum_band_.emplace(params_.band, params_.sigma_sum);
    else
      sum_noise_.emplace(params_.sigma_sum);
  }
}

DpReleaser::~DpReleaser() { OPENSSL_cleanse(secret_.data(), secret_.size()); }

void DpReleaser::begin_window(std::int64_t window) {
  window_ = window;
  for (auto& c : tree_caches_) c.clear();
  for (auto& c : banded_caches_) c.clear();
  const auto clear = [](auto& shards) {
    for (auto& m : shards) m.clear();
  };
  clear(count_trees_), clear(sum_trees_), clear(count_bands_), clear(sum_bands_), clear(retested_);
  std::fill(journaled_entries_.begin(), journaled_entries_.end(), 0);
  std::fill(above_mu_.begin(), above_mu_.end(), 0);
  scan_all_next_ = true;
}

// A shard's first tests since the last drain are in its entries added since (every entry is added at its
// key's first test) and in the older ones tested again in a later round (retested_): of those, the ones still
// tested now (a key released since has nothing to keep). A counter started blocked at p was first tested at
// p + b - 1; one drawn step by step is the same from any step, and step 1 draws it so again on a resume.
std::vector<FirstTest> DpReleaser::drain_first_tests(const KeyStateTable& keys) {
  std::vector<FirstTest> all;
  if (!selection_band_) return all;  // the tree's noise is a function of its nodes alone
  const auto keep = static_cast<std::uint32_t>(selection_band_->band()) - 1;
  for (std::size_t s = 0; s < KeyStateTable::kShards; ++s) {
    auto& cache = banded_caches_[s];
    const auto emit = [&](std::uint32_t n) {
      const auto& e = cache.entry(n);
      if (BandedSelection::untested(e.noise)) return;
      const std::uint32_t blocked = e.noise.frontier.blocked;
      all.push_back({e.key, keys.at(e.key).round, blocked > 0 ? blocked + keep : 1});
    };
    for (std::uint32_t n = journaled_entries_[s]; n < cache.size(); ++n) emit(n);
    for (const std::uint32_t n : retested_[s])
      if (n < journaled_entries_[s]) emit(n);
    journaled_entries_[s] = cache.size();
    std::vector<std::uint32_t>().swap(retested_[s]);
  }
  return all;
}

// After begin_window (the caches are empty): each key still in the round of its first test is sought at
// that step, as its first test did (a blocked prefix or not, by the step); the next test goes on from there.
// A key released since is in a later round: its next test starts a new counter.
void DpReleaser::restore_first_tests(const std::vector<FirstTest>& tests, const KeyStateTable& keys) {
  if (!selection_band_) return;  // the tree's noise is a function of its nodes alone
  noise::WindowPrf prf(secret_, window_);
  BandedSelection selection(prf, *selection_band_);
  for (const FirstTest& t : tests) {
    const std::optional<KeyState> st = keys.find(t.key);
    if (!st || st->round != t.round) continue;
    auto& cache = banded_caches_[KeyStateTable::shard_of(t.key)];
    auto& entry = cache.entry(cache.find_or_add(t.key).first);
    if (BandedSelection::untested(entry.noise)) selection.seek(entry.noise, t.key, t.round, t.step);
  }
}

std::uint64_t DpReleaser::cached_keys() const {
  std::uint64_t n = 0;
  for (const auto& c : tree_caches_) n += c.size();
  for (const auto& c : banded_caches_) n += c.size();
  return n;
}

std::uint64_t DpReleaser::memory_bytes() const {
  std::uint64_t b = 0;
  for (const auto& c : tree_caches_) b += c.memory_bytes();
  for (const auto& c : banded_caches_) b += c.memory_bytes();
  const auto map_bytes = [](const auto& shards) {
    std::uint64_t n = 0;
    for (const auto& m : shards) n += hash_table_bytes(m);
    return n;
  };
  b += map_bytes(count_trees_) + map_bytes(sum_trees_) + map_bytes(count_bands_) + map_bytes(sum_bands_);
  for (const auto& shard : retested_) b += shard.capacity() * sizeof(std::uint32_t);
  return b;
}

// The threshold test of DP-SQLP Algorithm 2 at round step `step`: round users plus the counter's prefix
// noise (on the kOne grid) above mu + tau[step].
bool DpReleaser::passes(int128 prefix_noise, std::int64_t round_users, std::uint32_t step) const {
  const int128 noisy_users = int128{round_users} * kOne + prefix_noise;
  return to_double(noisy_users) > threshold(step) * static_cast<double>(kOne);
}

// passes() is monotone in the users: start at the real-valued boundary, then step to the exact one
// (the estimate is off by at most one: every quantity is far inside double's exact range).
double DpReleaser::failing_boundary(int128 prefix_noise, std::uint32_t step) const {
  return threshold(step) - to_double(prefix_noise) / static_cast<double>(kOne);
}

std::int64_t DpReleaser::max_failing_users(int128 prefix_noise, std::uint32_t step, double boundary) const {
  constexpr double kLimit = 0x1p50;            // users never come near this; noise numerators are bounded at plan time
  constexpr std::int64_t limit = kUsersLimit;  // also ends the steps if the boundary is not finite
  static_assert(static_cast<double>(limit) == kLimit);
  if (std::isnan(boundary)) return -limit;  // no count is known to fail: never quiet
  auto users = static_cast<std::int64_t>(std::floor(std::clamp(boundary, -kLimit, kLimit)));
  while (users > -limit && passes(prefix_noise, users, step)) --users;
  while (users < limit && !passes(prefix_noise, users + 1, step)) ++users;
  return users;
}

// The exact search only where the step can lower the bound: floor(boundary) is within one of the
// step's largest failing count while |boundary| < 2^30 (double's error there is far below one), so a
// boundary 2 or more above the bound cannot lower it (most steps of a simulation).
void DpReleaser::lower_quiet_bound(std::int64_t& quiet_users, int128 prefix_noise, std::uint32_t step) const {
  if (quiet_bound_holds(quiet_users, prefix_noise, prefix_noise, step)) return;
  quiet_users = std::min(quiet_users, max_failing_users(prefix_noise, step, failing_boundary(prefix_noise, step)));
}

// max_failing_users never rises with the noise (passes() is monotone in it), so for any noise in [lo, hi]
// it lies between its values at the two ends: equal ends give it without the exact noise. They differ
// only where a count's boundary falls inside the interval (a few grid units of 2^20 per user).
// At `lo` it is at least u = its value at `hi` (u fails at hi, so at lo), and equal iff u + 1 passes at lo:
// one test instead of a second search, for a u strictly inside the search's limits.
bool DpReleaser::lower_quiet_bound_within(std::int64_t& quiet_users, int128 lo, int128 hi, std::uint32_t step) const {
  const std::int64_t at_hi = max_failing_users(hi, step, failing_boundary(hi, step));
  if (lo != hi) {
    const bool inside = at_hi > -kUsersLimit && at_hi < kUsersLimit;
    if (inside ? !passes(lo, at_hi + 1, step) : max_failing_users(lo, step, failing_boundary(lo, step)) != at_hi)
      return false;
  }
  quiet_users = std::min(quiet_users, at_hi);
  return true;
}

// The boundary falls as the noise grows: its least value is at `hi`, its extremes at the two ends.
bool DpReleaser::quiet_bound_holds(std::int64_t quiet_users, int128 lo, int128 hi, std::uint32_t step) const {
  const double least = failing_boundary(hi, step), most = failing_boundary(lo, step);
  return std::abs(least) < 0x1p30 && std::abs(most) < 0x1p30 && least >= static_cast<double>(quiet_users) + 2;
}

std::vector<KeyRelease> DpReleaser::release(KeyStateTable& keys, std::uint32_t trigger, DpStats& stats) {
  if (trigger >= params_.triggers) throw std::out_of_range("trigger beyond T");
  if (selection_band_)
    return std::move(
        release_with<BandedSelection>(keys, trigger, 1, nullptr, stats, nullptr, nullptr, banded_caches_)[0]);
  return std::move(release_with<TreeSelection>(keys, trigger, 1, nullptr, stats, nullptr, nullptr, tree_caches_)[0]);
}

std::vector<std::vector<KeyRelease>> DpReleaser::release_batch(KeyStateTable& keys,
                                                               const std::vector<KeyStateTable::ShardedGroups>& batch,
                                                               std::uint32_t first_trigger, DpStats& stats,
                                                               std::vector<std::uint64_t>& visits_per_trigger,
                                                               double& accumulate_seconds) {
  const auto n = static_cast<std::uint32_t>(batch.size());
  if (n == 0) return {};
  if (first_trigger + std::uint64_t{n} > params_.triggers) throw std::out_of_range("trigger beyond T");
  if (selection_band_)
    return release_with<BandedSelection>(keys, first_trigger, n, &batch, stats, &visits_per_trigger,
                                         &accumulate_seconds, banded_caches_);
  return release_with<TreeSelection>(keys, first_trigger, n, &batch, stats, &visits_per_trigger, &accumulate_seconds,
                                     tree_caches_);
}

template <class Selection>
std::vector<std::vector<KeyRelease>> DpReleaser::release_with(KeyStateTable& keys, std::uint32_t first_trigger,
                                                              std::uint32_t triggers,
                                                              const std::vector<KeyStateTable::ShardedGroups>* batch,
                                                              DpStats& stats,
                                                              std::vector<std::uint64_t>* visits_per_trigger,
                                                              double* accumulate_seconds,
                                                              CacheShards<typename Selection::State>& caches) {
  const bool predict = scan_ == KeyScan::Predicted;
  // else a release since the last accumulate put some; a batch accumulates each shard just before its selection
  const bool states_current = batch != nullptr || keys.touched_states_current;
  std::vector<std::vector<std::vector<KeyRelease>>> out(triggers,
                                                        std::vector<std::vector<KeyRelease>>(KeyStateTable::kShards));
  std::vector<std::uint64_t> visits(triggers);
  std::uint64_t tested = 0, released = 0, draws = 0, visited = 0, simulated = 0, bounded = 0, scheduled = 0,
                discarded = 0, predicted = 0, quiet = 0;
  std::string error;        // an exception must not leave the OpenMP region: keep the first, rethrow after
  double accumulating = 0;  // summed over threads
  int threads = 1;
#pragma omp parallel reduction(+ : tested, released, draws, visited, simulated, bounded, scheduled, discarded, predicted, \
                                    quiet, accumulating)
  try {
#pragma omp single
    threads = omp_get_num_threads();
    noise::WindowPrf prf(secret_, window_);
    Selection selection = [&] {
      if constexpr (std::is_same_v<Selection, BandedSelection>)
        return Selection(prf, *selection_band_);
      else
        return Selection(prf, *selection_noise_);
    }();
    // Noise of one node of one tree family (drawn once per node per cache lifetime).
    auto drawer = [&](std::uint64_t key, noise::Family family, std::uint32_t round, const noise::DiscreteGaussian& dg) {
      return [&, key, family, round](std::uint32_t level, std::uint32_t index) {
        ++draws;
        return noise::node_noise(prf, {key, family, round, level, index}, dg);
      };
    };
    IntervalSum accumulate_time;             // this thread's accumulation within the call
    std::vector<std::uint32_t> due_entries;  // a shard's entries due at this trigger
    std::vector<std::int64_t> value_z;       // a released value counter's Z~ (banded_value_noise)
    const auto keep_first_error = [&](const char* what) {
#pragma omp critical(dp_release_error)
      if (error.empty()) error = what;
    };
#pragma omp for schedule(dynamic, 4)
    for (std::size_t s = 0; s < KeyStateTable::kShards; ++s) try {  // an exception may not leave the loop
        for (std::uint32_t nth = 0; nth < triggers; ++nth) {        // the batch's nth trigger
          const std::uint32_t trigger = first_trigger + nth;
          const std::uint32_t leaf = trigger + 1;  // value trees: leaf i is trigger i - 1
          const bool scan_all = !predict || (scan_all_next_ && nth == 0);
          if (batch != nullptr) {
            if (s == KeyStateTable::kShards / 2) fault::point("accumulate");
            const std::uint64_t t0 = IntervalSum::ticks();
            keys.accumulate_shard((*batch)[nth], s, params_.mu);
            accumulate_time.add_since(t0);
          }
          const std::uint64_t visited_before = visited;
          if (s == KeyStateTable::kShards / 2) fault::point("dp_release");
          auto& cache = caches[s];
          using Cache = std::remove_reference_t<decltype(cache)>;
          std::uint64_t above = scan_all ? 0 : above_mu_[s], shard_released = 0;

          // One key at this trigger: the full scan's threshold test; then, if it failed and prediction is
          // on, the simulation of its next steps with no new user, which schedules its next visit.
          // `known`: the key's cache entry when the caller has found it already.
          auto visit = [&](std::uint64_t key, KeyState st, bool touched, std::uint32_t known = Cache::kNone) {
            ++visited;
            const std::int64_t round_users = st.users - st.round_base_users;
            if (static_cast<double>(round_users) <= params_.mu) return;  // never tested: no tiny keys
            const std::uint32_t step = trigger - st.round_start + 1;     // the round's leaf for this trigger
            const std::uint32_t entry = known != Cache::kNone ? known : cache.find_or_add(key).first;
            auto& c = cache.entry(entry);  // of the key's current round: a release resets it
            const bool first_test = Selection::untested(c.noise);
            if (scan_all || first_test) ++above;  // first test of its round (users only grow in a round)
            const auto next = cache.visit(entry, trigger);
            if (next == Cache::Visit::Later) ++discarded;            // new records came first (case 1)
            const bool due = !touched && next == Cache::Visit::Due;  // visited for its prediction alone
            cache.unschedule(entry);
            // Should the test fail, the simulation looks kHorizon steps ahead (to the window's end at most): new
            // records that pass the quiet bound make the steps simulated past them a redraw (touched keys
            // included: most new records stay quiet; one step after new records visited 1.5x the keys for
            // 0.2% fewer draws). Its steps are drawn with the test's.
            const std::uint32_t last = params_.triggers - st.round_start;  // the round's last step in the window
            const bool simulate = predict && step < last;
            const std::uint32_t until = simulate ? std::min(last, step + kHorizon) : 0;
            const auto& noise_now = selection.seek(c.noise, key, st.round, step, until);
            if constexpr (std::is_same_v<Selection, BandedSelection>)
              if (first_test && journal_first_tests && entry < journaled_entries_[s]) retested_[s].push_back(entry);
            if (passes(selection.prefix(noise_now, key, st.round), round_users, step)) {
              KeyRelease r{key, 0, 0};  // 128-bit values: no total plus noise can overflow (record.hpp)
              if (count_noise_) {
                dptree::PrefixNoise& n = count_trees_[s][key];
                n.advance(leaf, drawer(key, noise::Family::Count, 0, *count_noise_));
                r.count = int128{st.count} * kOne + n.prefix_noise(kOne);
              }
              if (count_band_)
                r.count = int128{st.count} * kOne + banded_value_noise(count_bands_[s][key], *count_band_, prf, key,
                                                                       noise::Family::BandedCount, leaf, kOne, draws,
                                                                       value_z);
              if (sum_noise_) {
                dptree::PrefixNoise& n = sum_trees_[s][key];
                n.advance(leaf, drawer(key, noise::Family::Sum, 0, *sum_noise_));
                r.sum = st.sum + n.prefix_noise(params_.sum_quantum);
              }
              if (sum_band_)
                r.sum = st.sum + banded_value_noise(sum_bands_[s][key], *sum_band_, prf, key, noise::Family::BandedSum,
                                                    leaf, params_.sum_quantum, draws, value_z);
              out[nth][s].push_back(r);
              ++shard_released;
              predicted += due;
              // The next round counts users new to the key after this trigger, in a fresh tree; the key is
              // visited again when it gets records (case 2 of Algorithm 4).
              ++st.round;
              st.round_start = trigger + 1;
              st.round_base_users = st.users;
              keys.put(key, st);
              keys.mark_changed(key);
              Selection::reset(c.noise);
              return;
            }
            if (!simulate) return;
            selection.begin_ahead(c.noise, key, st.round, until);
            std::int64_t quiet_users = std::numeric_limits<std::int64_t>::max();
            std::uint32_t q = step;
            // A run that one bound on its noise shows failing at every step is taken at once; the bound's count
            // is its quiet bound (lower than the steps' own would be: it only leaves more new records to visit).
            if (const std::int64_t failing = selection.take_all_bounded(q, plain_steps_, round_users);
                failing != PlainSteps::kNoCount) {
              simulated += until - q;
              bounded += until - q;
              q = until;
              quiet_users = failing;
            }
            // A step that fails at both ends of its interval and leaves the quiet bound as it is changes
            // nothing (most steps): such steps are taken in bulk (PlainSteps), the others one at a time below.
            while (q < until) {
              const double floor = plain_steps_.floor_units(round_users, quiet_users);
              const auto plain = [&](std::uint32_t step_at, const banded::NoiseEdges& e) {
                return plain_steps_.plain(e, floor, step_at);
              };
              const std::uint32_t taken = selection.take_plain(q, until - 1, plain);  // never the last step
              q += taken;
              simulated += taken;
              ++q;
              ++simulated;
              // The test's noise, within [lo, hi]: passes() and the quiet bound's shortcut are monotone in
              // it, so both ends agreeing decide them; else the exact value (a boundary within a few grid units).
              // (Plain locals, no lambda capturing them: they stay in registers in this per-step loop.)
              auto [lo, hi] = selection.step_ahead(c.noise, q, key, st.round);
              if (lo != hi && passes(hi, round_users, q) && !passes(lo, round_users, q))
                lo = hi = selection.exact_ahead(c.noise, key, st.round);
              if (passes(lo, round_users, q)) break;  // its predicted release (nodes drawn past it: unused)
              if (q == until || quiet_bound_holds(quiet_users, lo, hi, q)) continue;
              if (lower_quiet_bound_within(quiet_users, lo, hi, q)) continue;
              lower_quiet_bound(quiet_users, selection.exact_ahead(c.noise, key, st.round), q);
            }
            selection.end_ahead(c.noise);
            c.set_quiet_users(quiet_users);  // stored clamped to 2^24 - 1, never above the bound
            cache.schedule(entry, st.round_start + q - 1, trigger);
            ++scheduled;
          };

          if (scan_all) {
            keys.for_each_in(s, [&](std::uint64_t key, const KeyState& st) { visit(key, st, false); });
          } else {
            // The touched keys come with their states (accumulate's, unless a release came since); their cache
            // entries are DRAM misses, independent per key: the index slots kAhead keys ahead, the first kAhead
            // before the walk (at T = 1000 a shard lists ~15 keys per trigger), then halfway there the entry.
            // Each key's hash comes with it (accumulate's partition::key_hash, the cache index's too).
            constexpr std::size_t kAhead = 8;
            const auto& touched = keys.touched[s];
            for (std::size_t j = 0; j < std::min(kAhead, touched.size()); ++j) cache.prefetch_hashed(touched[j].hash);
            visited += keys.touched_below[s];  // at or below mu: never tested, not listed (accumulate's filter)
            for (std::size_t i = 0; i < touched.size(); ++i) {
              if (i + kAhead < touched.size()) cache.prefetch_hashed(touched[i + kAhead].hash);
              if (i + kAhead / 2 < touched.size()) cache.prefetch_entry_of_hashed(touched[i + kAhead / 2].hash);
              const std::uint64_t key = touched[i].key;
              const KeyState st = states_current ? touched[i].state : keys.at(key);
              if (st.round_users() <= params_.mu) {
                ++visited;  // never tested (as visit() finds first)
                continue;
              }
              const std::uint32_t n = cache.find_hashed(key, touched[i].hash);
              // New records that leave the round's users within the quiet bound change no test before
              // the scheduled visit (every one of those steps fails for any count up to the bound), so the
              // schedule and its simulated nodes stay valid: no visit now.
              if (n != Cache::kNone) {
                if (cache.visit(n, trigger) == Cache::Visit::Later &&
                    st.users - st.round_base_users <= cache.entry(n).quiet_users()) {
                  ++quiet;
                  continue;
                }
              }
              visit(key, st, true, n);
            }
            // The keys due for their scheduled visit alone (the touched ones were visited above): entries
            // fetched 2 kAhead ahead, so that their keys' lookups kAhead ahead read them from cache.
            cache.due(trigger, due_entries);
            for (std::size_t j = 0; j < std::min(2 * kAhead, due_entries.size()); ++j)
              cache.prefetch_entry(due_entries[j]);
            // The first kAhead keys' slots too (a shard has a few due keys a trigger at T = 1000: most are among
            // them); their entries' loads overlap, as they were just prefetched.
            for (std::size_t j = 0; j < std::min(kAhead, due_entries.size()); ++j)
              keys.prefetch(cache.entry(due_entries[j]).key);
            for (std::size_t i = 0; i < due_entries.size(); ++i) {
              if (i + 2 * kAhead < due_entries.size()) cache.prefetch_entry(due_entries[i + 2 * kAhead]);
              if (i + kAhead < due_entries.size()) keys.prefetch(cache.entry(due_entries[i + kAhead]).key);
              const std::uint64_t key = cache.entry(due_entries[i]).key;
              visit(key, keys.at(key), false, due_entries[i]);
            }
          }
          tested += above;  // every key above mu is tested at every trigger, visited or not
          above_mu_[s] = above - shard_released;
          released += shard_released;
#pragma omp atomic
          visits[nth] += visited - visited_before;
        }
      } catch (const std::exception& e) {
        keep_first_error(e.what());
      }
    draws += selection.draws;
    accumulating += accumulate_time.seconds();
  } catch (const std::exception& e) {
#pragma omp critical(dp_release_error)
    if (error.empty()) error = e.what();
  }
  keys.touched_states_current = false;
  if (!error.empty()) throw std::runtime_error("DP release: " + error);
  scan_all_next_ = false;
  stats.tested += tested;
  stats.released += released;
  stats.noise_draws += draws;
  stats.visited += visited;
  stats.simulated += simulated;
  stats.bounded += bounded;
  stats.scheduled += scheduled;
  stats.discarded += discarded;
  stats.predicted += predicted;
  stats.quiet += quiet;
  if (accumulate_seconds != nullptr) *accumulate_seconds += accumulating / threads;
  if (visits_per_trigger != nullptr)
    visits_per_trigger->insert(visits_per_trigger->end(), visits.begin(), visits.end());
  std::vector<std::vector<KeyRelease>> rows(triggers);
  for (std::uint32_t i = 0; i < triggers; ++i) {
    for (auto& o : out[i]) rows[i].insert(rows[i].end(), o.begin(), o.end());
    std::sort(rows[i].begin(), rows[i].end(), [](const KeyRelease& a, const KeyRelease& b) { return a.key < b.key; });
  }
  return rows;
}

}  // namespace dpstream::kernels
