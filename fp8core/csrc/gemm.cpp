// The CPU FP8 GEMM: C[m, n] = sum over K blocks kb of (sa[m, kb] * sb[n, kb]) * P_kb[m, n], where
// P_kb[m, n] = sum_{k in block kb} A[m, k] * B[n, k] over the FP8 codes, accumulated in FP32.
//
// Why this is exact up to summation order: every E4M3 / E5M2 value is a normal BF16 number (BF16 has FP32's
// exponent range; E5M2's smallest subnormal is 2^-16), and the product of two has at most 8 significant bits, so
// each product is exact in FP32 and the only roundings are the FP32 additions of P_kb and the scaled accumulation.
//
// Paths, chosen when the file is compiled for a CPU kind (fp8core/kernels.py builds one library per kind):
//   __AVX512BF16__: VDPBF16PS. A's codes as BF16 pairs broadcast to 16 lanes, B packed [N/16][K/2][16 lanes][2]:
//                   each lane n accumulates A[m, 2p] * B[n, 2p] + A[m, 2p+1] * B[n, 2p+1] into its FP32 sum.
//   else __AVX2__:  the same formula in FP32 FMAs, one k at a time (8 lanes over n).
// Order (the same for every M, every tiling and every thread count, so a row's output does not depend on its
// batch): for each output element, blocks kb = 0, 1, ... in turn; inside a block the pairs (AVX-512 BF16) or the
// single k (FP32 path) in increasing k into a fresh FP32 sum P_kb; then acc = fma(P_kb, sa * sb, acc) with the
// scale product rounded to FP32 first. A K block is `block` columns (128 for the blockwise recipe; all of K for
// rowwise / tensorwise, i.e. one GEMM over the codes then the outer product of the scales).
// Padding: each block is padded with zero codes to an even length (AVX-512 BF16 pairs); N to the lane width.
#include "quant.h"

#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace {

// ---------------------------------------------------------------------------------------------- FP8 code tables
float fp8_value(uint8_t code, int fmt) {  // fmt 0: float8_e4m3fn, 1: float8_e5m2
  const int mbits = fmt == 0 ? 3 : 2, ebits = fmt == 0 ? 4 : 5, bias = fmt == 0 ? 7 : 15;
  const int e = (code >> mbits) & ((1 << ebits) - 1), m = code & ((1 << mbits) - 1);
  float v;
  if (fmt == 0 && e == 15 && m == 7) {
    v = NAN;
  } else if (fmt == 1 && e == 31) {
    v = m ? NAN : INFINITY;
  } else if (e == 0) {
    v = std::ldexp(static_cast<float>(m), 1 - bias - mbits);
  } else {
    v = std::ldexp(static_cast<float>((1 << mbits) | m), e - bias - mbits);
  }
  return (code & 0x80) ? -v : v;
}

struct Tables {
  float f32[2][256];
  uint16_t bf16[2][256];
  Tables() {
    for (int fmt = 0; fmt < 2; ++fmt) {
      for (int c = 0; c < 256; ++c) {
        const float v = fp8_value(static_cast<uint8_t>(c), fmt);
        uint32_t bits;
        std::memcpy(&bits, &v, 4);
        f32[fmt][c] = v;
        bf16[fmt][c] = static_cast<uint16_t>(bits >> 16);  // exact: an FP8 value has <= 4 significant bits
      }
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

struct Shape {
  int64_t m, n, k, block, block_pad, nkb, kp;  // kp: packed K = nkb * block_pad
};

// The code at packed column c of row r (0 where the column is block padding or beyond K).
inline uint8_t code_at(const uint8_t* x, int64_t s0, int64_t s1, int64_t r, int64_t c, const Shape& s) {
  const int64_t kb = c / s.block_pad, j = c % s.block_pad, k = kb * s.block + j;
  return (j < s.block && k < s.k) ? x[r * s0 + k * s1] : 0;
}

inline int64_t block_len(const Shape& s, int64_t kb) {  // valid columns of block kb
  return std::min(s.block, s.k - kb * s.block);
}

// the register-blocked loops must be unrolled: an accumulator array indexed by a loop variable lives in memory
#define UNROLL _Pragma("GCC unroll 32")

#if defined(__AVX512BF16__)
constexpr const char* kPath = "avx512_bf16 (VDPBF16PS, FP32 accumulation)";
constexpr int kLanes = 16;
using Elem = uint32_t;  // a pair of BF16 codes

// One MR-row strip x NV column tiles over the K blocks [kb0, kb1). The block sums P live in MR * NV registers
// (enough independent VDPBF16PS chains to hide their latency); the scaled accumulation goes through the output tile
// c: written at block 0, read and written at the later ones (acc = fma(P, sa * sb, acc), the same per element as
// in registers). ap: row m0's packed pairs (rows apart by kp/2); bp: tile t0's packed pairs (tiles apart by
// kp/2 * 16); sa: row m0's scales [nkb] (rows apart by nkb); sbp: tile t0's scales [nkb][16] (tiles apart by
// nkb * 16).
template <int MR, int NV>
void micro(const Elem* ap, const Elem* bp, const float* sa, const float* sbp, float* c, int64_t ldc, int64_t ncols,
           const Shape& s, int64_t kb0, int64_t kb1) {
  const int64_t pairs = s.kp / 2, bstride = pairs * kLanes, half = s.block_pad / 2;
  __mmask16 mask[NV];
  UNROLL
  for (int v = 0; v < NV; ++v) {
    const int64_t left = ncols - v * kLanes;
    mask[v] = left >= kLanes ? static_cast<__mmask16>(0xFFFF)
                             : static_cast<__mmask16>(left > 0 ? (1u << left) - 1 : 0u);
  }
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    __m512 part[MR][NV];
    UNROLL
    for (int r = 0; r < MR; ++r)
      UNROLL
      for (int v = 0; v < NV; ++v) part[r][v] = _mm512_setzero_ps();
    const int64_t p0 = kb * half, p1 = p0 + (block_len(s, kb) + 1) / 2;
    for (int64_t p = p0; p < p1; ++p) {
      __m512i bv[NV];
      UNROLL
      for (int v = 0; v < NV; ++v)
        bv[v] = _mm512_loadu_si512(reinterpret_cast<const void*>(bp + v * bstride + p * kLanes));
      UNROLL
      for (int r = 0; r < MR; ++r) {
        const __m512i av = _mm512_set1_epi32(static_cast<int>(ap[r * pairs + p]));
        UNROLL
        for (int v = 0; v < NV; ++v)
          part[r][v] = _mm512_dpbf16_ps(part[r][v], (__m512bh)av, (__m512bh)bv[v]);
      }
    }
    UNROLL
    for (int v = 0; v < NV; ++v) {
      const __m512 sb = _mm512_loadu_ps(sbp + (v * s.nkb + kb) * kLanes);
      UNROLL
      for (int r = 0; r < MR; ++r) {
        const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(sa[r * s.nkb + kb]), sb);
        float* out = c + r * ldc + v * kLanes;
        const __m512 prev = kb == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask[v], out);
        _mm512_mask_storeu_ps(out, mask[v], _mm512_fmadd_ps(part[r][v], scale, prev));
      }
    }
  }
}

