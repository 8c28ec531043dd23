// Optimal composition of k (eps0, delta0)-DP mechanisms (Kairouz, Oh & Viswanath 2015, Thm 3.3; Murtagh &
// Vadhan 2016, Thm 1.5) against 120-digit decimal values from tests/reference/optimal_composition.py, the
// single-mechanism curve, advanced composition (Dwork, Rothblum & Vadhan 2010) and round trips.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <stdexcept>
#include <string>

#include "src/accounting.hpp"
#include "src/ledger.hpp"
#include "tools/ledger_report.hpp"

using namespace dpstream::accounting;

namespace {
double rel(double got, double want) { return std::abs(got - want) / std::abs(want); }

struct DiscreteRow {
  std::uint32_t k;
  double eps0, delta0;
  int i;
  double delta;
};
// delta(eps) at the KOV discrete points eps = (k - 2i) eps0:
//   1 - (1 - delta0)^k (1 - delta_i), delta_i = sum_{l<i} C(k,l) (e^{(k-l) eps0} - e^{(k-2i+l) eps0}) / (1 +
//   e^{eps0})^k.
// Rows below 1e-290 or equal to 1 in double are left out by the script.
const DiscreteRow kDiscrete[] = {
    {10, 0.01, 0.0, 1, 2.03261333258471886894e-5},       {10, 0.01, 0.0, 2, 2.41488631445483163623e-4},
    {10, 0.01, 0.0, 3, 1.35483602006288191563e-3},       {10, 0.01, 0.0, 4, 4.81318628936078325446e-3},
    {10, 0.01, 0.0, 5, 1.23041748251946200274e-2},       {10, 0.01, 1e-09, 0, 9.99999995500000074282e-9},
    {10, 0.01, 1e-09, 1, 2.03361331225408563463e-5},     {10, 0.01, 1e-09, 2, 2.41498629030551860036e-4},
    {10, 0.01, 1e-09, 3, 1.35484600651447677597e-3},     {10, 0.01, 1e-09, 4, 4.81319624122887557744e-3},
    {10, 0.01, 1e-09, 5, 1.23041847021528273291e-2},     {10, 0.1, 0.0, 1, 2.88233857618648001262e-4},
    {10, 0.1, 0.0, 2, 3.13226757611135398707e-3},        {10, 0.1, 0.0, 3, 1.60801319932129965345e-2},
    {10, 0.1, 0.0, 4, 5.23044140031311589769e-2},        {10, 0.1, 0.0, 5, 1.22536223561492671870e-1},
    {10, 0.1, 1e-09, 0, 9.99999995500000074282e-9},      {10, 0.1, 1e-09, 1, 2.88243854736264438047e-4},
    {10, 0.1, 1e-09, 2, 3.13227754478863336691e-3},      {10, 0.1, 1e-09, 3, 1.60801418324116323259e-2},
    {10, 0.1, 1e-09, 4, 5.23044234800869762993e-2},      {10, 0.1, 1e-09, 5, 1.22536232336130396769e-1},
    {10, 1.0, 0.0, 1, 3.77024449799655126872e-2},        {10, 1.0, 0.0, 2, 1.81504459950309588713e-1},
    {10, 1.0, 0.0, 3, 4.30577144529756477147e-1},        {10, 1.0, 0.0, 4, 6.89536771546200018724e-1},
    {10, 1.0, 0.0, 5, 8.69597463185155580130e-1},        {10, 1.0, 1e-09, 0, 9.99999995500000074282e-9},
    {10, 1.0, 1e-09, 1, 3.77024546029410195841e-2},      {10, 1.0, 1e-09, 2, 1.81504468135264952378e-1},
    {10, 1.0, 1e-09, 3, 4.30577150223985006225e-1},      {10, 1.0, 1e-09, 4, 6.89536774650832289291e-1},
    {10, 1.0, 1e-09, 5, 8.69597464489180942410e-1},      {100, 0.01, 0.0, 1, 2.57216661912159527509e-32},
    {100, 0.01, 0.0, 2, 2.59750714290358011915e-30},     {100, 0.01, 0.0, 5, 1.05275313792610550934e-25},
    {100, 0.01, 0.0, 10, 5.47174428948486890254e-20},    {100, 0.01, 0.0, 20, 4.69240961667256445645e-12},
    {100, 0.01, 0.0, 30, 6.33432842764741895957e-7},     {100, 0.01, 0.0, 40, 9.02616130976171805997e-4},
    {100, 0.01, 0.0, 45, 8.66691570019080607669e-3},     {100, 0.01, 0.0, 48, 2.33965001429023410667e-2},
    {100, 0.01, 0.0, 50, 3.97780438599416423206e-2},     {100, 0.1, 0.0, 1, 1.87297839514033837848e-29},
    {100, 0.1, 0.0, 2, 1.72880536916684279505e-27},      {100, 0.1, 0.0, 5, 5.35055202786700418484e-23},
    {100, 0.1, 0.0, 10, 1.77446982346291789176e-17},     {100, 0.1, 0.0, 20, 6.20163909818372145484e-10},
    {100, 0.1, 0.0, 30, 3.42231231919677381004e-5},      {100, 0.1, 0.0, 40, 2.01401784281915338593e-2},
    {100, 0.1, 0.0, 45, 1.25688390240636434504e-1},      {100, 0.1, 0.0, 48, 2.64115252015512813681e-1},
    {100, 0.1, 0.0, 50, 3.81972612615856056482e-1},      {100, 1.0, 0.0, 1, 2.14815448021813236845e-14},
    {100, 1.0, 0.0, 2, 8.14650625484921203287e-13},      {100, 1.0, 0.0, 5, 1.75668267155876450583e-9},
    {100, 1.0, 0.0, 10, 7.01509479924577976062e-6},      {100, 1.0, 0.0, 20, 4.13863604303148409172e-2},
    {100, 1.0, 0.0, 30, 7.12904303811227277533e-1},      {100, 1.0, 0.0, 40, 9.96538551220181705752e-1},
    {100, 1.0, 0.0, 45, 9.99905682529266475016e-1},      {100, 1.0, 0.0, 48, 9.99993059529099985234e-1},
    {100, 1.0, 0.0, 50, 9.99998988172889190428e-1},      {1000, 0.01, 0.0, 10, 6.70067048514370952701e-280},
    {1000, 0.01, 0.0, 100, 8.99492746225313633023e-163}, {1000, 0.01, 0.0, 200, 1.07998346482113060836e-86},
    {1000, 0.01, 0.0, 300, 9.52880757660738455238e-39},  {1000, 0.01, 0.0, 400, 1.39348272084599471016e-11},
    {1000, 0.01, 0.0, 450, 1.08311705451387769228e-4},   {1000, 0.01, 0.0, 480, 1.87502399309407306018e-2},
    {1000, 0.01, 0.0, 495, 8.61176964415218583193e-2},   {1000, 0.01, 0.0, 500, 1.25601535835457779560e-1},
    {1000, 0.01, 1e-09, 0, 9.99999500500166229240e-7},   {1000, 0.01, 1e-09, 450, 1.09311596640236585749e-4},
    {1000, 0.01, 1e-09, 480, 1.87512211802106655690e-2}, {1000, 0.01, 1e-09, 495, 8.61186103233689327387e-2},
    {1000, 0.01, 1e-09, 500, 1.25602410233485182214e-1}, {1000, 0.1, 0.0, 1, 2.51426183823061319166e-281},
    {1000, 0.1, 0.0, 2, 2.27957095529741389290e-278},    {1000, 0.1, 0.0, 10, 2.76724399583307354516e-260},
    {1000, 0.1, 0.0, 100, 1.12900099343143294168e-146},  {1000, 0.1, 0.0, 200, 1.67779778846615868479e-74},
    {1000, 0.1, 0.0, 300, 1.84189094070955389196e-30},   {1000, 0.1, 0.0, 400, 3.45798518884972689659e-7},
    {1000, 0.1, 0.0, 450, 3.33138256921140271841e-2},    {1000, 0.1, 0.0, 480, 5.02534940729782419635e-1},
    {1000, 0.1, 0.0, 495, 8.18253270705836485709e-1},    {1000, 0.1, 0.0, 500, 8.85988036239587246841e-1},
    {1000, 0.1, 1e-09, 0, 9.99999500500166229240e-7},    {1000, 0.1, 1e-09, 400, 1.34579767358679276023e-6},
    {1000, 0.1, 1e-09, 450, 3.33147923778054754867e-2},  {1000, 0.1, 1e-09, 480, 5.02535438194593206138e-1},
    {1000, 0.1, 1e-09, 495, 8.18253452452474997411e-1},  {1000, 0.1, 1e-09, 500, 8.85988150251494058297e-1},
    {1000, 1.0, 0.0, 1, 7.74507195311704688614e-137},    {1000, 1.0, 0.0, 2, 2.85804599540489062009e-134},
    {1000, 1.0, 0.0, 10, 2.61332940512492845418e-119},   {1000, 1.0, 0.0, 100, 8.22486430836026564107e-41},
    {1000, 1.0, 0.0, 200, 1.58577701786491340324e-7},    {1000, 1.0, 0.0, 300, 9.84149476117433307755e-1},
    {1000, 1.0, 1e-09, 0, 9.99999500500166229240e-7},    {1000, 1.0, 1e-09, 200, 1.15857704370903499261e-6},
    {1000, 1.0, 1e-09, 300, 9.84149491967949272987e-1},
};

struct GeneralRow {
  std::uint32_t k;
  double eps0, delta0, eps, delta;
};
// delta(eps) at any eps: 1 - (1 - delta0)^k (1 - D), D = sum_{l=0}^{k} C(k,l) max(0, e^{(k-l) eps0} - e^{eps + l eps0})
// / (1 + e^{eps0})^k, summed literally over every l.
const GeneralRow kGeneral[] = {
    // Generated by tests/reference/optimal_composition.py (MV Thm 1.5, summed over all l).
    // {k, eps0, delta0, eps, delta}
    {1, 0.5, 0.0, 0.2, 1.61330117014164553264e-1},
    {1, 3.0, 1e-06, 1.0, 8.23657413907812635237e-1},
    {2, 1.0, 0.0, 0.5, 4.15195479812190797450e-1},
    {10, 1.0, 0.0, 2.5, 6.63242962930831033748e-1},
    {10, 1.0, 1e-06, 3.3, 5.81349691828987343889e-1},
    {10, 10.0, 0.0, 65.0, 9.99999907140143804800e-1},
    {100, 0.1, 0.0, 1.0, 1.25688390240636446671e-1},
    {100, 0.1, 0.0, 2.5, 6.14479754960168359586e-3},
    {100, 0.1, 1e-08, 4.2, 1.53830817091303967542e-5},
    {100, 0.01, 0.0, 0.05, 2.03501482102617810421e-2},
    {100, 10.0, 0.0, 900.0, 9.99999999999985534264e-1},
    {1000, 0.01, 0.0, 0.5, 9.75376045682500288665e-3},
    {1000, 0.01, 0.0, 1.0, 1.08311705451387797475e-4},
    {1000, 0.1, 0.0, 6.0, 2.73296584414583403483e-1},
    {1000, 0.1, 1e-09, 20.0, 1.34579767358679356940e-6},
    {1000, 1.0, 0.0, 500.0, 8.03758690208145579176e-2},
    {1000, 1.0, 0.0, 700.0, 7.23654498461597791951e-20},
    {1000, 3.0, 0.0, 2800.0, 1.47058165553947158996e-2},
    {100000, 0.001, 0.0, 0.5, 9.77465760275251279955e-3},
    {100000, 0.001, 1e-12, 1.0, 1.09895447422562818477e-4},
    {100000, 0.01, 0.0, 5.0, 3.83828442350753226399e-1},
    {100000, 0.01, 0.0, 9.0, 6.42654346793162565165e-2},
    {100000, 10.0, 0.0, 999900.0, 5.24566468174663735834e-1},
};

struct RootRow {
  double eps, delta, delta0;
  std::uint32_t k;
  double eps0;
};
// The largest eps0 whose k-fold composition is (eps, delta)-DP, by a 1e-30 relative decimal bisection.
const RootRow kRoots[] = {
    // Generated by tests/reference/optimal_composition.py (largest eps0, bisection on MV Thm 1.5).
    // {eps, delta, delta0, k, eps0}
    {6.0, 5e-10, 5e-13, 100, 9.88656784888686355527e-2}, {6.0, 5e-10, 5e-13, 1000, 2.11683239202856624632e-2},
    {1.0, 1e-06, 0.0, 100, 2.40110803971598189836e-2},   {3.0, 1e-09, 1e-12, 1000, 1.10512619719575938547e-2},
    {0.0, 0.01, 0.0, 10, 8.12720779370744014448e-3},
};

// Dwork, Rothblum & Vadhan 2010 (Dwork & Roth 2014, Thm 3.20): k-fold (eps0, delta0) is (eps', k delta0 + d')-DP.
double advanced_eps(double eps0, std::uint32_t k, double d_prime) {
  return std::sqrt(2 * k * std::log(1 / d_prime)) * eps0 + k * eps0 * std::expm1(eps0);
}
}  // namespace

