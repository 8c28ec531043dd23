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

// Each batch's items grouped by owner (partition_by): what an exchange sends, and each owner's first place.
template <class T>
struct Grouped {
  std::vector<DefaultInitVector<T>> items;
  std::vector<std::vector<std::uint64_t>> offsets;
};
template <class T, class OwnerFn>
Grouped<T> group_by_owner(std::vector<std::vector<T>> batches, int P, OwnerFn owner) {
  Grouped<T> grouped{std::vector<DefaultInitVector<T>>(batches.size()),
                     std::vector<std::vector<std::uint64_t>>(batches.size())};
  for (std::size_t b = 0; b < batches.size(); ++b) {
    auto by_owner = partition::partition_by(batches[b], static_cast<std::size_t>(P),
                                            [&owner, P](const T& item) { return owner(item, P); });
    std::vector<T>().swap(batches[b]);
    grouped.items[b] = std::move(by_owner.items);
    grouped.offsets[b] = std::move(by_owner.offsets);
  }
  return grouped;
}
}  // namespace

TriggerPipeline::OwnedRecords TriggerPipeline::route_by_user(std::vector<std::vector<Record>> local) {
  Grouped<Record> grouped;
  {
    StageTimer timer(stage_.partition_user);
    grouped = group_by_owner(std::move(local), comm_.size(),
                             [](const Record& r, int P) { return partition::user_owner(r.user, P); });
  }
  StageTimer timer(stage_.shuffle_user);
  auto received = comm_.alltoallv_batches<Record, DefaultInitVector<Record>>(
      grouped.items, grouped.offsets, &counters_.user_traffic, "shuffle_user", shuffle::Comm::Own::kKept);
  return {std::move(grouped.items), std::move(grouped.offsets), std::move(received)};
}

std::vector<std::vector<KeyPartial>> TriggerPipeline::bound(OwnedRecords owned) {
  StageTimer timer(stage_.bounding);
  const auto me = static_cast<std::size_t>(comm_.rank());
  std::vector<kernels::RecordPieces> triggers;
  for (std::size_t t = 0; t < owned.grouped.size(); ++t) {
    const std::span<const Record> kept(owned.grouped[t].data() + owned.offsets[t][me],
                                       owned.offsets[t][me + 1] - owned.offsets[t][me]);
    triggers.push_back({kept, std::span<const Record>(owned.received[t])});
  }
  std::vector<std::vector<KeyPartial>> partials;
  shuffle::on_all_ranks<InputError>(
      comm_, [&] { partials = kernels::bound_and_aggregate_pieces(triggers, bounding_, users_, counters_.bounding); });
  return partials;
}

std::vector<std::vector<KeyPartial>> TriggerPipeline::route_by_key(std::vector<std::vector<KeyPartial>> partials) {
  Grouped<KeyPartial> grouped;
  {
    StageTimer timer(stage_.partition_key);
    grouped = group_by_owner(std::move(partials), comm_.size(),
                             [](const KeyPartial& p, int P) { return partition::key_owner(p.key, P); });
  }
  StageTimer timer(stage_.shuffle_key);
  return comm_.alltoallv_batches<KeyPartial, std::vector<KeyPartial>>(grouped.items, grouped.offsets,
                                                                      &counters_.key_traffic, "shuffle_key");
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
