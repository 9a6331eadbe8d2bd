// Quantized matmuls for the CPU decode path: y (M, N) = x (M, K) @ w (N, K)^T with w kept as
// 32-wide groups of integer codes, w[n, k] = scale[n, g] * code[n, k] + offset[n, g] (g = k / 32),
// and x quantized per 32-wide group to int8 (as GGUF's Q8 activations): x[m, k] ~ xd[m, g] * q.
//
//   y[m, n] = sum_g scale[n, g] * xd[m, g] * dot(code[n, g], q[m, g]) + offset[n, g] * xs[m, g]
//
// with xs[m, g] = xd[m, g] * sum(q[m, g]). Integer dot products of 32 codes at a time: AVX2
// (maddubs + madd) or AVX-512 VNNI (dpbusd), chosen at run time; a scalar path elsewhere.
// Output rows are split over torch's intra-op threads.
//
// 4-bit weights come in tiles of 4 output rows (q4_matmul): for each tile, its groups one after
// the other, 80 bytes each: the 4 rows' codes (16 bytes a row, GGUF's packing: byte j = code[j]
// | code[j+16] << 4), their 4 scales, then their 4 offsets, as fp16 (Q4_0 / Q4_1 store fp16).
// A thread reads one sequential stream, a cache line and a quarter per group of 4 rows.
// 8-bit codes (q8_matmul) are int8 rows (-128..127; Q8_0's or the int8 LM head's), no offsets.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t TILE = 4;        // activation rows per pass over int8 weights
constexpr int64_t Q4_ROWS = 4;     // output rows per 4-bit tile
constexpr int64_t Q4_BYTES = 80;   // one group of a 4-bit tile: 4 x 16 codes, 4 + 4 fp16

// ---- activations -----------------------------------------------------------------------------

void quantize_group_scalar(const float* src, int8_t* q, float* xd, float* xs) {
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
}

// The scalar path's arithmetic (x * (1 / d), rounded to nearest even), 32 values at a time.
__attribute__((target("avx2,fma"))) void quantize_group_avx2(const float* src, int8_t* q,
                                                             float* xd, float* xs) {
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
  *xs = d * static_cast<float>(_mm_cvtsi128_si32(s));
}

void quantize_rows(const float* x, int64_t m, int64_t k, bool simd, int8_t* q, float* xd,
                   float* xs) {
  const int64_t groups = k / GROUP;
  for (int64_t i = 0; i < m * groups; ++i) {
    if (simd) {
      quantize_group_avx2(x + i * GROUP, q + i * GROUP, xd + i, xs + i);
    } else {
      quantize_group_scalar(x + i * GROUP, q + i * GROUP, xd + i, xs + i);
    }
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

float fp16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// ---- 4-bit tiles: out[r] = row r of the tile times one activation row (q, xd, xs) ------------

void tile_q4_scalar(const uint8_t* t, const int8_t* q, const float* xd, const float* xs,
                    int64_t groups, float* out) {
  float acc[Q4_ROWS] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* b = t + g * Q4_BYTES;
    for (int r = 0; r < Q4_ROWS; ++r) {
      const int d = dot4_scalar(b + 16 * r, q + g * GROUP);
      acc[r] += static_cast<float>(d) * (fp16(b + 64 + 2 * r) * xd[g]) + fp16(b + 72 + 2 * r) * xs[g];
    }
  }
  for (int r = 0; r < Q4_ROWS; ++r) out[r] = acc[r];
}

// [r0 x4, r1 x4] and [r2 x4, r3 x4] (lanes of 8 floats) -> the four row sums, in order
__attribute__((target("avx2,fma"))) inline __m128 row_sums(__m256 a01, __m256 a23) {
  __m256 h = _mm256_hadd_ps(a01, a23);  // [r0 r0 r2 r2 | r1 r1 r3 r3] (pair sums)
  h = _mm256_hadd_ps(h, h);             // [r0 r2 r0 r2 | r1 r3 r1 r3]
  return _mm_unpacklo_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

__attribute__((target("avx2,fma,f16c"))) void tile_q4_avx2(const uint8_t* t, const int8_t* q,
                                                           const float* xd, const float* xs,
                                                           int64_t groups, float* out) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i rows01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i rows23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
  __m256 acc01 = _mm256_setzero_ps(), acc23 = _mm256_setzero_ps();
  __m128 acc_off = _mm_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* b = t + g * Q4_BYTES;
    const __m256i qlo = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * GROUP)));
    const __m256i qhi = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * GROUP + 16)));
    const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 64)));
    const __m256 sd = _mm256_mul_ps(dm, _mm256_set1_ps(xd[g]));
    // |15 * 127 * 2| twice fits int16: the two maddubs add without saturating
    const __m256i v01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
    const __m256i p01 = _mm256_add_epi16(
        _mm256_maddubs_epi16(_mm256_and_si256(v01, mask), qlo),
        _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v01, 4), mask), qhi));
    acc01 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p01, ones)),
                            _mm256_permutevar8x32_ps(sd, rows01), acc01);
    const __m256i v23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32));
    const __m256i p23 = _mm256_add_epi16(
        _mm256_maddubs_epi16(_mm256_and_si256(v23, mask), qlo),
        _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v23, 4), mask), qhi));
    acc23 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p23, ones)),
                            _mm256_permutevar8x32_ps(sd, rows23), acc23);
    acc_off = _mm_fmadd_ps(_mm256_extractf128_ps(dm, 1), _mm_set1_ps(xs[g]), acc_off);
  }
  _mm_storeu_ps(out, _mm_add_ps(row_sums(acc01, acc23), acc_off));
}