constexpr int kMaxMR = 8;
#elif defined(__AVX2__)
constexpr const char* kPath = "fp32 (AVX2 FMA; no BF16 units)";
constexpr int kLanes = 8;
using Elem = float;

// The FP32 path, same contract as above: 16 ymm registers, the block sums P in MR * NV of them; columns past ncols
// (the last tile's padding) go through a small buffer.
template <int MR, int NV>
void micro(const Elem* ap, const Elem* bp, const float* sa, const float* sbp, float* c, int64_t ldc, int64_t ncols,
           const Shape& s, int64_t kb0, int64_t kb1) {
  const int64_t bstride = s.kp * kLanes;
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    __m256 part[MR][NV];
    UNROLL
    for (int r = 0; r < MR; ++r)
      UNROLL
      for (int v = 0; v < NV; ++v) part[r][v] = _mm256_setzero_ps();
    const int64_t c0 = kb * s.block_pad, c1 = c0 + block_len(s, kb);
    for (int64_t col = c0; col < c1; ++col) {
      __m256 bv[NV];
      UNROLL
      for (int v = 0; v < NV; ++v) bv[v] = _mm256_loadu_ps(bp + v * bstride + col * kLanes);
      UNROLL
      for (int r = 0; r < MR; ++r) {
        const __m256 av = _mm256_broadcast_ss(ap + r * s.kp + col);
        UNROLL
        for (int v = 0; v < NV; ++v) part[r][v] = _mm256_fmadd_ps(av, bv[v], part[r][v]);
      }
    }
    UNROLL
    for (int v = 0; v < NV; ++v) {
      const int64_t left = std::min<int64_t>(ncols - v * kLanes, kLanes);
      if (left <= 0) break;
      const __m256 sb = _mm256_loadu_ps(sbp + (v * s.nkb + kb) * kLanes);
      UNROLL
      for (int r = 0; r < MR; ++r) {
        const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(sa[r * s.nkb + kb]), sb);
        float* out = c + r * ldc + v * kLanes;
        alignas(32) float buf[kLanes] = {};
        if (kb != 0) std::memcpy(buf, out, sizeof(float) * left);
        const __m256 prev = left == kLanes ? (kb == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out)) : _mm256_load_ps(buf);
        const __m256 res = _mm256_fmadd_ps(part[r][v], scale, prev);
        if (left == kLanes) {
          _mm256_storeu_ps(out, res);
        } else {
          _mm256_store_ps(buf, res);
          std::memcpy(out, buf, sizeof(float) * left);
        }
      }
    }
  }
}

constexpr int kMaxMR = 6;
#else
#error "fp8core's CPU FP8 GEMM needs AVX2 (the FP32 path) or AVX-512 BF16"
#endif

// ------------------------------------------------------------------------------------------------------ packing
// The operands as the micro-kernel reads them. A: [M][kp] values (BF16 bits / FP32), each K block padded with zeros
// to block_pad columns. B: [ntiles][kp][kLanes] for the FP32 path, [ntiles][kp / 2][kLanes][2] for the pair path
// (lane i's two columns of a pair side by side), with zero rows past N; B's scales [ntiles][nkb][kLanes].
#if defined(__AVX512BF16__)
using Value = uint16_t;
inline const Value* value_table(int fmt) { return tables().bf16[fmt]; }
inline int64_t b_index(const Shape& s, int64_t tile, int64_t i, int64_t c) {
  return ((tile * (s.kp / 2) + c / 2) * kLanes + i) * 2 + (c & 1);
}
#else
using Value = float;
inline const Value* value_table(int fmt) { return tables().f32[fmt]; }
inline int64_t b_index(const Shape& s, int64_t tile, int64_t i, int64_t c) { return (tile * s.kp + c) * kLanes + i; }
#endif
static_assert(sizeof(Elem) == 2 * sizeof(Value) || std::is_same<Elem, Value>::value, "element layout");

