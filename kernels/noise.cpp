#include "kernels/noise.hpp"

#include "kernels/cdf_table.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <boost/multiprecision/cpp_bin_float.hpp>
#include <boost/multiprecision/cpp_int.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <type_traits>

namespace dpstream::noise {

constexpr std::size_t kAesBlock = 16;  // bytes per AES block (one PRF output)

static_assert(std::endian::native == std::endian::little, "PRF words are read as little-endian");

namespace {
constexpr u128 kTwo127 = u128{1} << 127;
constexpr std::uint64_t kCutV = 1u << 11;  // proposals with |Y| > 2^11 t are rejected

void put_be64(std::uint8_t* p, std::uint64_t v) {
  v = __builtin_bswap64(v);
  std::memcpy(p, &v, 8);
}

int bit_length(std::uint64_t x) { return 64 - std::countl_zero(x); }
int bit_length(u128 x) {
  const auto hi = static_cast<std::uint64_t>(x >> 64);
  return hi ? 128 - std::countl_zero(hi) : bit_length(static_cast<std::uint64_t>(x));
}
}  // namespace

Secret secret_from_os() {
  Secret s{};
  if (RAND_priv_bytes(s.data(), static_cast<int>(s.size())) != 1) throw std::runtime_error("RAND_priv_bytes failed");
  return s;
}

Secret secret_from_seed(std::uint64_t seed) {
  std::uint8_t msg[18 + 8];
  std::copy_n("dpstream test seed", 18, msg);  // a byte string, no terminator
  for (int i = 0; i < 8; ++i) msg[18 + i] = static_cast<std::uint8_t>(seed >> (8 * i));
  Secret s{};
  unsigned len = 0;
  if (EVP_Digest(msg, sizeof msg, s.data(), &len, EVP_sha256(), nullptr) != 1 || len != s.size())
    throw std::runtime_error("SHA-256 failed");
  return s;
}

u128 pack(const NodeId& id) {
  const auto fam = static_cast<std::uint32_t>(id.family);
  if (fam >= 16 || id.round >= (1u << 20) || id.level >= 32 || id.index >= (1u << kIndexBits))
    throw std::invalid_argument("NodeId field out of range");
  const std::uint64_t lo = std::uint64_t{fam} << 60 | std::uint64_t{id.round} << 40 | std::uint64_t{id.level} << 35 |
                           std::uint64_t{id.index} << kIndexShift;
  return u128{id.key} << 64 | lo;
}

// ---------------------------------------------------------------------------------------------
namespace {
// The cipher keyed with K_w = HMAC-SHA256(secret, "dpstream window" || window LE8); K_w is wiped here.
Aes256Blocks window_cipher(const Secret& secret, std::int64_t window) {
  std::uint8_t msg[15 + 8];
  std::copy_n("dpstream window", 15, msg);  // a byte string, no terminator
  for (int i = 0; i < 8; ++i) msg[15 + i] = static_cast<std::uint8_t>(static_cast<std::uint64_t>(window) >> (8 * i));
  std::uint8_t key[Aes256Blocks::kKeyBytes];
  struct Wipe {
    std::uint8_t* key;
    ~Wipe() { OPENSSL_cleanse(key, Aes256Blocks::kKeyBytes); }  // after the cipher is built, or on a throw
  } wipe{key};
  unsigned len = 0;
  if (!HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), msg, sizeof msg, key, &len) ||
      len != sizeof key)
    throw std::runtime_error("window key derivation failed");
  return Aes256Blocks(key);
}
}  // namespace

WindowPrf::WindowPrf(const Secret& secret, std::int64_t window) : cipher_(window_cipher(secret, window)) {}

WindowPrf::WindowPrf(WindowPrf&&) noexcept = default;
WindowPrf& WindowPrf::operator=(WindowPrf&&) noexcept = default;
WindowPrf::~WindowPrf() = default;

void WindowPrf::blocks(const NodeId& id, std::uint32_t first, std::uint32_t count, std::uint8_t* out) {
  blocks_packed(pack(id), first, count, out);
}

