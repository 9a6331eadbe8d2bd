// Paged attention on CPU, in float32, keys and values read from the paged cache (no gather): a
// float32 cache in place; a bfloat16, float16, int8 or float8 e4m3 one (the last two with their
// k_scale, v_scale per token and kv head) converted to float32 rows a work item at a time, into
// a scratch of at most MAX_CHUNK positions per thread (kv_rows.h: exact conversions, code *
// scale), or, a bfloat16 one on the blocked AVX-512 path, converted in registers as it is read;
// so each row's result is the float32 path's over the cache the torch path reads back, and the
// bytes streamed from memory are the cache's own.
//
// Every query row, decode or prefill, is reduced the same way: its result depends on its query,
// its length and the cache only, never on the rows beside it, so a position gets the same bits
// whether it runs alone, in a batch, as a decode, a verification row or a row of a prefill chunk
// of any size (docs/determinism.md).
//
//   paged_decode_attention: one query row per request.
//     q (B, H, D); k_cache, v_cache (num_blocks, block_size, Hkv, D); block_tables (B, W)
//     int32; seq_lens (B,) int32 -> out (B, H, D), out[b, h] = softmax(scale * q[b, h] .
//     K[b, lo:L]) @ V[b, lo:L]. A request with seq_len 0 (a padding row) gets zeros.
//   paged_attention: any mix of prefill chunks and decodes, query_start (R + 1,) int32 giving
//     each request's rows of q (T, H, D); row t of request r attends to positions [lo_t, p_t]
//     with p_t its own position (causal over the chunk and the cached context before it).
//
// Sliding window (`window` > 0, Mistral / Gemma 3): the row at position p attends to positions
// [lo, p] with lo = max(0, p + 1 - window), its last `window` positions; window 0: lo = 0, full
// causal attention, the same operations (and bits) as before windows existed.
//
// A latent cache (multi-head latent attention, `value_dim` > 0): one kv head whose key rows are
// [latent, rotary key] and whose values are each row's first value_dim (the latent), read from
// the same rows; out (rows, H, value_dim). v_cache is then empty.
//
// Query heads h share kv head h / (H / Hkv) (GQA). A row's positions [lo, len) are split into
// chunks, from lo, of a size that follows from its own span len - lo; work items are (group of
// rows, chunk), split over torch's intra-op threads, so that one long row still uses every
// thread. A group is rows with the same lo and chunk size that read the same blocks (a prefill
// chunk's rows, a request's verification rows; under a window, only rows whose window starts at
// 0 share a lo), which share one pass over the keys and values. Each item keeps, per row
// in it, its chunk's max, sum of exponentials and weighted values per query head, and a row's
// chunks are merged afterwards (flash-decoding). Scalar, AVX2 + FMA and (head width a multiple
// of 16) AVX-512 paths.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <utility>
#include <vector>

#include "common.h"
#include "kv_rows.h"

namespace {

constexpr int64_t MAX_CHUNK = 256;  // positions per work item at most
// and at least (then whole blocks): a short row is one item or two, not four small ones each
// with its own per-head maxima, sums and merge; a row of 512 positions and more splits as
// before. One prefill step of a burst (13 prompts of 26-251 tokens), SmolLM2's heads on 2
// AVX-512 cores: 4.0 -> 3.1 ms, 1.31x (benchmarks/results/issue42/part12/
// burst_step_attention_ab.json).
constexpr int64_t MIN_CHUNK = 128;
constexpr int64_t MAX_GROUP = 8;    // rows sharing one pass over their keys and values
constexpr int64_t MAX_HEADS = 64;   // query heads per kv head (the blocked AVX-512 path)

// dim: a key's values (per kv head); vdim: a value's, the same but for a latent cache, whose
// values are the first vdim of each key row (no v_cache)
struct Shape {
  int64_t heads, kv_heads, group, dim, vdim, block_size, width, table_stride;
  float scale;
};

// Positions ahead of the one being read whose key and value rows are asked for, so that a long
// context streaming from memory overlaps its loads with the arithmetic (the 1.5B's attention at
// 8k positions, 28 layers from memory, 2 threads on an AVX2 EPYC: 71-76 -> 64-68 ms a step in
// alternating runs). The bits are the same with or without it.
constexpr int64_t PREFETCH_AHEAD = 8;

// Every line of one position's key row and value row (row_floats values each; v null: a latent
// cache); T: float, or uint16_t for a bfloat16 cache read in place.
template <typename T>
inline void prefetch_row(const T* k, const T* v, int64_t row_floats) {
  for (int64_t i = 0; i < row_floats; i += 64 / static_cast<int64_t>(sizeof(T))) {
    _mm_prefetch(reinterpret_cast<const char*>(k + i), _MM_HINT_T0);
    if (v != nullptr) _mm_prefetch(reinterpret_cast<const char*>(v + i), _MM_HINT_T0);
  }
}

// ---- math: scalar, AVX2, AVX-512 --------------------------------------------------------------

using pagoda_cpu::exp_nonpositive;
using pagoda_cpu::exp_nonpositive_avx2;
using pagoda_cpu::exp_nonpositive_avx512;
using pagoda_cpu::KvRows;
using pagoda_cpu::KvType;
using pagoda_cpu::row_to_float;

__attribute__((target("avx2,fma"))) inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// [sum(a0), sum(a1), sum(a2), sum(a3)]: one horizontal pass for all four
__attribute__((target("avx2,fma"))) inline __m128 sum4_avx2(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Four positions' keys k[0..3] against the group's query heads (q_j = q + j * d):
// scores[j * n + r] = scale * q_j . k[r]; four independent sums hide the FMA latency.
__attribute__((target("avx2,fma"))) inline void scores4_avx2(const float* q, const float* const* k,
                                                             int64_t group, int64_t d, float scale,
                                                             float* scores, int64_t n) {
  for (int64_t j = 0; j < group; ++j) {
    const float* qj = q + j * d;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
           a3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
      const __m256 qv = _mm256_loadu_ps(qj + i);
      a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + i), a0);
      a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + i), a1);
      a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + i), a2);
      a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + i), a3);
    }
    alignas(16) float t[4];
    _mm_store_ps(t, _mm_mul_ps(sum4_avx2(a0, a1, a2, a3), _mm_set1_ps(scale)));
    for (int c = 0; c < 4; ++c) {
      for (int64_t e = i; e < d; ++e) t[c] += scale * qj[e] * k[c][e];
      scores[j * n + c] = t[c];
    }
  }
}

__attribute__((target("avx2,fma"))) inline void scores_avx2(const float* q, const float* k,
                                                            int64_t group, int64_t d, float scale,
                                                            float* scores, int64_t n) {
  for (int64_t j = 0; j < group; ++j) {
    const float* qj = q + j * d;
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qj + i), _mm256_loadu_ps(k + i), acc);
    float r = hsum_avx2(acc);
    for (; i < d; ++i) r += qj[i] * k[i];
    scores[j * n] = r * scale;
  }
}

// scores_avx2 of a bfloat16 key row (d <= 128 values): the row converted exactly, then the
// float32 function, so the same bits.
__attribute__((target("avx2,fma"))) inline void scores_avx2(const float* q, const uint16_t* k,
                                                            int64_t group, int64_t d, float scale,
                                                            float* scores, int64_t n) {
  KvRows bf16;
  bf16.type = KvType::kBf16;
  alignas(32) float row[128];
  pagoda_cpu::to_float_avx2(bf16, k, d, 1.f, row);
  scores_avx2(q, row, group, d, scale, scores, n);
}