// The tile's 64 code bytes in one register: dpbusd gives lanes 4r..4r+3 to row r.
__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni"))) inline __m512
tile_group_avx512(const uint8_t* b, const int8_t* q, float xd, __m512 acc) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i v = _mm512_loadu_si512(b);
  const __m512i qlo = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __m512i qhi =
      _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
  const __m512i lo = _mm512_and_si512(v, mask);
  const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
  const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, qlo), hi, qhi);
  const __m256 sd = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 64))),
                                  _mm256_set1_ps(xd));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(sd)), acc);
}

__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni"))) void
tile_q4_avx512(const uint8_t* t, const int8_t* q, const float* xd, const float* xs, int64_t groups,
               float* out) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();  // even and odd groups
  __m128 off0 = _mm_setzero_ps(), off1 = _mm_setzero_ps();
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    const uint8_t* b = t + g * Q4_BYTES;
    acc0 = tile_group_avx512(b, q + g * GROUP, xd[g], acc0);
    acc1 = tile_group_avx512(b + Q4_BYTES, q + (g + 1) * GROUP, xd[g + 1], acc1);
    off0 = _mm_fmadd_ps(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 72))),
                        _mm_set1_ps(xs[g]), off0);
    off1 = _mm_fmadd_ps(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + Q4_BYTES + 72))),
                        _mm_set1_ps(xs[g + 1]), off1);
  }
  if (g < groups) {
    const uint8_t* b = t + g * Q4_BYTES;
    acc0 = tile_group_avx512(b, q + g * GROUP, xd[g], acc0);
    off0 = _mm_fmadd_ps(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 72))),
                        _mm_set1_ps(xs[g]), off0);
  }
  const __m512 acc = _mm512_add_ps(acc0, acc1);
  const __m128 sums = row_sums(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
  _mm_storeu_ps(out, _mm_add_ps(sums, _mm_add_ps(off0, off1)));
}

// ---- int8 rows: one output row for up to TILE activation rows --------------------------------

__attribute__((target("avx2"))) inline __m256i dot_u8s8_avx2(__m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);  // |128 * 127 * 2| fits
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

