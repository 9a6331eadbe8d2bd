// Quantized matmuls for the CPU decode path: y (M, N) = x (M, K) @ w (N, K)^T with w kept as
// 32-wide groups of integer codes, w[n, k] = scale[n, g] * code[n, k] + offset[n, g] (g = k / 32),
// and x quantized per 32-wide group to int8 (as GGUF's Q8 activations): x[m, k] ~ xd[m, g] * q.
//
//   y[m, n] = sum_g scale[n, g] * xd[m, g] * dot(code[n, g], q[m, g]) + offset[n, g] * xs[m, g]
//
// with xs[m, g] = xd[m, g] * sum(q[m, g]). Integer dot products of 32 codes at a time: AVX2
// (maddubs + madd) or AVX-512 VNNI (dpbusd on 256-bit lanes), chosen at run time; a scalar path
// elsewhere. Output rows are split over torch's intra-op threads; each weight group is read once
// per tile of up to 4 activation rows.
//
// 4-bit codes (0..15) are packed GGUF's way: 16 bytes per group, byte j = code[j] | code[j+16] << 4.
// 8-bit codes are int8 (-128..127; Q8_0's), offsets none.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t TILE = 4;  // activation rows per pass over the weights

// ---- activations -----------------------------------------------------------------------------

void quantize_rows(const float* x, int64_t m, int64_t k, int8_t* q, float* xd, float* xs) {
  const int64_t groups = k / GROUP;
  for (int64_t i = 0; i < m * groups; ++i) {
    const float* src = x + i * GROUP;
    float amax = 0.f;
    for (int j = 0; j < GROUP; ++j) amax = std::max(amax, std::fabs(src[j]));
    const float d = amax / 127.f;
    const float inv = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int j = 0; j < GROUP; ++j) {
      const int v = static_cast<int>(std::nearbyint(src[j] * inv));
      q[i * GROUP + j] = static_cast<int8_t>(v);
      sum += v;
    }
    xd[i] = d;
    xs[i] = d * static_cast<float>(sum);
  }
}

// ---- scalar ----------------------------------------------------------------------------------

int dot4_scalar(const uint8_t* w, const int8_t* q) {
  int acc = 0;
  for (int j = 0; j < 16; ++j) {
    acc += (w[j] & 0x0F) * q[j] + (w[j] >> 4) * q[j + 16];
  }
  return acc;
}

int dot8_scalar(const int8_t* w, const int8_t* q) {
  int acc = 0;
  for (int j = 0; j < GROUP; ++j) acc += w[j] * q[j];
  return acc;
}

// ---- AVX2 / AVX-512 VNNI -------------------------------------------------------------------

// 32 codes of a 4-bit group in order (low nibbles, then high nibbles) as unsigned bytes.
__attribute__((target("avx2"))) inline __m256i unpack4(const uint8_t* w) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(raw, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  return _mm256_set_m128i(hi, lo);
}

// sum over 32 bytes of u[i] * s[i] as 8 int32 lanes
__attribute__((target("avx2"))) inline __m256i dot_u8s8_avx2(__m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);  // |15 * 127 * 2| and |128 * 127 * 2| fit
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

