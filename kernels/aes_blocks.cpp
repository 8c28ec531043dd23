#include "kernels/aes_blocks.hpp"

#include "kernels/cpu_features.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <cstring>
#include <stdexcept>
#include <utility>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DPSTREAM_HAVE_VAES_CODE 1
#else
#define DPSTREAM_HAVE_VAES_CODE 0
#endif

namespace dpstream::noise {

namespace {
#if DPSTREAM_HAVE_VAES_CODE
#define DPSTREAM_VAES_TARGET __attribute__((target("aes,avx512f,avx512bw,vaes")))

// Clears every vector register the code below may leave key material in (OpenSSL's AES-NI code does the same):
// VZEROALL for zmm0-15, and zmm16-31, which AVX-512 code also allocates.
DPSTREAM_VAES_TARGET inline void clear_vector_registers() {
  _mm256_zeroall();
  __asm__ volatile(
      "vpxord %%zmm16, %%zmm16, %%zmm16\n\tvpxord %%zmm17, %%zmm17, %%zmm17\n\t"
      "vpxord %%zmm18, %%zmm18, %%zmm18\n\tvpxord %%zmm19, %%zmm19, %%zmm19\n\t"
      "vpxord %%zmm20, %%zmm20, %%zmm20\n\tvpxord %%zmm21, %%zmm21, %%zmm21\n\t"
      "vpxord %%zmm22, %%zmm22, %%zmm22\n\tvpxord %%zmm23, %%zmm23, %%zmm23\n\t"
      "vpxord %%zmm24, %%zmm24, %%zmm24\n\tvpxord %%zmm25, %%zmm25, %%zmm25\n\t"
      "vpxord %%zmm26, %%zmm26, %%zmm26\n\tvpxord %%zmm27, %%zmm27, %%zmm27\n\t"
      "vpxord %%zmm28, %%zmm28, %%zmm28\n\tvpxord %%zmm29, %%zmm29, %%zmm29\n\t"
      "vpxord %%zmm30, %%zmm30, %%zmm30\n\tvpxord %%zmm31, %%zmm31, %%zmm31" ::
          : "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27",
            "xmm28", "xmm29", "xmm30", "xmm31");
}

// FIPS-197 section 5.2's key expansion for Nk = 8, four words at a time: w[i] = w[i - 8] ^ f(w[i - 1]),
// where f is SubWord(RotWord(.)) ^ Rcon at i = 0 mod 8 (`assisted`: AESKEYGENASSIST's word 3) and SubWord
// at i = 4 mod 8 (its word 2). prev ^ (prev << 32) ^ (prev << 64) ^ (prev << 96) folds the w[i - 8] chain.
DPSTREAM_VAES_TARGET inline __m128i fold(__m128i prev, __m128i assisted_word) {
  __m128i t = _mm_slli_si128(prev, 4);
  prev = _mm_xor_si128(prev, t);
  t = _mm_slli_si128(t, 4);
  prev = _mm_xor_si128(prev, t);
  t = _mm_slli_si128(t, 4);
  prev = _mm_xor_si128(prev, t);
  return _mm_xor_si128(prev, assisted_word);
}

// Round key r, four times in a row at bytes 64 r ..: one 512-bit load gives it to the four blocks of a register.
DPSTREAM_VAES_TARGET inline void store_round_key(std::uint8_t* round_keys, std::size_t r, __m128i k) {
  for (std::size_t copy = 0; copy < 4; ++copy)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(round_keys + 64 * r + 16 * copy), k);
}

template <int Rcon>
DPSTREAM_VAES_TARGET inline void expand_pair(__m128i& even, __m128i& odd, std::uint8_t* round_keys, std::size_t r,
                                             bool last) {
  even = fold(even, _mm_shuffle_epi32(_mm_aeskeygenassist_si128(odd, Rcon), 0xff));  // RotWord, SubWord, Rcon
  store_round_key(round_keys, r, even);
  if (last) return;
  odd = fold(odd, _mm_shuffle_epi32(_mm_aeskeygenassist_si128(even, 0), 0xaa));  // SubWord only
  store_round_key(round_keys, r + 1, odd);
}

// Straight into the cipher's own memory (which its destructor wipes): no copy of the schedule on the stack.
DPSTREAM_VAES_TARGET void expand_key(const std::uint8_t* key, std::uint8_t* round_keys) {
  __m128i even = _mm_loadu_si128(reinterpret_cast<const __m128i*>(key));
  __m128i odd = _mm_loadu_si128(reinterpret_cast<const __m128i*>(key + 16));
  store_round_key(round_keys, 0, even);
  store_round_key(round_keys, 1, odd);
  expand_pair<0x01>(even, odd, round_keys, 2, false);
  expand_pair<0x02>(even, odd, round_keys, 4, false);
  expand_pair<0x04>(even, odd, round_keys, 6, false);
  expand_pair<0x08>(even, odd, round_keys, 8, false);
  expand_pair<0x10>(even, odd, round_keys, 10, false);
  expand_pair<0x20>(even, odd, round_keys, 12, false);
  expand_pair<0x40>(even, odd, round_keys, 14, true);
  clear_vector_registers();
}

// One pass of R registers of four blocks, the last register's valid blocks in `last` (two 64-bit lanes a
// block; masked lanes are neither read nor written): the rounds of the R registers' blocks are independent,
// so they overlap in the pipeline instead of waiting out each aesenc's latency. `k`: the round keys in the
// cipher's memory, read from there (a local copy would leave the schedule on the stack). The plaintexts come
// from `source.next(mask)`, register by register (Buffer or Counter below).
template <std::size_t R, class Source>
DPSTREAM_VAES_TARGET inline void pass(const __m512i* k, Source& source, std::uint8_t* out, __mmask8 last) {
  __m512i b[R];
#pragma GCC unroll 8
  for (std::size_t j = 0; j < R; ++j)
    b[j] = _mm512_xor_si512(source.next(j + 1 < R ? 0xff : last), _mm512_load_si512(k));
#pragma GCC unroll 13
  for (std::size_t r = 1; r < 14; ++r) {
    const __m512i key = _mm512_load_si512(k + r);
#pragma GCC unroll 8
    for (std::size_t j = 0; j < R; ++j) b[j] = _mm512_aesenc_epi128(b[j], key);
  }
  const __m512i key = _mm512_load_si512(k + 14);
#pragma GCC unroll 8
  for (std::size_t j = 0; j < R; ++j)
    _mm512_mask_storeu_epi64(out + 64 * j, j + 1 < R ? 0xff : last, _mm512_aesenclast_epi128(b[j], key));
}

// Plaintexts read from memory, four blocks a register (masked lanes not read).
struct Buffer {
  const std::uint8_t* in;
  DPSTREAM_VAES_TARGET __m512i next(__mmask8 mask) {
    const __m512i v = _mm512_maskz_loadu_epi64(mask, in);
    in += 64;
    return v;
  }
};

// A counter run's plaintexts (Aes256Blocks::encrypt_run), made in registers: `words` holds the next four blocks'
// words in native order (high, low, high, low + step, ..), `step4` four steps on each low word; each word's bytes
// are swapped to big-endian.
struct Counter {
  __m512i words, step4;
  DPSTREAM_VAES_TARGET __m512i next(__mmask8 /*mask*/) {  // masked lanes are not stored
    const __m512i swap =
        _mm512_set_epi64(0x08090a0b0c0d0e0f, 0x0001020304050607, 0x08090a0b0c0d0e0f, 0x0001020304050607,
                         0x08090a0b0c0d0e0f, 0x0001020304050607, 0x08090a0b0c0d0e0f, 0x0001020304050607);
    const __m512i v = _mm512_shuffle_epi8(words, swap);
    words = _mm512_add_epi64(words, step4);
    return v;
  }
};

// Thirty-two blocks a pass, then the rest in one pass of as many registers as it needs (short runs, such
// as a ring's seven samples, are common: one block at a time would wait out 14 latencies each).
template <class Source>
DPSTREAM_VAES_TARGET void encrypt_passes(const std::uint8_t* round_keys, Source source, std::uint8_t* out,
                                         std::size_t n) {
  const auto* k = reinterpret_cast<const __m512i*>(round_keys);  // 64-byte aligned (alignas in the header)
  for (; n >= 32; n -= 32, out += 512) pass<8>(k, source, out, 0xff);
  if (n > 0) {
    const std::size_t registers = (n + 3) / 4, in_last = n - 4 * (registers - 1);  // 1 .. 4 blocks
    const auto last = static_cast<__mmask8>((1u << (2 * in_last)) - 1);
    switch (registers) {
      case 1:
        pass<1>(k, source, out, last);
        break;
      case 2:
        pass<2>(k, source, out, last);
        break;
      case 3:
        pass<3>(k, source, out, last);
        break;
      case 4:
        pass<4>(k, source, out, last);
        break;
      case 5:
        pass<5>(k, source, out, last);
        break;
      case 6:
        pass<6>(k, source, out, last);
        break;
      case 7:
        pass<7>(k, source, out, last);
        break;
      default:
        pass<8>(k, source, out, last);
        break;
    }
  }
  clear_vector_registers();
}

DPSTREAM_VAES_TARGET void encrypt_vaes512(const std::uint8_t* round_keys, const std::uint8_t* in, std::uint8_t* out,
                                          std::size_t n) {
  encrypt_passes(round_keys, Buffer{in}, out, n);
}

DPSTREAM_VAES_TARGET void encrypt_run_vaes512(const std::uint8_t* round_keys, std::uint64_t high, std::uint64_t low,
                                              std::uint64_t step, std::uint8_t* out, std::size_t n) {
  // Lane values as the intrinsics take them (long long); the sums wrap modulo 2^64 as the caller's words would.
  const auto lane = [](std::uint64_t v) { return static_cast<long long>(v); };
  const long long h = lane(high), four = lane(step * 4);
  const auto word = [&](std::uint64_t i) { return lane(low + i * step); };
  encrypt_passes(round_keys,
                 Counter{_mm512_set_epi64(word(3), h, word(2), h, word(1), h, word(0), h),
                         _mm512_set_epi64(four, 0, four, 0, four, 0, four, 0)},
                 out, n);
}

#endif
}  // namespace

