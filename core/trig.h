// sin and cos of a product p * f of two doubles, as if the product were
// exact. p * f rounded to fp64 is off by up to half an ulp of the angle:
// 1.2e-4 rad at 2^40 rad, enough to move a RoPE or sinusoidal entry at a
// large position (or a large frequency) far past fp32's precision. The
// product's rounding error is itself a double (an FMA gives it exactly), so
// the angle is hi + lo and the angle-addition formula gives its sin and cos
// to a few fp64 ulps.
#ifndef ROPEATTN_CORE_TRIG_H_
#define ROPEATTN_CORE_TRIG_H_

#include <cmath>

namespace ropeattn::internal {

inline void SinCosOfProduct(double p, double f, double* s, double* c) {
  const double hi = p * f;
  const double lo = std::fma(p, f, -hi);
  const double sh = std::sin(hi), ch = std::cos(hi);
  if (lo == 0.0) {
    *s = sh;
    *c = ch;
    return;
  }
  double sl, cl;
  if (std::fabs(lo) < 0x1p-20) {
    // |lo| < 1e-6: the series' next terms are below 1e-19.
    sl = lo;
    cl = 1.0 - 0.5 * lo * lo;
  } else {
    sl = std::sin(lo);
    cl = std::cos(lo);
  }
  *s = sh * cl + ch * sl;
  *c = ch * cl - sh * sl;
}

}  // namespace ropeattn::internal

#endif  // ROPEATTN_CORE_TRIG_H_
