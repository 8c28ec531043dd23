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

evp_mac_ctx_st* make_siphash(const noise::Secret& secret, IdDomain domain) {
  // K_domain = HMAC-SHA256(secret, "dpstream ids" || domain byte)[0..16)
  std::array<unsigned char, 13> label{'d', 'p', 's', 't', 'r', 'e', 'a', 'm', ' ', 'i', 'd', 's', 0};
  label.back() = static_cast<unsigned char>(domain);
  std::array<unsigned char, 32> mac{};
  unsigned int mac_len = 0;
  if (!HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), label.data(), label.size(), mac.data(),
            &mac_len))
    throw std::runtime_error("HMAC-SHA256 failed while deriving the id key");
  EVP_MAC* alg = EVP_MAC_fetch(nullptr, "SIPHASH", nullptr);
  if (!alg) throw std::runtime_error("OpenSSL has no SIPHASH MAC");
  EVP_MAC_CTX* ctx = EVP_MAC_CTX_new(alg);
  EVP_MAC_free(alg);
  if (!ctx) throw std::runtime_error("cannot create the SipHash context");
  size_t out_size = 16;
  const OSSL_PARAM params[] = {OSSL_PARAM_construct_size_t(OSSL_MAC_PARAM_SIZE, &out_size), OSSL_PARAM_construct_end()};
  const bool ok = EVP_MAC_init(ctx, mac.data(), 16, params) == 1;
  OPENSSL_cleanse(mac.data(), mac.size());
  if (!ok) {
    EVP_MAC_CTX_free(ctx);
    throw std::runtime_error("cannot key SipHash-2-4-128");
  }
  return ctx;
}

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

void IdPrf::CtxFree::operator()(evp_mac_ctx_st* ctx) const { EVP_MAC_CTX_free(ctx); }

IdPrf::IdPrf(const noise::Secret& secret, int id_bits)
    : user_(make_siphash(secret, IdDomain::User)),
      key_(make_siphash(secret, IdDomain::Key)),
      id_mask_(id_bits >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << std::max(id_bits, 1)) - 1) {}
IdPrf::IdPrf(IdPrf&&) noexcept = default;
IdPrf& IdPrf::operator=(IdPrf&&) noexcept = default;
IdPrf::~IdPrf() = default;

Id128 IdPrf::operator()(IdDomain domain, std::string_view text) {
  EVP_MAC_CTX* ctx = domain == IdDomain::User ? user_.get() : key_.get();
  std::array<unsigned char, 16> out{};
  size_t len = 0;
  // EVP_MAC_init with no key restarts the keyed state.
  if (EVP_MAC_init(ctx, nullptr, 0, nullptr) != 1 ||
      EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(text.data()), text.size()) != 1 ||
      EVP_MAC_final(ctx, out.data(), &len, out.size()) != 1 || len != out.size())
    throw std::runtime_error("SipHash-2-4-128 failed");
  return {load_le64(out.data()) & id_mask_, load_le64(out.data() + 8)};
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
