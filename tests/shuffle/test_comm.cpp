#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <thread>

#include "common/default_init.hpp"
#include "common/elapsed.hpp"
#include "partition/hash.hpp"
#include "shuffle/comm.hpp"

using dpstream::shuffle::Comm;

namespace {
// Items rank s sends to rank d: a deterministic, uneven count, values encode (s, d, i).
std::uint64_t count_for(int s, int d) {
  return (static_cast<std::uint64_t>(s) * 7 + static_cast<std::uint64_t>(d) * 13) % 11 * 37 + (s == d ? 5 : 0);
}
std::uint64_t value_for(int s, int d, std::uint64_t i) {
  return (static_cast<std::uint64_t>(s) << 40) | (static_cast<std::uint64_t>(d) << 32) | i;
}

std::vector<std::uint64_t> exchange(const Comm& comm) {
  std::vector<std::uint64_t> send, offsets{0};
  for (int d = 0; d < comm.size(); ++d) {
    for (std::uint64_t i = 0; i < count_for(comm.rank(), d); ++i) send.push_back(value_for(comm.rank(), d, i));
    offsets.push_back(send.size());
  }
  return comm.alltoallv(send, offsets);
}

void expect_received(const Comm& comm, const std::vector<std::uint64_t>& got) {
  std::vector<std::uint64_t> want;
  for (int s = 0; s < comm.size(); ++s)
    for (std::uint64_t i = 0; i < count_for(s, comm.rank()); ++i) want.push_back(value_for(s, comm.rank(), i));
  EXPECT_EQ(got, want);
}
}  // namespace

TEST(Alltoallv, DeliversEverySegmentInSourceOrder) {
  Comm comm;
  expect_received(comm, exchange(comm));
}

TEST(Alltoallv, RoundsGiveTheSameResult) {
  Comm comm;
  for (std::uint64_t limit : {8ULL, 40ULL, 1000ULL}) {  // bytes per round: forces many rounds
    comm.set_round_limit_bytes(limit);
    expect_received(comm, exchange(comm));
  }
}

TEST(Alltoallv, EmptyEverywhere) {
  Comm comm;
  std::vector<std::uint64_t> none;
  std::vector<std::uint64_t> offsets(comm.size() + 1, 0);
  EXPECT_TRUE(comm.alltoallv(none, offsets).empty());
}

TEST(Alltoallv, CountsTraffic) {
  Comm comm;
  dpstream::shuffle::TrafficCounter t;
  std::vector<std::uint64_t> send(static_cast<std::size_t>(comm.size()) * 3, 1), offsets;
  for (int d = 0; d <= comm.size(); ++d) offsets.push_back(std::uint64_t{3} * d);
  comm.alltoallv(send, offsets, &t);
  EXPECT_EQ(t.bytes_total, send.size() * 8);
  EXPECT_EQ(t.bytes_sent_to_others, (send.size() - 3) * 8);
}

// Batches exchanged at once give each batch what its own alltoallv gives, by MPI datatypes (the default
// limit) and in rounds (a limit of 16 bytes): batch b's counts are the plain exchange's shifted by b (some
// of them 0, so empty blocks sit between full ones), and its values carry b. Fails if a block is placed
// after another source's, if the counts are read from another place, or if batches are interleaved.
TEST(AlltoallvBatches, EachBatchAsItsOwnExchange) {
  Comm comm;
  const int P = comm.size();
  for (std::size_t batches : {1u, 2u, 5u}) {
    for (std::uint64_t limit : {std::uint64_t{16}, (std::uint64_t{1} << 31) - 1}) {  // rounds, or one
      comm.set_round_limit_bytes(limit);
      std::vector<std::vector<std::array<std::uint64_t, 3>>> items(batches);
      std::vector<std::vector<std::uint64_t>> offsets(batches);
      // Some peers get nothing in any batch (a type of empty blocks only): (s + d) % 3 == 2, from 2 ranks on.
      const auto count = [](int s, int d, std::size_t b) {
        return (s + d) % 3 == 2 ? 0 : (count_for(s, d) + 3 * b) % 7;
      };
      for (std::size_t b = 0; b < batches; ++b) {
        offsets[b].push_back(0);
        for (int d = 0; d < P; ++d) {
          for (std::uint64_t i = 0; i < count(comm.rank(), d, b); ++i)
            items[b].push_back({value_for(comm.rank(), d, i), b, ~i});
          offsets[b].push_back(items[b].size());
        }
      }
      dpstream::shuffle::TrafficCounter traffic;
      const std::uint64_t calls_before = comm.collective_calls();
      const auto got = comm.alltoallv_batches(items, offsets, &traffic);
      // The path taken: one collective by datatypes (or one alltoallv for one batch); past the limit, the
      // refused datatype path, then the exchange in rounds.
      EXPECT_EQ(comm.collective_calls() - calls_before, batches > 1 && limit == 16 ? 2u : 1u)
          << batches << " batches, limit " << limit;
      ASSERT_EQ(got.size(), batches);
      for (std::size_t b = 0; b < batches; ++b) {
        std::vector<std::array<std::uint64_t, 3>> want;
        for (int s = 0; s < P; ++s)
          for (std::uint64_t i = 0; i < count(s, comm.rank(), b); ++i)
            want.push_back({value_for(s, comm.rank(), i), b, ~i});
        EXPECT_EQ(got[b], want) << "batch " << b << " of " << batches;
        EXPECT_EQ(got[b], comm.alltoallv(items[b], offsets[b])) << "batch " << b << " of " << batches;
      }
      // Into vectors that are not zero-filled first (the user shuffle's), by the same path: the same items.
      using Item = std::array<std::uint64_t, 3>;
      const auto unzeroed = comm.alltoallv_batches<Item, dpstream::DefaultInitVector<Item>>(items, offsets);
      ASSERT_EQ(unzeroed.size(), batches);
      for (std::size_t b = 0; b < batches; ++b)
        EXPECT_TRUE(std::equal(unzeroed[b].begin(), unzeroed[b].end(), got[b].begin(), got[b].end()))
            << "batch " << b << " of " << batches << ", limit " << limit;
      std::uint64_t sent = 0, kept = 0;
      for (std::size_t b = 0; b < batches; ++b) {
        sent += items[b].size() * sizeof(items[b][0]);
        kept += (offsets[b][comm.rank() + 1] - offsets[b][comm.rank()]) * sizeof(items[b][0]);
      }
      EXPECT_EQ(traffic.bytes_total, sent);  // the items' bytes, by either path
      EXPECT_EQ(traffic.bytes_sent_to_others, sent - kept);
    }
  }
  comm.set_round_limit_bytes((std::uint64_t{1} << 31) - 1);
}

