// One trigger through the engine, on every rank: route records by user -> bound each user's
// contribution -> route per-key partials by key -> accumulate -> release (docs/DESIGN-NOTES.md).
// Holds references to the run's state; every step is a collective.
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

  // This rank's records of the trigger in; the rows of the keys this rank owns out, sorted by key.
  std::vector<KeyRelease> process(std::vector<Record> local, std::uint32_t trigger);

 private:
  std::vector<Record> route_by_user(std::vector<Record> local);            // 1. to the user's owner
  std::vector<KeyPartial> bound(std::vector<Record> owned);                // 2. at most C records per user
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