TEST(OptimalComposition, SingleMechanismIsRandomizedResponse) {
  // k = 1: D = max(0, e^{eps0} - e^eps) / (1 + e^{eps0}), the privacy curve of randomized response with eps0, so
  // delta(eps) = delta0 + (1 - delta0) max(0, e^{eps0} - e^eps) / (1 + e^{eps0}); delta(0) = delta0 + (1 - delta0)
  // tanh(eps0 / 2).
  for (double eps0 : {1e-6, 1e-3, 0.1, 0.5, 1.0, 3.0, 10.0, 30.0}) {
    for (double delta0 : {0.0, 1e-12, 1e-6, 0.1}) {
      for (double eps : {0.0, 1e-4, 0.05, 0.5, 0.99, 2.0, 9.0, 29.0}) {
        // e^{eps0} - e^eps = e^eps expm1(eps0 - eps), without the cancellation at eps0 ~ eps ~ 0.
        const double d = eps < eps0 ? std::exp(eps) * std::expm1(eps0 - eps) / (1 + std::exp(eps0)) : 0.0;
        const double want = delta0 + (1 - delta0) * d, got = optimal_composition_delta(eps0, delta0, 1, eps);
        SCOPED_TRACE("eps0=" + std::to_string(eps0) + " delta0=" + std::to_string(delta0) +
                     " eps=" + std::to_string(eps));
        if (want == 0) {
          EXPECT_EQ(got, 0.0);
        } else {
          EXPECT_LE(rel(got, want), 1e-12) << got << " vs " << want;
        }
      }
      EXPECT_LE(rel(optimal_composition_delta(eps0, delta0, 1, 0), delta0 + (1 - delta0) * std::tanh(eps0 / 2)), 1e-12);
    }
  }
}