// The values of FP8 codes (value_table's entries, exactly), vectorized: a finite normal code's magnitude bits shifted
// into place plus the exponent-bias difference; subnormals and zero from the first table entries (a lane permute).
// A vector holding a NaN / infinity code (never in quantized data) returns false and is converted through the table.
#if defined(__AVX512BF16__)
constexpr int kConvertWidth = 32;
inline bool convert_vec(const __m256i codes, int fmt, __m512i* out) {  // 32 codes -> 32 BF16 patterns
  const __m512i c = _mm512_cvtepu8_epi16(codes);
  const __m512i mag = _mm512_and_si512(c, _mm512_set1_epi16(0x7F));
  if (_mm512_cmpge_epu16_mask(mag, _mm512_set1_epi16(static_cast<int16_t>(fmt == 0 ? 0x7F : 0x7C)))) return false;
  const __m512i bias = _mm512_set1_epi16(static_cast<int16_t>(fmt == 0 ? 120 << 7 : 112 << 7));
  const __m512i low = _mm512_loadu_si512(reinterpret_cast<const void*>(tables().bf16[fmt]));  // entries 0..31
  __m512i v = _mm512_add_epi16(fmt == 0 ? _mm512_slli_epi16(mag, 4) : _mm512_slli_epi16(mag, 5), bias);
  const __mmask32 sub = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(static_cast<int16_t>(fmt == 0 ? 0x08 : 0x04)));
  v = _mm512_mask_permutexvar_epi16(v, sub, mag, low);
  *out = _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(c, _mm512_set1_epi16(0x80)), 8));
  return true;
}
inline __m256i load_codes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store_values(uint16_t* p, __m512i v) { _mm512_storeu_si512(reinterpret_cast<void*>(p), v); }
#else
constexpr int kConvertWidth = 8;
inline bool convert_vec(const __m128i codes, int fmt, __m256* out) {  // the low 8 codes -> 8 FP32 values
  const __m256i c = _mm256_cvtepu8_epi32(codes);
  const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
  if (_mm256_movemask_epi8(_mm256_cmpgt_epi32(mag, _mm256_set1_epi32((fmt == 0 ? 0x7F : 0x7C) - 1)))) return false;
  const __m256i bias = _mm256_set1_epi32(fmt == 0 ? 120 << 23 : 112 << 23);
  const __m256 low = _mm256_loadu_ps(tables().f32[fmt]);  // entries 0..7
  const __m256i normal = _mm256_add_epi32(fmt == 0 ? _mm256_slli_epi32(mag, 20) : _mm256_slli_epi32(mag, 21), bias);
  const __m256 sub = _mm256_permutevar8x32_ps(low, mag);
  const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(fmt == 0 ? 0x08 : 0x04), mag));
  __m256 v = _mm256_blendv_ps(_mm256_castsi256_ps(normal), sub, is_sub);
  *out = _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24)));
  return true;
}
inline __m128i load_codes(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
inline void store_values(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
#endif

// dst[j] = the value of FP8 code src[j], j < n.
inline void convert_run(const uint8_t* src, int64_t n, int fmt, Value* dst) {
  const Value* t = value_table(fmt);
  int64_t j = 0;
  for (; j + kConvertWidth <= n; j += kConvertWidth) {
#if defined(__AVX512BF16__)
    __m512i v;
#else
    __m256 v;
#endif
    if (convert_vec(load_codes(src + j), fmt, &v)) {
      store_values(dst + j, v);
    } else {
      for (int64_t k = j; k < j + kConvertWidth; ++k) dst[k] = t[src[k]];
    }
  }
  for (; j < n; ++j) dst[j] = t[src[j]];
}

// out[c][r] = in[r][c] for a 16 x 16 byte block (rows of `in` lie in_stride apart, of `out` out_stride apart): four
// rounds of byte / word / dword / qword interleaves instead of 256 single-byte moves.
inline void transpose16x16(const uint8_t* in, int64_t in_stride, uint8_t* out, int64_t out_stride) {
  __m128i x[16], y[16];
  for (int i = 0; i < 16; ++i) x[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i * in_stride));
  for (int i = 0; i < 8; ++i) {
    y[i] = _mm_unpacklo_epi8(x[2 * i], x[2 * i + 1]);
    y[i + 8] = _mm_unpackhi_epi8(x[2 * i], x[2 * i + 1]);
  }
  for (int i = 0; i < 8; ++i) {
    x[i] = _mm_unpacklo_epi16(y[2 * i], y[2 * i + 1]);
    x[i + 8] = _mm_unpackhi_epi16(y[2 * i], y[2 * i + 1]);
  }
  for (int i = 0; i < 8; ++i) {
    y[i] = _mm_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
    y[i + 8] = _mm_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
  }
  for (int i = 0; i < 8; ++i) {
    x[i] = _mm_unpacklo_epi64(y[2 * i], y[2 * i + 1]);
    x[i + 8] = _mm_unpackhi_epi64(y[2 * i], y[2 * i + 1]);
  }
  // after the four rounds x[k] holds output row perm(k): the bit-reversal of k's 4 bits
  static constexpr int kPerm[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  for (int k = 0; k < 16; ++k) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + kPerm[k] * out_stride), x[k]);
}

