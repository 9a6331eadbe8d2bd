// What the CPU kernels share: the instruction set picked at run time, and activations quantized
// per 32-wide group to int8 (as GGUF's Q8 activations): x[m, k] ~ xd[m, g] * q[m, k], with
// xs[m, g] = xd[m, g] * qsum[m, g] and qsum the group's sum of codes.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <type_traits>

namespace pagoda_cpu {

constexpr int64_t GROUP = 32;

enum class Isa { kScalar = 0, kAvx2 = 1, kVnni = 2 };

// The cap ATEN_CPU_CAPABILITY sets (torch's own switch, which also caps torch's kernels and the
// code torch.compile generates): "default" scalar, "avx2" AVX2 + FMA; unset or any other value,
// no cap. Read once, with the CPU's features, at the first call.
inline Isa capability_cap() {
  const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
  if (cap != nullptr && std::strcmp(cap, "default") == 0) return Isa::kScalar;
  if (cap != nullptr && std::strcmp(cap, "avx2") == 0) return Isa::kAvx2;
  return Isa::kVnni;
}

inline Isa best_isa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    Isa found = Isa::kScalar;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
      found = Isa::kAvx2;
      if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")) {
        found = Isa::kVnni;
      }
    }
    return std::min(found, capability_cap());
  }();
  return isa;
}

// The best instruction set, capped at isa_limit (0 scalar, 1 AVX2 + FMA, 2 AVX-512 VNNI).
inline Isa pick_isa(int64_t isa_limit) {
  return static_cast<Isa>(std::min<int64_t>(static_cast<int64_t>(best_isa()), isa_limit));
}

inline float fp16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline void quantize_group_scalar(const float* src, int8_t* q, float* xd, float* xs,
                                  int32_t* qsum) {
  float amax = 0.f;
  for (int j = 0; j < GROUP; ++j) amax = std::max(amax, std::fabs(src[j]));
  const float d = amax / 127.f;
  const float inv = d > 0.f ? 1.f / d : 0.f;
  int sum = 0;
  for (int j = 0; j < GROUP; ++j) {
    const int v = static_cast<int>(std::nearbyint(src[j] * inv));
    q[j] = static_cast<int8_t>(v);
    sum += v;
  }
  *xd = d;
  *xs = d * static_cast<float>(sum);
  *qsum = sum;
}

// The scalar path's arithmetic (x * (1 / d), rounded to nearest even), 32 values at a time.
__attribute__((target("avx2,fma"))) inline void quantize_group_avx2(const float* src, int8_t* q,
                                                                    float* xd, float* xs,
                                                                    int32_t* qsum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(src + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  const float d = _mm_cvtss_f32(m) / 127.f;
  const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  __m256i c[4];
  for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  // packs interleave 128-bit lanes; the permute puts the 32 values back in order
  const __m256i p16a = _mm256_packs_epi32(c[0], c[1]);
  const __m256i p16b = _mm256_packs_epi32(c[2], c[3]);
  const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  const __m256i ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
  *xd = d;
  *qsum = _mm_cvtsi128_si32(s);
  *xs = d * static_cast<float>(*qsum);
}

// ---- exp(x) for x <= 0 (scores minus their max, -|x| for a sigmoid) --------------------------

// A weight below exp(-44) (2^-63) is taken as 0: next to the max score's weight of 1 it is far
// below float32 rounding, and its products with values would be denormal floats, which cost
// the CPU some hundred cycles each (peaked attention, e.g. on a sink token, has many).
constexpr float MIN_EXPONENT = -44.f;

inline float exp_nonpositive(float x) { return x >= MIN_EXPONENT ? std::exp(x) : 0.f; }

// exp(x) for x <= 0 (scores minus their max): 2^(x log2 e) as 2^round * a degree-6 polynomial
// of the remainder (relative error about 2e-7); 0 below MIN_EXPONENT.
__attribute__((target("avx2,fma"))) inline __m256 exp_nonpositive_avx2(__m256 x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(MIN_EXPONENT)), _mm256_set1_ps(1.44269504089f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.69314718056f));  // |f| <= ln2/2
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_and_ps(r, _mm256_cmp_ps(x, _mm256_set1_ps(MIN_EXPONENT), _CMP_GE_OQ));
}