TEST(OptimalComposition, KovDiscretePoints) {
  for (const auto& r : kDiscrete) {
    // eps is rounded to a double here, so the tolerance covers eps's own rounding: d ln delta / d eps ~ 1 / (2 eps0).
    const double eps = (r.k - 2.0 * r.i) * r.eps0, got = optimal_composition_delta(r.eps0, r.delta0, r.k, eps);
    EXPECT_LE(rel(got, r.delta), 1e-11) << "k=" << r.k << " eps0=" << r.eps0 << " delta0=" << r.delta0 << " i=" << r.i
                                        << ": " << got << " vs " << r.delta;
  }
}

TEST(OptimalComposition, GeneralEps) {
  for (const auto& r : kGeneral) {
    const double got = optimal_composition_delta(r.eps0, r.delta0, r.k, r.eps);
    EXPECT_LE(rel(got, r.delta), 1e-12) << "k=" << r.k << " eps0=" << r.eps0 << " delta0=" << r.delta0
                                        << " eps=" << r.eps << ": " << got << " vs " << r.delta;
  }
}

TEST(OptimalComposition, LargestEps0) {
  for (const auto& r : kRoots) {
    SCOPED_TRACE("eps=" + std::to_string(r.eps) + " delta=" + std::to_string(r.delta) + " k=" + std::to_string(r.k));
    const double eps0 = optimal_composition_eps0(r.eps, r.delta, r.delta0, r.k);
    EXPECT_LE(eps0, r.eps0 * (1 + 1e-15));  // never optimistic
    // delta = 5e-10 = 1000 * 5e-13 leaves a slack of only ~1.25e-19 = 2.5e-10 delta for D: eps0 is then
    // ill-conditioned and the rounding margins cost ~1e-7 of it. Elsewhere the margins cost ~1e-12.
    const bool thin_slack = r.delta - r.k * r.delta0 < 1e-6 * r.delta;
    EXPECT_LE(rel(eps0, r.eps0), thin_slack ? 2e-7 : 1e-10) << eps0 << " vs " << r.eps0;
    EXPECT_LE(optimal_composition_delta(eps0, r.delta0, r.k, r.eps), r.delta);
  }
}