// out_j += sum_r w[j * n + r] * v[r] over four positions' values (out_j = out + j * stride)
__attribute__((target("avx2,fma"))) inline void weighted4_avx2(const float* w, const float* const* v,
                                                               int64_t group, int64_t d, float* out,
                                                               int64_t stride, int64_t n) {
  for (int64_t j = 0; j < group; ++j) {
    const float* wj = w + j * n;
    const __m256 w0 = _mm256_set1_ps(wj[0]), w1 = _mm256_set1_ps(wj[1]), w2 = _mm256_set1_ps(wj[2]),
                 w3 = _mm256_set1_ps(wj[3]);
    float* o = out + j * stride;
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
      __m256 acc = _mm256_loadu_ps(o + i);
      acc = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v[0] + i), acc);
      acc = _mm256_fmadd_ps(w1, _mm256_loadu_ps(v[1] + i), acc);
      acc = _mm256_fmadd_ps(w2, _mm256_loadu_ps(v[2] + i), acc);
      acc = _mm256_fmadd_ps(w3, _mm256_loadu_ps(v[3] + i), acc);
      _mm256_storeu_ps(o + i, acc);
    }
    for (; i < d; ++i) o[i] += wj[0] * v[0][i] + wj[1] * v[1][i] + wj[2] * v[2][i] + wj[3] * v[3][i];
  }
}

// out_j += w[j * n] * v for the group's query heads (out_j = out + j * stride)
__attribute__((target("avx2,fma"))) inline void weighted_avx2(const float* w, const float* v,
                                                              int64_t group, int64_t d, float* out,
                                                              int64_t stride, int64_t n) {
  for (int64_t j = 0; j < group; ++j) {
    const __m256 wj = _mm256_set1_ps(w[j * n]);
    float* o = out + j * stride;
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(o + i, _mm256_fmadd_ps(wj, _mm256_loadu_ps(v + i), _mm256_loadu_ps(o + i)));
    for (; i < d; ++i) o[i] += w[j * n] * v[i];
  }
}

__attribute__((target("avx2,fma"))) inline float exp_shifted_sum_avx2(float* s, int64_t n, float shift) {
  const __m256 sh = _mm256_set1_ps(shift);
  __m256 sum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + i), sh));
    _mm256_storeu_ps(s + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  float r = hsum_avx2(sum);
  for (; i < n; ++i) r += (s[i] = exp_nonpositive(s[i] - shift));
  return r;
}

// The largest of s[0 .. n), n >= 1 (exact: any order gives the same value).
__attribute__((target("avx2,fma"))) inline float max_avx2(const float* s, int64_t n) {
  int64_t i = 0;
  float r = s[0];
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(s);
    for (i = 8; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + i));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    r = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
  }
  for (; i < n; ++i) r = std::max(r, s[i]);
  return r;
}

inline float max_scalar(const float* s, int64_t n) { return *std::max_element(s, s + n); }

inline void scores_scalar(const float* q, const float* k, int64_t group, int64_t d, float scale,
                          float* scores, int64_t n) {
  for (int64_t j = 0; j < group; ++j) {
    float r = 0.f;
    for (int64_t i = 0; i < d; ++i) r += q[j * d + i] * k[i];
    scores[j * n] = r * scale;
  }
}

inline void weighted_scalar(const float* w, const float* v, int64_t group, int64_t d, float* out,
                            int64_t stride, int64_t n) {
  for (int64_t j = 0; j < group; ++j) {
    for (int64_t i = 0; i < d; ++i) out[j * stride + i] += w[j * n] * v[i];
  }
}

inline void scores4_scalar(const float* q, const float* const* k, int64_t group, int64_t d,
                           float scale, float* scores, int64_t n) {
  for (int c = 0; c < 4; ++c) scores_scalar(q, k[c], group, d, scale, scores + c, n);
}

inline void weighted4_scalar(const float* w, const float* const* v, int64_t group, int64_t d,
                             float* out, int64_t stride, int64_t n) {
  for (int c = 0; c < 4; ++c) weighted_scalar(w + c, v[c], group, d, out, stride, n);
}

inline float exp_shifted_sum_scalar(float* s, int64_t n, float shift) {
  float r = 0.f;
  for (int64_t i = 0; i < n; ++i) r += (s[i] = exp_nonpositive(s[i] - shift));
  return r;
}

#define PAGODA_AVX512 __attribute__((target("avx2,fma,avx512f,avx512dq,avx512vl")))
// [sum(a0), sum(a1), sum(a2), sum(a3)]: each register's halves added, then sum4_avx2 (a third
// of the shuffles of four separate reductions).
PAGODA_AVX512 inline __m256 half(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
}

PAGODA_AVX512 inline __m128 sum4_avx512(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  return sum4_avx2(half(a0), half(a1), half(a2), half(a3));
}

// Sixteen values of a row as float32: a float32 cache's, or a bfloat16 one's (exact: its bits
// are a float32's top half).
PAGODA_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
PAGODA_AVX512 inline __m512 load16(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// The four-position steps with 512-bit registers, where d is a multiple of 16 (AVX-512).
PAGODA_AVX512 inline void scores4_avx512(const float* q, const float* const* k, int64_t group,
                                         int64_t d, float scale, float* scores, int64_t n) {
  for (int64_t j = 0; j < group; ++j) {
    const float* qj = q + j * d;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(),
           a3 = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
      const __m512 qv = _mm512_loadu_ps(qj + i);
      a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[0] + i), a0);
      a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[1] + i), a1);
      a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[2] + i), a2);
      a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[3] + i), a3);
    }
    alignas(16) float t[4];
    _mm_store_ps(t, _mm_mul_ps(sum4_avx512(a0, a1, a2, a3), _mm_set1_ps(scale)));
    for (int c = 0; c < 4; ++c) scores[j * n + c] = t[c];
  }
}

PAGODA_AVX512 inline void weighted4_avx512(const float* w, const float* const* v, int64_t group,
                                           int64_t d, float* out, int64_t stride, int64_t n) {
  for (int64_t j = 0; j < group; ++j) {
    const float* wj = w + j * n;
    const __m512 w0 = _mm512_set1_ps(wj[0]), w1 = _mm512_set1_ps(wj[1]), w2 = _mm512_set1_ps(wj[2]),
                 w3 = _mm512_set1_ps(wj[3]);
    float* o = out + j * stride;
    for (int64_t i = 0; i < d; i += 16) {
      __m512 acc = _mm512_loadu_ps(o + i);
      acc = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v[0] + i), acc);
      acc = _mm512_fmadd_ps(w1, _mm512_loadu_ps(v[1] + i), acc);
      acc = _mm512_fmadd_ps(w2, _mm512_loadu_ps(v[2] + i), acc);
      acc = _mm512_fmadd_ps(w3, _mm512_loadu_ps(v[3] + i), acc);
      _mm512_storeu_ps(o + i, acc);
    }
  }
}
// ---- one work item -----------------------------------------------------------------------------

// One row's share of a work item: its query heads, its positions in the chunk (n, of which the
// first n4 in steps of four), where its chunk result goes and its scores (heads x n).
struct RowWork {
  const float* q;
  int64_t n, n4;
  float* part;
  float* scores;
};

