// The only code that moves data between ranks. Counts are exchanged first, then the payload
// with MPI_Alltoallv; a payload past the per-round limit (2^31 - 1 bytes by MPI's int counts)
// is sent in rounds through a staging buffer.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace dpstream::shuffle {

// An MPI call failed; carries MPI's own message.
class MpiError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

void check_mpi(int code, const char* call);

// MPI_Init_thread / MPI_Finalize as RAII. Sets MPI_ERRORS_RETURN so failures become MpiError.
class MpiSession {
 public:
  MpiSession(int& argc, char**& argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
};

// Bytes moved by the exchanges of one communicator, for the run summary.
struct TrafficCounter {
  std::uint64_t bytes_sent_to_others = 0;  // excludes the part a rank keeps for itself
  std::uint64_t bytes_total = 0;
};

class Comm {
 public:
  explicit Comm(MPI_Comm comm = MPI_COMM_WORLD);
  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm raw() const { return comm_; }
  // The ranks of this communicator on this rank's node (MPI_COMM_TYPE_SHARED) and the bitwise OR of
  // their `words` (each rank gives as many); a collective.
  struct NodeShare {
    int ranks = 1;
    std::vector<std::uint64_t> words_or;
  };
  NodeShare share_with_node(std::vector<std::uint64_t> words) const;

  // Largest number of payload bytes per alltoallv round (tests lower it to exercise rounds).
  void set_round_limit_bytes(std::uint64_t limit) { round_limit_ = limit; }

  // All-to-all of byte segments: `send[offsets[d] .. offsets[d+1])` goes to rank d. Returns the
  // received bytes grouped by source rank; `recv_offsets` (size P+1) tells where each begins.
  // `fault_point` names the exchange for fault injection (common/fault_injection.hpp): it is reached
  // between the count exchange and the payload, i.e. inside the collective.
  std::vector<std::byte> alltoallv_bytes(const std::byte* send, const std::vector<std::uint64_t>& offsets,
                                         std::vector<std::uint64_t>& recv_offsets, TrafficCounter* traffic = nullptr,
                                         const char* fault_point = nullptr) const;

  // alltoallv_bytes into memory of the caller's: `receive(bytes)` sizes it once the counts are known and
  // returns where the received bytes go.
  void alltoallv_into(const std::byte* send, const std::vector<std::uint64_t>& offsets,
                      std::vector<std::uint64_t>& recv_offsets, const std::function<std::byte*(std::uint64_t)>& receive,
                      TrafficCounter* traffic = nullptr, const char* fault_point = nullptr) const;

  // Typed all-to-all of fixed-size records (`offsets` in items, P+1 entries), received into a vector of type
  // Out (a DefaultInitVector<T> is not zero-filled before MPI writes it).
  template <class T, class Out = std::vector<T>, class A = std::allocator<T>>
  Out alltoallv(const std::vector<T, A>& send, const std::vector<std::uint64_t>& offsets,
                TrafficCounter* traffic = nullptr, const char* fault_point = nullptr) const {
    static_assert(std::is_trivially_copyable_v<T> && std::is_same_v<typename Out::value_type, T>);
    std::vector<std::uint64_t> byte_offsets(offsets.size());
    for (std::size_t i = 0; i < offsets.size(); ++i) byte_offsets[i] = offsets[i] * sizeof(T);
    std::vector<std::uint64_t> recv_offsets;
    Out out;  // received into directly: a byte buffer and its copy were two more passes over the data
    alltoallv_into(
        reinterpret_cast<const std::byte*>(send.data()), byte_offsets, recv_offsets,
        [&out](std::uint64_t bytes) {
          if (bytes % sizeof(T) != 0) throw std::logic_error("alltoallv: ranks sent items of another size");
          out.resize(bytes / sizeof(T));
          return reinterpret_cast<std::byte*>(out.data());
        },
        traffic, fault_point);
    return out;
  }

