#include "src/release_stager.hpp"

#include <algorithm>
#include <cstring>
#include <optional>
#include <span>

#include "common/fault_injection.hpp"
#include "partition/hash.hpp"
#include "partition/partitioner.hpp"

namespace dpstream {

namespace {
// One trigger's rows of releases.csv, gathered on rank 0. Each key owner names, sorts and formats its own
// rows; rank 0 only merges the ranks' sorted runs (by key name, or by key id for integer keys) and copies
// their text. Rank 0's own run is read where it was formatted; every other rank sends its run with this
// wire format: row count n, the n sort keys (ids, or length-prefixed names), the n line ends, the text.
struct Run {  // one rank's sorted rows
  Run() = default;
  Run(const Run&) = delete;  // a copy's ids and ends would view the original's ids_read and ends_read
  Run& operator=(const Run&) = delete;
  Run(Run&&) noexcept = default;  // a moved vector keeps its buffer: the views stay valid
  Run& operator=(Run&&) noexcept = default;
  ~Run() = default;
  std::span<const std::uint64_t> ids, ends;
  std::vector<std::string_view> names;
  std::string_view text;
  std::vector<std::uint64_t> ids_read, ends_read;  // what ids and ends view, for a run read off the wire
  std::size_t next = 0;
};

// This rank's runs of a batch's triggers to rank 0 in one gather (collective); on rank 0, each trigger's
// non-empty runs of every rank, viewing `own` and `gathered`. Each rank sends its runs in trigger order.
std::vector<std::vector<Run>> send_rows(std::span<const ReleaseStager::Scratch> own, bool by_name,
                                        const shuffle::Comm& comm, shuffle::ByteWriter& wire,
                                        std::vector<std::byte>& gathered) {
  wire.clear();
  if (comm.rank() != 0) {
    std::size_t bytes = 0;
    for (const auto& o : own)
      bytes += sizeof(std::uint64_t) * (1 + 2 * o.ends.size()) + sizeof(std::uint32_t) + o.text.size();
    wire.reserve(bytes);
    for (const auto& o : own) {
      wire.put(static_cast<std::uint64_t>(o.ends.size()));
      if (by_name) {
        for (const auto& r : o.named) wire.put_string(r.name);
      } else {
        wire.put_array(o.ids.data(), o.ids.size());
      }
      wire.put_array(o.ends.data(), o.ends.size());
      wire.put_string(o.text);
    }
  }
  comm.gather_bytes_to_root(wire.bytes(), gathered);
  std::vector<std::vector<Run>> runs(own.size());
  if (comm.rank() != 0) return runs;
  for (std::size_t t = 0; t < own.size(); ++t) {
    if (own[t].ends.empty()) continue;
    Run r;
    r.ids = own[t].ids;
    r.ends = own[t].ends;
    if (by_name)
      for (const auto& row : own[t].named) r.names.emplace_back(row.name);
    r.text = own[t].text;
    runs[t].push_back(std::move(r));
  }
  std::size_t t = 0;  // the other ranks' runs, one per trigger each, in rank order
  for (shuffle::ByteReader in(gathered.data(), gathered.size()); !in.done(); t = (t + 1) % own.size()) {
    Run r;
    const auto n = in.get<std::uint64_t>();
    if (by_name) {
      for (std::uint64_t i = 0; i < n; ++i) r.names.emplace_back(in.get_view());
    } else {
      r.ids_read = in.get_array<std::uint64_t>(n);
    }
    r.ends_read = in.get_array<std::uint64_t>(n);
    r.ids = r.ids_read;
    r.ends = r.ends_read;
    r.text = in.get_view();
    if (n > 0) runs[t].push_back(std::move(r));
  }
  if (t != 0) throw std::logic_error("ReleaseStager: a rank sent runs for another number of triggers");
  return runs;
}

// Names (string keys) or ids of this rank's released rows, sorted, and their text, into `own`.
void format_own_rows(const std::vector<KeyRelease>& released, const KeyNames* names, std::int64_t window,
                     std::uint32_t trigger, ReleaseColumns columns, ReleaseStager::Scratch& own) {
  own.text.clear();
  own.ends.clear();
  own.ids.clear();
  own.named.clear();
  own.ends.reserve(released.size());
  if (names) {
    own.named.reserve(released.size());
    for (const auto& t : released) own.named.push_back({t.key, names->at(t.key), t.count, t.sum});
    std::sort(own.named.begin(), own.named.end(),
              [](const ReleaseRow& a, const ReleaseRow& b) { return a.name < b.name; });
    format_rows(window, trigger, own.named, columns, own.text, own.ends);
    return;
  }
  // Key accumulation reports its keys sorted (mode none): no copy, no sort.
  const auto by_key = [](const KeyRelease& a, const KeyRelease& b) { return a.key < b.key; };
  const std::vector<KeyRelease>* rows = &released;
  if (!std::is_sorted(released.begin(), released.end(), by_key)) {
    own.sorted.assign(released.begin(), released.end());
    std::sort(own.sorted.begin(), own.sorted.end(), by_key);
    rows = &own.sorted;
  }
  own.text.reserve(rows->size() * 24);
  format_id_rows(window, trigger, *rows, columns, own.text, own.ends);
  own.ids.reserve(rows->size());
  for (const auto& r : *rows) own.ids.push_back(r.key);
}

// Copies a row of `n` bytes from `src`, readable up to `src_end`, to `dst`, which has kRowSlack bytes of room
// past the row. Most rows are 12-20 bytes: one fixed-size copy writes them without glibc's choice of code by
// length (a mispredicted branch per row); the bytes past the row are overwritten by the next one.
constexpr std::size_t kRowSlack = 32;
inline void copy_row(char* dst, const char* src, std::size_t n, const char* src_end) {
  if (n <= kRowSlack && static_cast<std::size_t>(src_end - src) >= kRowSlack)
    std::memcpy(dst, src, kRowSlack);
  else
    std::memcpy(dst, src, n);
}

// Appends the runs' rows (`bytes` of text in all) to `out` in key order: a P-way merge; P is small, a
// linear scan picks the smallest head. The text is sized once and each row copied into place (4.3M
// rows a run in mode none: an append per row cost ~25 ns).
void merge_rows(std::vector<Run>& runs, bool by_name, std::uint64_t bytes, std::string& out) {
  const std::size_t at = out.size();
  out.resize(at + bytes + kRowSlack);
  char* dst = out.data() + at;
  const auto merge = [&](auto&& less) {
    while (!runs.empty()) {
      std::size_t best = 0;
      for (std::size_t i = 1; i < runs.size(); ++i)
        if (less(runs[i], runs[best])) best = i;
      Run& r = runs[best];
      const std::uint64_t begin = r.next == 0 ? 0 : r.ends[r.next - 1], end = r.ends[r.next];
      copy_row(dst, r.text.data() + begin, end - begin, r.text.data() + r.text.size());
      dst += end - begin;
      if (++r.next == r.ends.size()) runs.erase(runs.begin() + static_cast<std::ptrdiff_t>(best));
    }
  };
  if (by_name)
    merge([](const Run& a, const Run& b) { return a.names[a.next] < b.names[b.next]; });
  else
    merge([](const Run& a, const Run& b) { return a.ids[a.next] < b.ids[b.next]; });
  out.resize(at + bytes);
}

// One trigger's runs merged into rank 0's pending rows (`writer`; nothing elsewhere); returns its row count.
// The pending buffer is reserved for the window's remaining triggers at this trigger's size, so that it is
// not copied as it grows (reserved pages cost nothing until written); at most 1 GiB ahead (an address-space
// reservation may fail), beyond which it still at least doubles.
std::uint64_t stage_trigger(std::vector<Run>& runs, bool by_name, ReleaseWriter* writer, bool checkpointing,
                            std::uint32_t triggers_left) {
  std::uint64_t rows = 0, text_bytes = 0;
  for (const Run& r : runs) {
    rows += r.ends.size();
    text_bytes += r.text.size();
  }
  if (!writer) return rows;
  constexpr std::uint64_t kMaxAhead = std::uint64_t{1} << 30;
  const std::uint64_t expected_more =
      checkpointing && text_bytes > 0 ? std::min<std::uint64_t>(kMaxAhead / text_bytes, triggers_left) * text_bytes : 0;
  writer->stage_with(rows, text_bytes + kRowSlack, expected_more,  // merge_rows writes up to kRowSlack past the rows
                     [&](std::string& pending) { merge_rows(runs, by_name, text_bytes, pending); });
  if (!checkpointing) writer->append_pending(/*sync=*/false);
  return rows;
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

std::vector<std::uint64_t> ReleaseStager::stage(const std::vector<std::vector<KeyRelease>>& released,
                                                std::int64_t window, std::uint32_t first_trigger) {
  if (own_.size() < released.size()) own_.resize(released.size());  // kept, with their capacity
  const std::span<Scratch> own(own_.data(), released.size());       // this batch's
  for (std::size_t t = 0; t < released.size(); ++t)
    format_own_rows(released[t], names_ ? &*names_ : nullptr, window, first_trigger + static_cast<std::uint32_t>(t),
                    columns_, own[t]);
  std::vector<std::vector<Run>> runs = send_rows(own, names_.has_value(), comm_, wire_, gathered_);
  std::vector<std::uint64_t> row_counts(released.size(), 0);
  for (std::size_t t = 0; t < released.size(); ++t) {
    const std::uint32_t trigger = first_trigger + static_cast<std::uint32_t>(t);
    const std::uint32_t triggers_left = triggers_per_window_ > trigger ? triggers_per_window_ - trigger - 1 : 0;
    row_counts[t] = stage_trigger(runs[t], names_.has_value(), writer_, checkpointing_, triggers_left);
    fault::point("output");
  }
  return row_counts;
}

}  // namespace dpstream
