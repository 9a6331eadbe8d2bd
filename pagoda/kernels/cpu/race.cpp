// The sampler's exponential race for rows without a seed of their own, in one op: each row r of
// logits (R, V) float32 draws token argmax_i w_i / E_i, with w_i = exp((l_i - max l) / T_r) (the
// softmax's numerator: the race needs no normalisation) and E_i = -log(U_i), U_i ~ Uniform(0, 1),
// which picks i with probability softmax(l / T_r)_i (runner/sampler.py's module docstring).
//
//   race_sample(logits, inv_temperature, seed, isa_limit) -> (R,) int64
//     inv_temperature: (R,) float32 1 / T_r, or None for T = 1 (logits already divided and
//     filtered by top-k / top-p / min-p: -inf where dropped, which never wins).
//     seed: a one-element int64 tensor (read here, so the caller reads nothing back).
//
// The noise is counter-based, so no generator is walked serially and the rows split across
// threads: U_i of row r is a function of (seed, r, i) only. Row r's key is mix64(seed + G (r + 1))
// and element i of its block b = i / 16 at lane t = i % 16 reads z = mix64(key + G (8 b + t % 8 +
// 1)) (SplitMix64's output function, G its golden-ratio increment): 23 bits of it (z >> 41 for
// t < 8, z's low 23 bits for t >= 8), as U = (2 bits + 1) / 2^24, the midpoint of one of 2^23
// equal cells, never 0 nor 1. The caller draws `seed` from torch's default generator, so
// torch.manual_seed (and ranks seeded alike) reproduce the tokens.
//
// Scalar, AVX2 and AVX-512 paths compute the same bits: integer noise, the same exp and log
// polynomials (common.h's exp; Cephes' logf polynomial), every multiply-add an explicit fma, and
// a vector path's last partial block padded with -inf (weight 0, never a winner). So a row's
// token is the same on every path. A weight below exp(-44) counts as 0 (common.h), which drops at
// most V 2^-63 of probability. Rows split into CHUNK-sized pieces (a fixed split, whatever the
// threads): each piece's best (score, first index) merges in order, so ties go to the first
// index, as torch's argmax does.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"

namespace pagoda_cpu {
namespace {

#define PAGODA_RACE_AVX512 __attribute__((target("avx2,fma,avx512f,avx512dq,avx512vl")))
#define PAGODA_RACE_AVX2 __attribute__((target("avx2,fma")))

constexpr uint64_t GOLDEN = 0x9E3779B97F4A7C15ull;
constexpr uint64_t MIX1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t MIX2 = 0x94D049BB133111EBull;
constexpr uint64_t LOW23 = (1ull << 23) - 1;
constexpr float TWO_M24 = 1.f / 16777216.f;
constexpr int64_t CHUNK = 8192;  // elements per work item; a multiple of 16

// Cephes' logf: log(1 + x) ~ x - x^2 / 2 + x^3 P(x) for x in [sqrt(1/2) - 1, sqrt(2) - 1)
constexpr float LOG_P[9] = {7.0376836292E-2f,  -1.1514610310E-1f, 1.1676998740E-1f,
                            -1.2420140846E-1f, 1.4249322787E-1f,  -1.6668057665E-1f,
                            2.0000714765E-1f,  -2.4999993993E-1f, 3.3333331174E-1f};
constexpr float LN2_LO = -2.12194440e-4f, LN2_HI = 0.693359375f;
constexpr float SQRT2 = 1.41421356237f;

struct Best {
  float score;    // w / E, > 0; 0 where nothing has won yet
  int64_t index;  // -1 where nothing has won yet
};

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * MIX1;
  z = (z ^ (z >> 27)) * MIX2;
  return z ^ (z >> 31);
}

inline uint64_t row_key(uint64_t seed, int64_t row) {
  return mix64(seed + GOLDEN * static_cast<uint64_t>(row + 1));
}

// ---- scalar: the reference the vector paths match bit for bit ----------------------------------

inline float uniform_scalar(uint64_t key, int64_t i) {
  const uint64_t block = static_cast<uint64_t>(i / 16), lane = static_cast<uint64_t>(i % 16);
  const uint64_t z = mix64(key + GOLDEN * (8 * block + lane % 8 + 1));
  const uint64_t bits = lane < 8 ? z >> 41 : z & LOW23;
  return static_cast<float>(2 * bits + 1) * TWO_M24;
}

// common.h's exp_nonpositive_avx2 lane by lane (std::fma where it fuses)
inline float exp_scalar(float x) {
  const float t = std::max(x, MIN_EXPONENT) * 1.44269504089f;
  const float n = std::nearbyint(t);
  const float f = (t - n) * 0.69314718056f;
  float p = 1.f / 720.f;
  p = std::fma(p, f, 1.f / 120.f);
  p = std::fma(p, f, 1.f / 24.f);
  p = std::fma(p, f, 1.f / 6.f);
  p = std::fma(p, f, 0.5f);
  p = std::fma(p, f, 1.f);
  p = std::fma(p, f, 1.f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return x >= MIN_EXPONENT ? p * scale : 0.f;
}

// -log(u) for u in (0, 1), a normal float
inline float neg_log_scalar(float u) {
  int32_t bits;
  std::memcpy(&bits, &u, 4);
  float e = static_cast<float>((bits >> 23) - 127);
  const int32_t mbits = (bits & 0x7FFFFF) | 0x3F800000;
  float m;
  std::memcpy(&m, &mbits, 4);  // [1, 2)
  if (m > SQRT2) {
    m = m * 0.5f;
    e = e + 1.f;
  }
  const float x = m - 1.f, z = x * x;
  float p = LOG_P[0];
  for (int k = 1; k < 9; ++k) p = std::fma(p, x, LOG_P[k]);
  float y = p * x * z;
  y = std::fma(e, LN2_LO, y);
  y = std::fma(z, -0.5f, y);
  return -std::fma(e, LN2_HI, x + y);
}

float max_scalar(const float* l, int64_t begin, int64_t end) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = begin; i < end; ++i) m = std::max(m, l[i]);
  return m;
}

