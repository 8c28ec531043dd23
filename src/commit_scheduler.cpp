#include "src/commit_scheduler.hpp"

#include <memory>
#include <stdexcept>
#include <string>

#include "common/elapsed.hpp"
#include "src/stop_request.hpp"

namespace dpstream {

namespace {

// One agreement at the end of every batch of triggers (one small allgather): a stop signal seen by any rank,
// whether rank 0's commit clock has run out (the ranks' clocks differ; rank 0's decides for all), and
// whether any rank's journal has reached its byte bound.
struct TriggerEnd {
  StopAgreement stop;
  bool clock_due = false;
  bool journal_full = false;
};
TriggerEnd agree_on_trigger_end(const shuffle::Comm& comm, bool clock_due_on_root, bool journal_full_here) {
  constexpr std::uint64_t kClockDue = std::uint64_t{1} << 32;  // above any signal number
  constexpr std::uint64_t kJournalFull = std::uint64_t{1} << 33;
  const auto seen = comm.allgather(static_cast<std::uint64_t>(stop_request::signal_received()) |
                                   (clock_due_on_root ? kClockDue : 0) | (journal_full_here ? kJournalFull : 0));
  TriggerEnd end;
  end.clock_due = (seen.at(0) & kClockDue) != 0;
  for (const std::uint64_t word : seen) end.journal_full |= (word & kJournalFull) != 0;
  for (std::size_t r = 0; r < seen.size(); ++r)
    if (const auto signal = seen[r] & (kClockDue - 1); signal != 0) {
      end.stop = {static_cast<int>(signal), static_cast<int>(r)};
      break;
    }
  return end;
}
}  // namespace

CommitScheduler::CommitScheduler(const JobConfig& config, const shuffle::Comm& comm, bool checkpointing,
                                 checkpoint::Store& store, ReleaseWriter* writer, kernels::UserState& users,
                                 kernels::KeyStateTable& keys, kernels::Releaser& releaser, RunCounters& counters,
                                 StageTimes& stage)
    : config_(config),
      comm_(comm),
      checkpointing_(checkpointing),
      store_(store),
      writer_(writer),
      users_(users),
      keys_(keys),
      releaser_(releaser),
      counters_(counters),
      stage_(stage) {}

void CommitScheduler::start_at(std::uint32_t first_trigger) {
  uncommitted_from_ = first_trigger;
  last_commit_ = Clock::now();
}

StopAgreement CommitScheduler::end_trigger(std::uint32_t wi, std::uint32_t trigger, bool last_of_job, bool batch_end) {
  const bool root = comm_.rank() == 0;
  // Agreed at a batch's end only: within a batch nothing is committed and no stop taken, and what the
  // agreement reads (a signal received, the clock, the journal's size) can only have grown by its end.
  const TriggerEnd end =
      last_of_job || !batch_end
          ? TriggerEnd{}
          : agree_on_trigger_end(comm_, root && checkpointing_ && clock_ran_out(), checkpointing_ && journal_full());
  // At the end of each window, every `every` triggers, once any rank's journal is full, or every
  // `seconds`; the job's very last commit waits for summary.json.
  committed_now_ = false;
  const bool window_end = trigger + 1 == config_.stream.triggers;
  const bool count_due = config_.checkpoint.every && trigger + 1 - uncommitted_from_ >= *config_.checkpoint.every;
  if (window_end && !batch_end) throw std::logic_error("CommitScheduler: a batch ran past its window's end");
  const std::optional<CommitCause> cause = window_end         ? CommitCause::WindowEnd
                                           : deferred_        ? deferred_
                                           : count_due        ? CommitCause::Every
                                           : end.journal_full ? CommitCause::Journal
                                           : end.clock_due    ? CommitCause::Seconds
                                                              : std::optional<CommitCause>();
  if (checkpointing_ && cause && !batch_end) {
    deferred_ = cause;
    return end.stop;
  }
  deferred_.reset();
  if (checkpointing_ && cause) {
    count(*cause);
    if (wi + 1 == config_.stream.windows && window_end) {
      final_commit_pending_ = true;
    } else {
      commit(wi, uncommitted_from_, trigger + 1, false);
      uncommitted_from_ = window_end ? 0 : trigger + 1;
      committed_now_ = true;
    }
  }
  return end.stop;
}

void CommitScheduler::count(CommitCause cause) {
  if (comm_.rank() == 0) ++counters_.commits_by_cause[static_cast<std::size_t>(cause)];
}

bool CommitScheduler::clock_ran_out() const { return seconds_since(last_commit_) >= config_.checkpoint.seconds; }

bool CommitScheduler::journal_full() const {
  return checkpoint::estimate_journal(users_, keys_).bytes() >= std::uint64_t{config_.checkpoint.journal_mib} << 20;
}

void CommitScheduler::commit_for_stop(std::uint32_t wi, std::uint32_t trigger) {
  if (!checkpointing_ || committed_now_) return;
  count(CommitCause::Stop);
  commit(wi, uncommitted_from_, trigger + 1, false);
}

void CommitScheduler::finish_stopped() {
  if (checkpointing_) figures_.add(store_.finish());
}

void CommitScheduler::write_last_commit() {
  if (!final_commit_pending_) return;
  commit(config_.stream.windows - 1, uncommitted_from_, config_.stream.triggers, true);
  final_commit_pending_ = false;
  users_.clear();
  keys_.clear();
  figures_.add(store_.await_writes());
}

void CommitScheduler::finish_job(const nlohmann::json& summary) {
  write_last_commit();
  if (checkpointing_) figures_.add(store_.finish(summary));
}

nlohmann::json CommitScheduler::json(std::optional<std::uint32_t> resumed_from) const {
  if (!checkpointing_) return nullptr;
  nlohmann::json j = figures_.json(comm_, figures_.commits + (final_commit_pending_ ? 1 : 0));
  j["every"] = config_.checkpoint.every ? nlohmann::json(*config_.checkpoint.every) : nlohmann::json(nullptr);
  j["seconds"] = config_.checkpoint.seconds;
  j["journal_mib"] = config_.checkpoint.journal_mib;
  // The job's, over all its runs (carried in the manifest's counters); `commits` is this run's.
  const auto by_cause =
      comm_.sum(std::vector<std::uint64_t>(counters_.commits_by_cause.begin(), counters_.commits_by_cause.end()));
  j["commits_by_cause"] = nlohmann::json::object();
  for (std::size_t c = 0; c < by_cause.size(); ++c) j["commits_by_cause"][kCommitCauseNames[c]] = by_cause[c];
  j["resumed_from_commit"] = resumed_from ? nlohmann::json(*resumed_from) : nlohmann::json(nullptr);
  return j;
}

// One commit: every rank's state changes since the last one, rank 0's rows, the counters. The
// files are written in the background; the commit becomes visible during the next trigger.
void CommitScheduler::commit(std::uint32_t wi, std::uint32_t first_trigger, std::uint32_t next_trigger, bool complete) {
  const bool root = comm_.rank() == 0;
  const auto c0 = Clock::now();
  // A window's last commit carries no state: the next window starts empty, and a resume from that
  // commit reads none (Store::load, window_done). Writing it would put the whole window on the
  // critical path of the window's end. Its journal is dropped with the state (or the job ends).
  auto journal = std::make_shared<checkpoint::Journal>();
  if (next_trigger != config_.stream.triggers)
    *journal =
        checkpoint::drain_journal(users_, keys_, releaser_.drain_first_tests(keys_));  // else they go with clear()
  figures_.journal += seconds_since(c0);
  figures_.user_bytes += journal->user_bytes();
  figures_.key_bytes += journal->key_bytes();
  std::string rows = root ? writer_->take_pending() : std::string();
  figures_.release_bytes += rows.size();
  const auto sums = counters_.global_sums(comm_);
  figures_.add(store_.commit(std::move(journal), std::move(rows), {wi, first_trigger, next_trigger, complete}, sums,
                             root ? writer_->committed() : ReleasesExtent{}));
  ++figures_.commits;
  stage_.checkpoint += seconds_since(c0);
  last_commit_ = Clock::now();
}

}  // namespace dpstream