  // A batched exchange as blocks of bytes: blocks[d * B + b] (b < B) go to rank d, each block's size ahead
  // in the count exchange. `place(sizes)` is given the sizes received, sizes[s * B + b] for source s, and
  // returns where each block goes (P * B addresses, same order); MPI then moves every block from where
  // it lies to its place, with no copy of ours (MPI_Alltoallw of hindexed types). Returns false, having
  // moved nothing and called no `place`, when a rank's blocks to or from one peer exceed the per-round
  // limit: the caller then sends them through alltoallv, which goes in rounds.
  struct Block {
    const std::byte* data;
    std::uint64_t bytes;
  };
  bool alltoallw_blocks(const std::vector<Block>& blocks, std::size_t B,
                        const std::function<std::vector<std::byte*>(const std::vector<std::uint64_t>&)>& place,
                        TrafficCounter* traffic = nullptr, const char* fault_point = nullptr) const;

  // Several exchanges of fixed-size records at once, one collective instead of one each: batch b's items
  // `items[b]` go out as alltoallv(items[b], offsets[b]) would send them, and out[b] is what that call
  // would return (grouped by source rank). The items are sent from where they lie and received into
  // out[b] directly (alltoallw_blocks): a send buffer of their own and a receive buffer copied out cost
  // three passes more over the records (perf, T = 1000: 0.05 s a rank). Past the per-round limit, each
  // destination's segment carries its batches' item counts ahead of their items (8 bytes a batch) through
  // alltoallv. `traffic` counts the items' bytes. Every rank must pass the same number of batches. One
  // batch is a plain alltoallv. Each out[b] is a vector of type Out, as alltoallv's.
  template <class T, class Out = std::vector<T>, class A = std::allocator<T>>
  std::vector<Out> alltoallv_batches(const std::vector<std::vector<T, A>>& items,
                                     const std::vector<std::vector<std::uint64_t>>& offsets,
                                     TrafficCounter* traffic = nullptr, const char* fault_point = nullptr) const {
    static_assert(std::is_trivially_copyable_v<T> && std::is_same_v<typename Out::value_type, T>);
    const std::size_t B = items.size(), P = static_cast<std::size_t>(size_);
    if (offsets.size() != B) throw std::logic_error("alltoallv_batches: one offsets vector per batch");
    for (std::size_t b = 0; b < B; ++b)
      if (offsets[b].size() != P + 1 || offsets[b][P] != items[b].size())
        throw std::logic_error("alltoallv_batches: offsets of P + 1 entries per batch");
    std::vector<Out> out(B);
    if (B == 1) {
      out[0] = alltoallv<T, Out>(items[0], offsets[0], traffic, fault_point);
      return out;
    }
    std::vector<Block> blocks(P * B);
    for (std::size_t d = 0; d < P; ++d)
      for (std::size_t b = 0; b < B; ++b)
        blocks[d * B + b] = {reinterpret_cast<const std::byte*>(items[b].data() + offsets[b][d]),
                             (offsets[b][d + 1] - offsets[b][d]) * sizeof(T)};
    const auto place = [&](const std::vector<std::uint64_t>& sizes) {
      std::vector<std::uint64_t> totals(B, 0);
      for (std::size_t g = 0; g < P * B; ++g) {
        if (sizes[g] % sizeof(T) != 0) throw std::logic_error("alltoallv_batches: ranks sent items of another size");
        totals[g % B] += sizes[g] / sizeof(T);
      }
      for (std::size_t b = 0; b < B; ++b) out[b].resize(totals[b]);
      std::vector<std::byte*> at(P * B);
      std::vector<std::uint64_t> filled(B, 0);
      for (std::size_t s = 0; s < P; ++s)  // source s's items of batch b after those of sources before it
        for (std::size_t b = 0; b < B; ++b) {
          at[s * B + b] = reinterpret_cast<std::byte*>(out[b].data() + filled[b]);
          filled[b] += sizes[s * B + b] / sizeof(T);
        }
      return at;
    };
    if (alltoallw_blocks(blocks, B, place, traffic, fault_point)) return out;
    return alltoallv_batches_in_rounds<T, Out>(items, offsets, traffic, fault_point);
  }

  // Rank 0 receives every rank's bytes, concatenated in rank order (others get an empty vector).
  std::vector<std::byte> gather_bytes_to_root(const std::vector<std::byte>& mine) const;
  // The same into `into` (rank 0; emptied elsewhere), which keeps its capacity from call to call.
  void gather_bytes_to_root(const std::vector<std::byte>& mine, std::vector<std::byte>& into) const;