Best race_scalar(const float* l, int64_t begin, int64_t end, float m, float inv_t, uint64_t key) {
  Best best{0.f, -1};
  for (int64_t i = begin; i < end; ++i) {
    const float score = exp_scalar((l[i] - m) * inv_t) / neg_log_scalar(uniform_scalar(key, i));
    if (score > best.score) best = {score, i};
  }
  return best;
}

// ---- AVX-512 ------------------------------------------------------------------------------------

PAGODA_RACE_AVX512 inline __m512i mix64_avx512(__m512i z) {
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), _mm512_set1_epi64(MIX1));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), _mm512_set1_epi64(MIX2));
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

// U for the 16 elements of block b
PAGODA_RACE_AVX512 inline __m512 uniform_avx512(uint64_t key, int64_t b) {
  const __m512i steps = _mm512_setr_epi64(GOLDEN, 2 * GOLDEN, 3 * GOLDEN, 4 * GOLDEN, 5 * GOLDEN,
                                          6 * GOLDEN, 7 * GOLDEN, 8 * GOLDEN);
  const uint64_t base = key + GOLDEN * 8 * static_cast<uint64_t>(b);
  const __m512i z = mix64_avx512(_mm512_add_epi64(_mm512_set1_epi64(base), steps));
  const __m256i hi = _mm512_cvtepi64_epi32(_mm512_srli_epi64(z, 41));
  const __m256i lo = _mm512_cvtepi64_epi32(_mm512_and_si512(z, _mm512_set1_epi64(LOW23)));
  __m512i bits = _mm512_inserti64x4(_mm512_castsi256_si512(hi), lo, 1);
  bits = _mm512_or_si512(_mm512_slli_epi32(bits, 1), _mm512_set1_epi32(1));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(bits), _mm512_set1_ps(TWO_M24));
}

PAGODA_RACE_AVX512 inline __m512 neg_log_avx512(__m512 u) {
  const __m512i bits = _mm512_castps_si512(u);
  __m512 e = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(127)));
  __m512 m = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFF)),
                                                 _mm512_set1_epi32(0x3F800000)));
  const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(SQRT2), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
  e = _mm512_mask_add_ps(e, big, e, _mm512_set1_ps(1.f));
  const __m512 x = _mm512_sub_ps(m, _mm512_set1_ps(1.f)), z = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(LOG_P[0]);
  for (int k = 1; k < 9; ++k) p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(LOG_P[k]));
  __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, x), z);
  y = _mm512_fmadd_ps(e, _mm512_set1_ps(LN2_LO), y);
  y = _mm512_fmadd_ps(z, _mm512_set1_ps(-0.5f), y);
  const __m512 r = _mm512_fmadd_ps(e, _mm512_set1_ps(LN2_HI), _mm512_add_ps(x, y));
  return _mm512_sub_ps(_mm512_setzero_ps(), r);
}