Aes256Blocks::Engine Aes256Blocks::best_engine() {
#if DPSTREAM_HAVE_VAES_CODE
  return cpu_runs_vaes512() ? Engine::Vaes512 : Engine::OpenSsl;
#else
  return Engine::OpenSsl;
#endif
}

void Aes256Blocks::CtxFree::operator()(evp_cipher_ctx_st* ctx) const { EVP_CIPHER_CTX_free(ctx); }

Aes256Blocks::Aes256Blocks(const std::uint8_t* key, Engine engine) : engine_(engine) {
  if (engine_ == Engine::Vaes512) {
#if DPSTREAM_HAVE_VAES_CODE
    if (best_engine() != Engine::Vaes512) throw std::invalid_argument("AES-256: this CPU has no VAES with AVX-512");
    expand_key(key, round_keys_);
    return;
#else
    throw std::invalid_argument("AES-256: this build has no VAES code");
#endif
  }
  ctx_.reset(EVP_CIPHER_CTX_new());
  if (!ctx_ || EVP_EncryptInit_ex(ctx_.get(), EVP_aes_256_ecb(), nullptr, key, nullptr) != 1 ||
      EVP_CIPHER_CTX_set_padding(ctx_.get(), 0) != 1)
    throw std::runtime_error("AES-256: OpenSSL's EVP initialization failed");
}

