// Paged decode attention on CPU: one query token per request against its keys and values read
// in place from the paged cache (no gather), float32.
//
//   q (B, H, D); k_cache, v_cache (num_blocks, block_size, Hkv, D); block_tables (B, W) int32;
//   seq_lens (B,) int32 -> out (B, H, D), out[b, h] = softmax(scale * q[b, h] . K[b, :L]) @ V
//
// Query heads h share kv head h / (H / Hkv) (GQA). Work items are (group of requests, chunk of
// positions), split over torch's intra-op threads, so that one long request still uses every
// thread; a group is one request, or a request's verification rows (one block table), which
// share a pass over the keys and values. Each item keeps, per request in it, its chunk's max,
// sum of exponentials and weighted values per query head, and a request's chunks are merged
// afterwards (flash-decoding). A request's chunk size follows from
// its own length only, so its output is the same bits whatever batch it runs in (a speculative
// verification row equals the plain step at that length). A request with seq_len 0 (a padding
// row) gets zeros. Scalar, AVX2 + FMA and (head width a multiple of 16) AVX-512 paths.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t MAX_CHUNK = 256;  // positions per work item at most
constexpr int64_t MAX_GROUP = 8;    // requests sharing one pass over their keys and values

struct Shape {
  int64_t heads, kv_heads, group, dim, block_size, width, table_stride;
  float scale;
};

// ---- math: scalar, AVX2, AVX-512 --------------------------------------------------------------

