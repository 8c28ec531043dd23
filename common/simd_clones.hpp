// A function compiled twice, for baseline x86-64 and for x86-64-v3 (AVX2, FMA), the version chosen once at
// load time from the CPU (target_clones: an ifunc; the build's baseline ISA stays generic x86-64). Only for
// loops of independent double operations in a file built with -ffp-contract=off: without contraction or
// reassociation each element goes through the same IEEE operations in both versions (four lanes instead of
// two), so their results are bit-identical and the choice is invisible in any output.
#pragma once

#if defined(__x86_64__) && defined(__ELF__) && (defined(__GNUC__) || defined(__clang__))
#define DPSTREAM_AVX2_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define DPSTREAM_AVX2_CLONES
#endif