void WindowPrf::blocks_packed(u128 packed, std::uint32_t first, std::uint32_t count, std::uint8_t* out) {
  if (first > kBlocksPerNode || count > kBlocksPerNode - first) throw std::out_of_range("node PRF stream exhausted");
  const auto hi = static_cast<std::uint64_t>(packed >> 64);
  const auto lo = static_cast<std::uint64_t>(packed);
  constexpr std::uint32_t kChunk = 64;  // counter blocks per EVP call
  std::uint8_t in[kChunk * 16];
  while (count > 0) {
    const std::uint32_t c = std::min(count, kChunk);
    for (std::uint32_t i = 0; i < c; ++i) {  // plaintext = big-endian (pack(n) | counter)
      put_be64(in + kAesBlock * i, hi);
      put_be64(in + kAesBlock * i + 8, lo | (first + i));
    }
    cipher_.encrypt(in, out, c);
    out += kAesBlock * c;
    first += c;
    count -= c;
  }
}

void WindowPrf::first_blocks(const u128* packed, std::size_t n, std::uint32_t per_node, std::uint8_t* out) {
  constexpr std::size_t kMaxBlocks = 64;
  if (per_node == 0 || per_node > kBlocksPerNode || n * per_node > kMaxBlocks)
    throw std::invalid_argument("first_blocks: at most 64 blocks per call");
  std::uint8_t in[kMaxBlocks * 16];
  // plaintext = big-endian (pack(n) | counter); each word swapped once. `per` a compile-time constant for the
  // batches' one or two blocks a node: the inner loop unrolls (it was half of this function's instructions).
  const auto fill = [&](auto per) {
    std::uint8_t* block = in;
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint64_t hi = __builtin_bswap64(static_cast<std::uint64_t>(packed[i] >> 64));
      const std::uint64_t lo = __builtin_bswap64(static_cast<std::uint64_t>(packed[i]));  // counter bits zero
      for (std::uint32_t c = 0; c < per; ++c, block += kAesBlock) {
        const std::uint64_t lo_c = lo | __builtin_bswap64(std::uint64_t{c});  // c < 2^15: pack()'s zero low bits
        std::memcpy(block, &hi, 8);
        std::memcpy(block + 8, &lo_c, 8);
      }
    }
  };
  if (per_node == 1)
    fill(std::integral_constant<std::uint32_t, 1>{});
  else if (per_node == 2)
    fill(std::integral_constant<std::uint32_t, 2>{});
  else
    fill(per_node);
  const std::size_t b = n * per_node;
  cipher_.encrypt(in, out, b);
}

void WindowPrf::first_blocks_of_run(u128 first_packed, std::size_t n, std::uint8_t* out) {
  constexpr std::size_t kMaxBlocks = 64;
  if (n > kMaxBlocks) throw std::invalid_argument("first_blocks_of_run: at most 64 nodes per call");
  // A carry out of the index field would give a node another node's stream.
  const auto low = static_cast<std::uint64_t>(first_packed);
  constexpr std::uint64_t kIndexMask = (std::uint64_t{1} << kIndexBits) - 1;
  if ((low & (kBlocksPerNode - 1)) != 0 || (low >> kIndexShift & kIndexMask) + n > kIndexMask + 1)
    throw std::invalid_argument("first_blocks_of_run: node index out of range (or a block counter set)");
  // plaintext = big-endian (pack(node) | 0): the key word is the same for all, the low word steps by 2^15.
  cipher_.encrypt_run(static_cast<std::uint64_t>(first_packed >> 64), low, std::uint64_t{1} << kIndexShift, out, n);
}

// ---------------------------------------------------------------------------------------------
NodeStream::NodeStream(WindowPrf& prf, u128 packed, std::uint32_t first_blocks, const std::uint8_t* fetched)
    : prf_(prf), packed_(packed), first_blocks_(first_blocks) {
  if (first_blocks == 0 || first_blocks > kMoreBlocks) throw std::invalid_argument("NodeStream: 1..8 fetched blocks");
  std::memcpy(buf_.data(), fetched, kAesBlock * first_blocks);
  next_block_ = first_blocks;
  end_ = 2 * first_blocks;
}

NodeStream::NodeStream(WindowPrf& prf, const NodeId& id, std::uint32_t first_blocks)
    : prf_(prf), packed_(pack(id)), first_blocks_(std::clamp(first_blocks, 1u, kMoreBlocks)) {}

void NodeStream::refill() {
  const std::uint32_t want = next_block_ == 0 ? first_blocks_ : kMoreBlocks;
  const std::uint32_t n = std::min(want, WindowPrf::kBlocksPerNode - next_block_);
  if (n == 0) throw std::out_of_range("node PRF stream exhausted");
  prf_.blocks_packed(packed_, next_block_, n, reinterpret_cast<std::uint8_t*>(buf_.data()));
  next_block_ += n;
  pos_ = 0;
  end_ = 2 * n;
}

