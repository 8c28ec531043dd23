// AES-256 in ECB mode on runs of blocks: the noise PRF's cipher (kernels/noise.hpp). Where the CPU has VAES
// and AVX-512, up to 32 blocks go through each round together (four per instruction), about three times
// OpenSSL's AES-NI code per block here (docs/PERFORMANCE.md round 32); elsewhere OpenSSL's EVP does the
// work. Both are FIPS-197 AES-256 of each block, so the choice is invisible in every output
// (tests/kernels/test_aes_blocks.cpp compares them block for block and checks FIPS-197's test vector).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

struct evp_cipher_ctx_st;  // OpenSSL's EVP_CIPHER_CTX

namespace dpstream::noise {

class Aes256Blocks {
 public:
  enum class Engine { Vaes512, OpenSsl };
  static constexpr std::size_t kKeyBytes = 32;
  static constexpr std::size_t kBlockBytes = 16;

  // The fastest engine this CPU runs, or OpenSSL's when `engine` says so (for tests and measurements).
  explicit Aes256Blocks(const std::uint8_t* key, Engine engine = best_engine());
  Aes256Blocks(Aes256Blocks&&) noexcept;
  Aes256Blocks& operator=(Aes256Blocks&&) noexcept;
  // Wipes the round keys (the EVP context wipes its own). The VAES code reads them from this object only and
  // clears the vector registers before it returns: no copy of the schedule is left behind on purpose.
  ~Aes256Blocks();

  // out[i] = AES-256(in[i]) for n 16-byte blocks (in and out may be the same buffer).
  void encrypt(const std::uint8_t* in, std::uint8_t* out, std::size_t n);
  // out[i] = AES-256 of the block whose big-endian 64-bit words are `high` and low + i step, for n blocks (the
  // caller keeps low + (n - 1) step from wrapping): a counter run, its plaintexts made in registers (VAES) or
  // in a buffer (OpenSSL).
  void encrypt_run(std::uint64_t high, std::uint64_t low, std::uint64_t step, std::uint8_t* out, std::size_t n);
  Engine engine() const { return engine_; }
  // Vaes512 when this build targets x86-64 and the CPU has VAES, AVX-512F and AES-NI; else OpenSsl.
  static Engine best_engine();

 private:
  struct CtxFree {
    void operator()(evp_cipher_ctx_st* ctx) const;
  };
  static constexpr std::size_t kRounds = 14;
  Engine engine_;
  std::unique_ptr<evp_cipher_ctx_st, CtxFree> ctx_;  // OpenSsl only
  // Vaes512 only: FIPS-197's expanded key, round r four times at bytes 64 r .. 64 r + 63 (one register's worth).
  alignas(64) std::uint8_t round_keys_[(kRounds + 1) * 4 * kBlockBytes] = {};
};

}  // namespace dpstream::noise