__attribute__((target("avx2,avx512f,avx512vl,avx512vnni"))) inline __m256i dot_u8s8_vnni(
    __m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// One output row for `rows` activation rows (<= TILE), BITS 4 or 8, its integer dot products by
// DOT. Defined twice under different targets (a function compiled for AVX-512 may use it
// anywhere, so the AVX2 one must not be).
#define PAGODA_ROW_SIMD_BODY(DOT)                                                              \
  constexpr int64_t bytes = BITS == 4 ? 16 : 32;                                               \
  __m256 acc[TILE];                                                                            \
  for (int64_t r = 0; r < TILE; ++r) acc[r] = _mm256_setzero_ps();                             \
  for (int64_t g = 0; g < groups; ++g) {                                                       \
    __m256i u;                                                                                 \
    __m256i sign = _mm256_setzero_si256();                                                     \
    if constexpr (BITS == 4) {                                                                 \
      u = unpack4(w + g * bytes);                                                              \
    } else { /* signed codes: |w| as unsigned, its sign moved onto the activations */          \
      sign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * bytes));              \
      u = _mm256_sign_epi8(sign, sign);                                                        \
    }                                                                                          \
    const float sg = scale[g * sstep];                                                         \
    for (int64_t r = 0; r < rows; ++r) {                                                       \
      __m256i s =                                                                              \
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * groups * GROUP + g * GROUP)); \
      if constexpr (BITS == 8) s = _mm256_sign_epi8(s, sign);                                  \
      const __m256i d = DOT(u, s);                                                             \
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(sg * xd[r * groups + g]), \
                               acc[r]);                                                        \
    }                                                                                          \
  }                                                                                            \
  for (int64_t r = 0; r < rows; ++r) {                                                         \
    float sum = hsum(acc[r]);                                                                  \
    if (offset != nullptr) {                                                                   \
      const float* s = xs + r * groups;                                                        \
      for (int64_t g = 0; g < groups; ++g) sum += offset[g] * s[g];                            \
    }                                                                                          \
    y[r * y_stride] = sum;                                                                     \
  }

// Four output rows of 4-bit codes (group scales and offsets) for one activation row (decode):
// four independent accumulators, the activation group loaded once for the four (AVX2).
__attribute__((target("avx2,fma"))) void row4_q4_avx2(const uint8_t* w, const float* scale,
                                                      const float* offset, const int8_t* q,
                                                      const float* xd, const float* xs,
                                                      int64_t groups, float* y) {
  const int64_t wstride = groups * 16;
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * GROUP));
    const __m256 xdv = _mm256_set1_ps(xd[g]);
    for (int j = 0; j < 4; ++j) {
      const __m256i d = dot_u8s8_avx2(unpack4(w + j * wstride + g * 16), s);
      const __m256 sc = _mm256_mul_ps(_mm256_broadcast_ss(scale + j * groups + g), xdv);
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sc, acc[j]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    const float* o = offset + j * groups;
    __m256 t = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
      t = _mm256_fmadd_ps(_mm256_loadu_ps(o + g), _mm256_loadu_ps(xs + g), t);
    }
    float sum = hsum(acc[j]) + hsum(t);
    for (; g < groups; ++g) sum += o[g] * xs[g];
    y[j] = sum;
  }
}

// Four output rows of 4-bit codes for one activation row, two groups per 512-bit step (AVX-512
// VNNI): half the instructions of the 256-bit path per group.
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni"))) void row4_q4_avx512(
    const uint8_t* w, const float* scale, const float* offset, const int8_t* q, const float* xd,
    const float* xs, int64_t groups, float* y) {
  const int64_t wstride = groups * 16;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    const __m512i s = _mm512_loadu_si512(q + g * GROUP);
    const __m512 xdv = _mm512_insertf32x8(_mm512_set1_ps(xd[g]), _mm256_set1_ps(xd[g + 1]), 1);
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * wstride + g * 16));
      const __m256i lo = _mm256_and_si256(v, mask);                          // [lo0 | lo1]
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);   // [hi0 | hi1]
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      const __m512i u = _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));  // lo0 hi0 lo1 hi1
      const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
      const float* sj = scale + j * groups + g;
      const __m512 sc = _mm512_insertf32x8(_mm512_set1_ps(sj[0]), _mm256_set1_ps(sj[1]), 1);
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sc, xdv), acc[j]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    float sum = _mm512_reduce_add_ps(acc[j]);
    const uint8_t* wj = w + j * wstride;
    for (int64_t t = g; t < groups; ++t) {  // an odd last group
      sum += static_cast<float>(dot4_scalar(wj + t * 16, q + t * GROUP)) * (scale[j * groups + t] * xd[t]);
    }
    const float* o = offset + j * groups;
    __m512 ot = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 16 <= groups; t += 16) {
      ot = _mm512_fmadd_ps(_mm512_loadu_ps(o + t), _mm512_loadu_ps(xs + t), ot);
    }
    sum += _mm512_reduce_add_ps(ot);
    for (; t < groups; ++t) sum += o[t] * xs[t];
    y[j] = sum;
  }
}