std::uint64_t NodeStream::bits(unsigned count) {
  if (count == 64) return next_u64();
  if (pool_bits_ < count) {  // leftover bits are dropped: still independent and uniform
    pool_ = next_u64();
    pool_bits_ = 64;
  }
  const std::uint64_t v = pool_ & ((std::uint64_t{1} << count) - 1);
  pool_ >>= count;
  pool_bits_ -= count;
  return v;
}

std::uint64_t NodeStream::uniform_below(std::uint64_t n) {
  if (n == 0) throw std::invalid_argument("uniform_below(0)");
  if (n == 1) return 0;
  const auto len = static_cast<unsigned>(64 - std::countl_zero(n - 1));  // n <= 2^len < 2n: accept rate > 1/2
  for (;;) {
    const std::uint64_t x = bits(len);
    if (x < n) return x;
  }
}

u128 NodeStream::uniform_below_u128(u128 n) {
  if (n == 0) throw std::invalid_argument("uniform_below_u128(0)");
  if ((n >> 64) == 0) return uniform_below(static_cast<std::uint64_t>(n));
  const auto hi_len = static_cast<unsigned>(bit_length(n - 1) - 64);  // in [1, 64]
  for (;;) {
    const u128 hi = bits(hi_len);
    const u128 x = hi << 64 | next_u64();
    if (x < n) return x;
  }
}

namespace {
// U < r/d for U = 0.b1b2... uniform, 0 < r < d <= 2^(bits of T - 1): compare U's bits with the long
// division of r by d, stopping at the first difference (2 bits expected) or when the expansion ends.
template <class T>
bool below(NodeStream& rng, T r, T d) {
  for (;;) {
    r <<= 1;
    const bool p = r >= d;
    r -= p ? d : T{0};
    if (rng.next_bit() != p) return p;  // first difference: U < p iff p's bit is 1
    if (r == 0) return false;           // p's expansion ended with U's prefix equal to it: U > p a.s.
  }
}

// Bernoulli(num / (den k)) for num <= den; when den k would pass 2^(bits-1), the AND of Bernoulli(1/k)
// and Bernoulli(num/den).
template <class T>
bool bernoulli_over(NodeStream& rng, T num, T den, std::uint64_t k) {
  if (num == 0) return false;
  if (bit_length(den) + bit_length(k) < 8 * static_cast<int>(sizeof(T))) {  // den k < 2^(bits-1)
    const T d = den * k;
    return num >= d || below<T>(rng, num, d);
  }
  return below<std::uint64_t>(rng, 1, k) && (num >= den || below<T>(rng, num, den));
}

// CKS20 Algorithm 1: Bernoulli(exp(-gamma)) for gamma = num/den in [0, 1]. P[K > j] = gamma^j / j!,
// so P[K odd] = sum_j (-gamma)^j / j! = exp(-gamma).
template <class T>
bool bernoulli_exp_unit(NodeStream& rng, T num, T den) {
  std::uint64_t k = 1;
  while (bernoulli_over<T>(rng, num, den, k)) ++k;
  return k & 1;
}

// Algorithm 1 with gamma = 1: the first draw Bernoulli(1/1) always succeeds.
bool bernoulli_exp1(NodeStream& rng) {
  std::uint64_t k = 2;
  while (below<std::uint64_t>(rng, 1, k)) ++k;
  return k & 1;
}
}  // namespace

bool NodeStream::bernoulli(u128 num, u128 den) {
  if (den == 0 || num > den) throw std::invalid_argument("bernoulli needs 0 <= num <= den, den > 0");
  if (num == 0) return false;
  if (num == den) return true;
  if (den <= (u128{1} << 63))
    return below<std::uint64_t>(*this, static_cast<std::uint64_t>(num), static_cast<std::uint64_t>(den));
  if (den <= kTwo127) return below<u128>(*this, num, den);
  return uniform_below_u128(den) < num;
}