// Both packers read any strides (the wgrad operands are transposed views of row-major codes), in an order that
// keeps the source lines they share in L1, so neither a gather of columns nor a transposed copy is needed.
void pack_a(const uint8_t* a, int64_t s0, int64_t s1, int fmt, const Shape& s, Value* out) {
  constexpr int64_t kRows = 64;
  at::parallel_for(0, (s.m + kRows - 1) / kRows, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t rt = lo; rt < hi; ++rt) {
      const int64_t r0 = rt * kRows, r1 = std::min(s.m, r0 + kRows);
      for (int64_t kb = 0; kb < s.nkb; ++kb) {
        const int64_t len = block_len(s, kb);
        const uint8_t* src = a + kb * s.block * s1;
        Value* dst = out + kb * s.block_pad;
        if (s1 == 1) {
          for (int64_t r = r0; r < r1; ++r) convert_run(src + r * s0, len, fmt, dst + r * s.kp);
        } else {  // the codes through an L1 tile: the rows of dst lie kp apart (often a multiple of 4 KB: one set)
          constexpr int64_t kCols = 64;
          uint8_t tile[kRows][kCols];
          for (int64_t j0 = 0; j0 < len; j0 += kCols) {
            const int64_t j1 = std::min(len, j0 + kCols);
            if (s0 == 1 && r1 - r0 == kRows && j1 - j0 == kCols) {  // a full tile of a transposed row-major source
              for (int64_t jb = 0; jb < kCols; jb += 16)
                for (int64_t rb = 0; rb < kRows; rb += 16)
                  transpose16x16(src + (j0 + jb) * s1 + r0 + rb, s1, &tile[rb][jb], kCols);
            } else {
              for (int64_t j = j0; j < j1; ++j)
                for (int64_t r = r0; r < r1; ++r) tile[r - r0][j - j0] = src[r * s0 + j * s1];
            }
            for (int64_t r = r0; r < r1; ++r) convert_run(tile[r - r0], j1 - j0, fmt, dst + r * s.kp + j0);
          }
        }
        // the block's padding columns (the buffer is reused between calls: nothing else clears them)
        for (int64_t r = r0; r < r1; ++r) std::fill(dst + r * s.kp + len, dst + r * s.kp + s.block_pad, Value(0));
      }
    }
  });
}

// A's packed values straight from FP32 / BF16 activations x [M, K] (contiguous): each K block of a row is one
// quantization group (128 columns for group128, the whole row for rowwise), quantized with quant.h's operations
// (the fused quantizer's, so the scales are quantize()'s bit for bit) and written as the values of its codes
// (row_values: the rounded values themselves, no code formed) -- no FP8 code tensor, no conversion pass. sa: [M,
// nkb] scales out. Returns the largest |x| as FP32 bits (NaN > inf > finite: the caller rejects non-finite input).
template <typename T>
uint32_t pack_a_quantized(const T* x, const Fmt& f, bool pow2, const Shape& s, Value* out, float* sa) {
  constexpr int64_t kRows = 16;
  const Consts cst = consts_of(f);
  std::atomic<uint32_t> amax_all{0};
  at::parallel_for(0, (s.m + kRows - 1) / kRows, 1, [&](int64_t lo, int64_t hi) {
    uint32_t local = 0;
    for (int64_t r = lo * kRows; r < std::min(s.m, hi * kRows); ++r) {
      const T* row = x + r * s.k;
      Value* dst = out + r * s.kp;
      for (int64_t kb = 0; kb < s.nkb; ++kb) {
        const int64_t c0 = kb * s.block, len = block_len(s, kb);
        const uint32_t am = absmax_bits<T>(row + c0, len);
        const float scale = scale_of(am, f, pow2);
        local = am > local ? am : local;
        sa[r * s.nkb + kb] = scale;
        row_values<T, Value>(row + c0, scale, dst + kb * s.block_pad, len, cst);
        std::fill(dst + kb * s.block_pad + len, dst + (kb + 1) * s.block_pad, Value(0));
      }
    }
    uint32_t seen = amax_all.load();
    while (local > seen && !amax_all.compare_exchange_weak(seen, local)) {
    }
  });
  return amax_all.load();
}