template <int BITS>
__attribute__((target("avx2,fma"))) void row_avx2(const uint8_t* w, const float* scale,
                                                  const float* offset, const int8_t* q,
                                                  const float* xd, const float* xs, int64_t groups,
                                                  int64_t rows, float* y, int64_t y_stride,
                                                  int64_t sstep) {
  PAGODA_ROW_SIMD_BODY(dot_u8s8_avx2)
}

template <int BITS>
__attribute__((target("avx2,fma,avx512f,avx512vl,avx512vnni"))) void row_vnni(
    const uint8_t* w, const float* scale, const float* offset, const int8_t* q, const float* xd,
    const float* xs, int64_t groups, int64_t rows, float* y, int64_t y_stride, int64_t sstep) {
  PAGODA_ROW_SIMD_BODY(dot_u8s8_vnni)
}

template <int BITS>
void row_scalar(const uint8_t* w, const float* scale, const float* offset, const int8_t* q,
                const float* xd, const float* xs, int64_t groups, int64_t rows, float* y,
                int64_t y_stride, int64_t sstep) {
  constexpr int64_t bytes = BITS == 4 ? 16 : 32;
  for (int64_t r = 0; r < rows; ++r) {
    float sum = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* qg = q + r * groups * GROUP + g * GROUP;
      const int d = BITS == 4 ? dot4_scalar(w + g * bytes, qg)
                              : dot8_scalar(reinterpret_cast<const int8_t*>(w + g * bytes), qg);
      sum += static_cast<float>(d) * (scale[g * sstep] * xd[r * groups + g]);
      if (offset != nullptr) sum += offset[g] * xs[r * groups + g];
    }
    y[r * y_stride] = sum;
  }
}

enum class Isa { kScalar = 0, kAvx2 = 1, kVnni = 2 };

Isa best_isa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")) {
        return Isa::kVnni;
      }
      return Isa::kAvx2;
    }
    return Isa::kScalar;
  }();
  return isa;
}

