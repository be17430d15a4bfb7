// The FP8 quantizer's per-group arithmetic, shared by the fused quantize kernel (qdq.cpp) and the CPU FP8 GEMM's
// quantize-into-pack path (gemm.cpp), so both produce the same codes and scales bit for bit.
//
// Per group: amax, scale = max(amax / fp8_max, 2**-126) (rounded
// up to a power of two when pow2), b = clamp(x / scale, +-fp8_max), b rounded to the FP8 grid (round to nearest,
// ties to even), out = b * scale. Every step is the same IEEE FP32 operation as fp8core.quant's torch path (true
// division, no reciprocal; no -ffast-math), so results are bit-identical to it (tested), signed zeros included.
//
// Rounding to the FP8 grid: for |b| >= 2**(min_exp + mbits) (FP8 normals) keep the top ``mbits`` mantissa bits of
// the FP32 pattern with round-half-even on the integer pattern; below it (FP8 subnormals) the grid is uniform,
// spacing 2**min_exp, and (b + c) - c with c = 1.5 * 2**(min_exp + 23) rounds b to it in the FP32 adder (ties to
// even), sign restored with copysign. amax is computed on the integer patterns |x| (exact, and NaN > inf > finite),
// so the caller can reject non-finite input from the returned amax.
//
// FP8 codes (when asked) come from the rounded value's bits: sign | biased exponent | top mantissa bits for FP8
// normals, |value| / 2**min_exp for subnormals -- the byte torch's cast writes for the same value.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

struct Fmt {
  float fp8_max;
  int mbits;
  int min_exp;
};

inline uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

template <typename T> inline float load(const T* p, int64_t i);
template <> inline float load<float>(const float* p, int64_t i) { return p[i]; }
template <> inline float load<at::BFloat16>(const at::BFloat16* p, int64_t i) {
  uint16_t h; std::memcpy(&h, p + i, 2); return u2f(static_cast<uint32_t>(h) << 16);
}

inline float scale_of(uint32_t amax_bits, const Fmt& f, bool pow2) {
  const float amax = u2f(amax_bits);
  float s = amax / f.fp8_max;
  if (!(s >= 0x1p-126f)) s = 0x1p-126f;  // also catches nan (caller rejects non-finite amax anyway)
  if (pow2) {
    int e;
    const float m = std::frexp(s, &e);  // s = m * 2**e, m in [0.5, 1)
    if (m == 0.5f) e -= 1;
    s = std::ldexp(1.0f, e);
  }
  return s;
}

struct Consts {
  float c, thr, inv_sub, mx;
  int shift;
  uint32_t half, mask, mmask, bias;
  int mbits;
};

inline Consts consts_of(const Fmt& f) {
  Consts k;
  k.c = std::ldexp(1.5f, f.min_exp + 23);
  k.thr = std::ldexp(1.0f, f.min_exp + f.mbits);
  k.inv_sub = std::ldexp(1.0f, -f.min_exp);
  k.mx = f.fp8_max;
  k.shift = 23 - f.mbits;
  k.half = (1u << (k.shift - 1)) - 1u;
  k.mask = ~((1u << k.shift) - 1u);
  k.mmask = (1u << f.mbits) - 1u;
  k.bias = f.mbits == 3 ? 7u : 15u;
  k.mbits = f.mbits;
  return k;
}

// b = x / scale clamped to +-fp8_max and rounded to the FP8 grid (module comment): the value of b's FP8 code.
// Branch-free and always inlined, so the row loops below still vectorize.
__attribute__((always_inline)) inline float round_to_grid(float bv, const Consts& cs) {
  bv = bv > cs.mx ? cs.mx : (bv < -cs.mx ? -cs.mx : bv);
  const uint32_t u = f2u(bv);
  const float nrm = u2f((u + cs.half + ((u >> cs.shift) & 1u)) & cs.mask);
  const float ab = std::fabs(bv);
  const float sub = std::copysign((ab + cs.c) - cs.c, bv);
  return ab < cs.thr ? sub : nrm;  // on the FP8 grid, |rv| <= fp8_max
}

// One row: divide by the per-column scale, clamp, round to the FP8 grid, write dq and/or codes. Compile-time
// outputs and no branches in the body, so the compiler vectorizes it (checked with -fopt-info-vec).
template <typename T, bool DQ, bool CODES>
void row_loop(const T* __restrict xr, const float* __restrict sv, float* __restrict o, uint8_t* __restrict q,
              int64_t k, const Consts& cs) {
  const float thr = cs.thr, inv_sub = cs.inv_sub;
  const int shift = cs.shift, mbits = cs.mbits;
  const uint32_t mmask = cs.mmask, bias = cs.bias;
  const Consts kc = cs;  // a local copy: its fields stay in registers across the loop
  for (int64_t j = 0; j < k; ++j) {
    const float sj = sv[j];
    const float rv = round_to_grid(load<T>(xr, j) / sj, kc);
    if (DQ) o[j] = rv * sj;
    if (CODES) {
      const uint32_t ur = f2u(rv), ua = ur & 0x7FFFFFFFu;
      const float ar = u2f(ua);
      const uint32_t sub_code = static_cast<uint32_t>(static_cast<int32_t>(ar * inv_sub));  // exact, 0..2**mbits
      const uint32_t nrm_code = ((((ua >> 23) - 127u + bias) << mbits) | ((ua >> shift) & mmask));
      q[j] = static_cast<uint8_t>(((ur >> 24) & 0x80u) | (ar < thr ? sub_code : nrm_code));
    }
  }
}

// One group of a row with one scale: the same division, clamp and rounding as row_loop, writing the rounded values
// themselves (on the FP8 grid, |v| <= fp8_max) as V: float, or uint16_t for the BF16 pattern (the top half of the
// FP32 pattern, exact: an FP8 value has at most 4 significant bits) -- the value of the code row_loop would write,
// without forming the code. What the CPU FP8 GEMM multiplies (gemm.cpp).
template <typename T, typename V>
void row_values(const T* __restrict xr, float s, V* __restrict out, int64_t k, const Consts& cs) {
  const Consts kc = cs;  // a local copy: its fields stay in registers across the loop
  for (int64_t j = 0; j < k; ++j) {
    const float rv = round_to_grid(load<T>(xr, j) / s, kc);
    if constexpr (std::is_same<V, float>::value) {
      out[j] = rv;
    } else {
      out[j] = static_cast<V>(f2u(rv) >> 16);
    }
  }
}

// max over n elements of |x| as FP32 bit patterns (exact; NaN > inf > finite), a vectorizable unsigned reduction
template <typename T>
inline uint32_t absmax_bits(const T* __restrict p, int64_t n) {
  uint32_t m = 0;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t v = f2u(load<T>(p, j)) & 0x7FFFFFFFu;
    m = v > m ? v : m;
  }
  return m;
}

// acc[j] = max(acc[j], |x[j]| bits) over one row
template <typename T>
inline void col_absmax(const T* __restrict xr, uint32_t* __restrict acc, int64_t k) {
  for (int64_t j = 0; j < k; ++j) {
    const uint32_t v = f2u(load<T>(xr, j)) & 0x7FFFFFFFu;
    acc[j] = v > acc[j] ? v : acc[j];
  }
}

}  // namespace
