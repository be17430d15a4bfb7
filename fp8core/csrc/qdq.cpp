// Fused FP8 quantize -> dequantize for the CPU emulation (fp8core.kernels loads this with torch's cpp_extension).
//
// One pass per group instead of ~12 torch ops, with the same IEEE FP32 operations as fp8core.quant's torch path, so
// results are bit-identical to it (tested); the per-group arithmetic and its rounding rules are in quant.h.
//
// Groups are tiles of gr x gc elements of a row-major [M, K] tensor (see tile_kernel). Inputs float32 or bfloat16
// (contiguous); dequantized output float32. Parallel over row blocks with at::parallel_for (the caller decides the
// thread count).
#include "quant.h"

#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline uint32_t max_u32(const uint32_t* __restrict p, int64_t n) {
  uint32_t m = 0;
  for (int64_t j = 0; j < n; ++j) m = p[j] > m ? p[j] : m;
  return m;
}

// One kernel for every granularity: groups are tiles of ``gr`` rows x ``gc`` columns of a row-major [M, K] tensor
// (group128 along K: 1 x 128; rowwise: 1 x K; along T (wgrad operands): 128 x 1 or T x 1; block128: 128 x 128;
// tensorwise: M x K). Each block of ``gr`` rows is read twice: once for the column-wise |x| maxima (reduced to the
// tiles' amax), once to divide, clamp, round and write the dequantized values and/or the FP8 codes.
template <typename T>
void tile_kernel(const T* x, float* dq, uint8_t* codes, float* amax_out, float* scale_out, int64_t m, int64_t k,
                 int64_t gr, int64_t gc, Fmt f, bool pow2) {
  const int64_t nrb = (m + gr - 1) / gr, ncg = (k + gc - 1) / gc;
  const Consts cst = consts_of(f);
  float* dq_ = dq;
  uint8_t* codes_ = codes;
  // One block of gr rows; acc / sv are the calling thread's buffers (K elements each).
  auto block = [&](int64_t rb, uint32_t* acc, float* sv) {
    const int64_t r0 = rb * gr, r1 = std::min(m, r0 + gr);
    if (gr > 1) {  // column-wise maxima over the block's rows first
      std::fill(acc, acc + k, 0u);
      for (int64_t r = r0; r < r1; ++r) col_absmax<T>(x + r * k, acc, k);
    }
    for (int64_t g = 0; g < ncg; ++g) {
      const int64_t c0 = g * gc, c1 = std::min(k, c0 + gc);
      const uint32_t am = gr > 1 ? max_u32(acc + c0, c1 - c0) : absmax_bits<T>(x + r0 * k + c0, c1 - c0);
      const float s = scale_of(am, f, pow2);
      amax_out[rb * ncg + g] = u2f(am);
      scale_out[rb * ncg + g] = s;
      std::fill(sv + c0, sv + c1, s);
    }
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t off = r * k;
      if (dq_ && codes_) row_loop<T, true, true>(x + off, sv, dq_ + off, codes_ + off, k, cst);
      else if (dq_) row_loop<T, true, false>(x + off, sv, dq_ + off, nullptr, k, cst);
      else row_loop<T, false, true>(x + off, sv, nullptr, codes_ + off, k, cst);
    }
  };
  auto run = [&](int64_t b0, int64_t b1) {
    std::vector<uint32_t> acc(gr > 1 ? static_cast<size_t>(k) : 0u);
    std::vector<float> sv(static_cast<size_t>(k));
    for (int64_t b = b0; b < b1; ++b) block(b, acc.data(), sv.data());
  };
  if (nrb >= 2) {
    at::parallel_for(0, nrb, std::max<int64_t>(1, 65536 / std::max<int64_t>(gr * k, 1)), run);
  } else {
    run(0, 1);
  }
}