TEST(OptimalComposition, PureCompositionAndBounds) {
  for (std::uint32_t k : {1u, 2u, 10u, 100u, 1000u, 100000u}) {
    for (double eps0 : {1e-3, 0.1, 1.0, 5.0}) {
      // eps >= k eps0: only the delta0 parts remain.
      EXPECT_EQ(optimal_composition_delta(eps0, 0, k, k * eps0), 0.0) << "k=" << k << " eps0=" << eps0;
      EXPECT_EQ(optimal_composition_delta(eps0, 0, k, 2 * k * eps0), 0.0);
      const double floor = -std::expm1(k * std::log1p(-1e-9));
      EXPECT_DOUBLE_EQ(optimal_composition_delta(eps0, 1e-9, k, 1.5 * k * eps0), floor);
      // eps0 = 0 composes to eps = 0.
      EXPECT_EQ(optimal_composition_delta(0, 0, k, 0), 0.0);
      // Never below the delta0 parts, never above 1.
      for (double eps : {0.0, 0.5, 3.0}) {
        const double d = optimal_composition_delta(eps0, 1e-9, k, eps);
        EXPECT_GE(d, floor * (1 - 1e-15));
        EXPECT_LE(d, 1.0);
      }
    }
  }
}

TEST(OptimalComposition, AtLeastAsGoodAsAdvancedComposition) {
  for (std::uint32_t k : {2u, 10u, 100u, 1000u, 10000u, 100000u}) {
    for (double eps0 : {1e-4, 1e-3, 0.01, 0.1, 0.5, 1.0}) {
      for (double d_prime : {1e-3, 1e-6, 1e-9, 1e-12}) {
        for (double delta0 : {0.0, 1e-12}) {
          const double eps = advanced_eps(eps0, k, d_prime), bound = k * delta0 + d_prime;
          SCOPED_TRACE("k=" + std::to_string(k) + " eps0=" + std::to_string(eps0) + " d'=" + std::to_string(d_prime));
          EXPECT_LE(optimal_composition_delta(eps0, delta0, k, eps), bound);
          // ... so the largest eps0 for (eps, k delta0 + d') is at least eps0.
          EXPECT_GE(optimal_composition_eps0(eps, bound, delta0, k), eps0 * (1 - 1e-12));
        }
      }
    }
  }
}

