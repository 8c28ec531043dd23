// A trigger's release rows, from the keys' owners to releases.csv on rank 0: each owner names, sorts
// and formats its own rows; rank 0 merges the ranks' sorted runs and stages them until their
// trigger is committed (or, without checkpoints, appends them at once).
#pragma once

#include <absl/container/flat_hash_map.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "shuffle/comm.hpp"
#include "src/record_source.hpp"  // KeyRelease
#include "src/release_writer.hpp"

namespace dpstream {

using KeyNames = absl::flat_hash_map<std::uint64_t, std::string>;

// String keys: every rank sends (id, name) of the keys it read to the key's owner, which keeps the
// names for output (collective). Ids of distinct names were kept apart at ingest (CsvSource::separate_ids).
KeyNames distribute_key_names(const RecordSource& source, const shuffle::Comm& comm);

class ReleaseStager {
 public:
  // `names`: the names of this rank's keys (string keys), or none (integer keys, printed as numbers).
  // `writer`: rank 0's, null elsewhere.
  ReleaseStager(const shuffle::Comm& comm, ReleaseColumns columns, ReleaseWriter* writer, bool checkpointing,
                std::uint32_t triggers_per_window, std::optional<KeyNames> names)
      : comm_(comm),
        columns_(columns),
        writer_(writer),
        checkpointing_(checkpointing),
        triggers_per_window_(triggers_per_window),
        names_(std::move(names)) {}

  // Collective: the rows of a batch's triggers (this rank's keys; `released[i]` those of trigger
  // first_trigger + i) to rank 0 in one gather; returns each trigger's row count (rank 0; zeros elsewhere).
  std::vector<std::uint64_t> stage(const std::vector<std::vector<KeyRelease>>& released, std::int64_t window,
                                   std::uint32_t first_trigger);

  // This rank's rows of one trigger being staged. Kept with their capacity from batch to batch, as are
  // the wire buffers: fresh ones cost rank 0 a page fault per 4 KiB of rows at every trigger (mode none
  // formats ~100 MB of rows per 2M-user run).
  struct Scratch {
    std::string text;
    std::vector<std::uint64_t> ends, ids;  // each row's end in text; its key id (integer keys)
    std::vector<ReleaseRow> named;         // string keys: rows sorted by name
    std::vector<KeyRelease> sorted;        // integer keys reported out of order
  };

 private:
  const shuffle::Comm& comm_;
  ReleaseColumns columns_;
  ReleaseWriter* writer_;
  bool checkpointing_;
  std::uint32_t triggers_per_window_;
  std::optional<KeyNames> names_;
  std::vector<Scratch> own_;  // one per trigger of the largest batch so far
  shuffle::ByteWriter wire_;
  std::vector<std::byte> gathered_;  // rank 0: the other ranks' runs
};

}  // namespace dpstream
