# No floating-point contraction in any file of the main build or the fuzz build (tests/fuzz, a project of its
# own, includes this file too). With FMA available (-march=native, x86-64-v3, every aarch64 build) GCC and
# clang fused a * b + c into one operation with one rounding instead of two by default, so the synthetic
# stream, the privacy plan and the banded counters' band depended on how the code was compiled (a
# -march=native build drew another records-per-user count for one user in 10^6: docs/PERFORMANCE.md round
# 26). Off, every build computes the same doubles (tests/portability/test_fp_contract.cpp).
add_compile_options(-ffp-contract=off)
