// The noise PRF's cipher (kernels/aes_blocks.hpp): FIPS-197's AES-256 test vector on every engine this CPU runs,
// and the VAES engine against OpenSSL's block for block, at every run length of its passes,
// in place and at misaligned addresses.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <vector>

#include "kernels/aes_blocks.hpp"
#include "kernels/cpu_features.hpp"

using dpstream::noise::Aes256Blocks;

namespace {

std::vector<Aes256Blocks::Engine> engines() {
  std::vector<Aes256Blocks::Engine> e{Aes256Blocks::Engine::OpenSsl};
  if (Aes256Blocks::best_engine() == Aes256Blocks::Engine::Vaes512) e.push_back(Aes256Blocks::Engine::Vaes512);
  return e;
}

std::vector<std::uint8_t> random_bytes(std::mt19937_64& rng, std::size_t n) {
  std::vector<std::uint8_t> v(n);
  for (auto& b : v) b = static_cast<std::uint8_t>(rng());
  return v;
}

}  // namespace

// FIPS-197 appendix C.3: key 00 01 .. 1f, plaintext 00 11 22 .. ff.
TEST(Aes256Blocks, Fips197TestVector) {
  std::uint8_t key[32], block[16];
  for (int i = 0; i < 32; ++i) key[i] = static_cast<std::uint8_t>(i);
  const std::uint8_t want[16] = {0x8e, 0xa2, 0xb7, 0xca, 0x51, 0x67, 0x45, 0xbf,
                                 0xea, 0xfc, 0x49, 0x90, 0x4b, 0x49, 0x60, 0x89};
  for (const auto engine : engines()) {
    Aes256Blocks aes(key, engine);
    EXPECT_EQ(aes.engine(), engine);
    // The vector at every position of a 37-block run: inside the 32-block passes and in the rest.
    std::vector<std::uint8_t> run(std::size_t{37} * 16);
    for (std::size_t b = 0; b < 37; ++b)
      for (int i = 0; i < 16; ++i) run[16 * b + i] = static_cast<std::uint8_t>(0x11 * i);
    aes.encrypt(run.data(), run.data(), 37);  // in place
    for (std::size_t b = 0; b < 37; ++b)
      for (int i = 0; i < 16; ++i) ASSERT_EQ(run[16 * b + i], want[i]) << "block " << b << " byte " << i;
    for (int i = 0; i < 16; ++i) block[i] = static_cast<std::uint8_t>(0x11 * i);
    aes.encrypt(block, block, 1);
    for (int i = 0; i < 16; ++i) EXPECT_EQ(block[i], want[i]);
  }
}

TEST(Aes256Blocks, VaesMatchesOpenSslBlockForBlock) {
  if (Aes256Blocks::best_engine() != Aes256Blocks::Engine::Vaes512)
    GTEST_SKIP() << "this CPU has no VAES with AVX-512: only OpenSSL's engine runs here";
  std::mt19937_64 rng(20261203);
  for (int trial = 0; trial < 20; ++trial) {
    const std::vector<std::uint8_t> key = random_bytes(rng, 32);
    Aes256Blocks vaes(key.data(), Aes256Blocks::Engine::Vaes512), ssl(key.data(), Aes256Blocks::Engine::OpenSsl);
    // Every run length up to 70 (each register count of a pass, each fill of its last register) and a long one.
    std::vector<std::size_t> lengths(71);
    for (std::size_t n = 0; n < lengths.size(); ++n) lengths[n] = n;
    lengths.push_back(1000);
    for (const std::size_t n : lengths) {
      const std::vector<std::uint8_t> in = random_bytes(rng, 16 * n);
      std::vector<std::uint8_t> a(16 * n + 1, 0xa5), b(16 * n + 1, 0xa5);  // a guard byte after the run
      vaes.encrypt(in.data(), a.data(), n);
      ssl.encrypt(in.data(), b.data(), n);
      ASSERT_EQ(a, b) << "key trial " << trial << ", " << n << " blocks";
      EXPECT_EQ(a.back(), 0xa5);
    }
  }
}

