// Salted 64-bit hashing and the owner rule: which rank owns a user or a key.
#pragma once

#include <cstdint>

#include "common/int128.hpp"  // uint128 for exact multiply-shift range reduction

namespace dpstream::partition {

// Different salts for the user shuffle and the key shuffle, so that the two partitions are
// independent (a rank that owns a heavy user does not also tend to own its heavy keys).
inline constexpr std::uint64_t kUserSalt = 0x9E3779B97F4A7C15ULL;
inline constexpr std::uint64_t kKeySalt = 0xD1B54A32D192ED03ULL;
// For the 32-bit key fingerprints of a user's first-touch set (kernels/bounding.hpp).
inline constexpr std::uint64_t kFingerprintSalt = 0x8CB92BA72F3D8DD7ULL;
// For a user's shard (its low bits) and home slot in the shard's table (its high bits; kernels/bounding.hpp):
// independent of the bits that chose the user's rank, which are the same for every user of the rank.
inline constexpr std::uint64_t kUserSlotSalt = 0x2545F4914F6CDD1DULL;

inline constexpr std::uint64_t kMixMultiplier1 = 0xBF58476D1CE4E5B9ULL;
inline constexpr std::uint64_t kMixMultiplier2 = 0x94D049BB133111EBULL;

// SplitMix64 finalizer: a bijection on 64-bit integers with full avalanche, so two distinct
// ids never share a hash.
constexpr std::uint64_t mix64(std::uint64_t x) {
  x ^= x >> 30;
  x *= kMixMultiplier1;
  x ^= x >> 27;
  x *= kMixMultiplier2;
  x ^= x >> 31;
  return x;
}

// x from y = x ^ (x >> s): x's top s bits are y's, and each further s bits follow from those above them.
constexpr std::uint64_t unshift_xor(std::uint64_t y, int s) {
  std::uint64_t x = y;
  for (int done = s; done < 64; done += s) x = y ^ (x >> s);
  return x;
}

// The inverse of an odd a modulo 2^64: Newton's step x <- x (2 - a x) doubles the correct low bits, from the 3
// of x = a (a a = 1 mod 8 for odd a).
constexpr std::uint64_t inverse_mod_2_64(std::uint64_t a) {
  std::uint64_t x = a;
  for (int i = 0; i < 5; ++i) x *= 2 - a * x;
  return x;
}

// The inverse of mix64: unmix64(mix64(x)) == x for every x.
constexpr std::uint64_t unmix64(std::uint64_t x) {
  x = unshift_xor(x, 31);
  x *= inverse_mod_2_64(kMixMultiplier2);
  x = unshift_xor(x, 27);
  x *= inverse_mod_2_64(kMixMultiplier1);
  return unshift_xor(x, 30);
}
static_assert(unmix64(mix64(0x0123456789ABCDEFULL)) == 0x0123456789ABCDEFULL);

constexpr std::uint64_t salted_hash(std::uint64_t id, std::uint64_t salt) { return mix64(id ^ salt); }
// The id whose salted_hash under `salt` is `hash`.
constexpr std::uint64_t salted_unhash(std::uint64_t hash, std::uint64_t salt) { return unmix64(hash) ^ salt; }

// One more value folded into a running hash (state digests: equal inputs, equal hashes; a change
// of any value changes the hash except with probability ~2^-64).
constexpr std::uint64_t hash_combine(std::uint64_t h, std::uint64_t v) {
  return mix64(h ^ mix64(v + 0x9E3779B97F4A7C15ULL));
}

// Owner rank from the high bits (multiply-shift range reduction: floor(h * P / 2^64)); the low
// bits stay free for local buckets, so owner and bucket are independent.
constexpr int owner_rank(std::uint64_t hash, int ranks) {
  return static_cast<int>((static_cast<uint128>(hash) * static_cast<unsigned>(ranks)) >> 64);
}

// A key's hash: its owner rank (high bits), its shard in the key table (low bits), and its home slot in the
// key table and in key selection's cache index (the bits between), so one computation serves all of them.
constexpr std::uint64_t key_hash(std::uint64_t key) { return salted_hash(key, kKeySalt); }

// The rank that owns a user (its bounding state) and the rank that owns a key (its totals and releases).
constexpr int user_owner(std::uint64_t user, int ranks) { return owner_rank(salted_hash(user, kUserSalt), ranks); }
constexpr int key_owner(std::uint64_t key, int ranks) { return owner_rank(key_hash(key), ranks); }

// Local shard from the low bits; `shards` is a power of two.
constexpr std::size_t local_shard(std::uint64_t hash, std::size_t shards) { return hash & (shards - 1); }

}  // namespace dpstream::partition