// Positions [begin, begin + n_i) of the rows w[0 .. count) of one group (rows with the same
// block table: a request's verification rows), every kv head: each row's part holds, per query
// head, the max score, the sum of exponentials, then D weighted values. A position's keys (and
// values) of all kv heads are one contiguous row, read in position order, so the memory is
// streamed, and once for the whole group: its rows take them from L1. Each row sees the same
// sequence of operations as if it were alone (four-position steps up to its own n4, then single
// positions), so a row's bits do not depend on its group. Defined once per instruction set: WIDE
// for the four-position steps, SUFFIX for the rest.
#define PAGODA_ATTEND_GROUP(WIDE, SUFFIX)                                                             \
  const int64_t d = s.dim, vd = s.vdim, row = s.kv_heads * d;                                \
  auto at = [&](const float* cache, int64_t p) {                                               \
    const int64_t pos = begin + p;                                                             \
    const int64_t block = table[pos / s.block_size];                                           \
    return cache + (block * s.block_size + pos % s.block_size) * row;                          \
  };                                                                                           \
  int64_t most4 = 0, most = 0;                                                                 \
  for (int i = 0; i < count; ++i) {                                                            \
    most4 = std::max(most4, w[i].n4);                                                          \
    most = std::max(most, w[i].n);                                                             \
  }                                                                                            \
  const float* vp = vc == kc ? nullptr : vc; /* a latent cache: its values are the key rows */ \
  for (int64_t p = 0; p < most4; p += 4) {                                                     \
    for (int64_t a = p + PREFETCH_AHEAD; a < std::min(p + PREFETCH_AHEAD + 4, most); ++a) {    \
      prefetch_row(at(kc, a), vp != nullptr ? at(vp, a) : nullptr, row);                       \
    }                                                                                          \
    const float* r4[4] = {at(kc, p), at(kc, p + 1), at(kc, p + 2), at(kc, p + 3)};             \
    for (int64_t kh = 0; kh < s.kv_heads; ++kh) {                                              \
      const float* k4[4] = {r4[0] + kh * d, r4[1] + kh * d, r4[2] + kh * d, r4[3] + kh * d};   \
      for (int i = 0; i < count; ++i) {                                                        \
        if (p + 4 > w[i].n4) continue;                                                         \
        scores4_##WIDE(w[i].q + kh * s.group * d, k4, s.group, d, s.scale,                     \
                       w[i].scores + kh * s.group * w[i].n + p, w[i].n);                       \
      }                                                                                        \
    }                                                                                          \
  }                                                                                            \
  for (int i = 0; i < count; ++i) {                                                            \
    const RowWork& r = w[i];                                                                   \
    for (int64_t p = r.n4; p < r.n; ++p) {                                                     \
      for (int64_t kh = 0; kh < s.kv_heads; ++kh) {                                            \
        scores_##SUFFIX(r.q + kh * s.group * d, at(kc, p) + kh * d, s.group, d, s.scale,       \
                        r.scores + kh * s.group * r.n + p, r.n);                               \
      }                                                                                        \
    }                                                                                          \
    for (int64_t h = 0; h < s.heads; ++h) {                                                    \
      float* sh = r.scores + h * r.n;                                                          \
      float* out = r.part + h * (vd + 2);                                                      \
      out[0] = max_##SUFFIX(sh, r.n);                                                          \
      out[1] = exp_shifted_sum_##SUFFIX(sh, r.n, out[0]);                                      \
      std::fill(out + 2, out + 2 + vd, 0.f);                                                   \
    }                                                                                          \
  }                                                                                            \
  for (int64_t p = 0; p < most4; p += 4) {                                                     \
    const float* r4[4] = {at(vc, p), at(vc, p + 1), at(vc, p + 2), at(vc, p + 3)};             \
    for (int64_t kh = 0; kh < s.kv_heads; ++kh) {                                              \
      const float* v4[4] = {r4[0] + kh * d, r4[1] + kh * d, r4[2] + kh * d, r4[3] + kh * d};   \
      for (int i = 0; i < count; ++i) {                                                        \
        if (p + 4 > w[i].n4) continue;                                                         \
        weighted4_##WIDE(w[i].scores + kh * s.group * w[i].n + p, v4, s.group, vd,             \
                         w[i].part + kh * s.group * (vd + 2) + 2, vd + 2, w[i].n);             \
      }                                                                                        \
    }                                                                                          \
  }                                                                                            \
  for (int i = 0; i < count; ++i) {                                                            \
    const RowWork& r = w[i];                                                                   \
    for (int64_t p = r.n4; p < r.n; ++p) {                                                     \
      for (int64_t kh = 0; kh < s.kv_heads; ++kh) {                                            \
        weighted_##SUFFIX(r.scores + kh * s.group * r.n + p, at(vc, p) + kh * d, s.group, vd,  \
                          r.part + kh * s.group * (vd + 2) + 2, vd + 2, r.n);                  \
      }                                                                                        \
    }                                                                                          \
  }

__attribute__((target("avx2,fma"))) void attend_group_avx2(const Shape& s, const RowWork* w,
                                                           int count, const float* kc,
                                                           const float* vc, const int32_t* table,
                                                           int64_t begin) {
  PAGODA_ATTEND_GROUP(avx2, avx2)
}

PAGODA_AVX512 void attend_group_avx512(const Shape& s, const RowWork* w, int count,
                                       const float* kc, const float* vc, const int32_t* table,
                                       int64_t begin) {
  PAGODA_ATTEND_GROUP(avx512, avx2)
}

void attend_group_scalar(const Shape& s, const RowWork* w, int count, const float* kc,
                         const float* vc, const int32_t* table, int64_t begin) {
  PAGODA_ATTEND_GROUP(scalar, scalar)
}

// ---- AVX-512 with 64- or 128-wide heads: the same arithmetic, blocked --------------------------
//
// attend_group_avx512_blocked gives every row the bits attend_group_avx512 gives it: each score
// is the same chain of FMAs over the head width and the same sum4 tree, each weighted value the
// same FMA chain over the positions in order (an FMA rounds once per element, whatever the
// vector width). It only shares loads: a block of up to four query vectors (rows x heads of one
// kv head) reads four positions' keys once, and six query vectors of one kv head, of one row or
// of the group's rows, read each position's values once, 64 of them at a time, their weighted
// values in registers over the chunk. Prefill chunks (groups of up to MAX_GROUP rows) are what
// it is for. (Against a row's heads of one kv head at a time, 128 values a pass, the same bits;
// one process, the two builds alternately, 41 rounds, benchmarks/attention_ab.py,
// results/issue42/part14/attention_ab.json: a 512-token prompt 1.14x with SmolLM2's heads and
// 1.13x with the 1.5B's, a burst's prefill step 1.02x and 1.07x, one decode row of 8,192
// positions 1.03x and 1.18x, 64 decode rows of 300 level.)

// exp_shifted_sum_avx2's values and sum, sixteen exponentials an instruction: each element is
// the same per-lane arithmetic, and the sum is accumulated in the same eight lanes in the same
// order (elements i .. i + 7, then i + 8 .. i + 15).
PAGODA_AVX512 inline float exp_shifted_sum_avx512(float* s, int64_t n, float shift) {
  const __m512 sh = _mm512_set1_ps(shift);
  __m256 sum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp_nonpositive_avx512(_mm512_sub_ps(_mm512_loadu_ps(s + i), sh));
    _mm512_storeu_ps(s + i, e);
    sum = _mm256_add_ps(sum, _mm512_castps512_ps256(e));
    sum = _mm256_add_ps(sum, _mm512_extractf32x8_ps(e, 1));
  }
  if (i + 8 <= n) {
    const __m256 e = exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(shift)));
    _mm256_storeu_ps(s + i, e);
    sum = _mm256_add_ps(sum, e);
    i += 8;
  }
  float r = hsum_avx2(sum);
  for (; i < n; ++i) r += (s[i] = exp_nonpositive(s[i] - shift));
  return r;
}

// One query vector of a group: its floats, and its row's scores for that head (n of them).
struct QueryVec {
  const float* q;
  float* scores;
};

