// The probe of tests/portability/test_fp_contract.cpp: a * b + c, compiled where FMA is available.
#pragma once

namespace dpstream::test {

double multiply_add(double a, double b, double c);

}  // namespace dpstream::test
