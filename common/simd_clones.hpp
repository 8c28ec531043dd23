// A function compiled twice, for baseline x86-64 and for x86-64-v3 (AVX2, FMA), the version chosen once at
// load time from the CPU (GCC's target_clones: an ifunc; the build's baseline ISA stays generic x86-64). Only
// for loops whose vectorized form does the same IEEE operations per element (no reassociation; serial sums
// stay scalar; no contraction: the project builds every file with -ffp-contract=off): both versions' doubles
// are bit-identical and the choice is invisible in any output.
// GCC only: clang 14 emits the clones without the plain symbol, so calls from other files do not link. Not
// under ThreadSanitizer: the ifunc resolver is instrumented and runs before TSan starts (a crash before main).
#pragma once

#if defined(__x86_64__) && defined(__ELF__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define DPSTREAM_AVX2_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define DPSTREAM_AVX2_CLONES
#endif
