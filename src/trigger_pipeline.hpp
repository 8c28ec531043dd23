// Triggers through the engine, on every rank: route records by user -> bound each user's
// contribution -> route per-key partials by key -> accumulate -> release (docs/DESIGN-NOTES.md).
// The first two steps take a batch of consecutive triggers of a window at once (one pass over the user
// state), the others one trigger at a time, in order. Holds references to the run's state; every step is
// a collective.
#pragma once

#include <cstdint>
#include <vector>

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

  // 1. This rank's records of a trigger to their users' owners: the records of those users this rank owns.
  std::vector<Record> route_by_user(std::vector<Record> local);
  // 2. At most C records per user: the owned records of a batch's triggers (in trigger order) in, each
  // trigger's partials out, as bounding trigger by trigger would give them.
  std::vector<std::vector<KeyPartial>> bound(std::vector<std::vector<Record>> owned);
  // 3.-4. One trigger's partials (the triggers of a batch in order) to the rows of the keys this rank owns,
  // sorted by key.
  std::vector<KeyRelease> release(std::vector<KeyPartial> partials, std::uint32_t trigger);

 private:
  std::vector<KeyPartial> route_by_key(std::vector<KeyPartial> partials);  // 3. to the key's owner
  std::vector<KeyRelease> accumulate_and_release(std::vector<KeyPartial> owned, std::uint32_t trigger);  // 4.

  const shuffle::Comm& comm_;
  const kernels::BoundingParams bounding_;
  kernels::UserState& users_;
  kernels::KeyStateTable& keys_;
  kernels::Releaser& releaser_;
  RunCounters& counters_;
  StageTimes& stage_;
};

}  // namespace dpstream