PAGODA_RACE_AVX512 float max_avx512(const float* l, int64_t begin, int64_t end) {
  __m512 acc = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) acc = _mm512_max_ps(acc, _mm512_loadu_ps(l + i));
  float m = _mm512_reduce_max_ps(acc);
  for (; i < end; ++i) m = std::max(m, l[i]);
  return m;
}

// `begin` is a multiple of 16 (a chunk's start)
PAGODA_RACE_AVX512 Best race_avx512(const float* l, int64_t begin, int64_t end, float m,
                                    float inv_t, uint64_t key) {
  const __m512 mv = _mm512_set1_ps(m), tv = _mm512_set1_ps(inv_t);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best = _mm512_setzero_ps();
  __m512i best_at = _mm512_set1_epi32(-1);
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  at = _mm512_add_epi32(at, _mm512_set1_epi32(static_cast<int32_t>(begin)));
  for (int64_t i = begin; i < end; i += 16) {
    const __mmask16 valid = end - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (end - i)) - 1);
    const __m512 x = _mm512_mask_loadu_ps(minus_inf, valid, l + i);
    const __m512 w = exp_nonpositive_avx512(_mm512_mul_ps(_mm512_sub_ps(x, mv), tv));
    const __m512 score = _mm512_div_ps(w, neg_log_avx512(uniform_avx512(key, i / 16)));
    const __mmask16 wins = _mm512_cmp_ps_mask(score, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, wins, score);
    best_at = _mm512_mask_mov_epi32(best_at, wins, at);
    at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
  }
  float scores[16];
  int32_t indices[16];
  _mm512_storeu_ps(scores, best);
  _mm512_storeu_si512(indices, best_at);
  Best out{0.f, -1};
  for (int t = 0; t < 16; ++t) {
    const bool earlier = scores[t] == out.score && indices[t] < out.index;
    if (indices[t] >= 0 && (scores[t] > out.score || earlier)) out = {scores[t], indices[t]};
  }
  return out;
}

// ---- AVX2 ---------------------------------------------------------------------------------------

// a * c mod 2^64, four lanes (AVX2 has no 64-bit lane multiply)
PAGODA_RACE_AVX2 inline __m256i mullo64_avx2(__m256i a, uint64_t c) {
  const __m256i lo = _mm256_set1_epi64x(static_cast<int64_t>(c & 0xFFFFFFFFu));
  const __m256i hi = _mm256_set1_epi64x(static_cast<int64_t>(c >> 32));
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), lo),
                                         _mm256_mul_epu32(a, hi));
  return _mm256_add_epi64(_mm256_mul_epu32(a, lo), _mm256_slli_epi64(cross, 32));
}

PAGODA_RACE_AVX2 inline __m256i mix64_avx2(__m256i z) {
  z = mullo64_avx2(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), MIX1);
  z = mullo64_avx2(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), MIX2);
  return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}

// the low 32 bits of a's and b's four 64-bit lanes, in order: a0..a3, b0..b3
PAGODA_RACE_AVX2 inline __m256i low_halves(__m256i a, __m256i b) {
  const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
  return _mm256_permute2x128_si256(_mm256_permutevar8x32_epi32(a, even),
                                   _mm256_permutevar8x32_epi32(b, even), 0x20);
}

PAGODA_RACE_AVX2 inline __m256 cell_midpoints(__m256i bits) {
  bits = _mm256_or_si256(_mm256_slli_epi32(bits, 1), _mm256_set1_epi32(1));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(bits), _mm256_set1_ps(TWO_M24));
}