// x [M, K] -> (dequantized FP32 [M, K] or empty, FP8 codes uint8 [M, K] or empty, amax, scale [ceil(M/gr), ceil(K/gc)])
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_tiles(const at::Tensor& x, int64_t gr, int64_t gc, double fp8_max, int64_t mbits,
                                          int64_t min_exp, bool pow2, bool want_dq, bool want_codes) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "quantize_tiles: x must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quantize_tiles: x must be float32 or bfloat16");
  TORCH_CHECK(gr > 0 && gc > 0, "quantize_tiles: tile sizes must be positive");
  TORCH_CHECK(mbits == 3 || mbits == 2, "quantize_tiles: mbits must be 3 (e4m3) or 2 (e5m2)");
  const int64_t m = x.size(0), k = x.size(1);
  auto fopt = x.options().dtype(at::kFloat);
  auto dq = want_dq ? at::empty({m, k}, fopt) : at::empty({0}, fopt);
  auto codes = want_codes ? at::empty({m, k}, x.options().dtype(at::kByte)) : at::empty({0}, x.options().dtype(at::kByte));
  const int64_t nrb = (m + gr - 1) / gr, ncg = (k + gc - 1) / gc;
  auto amax = at::empty({nrb, ncg}, fopt);
  auto scale = at::empty({nrb, ncg}, fopt);
  if (m == 0 || k == 0) return {dq, codes, amax, scale};
  const Fmt f{static_cast<float>(fp8_max), static_cast<int>(mbits), static_cast<int>(min_exp)};
  float* dqp = want_dq ? dq.data_ptr<float>() : nullptr;
  uint8_t* qp = want_codes ? codes.data_ptr<uint8_t>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    tile_kernel<float>(x.data_ptr<float>(), dqp, qp, amax.data_ptr<float>(), scale.data_ptr<float>(), m, k, gr, gc, f, pow2);
  } else {
    tile_kernel<at::BFloat16>(x.data_ptr<at::BFloat16>(), dqp, qp, amax.data_ptr<float>(), scale.data_ptr<float>(), m, k,
                              gr, gc, f, pow2);
  }
  return {dq, codes, amax, scale};
}

}  // namespace

std::string fp8_gemm_path();  // gemm.cpp: the GEMM path this build compiled
int64_t fp8_gemm_lanes();  // gemm.cpp: output columns per packed tile

// How many threads at::parallel_for runs this build's loops on: ATen's OpenMP backend expands the parallel region
// inside the extension's own code, so a build without -fopenmp runs every kernel of this file and gemm.cpp on one
// thread, whatever torch.get_num_threads() says. 64 items of a little work each; the distinct thread ids counted.
int64_t parallel_width() {
  std::vector<int> seen(64, -1);
  at::parallel_for(0, 64, 1, [&](int64_t lo, int64_t hi) {
    volatile double sink = 0;
    for (int64_t i = lo; i < hi; ++i) {
      for (int j = 0; j < 20000; ++j) sink = sink + j;
      seen[i] = at::get_thread_num();
    }
  });
  std::sort(seen.begin(), seen.end());
  return std::unique(seen.begin(), seen.end()) - seen.begin();
}

// Registered as operators of the library gemm.cpp defines (torch.ops.fp8core.*): the build needs only ATen's and the
// operator library's headers, not torch/extension.h's Python bindings (which tripled each file's compile time).
TORCH_LIBRARY_FRAGMENT(fp8core, m) {
  m.def("quantize_tiles(Tensor x, int gr, int gc, float fp8_max, int mbits, int min_exp, bool pow2, bool want_dq, "
        "bool want_codes) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("fp8_gemm_path() -> str", &fp8_gemm_path);
  m.def("fp8_gemm_lanes() -> int", &fp8_gemm_lanes);
  m.def("parallel_width() -> int", &parallel_width);
}

TORCH_LIBRARY_IMPL(fp8core, CPU, m) { m.impl("quantize_tiles", &quantize_tiles); }