// Signed codes: |w| as unsigned, its sign moved onto the activations. Defined twice under
// different targets (a function compiled for AVX-512 may use it anywhere, so the AVX2 one must
// not be).
#define PAGODA_Q8_ROW_BODY(DOT)                                                                \
  __m256 acc[TILE];                                                                            \
  for (int64_t r = 0; r < TILE; ++r) acc[r] = _mm256_setzero_ps();                             \
  for (int64_t g = 0; g < groups; ++g) {                                                       \
    const __m256i sign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * GROUP)); \
    const __m256i u = _mm256_sign_epi8(sign, sign);                                            \
    const float sg = scale[g * sstep];                                                         \
    for (int64_t r = 0; r < rows; ++r) {                                                       \
      const __m256i s = _mm256_sign_epi8(                                                      \
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * groups * GROUP + g * GROUP)), \
          sign);                                                                               \
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT(u, s)),                                  \
                               _mm256_set1_ps(sg * xd[r * groups + g]), acc[r]);               \
    }                                                                                          \
  }                                                                                            \
  for (int64_t r = 0; r < rows; ++r) y[r * y_stride] = hsum(acc[r]);

__attribute__((target("avx2,fma"))) void row_q8_avx2(const int8_t* w, const float* scale,
                                                     const int8_t* q, const float* xd,
                                                     int64_t groups, int64_t rows, float* y,
                                                     int64_t y_stride, int64_t sstep) {
  PAGODA_Q8_ROW_BODY(dot_u8s8_avx2)
}

__attribute__((target("avx2,fma,avx512f,avx512vl,avx512vnni"))) void row_q8_vnni(
    const int8_t* w, const float* scale, const int8_t* q, const float* xd, int64_t groups,
    int64_t rows, float* y, int64_t y_stride, int64_t sstep) {
  PAGODA_Q8_ROW_BODY(dot_u8s8_vnni)
}

void row_q8_scalar(const int8_t* w, const float* scale, const int8_t* q, const float* xd,
                   int64_t groups, int64_t rows, float* y, int64_t y_stride, int64_t sstep) {
  for (int64_t r = 0; r < rows; ++r) {
    float sum = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const int d = dot8_scalar(w + g * GROUP, q + r * groups * GROUP + g * GROUP);
      sum += static_cast<float>(d) * (scale[g * sstep] * xd[r * groups + g]);
    }
    y[r * y_stride] = sum;
  }
}

// ---- dispatch ----------------------------------------------------------------------------------

enum class Isa { kScalar = 0, kAvx2 = 1, kVnni = 2 };

Isa best_isa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
      if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")) {
        return Isa::kVnni;
      }
      return Isa::kAvx2;
    }
    return Isa::kScalar;
  }();
  return isa;
}

Isa pick_isa(int64_t isa_limit) {
  return static_cast<Isa>(std::min<int64_t>(static_cast<int64_t>(best_isa()), isa_limit));
}

struct Activations {
  at::Tensor q, xd, xs;
};

Activations quantize(const at::Tensor& x, Isa isa) {
  const int64_t m = x.size(0), k = x.size(1);
  Activations a{at::empty({m, k}, at::kChar), at::empty({m, k / GROUP}, at::kFloat),
                at::empty({m, k / GROUP}, at::kFloat)};
  quantize_rows(x.data_ptr<float>(), m, k, isa != Isa::kScalar, a.q.data_ptr<int8_t>(),
                a.xd.data_ptr<float>(),
                a.xs.data_ptr<float>());
  return a;
}

at::Tensor float_rows(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2, "x must be (M, K)");
  TORCH_CHECK(x_in.size(1) % GROUP == 0, "K must be a multiple of 32, got ", x_in.size(1));
  return x_in.to(at::kFloat).contiguous();
}