// One K block of one tile: len columns of kLanes codes each, column j at src + j * s1, into dst (the block's first
// packed column of the tile), padded with zeros to block_pad columns.
void pack_lanes_block(const uint8_t* src, int64_t s1, int64_t len, int64_t block_pad, int fmt, Value* dst) {
  const Value* t = value_table(fmt);
#if defined(__AVX512BF16__)
  // word 2i of the output pair row is lane i of column j, word 2i + 1 lane i of column j + 1
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                           8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i perm = _mm512_load_si512(reinterpret_cast<const void*>(kInterleave));
  int64_t j = 0;
  for (; j < len; j += 2) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j * s1));
    const __m128i hi = j + 1 < len ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (j + 1) * s1))
                                   : _mm_setzero_si128();  // an odd block's last pair: code 0 is +0
    __m512i v;
    if (!convert_vec(_mm256_set_m128i(hi, lo), fmt, &v)) {
      alignas(64) uint16_t tmp[32];
      for (int i = 0; i < kLanes; ++i) {
        tmp[i] = t[src[j * s1 + i]];
        tmp[kLanes + i] = j + 1 < len ? t[src[(j + 1) * s1 + i]] : Value(0);
      }
      v = _mm512_load_si512(reinterpret_cast<const void*>(tmp));
    }
    store_values(dst + j * kLanes, _mm512_permutexvar_epi16(perm, v));
  }
#else
  int64_t j = 0;
  for (; j < len; ++j) {
    __m256 v;
    if (convert_vec(load_codes(src + j * s1), fmt, &v)) {
      store_values(dst + j * kLanes, v);
    } else {
      for (int i = 0; i < kLanes; ++i) dst[j * kLanes + i] = t[src[j * s1 + i]];
    }
  }
#endif
  std::fill(dst + j * kLanes, dst + block_pad * kLanes, Value(0));  // the block's padding columns
}

// A full tile whose kLanes rows lie next to each other in memory (s0 == 1: a transposed view of row-major codes,
// i.e. the wgrad operand along tokens and the dgrad weight): each K column's kLanes codes are one contiguous load,
// converted in vector registers and stored in packed order (for the pair layout two columns at once, their values
// interleaved by one permute) -- no gather, no scalar scatter.
void pack_b_tile_lanes(const uint8_t* b, int64_t s1, int fmt, const Shape& s, int64_t tile, Value* out) {
  for (int64_t kb = 0; kb < s.nkb; ++kb)
    pack_lanes_block(b + tile * kLanes + kb * s.block * s1, s1, block_len(s, kb), s.block_pad, fmt,
                     out + b_index(s, tile, 0, kb * s.block_pad));
}

void pack_b(const uint8_t* b, int64_t s0, int64_t s1, int fmt, const Shape& s, Value* out) {
  const int64_t ntiles = (s.n + kLanes - 1) / kLanes;
  at::parallel_for(0, ntiles, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t tile = lo; tile < hi; ++tile) {
      if (s0 == 1 && (tile + 1) * kLanes <= s.n) {
        pack_b_tile_lanes(b, s1, fmt, s, tile, out);
        continue;
      }
      Value* tout = out + b_index(s, tile, 0, 0);
      std::fill(tout, tout + s.kp * kLanes, Value(0));
      const int64_t lanes = std::min<int64_t>(kLanes, s.n - tile * kLanes);
      for (int64_t kb = 0; kb < s.nkb; ++kb) {
        const int64_t len = block_len(s, kb);
        // 128 columns at a time: the tile's codes gathered into L1 (kLanes source rows, any strides), converted
        // row by row, then written in order through the packed tile
        constexpr int64_t kCols = 128;
        uint8_t codes[kLanes][kCols];
        Value vals[kLanes][kCols];
        for (int64_t j0 = 0; j0 < len; j0 += kCols) {
          const int64_t j1 = std::min(len, j0 + kCols);
          const uint8_t* src = b + tile * kLanes * s0 + (kb * s.block + j0) * s1;
          for (int64_t i = 0; i < lanes; ++i) {
            if (s1 == 1) {
              convert_run(src + i * s0, j1 - j0, fmt, vals[i]);
            } else {
              for (int64_t j = 0; j < j1 - j0; ++j) codes[i][j] = src[i * s0 + j * s1];
              convert_run(codes[i], j1 - j0, fmt, vals[i]);
            }
          }
          for (int64_t j = j0; j < j1; ++j)
            for (int64_t i = 0; i < lanes; ++i) out[b_index(s, tile, i, kb * s.block_pad + j)] = vals[i][j - j0];
        }
      }
    }
  });
}

// Column tiles per micro-kernel call for an MR-row strip: more for short strips (decode), where the FMA / VDPBF16PS
// latency of too few independent sums would bound the speed; each a divisor of kChunkTiles. Each output's
// instruction sequence is the same whatever the width, so this choice does not change a bit.
template <int MR>
constexpr int nv_for() {
#if defined(__AVX512BF16__)
  return MR <= 1 ? 12 : MR <= 3 ? 6 : MR <= 6 ? 4 : 3;
#else
  return MR <= 1 ? 6 : MR <= 2 ? 4 : 2;
#endif
}

constexpr int64_t kChunkTiles = 12;    // column tiles per work item (a multiple of every nv_for width)
constexpr int64_t kBlockRows = 32 * kMaxMR;  // rows per work item (halved while items are few: a multiple of kMaxMR)

inline int64_t b_tile_stride(const Shape& s) {
  return (std::is_same<Elem, float>::value ? s.kp : s.kp / 2) * kLanes;
}