// A counter run (the normal sampler's batches: one node's block 0 after another) is the blocks of its big-endian
// words encrypted one by one, on every engine, at every run length up to 70 (each register count of a pass, each
// fill of its last register) and a long one, with steps that carry across bytes and a low word that wraps.
TEST(Aes256Blocks, CounterRunIsItsBlocksEncrypted) {
  std::mt19937_64 rng(20261205);
  const std::vector<std::uint8_t> key = random_bytes(rng, 32);
  Aes256Blocks ssl(key.data(), Aes256Blocks::Engine::OpenSsl);
  for (const auto engine : engines()) {
    Aes256Blocks aes(key.data(), engine);
    std::vector<std::size_t> lengths(71);
    for (std::size_t n = 0; n < lengths.size(); ++n) lengths[n] = n;
    lengths.push_back(1000);
    for (const std::size_t n : lengths)
      for (const std::uint64_t step :
           {std::uint64_t{1} << 15, std::uint64_t{0xff}, std::uint64_t{0x0123456789abcdef}}) {
        const std::uint64_t high = rng(), low = n == 1000 ? ~std::uint64_t{0} - 300 * step : rng();
        std::vector<std::uint8_t> in(16 * n), want(16 * n);
        for (std::size_t i = 0; i < n; ++i)
          for (int byte = 0; byte < 8; ++byte) {
            in[16 * i + byte] = static_cast<std::uint8_t>(high >> (56 - 8 * byte));
            in[16 * i + 8 + byte] = static_cast<std::uint8_t>((low + i * step) >> (56 - 8 * byte));
          }
        ssl.encrypt(in.data(), want.data(), n);
        std::vector<std::uint8_t> got(16 * n + 1, 0xa5);  // a guard byte after the run
        aes.encrypt_run(high, low, step, got.data(), n);
        EXPECT_EQ(got.back(), 0xa5);
        got.pop_back();
        ASSERT_EQ(got, want) << n << " blocks, step " << step << ", engine " << static_cast<int>(engine);
      }
  }
}

// In place with distinct blocks (a pass that mixed up its blocks would show), and at odd addresses.
TEST(Aes256Blocks, InPlaceAndMisalignedMatchOutOfPlace) {
  std::mt19937_64 rng(7);
  const std::vector<std::uint8_t> key = random_bytes(rng, 32);
  for (const auto engine : engines()) {
    Aes256Blocks aes(key.data(), engine), ssl(key.data(), Aes256Blocks::Engine::OpenSsl);
    for (const std::size_t n : {std::size_t{5}, std::size_t{37}, std::size_t{70}}) {
      const std::vector<std::uint8_t> in = random_bytes(rng, 16 * n);
      std::vector<std::uint8_t> want(16 * n);
      ssl.encrypt(in.data(), want.data(), n);
      std::vector<std::uint8_t> same = in;
      aes.encrypt(same.data(), same.data(), n);
      EXPECT_EQ(same, want) << n << " blocks in place";
      for (const std::size_t shift : {std::size_t{1}, std::size_t{3}, std::size_t{8}}) {
        std::vector<std::uint8_t> src(16 * n + shift), dst(16 * n + shift);
        std::copy(in.begin(), in.end(), src.begin() + static_cast<std::ptrdiff_t>(shift));
        aes.encrypt(src.data() + shift, dst.data() + shift, n);
        EXPECT_TRUE(std::equal(want.begin(), want.end(), dst.begin() + static_cast<std::ptrdiff_t>(shift)))
            << n << " blocks at offset " << shift;
      }
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// The engine's own CPUID test agrees with GCC's: a detection that always fell back would pass every other test.
TEST(Aes256Blocks, DetectionAgreesWithTheCompilersCpuModel) {
  const bool gcc_says = __builtin_cpu_supports("vaes") && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("aes");
  EXPECT_EQ(Aes256Blocks::best_engine() == Aes256Blocks::Engine::Vaes512, gcc_says);
  EXPECT_EQ(dpstream::noise::cpu_runs_vaes512(), gcc_says);
  EXPECT_EQ(dpstream::noise::cpu_runs_avx512f(),
            __builtin_cpu_supports("avx512f") != 0);  // the normal sampler's vector path
}
#endif

TEST(Aes256Blocks, MovedFromCipherRefusesToEncrypt) {
  std::uint8_t key[32] = {}, block[16] = {};
  for (const auto engine : engines()) {
    Aes256Blocks a(key, engine);
    Aes256Blocks b(std::move(a));
    EXPECT_NO_THROW(b.encrypt(block, block, 1));
    EXPECT_THROW(a.encrypt(block, block, 1), std::logic_error);  // NOLINT(bugprone-use-after-move): the test
  }
}