// exp_nonpositive_avx2's per-lane arithmetic, sixteen lanes at a time.
__attribute__((target("avx2,fma,avx512f,avx512dq,avx512vl"))) inline __m512 exp_nonpositive_avx512(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(MIN_EXPONENT)), _mm512_set1_ps(1.44269504089f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718056f));
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 r = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(MIN_EXPONENT), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(keep, r);
}

// Groups of 32 activations below which quantize (and quant_gemm's sums per 16) run on the
// calling thread: a decode step's rows, where waking the pool costs more than the work.
constexpr int64_t QUANTIZE_GRAIN = 512;

struct Activations {
  at::Tensor q, xd, xs, qsum;  // (M, K) int8, (M, K / 32) float32 twice, (M, K / 32) int32
};

// x: contiguous float32 (M, K), K a multiple of 32
inline Activations quantize(const at::Tensor& x, Isa isa) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / GROUP;
  Activations a{at::empty({m, k}, at::kChar), at::empty({m, groups}, at::kFloat),
                at::empty({m, groups}, at::kFloat), at::empty({m, groups}, at::kInt)};
  const float* src = x.data_ptr<float>();
  int8_t* q = a.q.data_ptr<int8_t>();
  float* xd = a.xd.data_ptr<float>();
  float* xs = a.xs.data_ptr<float>();
  int32_t* qsum = a.qsum.data_ptr<int32_t>();
  // Groups are independent: a prefill chunk's split over torch's threads (a single-threaded
  // pass took 17% of a 2,048-row call's time at K = 1,536); calls of fewer than
  // QUANTIZE_GRAIN groups (decode steps) run inline.
  at::parallel_for(0, m * groups, QUANTIZE_GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (isa != Isa::kScalar) {
        quantize_group_avx2(src + i * GROUP, q + i * GROUP, xd + i, xs + i, qsum + i);
      } else {
        quantize_group_scalar(src + i * GROUP, q + i * GROUP, xd + i, xs + i, qsum + i);
      }
    }
  });
  return a;
}

// row_ops.cpp: the norm and the activation quant_gemm.cpp runs before its matmuls
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t isa_limit);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x,
                                                const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps,
                                                int64_t isa_limit);
at::Tensor silu_and_mul(const at::Tensor& x, int64_t isa_limit);
// silu_and_mul's float32 arithmetic on d values (out = silu(g) * u): each value's bits depend on
// its place in 16 (AVX-512) or 8 (AVX2) only, so a row's slices at multiples of 16 give the
// whole row's bits
void silu_mul(const float* g, const float* u, int64_t d, float* out, Isa isa);

inline void check_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "x must be (M, K)");
  TORCH_CHECK(x.size(1) % GROUP == 0, "K must be a multiple of 32, got ", x.size(1));
}

inline at::Tensor float_rows(const at::Tensor& x) {
  check_rows(x);
  return x.to(at::kFloat).contiguous();
}

// The first `valid` of 8 outputs (a tile's 8-row half on AVX2; none where valid <= 0).
__attribute__((target("avx2,fma"))) inline void store_half(float* y, int64_t valid, __m256 v) {
  if (valid >= 8) {
    _mm256_storeu_ps(y, v);
  } else if (valid > 0) {
    float tmp[8];
    _mm256_storeu_ps(tmp, v);
    std::memcpy(y, tmp, valid * sizeof(float));
  }
}

// Calls fn(std::integral_constant<int, M>) for M = m (1 .. Max): a tile function's pass of m
// activation rows, M a compile-time constant (its accumulators stay in registers).
template <int Max, typename Fn>
void with_rows(int m, Fn&& fn) {
  static_assert(Max == 4 || Max == 8);
  switch (m) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    default:
      if constexpr (Max == 8) {
        switch (m) {
          case 5: fn(std::integral_constant<int, 5>{}); break;
          case 6: fn(std::integral_constant<int, 6>{}); break;
          case 7: fn(std::integral_constant<int, 7>{}); break;
          default: fn(std::integral_constant<int, 8>{}); break;
        }
      }
  }
}

}  // namespace pagoda_cpu
