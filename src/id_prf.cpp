#include "src/id_prf.hpp"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/params.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <stdexcept>

#include "partition/hash.hpp"
#include "partition/partitioner.hpp"

namespace dpstream {

namespace {

std::uint64_t load_le64(const unsigned char* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = v << 8 | p[i];
  return v;
}

// All ranks receive every rank's bytes, in rank order.
std::vector<std::byte> allgather_bytes(const std::vector<std::byte>& mine, const shuffle::Comm& comm) {
  auto all = comm.gather_bytes_to_root(mine);
  std::uint64_t size = all.size();
  comm.broadcast(&size, sizeof size);
  all.resize(size);
  if (size) comm.broadcast(all.data(), size);
  return all;
}

}  // namespace

void KeyedSipHash::CtxFree::operator()(evp_mac_ctx_st* ctx) const { EVP_MAC_CTX_free(ctx); }

KeyedSipHash::KeyedSipHash(const noise::Secret& secret, std::string_view label) {
  std::array<unsigned char, 32> mac{};  // the key: its first 16 bytes
  unsigned int mac_len = 0;
  if (!HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
            reinterpret_cast<const unsigned char*>(label.data()), label.size(), mac.data(), &mac_len))
    throw std::runtime_error("HMAC-SHA256 failed while deriving a SipHash key");
  EVP_MAC* alg = EVP_MAC_fetch(nullptr, "SIPHASH", nullptr);
  if (!alg) throw std::runtime_error("OpenSSL has no SIPHASH MAC");
  ctx_.reset(EVP_MAC_CTX_new(alg));
  EVP_MAC_free(alg);
  size_t out_size = 16;
  const OSSL_PARAM params[] = {OSSL_PARAM_construct_size_t(OSSL_MAC_PARAM_SIZE, &out_size), OSSL_PARAM_construct_end()};
  const bool ok = ctx_ && EVP_MAC_init(ctx_.get(), mac.data(), 16, params) == 1;
  OPENSSL_cleanse(mac.data(), mac.size());
  if (!ok) throw std::runtime_error("cannot key SipHash-2-4-128");
}
KeyedSipHash::KeyedSipHash(KeyedSipHash&&) noexcept = default;
KeyedSipHash& KeyedSipHash::operator=(KeyedSipHash&&) noexcept = default;
KeyedSipHash::~KeyedSipHash() = default;

std::pair<std::uint64_t, std::uint64_t> KeyedSipHash::operator()(const void* data, std::size_t size) const {
  std::array<unsigned char, 16> out{};
  size_t len = 0;
  // EVP_MAC_init with no key restarts the keyed state.
  if (EVP_MAC_init(ctx_.get(), nullptr, 0, nullptr) != 1 ||
      EVP_MAC_update(ctx_.get(), static_cast<const unsigned char*>(data), size) != 1 ||
      EVP_MAC_final(ctx_.get(), out.data(), &len, out.size()) != 1 || len != out.size())
    throw std::runtime_error("SipHash-2-4-128 failed");
  return {load_le64(out.data()), load_le64(out.data() + 8)};
}

namespace {
std::string id_label(IdDomain domain) {  // "dpstream ids" || domain byte
  std::string label = "dpstream ids";
  label += static_cast<char>(domain);
  return label;
}
}  // namespace

IdPrf::IdPrf(const noise::Secret& secret, int id_bits)
    : user_(secret, id_label(IdDomain::User)),
      key_(secret, id_label(IdDomain::Key)),
      id_mask_(id_bits >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << std::max(id_bits, 1)) - 1) {}
IdPrf::IdPrf(IdPrf&&) noexcept = default;
IdPrf& IdPrf::operator=(IdPrf&&) noexcept = default;
IdPrf::~IdPrf() = default;

Id128 IdPrf::operator()(IdDomain domain, std::string_view text) {
  const auto [id, check] = (domain == IdDomain::User ? user_ : key_)(text.data(), text.size());
  return {id & id_mask_, check};
}

absl::flat_hash_map<Id128, std::uint64_t> separate_colliding_ids(const std::vector<Id128>& local_distinct,
                                                                 std::uint64_t salt, const shuffle::Comm& comm) {
  const int P = comm.size();
  // Current (id, check) of each local original; only moved ones differ from the original.
  std::vector<Id128> current = local_distinct;
  for (std::uint64_t pass = 0;; ++pass) {
    if (pass == 64) throw std::runtime_error("ids still collide after 64 separation passes");
    // 1. every distinct current pair to the owner of its id (the engine's partition and all-to-all).
    const auto by_owner = partition::partition_by(current, static_cast<std::size_t>(P), [&](const Id128& x) {
      return partition::owner_rank(partition::salted_hash(x.id, salt), P);
    });
    std::vector<Id128> owned = comm.alltoallv(by_owner.items, by_owner.offsets);
    // 2. the owner: in each group sharing an id, every check after the smallest moves.
    std::sort(owned.begin(), owned.end());
    owned.erase(std::unique(owned.begin(), owned.end()), owned.end());
    shuffle::ByteWriter moves;
    for (std::size_t i = 1; i < owned.size(); ++i)
      if (owned[i].id == owned[i - 1].id) {
        moves.put(owned[i].id);
        moves.put(owned[i].check);
        moves.put(partition::mix64(owned[i].id ^ partition::mix64(owned[i].check + pass + 1)));
      }
    // 3. every rank learns the moves (rare: almost always none) and applies them to its pairs.
    const auto all = allgather_bytes(moves.bytes(), comm);
    if (all.empty()) break;
    absl::flat_hash_map<Id128, std::uint64_t> moved;
    for (shuffle::ByteReader in(all.data(), all.size()); !in.done();) {
      const auto id = in.get<std::uint64_t>();
      const auto check = in.get<std::uint64_t>();
      moved[{id, check}] = in.get<std::uint64_t>();
    }
    for (auto& x : current)
      if (const auto it = moved.find(x); it != moved.end()) x.id = it->second;
  }
  absl::flat_hash_map<Id128, std::uint64_t> result;
  for (std::size_t i = 0; i < current.size(); ++i)
    if (current[i].id != local_distinct[i].id) result[local_distinct[i]] = current[i].id;
  return result;
}

}  // namespace dpstream