inline float exp_nonpositive(float x);

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
  const int64_t d = s.dim, row = s.kv_heads * d;                                               \
  auto at = [&](const float* cache, int64_t p) {                                               \
    const int64_t pos = begin + p;                                                             \
    const int64_t block = table[pos / s.block_size];                                           \
    return cache + (block * s.block_size + pos % s.block_size) * row;                          \
  };                                                                                           \
  int64_t most4 = 0;                                                                           \
  for (int i = 0; i < count; ++i) most4 = std::max(most4, w[i].n4);                            \
  for (int64_t p = 0; p < most4; p += 4) {                                                     \
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
      float* out = r.part + h * (d + 2);                                                       \
      out[0] = *std::max_element(sh, sh + r.n);                                                \
      out[1] = exp_shifted_sum_##SUFFIX(sh, r.n, out[0]);                                      \
      std::fill(out + 2, out + 2 + d, 0.f);                                                    \
    }                                                                                          \
  }                                                                                            \
  for (int64_t p = 0; p < most4; p += 4) {                                                     \
    const float* r4[4] = {at(vc, p), at(vc, p + 1), at(vc, p + 2), at(vc, p + 3)};             \
    for (int64_t kh = 0; kh < s.kv_heads; ++kh) {                                              \
      const float* v4[4] = {r4[0] + kh * d, r4[1] + kh * d, r4[2] + kh * d, r4[3] + kh * d};   \
      for (int i = 0; i < count; ++i) {                                                        \
        if (p + 4 > w[i].n4) continue;                                                         \
        weighted4_##WIDE(w[i].scores + kh * s.group * w[i].n + p, v4, s.group, d,              \
                         w[i].part + kh * s.group * (d + 2) + 2, d + 2, w[i].n);               \
      }                                                                                        \
    }                                                                                          \
  }                                                                                            \
  for (int i = 0; i < count; ++i) {                                                            \
    const RowWork& r = w[i];                                                                   \
    for (int64_t p = r.n4; p < r.n; ++p) {                                                     \
      for (int64_t kh = 0; kh < s.kv_heads; ++kh) {                                            \
        weighted_##SUFFIX(r.scores + kh * s.group * r.n + p, at(vc, p) + kh * d, s.group, d,   \
                          r.part + kh * s.group * (d + 2) + 2, d + 2, r.n);                    \
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

// Merges a request's chunks into its query heads' outputs: exp(m_c - M) rescales each.
void merge(const Shape& s, const float* parts, int64_t num_chunks, float* out) {
  const int64_t d = s.dim, stride = s.heads * (d + 2);  // floats per chunk
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

// Positions per work item of a request of `length`: split into about two items per thread, in
// whole blocks, at most MAX_CHUNK.
int64_t chunk_size(int64_t length, int64_t block_size) {
  const int64_t pieces = 2 * std::max(1, at::get_num_threads());
  int64_t size = (length + pieces - 1) / pieces;
  size = (size + block_size - 1) / block_size * block_size;
  return std::clamp<int64_t>(size, block_size, std::max(block_size, MAX_CHUNK));
}

// Where each group of requests starts (then `batch`): runs of consecutive requests with the same
// chunk size whose tables agree with the group's first on every block any of them reads (a
// request's verification rows), at most MAX_GROUP; the group reads its first one's table.
std::vector<int64_t> group_starts(const Shape& s, const int32_t* lp, const int32_t* tp,
                                  const std::vector<int64_t>& chunk, int64_t batch) {
  std::vector<int64_t> starts{0};
  int64_t longest = batch > 0 ? lp[0] : 0;  // in the current group
  for (int64_t b = 1; b < batch; ++b) {
    const int64_t g = starts.back();
    const int64_t reach = std::max<int64_t>(longest, lp[b]);
    const int64_t blocks = (reach + s.block_size - 1) / s.block_size;
    const int32_t* first_row = tp + g * s.table_stride;
    const bool same = b - g < MAX_GROUP && chunk[b] == chunk[g] && lp[b] > 0 && lp[g] > 0 &&
                      std::equal(first_row, first_row + blocks, tp + b * s.table_stride);
    if (same) {
      longest = reach;
    } else {
      starts.push_back(b);
      longest = lp[b];
    }
  }
  starts.push_back(batch);
  return starts;
}

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t isa_limit) {
  TORCH_CHECK(q_in.dim() == 3, "q must be (B, H, D)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache, v_cache: (num_blocks, block_size, Hkv, D), the same shape");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat,
              "caches must be float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens: int32");
  const at::Tensor q = q_in.to(at::kFloat).contiguous();
  // a view of the runner's wider table buffer: rows read in place with their stride
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1, "block_tables: (B, W), rows contiguous");
  const at::Tensor& tables = block_tables;
  const at::Tensor lens = seq_lens.contiguous();
  const int64_t batch = q.size(0);
  Shape s{q.size(1), k_cache.size(2), 0, q.size(2), k_cache.size(1), tables.size(1),
          tables.stride(0), static_cast<float>(scale)};
  TORCH_CHECK(k_cache.size(3) == s.dim, "head_dim of q and the cache differ");
  TORCH_CHECK(s.heads % s.kv_heads == 0, "query heads must be a multiple of kv heads");
  s.group = s.heads / s.kv_heads;
  TORCH_CHECK(tables.size(0) == batch && lens.size(0) == batch, "one table row and length per request");
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t num_blocks = k_cache.size(0);
  // request b's chunk results are parts [first[b], first[b + 1]), each `chunk[b]` positions
  std::vector<int64_t> chunk(batch), first(batch + 1, 0);
  int64_t widest = s.block_size;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= s.width * s.block_size, "seq_len beyond the block table");
    for (int64_t i = 0; i < (lp[b] + s.block_size - 1) / s.block_size; ++i) {
      const int32_t block = tp[b * s.table_stride + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " outside the cache");
    }
    chunk[b] = chunk_size(lp[b], s.block_size);
    widest = std::max(widest, chunk[b]);
    first[b + 1] = first[b] + (lp[b] + chunk[b] - 1) / chunk[b];
  }
  const std::vector<int64_t> group_start = group_starts(s, lp, tp, chunk, batch);
  std::vector<std::pair<int64_t, int64_t>> items;  // (group, chunk)
  int64_t largest = 1;  // requests in a group
  for (size_t g = 0; g + 1 < group_start.size(); ++g) {
    largest = std::max(largest, group_start[g + 1] - group_start[g]);
    int64_t most = 0;
    for (int64_t b = group_start[g]; b < group_start[g + 1]; ++b) most = std::max(most, first[b + 1] - first[b]);
    for (int64_t c = 0; c < most; ++c) items.emplace_back(static_cast<int64_t>(g), c);
  }
  const int64_t d = s.dim, per_item = s.heads * (d + 2);
  auto out = at::zeros({batch, s.heads, d}, at::kFloat);
  std::vector<float> parts(first[batch] * per_item);  // (request's chunk, head, max|sum|D)
  const pagoda_cpu::Isa isa = pagoda_cpu::pick_isa(isa_limit);
  const bool simd = isa != pagoda_cpu::Isa::kScalar;
  const bool wide = isa == pagoda_cpu::Isa::kVnni && d % 16 == 0;  // AVX-512 F among VNNI's
  const float* qp = q.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, num_items, 1, [&](int64_t begin_item, int64_t end_item) {
    std::unique_ptr<float[]> scores(new float[largest * s.heads * widest]);  // written before read
    RowWork work[MAX_GROUP];
    for (int64_t it = begin_item; it < end_item; ++it) {
      const auto [g, c] = items[it];
      const int64_t g0 = group_start[g], g1 = group_start[g + 1], begin = c * chunk[g0];
      int count = 0;
      for (int64_t b = g0; b < g1; ++b) {
        const int64_t n = std::min<int64_t>(lp[b], begin + chunk[b]) - begin;
        if (n <= 0) continue;
        work[count] = RowWork{qp + b * s.heads * d, n, n / 4 * 4, parts.data() + (first[b] + c) * per_item,
                              scores.get() + count * s.heads * widest};
        ++count;
      }
      if (count == 0) continue;
      const int32_t* table = tp + g0 * s.table_stride;
      if (wide) {
        attend_group_avx512(s, work, count, kc, vc, table, begin);
      } else if (simd) {
        attend_group_avx2(s, work, count, kc, vc, table, begin);
      } else {
        attend_group_scalar(s, work, count, kc, vc, table, begin);
      }
    }
  });
  float* op = out.data_ptr<float>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t used = first[b + 1] - first[b];
    if (used > 0) merge(s, parts.data() + first[b] * per_item, used, op + b * s.heads * d);
  }
  return out.to(q_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int isa_limit) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