  std::uint64_t sum(std::uint64_t v) const;
  std::uint64_t max(std::uint64_t v) const;
  double max(double v) const;
  // All ranks learn whether any rank reported failure; the first failing rank's message is
  // returned to all (empty when none failed). Use after local validation, before collectives.
  std::string agree_on_error(const std::string& local_error) const;
  std::vector<std::uint64_t> allgather(std::uint64_t v) const;
  // Element-wise sum over ranks, on every rank.
  std::vector<std::uint64_t> sum(const std::vector<std::uint64_t>& v) const;
  void barrier() const;
  // Copies `bytes` bytes at `data` from `root` to every rank.
  void broadcast(void* data, std::size_t bytes, int root = 0) const;

  // Seconds this rank has spent inside this communicator's collective methods since it was built: waiting
  // for the other ranks, moving the data, and the local copies around it (alltoallv's buffers). Next to the
  // wall time it shows how much a rank computed, and so how unbalanced the ranks were. Main thread only.
  double collective_seconds() const { return collective_seconds_; }
  // Collective methods called since it was built (outermost only: an all-to-all's count exchange is part of
  // it): every rank calls the same ones, and each waits for the slowest rank once. Main thread only.
  std::uint64_t collective_calls() const { return collective_calls_; }

 private:
  class Timed;  // adds an outermost collective's seconds to collective_seconds_, and counts it

