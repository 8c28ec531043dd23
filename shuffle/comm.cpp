#include "shuffle/comm.hpp"

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <string>
#include <string_view>

#include "common/elapsed.hpp"
#include "common/fault_injection.hpp"

namespace dpstream::shuffle {

void check_mpi(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, msg, &len);
  throw MpiError(std::string(call) + " failed: " + std::string(msg, static_cast<std::size_t>(len)));
}

namespace {

// Open MPI launched by mpirun with every rank on this node: the fabric MTLs (psm, psm2: Omni-Path and
// True Scale; ofi: libfabric) are not probed unless the user chose an MTL or a PML. Their probing is
// 0.2 s of the 0.3 s MPI_Init takes on a test machine without such hardware, for a transport a single
// node does not use (Open MPI then selects ob1 over shared memory, as it would after probing; a PML set
// in the environment or the MCA parameter files, e.g. UCX, is still honoured). Other MPIs, srun,
// singletons and multi-node runs are left alone. Runs before any thread exists (setenv, getenv).
void skip_fabric_probing_on_one_node() {
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");         // NOLINT(concurrency-mt-unsafe)
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");  // NOLINT(concurrency-mt-unsafe)
  if (size == nullptr || local == nullptr || std::string_view(size) != std::string_view(local)) return;
  const char* mtl = std::getenv("OMPI_MCA_mtl");  // NOLINT(concurrency-mt-unsafe)
  const char* pml = std::getenv("OMPI_MCA_pml");  // NOLINT(concurrency-mt-unsafe)
  if (mtl != nullptr || pml != nullptr) return;
  setenv("OMPI_MCA_mtl", "^ofi,psm,psm2", /*overwrite=*/0);  // NOLINT(concurrency-mt-unsafe)
}

}  // namespace

// Only the outermost collective adds its time: alltoallv_bytes calls max(), for one.
class Comm::Timed {
 public:
  explicit Timed(const Comm& comm) : comm_(comm), t0_(SteadyClock::now()) { ++comm_.timed_depth_; }
  ~Timed() {
    if (--comm_.timed_depth_ == 0) {
      comm_.collective_seconds_ += seconds_since(t0_);
      ++comm_.collective_calls_;
    }
  }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  const Comm& comm_;
  SteadyClock::time_point t0_;
};