// U for the 16 elements of block b: lanes 0..7 in first, 8..15 in second
PAGODA_RACE_AVX2 inline void uniform_avx2(uint64_t key, int64_t b, __m256* first, __m256* second) {
  const uint64_t base = key + GOLDEN * 8 * static_cast<uint64_t>(b);
  const __m256i lo_steps = _mm256_setr_epi64x(GOLDEN, 2 * GOLDEN, 3 * GOLDEN, 4 * GOLDEN);
  const __m256i hi_steps = _mm256_setr_epi64x(5 * GOLDEN, 6 * GOLDEN, 7 * GOLDEN, 8 * GOLDEN);
  const __m256i start = _mm256_set1_epi64x(static_cast<int64_t>(base));
  const __m256i za = mix64_avx2(_mm256_add_epi64(start, lo_steps));
  const __m256i zb = mix64_avx2(_mm256_add_epi64(start, hi_steps));
  const __m256i low23 = _mm256_set1_epi64x(LOW23);
  *first = cell_midpoints(low_halves(_mm256_srli_epi64(za, 41), _mm256_srli_epi64(zb, 41)));
  *second = cell_midpoints(
      low_halves(_mm256_and_si256(za, low23), _mm256_and_si256(zb, low23)));
}

PAGODA_RACE_AVX2 inline __m256 neg_log_avx2(__m256 u) {
  const __m256i bits = _mm256_castps_si256(u);
  __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)));
  __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFF)),
                                                 _mm256_set1_epi32(0x3F800000)));
  const __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(SQRT2), _CMP_GT_OQ);
  m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
  e = _mm256_blendv_ps(e, _mm256_add_ps(e, _mm256_set1_ps(1.f)), big);
  const __m256 x = _mm256_sub_ps(m, _mm256_set1_ps(1.f)), z = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(LOG_P[0]);
  for (int k = 1; k < 9; ++k) p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(LOG_P[k]));
  __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, x), z);
  y = _mm256_fmadd_ps(e, _mm256_set1_ps(LN2_LO), y);
  y = _mm256_fmadd_ps(z, _mm256_set1_ps(-0.5f), y);
  const __m256 r = _mm256_fmadd_ps(e, _mm256_set1_ps(LN2_HI), _mm256_add_ps(x, y));
  return _mm256_sub_ps(_mm256_setzero_ps(), r);
}

PAGODA_RACE_AVX2 float max_avx2(const float* l, int64_t begin, int64_t end) {
  __m256 acc = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) acc = _mm256_max_ps(acc, _mm256_loadu_ps(l + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  float m = lanes[0];
  for (int t = 1; t < 8; ++t) m = std::max(m, lanes[t]);
  for (; i < end; ++i) m = std::max(m, l[i]);
  return m;
}

// one half (8 lanes) of a block: keeps each lane's first best
struct Lanes8 {
  __m256 best;
  __m256i at;
};

PAGODA_RACE_AVX2 inline void race_half(Lanes8* s, __m256 x, __m256 u, __m256 mv, __m256 tv,
                                       __m256i at) {
  const __m256 w = exp_nonpositive_avx2(_mm256_mul_ps(_mm256_sub_ps(x, mv), tv));
  const __m256 score = _mm256_div_ps(w, neg_log_avx2(u));
  const __m256 wins = _mm256_cmp_ps(score, s->best, _CMP_GT_OQ);
  s->best = _mm256_blendv_ps(s->best, score, wins);
  s->at = _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(s->at), _mm256_castsi256_ps(at), wins));
}

PAGODA_RACE_AVX2 Best race_avx2(const float* l, int64_t begin, int64_t end, float m, float inv_t,
                                uint64_t key) {
  const __m256 mv = _mm256_set1_ps(m), tv = _mm256_set1_ps(inv_t);
  Lanes8 halves[2] = {{_mm256_setzero_ps(), _mm256_set1_epi32(-1)},
                      {_mm256_setzero_ps(), _mm256_set1_epi32(-1)}};
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  alignas(32) float pad[16];
  for (int64_t i = begin; i < end; i += 16) {
    const float* src = l + i;
    if (end - i < 16) {
      std::fill(pad, pad + 16, -std::numeric_limits<float>::infinity());
      std::copy(l + i, l + end, pad);
      src = pad;
    }
    __m256 u0, u1;
    uniform_avx2(key, i / 16, &u0, &u1);
    const __m256i at = _mm256_add_epi32(iota, _mm256_set1_epi32(static_cast<int32_t>(i)));
    race_half(&halves[0], _mm256_loadu_ps(src), u0, mv, tv, at);
    race_half(&halves[1], _mm256_loadu_ps(src + 8), u1, mv, tv,
              _mm256_add_epi32(at, _mm256_set1_epi32(8)));
  }
  Best out{0.f, -1};
  for (const Lanes8& h : halves) {
    float scores[8];
    int32_t indices[8];
    _mm256_storeu_ps(scores, h.best);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(indices), h.at);
    for (int t = 0; t < 8; ++t) {
      const bool earlier = scores[t] == out.score && indices[t] < out.index;
      if (indices[t] >= 0 && (scores[t] > out.score || earlier)) out = {scores[t], indices[t]};
    }
  }
  return out;
}