// One MR-row strip against tiles [t0, t0 + ntiles) over the K blocks [kb0, kb1).
template <int MR>
void rows(const Elem* ap, const Elem* bp, const float* sa, const float* sbp, float* c, const Shape& s,
          int64_t t0, int64_t ntiles, int64_t kb0, int64_t kb1) {
  constexpr int NV = nv_for<MR>();
  const int64_t bstride = b_tile_stride(s);
  int64_t t = t0;
  for (; t + NV <= t0 + ntiles; t += NV)
    micro<MR, NV>(ap, bp + t * bstride, sa, sbp + t * s.nkb * kLanes, c + t * kLanes, s.n,
                  std::min<int64_t>(NV * kLanes, s.n - t * kLanes), s, kb0, kb1);
  // the rest: half a panel at once where it fits (e.g. 8 tiles in panels of 3, 3, 2: the last 2 with 2 x MR
  // independent sums instead of MR, twice), then tile by tile
  constexpr int kHalf = (NV + 1) / 2;
  if constexpr (kHalf > 1 && kHalf < NV) {
    if (t + kHalf <= t0 + ntiles) {
      micro<MR, kHalf>(ap, bp + t * bstride, sa, sbp + t * s.nkb * kLanes, c + t * kLanes, s.n,
                       std::min<int64_t>(kHalf * kLanes, s.n - t * kLanes), s, kb0, kb1);
      t += kHalf;
    }
  }
  for (; t < t0 + ntiles; ++t)
    micro<MR, 1>(ap, bp + t * bstride, sa, sbp + t * s.nkb * kLanes, c + t * kLanes, s.n,
                 std::min<int64_t>(kLanes, s.n - t * kLanes), s, kb0, kb1);
}

template <int MR>
void strip(int mr, const Elem* ap, const Elem* bp, const float* sa, const float* sbp, float* c, const Shape& s,
           int64_t t0, int64_t ntiles, int64_t kb0, int64_t kb1) {
  if constexpr (MR > 1) {
    if (mr < MR) return strip<MR - 1>(mr, ap, bp, sa, sbp, c, s, t0, ntiles, kb0, kb1);
  }
  rows<MR>(ap, bp, sa, sbp, c, s, t0, ntiles, kb0, kb1);
}

// One work item: rows [m0, m1) x tiles [t0, t0 + ntiles), all K blocks. K blocks outermost, then panels of NV
// tiles, then the full strips: a panel's block of B (NV tiles x one K block, 12 KB) stays in L1 while every strip
// of the item passes over it, and the item's outputs stay in L2 between blocks. Every output element still gets
// its blocks in increasing order, each block's sum from zero: the result does not depend on this order.
void item(const Elem* ap, const Elem* bp, const float* sa, const float* sbp, float* c, const Shape& s, int64_t m0,
          int64_t m1, int64_t t0, int64_t ntiles) {
  constexpr int NV = nv_for<kMaxMR>();
  const int64_t per_row = s.kp * static_cast<int64_t>(sizeof(Value)) / static_cast<int64_t>(sizeof(Elem));
  const int64_t full = (m1 - m0) / kMaxMR, rest = (m1 - m0) % kMaxMR;
  for (int64_t kb = 0; kb < s.nkb; ++kb) {
    for (int64_t t = t0; t < t0 + ntiles; t += NV) {
      const int64_t width = std::min<int64_t>(NV, t0 + ntiles - t);  // one panel (fewer tiles at the chunk's end)
      for (int64_t st = 0; st < full; ++st) {
        const int64_t r0 = m0 + st * kMaxMR;
        rows<kMaxMR>(ap + r0 * per_row, bp, sa + r0 * s.nkb, sbp, c + r0 * s.n, s, t, width, kb, kb + 1);
      }
    }
    if (rest) {
      const int64_t r0 = m0 + full * kMaxMR;
      strip<kMaxMR>(static_cast<int>(rest), ap + r0 * per_row, bp, sa + r0 * s.nkb, sbp, c + r0 * s.n, s, t0, ntiles,
                    kb, kb + 1);
    }
  }
}

int fmt_index(int64_t fmt) {
  TORCH_CHECK(fmt == 0 || fmt == 1, "fp8_gemm: format must be 0 (e4m3) or 1 (e5m2), got ", fmt);
  return static_cast<int>(fmt);
}

}  // namespace

namespace {

Shape shape_of(int64_t m, int64_t n, int64_t k, int64_t block) {
  TORCH_CHECK(block >= 1, "fp8_gemm: block must be >= 1");
  Shape s{};
  s.m = m;
  s.n = n;
  s.k = k;
  s.block = std::min<int64_t>(block, std::max<int64_t>(k, 1));
  s.block_pad = (s.block + 1) / 2 * 2;
  s.nkb = k == 0 ? 0 : (k + s.block - 1) / s.block;
  s.kp = s.nkb * s.block_pad;
  return s;
}

at::Tensor rows_scales(const at::Tensor& scale, int64_t rows, int64_t nkb, const char* what) {
  auto out = scale.to(at::kFloat).contiguous();
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == nkb, "fp8_gemm: ", what, " must be [", rows,
              ", ", nkb, "], got ", out.sizes());
  return out;
}

int64_t packed_values(const Shape& s) { return (s.n + kLanes - 1) / kLanes * s.kp * kLanes; }
int64_t packed_scales(const Shape& s) { return (s.n + kLanes - 1) / kLanes * s.nkb * kLanes; }

}  // namespace