// ---------------------------------------------------------------------------------------------
// boost::multiprecision's internals trip GCC's -Wnull-dereference analysis (false positives).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnull-dereference"
CdfTable CdfTable::from_masses(const std::vector<BigFloat>& mass) {
  namespace mp = boost::multiprecision;
  BigFloat z = 0;
  for (const auto& m : mass) z += m;
  const mp::cpp_int one = mp::cpp_int(1) << 192, word = (mp::cpp_int(1) << 64) - 1;
  const BigFloat scale = mp::ldexp(BigFloat(1), 192) / z;
  CdfTable table;
  BigFloat cum = 0;
  for (std::size_t m = 0; m < mass.size(); ++m) {
    cum += mass[m];
    const auto c = mp::round(cum * scale).convert_to<mp::cpp_int>();
    if (m + 1 == mass.size() || c >= one) {  // the last entry: all ones, it takes every U above the previous one
      table.hi.push_back(~std::uint64_t{0});
      table.lo.push_back({~std::uint64_t{0}, ~std::uint64_t{0}});
      break;
    }
    table.hi.push_back(static_cast<std::uint64_t>((c >> 128) & word));
    table.lo.push_back({static_cast<std::uint64_t>((c >> 64) & word), static_cast<std::uint64_t>(c & word)});
  }
  std::size_t m = 0;
  for (std::uint32_t h = 0; h < table.guide.size(); ++h) {
    while (table.hi[m] < (std::uint64_t{h} << (64 - kGuideBits))) ++m;  // ends: the last hi is all ones
    table.guide[h] = static_cast<std::uint32_t>(m);
  }
  const std::size_t last = table.hi.size() - 1;
  for (std::uint32_t h = 0; h < table.guide.size(); ++h) {
    const std::uint64_t start = std::uint64_t{h} << (64 - kGuideBits), end = start | (~std::uint64_t{0} >> kGuideBits);
    const std::uint64_t first = table.guide[h];
    const bool first_in = first < last && table.hi[first] <= end;  // the search's first step may go past it
    const bool second_in = first_in && first + 1 < last && table.hi[first + 1] <= end;
    const std::uint64_t field = first_in ? (table.hi[first] - start) >> 1 : kBucketField;
    table.bucket[h] = first >= 4095 ? (std::uint64_t{4095} << 52 | kSecondInBucket)  // d < 0 and no m + 1: never
                                    : (first << 52 | (second_in ? kSecondInBucket : 0) | field);
  }
  return table;
}

// The inverse-CDF table. With s2 = sigma^2 = n 2^-k exactly and w_m = exp(-m^2 / (2 s2)):
// P[|Y| = 0] = 1/Z, P[|Y| = m] = 2 w_m / Z, Z = 1 + 2 sum_m w_m. w_m = w_(m-1) r_m with r_1 = a,
// r_m = r_(m-1) b, a = exp(-1/(2 s2)), b = exp(-1/s2): two exponentials, then products, in 320-bit
// binary floating point (relative error of w_m < m^2 2^-318 < 2^-280 for m < 2^17). Entry m is
// C_m = round(2^192 sum_(j<=m) P[|Y| = j]); entries stop at m = ceil(17 sigma) + 2 (the mass beyond
// is < 2^-200) or where C_m would reach 2^192, and the last entry is all ones (it takes the rest).
// Each P_table(m) = (C_m - C_(m-1)) 2^-192 is within 2^-192 of P[|Y| = m] (rounding, plus the
// arithmetic's 2^-280), so over < 2^17 entries the total variation to N_Z is < 2^-174 + 2^-200.
std::shared_ptr<const CdfTable> DiscreteGaussian::build_table(std::uint64_t n, int k, double sigma) {
  namespace mp = boost::multiprecision;
  const BigFloat s2 = mp::ldexp(BigFloat(n), -k);
  const auto ymax = static_cast<std::size_t>(std::ceil(17.0 * sigma)) + 2;
  const BigFloat a = mp::exp(-1 / (2 * s2)), b = mp::exp(-1 / s2);
  std::vector<BigFloat> mass(ymax + 1);
  mass[0] = 1;
  BigFloat w = 1, r = a;
  for (std::size_t m = 1; m <= ymax; ++m) {
    w *= r;
    r *= b;
    mass[m] = 2 * w;
  }
  return std::make_shared<const CdfTable>(CdfTable::from_masses(mass));
}
#pragma GCC diagnostic pop