// The sixteen sums of acc[a][c], in lane 4a + c, each by sum4_avx512's tree (lanes l and l + 8,
// then adjacent pairs, then adjacent pairs of those, then the two halves), so the same bits, in
// a butterfly that shares its shuffles among the sixteen: 31 shuffles where four sum4_avx512
// take 44.
PAGODA_AVX512 inline __m512 sum16_avx512(const __m512 (&acc)[4][4]) {
  const __m512* x = &acc[0][0];
  __m512 u[8], w[4], y[2];
  for (int t = 0; t < 8; ++t) {  // [h(x_2t) | h(x_2t+1)], h_l = x_l + x_l+8
    u[t] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * t], x[2 * t + 1], 0x44),
                         _mm512_shuffle_f32x4(x[2 * t], x[2 * t + 1], 0xEE));
  }
  for (int t = 0; t < 4; ++t) {  // adjacent pairs within each 128-bit lane
    w[t] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * t], u[2 * t + 1], 0x88),
                         _mm512_shuffle_ps(u[2 * t], u[2 * t + 1], 0xDD));
  }
  for (int t = 0; t < 2; ++t) {
    y[t] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * t], w[2 * t + 1], 0x88),
                         _mm512_shuffle_ps(w[2 * t], w[2 * t + 1], 0xDD));
  }
  // lanes now hold x 0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88),
                                    _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15), sums);
}

// scores[p .. p + 3] of NQ query vectors against four positions' keys k[0..3].
template <int NQ, typename T>
PAGODA_AVX512 inline void scores4_block_avx512(const QueryVec* v, const T* const* k, int64_t d,
                                               float scale, int64_t p) {
  __m512 acc[NQ][4];
#pragma GCC unroll 4
  for (int a = 0; a < NQ; ++a) {
    for (int c = 0; c < 4; ++c) acc[a][c] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < d; i += 16) {
    const __m512 k0 = load16(k[0] + i), k1 = load16(k[1] + i), k2 = load16(k[2] + i),
                 k3 = load16(k[3] + i);
#pragma GCC unroll 4
    for (int a = 0; a < NQ; ++a) {
      const __m512 qv = _mm512_loadu_ps(v[a].q + i);
      acc[a][0] = _mm512_fmadd_ps(qv, k0, acc[a][0]);
      acc[a][1] = _mm512_fmadd_ps(qv, k1, acc[a][1]);
      acc[a][2] = _mm512_fmadd_ps(qv, k2, acc[a][2]);
      acc[a][3] = _mm512_fmadd_ps(qv, k3, acc[a][3]);
    }
  }
  if constexpr (NQ == 4) {
    const __m512 sums = _mm512_mul_ps(sum16_avx512(acc), _mm512_set1_ps(scale));
    alignas(64) float t[16];
    _mm512_store_ps(t, sums);
    for (int a = 0; a < 4; ++a) std::memcpy(v[a].scores + p, t + 4 * a, 4 * sizeof(float));
  } else {
#pragma GCC unroll 4
    for (int a = 0; a < NQ; ++a) {
      _mm_storeu_ps(v[a].scores + p, _mm_mul_ps(sum4_avx512(acc[a][0], acc[a][1], acc[a][2], acc[a][3]),
                                                _mm_set1_ps(scale)));
    }
  }
}

template <typename T>
PAGODA_AVX512 inline void scores4_blocks_avx512(const QueryVec* v, int count, const T* const* k,
                                                int64_t d, float scale, int64_t p) {
  switch (count) {
    case 4: scores4_block_avx512<4, T>(v, k, d, scale, p); break;
    case 3: scores4_block_avx512<3, T>(v, k, d, scale, p); break;
    case 2: scores4_block_avx512<2, T>(v, k, d, scale, p); break;
    case 1: scores4_block_avx512<1, T>(v, k, d, scale, p); break;
    default: break;
  }
}