  // alltoallv_batches through one alltoallv (which goes in rounds): each destination's segment holds its
  // batches' item counts, then their items.
  template <class T, class Out, class A>
  std::vector<Out> alltoallv_batches_in_rounds(const std::vector<std::vector<T, A>>& items,
                                               const std::vector<std::vector<std::uint64_t>>& offsets,
                                               TrafficCounter* traffic, const char* fault_point) const {
    const std::size_t B = items.size(), P = static_cast<std::size_t>(size_);
    std::vector<std::uint64_t> send_offsets{0};
    std::vector<std::byte> send;
    std::size_t send_items = 0;
    for (const auto& batch : items) send_items += batch.size();
    send.reserve(send_items * sizeof(T) + P * B * sizeof(std::uint64_t));
    const auto append = [&send](const void* data, std::size_t bytes) {
      const auto* first = static_cast<const std::byte*>(data);
      send.insert(send.end(), first, first + bytes);
    };
    std::vector<std::uint64_t> to_d(B);
    for (std::size_t d = 0; d < P; ++d) {  // destination d: the B counts, then each batch's items for d
      for (std::size_t b = 0; b < B; ++b) to_d[b] = offsets[b][d + 1] - offsets[b][d];
      append(to_d.data(), B * sizeof(std::uint64_t));
      for (std::size_t b = 0; b < B; ++b) append(items[b].data() + offsets[b][d], to_d[b] * sizeof(T));
      send_offsets.push_back(send.size());
    }
    if (traffic) {  // the items' bytes, as alltoallw_blocks counts them
      traffic->bytes_total += send_items * sizeof(T);
      for (std::size_t b = 0; b < B; ++b)
        traffic->bytes_sent_to_others += (items[b].size() - (offsets[b][rank_ + 1] - offsets[b][rank_])) * sizeof(T);
    }
    std::vector<std::uint64_t> recv_offsets;
    const std::vector<std::byte> recv = alltoallv_bytes(send.data(), send_offsets, recv_offsets, nullptr, fault_point);
    std::vector<std::byte>().swap(send);  // sent: its memory back before the batches are copied out
    std::vector<Out> out(B);
    std::vector<std::uint64_t> counts(P * B), totals(B, 0);  // source s's count of batch b at s * B + b
    for (std::size_t s = 0; s < P; ++s) {
      if (recv_offsets[s + 1] - recv_offsets[s] < B * sizeof(std::uint64_t))
        throw std::logic_error("alltoallv_batches: ranks passed different numbers of batches");
      std::memcpy(counts.data() + s * B, recv.data() + recv_offsets[s], B * sizeof(std::uint64_t));
      for (std::size_t b = 0; b < B; ++b) totals[b] += counts[s * B + b];
    }
    for (std::size_t b = 0; b < B; ++b) out[b].reserve(totals[b]);
    for (std::size_t s = 0; s < P; ++s) {  // source s's segment, laid out as above
      std::size_t at = recv_offsets[s] + B * sizeof(std::uint64_t);
      for (std::size_t b = 0; b < B; ++b) {
        const std::size_t bytes = counts[s * B + b] * sizeof(T);
        if (recv_offsets[s + 1] - at < bytes)
          throw std::logic_error("alltoallv_batches: a segment shorter than its counts");
        const std::size_t had = out[b].size();
        out[b].resize(had + counts[s * B + b]);
        if (bytes > 0) std::memcpy(out[b].data() + had, recv.data() + at, bytes);
        at += bytes;
      }
      if (at != recv_offsets[s + 1]) throw std::logic_error("alltoallv_batches: a segment longer than its counts");
    }
    return out;
  }
  mutable double collective_seconds_ = 0;
  mutable std::uint64_t collective_calls_ = 0;
  mutable int timed_depth_ = 0;
  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
  std::uint64_t round_limit_ = (std::uint64_t{1} << 31) - 1;
};

// Runs `fn` on this rank; if it throws on any rank, every rank throws E with the first message.
// Keeps ranks in step: no rank is left waiting in a collective after another rank failed.
template <class E, class Fn>
void on_all_ranks(const Comm& comm, Fn&& fn) {
  std::string err;
  try {
    fn();
  } catch (const std::exception& e) {
    err = e.what();
    if (err.empty()) err = "unknown error";
  }
  err = comm.agree_on_error(err);
  if (!err.empty()) throw E(err);
}

// Rank `root`'s string on every rank.
void broadcast_string(const Comm& comm, std::string& s, int root = 0);

// Variable-length items (strings) through the byte exchange: length-prefixed records.
class ByteWriter {
 public:
  template <class T>
  void put(const T& v) {
    put_array(&v, 1);
  }
  // n values at once (read back by ByteReader::get_array).
  template <class T>
  void put_array(const T* values, std::size_t n) {
    static_assert(std::is_trivially_copyable_v<T>);
    const std::size_t at = buf_.size();
    buf_.resize(at + n * sizeof(T));
    if (n > 0) std::memcpy(buf_.data() + at, values, n * sizeof(T));
  }
  void put_string(std::string_view s) {
    if (s.size() > UINT32_MAX) throw std::length_error("ByteWriter: a string of 4 GiB or more");
    put(static_cast<std::uint32_t>(s.size()));
    put_array(s.data(), s.size());
  }
  void reserve(std::size_t bytes) { buf_.reserve(bytes); }
  void clear() { buf_.clear(); }  // keeps the capacity
  std::vector<std::byte>& bytes() { return buf_; }
  std::size_t size() const { return buf_.size(); }

 private:
  std::vector<std::byte> buf_;
};

class ByteReader {
 public:
  ByteReader(const std::byte* data, std::size_t size) : p_(data), end_(data + size) {}
  bool done() const { return p_ >= end_; }
  template <class T>
  T get() {
    static_assert(std::is_trivially_copyable_v<T>);
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }
  template <class T>
  std::vector<T> get_array(std::size_t n) {
    static_assert(std::is_trivially_copyable_v<T>);
    if (n > static_cast<std::size_t>(end_ - p_) / sizeof(T)) throw std::runtime_error("ByteReader: truncated message");
    std::vector<T> v(n);
    if (n > 0) std::memcpy(v.data(), p_, n * sizeof(T));
    p_ += n * sizeof(T);
    return v;
  }
  std::string get_string() { return std::string(get_view()); }
  // The next string in place: valid while the reader's bytes are.
  std::string_view get_view() {
    const auto n = get<std::uint32_t>();
    need(n);
    std::string_view s(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return s;
  }

 private:
  void need(std::size_t n) const {
    if (static_cast<std::size_t>(end_ - p_) < n) throw std::runtime_error("ByteReader: truncated message");
  }
  const std::byte* p_;
  const std::byte* end_;
};

}  // namespace dpstream::shuffle