namespace {
// sigma^2 = m2 2^(2ex-106) rounded up to n 2^-k with n in [2^51, 2^52).
void round_sigma2(double sigma, std::uint64_t& n, int& k) {
  if (!(sigma >= std::ldexp(1.0, -10) && sigma <= std::ldexp(1.0, 24)))
    throw std::invalid_argument("DiscreteGaussian: sigma must be in [2^-10, 2^24]");
  int ex = 0;
  const double f = std::frexp(sigma, &ex);                       // sigma = f 2^ex, f in [1/2, 1)
  const auto m = static_cast<std::uint64_t>(std::ldexp(f, 53));  // sigma = m 2^(ex-53), m in [2^52, 2^53)
  const u128 m2 = u128{m} * m;                                   // sigma^2 = m2 2^(2ex-106), m2 in [2^104, 2^106)
  int s = bit_length(m2) - 52;
  u128 q = m2 >> s;
  if ((q << s) != m2) ++q;  // round up: n 2^-k >= sigma^2
  if (q == (u128{1} << 52)) {
    q >>= 1;
    ++s;
  }
  n = static_cast<std::uint64_t>(q);  // in [2^51, 2^52)
  k = -(2 * (ex - 53) + s);           // in [3, 71] for sigma in [2^-10, 2^24]
}
}  // namespace

double DiscreteGaussian::rounded_sigma(double sigma) {
  std::uint64_t n = 0;
  int k = 0;
  round_sigma2(sigma, n, k);
  return std::sqrt(std::ldexp(static_cast<double>(n), -k));  // correctly rounded, so >= requested sigma
}

DiscreteGaussian::DiscreteGaussian(double sigma) {
  round_sigma2(sigma, n_, k_);
  sigma_ = std::sqrt(std::ldexp(static_cast<double>(n_), -k_));  // correctly rounded, so >= requested sigma
  // t - 1 = floor(sqrt(n 2^-k)) = isqrt(floor(n 2^-k)), exact integer square root.
  const std::uint64_t fl = k_ >= 64 ? 0 : n_ >> k_;
  auto r = static_cast<std::uint64_t>(std::sqrt(static_cast<double>(fl)));
  while (r * r > fl) --r;
  while ((r + 1) * (r + 1) <= fl) ++r;
  t_ = r + 1;  // <= 2^24 + 1; t > sigma
  cut_ = kCutV * t_;
  // Bounds: sigma >= 1 gives t <= 2 sigma, so 2^k t^2 <= 4n < 2^54; sigma < 1 gives t = 1, 2^k <= 2^71.
  cd_ = (u128{t_} * t_) << (k_ + 1);  // 2^(k+1) t^2 < 2^73
  d_ = cd_ * n_;                      // D = n 2^(k+1) t^2 < 2^55 2^52 or 2^72 2^52 = 2^124
  e_ = (u128{n_} * t_) << (k_ + 1);   // D / t
  n2_ = u128{n_} * n_;                // n^2 <= D since sigma^2 <= 2 t^2
  if (sigma_ <= kTableMaxSigma) table_ = build_table(n_, k_, sigma_);
}

// gamma = (y - sigma^2/t)^2 / (2 sigma^2) = y^2 2^(k-1)/n - y/t + n/(2^(k+1) t^2) with y = v t + u.
// Integer parts q1 - v; fractional parts over the common denominator D = n 2^(k+1) t^2:
//   (y^2 2^(k-1) mod n) 2^(k+1) t^2 + n^2 - u n 2^(k+1) t, each term < D (so the sum fits in 2^126).
DiscreteGaussian::Gamma DiscreteGaussian::gamma(std::uint64_t y, std::uint64_t v, std::uint64_t u) const {
  const u128 a = (u128{y} * y) << (k_ - 1);  // y <= 2^11 t: a <= 2^21 2^k t^2 < max(2^75, 2^92)
  std::uint64_t q1, r1;                      // q1 < 2^41
  if ((a >> 64) == 0) {                      // the usual case: one 64-bit division
    q1 = static_cast<std::uint64_t>(a) / n_, r1 = static_cast<std::uint64_t>(a) % n_;
  } else {
    q1 = static_cast<std::uint64_t>(a / n_), r1 = static_cast<std::uint64_t>(a % n_);
  }
  const u128 fpos = cd_ * r1 + n2_;  // < 2D
  const u128 fneg = e_ * u;          // < D
  auto g = static_cast<std::int64_t>(q1) - static_cast<std::int64_t>(v);
  u128 f;
  if (fpos >= fneg) {
    f = fpos - fneg;
    if (f >= d_) f -= d_, ++g;
  } else {
    f = d_ - (fneg - fpos), --g;
  }
  if (g < 0) throw std::logic_error("DiscreteGaussian: negative gamma");  // impossible: gamma is a square
  return {static_cast<std::uint64_t>(g), f, d_};
}