// out_h[0 .. 16 * DV) = (from > 0 ? out_h : 0) + sum over positions [from, to) in order of
// w_h[p] * v[p] (FMAs), for HB query vectors of one kv head; v[p] + off is position p's values of
// that kv head. A sum split at any position and continued from what was stored is the same FMA
// chain, so the same bits as one pass from 0.
template <int DV, int HB, typename T>
PAGODA_AVX512 inline void weighted_block_avx512(const float* const* w, const T* const* v,
                                                int64_t off, int64_t from, int64_t to,
                                                float* const* out) {
  __m512 acc[HB][DV];
#pragma GCC unroll 8
  for (int h = 0; h < HB; ++h) {
    for (int i = 0; i < DV; ++i) acc[h][i] = from > 0 ? _mm512_loadu_ps(out[h] + 16 * i) : _mm512_setzero_ps();
  }
  for (int64_t p = from; p < to; ++p) {
    __m512 wv[HB];
#pragma GCC unroll 8
    for (int h = 0; h < HB; ++h) wv[h] = _mm512_set1_ps(w[h][p]);
#pragma GCC unroll 8
    for (int i = 0; i < DV; ++i) {
      const __m512 x = load16(v[p] + off + 16 * i);
#pragma GCC unroll 8
      for (int h = 0; h < HB; ++h) acc[h][i] = _mm512_fmadd_ps(wv[h], x, acc[h][i]);
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < HB; ++h) {
    for (int i = 0; i < DV; ++i) _mm512_storeu_ps(out[h] + 16 * i, acc[h][i]);
  }
}

// Query vectors of one kv head, vector e over its own positions [0, n[e]): up to HB of them at a
// time share each position's value loads while they all still run (the rows of a prefill group
// differ in length by a position or so), then the longer ones go on from where they stopped.
// BLOCK(k, w, out, from, to) runs k <= HB vectors over [from, to).
template <int HB, typename Block>
inline void weighted_shared(const float* const* w, const int64_t* n, float* const* out,
                            int64_t count, Block block) {
  for (int64_t e = 0; e < count; e += HB) {
    const float* ws[HB];
    float* outs[HB];
    int64_t ns[HB];
    int k = static_cast<int>(std::min<int64_t>(HB, count - e));
    for (int j = 0; j < k; ++j) ws[j] = w[e + j], outs[j] = out[e + j], ns[j] = n[e + j];
    int64_t from = 0;
    while (k > 0) {
      const int64_t to = *std::min_element(ns, ns + k);
      block(k, ws, outs, from, to);
      int kept = 0;  // the vectors with positions left
      for (int j = 0; j < k; ++j) {
        if (ns[j] > to) ws[kept] = ws[j], outs[kept] = outs[j], ns[kept++] = ns[j];
      }
      k = kept;
      from = to;
    }
  }
}

// 64 of each vector's values at a time (4 registers), six vectors a block: 24 accumulators of
// the 32, and each position's values loaded once per six vectors
template <typename T>
PAGODA_AVX512 inline void weighted_vectors_avx512(const float* const* w, const int64_t* n,
                                                  const T* const* v, int64_t off,
                                                  float* const* out, int64_t count, int64_t d) {
  constexpr int HB = 6;
  for (int64_t c = 0; c < d; c += 64) {
    float* slice[MAX_GROUP * MAX_HEADS];
    for (int64_t e = 0; e < count; ++e) slice[e] = out[e] + c;
    weighted_shared<HB>(w, n, slice, count, [&](int k, const float* const* ws, float* const* outs,
                                                int64_t from, int64_t to) {
      switch (k) {
        case 6: weighted_block_avx512<4, 6, T>(ws, v, off + c, from, to, outs); break;
        case 5: weighted_block_avx512<4, 5, T>(ws, v, off + c, from, to, outs); break;
        case 4: weighted_block_avx512<4, 4, T>(ws, v, off + c, from, to, outs); break;
        case 3: weighted_block_avx512<4, 3, T>(ws, v, off + c, from, to, outs); break;
        case 2: weighted_block_avx512<4, 2, T>(ws, v, off + c, from, to, outs); break;
        case 1: weighted_block_avx512<4, 1, T>(ws, v, off + c, from, to, outs); break;
        default: break;
      }
    });
  }
}

// The blocked group: positions' key and value pointers first, then the scores in blocks of query
// vectors (SCORES: the blocks' function), the single positions past a row's n4 (scores_avx2, as
// the plain path), each head's max and sum of exponentials (EXP_SUM), and the weighted values
// in registers (WEIGHTED). krow, vrow: scratch for a chunk's position pointers.
#define PAGODA_ATTEND_BLOCKED(SCORES, EXP_SUM, WEIGHTED)                                         \
  const int64_t d = s.dim, row = s.kv_heads * d;                                               \
  int64_t most = 0, most4 = 0;                                                                 \
  for (int i = 0; i < count; ++i) {                                                            \
    most = std::max(most, w[i].n);                                                             \
    most4 = std::max(most4, w[i].n4);                                                          \
  }                                                                                            \
  for (int64_t p = 0; p < most; ++p) {                                                         \
    const int64_t pos = begin + p;                                                             \
    const int64_t slot = table[pos / s.block_size] * s.block_size + pos % s.block_size;        \
    krow[p] = kc + slot * row;                                                                 \
    vrow[p] = vc + slot * row;                                                                 \
  }                                                                                            \
  /* One row (a decode): every kv head's keys of four positions in turn, so that each key row */ \
  /* is read once, in order, as it streams from memory (64 decode rows of 300 positions, 30 */ \
  /* layers' caches from memory, SmolLM2's heads: 1.12x AVX-512, 1.14x AVX2; the 1.5B's */     \
  /* level; results/issue42/part15). A group: one kv head at a time over the positions (the */ \
  /* other order lost 2% on a burst's prefill step). Either way each score is the same chain. */ \
  const bool by_position = count == 1;                                                         \
  const int64_t steps = (most4 + 3) / 4;                                                       \
  for (int64_t outer = 0; outer < (by_position ? steps : s.kv_heads); ++outer) {               \
    for (int64_t inner = 0; inner < (by_position ? s.kv_heads : steps); ++inner) {             \
      const int64_t kh = by_position ? inner : outer, p = 4 * (by_position ? outer : inner);   \
      for (int64_t a = p + PREFETCH_AHEAD; kh == 0 && a < std::min(p + PREFETCH_AHEAD + 4, most); \
           ++a) {                                                                              \
        prefetch_row(krow[a], vrow[a], row);                                                   \
      }                                                                                        \
      std::remove_reference_t<decltype(*krow)> k4[4] = {                                       \
          krow[p] + kh * d, krow[p + 1] + kh * d, krow[p + 2] + kh * d, krow[p + 3] + kh * d};   \
      QueryVec block[4];                                                                       \
      int filled = 0;                                                                          \
      for (int i = 0; i < count; ++i) {                                                        \
        if (p + 4 > w[i].n4) continue;                                                         \
        for (int64_t j = 0; j < s.group; ++j) {                                                \
          const int64_t h = kh * s.group + j;                                                  \
          block[filled++] = QueryVec{w[i].q + h * d, w[i].scores + h * w[i].n};                \
          if (filled == 4) {                                                                   \
            SCORES(block, 4, k4, d, s.scale, p);                                               \
            filled = 0;                                                                        \
          }                                                                                    \
        }                                                                                      \
      }                                                                                        \
      SCORES(block, filled, k4, d, s.scale, p);                                                \
    }                                                                                          \
  }                                                                                            \
  for (int i = 0; i < count; ++i) {                                                            \
    const RowWork& r = w[i];                                                                   \
    for (int64_t p = r.n4; p < r.n; ++p) {                                                     \
      for (int64_t kh = 0; kh < s.kv_heads; ++kh) {                                            \
        scores_avx2(r.q + kh * s.group * d, krow[p] + kh * d, s.group, d, s.scale,             \
                    r.scores + kh * s.group * r.n + p, r.n);                                   \
      }                                                                                        \
    }                                                                                          \
    for (int64_t h = 0; h < s.heads; ++h) {                                                    \
      float* sh = r.scores + h * r.n;                                                          \
      float* out = r.part + h * (d + 2);                                                       \
      out[0] = max_avx2(sh, r.n);                                                              \
      out[1] = EXP_SUM(sh, r.n, out[0]);                                                       \
    }                                                                                          \
  }                                                                                            \
  for (int64_t kh = 0; kh < s.kv_heads; ++kh) {                                                \
    const float* weights[MAX_GROUP * MAX_HEADS];                                               \
    float* outs[MAX_GROUP * MAX_HEADS];                                                        \
    int64_t lens[MAX_GROUP * MAX_HEADS];                                                       \
    int64_t e = 0;                                                                             \
    for (int i = 0; i < count; ++i) {                                                          \
      for (int64_t j = 0; j < s.group; ++j, ++e) {                                             \
        weights[e] = w[i].scores + (kh * s.group + j) * w[i].n;                                \
        outs[e] = w[i].part + (kh * s.group + j) * (d + 2) + 2;                                \
        lens[e] = w[i].n;                                                                      \
      }                                                                                        \
    }                                                                                          \
    WEIGHTED(weights, lens, vrow, kh * d, outs, e, d);                                         \
  }

// attend_group_avx512 for d = 64 or 128; T: float, or uint16_t where a bfloat16 cache is read in
// place (its values converted in registers, exactly: the bits of the float32 rows convert_rows
// would give).
template <typename T>
PAGODA_AVX512 void attend_group_avx512_blocked(const Shape& s, const RowWork* w, int count,
                                               const T* kc, const T* vc, const int32_t* table,
                                               int64_t begin, const T** krow, const T** vrow) {
  PAGODA_ATTEND_BLOCKED(scores4_blocks_avx512, exp_shifted_sum_avx512, weighted_vectors_avx512)
}

// ---- AVX2 with 64- or 128-wide heads: the same blocking in 16 registers -------------------------
//
// attend_group_avx2_blocked gives every row attend_group_avx2's bits: blocks of up to two query
// vectors against four positions (8 accumulators), scores4_avx2's chains and sum4 tree; the
// weighted values of three query vectors at a time (of one row or of the group's rows), 32 of
// each one's values in registers per pass (12 accumulators).

template <int NQ>
__attribute__((target("avx2,fma"))) inline void scores4_block_avx2(const QueryVec* v,
                                                                   const float* const* k,
                                                                   int64_t d, float scale,
                                                                   int64_t p) {
  __m256 acc[NQ][4];
  for (int a = 0; a < NQ; ++a) {
    for (int c = 0; c < 4; ++c) acc[a][c] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 k0 = _mm256_loadu_ps(k[0] + i), k1 = _mm256_loadu_ps(k[1] + i),
                 k2 = _mm256_loadu_ps(k[2] + i), k3 = _mm256_loadu_ps(k[3] + i);
    for (int a = 0; a < NQ; ++a) {
      const __m256 qv = _mm256_loadu_ps(v[a].q + i);
      acc[a][0] = _mm256_fmadd_ps(qv, k0, acc[a][0]);
      acc[a][1] = _mm256_fmadd_ps(qv, k1, acc[a][1]);
      acc[a][2] = _mm256_fmadd_ps(qv, k2, acc[a][2]);
      acc[a][3] = _mm256_fmadd_ps(qv, k3, acc[a][3]);
    }
  }
  for (int a = 0; a < NQ; ++a) {
    _mm_storeu_ps(v[a].scores + p, _mm_mul_ps(sum4_avx2(acc[a][0], acc[a][1], acc[a][2], acc[a][3]),
                                              _mm_set1_ps(scale)));
  }
}

__attribute__((target("avx2,fma"))) inline void scores4_blocks_avx2(const QueryVec* v, int count,
                                                                    const float* const* k,
                                                                    int64_t d, float scale,
                                                                    int64_t p) {
  int a = 0;
  for (; a + 2 <= count; a += 2) scores4_block_avx2<2>(v + a, k, d, scale, p);
  if (a < count) scores4_block_avx2<1>(v + a, k, d, scale, p);
}

// out_h[off2 .. off2 + 32) for HB <= 3 query vectors, over positions [from, to) in
// order (FMAs, continuing what is stored when from > 0, as weighted_block_avx512)
template <int HB>
__attribute__((target("avx2,fma"))) inline void weighted_slice_avx2(const float* const* w,
                                                                    const float* const* v,
                                                                    int64_t off, int64_t from,
                                                                    int64_t to, float* const* out) {
  __m256 acc[HB][4];
  for (int h = 0; h < HB; ++h) {
    for (int i = 0; i < 4; ++i) acc[h][i] = from > 0 ? _mm256_loadu_ps(out[h] + 8 * i) : _mm256_setzero_ps();
  }
  for (int64_t p = from; p < to; ++p) {
    __m256 wv[HB];
    for (int h = 0; h < HB; ++h) wv[h] = _mm256_set1_ps(w[h][p]);
    for (int i = 0; i < 4; ++i) {
      const __m256 x = _mm256_loadu_ps(v[p] + off + 8 * i);
      for (int h = 0; h < HB; ++h) acc[h][i] = _mm256_fmadd_ps(wv[h], x, acc[h][i]);
    }
  }
  for (int h = 0; h < HB; ++h) {
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out[h] + 8 * i, acc[h][i]);
  }
}