// DefaultInitVector's allocator leaves an element constructed with no arguments unwritten (what MPI then
// writes), and constructs one with arguments as std::allocator does. Fails if it value-initializes (zeroes).
TEST(DefaultInitVector, SizesWithoutWritingAndConstructsWithArguments) {
  using Item = std::array<std::uint64_t, 3>;
  alignas(Item) std::array<unsigned char, sizeof(Item)> bytes;
  bytes.fill(0xAB);
  dpstream::DefaultInitAllocator<Item> alloc;
  alloc.construct(reinterpret_cast<Item*>(bytes.data()));
  for (const unsigned char b : bytes) EXPECT_EQ(b, 0xAB);
  alloc.construct(reinterpret_cast<Item*>(bytes.data()), Item{1, 2, 3});
  Item back{};
  std::memcpy(&back, bytes.data(), sizeof back);
  EXPECT_EQ(back, (Item{1, 2, 3}));
  dpstream::DefaultInitVector<Item> v{{4, 5, 6}};
  v.resize(3);
  v[1] = {7, 8, 9};
  v[2] = {1, 1, 1};
  v.push_back({2, 2, 2});
  EXPECT_EQ(v.size(), 4u);
  EXPECT_EQ(v.front(), (Item{4, 5, 6}));
  EXPECT_EQ(v.back(), (Item{2, 2, 2}));
}

TEST(VariableLength, StringsRoundTripThroughTheExchange) {
  Comm comm;
  std::vector<dpstream::shuffle::ByteWriter> w(comm.size());
  for (int d = 0; d < comm.size(); ++d)
    for (int i = 0; i <= d; ++i) {
      w[d].put(static_cast<std::uint64_t>(comm.rank()));
      w[d].put_string(std::string(static_cast<std::size_t>(i * 3), 'a' + static_cast<char>(d)) + ",\"\n");
    }
  std::vector<std::byte> send;
  std::vector<std::uint64_t> offsets{0};
  for (auto& x : w) {
    send.insert(send.end(), x.bytes().begin(), x.bytes().end());
    offsets.push_back(send.size());
  }
  comm.set_round_limit_bytes(16);
  std::vector<std::uint64_t> recv_offsets;
  const auto recv = comm.alltoallv_bytes(send.data(), offsets, recv_offsets);
  dpstream::shuffle::ByteReader in(recv.data(), recv.size());
  for (int s = 0; s < comm.size(); ++s)
    for (int i = 0; i <= comm.rank(); ++i) {
      EXPECT_EQ(in.get<std::uint64_t>(), static_cast<std::uint64_t>(s));
      EXPECT_EQ(in.get_string(),
                std::string(static_cast<std::size_t>(i * 3), 'a' + static_cast<char>(comm.rank())) + ",\"\n");
    }
  EXPECT_TRUE(in.done());
}

TEST(VariableLength, TruncatedMessageThrows) {
  dpstream::shuffle::ByteWriter w;
  w.put_string("hello");
  dpstream::shuffle::ByteReader r(w.bytes().data(), w.size() - 1);
  EXPECT_THROW(r.get_string(), std::runtime_error);
}

