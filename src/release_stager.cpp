#include "src/release_stager.hpp"

#include <algorithm>
#include <optional>

#include "common/fault_injection.hpp"
#include "partition/hash.hpp"
#include "partition/partitioner.hpp"

namespace dpstream {

namespace {
// One trigger's rows of releases.csv, on rank 0. Each key owner names, sorts and formats its own rows;
// rank 0 only merges the ranks' sorted runs (by key name, or by key id for integer keys) and copies
// their text. Wire format per rank: row count, per row (sort key, end offset of its line), the text.
struct ReleaseText {
  std::string text;
  std::uint64_t rows = 0;
};
ReleaseText gather_release_text(const std::vector<KeyRelease>& released, const KeyNames* names, std::int64_t window,
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
  w.put(static_cast<std::uint64_t>(rows.size()));
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (names)
      w.put_string(rows[i].name);
    else
      w.put(rows[i].key);
    w.put(ends[i]);
  }
  w.put_string(text);
  const auto all = comm.gather_bytes_to_root(w.bytes());
  ReleaseText out;
  if (all.empty()) return out;

  struct Run {  // one rank's sorted rows
    std::vector<std::uint64_t> ids, ends;
    std::vector<std::string> names;
    std::string text;
    std::size_t next = 0;
  };
  std::vector<Run> runs;
  for (shuffle::ByteReader in(all.data(), all.size()); !in.done();) {
    Run r;
    const auto n = in.get<std::uint64_t>();
    for (std::uint64_t i = 0; i < n; ++i) {
      if (names)
        r.names.push_back(in.get_string());
      else
        r.ids.push_back(in.get<std::uint64_t>());
      r.ends.push_back(in.get<std::uint64_t>());
    }
    r.text = in.get_string();
    out.rows += n;
    if (n > 0) runs.push_back(std::move(r));
  }
  out.text.reserve([&] {
    std::size_t b = 0;
    for (const auto& r : runs) b += r.text.size();
    return b;
  }());
  auto less = [&](const Run& a, const Run& b) {
    return names ? a.names[a.next] < b.names[b.next] : a.ids[a.next] < b.ids[b.next];
  };
  while (!runs.empty()) {  // P-way merge; P is small, a linear scan picks the smallest head
    std::size_t best = 0;
    for (std::size_t i = 1; i < runs.size(); ++i)
      if (less(runs[i], runs[best])) best = i;
    Run& r = runs[best];
    const std::uint64_t begin = r.next == 0 ? 0 : r.ends[r.next - 1];
    out.text.append(r.text, begin, r.ends[r.next] - begin);
    if (++r.next == r.ends.size()) runs.erase(runs.begin() + static_cast<std::ptrdiff_t>(best));
  }
  return out;
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
  const auto rows = gather_release_text(released, names_ ? &*names_ : nullptr, window, trigger, columns_, comm_);
  if (writer_) {
    writer_->stage_text(rows.text, rows.rows);
    if (!checkpointing_) writer_->append(writer_->take_pending(), /*sync=*/false);
  }
  fault::point("output");
  return rows.rows;
}

}  // namespace dpstream