__attribute__((target("avx2,fma"))) inline void weighted_vectors_avx2(const float* const* w,
                                                                      const int64_t* n,
                                                                      const float* const* v,
                                                                      int64_t off,
                                                                      float* const* out,
                                                                      int64_t count, int64_t d) {
  for (int64_t c = 0; c < d; c += 32) {  // 32 of each vector's values at a time
    float* slice[MAX_GROUP * MAX_HEADS];
    for (int64_t e = 0; e < count; ++e) slice[e] = out[e] + c;
    weighted_shared<3>(w, n, slice, count, [&](int k, const float* const* ws, float* const* outs,
                                                int64_t from, int64_t to) {
      if (k == 3) {
        weighted_slice_avx2<3>(ws, v, off + c, from, to, outs);
      } else if (k == 2) {
        weighted_slice_avx2<2>(ws, v, off + c, from, to, outs);
      } else {
        weighted_slice_avx2<1>(ws, v, off + c, from, to, outs);
      }
    });
  }
}

// attend_group_avx2 for d = 64 or 128.
__attribute__((target("avx2,fma"))) void attend_group_avx2_blocked(
    const Shape& s, const RowWork* w, int count, const float* kc, const float* vc,
    const int32_t* table, int64_t begin, const float** krow, const float** vrow) {
  PAGODA_ATTEND_BLOCKED(scores4_blocks_avx2, exp_shifted_sum_avx2, weighted_vectors_avx2)
}

// Merges a row's chunks into its query heads' outputs: exp(m_c - M) rescales each.
void merge(const Shape& s, const float* parts, int64_t num_chunks, float* out) {
  const int64_t d = s.vdim, stride = s.heads * (d + 2);  // floats per chunk
  for (int64_t h = 0; h < s.heads; ++h) {
    float big = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < num_chunks; ++c) big = std::max(big, parts[c * stride + h * (d + 2)]);
    float total = 0.f;
    float* o = out + h * d;
    std::fill(o, o + d, 0.f);
    for (int64_t c = 0; c < num_chunks; ++c) {
      const float* p = parts + c * stride + h * (d + 2);
      const float w = std::exp(p[0] - big);
      total += w * p[1];
      for (int64_t i = 0; i < d; ++i) o[i] += w * p[2 + i];
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int64_t i = 0; i < d; ++i) o[i] *= inv;
  }
}

// Positions [begin, begin + n) of a table as float32 rows 0 .. n of kbuf and vbuf (vbuf null:
// a latent cache, whose values are its key rows).
void convert_rows(const Shape& s, const KvRows& kr, const KvRows& vr, const int32_t* table,
                  int64_t begin, int64_t n, bool simd, float* kbuf, float* vbuf) {
  const int64_t row = s.kv_heads * s.dim;
  auto slot_of = [&](int64_t pos) { return table[pos / s.block_size] * s.block_size + pos % s.block_size; };
  for (int64_t p = 0; p < n; ++p) {
    if (p + PREFETCH_AHEAD < n) {
      const int64_t ahead = slot_of(begin + p + PREFETCH_AHEAD);
      pagoda_cpu::prefetch_slot(kr, ahead);
      if (vbuf != nullptr) pagoda_cpu::prefetch_slot(vr, ahead);
    }
    const int64_t slot = slot_of(begin + p);
    row_to_float(kr, slot, simd, kbuf + p * row);
    if (vbuf != nullptr) row_to_float(vr, slot, simd, vbuf + p * row);
  }
}

// Positions per work item of a row of `length` positions (its span len - lo): a quarter of it
// but at least MIN_CHUNK, in whole blocks, at most MAX_CHUNK. A function of the length alone,
// not of the threads, so a row's bits are the same in any process (a tensor-parallel worker
// runs on its share of the cores).
int64_t chunk_size(int64_t length, int64_t block_size) {
  constexpr int64_t pieces = 4;
  int64_t size = std::max((length + pieces - 1) / pieces, MIN_CHUNK);
  size = (size + block_size - 1) / block_size * block_size;
  return std::clamp<int64_t>(size, block_size, std::max(block_size, MAX_CHUNK));
}

// One query row: its query heads (heads x D floats), the block table it reads, the keys
// [lo, len) it attends to (len 0 for a padding row).
struct QueryRow {
  const float* q;
  const int32_t* table;
  int64_t lo, len;
};