TEST(OptimalComposition, Monotone) {
  for (std::uint32_t k : {1u, 7u, 100u, 1000u}) {
    for (double eps0 : {0.01, 0.3, 2.0}) {
      double prev = 2;
      for (double eps = 0; eps <= k * eps0 * 1.01; eps += k * eps0 / 97) {  // falls with eps
        const double d = optimal_composition_delta(eps0, 1e-10, k, eps);
        EXPECT_LE(d, prev * (1 + 1e-13)) << "k=" << k << " eps0=" << eps0 << " eps=" << eps;  // up to rounding
        prev = d;
      }
    }
    for (double eps : {0.0, 0.5, 2.0}) {
      double prev = -1;
      for (double eps0 = 0; eps0 <= 3; eps0 += 0.01) {  // rises with eps0
        const double d = optimal_composition_delta(eps0, 1e-10, k, eps);
        EXPECT_GE(d, prev * (1 - 1e-13)) << "k=" << k << " eps0=" << eps0 << " eps=" << eps;
        prev = d;
      }
    }
  }
  for (double eps0 : {0.01, 0.1, 1.0}) {
    double prev = -1;
    for (std::uint32_t k = 1; k <= 2000; k += 37) {  // rises with k
      const double d = optimal_composition_delta(eps0, 1e-10, k, 2.0);
      EXPECT_GE(d, prev * (1 - 1e-13)) << "k=" << k << " eps0=" << eps0;
      prev = d;
    }
  }
}

