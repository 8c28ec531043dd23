// What this CPU and its OS run, read once from CPUID and XGETBV (Intel SDM vol. 2A, "CPUID"): the kernels'
// hand-vectorized paths are taken only where these say so, and each has a portable twin with the same output.
#pragma once

namespace dpstream::noise {

// AVX-512F with the OS saving the opmask and ZMM state; false on non-x86-64 builds.
bool cpu_runs_avx512f();
// cpu_runs_avx512f() and AES-NI and VAES (four AES blocks per instruction).
bool cpu_runs_vaes512();

}  // namespace dpstream::noise