template <int BITS>
at::Tensor matmul(const at::Tensor& x_in, const at::Tensor& codes,
                     const at::Tensor& scale, const std::optional<at::Tensor>& offset,
                     int64_t isa_limit) {
  TORCH_CHECK(x_in.dim() == 2, "x must be (M, K)");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(k % GROUP == 0, "K must be a multiple of 32, got ", k);
  const int64_t groups = k / GROUP;
  const int64_t bytes = BITS == 4 ? 16 : 32;
  TORCH_CHECK(codes.dtype() == (BITS == 4 ? at::kByte : at::kChar), "codes dtype");
  TORCH_CHECK(codes.is_contiguous() && codes.size(1) == groups * bytes, "codes shape");
  TORCH_CHECK(scale.dtype() == at::kFloat && scale.is_contiguous(), "scale: float32");
  // scale (N, groups), or (N, 1): one scale for a whole row (int8 rows)
  TORCH_CHECK(scale.size(0) == n && (scale.size(1) == groups || scale.size(1) == 1), "scale shape");
  const int64_t sstep = scale.size(1) == 1 ? 0 : 1;
  const float* off = nullptr;
  if (offset.has_value()) {
    TORCH_CHECK(offset->dtype() == at::kFloat && offset->is_contiguous(), "offset");
    TORCH_CHECK(offset->size(0) == n && offset->size(1) == groups, "offset shape");
    off = offset->data_ptr<float>();
  }
  auto q = at::empty({m, k}, at::kChar);
  auto xd = at::empty({m, groups}, at::kFloat);
  auto xs = at::empty({m, groups}, at::kFloat);
  quantize_rows(x.data_ptr<float>(), m, k, q.data_ptr<int8_t>(), xd.data_ptr<float>(),
                xs.data_ptr<float>());
  auto y = at::empty({m, n}, at::kFloat);
  const auto* w = static_cast<const uint8_t*>(codes.data_ptr());
  const float* sc = scale.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* xdp = xd.data_ptr<float>();
  const float* xsp = xs.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const Isa isa = static_cast<Isa>(std::min<int64_t>(static_cast<int64_t>(best_isa()), isa_limit));
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = 0; t < m; t += TILE) {
      const int64_t rows = std::min(TILE, m - t);
      int64_t row = begin;
      // decode of 4-bit codes with group scales and offsets: four output rows at a time
      if (BITS == 4 && rows == 1 && isa != Isa::kScalar && off != nullptr && sstep == 1) {
        for (; row + 4 <= end; row += 4) {
          const uint8_t* wr = w + row * groups * bytes;
          const float* srow = sc + row * groups;
          const float* orow = off + row * groups;
          float* yt = yp + t * n + row;
          if (isa == Isa::kVnni) {
            row4_q4_avx512(wr, srow, orow, qp + t * k, xdp + t * groups, xsp + t * groups,
                           groups, yt);
          } else {
            row4_q4_avx2(wr, srow, orow, qp + t * k, xdp + t * groups, xsp + t * groups,
                         groups, yt);
          }
        }
      }
      for (; row < end; ++row) {
        const uint8_t* wr = w + row * groups * bytes;
        const float* sr = sc + row * scale.size(1);
        const float* orow = off == nullptr ? nullptr : off + row * groups;
        const int8_t* qt = qp + t * k;
        float* yt = yp + t * n + row;
        if (isa == Isa::kVnni) {
          row_vnni<BITS>(wr, sr, orow, qt, xdp + t * groups, xsp + t * groups, groups, rows, yt, n, sstep);
        } else if (isa == Isa::kAvx2) {
          row_avx2<BITS>(wr, sr, orow, qt, xdp + t * groups, xsp + t * groups, groups, rows, yt, n, sstep);
        } else {
          row_scalar<BITS>(wr, sr, orow, qt, xdp + t * groups, xsp + t * groups, groups, rows, yt, n, sstep);
        }
      }
    }
  });
  return y;
}

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& codes,
                        const at::Tensor& scale, const std::optional<at::Tensor>& offset,
                        int64_t isa_limit) {
  return matmul<4>(x, codes, scale, offset, isa_limit);
}

at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& codes,
                        const at::Tensor& scale, int64_t isa_limit) {
  return matmul<8>(x, codes, scale, std::nullopt, isa_limit);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x_in) {
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % GROUP == 0, "K must be a multiple of 32");
  auto q = at::empty({m, k}, at::kChar);
  auto xd = at::empty({m, k / GROUP}, at::kFloat);
  auto xs = at::empty({m, k / GROUP}, at::kFloat);
  quantize_rows(x.data_ptr<float>(), m, k, q.data_ptr<int8_t>(), xd.data_ptr<float>(),
                xs.data_ptr<float>());
  return {q, xd, xs};
}

int64_t isa() { return static_cast<int64_t>(best_isa()); }

}  // namespace

// torch.ops.pagoda_cpu.*: custom ops, so torch.compile keeps them in its graph (their shapes are
// registered in Python, pagoda/kernels/cpu/__init__.py).
TORCH_LIBRARY(pagoda_cpu, m) {
  m.def("q4_matmul(Tensor x, Tensor codes, Tensor scale, Tensor? offset, int isa_limit) -> Tensor");
  m.def("q8_matmul(Tensor x, Tensor codes, Tensor scale, int isa_limit) -> Tensor");
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("isa() -> int", &isa);
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("q4_matmul", &q4_matmul);
  m.impl("q8_matmul", &q8_matmul);
  m.impl("quantize_activations", &quantize_activations);
}
