// Keyed ids of CSV strings. A user id or key string maps to 128 pseudorandom bits under a key derived
// from the job's secret: `id` (64 bits) is what the pipeline carries, `check` (64 bits) tells two
// strings with the same `id` apart. Without the secret nobody can compute an id, so no one can forge a
// string that merges with another user (docs/PRIVACY.md section 9).
#pragma once

#include <absl/container/flat_hash_map.h>

#include <cstdint>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "kernels/noise.hpp"
#include "shuffle/comm.hpp"

struct evp_mac_ctx_st;  // OpenSSL's EVP_MAC_CTX

namespace dpstream {

struct Id128 {
  std::uint64_t id;
  std::uint64_t check;
  friend bool operator==(const Id128&, const Id128&) = default;
  friend auto operator<=>(const Id128&, const Id128&) = default;
  template <class H>
  friend H AbslHashValue(H h, const Id128& x) {
    return H::combine(std::move(h), x.id, x.check);
  }
};

enum class IdDomain : std::uint8_t { User, Key };

// SipHash-2-4 with 128-bit output (OpenSSL EVP_MAC "SIPHASH"), a PRF for short inputs, keyed with the
// first 16 bytes of HMAC-SHA256(secret, label): one key per use, apart by label. Not thread-safe.
class KeyedSipHash {
 public:
  KeyedSipHash(const noise::Secret& secret, std::string_view label);
  KeyedSipHash(KeyedSipHash&&) noexcept;
  KeyedSipHash& operator=(KeyedSipHash&&) noexcept;
  ~KeyedSipHash();
  // The MAC's two little-endian 64-bit halves.
  std::pair<std::uint64_t, std::uint64_t> operator()(const void* data, std::size_t size) const;

 private:
  struct CtxFree {
    void operator()(evp_mac_ctx_st* ctx) const;
  };
  std::unique_ptr<evp_mac_ctx_st, CtxFree> ctx_;
};

// Ids of user and key strings: KeyedSipHash under "dpstream ids" || domain byte. One per thread.
class IdPrf {
 public:
  // id_bits < 64 keeps only the low bits of `id`: tests use it to make collisions common.
  explicit IdPrf(const noise::Secret& secret, int id_bits = 64);
  IdPrf(IdPrf&&) noexcept;
  IdPrf& operator=(IdPrf&&) noexcept;
  ~IdPrf();
  Id128 operator()(IdDomain domain, std::string_view text);

 private:
  KeyedSipHash user_, key_;
  std::uint64_t id_mask_;
};

// Keeps apart distinct ids that share their 64-bit `id`. Collective: every rank passes the distinct
// ids it holds; the owner of each `id` (routed with `salt`) sorts the checks sharing it, the smallest
// keeps the id and each other one moves to a fresh id derived from (id, check); repeated until no two
// distinct ids share an `id`. Returns the moved ids among this rank's, original -> new `id`. The result
// depends only on the set of ids, never on rank count or order.
absl::flat_hash_map<Id128, std::uint64_t> separate_colliding_ids(const std::vector<Id128>& local_distinct,
                                                                 std::uint64_t salt, const shuffle::Comm& comm);

}  // namespace dpstream
