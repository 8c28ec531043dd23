#include "src/release_stager.hpp"

#include <algorithm>
#include <cstring>
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

// Sends one rank's formatted rows (`text`, each row's end in `ends`) to rank 0 with their sort keys (the
// names of `named` when given, else `ids`) and, on rank 0, views every rank's run in the gathered bytes.
GatheredRows send_rows(const std::vector<ReleaseRow>* named, const std::vector<std::uint64_t>& ids,
                       const std::vector<std::uint64_t>& ends, const std::string& text, const shuffle::Comm& comm) {
  const bool by_name = named != nullptr;
  const std::size_t n_rows = ends.size();
  shuffle::ByteWriter w;
  w.reserve(sizeof(std::uint64_t) * (1 + 2 * n_rows) + sizeof(std::uint32_t) + text.size());
  w.put(static_cast<std::uint64_t>(n_rows));
  if (by_name) {
    for (const auto& r : *named) w.put_string(r.name);
  } else {
    w.put_array(ids.data(), ids.size());
  }
  w.put_array(ends.data(), ends.size());
  w.put_string(text);
  GatheredRows out;
  out.bytes = comm.gather_bytes_to_root(w.bytes());
  for (shuffle::ByteReader in(out.bytes.data(), out.bytes.size()); !in.done();) {
    GatheredRows::Run r;
    const auto n = in.get<std::uint64_t>();
    if (by_name) {
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

GatheredRows gather_rows(const std::vector<KeyRelease>& released, const KeyNames* names, std::int64_t window,
                         std::uint32_t trigger, ReleaseColumns columns, const shuffle::Comm& comm) {
  std::string text;
  std::vector<std::uint64_t> ends;
  ends.reserve(released.size());
  std::vector<std::uint64_t> ids;  // the rows' sort keys when they are the ids
  if (names) {
    std::vector<ReleaseRow> rows;
    rows.reserve(released.size());
    for (const auto& t : released) rows.push_back({t.key, names->at(t.key), t.count, t.sum});
    std::sort(rows.begin(), rows.end(), [](const ReleaseRow& a, const ReleaseRow& b) { return a.name < b.name; });
    format_rows(window, trigger, rows, columns, text, ends);
    return send_rows(&rows, ids, ends, text, comm);
  }
  // Key accumulation reports its keys sorted (mode none): no copy, no sort.
  const auto by_key = [](const KeyRelease& a, const KeyRelease& b) { return a.key < b.key; };
  std::vector<KeyRelease> sorted;
  const std::vector<KeyRelease>* rows = &released;
  if (!std::is_sorted(released.begin(), released.end(), by_key)) {
    sorted = released;
    std::sort(sorted.begin(), sorted.end(), by_key);
    rows = &sorted;
  }
  text.reserve(rows->size() * 24);
  format_id_rows(window, trigger, *rows, columns, text, ends);
  ids.reserve(rows->size());
  for (const auto& r : *rows) ids.push_back(r.key);
  return send_rows(nullptr, ids, ends, text, comm);
}

// Appends the runs' rows (`bytes` of text in all) to `out` in key order: a P-way merge; P is small, a
// linear scan picks the smallest head. The text is sized once and each row copied into place (4.3M
// rows a run in mode none: an append per row cost ~25 ns).
void merge_rows(std::vector<GatheredRows::Run>& runs, bool by_name, std::uint64_t bytes, std::string& out) {
  const std::size_t at = out.size();
  out.resize(at + bytes);
  char* dst = out.data() + at;
  const auto merge = [&](auto&& less) {
    while (!runs.empty()) {
      std::size_t best = 0;
      for (std::size_t i = 1; i < runs.size(); ++i)
        if (less(runs[i], runs[best])) best = i;
      GatheredRows::Run& r = runs[best];
      const std::uint64_t begin = r.next == 0 ? 0 : r.ends[r.next - 1], end = r.ends[r.next];
      std::memcpy(dst, r.text.data() + begin, end - begin);
      dst += end - begin;
      if (++r.next == r.ends.size()) runs.erase(runs.begin() + static_cast<std::ptrdiff_t>(best));
    }
  };
  if (by_name)
    merge([](const GatheredRows::Run& a, const GatheredRows::Run& b) { return a.names[a.next] < b.names[b.next]; });
  else
    merge([](const GatheredRows::Run& a, const GatheredRows::Run& b) { return a.ids[a.next] < b.ids[b.next]; });
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
    writer_->stage_with(rows.rows, rows.text_bytes, expected_more, [&](std::string& pending) {
      merge_rows(rows.runs, names_.has_value(), rows.text_bytes, pending);
    });
    if (!checkpointing_) writer_->append(writer_->take_pending(), /*sync=*/false);
  }
  fault::point("output");
  return rows.rows;
}

}  // namespace dpstream
