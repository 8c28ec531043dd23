// The project's doubles do not depend on the instruction set it is compiled for: no a * b + c is fused into
// one FMA (cmake/FloatingPoint.cmake, -ffp-contract=off). A fused one rounds once where IEEE arithmetic rounds twice,
// and a -march=native build drew another synthetic stream (docs/PERFORMANCE.md round 26).
#include <gtest/gtest.h>

#include <cmath>

#include "tests/portability/multiply_add.hpp"

namespace dpstream::test {
namespace {

TEST(FloatingPoint, NoMultiplyAddIsFused) {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("fma")) GTEST_SKIP() << "this CPU has no FMA: the probe, built with -mfma, cannot run";
#endif
  // a^2 = 1 + 2^-29 + 2^-60: rounded on its own it is 1 + 2^-29 and a^2 + c is 0; fused, the sum keeps 2^-60.
  volatile double a = 1.0 + std::ldexp(1.0, -30);
  volatile double c = -(1.0 + std::ldexp(1.0, -29));
  const double r = multiply_add(a, a, c);
  EXPECT_EQ(r, 0.0) << "a * a + c = " << r << " (2^-60 = " << std::ldexp(1.0, -60)
                    << "): the build fuses multiply-adds, so its results depend on -march; keep -ffp-contract=off "
                       "(cmake/FloatingPoint.cmake)";
}

}  // namespace
}  // namespace dpstream::test
