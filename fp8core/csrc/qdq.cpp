// Fused FP8 quantize -> dequantize for the CPU emulation (fp8core.kernels loads this with torch's cpp_extension).
//
// One pass per group instead of ~12 torch ops: amax of the group, scale = max(amax / fp8_max, 2**-126) (rounded
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
// Layouts: ``rows``: x [M, K], groups of ``group`` consecutive elements along K (group128: 128; rowwise: K).
//          ``cols``: x [T, K], groups of ``group`` consecutive rows of one column (group128: 128; rowwise: T).
// Inputs float32 or bfloat16 (contiguous); output float32. Parallel over row blocks with at::parallel_for (the
// caller decides the thread count).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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

template <typename T>
void rows_kernel(const T* x, float* out, float* amax_out, int64_t m, int64_t k, int64_t group, Fmt f, bool pow2) {
  const int64_t g = (k + group - 1) / group;
  const float c = std::ldexp(1.5f, f.min_exp + 23);
  const float thr = std::ldexp(1.0f, f.min_exp + f.mbits);
  const int shift = 23 - f.mbits;
  const uint32_t half = (1u << (shift - 1)) - 1u, mask = ~((1u << shift) - 1u);
  const float mx = f.fp8_max;
  at::parallel_for(0, m, std::max<int64_t>(1, 65536 / std::max<int64_t>(k, 1)), [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(static_cast<size_t>(std::min<int64_t>(group, k)));
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * k;
      float* orow = out + r * k;
      for (int64_t gi = 0; gi < g; ++gi) {
        const int64_t c0 = gi * group, n = std::min(group, k - c0);
        float* v = buf.data();
        uint32_t am = 0;
        for (int64_t j = 0; j < n; ++j) {
          v[j] = load<T>(xr, c0 + j);
          const uint32_t a = f2u(v[j]) & 0x7FFFFFFFu;
          am = a > am ? a : am;
        }
        amax_out[r * g + gi] = u2f(am);
        const float s = scale_of(am, f, pow2);
        float* o = orow + c0;
        for (int64_t j = 0; j < n; ++j) {
          float b = v[j] / s;
          b = b > mx ? mx : (b < -mx ? -mx : b);
          const uint32_t u = f2u(b);
          const float nrm = u2f((u + half + ((u >> shift) & 1u)) & mask);
          const float ab = std::fabs(b);
          const float sub = std::copysign((ab + c) - c, b);
          o[j] = (ab < thr ? sub : nrm) * s;
        }
      }
    }
  });
}

template <typename T>
void cols_kernel(const T* x, float* out, float* amax_out, int64_t t, int64_t k, int64_t group, Fmt f, bool pow2) {
  const int64_t nb = (t + group - 1) / group;
  const float c = std::ldexp(1.5f, f.min_exp + 23);
  const float thr = std::ldexp(1.0f, f.min_exp + f.mbits);
  const int shift = 23 - f.mbits;
  const uint32_t half = (1u << (shift - 1)) - 1u, mask = ~((1u << shift) - 1u);
  const float mx = f.fp8_max;
  // parallel over row blocks when there are several, else over column ranges
  const bool by_blocks = nb >= 2;
  auto block = [&](int64_t b, int64_t k0, int64_t k1) {
    const int64_t r0 = b * group, r1 = std::min(t, r0 + group);
    std::vector<uint32_t> am(static_cast<size_t>(k1 - k0), 0u);
    std::vector<float> s(static_cast<size_t>(k1 - k0));
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * k;
      for (int64_t j = k0; j < k1; ++j) {
        const uint32_t a = f2u(load<T>(xr, j)) & 0x7FFFFFFFu;
        am[j - k0] = a > am[j - k0] ? a : am[j - k0];
      }
    }
    for (int64_t j = k0; j < k1; ++j) {
      amax_out[b * k + j] = u2f(am[j - k0]);
      s[j - k0] = scale_of(am[j - k0], f, pow2);
    }
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * k;
      float* o = out + r * k;
      for (int64_t j = k0; j < k1; ++j) {
        const float sj = s[j - k0];
        float bv = load<T>(xr, j) / sj;
        bv = bv > mx ? mx : (bv < -mx ? -mx : bv);
        const uint32_t u = f2u(bv);
        const float nrm = u2f((u + half + ((u >> shift) & 1u)) & mask);
        const float ab = std::fabs(bv);
        const float sub = std::copysign((ab + c) - c, bv);
        o[j] = (ab < thr ? sub : nrm) * sj;
      }
    }
  };
  if (by_blocks) {
    at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) block(b, 0, k);
    });
  } else {
    at::parallel_for(0, k, 256, [&](int64_t k0, int64_t k1) { block(0, k0, k1); });
  }
}

std::vector<torch::Tensor> qdq(torch::Tensor x, int64_t group, bool columns, double fp8_max, int64_t mbits,
                               int64_t min_exp, bool pow2) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "qdq: x must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "qdq: x must be float32 or bfloat16");
  TORCH_CHECK(group > 0, "qdq: group must be positive");
  const int64_t m = x.size(0), k = x.size(1);
  auto out = torch::empty({m, k}, x.options().dtype(at::kFloat));
  const int64_t ng = columns ? (m + group - 1) / group : (k + group - 1) / group;
  auto amax = columns ? torch::empty({ng, k}, out.options()) : torch::empty({m, ng}, out.options());
  if (m == 0 || k == 0) return {out, amax};
  const Fmt f{static_cast<float>(fp8_max), static_cast<int>(mbits), static_cast<int>(min_exp)};
  if (x.scalar_type() == at::kFloat) {
    if (columns) cols_kernel<float>(x.data_ptr<float>(), out.data_ptr<float>(), amax.data_ptr<float>(), m, k, group, f, pow2);
    else rows_kernel<float>(x.data_ptr<float>(), out.data_ptr<float>(), amax.data_ptr<float>(), m, k, group, f, pow2);
  } else {
    auto* xp = x.data_ptr<at::BFloat16>();
    if (columns) cols_kernel<at::BFloat16>(xp, out.data_ptr<float>(), amax.data_ptr<float>(), m, k, group, f, pow2);
    else rows_kernel<at::BFloat16>(xp, out.data_ptr<float>(), amax.data_ptr<float>(), m, k, group, f, pow2);
  }
  return {out, amax};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("qdq", &qdq, "fused FP8 quantize-dequantize (rows or columns groups)");
}