// ---- dispatch -----------------------------------------------------------------------------------

float chunk_max(const float* l, int64_t begin, int64_t end, Isa isa) {
  if (isa == Isa::kVnni) return max_avx512(l, begin, end);
  if (isa == Isa::kAvx2) return max_avx2(l, begin, end);
  return max_scalar(l, begin, end);
}

Best chunk_race(const float* l, int64_t begin, int64_t end, float m, float inv_t, uint64_t key,
                Isa isa) {
  if (isa == Isa::kVnni) return race_avx512(l, begin, end, m, inv_t, key);
  if (isa == Isa::kAvx2) return race_avx2(l, begin, end, m, inv_t, key);
  return race_scalar(l, begin, end, m, inv_t, key);
}

// The row's first max where no score beat 0 (every U's E made its weight's score 0: not seen in
// practice, kept so that the token is never a dropped one).
int64_t first_max(const float* l, int64_t n, float m) {
  for (int64_t i = 0; i < n; ++i) {
    if (l[i] == m) return i;
  }
  return 0;
}

void check_inputs(const at::Tensor& logits, const c10::optional<at::Tensor>& inv_temperature,
                  const at::Tensor& seed) {
  TORCH_CHECK(seed.numel() == 1 && seed.scalar_type() == at::kLong && seed.device().is_cpu(),
              "race_sample: seed must be a one-element int64 tensor on the CPU");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "race_sample: logits must be float32 (R, V) with contiguous rows");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 31),
              "race_sample: the vocabulary must hold 1 to 2^31 - 1 tokens");
  if (inv_temperature.has_value()) {
    const at::Tensor& t = *inv_temperature;
    TORCH_CHECK(t.dim() == 1 && t.size(0) == logits.size(0) && t.scalar_type() == at::kFloat &&
                    t.is_contiguous(),
                "race_sample: inv_temperature must be contiguous float32 (R,)");
  }
}

}  // namespace

at::Tensor race_sample(const at::Tensor& logits, const c10::optional<at::Tensor>& inv_temperature,
                       const at::Tensor& seed, int64_t isa_limit) {
  check_inputs(logits, inv_temperature, seed);
  const uint64_t seed_bits = static_cast<uint64_t>(seed.item<int64_t>());
  const int64_t rows = logits.size(0), n = logits.size(1), ld = logits.stride(0);
  const int64_t chunks = (n + CHUNK - 1) / CHUNK, items = rows * chunks;
  const Isa isa = pick_isa(isa_limit);
  const float* lp = logits.data_ptr<float>();
  const float* tp = inv_temperature.has_value() ? inv_temperature->data_ptr<float>() : nullptr;
  std::vector<float> maxima(items);
  std::vector<Best> bests(items);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t start = (it % chunks) * CHUNK;
      maxima[it] = chunk_max(lp + (it / chunks) * ld, start, std::min(start + CHUNK, n), isa);
    }
  });
  std::vector<float> row_max(rows);
  for (int64_t r = 0; r < rows; ++r) {
    row_max[r] = *std::max_element(maxima.begin() + r * chunks, maxima.begin() + (r + 1) * chunks);
  }
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t r = it / chunks, start = (it % chunks) * CHUNK;
      const uint64_t key = row_key(seed_bits, r);
      const float inv_t = tp != nullptr ? tp[r] : 1.f;
      bests[it] = chunk_race(lp + r * ld, start, std::min(start + CHUNK, n), row_max[r], inv_t,
                             key, isa);
    }
  });
  auto out = at::empty({rows}, at::kLong);
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    Best best{0.f, -1};
    for (int64_t c = 0; c < chunks; ++c) {
      if (bests[r * chunks + c].score > best.score) best = bests[r * chunks + c];
    }
    op[r] = best.index >= 0 ? best.index : first_max(lp + r * ld, n, row_max[r]);
  }
  return out;
}

}  // namespace pagoda_cpu

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("race_sample(Tensor logits, Tensor? inv_temperature, Tensor seed, int isa_limit) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) { m.impl("race_sample", &pagoda_cpu::race_sample); }