TEST(OptimalComposition, RoundTrip) {
  for (std::uint32_t k : {1u, 3u, 10u, 100u, 1000u, 100000u}) {
    for (double eps0 : {1e-3, 0.01, 0.1, 1.0, 4.0}) {
      for (double delta0 : {0.0, 1e-10}) {
        for (double frac : {0.0, 0.1, 0.3, 0.6}) {  // eps as a fraction of k eps0
          const double eps = frac * k * eps0, delta = optimal_composition_delta(eps0, delta0, k, eps);
          const double floor = -std::expm1(k * std::log1p(-delta0));
          // eps0 is not identifiable when delta is the delta0 floor, and badly conditioned when D is a sliver of
          // delta (see LargestEps0) or as delta -> 1.
          if (!(delta - floor > 1e-3 * delta) || delta < 1e-300 || delta > 0.99) continue;
          SCOPED_TRACE("k=" + std::to_string(k) + " eps0=" + std::to_string(eps0) + " delta0=" +
                       std::to_string(delta0) + " eps=" + std::to_string(eps) + " delta=" + std::to_string(delta));
          const double back = optimal_composition_eps0(eps, delta, delta0, k);
          EXPECT_LE(rel(back, eps0), 1e-9) << back;
          EXPECT_LE(optimal_composition_delta(back, delta0, k, eps), delta);
          EXPECT_GT(optimal_composition_delta(back * (1 + 1e-9), delta0, k, eps), delta) << "not the largest eps0";
        }
      }
    }
  }
}

TEST(OptimalComposition, Performance) {
  // Called inside bisections: one evaluation at k = 1000 must stay well under a millisecond (~50 us here).
  const auto t0 = std::chrono::steady_clock::now();
  double sink = 0;
  constexpr int kCalls = 200;
  for (int i = 0; i < kCalls; ++i) sink += optimal_composition_delta(0.01 + 1e-3 * i, 1e-9, 1000, 3.0);
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / kCalls;
  EXPECT_GT(sink, 0.0);
  EXPECT_LT(us, 500.0) << us << " us per call";
  RecordProperty("us_per_call_k1000", std::to_string(us));
}