DiscreteGaussian::Gamma DiscreteGaussian::gamma(std::uint64_t y) const {
  if (y > cut_) throw std::invalid_argument("DiscreteGaussian::gamma: y > 2^11 t");
  return gamma(y, y / t_, y % t_);
}

// CKS20 Algorithm 3 with the Algorithm 2 proposal Y ~ DLap(t) (s = 1), P[Y = y] ~ exp(-|y|/t).
// The cut |Y| <= 2^11 t makes the output N_Z conditioned on |Y| <= M = 2^11 t, at total variation
// distance P[|Y| > M] <= 2 sum_{j>=1} exp(-(M+j)^2/(2 sigma^2)) / Z with Z >= 1; (M+j)^2 >= M^2 + 2jM
// gives <= 2 exp(-M^2/(2 sigma^2)) / (exp(M/sigma^2) - 1) <= 2 exp(-M^2/(2 sigma^2)) sigma^2/M, and
// M = 2^11 t > 2^11 sigma, sigma <= 2^24 give < 2 exp(-2^21) 2^13 < exp(-2^20).
std::int64_t DiscreteGaussian::sample_exact(NodeStream& rng) const {
  for (;;) {
    const std::uint64_t u = rng.uniform_below(t_);
    if (!bernoulli_exp_unit<std::uint64_t>(rng, u, t_)) continue;  // Bernoulli(exp(-u/t))
    std::uint64_t v = 0;                                           // geometric: P[V >= j] = exp(-j)
    while (v <= kCutV && bernoulli_exp1(rng)) ++v;
    const std::uint64_t y = u + t_ * v;
    if (y > cut_) continue;  // the documented cut
    const bool neg = rng.next_bit();
    if (neg && y == 0) continue;  // so that 0 is not counted twice
    // Bernoulli(exp(-gamma)) as in CKS20 Algorithm 1 for gamma > 1: floor(gamma) Bernoulli(exp(-1)), then the rest.
    const Gamma gm = gamma(y, v, u);
    bool accept = true;
    for (std::uint64_t i = 0; accept && i < gm.whole; ++i) accept = bernoulli_exp1(rng);
    if (accept && bernoulli_exp_unit<u128>(rng, gm.num, gm.den))
      return neg ? -static_cast<std::int64_t>(y) : static_cast<std::int64_t>(y);
  }
}

double DiscreteGaussian::variance() const {
  const double s2 = std::ldexp(static_cast<double>(n_), -k_);
  const auto ymax = static_cast<std::uint64_t>(12.0 * sigma_) + 2;  // exp(-72) relative tail: negligible
  long double z = 1, m = 0;
  for (std::uint64_t y = 1; y <= ymax; ++y) {
    const double yd = static_cast<double>(y);
    const long double w = std::exp(-yd * yd / (2 * s2));
    z += 2 * w;
    m += 2 * w * yd * yd;
  }
  return static_cast<double>(m / z);
}

std::int64_t DiscreteGaussian::sample(NodeStream& rng) const { return table_ ? sample_table(rng) : sample_exact(rng); }

// Inverse CDF: U uniform on [0, 2^192) (three stream words, the lower two read only on a tie of the
// top word), |Y| = the first m with U < C_m (the guide table skips the entries below U's top 12
// bits), then a sign bit for m > 0.
std::int64_t DiscreteGaussian::sample_table(NodeStream& rng) const {
  const std::size_t m = table_->sample(rng);
  if (m == 0) return 0;
  const auto y = static_cast<std::int64_t>(m);
  return rng.next_bit() ? -y : y;
}

std::size_t DiscreteGaussian::table_size() const { return table_ ? table_->hi.size() : 0; }

std::array<std::uint64_t, 3> DiscreteGaussian::table_entry(std::size_t m) const {
  if (!table_ || m >= table_->hi.size()) throw std::out_of_range("DiscreteGaussian::table_entry");
  return {table_->hi[m], table_->lo[m][0], table_->lo[m][1]};
}

