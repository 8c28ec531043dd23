#include "src/trigger_pipeline.hpp"

#include <span>
#include <utility>

#include "common/elapsed.hpp"
#include "partition/hash.hpp"
#include "partition/partitioner.hpp"
#include "src/errors.hpp"

namespace dpstream {

namespace {
// Adds the seconds since construction to `into` when it goes out of scope.
class StageTimer {
 public:
  explicit StageTimer(double& into) : into_(into), t0_(SteadyClock::now()) {}
  ~StageTimer() { into_ += seconds_since(t0_); }
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;

 private:
  double& into_;
  SteadyClock::time_point t0_;
};
}  // namespace

std::vector<KeyRelease> TriggerPipeline::release(std::vector<KeyPartial> partials, std::uint32_t trigger) {
  return accumulate_and_release(route_by_key(std::move(partials)), trigger);
}

std::vector<Record> TriggerPipeline::route_by_user(std::vector<Record> local) {
  const int P = comm_.size();
  partition::Partitioned<Record> by_user;
  {
    StageTimer timer(stage_.partition_user);
    by_user = partition::partition_by(local, static_cast<std::size_t>(P),
                                      [P](const Record& r) { return partition::user_owner(r.user, P); });
    std::vector<Record>().swap(local);
  }
  StageTimer timer(stage_.shuffle_user);
  return comm_.alltoallv(by_user.items, by_user.offsets, &counters_.user_traffic, "shuffle_user");
}

std::vector<std::vector<KeyPartial>> TriggerPipeline::bound(std::vector<std::vector<Record>> owned) {
  StageTimer timer(stage_.bounding);
  const std::vector<std::span<const Record>> triggers(owned.begin(), owned.end());
  std::vector<std::vector<KeyPartial>> partials;
  shuffle::on_all_ranks<InputError>(
      comm_, [&] { partials = kernels::bound_and_aggregate_batch(triggers, bounding_, users_, counters_.bounding); });
  return partials;
}

std::vector<KeyPartial> TriggerPipeline::route_by_key(std::vector<KeyPartial> partials) {
  const int P = comm_.size();
  partition::Partitioned<KeyPartial> by_key;
  {
    StageTimer timer(stage_.partition_key);
    by_key = partition::partition_by(partials, static_cast<std::size_t>(P),
                                     [P](const KeyPartial& p) { return partition::key_owner(p.key, P); });
    std::vector<KeyPartial>().swap(partials);
  }
  StageTimer timer(stage_.shuffle_key);
  return comm_.alltoallv(by_key.items, by_key.offsets, &counters_.key_traffic, "shuffle_key");
}

std::vector<KeyRelease> TriggerPipeline::accumulate_and_release(std::vector<KeyPartial> owned, std::uint32_t trigger) {
  std::vector<KeyTotals> reported;
  {
    StageTimer timer(stage_.accumulate);
    shuffle::on_all_ranks<InputError>(comm_, [&] {
      reported = keys_.accumulate(std::move(owned), releaser_.accumulation(), releaser_.touched_above());
    });
    std::vector<KeyPartial>().swap(owned);
  }
  StageTimer timer(stage_.dp_release);
  std::vector<KeyRelease> rows;
  const std::uint64_t visited_before = counters_.dp.visited;
  shuffle::on_all_ranks<InputError>(
      comm_, [&] { rows = releaser_.release(std::move(reported), keys_, trigger, counters_.dp); });
  counters_.visits_per_trigger.push_back(counters_.dp.visited - visited_before);
  return rows;
}

}  // namespace dpstream
