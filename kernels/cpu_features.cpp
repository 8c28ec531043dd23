#include "kernels/cpu_features.hpp"

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#define DPSTREAM_HAVE_CPUID 1
#else
#define DPSTREAM_HAVE_CPUID 0
#endif

namespace dpstream::noise {

namespace {
struct Features {
  bool avx512f = false;
  bool vaes512 = false;
};

// CPUID (clang 14's __builtin_cpu_supports knows no "vaes"): AES-NI (leaf 1 ECX bit 25), AVX-512F (leaf 7 EBX
// bit 16), AVX-512BW (leaf 7 EBX bit 30), VAES (leaf 7 ECX bit 9), and the OS saving the vector state: OSXSAVE (leaf 1
// ECX bit 27), then XCR0's SSE, AVX, opmask and both ZMM halves (bits 1, 2, 5-7).
Features read_features() {
  Features f;
#if DPSTREAM_HAVE_CPUID
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0) return f;
  const bool aes = (c >> 25 & 1) != 0, osxsave = (c >> 27 & 1) != 0;
  if (!osxsave) return f;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return f;
  const bool avx512f = (b >> 16 & 1) != 0, avx512bw = (b >> 30 & 1) != 0, vaes = (c >> 9 & 1) != 0;
  std::uint32_t xcr0_lo = 0, xcr0_hi = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  constexpr std::uint32_t kZmmState = 0xe6;  // bits 1, 2, 5, 6, 7
  f.avx512f = avx512f && (xcr0_lo & kZmmState) == kZmmState;
  f.vaes512 = f.avx512f && avx512bw && aes && vaes;
#endif
  return f;
}

const Features& features() {
  static const Features f = read_features();
  return f;
}
}  // namespace

bool cpu_runs_avx512f() { return features().avx512f; }
bool cpu_runs_vaes512() { return features().vaes512; }

}  // namespace dpstream::noise
