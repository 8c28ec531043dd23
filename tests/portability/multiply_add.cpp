// a * b + c as the project compiles it, in a file built for a CPU with FMA (tests/CMakeLists.txt adds -mfma on
// x86-64; aarch64 has FMA in its base ISA): fused into one operation when the build contracts, two otherwise.
#include "tests/portability/multiply_add.hpp"

namespace dpstream::test {

double multiply_add(double a, double b, double c) { return a * b + c; }

}  // namespace dpstream::test
