#!/usr/bin/env python3
"""Reference entries of the discrete Gaussian inverse-CDF table (kernels/noise.hpp, DiscreteGaussian).

For each sigma (a double), independently of the engine's code:
  * sigma^2 rounded up to n / 2^k with n in [2^51, 2^52) (exact rationals: fractions);
  * ymax = ceil(17 sigma') + 2 with sigma' = the double sqrt(n / 2^k);
  * w_m = exp(-m^2 / (2 n / 2^k)) for m = 0..ymax, each by Python's decimal exp (correctly rounded)
    at 130 significant digits, directly (the engine uses a product recurrence in binary floating
    point); Z = w_0 + 2 sum_{m>=1} w_m over m <= ymax;
  * C_m = round(2^192 (w_0 + 2 sum_{1<=j<=m} w_j) / Z); the table ends at the first m = ymax or with
    C_m >= 2^192, whose entry is 2^192 - 1 (all ones).
Prints, per sigma, n, k, the table size and entries at chosen m as hexadecimal 192-bit integers.
Refuses to print an entry whose rounding is within 10^-30 of a tie (none is).

  python3 tests/reference/discrete_gaussian_table.py > tests/reference/discrete_gaussian_table.txt
"""
import math
from decimal import Decimal, getcontext, ROUND_HALF_EVEN
from fractions import Fraction

getcontext().prec = 130
SIGMAS = [0.5, 1.0, 3.7, 27.36566871162691, 154.80359934156738, 1000.0]
TWO192 = 1 << 192


def rounded_sigma2(sigma):
    s2 = Fraction(sigma) ** 2
    k = 0
    # n / 2^k >= s2 with n in [2^51, 2^52): scale, then round the numerator up
    while s2 * 2 ** k < 2 ** 51:
        k += 1
    while s2 * 2 ** k >= 2 ** 52:
        k -= 1
    n = math.ceil(s2 * 2 ** k)
    if n == 2 ** 52:
        n //= 2
        k -= 1
    return n, k


def table(sigma):
    n, k = rounded_sigma2(sigma)
    sig = math.sqrt(n / 2 ** k)
    ymax = math.ceil(17.0 * sig) + 2
    two_s2 = Decimal(2 * n) / Decimal(2) ** k
    w = [(-Decimal(m * m) / two_s2).exp() for m in range(ymax + 1)]
    z = w[0] + 2 * sum(w[1:])
    entries = []
    cum = Decimal(0)
    for m in range(ymax + 1):
        cum += w[m] if m == 0 else 2 * w[m]
        x = cum / z * TWO192
        c = int(x.to_integral_value(rounding=ROUND_HALF_EVEN))
        if m == ymax or c >= TWO192:
            entries.append(TWO192 - 1)
            break
        frac = x - int(x)
        assert abs(frac - Decimal("0.5")) > Decimal("1e-30"), f"near tie at sigma {sigma} m {m}"
        entries.append(c)
    return n, k, entries


def main():
    print("# sigma n k size, then m C_m (hex) lines; tests/reference/discrete_gaussian_table.py")
    for sigma in SIGMAS:
        n, k, entries = table(sigma)
        picks = sorted({0, 1, 2, len(entries) // 7, len(entries) // 3, len(entries) // 2, len(entries) - 2,
                        len(entries) - 1} & set(range(len(entries))))
        print(f"sigma {sigma!r} {n} {k} {len(entries)}")
        for m in picks:
            print(f"{m} {entries[m]:048x}")


if __name__ == "__main__":
    main()