TEST(VariableLength, ArraysAndViewsRoundTrip) {
  dpstream::shuffle::ByteWriter w;
  const std::vector<std::uint64_t> ids{3, 1ULL << 63, 0, 42};
  w.put(std::uint32_t{7});  // arrays need no alignment
  w.put_array(ids.data(), ids.size());
  w.put_array(ids.data(), 0);
  w.put_string("a,b\n");
  w.put_string("");
  dpstream::shuffle::ByteReader r(w.bytes().data(), w.size());
  EXPECT_EQ(r.get<std::uint32_t>(), 7u);
  EXPECT_EQ(r.get_array<std::uint64_t>(ids.size()), ids);
  EXPECT_TRUE(r.get_array<std::uint64_t>(0).empty());
  EXPECT_EQ(r.get_view(), "a,b\n");
  EXPECT_EQ(r.get_view(), "");
  EXPECT_TRUE(r.done());
  dpstream::shuffle::ByteReader short_read(w.bytes().data(), 4 + 8 * 3);
  short_read.get<std::uint32_t>();
  EXPECT_THROW(short_read.get_array<std::uint64_t>(4), std::runtime_error);
}

TEST(Gather, RootGetsAllInRankOrder) {
  Comm comm;
  std::vector<std::byte> mine(static_cast<std::size_t>(comm.rank()) + 1,
                              std::byte{static_cast<unsigned char>(comm.rank())});
  comm.set_round_limit_bytes(3);
  const auto all = comm.gather_bytes_to_root(mine);
  if (comm.rank() == 0) {
    std::size_t k = 0;
    for (int r = 0; r < comm.size(); ++r)
      for (int i = 0; i <= r; ++i) EXPECT_EQ(all.at(k++), std::byte{static_cast<unsigned char>(r)});
    EXPECT_EQ(k, all.size());
  } else {
    EXPECT_TRUE(all.empty());
  }
}

TEST(Agreement, FirstFailingRankMessageReachesAll) {
  Comm comm;
  EXPECT_EQ(comm.agree_on_error(""), "");
  const int bad = comm.size() - 1;
  const std::string msg = comm.agree_on_error(comm.rank() == bad ? "rank " + std::to_string(bad) + " says no" : "");
  EXPECT_EQ(msg, "rank " + std::to_string(bad) + " says no");
}

TEST(Collectives, SumMaxAllgather) {
  Comm comm;
  const auto P = static_cast<std::uint64_t>(comm.size());
  EXPECT_EQ(comm.sum(static_cast<std::uint64_t>(comm.rank()) + 1), P * (P + 1) / 2);
  EXPECT_EQ(comm.max(static_cast<std::uint64_t>(comm.rank())), P - 1);
  const auto all = comm.allgather(static_cast<std::uint64_t>(comm.rank()) * 10);
  for (std::uint64_t r = 0; r < P; ++r) EXPECT_EQ(all[r], r * 10);
}

// collective_seconds counts the time a rank waits inside collectives: while the last rank sleeps before
// a barrier, every other rank waits there (a lower bound far below the sleep: ranks may leave the first
// barrier apart on a loaded host). Local work outside collectives is not counted, and a collective that
// calls another (alltoallv's agreement on rounds) is counted once: never more than the time around the call.
TEST(Collectives, SecondsInsideCollectivesCountTheWaitOnce) {
  using dpstream::seconds_since;
  using Clock = dpstream::SteadyClock;
  Comm comm;
  comm.barrier();
  double before = comm.collective_seconds();
  if (comm.rank() == comm.size() - 1) std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  EXPECT_EQ(comm.collective_seconds(), before);  // the sleep is not inside a collective
  auto t0 = Clock::now();
  comm.barrier();
  const double around = seconds_since(t0);
  const double waited = comm.collective_seconds() - before;
  if (comm.rank() != comm.size() - 1) {
    EXPECT_GE(waited, 0.25);
  }
  EXPECT_GT(waited, 0.0);
  EXPECT_LE(waited, around);

  // The last rank receives 128 MiB and zeroes its buffer before alltoallv's inner agreement on rounds, while
  // the others wait there: counted twice, their figure would exceed the time around the call.
  const std::size_t P = static_cast<std::size_t>(comm.size());
  const std::size_t share = (std::size_t{128} << 20) / P;
  const std::vector<std::byte> bulk(share);
  std::vector<std::uint64_t> offsets(P, 0);  // everything to the last rank: [0, share)
  offsets.push_back(share);
  for (int i = 0; i < 3; ++i) {
    std::vector<std::uint64_t> recv_offsets;
    before = comm.collective_seconds();
    t0 = Clock::now();
    const auto got = comm.alltoallv_bytes(bulk.data(), offsets, recv_offsets);
    const double exchange_around = seconds_since(t0);
    EXPECT_EQ(got.size(), comm.rank() == comm.size() - 1 ? share * P : 0);
    EXPECT_GT(comm.collective_seconds(), before);
    EXPECT_LE(comm.collective_seconds() - before, exchange_around);
    before = comm.collective_seconds();
    t0 = Clock::now();
    (void)comm.gather_bytes_to_root(std::vector<std::byte>(16));
    const double gather_around = seconds_since(t0);
    EXPECT_GT(comm.collective_seconds(), before);
    EXPECT_LE(comm.collective_seconds() - before, gather_around);
  }
}