TEST(OptimalComposition, InvalidArgumentsThrow) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  for (double bad : {-0.1, nan, inf}) {
    EXPECT_THROW(optimal_composition_delta(bad, 0, 10, 1), std::invalid_argument);
    EXPECT_THROW(optimal_composition_delta(0.1, 0, 10, bad), std::invalid_argument);
    EXPECT_THROW(optimal_composition_eps0(bad, 1e-6, 0, 10), std::invalid_argument);
  }
  for (double bad : {-1e-9, 1.0, 1.5, nan}) {
    EXPECT_THROW(optimal_composition_delta(0.1, bad, 10, 1), std::invalid_argument);
    EXPECT_THROW(optimal_composition_eps0(1, 1e-6, bad, 10), std::invalid_argument);
  }
  for (double bad : {0.0, 1.0, -0.1, nan}) EXPECT_THROW(optimal_composition_eps0(1, bad, 0, 10), std::invalid_argument);
  EXPECT_THROW(optimal_composition_delta(0.1, 0, 0, 1), std::invalid_argument);
  EXPECT_THROW(optimal_composition_eps0(1, 1e-6, 0, 0), std::invalid_argument);
  // The delta0 parts alone exceed delta: 1 - (1 - 1e-9)^1000 ~ 1e-6 > 5e-7.
  try {
    optimal_composition_eps0(1, 5e-7, 1e-9, 1000);
    ADD_FAILURE() << "no throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("1 - (1 - delta0)^k"), std::string::npos) << e.what();
  }
  EXPECT_THROW(optimal_composition_eps0(1, 1e-6, 1e-6, 1), std::invalid_argument);  // delta0 = delta, k = 1
  EXPECT_NO_THROW(optimal_composition_eps0(1, 1e-6, 0, 100000));
}

// `ledger explain` prints job names from the ledger: bytes that would move the terminal's cursor, color it or start
// a line that looks like another charge are shown as '?'.
TEST(LedgerReport, JobNamesArePrintedWithoutControlBytes) {
  const auto path = std::filesystem::temp_directory_path() / fmt::format("ledger-report-{}.db", ::getpid());
  std::filesystem::remove(path);
  dpstream::ledger::init(path.string(), {10, 1e-6, 86400});
  dpstream::ledger::Request r{.run_id = "r1",
                              .job = "a\n  #9 job 'admin'\x1b[31m",
                              .mechanism = "test",
                              .zcdp = false,
                              .epsilon = 1,
                              .delta = 1e-9,
                              .blocks = {0}};
  ASSERT_EQ(dpstream::ledger::charge_or_refuse(path.string(), 86400, r), dpstream::ledger::Outcome::Admitted);
  const dpstream::ledger::Ledger book(path.string());
  const std::string text = dpstream::ledger_text(path.string(), book, true);
  EXPECT_NE(text.find("job 'a?  #9 job 'admin'?[31m'"), std::string::npos) << text;
  EXPECT_EQ(text.find('\x1b'), std::string::npos);
  std::filesystem::remove(path);
}