// ---------------------------------------------------------------------------------------------
namespace {
constexpr std::uint64_t kMaxLaplace = std::uint64_t{1} << 62;  // |Y| beyond needs V > 2^21: probability < exp(-2^21)

// b = m 2^(ex-53), m in [2^52, 2^53), rounded up to n 2^-k with n = ceil(m / 2) in [2^51, 2^52).
void round_scale(double b, std::uint64_t& n, int& k) {
  if (!(b >= std::ldexp(1.0, -10) && b <= std::ldexp(1.0, 40)))
    throw std::invalid_argument("DiscreteLaplace: scale must be in [2^-10, 2^40]");
  int ex = 0;
  const double f = std::frexp(b, &ex);                           // b = f 2^ex, f in [1/2, 1)
  const auto m = static_cast<std::uint64_t>(std::ldexp(f, 53));  // exact
  n = (m >> 1) + (m & 1);                                        // round up: n 2^-k >= b
  k = 52 - ex;                                                   // in [11, 61] for b in [2^-10, 2^40]
  if (n == (std::uint64_t{1} << 52)) n >>= 1, --k;
}
}  // namespace

double DiscreteLaplace::rounded_scale(double scale) {
  std::uint64_t n = 0;
  int k = 0;
  round_scale(scale, n, k);
  return std::ldexp(static_cast<double>(n), -k);  // exact: n has 52 bits
}

DiscreteLaplace::DiscreteLaplace(double scale) {
  round_scale(scale, n_, k_);
  scale_ = std::ldexp(static_cast<double>(n_), -k_);
}

// CKS20 Algorithm 2 with t = n, s = 2^k: X = U + n V has P[X = x] ~ exp(-x/n) on x >= 0, so Y = floor(X / 2^k)
// has P[Y = y] ~ exp(-y 2^k / n) = exp(-y / b); a sign bit, rejecting -0, makes it two-sided.
std::int64_t DiscreteLaplace::sample(NodeStream& rng) const {
  for (;;) {
    const std::uint64_t u = rng.uniform_below(n_);
    if (!bernoulli_exp_unit<std::uint64_t>(rng, u, n_)) continue;  // Bernoulli(exp(-u/n))
    std::uint64_t v = 0;                                           // geometric: P[V >= j] = exp(-j)
    while (bernoulli_exp1(rng)) ++v;
    const u128 y = (u + u128{n_} * v) >> k_;  // X < 2^52 (v + 1) < 2^117
    if (y > kMaxLaplace) continue;            // keeps Y in int64; unreachable in practice (see kMaxLaplace)
    const bool neg = rng.next_bit();
    if (neg && y == 0) continue;  // so that 0 is not counted twice
    return neg ? -static_cast<std::int64_t>(y) : static_cast<std::int64_t>(y);
  }
}

// Sum over x >= m of q^x (1 - q) / (1 + q) = q^m / (1 + q), q = exp(-1/b); symmetry for m <= 0.
long double DiscreteLaplace::upper_tail(std::int64_t m) const {
  if (m <= 0) return m < -(std::int64_t{1} << 62) ? 1.0L : 1 - upper_tail(1 - m);
  const long double b = std::ldexp(static_cast<long double>(n_), -k_);
  return std::exp(-static_cast<long double>(m) / b) / (1 + std::exp(-1 / b));
}

void node_noises(WindowPrf& prf, const NodeId* ids, std::size_t n, const DiscreteGaussian& dg, std::int64_t* out) {
  const std::uint32_t per_node = dg.tabulated() ? 1 : NodeStream::kFirstBlocks;  // as node_noise
  constexpr std::size_t kChunk = 32;
  std::array<u128, kChunk> packed;
  std::array<std::uint8_t, kChunk * 16 * NodeStream::kFirstBlocks> fetched;
  for (std::size_t at = 0; at < n; at += kChunk) {
    const std::size_t c = std::min(kChunk, n - at);
    for (std::size_t i = 0; i < c; ++i) packed[i] = pack(ids[at + i]);
    prf.first_blocks(packed.data(), c, per_node, fetched.data());
    for (std::size_t i = 0; i < c; ++i) {
      NodeStream rng(prf, packed[i], per_node, fetched.data() + kAesBlock * per_node * i);
      out[at + i] = dg.sample(rng);
    }
  }
}

std::int64_t node_noise(WindowPrf& prf, const NodeId& id, const DiscreteGaussian& dg) {
  // The table reads one word and a sign bit (one block) but on a tie; CKS20 most often fits in two.
  NodeStream rng(prf, id, dg.tabulated() ? 1 : NodeStream::kFirstBlocks);
  return dg.sample(rng);
}

}  // namespace dpstream::noise