MpiSession::MpiSession(int& argc, char**& argv) {
  skip_fabric_probing_on_one_node();
  int provided = 0;
  check_mpi(MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
}

MpiSession::~MpiSession() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

Comm::Comm(MPI_Comm comm) : comm_(comm) {
  check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
}

std::vector<std::byte> Comm::alltoallv_bytes(const std::byte* send, const std::vector<std::uint64_t>& offsets,
                                             std::vector<std::uint64_t>& recv_offsets, TrafficCounter* traffic,
                                             const char* fault_point) const {
  std::vector<std::byte> recv;
  alltoallv_into(
      send, offsets, recv_offsets,
      [&recv](std::uint64_t bytes) {
        recv.resize(bytes);
        return recv.data();
      },
      traffic, fault_point);
  return recv;
}

void Comm::alltoallv_into(const std::byte* send, const std::vector<std::uint64_t>& offsets,
                          std::vector<std::uint64_t>& recv_offsets,
                          const std::function<std::byte*(std::uint64_t)>& receive, TrafficCounter* traffic,
                          const char* fault_point) const {
  const Timed timed(*this);
  const auto P = static_cast<std::size_t>(size_);
  if (offsets.size() != P + 1) throw std::invalid_argument("alltoallv_bytes: offsets must have P+1 entries");
  // 1. counts first (64-bit, so sizes past 2^31 are exact).
  std::vector<std::uint64_t> send_counts(P), recv_counts(P);
  for (std::size_t d = 0; d < P; ++d) send_counts[d] = offsets[d + 1] - offsets[d];
  check_mpi(MPI_Alltoall(send_counts.data(), 1, MPI_UINT64_T, recv_counts.data(), 1, MPI_UINT64_T, comm_),
            "MPI_Alltoall");
  recv_offsets.assign(P + 1, 0);
  for (std::size_t s = 0; s < P; ++s) recv_offsets[s + 1] = recv_offsets[s] + recv_counts[s];
  std::byte* const recv = receive(recv_offsets[P]);
  if (fault_point) fault::point(fault_point);
  if (traffic) {
    traffic->bytes_total += offsets[P];
    traffic->bytes_sent_to_others += offsets[P] - send_counts[static_cast<std::size_t>(rank_)];
  }

  // 2. payload in rounds: each round sends at most `chunk` bytes per peer, so every count and
  // displacement of the round fits an int.
  const std::uint64_t limit = std::min<std::uint64_t>(round_limit_, INT_MAX);
  const std::uint64_t chunk = std::max<std::uint64_t>(1, limit / P);
  std::uint64_t my_max = 0;
  for (std::size_t d = 0; d < P; ++d) my_max = std::max({my_max, send_counts[d], recv_counts[d]});
  const std::uint64_t rounds = (max(my_max) + chunk - 1) / chunk;

  std::vector<int> sc(P), sd(P), rc(P), rd(P);
  if (rounds <= 1) {
    for (std::size_t d = 0; d < P; ++d) {
      sc[d] = static_cast<int>(send_counts[d]);
      sd[d] = static_cast<int>(offsets[d]);
      rc[d] = static_cast<int>(recv_counts[d]);
      rd[d] = static_cast<int>(recv_offsets[d]);
    }
    if (rounds == 1)
      check_mpi(MPI_Alltoallv(send, sc.data(), sd.data(), MPI_BYTE, recv, rc.data(), rd.data(), MPI_BYTE, comm_),
                "MPI_Alltoallv");
    return;
  }
  std::vector<std::byte> stage_send, stage_recv;
  for (std::uint64_t r = 0; r < rounds; ++r) {
    const std::uint64_t begin = r * chunk;
    int s_total = 0, r_total = 0;
    for (std::size_t d = 0; d < P; ++d) {
      sc[d] = static_cast<int>(send_counts[d] > begin ? std::min(chunk, send_counts[d] - begin) : 0);
      rc[d] = static_cast<int>(recv_counts[d] > begin ? std::min(chunk, recv_counts[d] - begin) : 0);
      sd[d] = s_total;
      rd[d] = r_total;
      s_total += sc[d];
      r_total += rc[d];
    }
    stage_send.resize(static_cast<std::size_t>(s_total));
    stage_recv.resize(static_cast<std::size_t>(r_total));
    for (std::size_t d = 0; d < P; ++d)
      if (sc[d]) std::memcpy(stage_send.data() + sd[d], send + offsets[d] + begin, static_cast<std::size_t>(sc[d]));
    check_mpi(MPI_Alltoallv(stage_send.data(), sc.data(), sd.data(), MPI_BYTE, stage_recv.data(), rc.data(), rd.data(),
                            MPI_BYTE, comm_),
              "MPI_Alltoallv");
    for (std::size_t s = 0; s < P; ++s)
      if (rc[s])
        std::memcpy(recv + recv_offsets[s] + begin, stage_recv.data() + rd[s], static_cast<std::size_t>(rc[s]));
  }
}

bool Comm::alltoallw_blocks(const std::vector<Block>& blocks, std::size_t B,
                            const std::function<std::vector<std::byte*>(const std::vector<std::uint64_t>&)>& place,
                            TrafficCounter* traffic, const char* fault_point) const {
  const Timed timed(*this);
  const auto P = static_cast<std::size_t>(size_);
  if (B == 0 || B > INT_MAX || blocks.size() != P * B)
    throw std::invalid_argument("alltoallw_blocks: need B >= 1 blocks per rank");
  // 1. Every block's size (64-bit), then one agreement on the path: each rank's largest total to or from
  // one peer against the limit of an int count. (A throw on one rank from here on leaves the others in a
  // collective, as in exchange(): the engine aborts the job on it.)
  std::vector<std::uint64_t> sizes(P * B), recv_sizes(P * B);
  for (std::size_t g = 0; g < P * B; ++g) sizes[g] = blocks[g].bytes;
  check_mpi(MPI_Alltoall(sizes.data(), static_cast<int>(B), MPI_UINT64_T, recv_sizes.data(), static_cast<int>(B),
                         MPI_UINT64_T, comm_),
            "MPI_Alltoall");
  std::uint64_t largest = 0, sent = 0, kept = 0;
  for (std::size_t p = 0; p < P; ++p) {
    std::uint64_t to = 0, from = 0;
    for (std::size_t b = 0; b < B; ++b) to += sizes[p * B + b], from += recv_sizes[p * B + b];
    largest = std::max({largest, to, from});
    sent += to;
    if (p == static_cast<std::size_t>(rank_)) kept = to;
  }
  // One flag, not the sizes: a rank whose limit differed would otherwise take the other path alone.
  const bool too_large = largest > std::min<std::uint64_t>(round_limit_, INT_MAX);
  if (max(std::uint64_t{too_large}) != 0) return false;
  const std::vector<std::byte*> at = place(recv_sizes);
  if (at.size() != P * B) throw std::logic_error("alltoallw_blocks: a place for every block received");
  if (fault_point) fault::point(fault_point);
  if (traffic) {
    traffic->bytes_total += sent;
    traffic->bytes_sent_to_others += sent - kept;
  }
  // 2. Per peer one type of B blocks at their absolute addresses (from MPI_BOTTOM): sent where they lie,
  // received where `place` put them.
  std::vector<MPI_Datatype> send_types(P, MPI_DATATYPE_NULL), recv_types(P, MPI_DATATYPE_NULL);
  struct FreeTypes {
    std::vector<MPI_Datatype>& a;
    std::vector<MPI_Datatype>& b;
    ~FreeTypes() {
      for (auto* v : {&a, &b})
        for (MPI_Datatype& t : *v)
          if (t != MPI_DATATYPE_NULL) MPI_Type_free(&t);
    }
  } free_types{send_types, recv_types};
  std::vector<int> lengths(B);
  std::vector<MPI_Aint> where(B);
  const auto make_type = [&](std::size_t p, const auto& address, const std::vector<std::uint64_t>& bytes,
                             MPI_Datatype& type) {
    for (std::size_t b = 0; b < B; ++b) {
      lengths[b] = static_cast<int>(bytes[p * B + b]);  // <= the peer's total <= INT_MAX
      check_mpi(MPI_Get_address(address(p * B + b), &where[b]), "MPI_Get_address");
    }
    check_mpi(MPI_Type_create_hindexed(static_cast<int>(B), lengths.data(), where.data(), MPI_BYTE, &type),
              "MPI_Type_create_hindexed");
    check_mpi(MPI_Type_commit(&type), "MPI_Type_commit");
  };
  for (std::size_t p = 0; p < P; ++p) {
    make_type(
        p, [&](std::size_t g) { return blocks[g].data; }, sizes, send_types[p]);
    make_type(
        p, [&](std::size_t g) { return at[g]; }, recv_sizes, recv_types[p]);
  }
  const std::vector<int> ones(P, 1), zeros(P, 0);
  check_mpi(MPI_Alltoallw(MPI_BOTTOM, ones.data(), zeros.data(), send_types.data(), MPI_BOTTOM, ones.data(),
                          zeros.data(), recv_types.data(), comm_),
            "MPI_Alltoallw");
  return true;
}

std::vector<std::byte> Comm::gather_bytes_to_root(const std::vector<std::byte>& mine) const {
  std::vector<std::byte> all;
  gather_bytes_to_root(mine, all);
  return all;
}

void Comm::gather_bytes_to_root(const std::vector<std::byte>& mine, std::vector<std::byte>& into) const {
  // Routed through the all-to-all so that sizes past 2^31 go in rounds as well.
  std::vector<std::uint64_t> offsets(static_cast<std::size_t>(size_) + 1, mine.size());
  offsets[0] = 0;
  std::vector<std::uint64_t> recv_offsets;
  alltoallv_into(mine.data(), offsets, recv_offsets, [&into](std::uint64_t bytes) {
    into.resize(bytes);
    return into.data();
  });
}

Comm::NodeShare Comm::share_with_node(std::vector<std::uint64_t> words) const {
  const Timed timed(*this);
  MPI_Comm node = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node), "MPI_Comm_split_type");
  NodeShare share;
  int rc = MPI_Comm_size(node, &share.ranks);
  if (rc == MPI_SUCCESS)
    rc = MPI_Allreduce(MPI_IN_PLACE, words.data(), static_cast<int>(words.size()), MPI_UINT64_T, MPI_BOR, node);
  MPI_Comm_free(&node);
  check_mpi(rc, "MPI_Allreduce (node)");
  share.words_or = std::move(words);
  return share;
}