// The first position a row of `len` positions attends to under `window` (0: the whole row).
int64_t window_start(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

// A call's chunk results, `floats` of them, not initialised (every one is written before it is
// read): the calling thread's buffer, kept between calls up to KEEP_PARTS floats, so a prefill's
// layers do not each fault in (and zero) tens of megabytes afresh; a larger call's is `own`.
constexpr int64_t KEEP_PARTS = int64_t{32} << 20;  // 128 MiB

float* chunk_results(int64_t floats, std::unique_ptr<float[]>& own) {
  thread_local std::unique_ptr<float[]> kept;
  thread_local int64_t kept_floats = 0;
  if (floats > KEEP_PARTS) {
    own.reset(new float[floats]);
    return own.get();
  }
  if (floats > kept_floats) {
    kept.reset(new float[floats]);
    kept_floats = floats;
  }
  return kept.get();
}

// What a work item of group g costs, roughly: its rows times its chunk's positions.
int64_t item_cost(const std::vector<int64_t>& group_start, const std::vector<int64_t>& chunk,
                  int64_t g) {
  return (group_start[g + 1] - group_start[g]) * chunk[group_start[g]];
}

// Attends every row into out (rows, heads, D), writing every value of it. Work items are handed
// out one at a time from a shared counter, costliest first (a prefill's late rows read far more
// than its early ones; an even split of the items left one thread idle a fifth of the time).
// Rows [group_start[g], group_start[g + 1]) are a group: rows whose tables agree on every block
// any of them reads, all with the same lo and chunk size; the group reads its first row's table,
// in one pass over the keys and values. A row's result depends on its query, its [lo, len) and
// the cache only (its chunks follow from them; each chunk and the merge see the same operations
// in any group), so it is the same bits in any batch, any group, any step.
void attend_rows(const Shape& s, const std::vector<QueryRow>& rows,
                 const std::vector<int64_t>& group_start, const KvRows& kr, const KvRows& vr,
                 int64_t isa_limit, float* op) {
  const int64_t num_rows = static_cast<int64_t>(rows.size());
  // row b's chunk results are parts [first[b], first[b + 1]), each `chunk[b]` positions
  std::vector<int64_t> chunk(num_rows), first(num_rows + 1, 0);
  int64_t widest = s.block_size;
  for (int64_t b = 0; b < num_rows; ++b) {
    const int64_t span = rows[b].len - rows[b].lo;
    chunk[b] = chunk_size(span, s.block_size);
    widest = std::max(widest, chunk[b]);
    first[b + 1] = first[b] + (span + chunk[b] - 1) / chunk[b];
  }
  std::vector<std::pair<int64_t, int64_t>> items;  // (group, chunk)
  int64_t largest = 1;  // rows in a group
  for (size_t g = 0; g + 1 < group_start.size(); ++g) {
    largest = std::max(largest, group_start[g + 1] - group_start[g]);
    int64_t most = 0;
    for (int64_t b = group_start[g]; b < group_start[g + 1]; ++b) most = std::max(most, first[b + 1] - first[b]);
    for (int64_t c = 0; c < most; ++c) items.emplace_back(static_cast<int64_t>(g), c);
  }
  const int64_t d = s.dim, vd = s.vdim, per_item = s.heads * (vd + 2);
  std::unique_ptr<float[]> own;
  // (row's chunk, head, max|sum|D)
  float* parts = chunk_results(first[num_rows] * per_item, own);
  // costliest first (rows x positions), so that the last items handed out are small ones
  std::stable_sort(items.begin(), items.end(), [&](const auto& a, const auto& b) {
    return item_cost(group_start, chunk, a.first) > item_cost(group_start, chunk, b.first);
  });
  const pagoda_cpu::Isa isa = pagoda_cpu::pick_isa(isa_limit);
  const bool simd = isa != pagoda_cpu::Isa::kScalar;
  const bool wide = isa == pagoda_cpu::Isa::kVnni && d % 16 == 0 && vd % 16 == 0;  // AVX-512 F
  const bool blocked = simd && (d == 64 || d == 128) && vd == d && s.group <= MAX_HEADS;
  const int64_t num_items = static_cast<int64_t>(items.size());
  // a bfloat16 cache on the blocked AVX-512 path is read in place (half the bytes, no scratch)
  const bool bf16_in_place = blocked && wide && kr.type == KvType::kBf16 && vr.type == KvType::kBf16;
  const bool convert = kr.type != KvType::kF32 && !bf16_in_place;
  // a converted item's rows: positions 0, 1, ... of its scratch, through this table
  std::vector<int32_t> identity(convert ? widest / s.block_size + 2 : 0);
  std::iota(identity.begin(), identity.end(), 0);
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, std::min<int64_t>(num_items, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    std::unique_ptr<float[]> scores(new float[largest * s.heads * widest]);  // written before read
    RowWork work[MAX_GROUP];
    std::unique_ptr<const float*[]> krow(new const float*[widest]), vrow(new const float*[widest]);
    // the same for a bfloat16 cache read in place
    std::unique_ptr<const uint16_t*[]> krow16(bf16_in_place ? new const uint16_t*[widest] : nullptr);
    std::unique_ptr<const uint16_t*[]> vrow16(bf16_in_place ? new const uint16_t*[widest] : nullptr);
    const int64_t row = s.kv_heads * d;
    std::unique_ptr<float[]> kbuf(convert ? new float[widest * row] : nullptr);
    std::unique_ptr<float[]> vbuf(convert && vr.data != kr.data ? new float[widest * row] : nullptr);
    for (int64_t it = next_item++; it < num_items; it = next_item++) {
      const auto [g, c] = items[it];
      const int64_t g0 = group_start[g], g1 = group_start[g + 1];
      int64_t begin = rows[g0].lo + c * chunk[g0];  // the group's rows share lo
      int count = 0;
      int64_t most = 0;
      for (int64_t b = g0; b < g1; ++b) {
        const int64_t n = std::min<int64_t>(rows[b].len, begin + chunk[b]) - begin;
        if (n <= 0) continue;
        work[count] = RowWork{rows[b].q, n, n / 4 * 4, parts + (first[b] + c) * per_item,
                              scores.get() + count * s.heads * widest};
        most = std::max(most, n);
        ++count;
      }
      if (count == 0) continue;
      const int32_t* table = rows[g0].table;
      const float* kc = static_cast<const float*>(kr.data);
      const float* vc = static_cast<const float*>(vr.data);
      if (convert) {
        convert_rows(s, kr, vr, table, begin, most, simd, kbuf.get(), vbuf.get());
        kc = kbuf.get();
        vc = vbuf ? vbuf.get() : kbuf.get();
        table = identity.data();
        begin = 0;
      }
      if (bf16_in_place) {
        attend_group_avx512_blocked(s, work, count, static_cast<const uint16_t*>(kr.data),
                                    static_cast<const uint16_t*>(vr.data), table, begin,
                                    krow16.get(), vrow16.get());
      } else if (blocked && wide) {
        attend_group_avx512_blocked(s, work, count, kc, vc, table, begin, krow.get(), vrow.get());
      } else if (blocked) {
        attend_group_avx2_blocked(s, work, count, kc, vc, table, begin, krow.get(), vrow.get());
      } else if (wide) {
        attend_group_avx512(s, work, count, kc, vc, table, begin);
      } else if (simd) {
        attend_group_avx2(s, work, count, kc, vc, table, begin);
      } else {
        attend_group_scalar(s, work, count, kc, vc, table, begin);
      }
    }
  });
  at::parallel_for(0, num_rows, 16, [&](int64_t begin_row, int64_t end_row) {
    for (int64_t b = begin_row; b < end_row; ++b) {
      const int64_t used = first[b + 1] - first[b];
      float* row_out = op + b * s.heads * vd;
      if (used > 0) {
        merge(s, parts + first[b] * per_item, used, row_out);
      } else {
        std::fill(row_out, row_out + s.heads * vd, 0.f);  // a padding row (seq_len 0)
      }
    }
  });
}

// Decode rows: where each group starts (then `batch`): runs of consecutive rows with the same lo
// and chunk size whose tables agree with the group's first on every block any of them reads (a
// request's verification rows), at most MAX_GROUP.
std::vector<int64_t> group_starts(const Shape& s, const std::vector<QueryRow>& rows) {
  const int64_t batch = static_cast<int64_t>(rows.size());
  std::vector<int64_t> starts{0};
  int64_t longest = batch > 0 ? rows[0].len : 0;  // in the current group
  for (int64_t b = 1; b < batch; ++b) {
    const int64_t g = starts.back();
    const int64_t reach = std::max<int64_t>(longest, rows[b].len);
    const int64_t blocks = (reach + s.block_size - 1) / s.block_size;
    const bool same = b - g < MAX_GROUP && rows[b].len > 0 && rows[g].len > 0 &&
                      rows[b].lo == rows[g].lo &&
                      chunk_size(rows[b].len - rows[b].lo, s.block_size) ==
                          chunk_size(rows[g].len - rows[g].lo, s.block_size) &&
                      std::equal(rows[g].table, rows[g].table + blocks, rows[b].table);
    if (same) {
      longest = reach;
    } else {
      starts.push_back(b);
      longest = rows[b].len;
    }
  }
  starts.push_back(batch);
  return starts;
}

