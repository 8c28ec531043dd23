#include "src/trigger_pipeline.hpp"

#include <span>
#include <utility>

#include "common/default_init.hpp"
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

// Each batch's items grouped by owner (partition_by), exchanged at once (Comm::alltoallv_batches) into
// vectors of type Out.
template <class T, class Out, class OwnerFn>
std::vector<Out> route_batches(const shuffle::Comm& comm, std::vector<std::vector<T>> batches, OwnerFn owner,
                               double& partition_seconds, double& shuffle_seconds, shuffle::TrafficCounter* traffic,
                               const char* fault_point) {
  const int P = comm.size();
  std::vector<DefaultInitVector<T>> items(batches.size());
  std::vector<std::vector<std::uint64_t>> offsets(batches.size());
  {
    StageTimer timer(partition_seconds);
    for (std::size_t b = 0; b < batches.size(); ++b) {
      auto grouped = partition::partition_by(batches[b], static_cast<std::size_t>(P),
                                             [&owner, P](const T& item) { return owner(item, P); });
      std::vector<T>().swap(batches[b]);
      items[b] = std::move(grouped.items);
      offsets[b] = std::move(grouped.offsets);
    }
  }
  StageTimer timer(shuffle_seconds);
  return comm.alltoallv_batches<T, Out>(items, offsets, traffic, fault_point);
}
}  // namespace

std::vector<DefaultInitVector<Record>> TriggerPipeline::route_by_user(std::vector<std::vector<Record>> local) {
  return route_batches<Record, DefaultInitVector<Record>>(
      comm_, std::move(local), [](const Record& r, int P) { return partition::user_owner(r.user, P); },
      stage_.partition_user, stage_.shuffle_user, &counters_.user_traffic, "shuffle_user");
}

std::vector<std::vector<KeyPartial>> TriggerPipeline::bound(std::vector<DefaultInitVector<Record>> owned) {
  StageTimer timer(stage_.bounding);
  const std::vector<std::span<const Record>> triggers(owned.begin(), owned.end());
  std::vector<std::vector<KeyPartial>> partials;
  shuffle::on_all_ranks<InputError>(
      comm_, [&] { partials = kernels::bound_and_aggregate_batch(triggers, bounding_, users_, counters_.bounding); });
  return partials;
}

std::vector<std::vector<KeyPartial>> TriggerPipeline::route_by_key(std::vector<std::vector<KeyPartial>> partials) {
  return route_batches<KeyPartial, std::vector<KeyPartial>>(
      comm_, std::move(partials), [](const KeyPartial& p, int P) { return partition::key_owner(p.key, P); },
      stage_.partition_key, stage_.shuffle_key, &counters_.key_traffic, "shuffle_key");
}

std::vector<std::vector<KeyRelease>> TriggerPipeline::release(std::vector<std::vector<KeyPartial>> partials,
                                                              std::uint32_t first_trigger) {
  std::vector<std::vector<KeyPartial>> owned = route_by_key(std::move(partials));
  std::vector<std::vector<KeyRelease>> rows;
  // A rank that fails at one trigger releases none after it; every rank learns of it at the batch's end.
  const auto t0 = SteadyClock::now();
  const double timed_before = stage_.accumulate + stage_.dp_release;
  shuffle::on_all_ranks<InputError>(comm_, [&] {
    rows = releaser_.release_batch(std::move(owned), keys_, first_trigger, counters_.dp, counters_.visits_per_trigger,
                                   stage_.accumulate);
  });
  // The agreement's wait counts as key selection's, as when each trigger's release ended with one.
  const double timed_inside = stage_.accumulate + stage_.dp_release - timed_before;
  stage_.dp_release += seconds_since(t0) - timed_inside;
  return rows;
}

}  // namespace dpstream