std::uint64_t Comm::sum(std::uint64_t v) const {
  const Timed timed(*this);
  std::uint64_t out = 0;
  check_mpi(MPI_Allreduce(&v, &out, 1, MPI_UINT64_T, MPI_SUM, comm_), "MPI_Allreduce");
  return out;
}

std::vector<std::uint64_t> Comm::sum(const std::vector<std::uint64_t>& v) const {
  const Timed timed(*this);
  std::vector<std::uint64_t> out(v.size());
  check_mpi(MPI_Allreduce(v.data(), out.data(), static_cast<int>(v.size()), MPI_UINT64_T, MPI_SUM, comm_),
            "MPI_Allreduce");
  return out;
}

std::uint64_t Comm::max(std::uint64_t v) const {
  const Timed timed(*this);
  std::uint64_t out = 0;
  check_mpi(MPI_Allreduce(&v, &out, 1, MPI_UINT64_T, MPI_MAX, comm_), "MPI_Allreduce");
  return out;
}

double Comm::max(double v) const {
  const Timed timed(*this);
  double out = 0;
  check_mpi(MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MAX, comm_), "MPI_Allreduce");
  return out;
}

std::vector<std::uint64_t> Comm::allgather(std::uint64_t v) const {
  const Timed timed(*this);
  std::vector<std::uint64_t> out(static_cast<std::size_t>(size_));
  check_mpi(MPI_Allgather(&v, 1, MPI_UINT64_T, out.data(), 1, MPI_UINT64_T, comm_), "MPI_Allgather");
  return out;
}

