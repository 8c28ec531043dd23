#include "src/release_stager.hpp"

#include <algorithm>
#include <optional>

#include "common/fault_injection.hpp"
#include "partition/hash.hpp"
#include "partition/partitioner.hpp"

namespace dpstream {

namespace {
// One trigger's rows of releases.csv, gathered on rank 0. Each key owner names, sorts and formats its own
// rows; rank 0 only merges the ranks' sorted runs (by key name, or by key id for integer keys) and copies
// their text. Wire format per rank: row count n, the n sort keys (ids, or length-prefixed names), the n
// line ends, the text.
struct GatheredRows {
  GatheredRows() = default;
  GatheredRows(const GatheredRows&) = delete;  // a copy's runs would view the original's bytes
  GatheredRows& operator=(const GatheredRows&) = delete;
  GatheredRows(GatheredRows&&) = default;  // a moved vector keeps its buffer: the views stay valid
  GatheredRows& operator=(GatheredRows&&) = default;
  ~GatheredRows() = default;
  struct Run {  // one rank's sorted rows; its text lies in `bytes`
    std::vector<std::uint64_t> ids, ends;
    std::vector<std::string> names;
    std::string_view text;
    std::size_t next = 0;
  };
  std::vector<std::byte> bytes;  // every rank's message (rank 0)
  std::vector<Run> runs;         // the ranks' non-empty runs (rank 0)
  std::uint64_t rows = 0, text_bytes = 0;
};

GatheredRows gather_rows(const std::vector<KeyRelease>& released, const KeyNames* names, std::int64_t window,
                         std::uint32_t trigger, ReleaseColumns columns, const shuffle::Comm& comm) {
  std::vector<ReleaseRow> rows;
  rows.reserve(released.size());
  for (const auto& t : released)
    rows.push_back({t.key, names ? names->at(t.key) : std::to_string(t.key), t.count, t.sum});
  if (names)
    std::sort(rows.begin(), rows.end(), [](const ReleaseRow& a, const ReleaseRow& b) { return a.name < b.name; });
  else
    std::sort(rows.begin(), rows.end(), [](const ReleaseRow& a, const ReleaseRow& b) { return a.key < b.key; });
  std::string text;
  std::vector<std::uint64_t> ends;
  ends.reserve(rows.size());
  format_rows(window, trigger, rows, columns, text, ends);
  shuffle::ByteWriter w;
  w.reserve(sizeof(std::uint64_t) * (1 + 2 * rows.size()) + sizeof(std::uint32_t) + text.size());
  w.put(static_cast<std::uint64_t>(rows.size()));
  if (names) {
    for (const auto& r : rows) w.put_string(r.name);
  } else {
    std::vector<std::uint64_t> ids(rows.size());
    for (std::size_t i = 0; i < rows.size(); ++i) ids[i] = rows[i].key;
    w.put_array(ids.data(), ids.size());
  }
  w.put_array(ends.data(), ends.size());
  w.put_string(text);
  GatheredRows out;
  out.bytes = comm.gather_bytes_to_root(w.bytes());
  for (shuffle::ByteReader in(out.bytes.data(), out.bytes.size()); !in.done();) {
    GatheredRows::Run r;
    const auto n = in.get<std::uint64_t>();
    if (names) {
      for (std::uint64_t i = 0; i < n; ++i) r.names.emplace_back(in.get_view());
    } else {
      r.ids = in.get_array<std::uint64_t>(n);
    }
    r.ends = in.get_array<std::uint64_t>(n);
    r.text = in.get_view();
    out.rows += n;
    out.text_bytes += r.text.size();
    if (n > 0) out.runs.push_back(std::move(r));
  }
  return out;
}

// Appends the runs' rows to `out` in key order: a P-way merge; P is small, a linear scan picks the
// smallest head.
void merge_rows(std::vector<GatheredRows::Run>& runs, bool by_name, std::string& out) {
  auto less = [by_name](const GatheredRows::Run& a, const GatheredRows::Run& b) {
    return by_name ? a.names[a.next] < b.names[b.next] : a.ids[a.next] < b.ids[b.next];
  };
  while (!runs.empty()) {
    std::size_t best = 0;
    for (std::size_t i = 1; i < runs.size(); ++i)
      if (less(runs[i], runs[best])) best = i;
    GatheredRows::Run& r = runs[best];
    const std::uint64_t begin = r.next == 0 ? 0 : r.ends[r.next - 1];
    out.append(r.text.substr(begin, r.ends[r.next] - begin));
    if (++r.next == r.ends.size()) runs.erase(runs.begin() + static_cast<std::ptrdiff_t>(best));
  }
}

}  // namespace

KeyNames distribute_key_names(const RecordSource& source, const shuffle::Comm& comm) {
  const int P = comm.size();
  std::vector<shuffle::ByteWriter> out(static_cast<std::size_t>(P));
  for (const auto& [id, name] : source.key_names()) {
    auto& w = out[static_cast<std::size_t>(partition::key_owner(id, P))];
    w.put(id);
    w.put_string(name);
  }
  std::vector<std::byte> send;
  std::vector<std::uint64_t> offsets{0};
  for (auto& w : out) {
    send.insert(send.end(), w.bytes().begin(), w.bytes().end());
    offsets.push_back(send.size());
  }
  std::vector<std::uint64_t> recv_offsets;
  const auto recv = comm.alltoallv_bytes(send.data(), offsets, recv_offsets);
  KeyNames names;
  for (shuffle::ByteReader in(recv.data(), recv.size()); !in.done();) {
    const auto id = in.get<std::uint64_t>();
    names.try_emplace(id, in.get_string());
  }
  return names;
}

std::uint64_t ReleaseStager::stage(const std::vector<KeyRelease>& released, std::int64_t window,
                                   std::uint32_t trigger) {
  GatheredRows rows = gather_rows(released, names_ ? &*names_ : nullptr, window, trigger, columns_, comm_);
  if (writer_) {
    // Rows wait for their commit in one buffer: reserved for the window's remaining triggers at this
    // trigger's size, so that it is not copied as it grows (reserved pages cost nothing until written);
    // at most 1 GiB ahead (an address-space reservation may fail), beyond which it still at least doubles.
    constexpr std::uint64_t kMaxAhead = std::uint64_t{1} << 30;
    const std::uint64_t remaining = triggers_per_window_ > trigger ? triggers_per_window_ - trigger - 1 : 0;
    const std::uint64_t expected_more =
        checkpointing_ && rows.text_bytes > 0 ? std::min(kMaxAhead / rows.text_bytes, remaining) * rows.text_bytes : 0;
    writer_->stage_with(rows.rows, rows.text_bytes, expected_more,
                        [&](std::string& pending) { merge_rows(rows.runs, names_.has_value(), pending); });
    if (!checkpointing_) writer_->append(writer_->take_pending(), /*sync=*/false);
  }
  fault::point("output");
  return rows.rows;
}

}  // namespace dpstream