// The checks both entry points make; returns the shape. value_dim 0: values from v_cache, of
// the keys' shape; value_dim > 0: a latent cache (multi-head latent attention), whose values are
// the first value_dim of each key row, v_cache empty (its last dimension 0).
Shape check_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                   int64_t value_dim) {
  TORCH_CHECK(q.dim() == 3, "q must be (num_rows, H, D)");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "caches: (num_blocks, block_size, Hkv, D)");
  if (value_dim == 0) {
    TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache, v_cache: the same shape");
  } else {
    TORCH_CHECK(value_dim > 0 && value_dim <= k_cache.size(3) && v_cache.size(3) == 0,
                "a latent cache: 0 < value_dim <= the key width, v_cache empty");
  }
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache, v_cache: the same dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens: int32");
  // a view of the runner's wider table buffer: rows read in place with their stride
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1, "block_tables: (B, W), rows contiguous");
  const int64_t vdim = value_dim > 0 ? value_dim : q.size(2);
  Shape s{q.size(1), k_cache.size(2), 0, q.size(2), vdim, k_cache.size(1),
          block_tables.size(1), block_tables.stride(0), static_cast<float>(scale)};
  TORCH_CHECK(k_cache.size(3) == s.dim, "head_dim of q and the cache differ");
  TORCH_CHECK(s.heads % s.kv_heads == 0, "query heads must be a multiple of kv heads");
  s.group = s.heads / s.kv_heads;
  TORCH_CHECK(block_tables.size(0) == seq_lens.size(0), "one table row and length per request");
  return s;
}

// One cache tensor's rows, with its scales: given exactly where the dtype is int8 or float8,
// (num_blocks, block_size, Hkv) float32.
KvRows cache_rows(const at::Tensor& cache, const c10::optional<at::Tensor>& scale) {
  KvRows r;
  r.data = cache.data_ptr();
  r.type = pagoda_cpu::kv_type(cache.scalar_type());
  r.kv_heads = cache.size(2);
  r.width = cache.size(3);
  const bool has = scale.has_value() && scale->defined();
  TORCH_CHECK(has == pagoda_cpu::kv_scaled(r.type),
              "scales are given with an int8 or float8 cache, and only then");
  if (has) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
                    scale->sizes() == cache.sizes().slice(0, 3),
                "scales: float32 (num_blocks, block_size, Hkv), contiguous");
    r.scale = scale->data_ptr<float>();
  }
  return r;
}

// The keys' rows and the values': v_cache's, or a latent cache's own key rows (their first
// vdim values, with the keys' scales).
std::pair<KvRows, KvRows> kv_rows(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const c10::optional<at::Tensor>& k_scale,
                                  const c10::optional<at::Tensor>& v_scale, int64_t value_dim) {
  const KvRows k = cache_rows(k_cache, k_scale);
  if (value_dim > 0) return {k, k};
  return {k, cache_rows(v_cache, v_scale)};
}

// Request b's table covers its seq_len within the cache: every block from position lo's on.
void check_table(const Shape& s, const int32_t* table, int64_t lo, int64_t seq_len,
                 int64_t num_blocks) {
  TORCH_CHECK(seq_len >= 0 && seq_len <= s.width * s.block_size, "seq_len beyond the block table");
  for (int64_t i = lo / s.block_size; i < (seq_len + s.block_size - 1) / s.block_size; ++i) {
    TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "block id ", table[i], " outside the cache");
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window,
                                  int64_t isa_limit, int64_t value_dim,
                                  const c10::optional<at::Tensor>& k_scale,
                                  const c10::optional<at::Tensor>& v_scale) {
  const Shape s = check_inputs(q_in, k_cache, v_cache, block_tables, seq_lens, scale, value_dim);
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: full attention)");
  const at::Tensor q = q_in.to(at::kFloat).contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  const int64_t batch = q.size(0);
  TORCH_CHECK(lens.size(0) == batch, "one table row and length per request");
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  const float* qp = q.data_ptr<float>();
  std::vector<QueryRow> rows(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t lo = window_start(lp[b], window);
    check_table(s, tp + b * s.table_stride, lo, lp[b], k_cache.size(0));
    rows[b] = QueryRow{qp + b * s.heads * s.dim, tp + b * s.table_stride, lo, lp[b]};
  }
  const auto [kr, vr] = kv_rows(k_cache, v_cache, k_scale, v_scale, value_dim);
  auto out = at::empty({batch, s.heads, s.vdim}, at::kFloat);
  attend_rows(s, rows, group_starts(s, rows), kr, vr, isa_limit, out.data_ptr<float>());
  return out.to(q_in.scalar_type());
}

// Any mix of prefill chunks and decodes: request r's query rows are q[query_start[r] ..
// query_start[r + 1]), the last of its seq_lens[r] positions, each attending to the keys up to
// its own position (from its window's start); they are grouped by up to MAX_GROUP rows of one lo
// and chunk size. A row's bits are those paged_decode_attention gives a decode at its position.
at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& query_start, const at::Tensor& seq_lens, double scale,
                           int64_t window, int64_t isa_limit, int64_t value_dim,
                           const c10::optional<at::Tensor>& k_scale,
                           const c10::optional<at::Tensor>& v_scale) {
  const Shape s = check_inputs(q_in, k_cache, v_cache, block_tables, seq_lens, scale, value_dim);
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: full attention)");
  TORCH_CHECK(query_start.scalar_type() == at::kInt && query_start.dim() == 1 &&
                  query_start.size(0) == seq_lens.size(0) + 1,
              "query_start: int32 (num_requests + 1,)");
  const at::Tensor q = q_in.to(at::kFloat).contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  const at::Tensor starts = query_start.contiguous();
  const int64_t num_reqs = lens.size(0), num_rows = q.size(0);
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* qs = starts.data_ptr<int32_t>();
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  const float* qp = q.data_ptr<float>();
  TORCH_CHECK(qs[0] == 0 && qs[num_reqs] == num_rows, "query_start must run from 0 to the rows of q");
  std::vector<QueryRow> rows(num_rows);
  std::vector<int64_t> group_start;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = qs[r + 1] - qs[r];
    TORCH_CHECK(q_len >= 1 && q_len <= lp[r], "request ", r, ": query rows must be 1..seq_len");
    const int32_t* table = tp + r * s.table_stride;
    check_table(s, table, window_start(lp[r] - q_len + 1, window), lp[r], k_cache.size(0));
    int64_t group_chunk = 0, group_lo = 0;
    for (int64_t t = qs[r]; t < qs[r + 1]; ++t) {
      const int64_t len = lp[r] - (qs[r + 1] - t) + 1;
      const int64_t lo = window_start(len, window);
      rows[t] = QueryRow{qp + t * s.heads * s.dim, table, lo, len};
      const int64_t c = chunk_size(len - lo, s.block_size);
      if (t == qs[r] || c != group_chunk || lo != group_lo || t - group_start.back() >= MAX_GROUP) {
        group_start.push_back(t);
        group_chunk = c;
        group_lo = lo;
      }
    }
  }
  group_start.push_back(num_rows);
  const auto [kr, vr] = kv_rows(k_cache, v_cache, k_scale, v_scale, value_dim);
  auto out = at::empty({num_rows, s.heads, s.vdim}, at::kFloat);
  attend_rows(s, rows, group_start, kr, vr, isa_limit, out.data_ptr<float>());
  return out.to(q_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window, int isa_limit, int value_dim=0, "
      "Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor query_start, Tensor seq_lens, float scale, int window, int isa_limit, "
      "int value_dim=0, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_attention", &paged_attention);
}