std::string Comm::agree_on_error(const std::string& local_error) const {
  const Timed timed(*this);
  // Lowest failing rank wins; its message is broadcast so every rank reports the same thing.
  const int mine = local_error.empty() ? size_ : rank_;
  int first = size_;
  check_mpi(MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm_), "MPI_Allreduce");
  if (first == size_) return {};
  int len = first == rank_ ? static_cast<int>(local_error.size()) : 0;
  check_mpi(MPI_Bcast(&len, 1, MPI_INT, first, comm_), "MPI_Bcast");
  std::string msg = first == rank_ ? local_error : std::string(static_cast<std::size_t>(len), '\0');
  check_mpi(MPI_Bcast(msg.data(), len, MPI_CHAR, first, comm_), "MPI_Bcast");
  return msg;
}

void Comm::broadcast(void* data, std::size_t bytes, int root) const {
  const Timed timed(*this);
  check_mpi(MPI_Bcast(data, static_cast<int>(bytes), MPI_BYTE, root, comm_), "MPI_Bcast");
}

void broadcast_string(const Comm& comm, std::string& s, int root) {
  std::uint64_t n = s.size();
  comm.broadcast(&n, sizeof n, root);
  s.resize(n);
  for (std::uint64_t done = 0; done < n;) {  // MPI counts are int
    const std::uint64_t part = std::min<std::uint64_t>(n - done, INT_MAX);
    comm.broadcast(s.data() + done, part, root);
    done += part;
  }
}

void Comm::barrier() const {
  const Timed timed(*this);
  check_mpi(MPI_Barrier(comm_), "MPI_Barrier");
}

}  // namespace dpstream::shuffle