// Pack the weight-side operand once (per refit / optimizer update): b uint8 codes [N, K] (any strides), b_scale
// float32 [N, nkb] (per row and K block). Returns (values: this build's value type as int16 / float32, flat; scales:
// float32, flat) -- a layout private to this build, read only by fp8_gemm_packed of the same process.
std::tuple<at::Tensor, at::Tensor> fp8_pack(const at::Tensor& b, int64_t b_fmt, const at::Tensor& b_scale,
                                            int64_t block) {
  TORCH_CHECK(b.device().is_cpu() && b.scalar_type() == at::kByte && b.dim() == 2, "fp8_pack: uint8 CPU codes [N, K]");
  const Shape s = shape_of(0, b.size(0), b.size(1), block);
  const auto sb = rows_scales(b_scale, s.n, s.nkb, "b_scale");
  const bool bf16 = std::is_same<Value, uint16_t>::value;
  auto values = at::empty({packed_values(s)}, b.options().dtype(bf16 ? at::kShort : at::kFloat));
  auto scales = at::zeros({packed_scales(s)}, b.options().dtype(at::kFloat));
  if (s.n == 0 || s.nkb == 0) return {values, scales};
  pack_b(b.data_ptr<uint8_t>(), b.stride(0), b.stride(1), fmt_index(b_fmt), s,
         reinterpret_cast<Value*>(values.data_ptr()));
  const float* src = sb.data_ptr<float>();
  float* dst = scales.data_ptr<float>();
  for (int64_t r = 0; r < s.n; ++r)
    for (int64_t kb = 0; kb < s.nkb; ++kb)
      dst[((r / kLanes) * s.nkb + kb) * kLanes + r % kLanes] = src[r * s.nkb + kb];
  return {values, scales};
}

namespace {

void check_packed(const Shape& s, const at::Tensor& b_values, const at::Tensor& b_scales) {
  TORCH_CHECK(b_values.numel() == packed_values(s) && b_scales.numel() == packed_scales(s) && b_values.is_contiguous()
              && b_scales.is_contiguous() && b_values.element_size() == static_cast<int64_t>(sizeof(Value)),
              "fp8_gemm_packed: the packed weight does not match N = ", s.n, ", K = ", s.k, ", block = ", s.block,
              " (pack it with fp8_pack in this process)");
}

// C [M, N] = A @ B.T from A packed ([M][kp] values) with its scales sa [M, nkb] and B packed by fp8_pack.
void run_gemm(const Value* ap, const float* sad, const at::Tensor& b_values, const at::Tensor& b_scales,
              const Shape& s, float* c) {
  const int64_t ntiles = (s.n + kLanes - 1) / kLanes;
  // work items: (block of kBlockRows rows) x (chunk of kChunkTiles column tiles), consecutive items sharing a chunk
  // (its B stays in L2); each output element is computed by one item with the same instruction sequence whatever
  // the split
  const int64_t chunks = (ntiles + kChunkTiles - 1) / kChunkTiles;
  int64_t block_rows = kBlockRows;  // fewer rows per item where there are too few items for the threads
  while (block_rows > kMaxMR && (s.m + block_rows - 1) / block_rows * chunks < 4 * at::get_num_threads())
    block_rows /= 2;
  const int64_t mblocks = (s.m + block_rows - 1) / block_rows;
  const Elem* apd = reinterpret_cast<const Elem*>(ap);
  const Elem* bpd = reinterpret_cast<const Elem*>(b_values.data_ptr());
  const float* sbp = b_scales.data_ptr<float>();
  // items taken one at a time by whichever thread is free (OpenMP's dynamic schedule on torch's thread count): the
  // last column chunk and the last row block are smaller, and a static split left one thread up to a third idle
  const int64_t items = mblocks * chunks;
  const int threads = at::in_parallel_region() ? 1 : static_cast<int>(std::min<int64_t>(at::get_num_threads(), items));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t g = it / mblocks, mb = it % mblocks;
    const int64_t m0 = mb * block_rows, m1 = std::min(s.m, m0 + block_rows);
    const int64_t t0 = g * kChunkTiles, nt = std::min(kChunkTiles, ntiles - t0);
    item(apd, bpd, sad, sbp, c, s, m0, m1, t0, nt);
  }
}

// A's packed values: a buffer the calling thread keeps between calls (the packers write every element, padding
// included, so it is never cleared), up to kScratchBytes; a larger A gets a buffer of its own for the call. A fresh
// buffer per call costs a page fault and a zeroing per 4 KB page (glibc hands blocks this large back to the system
// when they are freed): at the tiny model's shapes up to half of the op's time, and it varied from call to call.
constexpr size_t kScratchBytes = size_t(64) << 20;

Value* a_buffer(const Shape& s, std::unique_ptr<Value[]>& own) {
  static thread_local std::unique_ptr<Value[]> kept;
  static thread_local size_t kept_size = 0;
  const size_t need = static_cast<size_t>(s.m * s.kp);
  if (need * sizeof(Value) > kScratchBytes) {
    own.reset(new Value[need]);  // default-initialized: no zeroing pass
    return own.get();
  }
  if (kept_size < need) {
    kept.reset(new Value[need]);
    kept_size = need;
  }
  return kept.get();
}

}  // namespace