// Blocks charged by the same jobs are accounted once (Ledger's SpendCache): every block's spend must still be what
// account() gives for that block's own charges, and an admission must still be refused at the first block that
// cannot take it.
TEST(Ledger, BlocksChargedAlikeKeepTheirOwnSpend) {
  namespace ledger = dpstream::ledger;
  const auto path = std::filesystem::temp_directory_path() / fmt::format("ledger-alike-{}.db", ::getpid());
  std::filesystem::remove(path);
  const ledger::Ceiling ceiling{10, 1e-6, 86400};
  ledger::init(path.string(), ceiling);
  const auto blocks = [](std::int64_t from, std::int64_t to) {
    std::vector<std::int64_t> b;
    for (std::int64_t i = from; i < to; ++i) b.push_back(i);
    return b;
  };
  // Each job's own (epsilon, delta) above what its rho converts to, so that zCDP accounting, not basic, is in use.
  // Jobs a and b differ in rho alone, so a cache whose key left out rho would give block 60 block 0's spend (the
  // other fields are keyed alike; these jobs do not tell whether each of them is).
  const ledger::Request a{.run_id = "a",
                          .job = "a",
                          .mechanism = "t",
                          .zcdp = true,
                          .rho = 0.05,
                          .coupled = 1e-9,
                          .epsilon = 2.5,
                          .delta = 1e-7,
                          .blocks = blocks(0, 60)};
  ledger::Request b = a;  // another run, on other blocks, of another rho
  b.run_id = b.job = "b";
  b.rho = 0.1;
  b.blocks = blocks(30, 90);
  const ledger::Request c{.run_id = "c",
                          .job = "c",
                          .mechanism = "t",
                          .zcdp = false,
                          .epsilon = 0.5,
                          .delta = 1e-8,
                          .blocks = blocks(45, 50)};
  for (const ledger::Request& r : {a, b, c})
    ASSERT_EQ(ledger::charge_or_refuse(path.string(), 86400, r), ledger::Outcome::Admitted) << r.job;
  {
    const ledger::Ledger book(path.string());
    const auto spent = book.blocks();
    ASSERT_EQ(spent.size(), 90U);
    for (std::size_t i = 0; i < spent.size(); ++i) {
      ASSERT_EQ(spent[i].block, static_cast<std::int64_t>(i));
      EXPECT_EQ(spent[i].charges.size(), (i < 60 ? 1U : 0U) + (i >= 30 ? 1U : 0U) + (i >= 45 && i < 50 ? 1U : 0U));
    }
    // Every kind of block, and the first and last of each run of alike blocks, against account() of its own charges.
    for (const std::int64_t blk : {0, 29, 30, 44, 45, 49, 50, 59, 60, 89}) {
      const auto& got = spent[static_cast<std::size_t>(blk)];
      const auto want = ledger::account(blk, got.charges, ceiling);
      EXPECT_EQ(got.zcdp, want.zcdp) << blk;
      EXPECT_EQ(got.rho, want.rho) << blk;
      EXPECT_EQ(got.epsilon, want.epsilon) << blk;
      EXPECT_EQ(got.delta, want.delta) << blk;
      EXPECT_EQ(got.epsilon_left, want.epsilon_left) << blk;
      EXPECT_EQ(got.delta_left, want.delta_left) << blk;
      EXPECT_EQ(got.rho_left, want.rho_left) << blk;
    }
    // The three kinds of block differ (the test would not see a cache that mixed them up otherwise).
    EXPECT_TRUE(spent[0].zcdp && spent[30].zcdp && spent[60].zcdp);
    EXPECT_LT(spent[0].epsilon, spent[30].epsilon);
    EXPECT_FALSE(spent[45].zcdp);
    EXPECT_NE(spent[60].epsilon, spent[30].epsilon);
  }
  // Fits where a alone or b alone was charged, not where both were: refused, naming the first such block.
  ledger::Request d{
      .run_id = "d", .job = "d", .mechanism = "t", .zcdp = true, .epsilon = 10, .delta = 1e-6, .blocks = blocks(0, 90)};
  const ledger::Ledger probe(path.string());
  const auto rho_left = [&](std::int64_t blk) { return probe.blocks()[static_cast<std::size_t>(blk)].rho_left; };
  // rho_left is a grid's lower bound: a margin of half the gap.
  d.rho = (rho_left(30) + std::min(rho_left(0), rho_left(60))) / 2;
  ASSERT_GT(d.rho, rho_left(30));
  ASSERT_LT(d.rho, std::min(rho_left(0), rho_left(60)));
  try {
    ledger::charge_or_refuse(path.string(), 86400, d);
    ADD_FAILURE() << "admitted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("block 30 "), std::string::npos) << e.what();
  }
  d.blocks = blocks(60, 90);
  EXPECT_EQ(ledger::charge_or_refuse(path.string(), 86400, d), ledger::Outcome::Admitted);
  std::filesystem::remove(path);
}