// A moved-from cipher has no engine left: OpenSsl without a context, whose encrypt() throws.
Aes256Blocks::Aes256Blocks(Aes256Blocks&& other) noexcept : engine_(Engine::OpenSsl) { *this = std::move(other); }

Aes256Blocks& Aes256Blocks::operator=(Aes256Blocks&& other) noexcept {
  if (this == &other) return *this;
  engine_ = other.engine_;
  ctx_ = std::move(other.ctx_);
  std::memcpy(round_keys_, other.round_keys_, sizeof round_keys_);
  OPENSSL_cleanse(other.round_keys_, sizeof other.round_keys_);
  other.engine_ = Engine::OpenSsl;
  return *this;
}

Aes256Blocks::~Aes256Blocks() { OPENSSL_cleanse(round_keys_, sizeof round_keys_); }

void Aes256Blocks::encrypt_run(std::uint64_t high, std::uint64_t low, std::uint64_t step, std::uint8_t* out,
                               std::size_t n) {
#if DPSTREAM_HAVE_VAES_CODE
  if (engine_ == Engine::Vaes512) {
    encrypt_run_vaes512(round_keys_, high, low, step, out, n);
    return;
  }
#endif
  constexpr std::size_t kChunk = 64;
  std::uint8_t in[kChunk * kBlockBytes];
  const std::uint64_t high_be = __builtin_bswap64(high);
  for (std::size_t at = 0; at < n; at += kChunk) {
    const std::size_t c = n - at < kChunk ? n - at : kChunk;
    for (std::size_t i = 0; i < c; ++i) {
      const std::uint64_t low_be = __builtin_bswap64(low + (at + i) * step);
      std::memcpy(in + kBlockBytes * i, &high_be, 8);
      std::memcpy(in + kBlockBytes * i + 8, &low_be, 8);
    }
    encrypt(in, out + kBlockBytes * at, c);
  }
}

void Aes256Blocks::encrypt(const std::uint8_t* in, std::uint8_t* out, std::size_t n) {
#if DPSTREAM_HAVE_VAES_CODE
  if (engine_ == Engine::Vaes512) {
    encrypt_vaes512(round_keys_, in, out, n);
    return;
  }
#endif
  if (!ctx_) throw std::logic_error("AES-256: a moved-from cipher");
  constexpr std::size_t kMaxPerCall = std::size_t{1} << 20;  // EVP takes an int length
  while (n > 0) {
    const std::size_t c = n < kMaxPerCall ? n : kMaxPerCall;
    int outl = 0;
    if (EVP_EncryptUpdate(ctx_.get(), out, &outl, in, static_cast<int>(kBlockBytes * c)) != 1 ||
        outl != static_cast<int>(kBlockBytes * c))
      throw std::runtime_error("AES-256: EVP_EncryptUpdate failed");
    in += kBlockBytes * c, out += kBlockBytes * c, n -= c;
  }
}

}  // namespace dpstream::noise