// C = A @ B.T from A's uint8 codes [M, K] (any strides) + a_scale float32 [M, nkb] and B packed by fp8_pack.
at::Tensor fp8_gemm_packed(const at::Tensor& a, int64_t a_fmt, const at::Tensor& a_scale, const at::Tensor& b_values,
                           const at::Tensor& b_scales, int64_t n, int64_t block) {
  TORCH_CHECK(a.device().is_cpu() && a.scalar_type() == at::kByte && a.dim() == 2, "fp8_gemm: uint8 CPU codes [M, K]");
  const Shape s = shape_of(a.size(0), n, a.size(1), block);
  const auto sa = rows_scales(a_scale, s.m, s.nkb, "a_scale");
  check_packed(s, b_values, b_scales);
  if (s.m == 0 || s.n == 0 || s.nkb == 0) return at::zeros({s.m, s.n}, a.options().dtype(at::kFloat));
  auto out = at::empty({s.m, s.n}, a.options().dtype(at::kFloat));  // every element is written by its micro call
  std::unique_ptr<Value[]> own;
  Value* apd = a_buffer(s, own);
  pack_a(a.data_ptr<uint8_t>(), a.stride(0), a.stride(1), fmt_index(a_fmt), s, apd);
  run_gemm(apd, sa.data_ptr<float>(), b_values, b_scales, s, out.data_ptr<float>());
  return out;
}

// The linear's GEMM from unquantized activations: x float32 / bfloat16 [M, K] quantized along K in groups of the
// GEMM's K block (group128 for block 128, rowwise for a block of all of K) straight into A's packed layout
// (pack_a_quantized), then C = A @ B.T with B packed by fp8_pack. Returns (C float32 [M, N], the scales float32
// [M, nkb], the largest |x| float32 []): the codes and scales of quantize(x) and the result of fp8_gemm_packed on
// them, bit for bit.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_quant_gemm_packed(const at::Tensor& x, int64_t a_fmt, bool pow2,
                                                                     const at::Tensor& b_values,
                                                                     const at::Tensor& b_scales, int64_t n,
                                                                     int64_t block) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous()
              && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "fp8_quant_gemm_packed: x must be a contiguous float32 / bfloat16 CPU tensor [M, K]");
  const Shape s = shape_of(x.size(0), n, x.size(1), block);
  check_packed(s, b_values, b_scales);
  const auto fopt = x.options().dtype(at::kFloat);
  auto sa = at::empty({s.m, s.nkb}, fopt);
  auto amax = at::zeros({}, fopt);
  if (s.m == 0 || s.n == 0 || s.nkb == 0) return {at::zeros({s.m, s.n}, fopt), sa.zero_(), amax};
  const int fmt = fmt_index(a_fmt);
  const Fmt f = fmt == 0 ? Fmt{448.0f, 3, -9} : Fmt{57344.0f, 2, -16};
  std::unique_ptr<Value[]> own;
  Value* apd = a_buffer(s, own);
  const uint32_t am = x.scalar_type() == at::kFloat
      ? pack_a_quantized<float>(x.data_ptr<float>(), f, pow2, s, apd, sa.data_ptr<float>())
      : pack_a_quantized<at::BFloat16>(x.data_ptr<at::BFloat16>(), f, pow2, s, apd, sa.data_ptr<float>());
  amax.fill_(u2f(am));
  auto out = at::empty({s.m, s.n}, fopt);
  run_gemm(apd, sa.data_ptr<float>(), b_values, b_scales, s, out.data_ptr<float>());
  return {out, sa, amax};
}

// a: uint8 codes [M, K] (any strides), b: uint8 codes [N, K]; a_scale float32 [M, nkb], b_scale float32 [N, nkb]
// (per row and K block, nkb = ceil(K / block)). Returns float32 [M, N] (contiguous). B is packed for this call.
at::Tensor fp8_gemm(const at::Tensor& a, int64_t a_fmt, const at::Tensor& a_scale, const at::Tensor& b,
                    int64_t b_fmt, const at::Tensor& b_scale, int64_t block) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1), "fp8_gemm: need a [M, K] and b [N, K], got ",
              a.sizes(), " and ", b.sizes());
  auto packed = fp8_pack(b, b_fmt, b_scale, block);
  return fp8_gemm_packed(a, a_fmt, a_scale, std::get<0>(packed), std::get<1>(packed), b.size(0), block);
}

std::string fp8_gemm_path() { return kPath; }
int64_t fp8_gemm_lanes() { return kLanes; }

TORCH_LIBRARY(fp8core, m) {
  m.def("fp8_gemm(Tensor a, int a_fmt, Tensor a_scale, Tensor b, int b_fmt, Tensor b_scale, int block) -> Tensor");
  m.def("fp8_pack(Tensor b, int b_fmt, Tensor b_scale, int block) -> (Tensor, Tensor)");
  m.def("fp8_gemm_packed(Tensor a, int a_fmt, Tensor a_scale, Tensor b_values, Tensor b_scales, int n, int block) "
        "-> Tensor");
  m.def("fp8_quant_gemm_packed(Tensor x, int a_fmt, bool pow2, Tensor b_values, Tensor b_scales, int n, int block) "
        "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fp8core, CPU, m) {
  m.impl("fp8_gemm", &fp8_gemm);
  m.impl("fp8_pack", &fp8_pack);
  m.impl("fp8_gemm_packed", &fp8_gemm_packed);
  m.impl("fp8_quant_gemm_packed", &fp8_quant_gemm_packed);
}
