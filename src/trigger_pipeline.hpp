// Triggers through the engine, on every rank: route records by user -> bound each user's
// contribution -> route per-key partials by key -> accumulate -> release (docs/DESIGN-NOTES.md).
// Every step takes a batch of consecutive triggers of a window at once: one exchange each way, one pass
// over the user state, and the keys' steps trigger by trigger, in order (DP-SQLP: shard by shard, each
// shard through the batch's triggers in order; the same rows). Holds references to the run's
// state; every step is a collective.
#pragma once

#include <cstdint>
#include <vector>

#include "common/default_init.hpp"
#include "common/record.hpp"
#include "kernels/bounding.hpp"
#include "kernels/key_accumulate.hpp"
#include "kernels/releaser.hpp"
#include "shuffle/comm.hpp"
#include "src/run_counters.hpp"

namespace dpstream {

class TriggerPipeline {
 public:
  TriggerPipeline(const shuffle::Comm& comm, const kernels::BoundingParams& bounding, kernels::UserState& users,
                  kernels::KeyStateTable& keys, kernels::Releaser& releaser, RunCounters& counters, StageTimes& stage)
      : comm_(comm),
        bounding_(bounding),
        users_(users),
        keys_(keys),
        releaser_(releaser),
        counters_(counters),
        stage_(stage) {}

  // A batch's triggers go through each step together, so that the ranks synchronize a few times per batch
  // instead of at every trigger (at T = 1000 each trigger is small, and every synchronization waits for
  // the slower rank).
  // 1. This rank's records of each trigger to their users' owners (one exchange): per trigger, the records
  // of those users this rank owns (received into vectors that are not zero-filled first).
  std::vector<DefaultInitVector<Record>> route_by_user(std::vector<std::vector<Record>> local);
  // 2. At most C records per user: the owned records of a batch's triggers (in trigger order) in, each
  // trigger's partials out, as bounding trigger by trigger would give them.
  std::vector<std::vector<KeyPartial>> bound(std::vector<DefaultInitVector<Record>> owned);
  // 3.-4. Each trigger's partials to the rows of the keys this rank owns, sorted by key: routed in one
  // exchange, then accumulated and released trigger by trigger (`first_trigger` the batch's first), with
  // one agreement on errors for the batch. Releaser::release_batch takes the batch whole (DP-SQLP: each key
  // shard through all of the batch's triggers before the next shard).
  std::vector<std::vector<KeyRelease>> release(std::vector<std::vector<KeyPartial>> partials,
                                               std::uint32_t first_trigger);

 private:
  std::vector<std::vector<KeyPartial>> route_by_key(std::vector<std::vector<KeyPartial>> partials);  // 3.

  const shuffle::Comm& comm_;
  const kernels::BoundingParams bounding_;
  kernels::UserState& users_;
  kernels::KeyStateTable& keys_;
  kernels::Releaser& releaser_;
  RunCounters& counters_;
  StageTimes& stage_;
};

}  // namespace dpstream