// packed: (ceil(n / 4), K / 32, 80) uint8, the tiles described at the top
at::Tensor q4_matmul(const at::Tensor& x_in, const at::Tensor& packed, int64_t n,
                     int64_t isa_limit) {
  const at::Tensor x = float_rows(x_in);
  const int64_t m = x.size(0), k = x.size(1), groups = k / GROUP;
  const int64_t tiles = (n + Q4_ROWS - 1) / Q4_ROWS;
  TORCH_CHECK(packed.dtype() == at::kByte && packed.is_contiguous() && packed.dim() == 3,
              "packed: contiguous uint8 (tiles, groups, 80)");
  TORCH_CHECK(packed.size(0) == tiles && packed.size(1) == groups && packed.size(2) == Q4_BYTES,
              "packed shape: expected (", tiles, ", ", groups, ", ", Q4_BYTES, ") for N=", n,
              ", K=", k, ", got ", packed.sizes());
  const Isa isa = pick_isa(isa_limit);
  const Activations a = quantize(x, isa);
  auto y = at::empty({m, n}, at::kFloat);
  const auto* w = packed.data_ptr<uint8_t>();
  const int8_t* qp = a.q.data_ptr<int8_t>();
  const float* xdp = a.xd.data_ptr<float>();
  const float* xsp = a.xs.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    float out[Q4_ROWS];
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = w + t * groups * Q4_BYTES;
      const int64_t valid = std::min(Q4_ROWS, n - t * Q4_ROWS);
      for (int64_t r = 0; r < m; ++r) {  // the tile stays in L1 across activation rows
        const int8_t* qr = qp + r * k;
        const float* xdr = xdp + r * groups;
        const float* xsr = xsp + r * groups;
        if (isa == Isa::kVnni) {
          tile_q4_avx512(tile, qr, xdr, xsr, groups, out);
        } else if (isa == Isa::kAvx2) {
          tile_q4_avx2(tile, qr, xdr, xsr, groups, out);
        } else {
          tile_q4_scalar(tile, qr, xdr, xsr, groups, out);
        }
        std::memcpy(yp + r * n + t * Q4_ROWS, out, valid * sizeof(float));
      }
    }
  });
  return y;
}

// codes: (N, K) int8; scale: (N, K / 32) or (N, 1) (one scale for a whole row)
at::Tensor q8_matmul(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scale,
                     int64_t isa_limit) {
  const at::Tensor x = float_rows(x_in);
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0), groups = k / GROUP;
  TORCH_CHECK(codes.dtype() == at::kChar, "codes dtype: int8");
  TORCH_CHECK(codes.is_contiguous() && codes.size(1) == k, "codes shape");
  TORCH_CHECK(scale.dtype() == at::kFloat && scale.is_contiguous(), "scale: float32");
  TORCH_CHECK(scale.size(0) == n && (scale.size(1) == groups || scale.size(1) == 1), "scale shape");
  const int64_t sstep = scale.size(1) == 1 ? 0 : 1;
  const Isa isa = pick_isa(isa_limit);
  const Activations a = quantize(x, isa);
  auto y = at::empty({m, n}, at::kFloat);
  const auto* w = codes.data_ptr<int8_t>();
  const float* sc = scale.data_ptr<float>();
  const int8_t* qp = a.q.data_ptr<int8_t>();
  const float* xdp = a.xd.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = 0; t < m; t += TILE) {
      const int64_t rows = std::min(TILE, m - t);
      for (int64_t row = begin; row < end; ++row) {
        const int8_t* wr = w + row * k;
        const float* sr = sc + row * scale.size(1);
        const int8_t* qt = qp + t * k;
        float* yt = yp + t * n + row;
        if (isa == Isa::kVnni) {
          row_q8_vnni(wr, sr, qt, xdp + t * groups, groups, rows, yt, n, sstep);
        } else if (isa == Isa::kAvx2) {
          row_q8_avx2(wr, sr, qt, xdp + t * groups, groups, rows, yt, n, sstep);
        } else {
          row_q8_scalar(wr, sr, qt, xdp + t * groups, groups, rows, yt, n, sstep);
        }
      }
    }
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x_in) {
  const Activations a = quantize(float_rows(x_in), best_isa());
  return {a.q, a.xd, a.xs};
}

int64_t isa() { return static_cast<int64_t>(best_isa()); }

}  // namespace

// torch.ops.pagoda_cpu.*: custom ops, so torch.compile keeps them in its graph (their shapes are
// registered in Python, pagoda/kernels/cpu/__init__.py).
TORCH_LIBRARY(pagoda_cpu, m) {
  m.def("q4_matmul(Tensor x, Tensor packed, int n, int isa_limit) -> Tensor");
  m.def("q8_matmul(Tensor x, Tensor codes, Tensor scale, int isa_limit) -> Tensor");
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("isa() -> int", &isa);
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("q4_matmul", &q4_matmul);
  m.impl("q8_matmul", &q8_matmul);
  m.impl("quantize_activations", &quantize_activations);
}
