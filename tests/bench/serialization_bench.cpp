// Why dpstream's variable-length messages between ranks use shuffle::ByteWriter / ByteReader and
// not Boost.Serialization: both encode the same message (one rank's release rows: key name and
// end offset per row, then the formatted text, as gather_release_text sends them) and decode it
// again; this prints bytes and time of each, side by side in one run (docs/DESIGN-NOTES.md).
//   bench_serialization [rows]   (default 1,000,000)
#include <fmt/core.h>
#include <boost/archive/binary_iarchive.hpp>
#include <boost/archive/binary_oarchive.hpp>
#include <boost/serialization/string.hpp>
#include <boost/serialization/vector.hpp>

#include <chrono>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "shuffle/comm.hpp"

namespace {

struct Rows {  // one rank's sorted release rows
  std::vector<std::string> names;
  std::vector<std::uint64_t> ends;
  std::string text;
  template <class Archive>
  void serialize(Archive& ar, unsigned /*version*/) {
    ar& names& ends& text;
  }
  bool operator==(const Rows&) const = default;
};

Rows make_rows(std::size_t n) {
  Rows r;
  for (std::size_t i = 0; i < n; ++i) {
    r.names.push_back(fmt::format("key-{}", i * 2654435761u % 100'000'000));
    r.text += fmt::format("0,7,{},{},{}.5\n", r.names.back(), i % 1000, i);
    r.ends.push_back(r.text.size());
  }
  return r;
}

std::vector<std::byte> encode_bytes(const Rows& r) {
  dpstream::shuffle::ByteWriter w;
  w.put(static_cast<std::uint64_t>(r.names.size()));
  for (std::size_t i = 0; i < r.names.size(); ++i) {
    w.put_string(r.names[i]);
    w.put(r.ends[i]);
  }
  w.put_string(r.text);
  return std::move(w.bytes());
}

Rows decode_bytes(const std::vector<std::byte>& b) {
  dpstream::shuffle::ByteReader in(b.data(), b.size());
  Rows r;
  const auto n = in.get<std::uint64_t>();
  r.names.reserve(n);
  r.ends.reserve(n);
  for (std::uint64_t i = 0; i < n; ++i) {
    r.names.push_back(in.get_string());
    r.ends.push_back(in.get<std::uint64_t>());
  }
  r.text = in.get_string();
  return r;
}

std::string encode_boost(const Rows& r) {
  std::ostringstream out;
  boost::archive::binary_oarchive ar(out);
  ar << r;
  return std::move(out).str();
}

Rows decode_boost(const std::string& s) {
  std::istringstream in(s);
  boost::archive::binary_iarchive ar(in);
  Rows r;
  ar >> r;
  return r;
}

template <class Fn>
double best_seconds(Fn&& fn) {  // best of 5: the machine is shared
  double best = 1e300;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t n = argc > 1 ? std::stoull(argv[1]) : 1'000'000;
  const Rows rows = make_rows(n);
  const auto bytes = encode_bytes(rows);
  const auto archive = encode_boost(rows);
  if (!(decode_bytes(bytes) == rows) || !(decode_boost(archive) == rows)) {
    fmt::print(stderr, "bench_serialization: a round trip changed the rows\n");
    return 1;
  }
  const double enc_b = best_seconds([&] { (void)encode_bytes(rows); });
  const double dec_b = best_seconds([&] { (void)decode_bytes(bytes); });
  const double enc_a = best_seconds([&] { (void)encode_boost(rows); });
  const double dec_a = best_seconds([&] { (void)decode_boost(archive); });
  fmt::print("rows {}\n", n);
  fmt::print("ByteWriter          bytes {:>11}  encode {:7.1f} ms  decode {:7.1f} ms\n", bytes.size(), enc_b * 1e3,
             dec_b * 1e3);
  fmt::print("boost binary_archive bytes {:>10}  encode {:7.1f} ms  decode {:7.1f} ms\n", archive.size(), enc_a * 1e3,
             dec_a * 1e3);
  fmt::print("boost / ByteWriter: encode {:.2f}x, decode {:.2f}x the time\n", enc_a / enc_b, dec_a / dec_b);
  return 0;
}
