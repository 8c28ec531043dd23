// What this CPU and its OS run, read once from CPUID and XGETBV (Intel SDM vol. 2A, "CPUID"): the kernels'
// hand-vectorized paths are taken only where these say so, and each has a portable twin with the same output.
#pragma once

// A kernel's AVX-512F twin is compiled where GCC-style target attributes exist (x86-64), and taken at run time
// only where cpu_runs_avx512f().
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DPSTREAM_HAVE_AVX512_CODE 1
#define DPSTREAM_AVX512_TARGET __attribute__((target("avx512f")))
#else
#define DPSTREAM_HAVE_AVX512_CODE 0
#endif

namespace dpstream::noise {

// AVX-512F with the OS saving the opmask and ZMM state; false on non-x86-64 builds.
bool cpu_runs_avx512f();
// cpu_runs_avx512f() and AVX-512BW (byte shuffles) and AES-NI and VAES (four AES blocks per instruction).
bool cpu_runs_vaes512();

}  // namespace dpstream::noise
