// Float matmuls on CPU for GGUF's F16 and BF16 weights, read as the file holds them (2 bytes a
// weight): y (M, N) = x (M, K) @ w (N, K)^T in float32, x float32 as it comes (not quantized).
//
// Weights in tiles of 16 output rows: packed (ceil(N / 16), K, 16) int16, element [t, k, j] the
// bits of w[16t + j, k] (fp16, or bf16: a float32's top half), rows past N zero. Per tile and pass
// of up to 8 (AVX-512) or 4 (AVX2) activation rows, k runs in order and each row keeps its 16
// sums in one register (two on AVX2): a row gets the same bits in any batch. Tiles are split over
// torch's intra-op threads.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

namespace pagoda_cpu {
namespace {

constexpr int64_t ROWS = 16;
constexpr int MAX_M_AVX512 = 8;
constexpr int MAX_M_AVX2 = 4;

#define PAGODA_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")))
#define PAGODA_AVX2 __attribute__((target("avx2,fma,f16c")))

// One pass: activation rows [0, M) of x and where their 16 outputs go.
struct FloatPass {
  const float* x;  // row r at x + r * k
  int64_t k;
  float* y;  // row r at y + r * ldy
  int64_t ldy;
  int64_t valid;  // outputs of the tile that exist
};

template <bool kBf16>
PAGODA_AVX512 inline __m512 weights_x16(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (kBf16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  } else {
    return _mm512_cvtph_ps(bits);
  }
}

template <int M, bool kBf16>
PAGODA_AVX512 void tile_avx512(const uint16_t* tile, const FloatPass& p) {
  __m512 acc[M];
  for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < p.k; ++k) {
    const __m512 w = weights_x16<kBf16>(tile + ROWS * k);
    for (int r = 0; r < M; ++r) acc[r] = _mm512_fmadd_ps(w, _mm512_set1_ps(p.x[r * p.k + k]), acc[r]);
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << p.valid) - 1u);
  for (int r = 0; r < M; ++r) _mm512_mask_storeu_ps(p.y + r * p.ldy, keep, acc[r]);
}

template <bool kBf16>
PAGODA_AVX2 inline __m256 weights_x8(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (kBf16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  } else {
    return _mm256_cvtph_ps(bits);
  }
}

template <int M, bool kBf16>
PAGODA_AVX2 void tile_avx2(const uint16_t* tile, const FloatPass& p) {
  __m256 acc[M][2];
  for (int r = 0; r < M; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < p.k; ++k) {
    const __m256 w0 = weights_x8<kBf16>(tile + ROWS * k);
    const __m256 w1 = weights_x8<kBf16>(tile + ROWS * k + 8);
    for (int r = 0; r < M; ++r) {
      const __m256 xk = _mm256_set1_ps(p.x[r * p.k + k]);
      acc[r][0] = _mm256_fmadd_ps(w0, xk, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, xk, acc[r][1]);
    }
  }
  for (int r = 0; r < M; ++r) {
    store_half(p.y + r * p.ldy, p.valid, acc[r][0]);
    store_half(p.y + r * p.ldy + 8, p.valid - 8, acc[r][1]);
  }
}

inline float weight_scalar(uint16_t bits, bool bf16) {
  if (bf16) {
    const uint32_t word = static_cast<uint32_t>(bits) << 16;
    float w;
    std::memcpy(&w, &word, 4);
    return w;
  }
  return fp16(reinterpret_cast<const uint8_t*>(&bits));
}

// The vector paths' order of operations: per output, a fused multiply-add per k, in order.
void tile_scalar(const uint16_t* tile, const FloatPass& p, int m, bool bf16) {
  for (int r = 0; r < m; ++r) {
    for (int64_t j = 0; j < p.valid; ++j) {
      float sum = 0.f;
      for (int64_t k = 0; k < p.k; ++k) {
        sum = std::fma(weight_scalar(tile[ROWS * k + j], bf16), p.x[r * p.k + k], sum);
      }
      p.y[r * p.ldy + j] = sum;
    }
  }
}

template <bool kBf16>
void run_tile(const uint16_t* tile, const FloatPass& p, int m, Isa isa) {
  if (isa == Isa::kVnni) {
    with_rows<MAX_M_AVX512>(m, [&](auto rows) { tile_avx512<decltype(rows)::value, kBf16>(tile, p); });
  } else if (isa == Isa::kAvx2) {
    with_rows<MAX_M_AVX2>(m, [&](auto rows) { tile_avx2<decltype(rows)::value, kBf16>(tile, p); });
  } else {
    tile_scalar(tile, p, m, kBf16);
  }
}

// packed: (ceil(n / 16), K, 16) int16, the tiles described at the top; bf16: its bits are bf16
// (else fp16)
at::Tensor f16x16_matmul(const at::Tensor& x_in, const at::Tensor& packed, int64_t n,
                         int64_t isa_limit, bool bf16) {
  TORCH_CHECK(x_in.dim() == 2, "x must be (M, K)");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0), k = x.size(1), tiles = (n + ROWS - 1) / ROWS;
  TORCH_CHECK(packed.dtype() == at::kShort && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == tiles && packed.size(1) == k && packed.size(2) == ROWS,
              "packed shape: expected contiguous int16 (", tiles, ", ", k, ", 16) for N=", n,
              ", K=", k, ", got ", packed.sizes());
  const Isa isa = pick_isa(isa_limit);
  const int64_t per_pass = isa == Isa::kVnni ? MAX_M_AVX512 : MAX_M_AVX2;
  auto y = at::empty({m, n}, at::kFloat);
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<int16_t>());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* tile = w + t * k * ROWS;
      for (int64_t r = 0; r < m; r += per_pass) {
        const FloatPass pass{xp + r * k, k, yp + r * n + t * ROWS, n, std::min(ROWS, n - t * ROWS)};
        const int rows = static_cast<int>(std::min(per_pass, m - r));
        bf16 ? run_tile<true>(tile, pass, rows, isa) : run_tile<false>(tile, pass, rows, isa);
      }
    }
  });
  return y;
}

}  // namespace
}  // namespace pagoda_cpu

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("f16x16_matmul(Tensor x, Tensor packed, int n, int isa_limit, bool bf16) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) { m.impl("f16x16_matmul", &pagoda_cpu::f16x16_matmul); }
