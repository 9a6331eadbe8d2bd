// Quantized matmuls on CPU, every step size: y (M, N) = x (M, K) @ w (N, K)^T with w kept as
// 32-wide groups of integer codes and x quantized per 32-wide group to int8 (common.h).
//
// Weights come in tiles of 16 output rows; per tile, its groups one after the other. Inside a
// group the codes are laid out for VNNI's dpbusd: one 64-byte block holds 4 consecutive codes of
// each of the 16 rows (bytes 4j..4j+3: row j), so one dpbusd against 4 broadcast activation bytes
// adds 4 products to each row's 32-bit lane, and a group's epilogue (convert, scale, add) is
// shared by 16 rows. The tile's unpacked codes stay in registers across up to 8 activation rows
// (4 on AVX2; its plain 4-bit forms take a block's codes against 8 rows at a time).
//
//   4-bit (q4x16_matmul), w[n, k] = scale[n, g] * code[n, k] + offset[n, g], code in [0, 15]:
//     320 bytes a group: 4 blocks of 64 (block s, byte 4j + b: code[j, 8s + b] in the low nibble,
//     code[j, 8s + 4 + b] in the high one), then the 16 rows' scales, then their offsets, fp16.
//     y[m, n] = sum_g scale * xd * dot(code, q) + offset * xs
//   5-bit (q4x16_matmul on 352-byte groups; GGUF Q5_0 as the file holds it, 22 bytes / 32
//     values), w[n, k] = scale[n, g] * (code[n, k] - 16), code in [0, 31]: the low nibbles as
//     the 4-bit blocks, then 8 masks of 64 bits (mask 2s + h, bit 4j + b: the fifth bit of
//     code[j, 8s + 4h + b], the code the 4-bit block s holds in its low (h = 0) or high nibble),
//     then the 16 rows' scales, fp16; the offset is -16 * scale.
//   GGUF Q4_0 (288 bytes: 16 x 18), w = scale * (code - 8): the 4-bit blocks, then the scales.
//   GGUF Q5_1 (384 bytes: 16 x 24), w = scale * code + offset, code in [0, 31]: the 5-bit
//     layout, then the offsets after the scales.
//   GGUF IQ4_NL (288 bytes: 16 x 18), w = scale * IQ4[code], code in [0, 15] indexing the
//     file's 16 int8 values (kIq4): the 4-bit blocks, then the scales.
//   GGUF Q4_K (q4x16_matmul on 2368-byte super-blocks of 8 groups: 16 x 148 bytes / 256 values,
//     the file's 144 with its 6-bit numbers a byte each), w = d * sc[g] * code - dmin * m[g],
//     code in [0, 15], sc and m 6-bit: the 8 groups' 4-bit blocks, then per group the rows' sc,
//     then their m, a byte each, then the rows' d and -dmin, fp16.
//   GGUF Q5_K (2880-byte super-blocks: 16 x 180, the file's 176 with Q4_K's 6-bit numbers a
//     byte each): Q4_K's layout with each group's 4-bit blocks followed by its 8 masks of
//     fifth bits (as the 5-bit form's); code in [0, 31].
//   GGUF IQ4_XS (2208-byte super-blocks: 16 x 138, the file's 136 with its 6-bit sub-scales a
//     byte each), w = d * sc[g] * IQ4[code]: the 8 groups' 4-bit blocks, then per group the
//     rows' sc (int8, the file's 6-bit number less 32), then the rows' d, fp16.
//   GGUF Q6_K (q4x16_matmul on 3360-byte super-blocks: 16 x 210 bytes / 256 values),
//     w = d * sc[g, half] * (code - 32), code in [0, 63], sc int8 per 16 values: per group the
//     4-bit blocks of the low nibbles and 4 x 32 bytes of top 2 bits (block s's byte p % 32,
//     nibble p / 32, for its byte p: bits 0-1 the low nibble's code's, 2-3 the high one's),
//     then per group the rows' two int8 scales, then the rows' d, fp16. The halves' dot products
//     are kept apart, each less 32 * the half's sum of activation codes.
//   GGUF Q3_K (1824-byte super-blocks: 16 x 114, the file's 110 with its 6-bit sub-scales a
//     byte each), w = d * sc[g, half] * (code - 4), code in [0, 7]: per group 2 blocks of 64
//     bytes of 2-bit crumbs (block t, byte 4j + b, bits 2c .. 2c + 1: the code the 4-bit form
//     keeps in block (4t + c) / 2's low (c even) or high nibble), then 8 masks of third bits
//     (as the 5-bit form's fifth), then per group the rows' two int8 scales, then the rows' d.
//   GGUF Q2_K (1344-byte super-blocks: 16 x 84, the file's bytes), w = d * sc[g, half] * code
//     - dmin * m[g, half], code in [0, 3], sc and m 4-bit: per group the 2 crumb blocks, then
//     per group the rows' two (sc | m << 4) bytes, then the rows' d and -dmin, fp16.
//   The caller names the form (Form's numbers); the unit's bytes are checked against it.
//   IQ4's values: VNNI looks up value + 128 (unsigned for dpbusd) and takes 128 * the group's
//     sum of activation codes off; AVX2 looks up the signed values and moves their signs onto
//     the activations (as the 8-bit form).
//   8-bit (q8x16_matmul), w[n, k] = scale[n, g] * code[n, k], code in [-128, 127]: 512 bytes a
//     group, 8 blocks of 64 (block s, byte 4j + b: code[j, 4s + b] + 128, as uint8); scales apart,
//     float32 (tiles, groups, 16) or (tiles, 1, 16) for one scale a row.
//     dot(code, q) = dot(code + 128, q) - 128 * qsum (dpbusd multiplies unsigned by signed)
//
// AVX-512 VNNI, AVX2 (maddubs + madd on the 8-row halves) and scalar paths, chosen at run time;
// tiles are split over torch's intra-op threads.

#include <ATen/Parallel.h>
#include <cpuid.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <vector>

#include "common.h"
#include "lora.h"

namespace pagoda_cpu {
namespace {

constexpr int64_t ROWS = 16;       // output rows per tile
constexpr int64_t Q8_BYTES = 512;  // a tile's group of 8-bit codes
// Activation rows per pass over a tile: a pass keeps the tile's unpacked codes in registers
// (8 of them) beside one accumulator per row; AVX2 has 16 registers, AVX-512 32. AVX2's tiles
// of the plain 4-bit forms and kQ6K (kByBlockAvx2) unpack a block at a time instead and keep a
// sum per row.
constexpr int MAX_M_AVX2 = 4;
constexpr int MAX_M_AVX2_BY_BLOCK = 8;
constexpr int MAX_M_VNNI = 8;
// Passes of up to this many rows take both 8-row halves of a tile in one walk over it.
constexpr int FUSED_M_AVX2 = 2;

// Activation rows [0, M) of one pass, and where their 16 outputs go.
struct Pass {
  const int8_t* q;  // row r at q + r * k
  int64_t k;
  const float* xd;  // row r at + r * groups
  const float* xs;
  const int32_t* qsum;
  const int32_t* qsum16;  // row r's (groups, 2) sums of codes per 16 values at + r * 2 * groups
  int64_t groups;
  float* y;  // row r at y + r * ldy
  int64_t ldy;
  int64_t valid;  // outputs of the tile that exist (the last tile may be partial)
};

#define PAGODA_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#define PAGODA_AMX \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,amx-tile,amx-int8")))
#define PAGODA_AVX2 __attribute__((target("avx2,fma,f16c")))

// Activation word i (4 int8 codes) of a row's group, broadcast to every 32-bit lane: loaded from
// memory by the broadcast itself (vpbroadcastd m32, a load), not through a general register (a
// GPR-to-vector move per word, 64 a group at 8 rows, which bound the many-row passes).
PAGODA_VNNI inline __m512i word_x16(const int8_t* q, int i) {
  return _mm512_broadcastd_epi32(_mm_loadu_si32(q + 4 * i));
}
PAGODA_AVX2 inline __m256i word_x8(const int8_t* q, int i) {
  return _mm256_broadcastd_epi32(_mm_loadu_si32(q + 4 * i));
}

// The tile walks ask for the bytes PREFETCH_BYTES ahead of the group they read, into L2, so that
// the next groups' lines (the next tile's past the end: a thread's tiles are consecutive) stream
// in while this one is computed. Without it a pass of few rows stalls on each group's loads
// instead of overlapping them with the arithmetic. Batch 1, the 1.5B's Q4_K / Q6_K layers in a
// step's order from memory, 2 threads (GB/s of the packed bytes):
//   AVX2 EPYC (Zen 3), AVX2 tiles: none 9.7, to L1 (T0) 4 KB ahead 13.7 (L2 not measured there);
//   Sapphire Rapids, VNNI tiles: none 13.3, T0 15, T1 or T2 at 3.5-5 KB ahead 18-22; 2 to 8
//   rows 1.35-1.75x; AVX2 tiles there: T0 14, T1 18.
constexpr int64_t PREFETCH_BYTES = 4096;

inline void prefetch_ahead(const uint8_t* from, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(from + PREFETCH_BYTES + o), _MM_HINT_T1);
  }
}

// ---- the nibble forms ------------------------------------------------------------------------
//
// One tile function per ISA for all of them (Form): every one holds a group's low nibbles in the
// 4-bit blocks; the 5-bit ones add a fifth bit from their masks, kQ6K two high bits from its bit
// planes, the IQ4 ones look their codes up in kIq4. The group forms store a group at a time;
// the super-block ones 8 groups (256 values, the file's block), whose per-group scales are the
// file's small integers times its fp16 ones. The numbers are the Python side's
// (layers/cpu_forms.py NIBBLE_FORMS).

enum class Form : int64_t {
  kQ4 = 0,     // 4-bit, scale and offset (GGUF Q4_1, pagoda's int4)
  kQ5 = 1,     // GGUF Q5_0
  kQ4K = 2,    // GGUF Q4_K
  kQ6K = 3,    // GGUF Q6_K
  kQ40 = 4,    // GGUF Q4_0
  kQ51 = 5,    // GGUF Q5_1
  kQ5K = 6,    // GGUF Q5_K
  kIq4Nl = 7,  // GGUF IQ4_NL
  kIq4Xs = 8,  // GGUF IQ4_XS
  kQ3K = 9,    // GGUF Q3_K
  kQ2K = 10,   // GGUF Q2_K
};
constexpr int64_t FORMS = 11;

template <Form F>
constexpr bool kSuper = F == Form::kQ4K || F == Form::kQ6K || F == Form::kQ5K || F == Form::kIq4Xs ||
                        F == Form::kQ3K || F == Form::kQ2K;
template <Form F>
constexpr bool kCrumb = F == Form::kQ3K || F == Form::kQ2K;  // 2-bit blocks, not 4-bit ones
// A scale per 16 values (the halves of a group), and the codes' offset: w = scale * (code - it)
template <Form F>
constexpr bool kHalves = F == Form::kQ6K || F == Form::kQ3K || F == Form::kQ2K;
template <Form F>
constexpr int kHalfOffset = F == Form::kQ6K ? 32 : F == Form::kQ3K ? 4 : 0;
template <Form F>
constexpr bool kFifth = F == Form::kQ5 || F == Form::kQ51 || F == Form::kQ5K || F == Form::kQ3K;
// The bit the masks add: 16 (the 5-bit forms), 4 (Q3_K's third bit)
template <Form F>
constexpr int kMaskBit = F == Form::kQ3K ? 4 : 16;
template <Form F>
constexpr bool kTable = F == Form::kIq4Nl || F == Form::kIq4Xs;
template <Form F>
constexpr bool kMinK = F == Form::kQ4K || F == Form::kQ5K;  // d * sc and -dmin * m
template <Form F>  // codes <= 15, no extra bits, no table, one scale a group: plain4_tile_avx2
constexpr bool kPlain4 = F == Form::kQ4 || F == Form::kQ40 || F == Form::kQ4K;
template <Form F>  // the forms whose AVX2 tiles take a block at a time against up to 8 rows
constexpr bool kByBlockAvx2 = kPlain4<F> || F == Form::kQ6K;

// IQ4_NL's 16 values (ggml's kvalues_iq4nl), and plus 128 as dpbusd's unsigned operand.
alignas(16) constexpr int8_t kIq4[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                         1,    13,   25,  38,  53,  69,  89,  113};
alignas(16) constexpr uint8_t kIq4Unsigned[16] = {1,   24,  45,  63,  79,  93,  106, 118,
                                                  129, 141, 153, 166, 181, 197, 217, 241};

// A tile's unit: one group, or one super-block of 8 groups.
constexpr int64_t unit_bytes(Form f) {
  switch (f) {
    case Form::kQ4: return 320;     // 16 x 20: codes, scales, offsets
    case Form::kQ5: return 352;     // 16 x 22: codes, masks, scales
    case Form::kQ4K: return 2368;   // 16 x 148: the file's 144 + 4
    case Form::kQ6K: return 3360;   // 16 x 210
    case Form::kQ40: return 288;    // 16 x 18
    case Form::kQ51: return 384;    // 16 x 24
    case Form::kQ5K: return 2880;   // 16 x 180: the file's 176 + 4
    case Form::kIq4Nl: return 288;  // 16 x 18
    case Form::kIq4Xs: return 2208; // 16 x 138: the file's 136 + 2
    case Form::kQ3K: return 1824;   // 16 x 114: the file's 110 + 4
    case Form::kQ2K: return 1344;   // 16 x 84
  }
  return 0;
}

template <Form F>
constexpr int64_t unit_groups() {
  return kSuper<F> ? 8 : 1;
}

// A group's share of its unit's bytes (the tile walks' stride for prefetching).
template <Form F>
constexpr int64_t group_share() { return unit_bytes(F) / unit_groups<F>(); }

// A group's code bytes: the 4-bit blocks, then the 5-bit forms' masks or kQ6K's high bits. A
// super-block holds its groups' code bytes one after the other, then the per-group numbers
// (meta_at), then the fp16 ones (d_at).
template <Form F>
constexpr int64_t code_bytes() {
  return F == Form::kQ6K ? 384 : F == Form::kQ3K ? 192 : F == Form::kQ2K ? 128 : kFifth<F> ? 320 : 256;
}

// Where a group's masks start in its code bytes.
template <Form F>
constexpr int64_t masks_at() { return kCrumb<F> ? 128 : 256; }

template <Form F>
constexpr int64_t meta_at() { return 8 * code_bytes<F>(); }

template <Form F>
constexpr int64_t meta_bytes() { return F == Form::kIq4Xs ? 16 : 32; }

template <Form F>
constexpr int64_t d_at() { return meta_at<F>() + 8 * meta_bytes<F>(); }

template <Form F>
inline const uint8_t* unit_at(const uint8_t* tile, int64_t g) {
  return tile + g / unit_groups<F>() * unit_bytes(F);
}

// Group g's 4 blocks of 64 nibble bytes (then its masks or high bits).
template <Form F>
inline const uint8_t* codes_at(const uint8_t* tile, int64_t g) {
  return unit_at<F>(tile, g) + g % unit_groups<F>() * code_bytes<F>();
}

// Group g's per-group numbers: kMinK the 16 rows' 6-bit scales, then their 6-bit mins, a byte
// each, with the rows' d and -dmin after the groups' (scale = d * sc, offset = (-dmin) * m; the
// file packs the 6-bit numbers into 12 bytes a row: a byte each costs 4 bytes a row and 256
// values, 2.8%, and saves the unpacking in every tile's group, where a batch-1 step on 2 cores
// is bound by instructions); kQ6K 2 x 16 int8 scales (the 16-value halves), kIq4Xs 16 int8
// ones, each with the rows' d after the groups'.
template <Form F>
inline const uint8_t* meta_of(const uint8_t* tile, int64_t g) {
  return unit_at<F>(tile, g) + meta_at<F>() + meta_bytes<F>() * (g % 8);
}

// The fifth (third) bits of 64 codes (w[i]'s) from their mask.
template <Form F>
inline uint64_t fifth_mask(const uint8_t* b, int i) {
  uint64_t bits;
  std::memcpy(&bits, b + masks_at<F>() + 8 * i, 8);
  return bits;
}

// kQ6K's two high bits of the codes of block s's byte p (p in [0, 64)): bits 0-1 the low
// nibble's code's, bits 2-3 the high nibble's; byte p % 32 of the block's 32 bytes holds them in
// its low (p < 32) or high nibble.
inline int q6k_high(const uint8_t* b, int s, int p) {
  return (b[256 + 32 * s + p % 32] >> (4 * (p / 32))) & 0xF;
}

PAGODA_VNNI inline __m512 fp16x16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

PAGODA_VNNI inline __m512 uint8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

PAGODA_VNNI inline __m512 int8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// The low (hi = 0) or high nibbles of 16 bytes, as floats.
PAGODA_VNNI inline __m512 nibbles_x16(const uint8_t* p, int hi) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i n = _mm_and_si128(hi ? _mm_srli_epi16(v, 4) : v, _mm_set1_epi8(0x0F));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(n));
}

// kQ2K's halves' offsets for group g: -dmin * m.
PAGODA_VNNI inline void q2k_offsets_vnni(const uint8_t* unit, const uint8_t* meta, __m512* o0, __m512* o1) {
  const __m512 ndmin = fp16x16(unit + d_at<Form::kQ2K>() + 32);
  *o0 = _mm512_mul_ps(ndmin, nibbles_x16(meta, 1));
  *o1 = _mm512_mul_ps(ndmin, nibbles_x16(meta + 16, 1));
}

// Group g's 16 scales and offsets; kQ6K: its halves' scales (the offset is -32 * scale, applied
// as -32 * the half's sum of activation codes); the IQ4 forms: scales only.
template <Form F>
PAGODA_VNNI inline void group_scales_vnni(const uint8_t* tile, int64_t g, __m512* s0, __m512* s1) {
  const uint8_t* b = codes_at<F>(tile, g);
  const uint8_t* unit = unit_at<F>(tile, g);
  if constexpr (F == Form::kQ4) {
    *s0 = fp16x16(b + 256);
    *s1 = fp16x16(b + 288);
  } else if constexpr (F == Form::kQ40 || F == Form::kIq4Nl) {
    *s0 = fp16x16(b + 256);
    *s1 = _mm512_mul_ps(*s0, _mm512_set1_ps(-8.f));
  } else if constexpr (F == Form::kQ5) {
    *s0 = fp16x16(b + 320);
    *s1 = _mm512_mul_ps(*s0, _mm512_set1_ps(-16.f));
  } else if constexpr (F == Form::kQ51) {
    *s0 = fp16x16(b + 320);
    *s1 = fp16x16(b + 352);
  } else if constexpr (kMinK<F>) {
    const uint8_t* meta = meta_of<F>(tile, g);
    *s0 = _mm512_mul_ps(fp16x16(unit + d_at<F>()), uint8x16(meta));
    *s1 = _mm512_mul_ps(fp16x16(unit + d_at<F>() + 32), uint8x16(meta + 16));
  } else if constexpr (F == Form::kIq4Xs) {
    *s0 = _mm512_mul_ps(fp16x16(unit + d_at<F>()), int8x16(meta_of<F>(tile, g)));
    *s1 = *s0;
  } else if constexpr (F == Form::kQ2K) {
    const uint8_t* meta = meta_of<F>(tile, g);
    const __m512 d = fp16x16(unit + d_at<F>());
    *s0 = _mm512_mul_ps(d, nibbles_x16(meta, 0));
    *s1 = _mm512_mul_ps(d, nibbles_x16(meta + 16, 0));
  } else {
    const uint8_t* sc = meta_of<F>(tile, g);
    const __m512 d = fp16x16(unit + d_at<F>());
    *s0 = _mm512_mul_ps(d, int8x16(sc));
    *s1 = _mm512_mul_ps(d, int8x16(sc + 16));
  }
}

// Group g's codes as 8 blocks of 64 bytes in dpbusd's order (block i, byte 4j + b: row j's
// code 4i + b of the group), unsigned: the nibbles with the 5-bit forms' fifth bits, kQ6K's high
// bits, or the IQ4 forms' values + 128; the crumb forms' 2-bit codes with their masks' bits.
template <Form F>
PAGODA_VNNI inline void unpack_codes_vnni(const uint8_t* b, __m512i* w) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  if constexpr (kCrumb<F>) {
    const __m512i three = _mm512_set1_epi8(3);
    for (int t = 0; t < 2; ++t) {
      const __m512i v = _mm512_loadu_si512(b + 64 * t);
      for (int c = 0; c < 4; ++c) w[4 * t + c] = _mm512_and_si512(_mm512_srli_epi16(v, 2 * c), three);
    }
  } else {
    for (int s = 0; s < 4; ++s) {
      const __m512i v = _mm512_loadu_si512(b + 64 * s);
      w[2 * s] = _mm512_and_si512(v, mask);
      w[2 * s + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    }
  }
  if constexpr (kFifth<F>) {
    const __m512i fifth = _mm512_set1_epi8(kMaskBit<F>);
    for (int i = 0; i < 8; ++i) {
      w[i] = _mm512_or_si512(w[i], _mm512_maskz_mov_epi8(fifth_mask<F>(b, i), fifth));
    }
  } else if constexpr (kTable<F>) {
    const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Unsigned)));
    for (int i = 0; i < 8; ++i) w[i] = _mm512_shuffle_epi8(lut, w[i]);
  } else if constexpr (F == Form::kQ6K) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int s = 0; s < 4; ++s) {
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 256 + 32 * s));
      const __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(hb, low4)),
                                           _mm256_and_si256(_mm256_srli_epi16(hb, 4), low4), 1);
      w[2 * s] = _mm512_or_si512(w[2 * s], _mm512_slli_epi16(_mm512_and_si512(h, _mm512_set1_epi8(3)), 4));
      w[2 * s + 1] = _mm512_or_si512(w[2 * s + 1], _mm512_slli_epi16(_mm512_and_si512(h, _mm512_set1_epi8(12)), 2));
    }
  }
}

template <int M, Form F>
PAGODA_VNNI void nibble_tile_vnni(const uint8_t* tile, const Pass& p) {
  __m512 acc[M];
  for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
  constexpr int64_t kGroupBytes = group_share<F>();
  for (int64_t g = 0; g < p.groups; ++g) {
    prefetch_ahead(tile + g * kGroupBytes, kGroupBytes);
    const uint8_t* b = codes_at<F>(tile, g);
    __m512i w[8];
    unpack_codes_vnni<F>(b, w);
    __m512 s0, s1, o0, o1;
    group_scales_vnni<F>(tile, g, &s0, &s1);
    if constexpr (F == Form::kQ2K) q2k_offsets_vnni(unit_at<F>(tile, g), meta_of<F>(tile, g), &o0, &o1);
    // Unrolled, the rows' accumulators stay in registers (rolled, GCC kept them in memory: a
    // load and a store a row and group). With word_x16, 512 rows of the 1.5B's shapes on a
    // 2-core Zen 5: Q4_K 1.26-1.48x, Q6_K 1.41x (benchmarks/results/issue42/part10).
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) {
      const int8_t* qw = p.q + r * p.k + g * GROUP;
      const int64_t i = r * p.groups + g;
      const __m512 xd = _mm512_set1_ps(p.xd[i]);
      if constexpr (kHalves<F>) {  // the halves' dot products apart: a scale each
        __m512i d0 = _mm512_set1_epi32(-kHalfOffset<F> * p.qsum16[2 * i]);
        __m512i d1 = _mm512_set1_epi32(-kHalfOffset<F> * p.qsum16[2 * i + 1]);
        for (int s = 0; s < 4; ++s) {
          d0 = _mm512_dpbusd_epi32(d0, w[s], word_x16(qw, s));
          d1 = _mm512_dpbusd_epi32(d1, w[s + 4], word_x16(qw, s + 4));
        }
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_mul_ps(s0, xd), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_mul_ps(s1, xd), acc[r]);
        if constexpr (F == Form::kQ2K) {  // -dmin * m * (the half's sum of activations)
          acc[r] = _mm512_fmadd_ps(o0, _mm512_set1_ps(p.xd[i] * static_cast<float>(p.qsum16[2 * i])), acc[r]);
          acc[r] = _mm512_fmadd_ps(o1, _mm512_set1_ps(p.xd[i] * static_cast<float>(p.qsum16[2 * i + 1])), acc[r]);
        }
      } else {
        // IQ4: the codes are value + 128, so 128 * qsum comes off (in integers, exactly)
        __m512i d0 = kTable<F> ? _mm512_set1_epi32(-128 * p.qsum[i]) : _mm512_setzero_si512();
        __m512i d1 = _mm512_setzero_si512();
        for (int s = 0; s < 4; ++s) {
          d0 = _mm512_dpbusd_epi32(d0, w[2 * s], word_x16(qw, 2 * s));
          d1 = _mm512_dpbusd_epi32(d1, w[2 * s + 1], word_x16(qw, 2 * s + 1));
        }
        const __m512 d = _mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1));
        acc[r] = _mm512_fmadd_ps(d, _mm512_mul_ps(s0, xd), acc[r]);
        if constexpr (!kTable<F>) acc[r] = _mm512_fmadd_ps(s1, _mm512_set1_ps(p.xs[i]), acc[r]);
      }
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << p.valid) - 1u);
  for (int r = 0; r < M; ++r) _mm512_mask_storeu_ps(p.y + r * p.ldy, keep, acc[r]);
}

// ---- AMX: passes of 16 rows on the tile unit ----------------------------------------------------
//
// A group's 16 x 16 dot products of a 16-row pass, in one tdpbsud: A the pass's activation codes
// (16 rows x the group's 32 bytes, signed), B the group's 8 unpacked code blocks (8 rows x 64
// bytes, unsigned: unpack_codes_vnni's, which are already the tile unit's layout, 4 codes of each
// output row a 32-bit word). The dot products are integers, so each equals nibble_tile_vnni's
// d0 + d1 exactly, and the epilogue is its, operation for operation: a row gets the same bits on
// either path. The forms with a scale per 16 values (kHalves) take two dot products a group.

// ldtilecfg's 64 bytes, palette 1: tiles 0 and 3 dot products (16 x 16 int32), 1 and 4
// activations (16 x 32 bytes), 2 and 5 codes (8 x 64 bytes)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 32, 64, 64, 32, 64};
  uint8_t rows[16] = {16, 16, 8, 16, 16, 8};
};

sigjmp_buf probe_jump;
void on_sigill(int) { siglongjmp(probe_jump, 1); }

// Runs a tile instruction with SIGILL caught: a virtual machine may list AMX in CPUID and grant
// the permission, yet fault on the first tile instruction.
PAGODA_AMX bool tiles_run() {
  struct sigaction action {}, previous {};
  action.sa_handler = on_sigill;
  sigemptyset(&action.sa_mask);
  if (sigaction(SIGILL, &action, &previous) != 0) return false;
  bool ran = false;
  if (sigsetjmp(probe_jump, 1) == 0) {
    static const TileConfig config;
    _tile_loadconfig(&config);
    _tile_zero(0);
    _tile_release();
    ran = true;
  }
  sigaction(SIGILL, &previous, nullptr);
  return ran;
}

// Whether this process may run tile instructions: the CPU has AMX-TILE and AMX-INT8 (CPUID 7.0
// EDX bits 24, 25), Linux grants the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM) and a tile
// instruction runs; found once. PAGODA_CPU_AMX=0 turns the tile path off.
bool amx_ready() {
  static const bool ready = [] {
    const char* env = std::getenv("PAGODA_CPU_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (((d >> 24) & 1u) == 0 || ((d >> 25) & 1u) == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0 && tiles_run();
  }();
  return ready;
}

// The tile intrinsics are asm without a memory operand: the barrier keeps the compiler's stores
// to what a tile loads before it, and its loads of what a tile stores after it.
inline void memory_barrier() { asm volatile("" ::: "memory"); }

constexpr int AMX_ROWS = 16;  // activation rows a pass

// Rows [r, ...) of a pass, as a pass of their own.
inline Pass pass_from(const Pass& p, int64_t r) {
  Pass q = p;
  q.q += r * p.k;
  q.xd += r * p.groups;
  q.xs += r * p.groups;
  q.qsum += r * p.groups;
  if (q.qsum16 != nullptr) q.qsum16 += r * 2 * p.groups;
  q.y += r * p.ldy;
  return q;
}

// Every group's codes of a tile, unpacked once for all of its passes: groups x 512 bytes.
template <Form F>
PAGODA_VNNI void unpack_tile_vnni(const uint8_t* tile, int64_t groups, uint8_t* out) {
  constexpr int64_t kGroupBytes = group_share<F>();
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_ahead(tile + g * kGroupBytes, kGroupBytes);
    __m512i w[8];
    unpack_codes_vnni<F>(codes_at<F>(tile, g), w);
    for (int i = 0; i < 8; ++i) _mm512_store_si512(out + 512 * g + 64 * i, w[i]);
  }
}

// The nibble forms' share of group g in a 16-row pass, from its dot products as the tile unit
// stored them: nibble_tile_vnni's epilogue on its d0 + d1.
template <Form F>
struct NibbleGroups {
  const uint8_t* tile;
  PAGODA_VNNI void add(const Pass& p, int64_t g, const int32_t* dots, __m512* acc) const {
    __m512 s0, s1;
    group_scales_vnni<F>(tile, g, &s0, &s1);
    for (int r = 0; r < AMX_ROWS; ++r) {
      const int64_t i = r * p.groups + g;
      __m512i dot = _mm512_load_si512(dots + 16 * r);
      if constexpr (kTable<F>) dot = _mm512_add_epi32(dot, _mm512_set1_epi32(-128 * p.qsum[i]));
      const __m512 xd = _mm512_set1_ps(p.xd[i]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s0, xd), acc[r]);
      if constexpr (!kTable<F>) acc[r] = _mm512_fmadd_ps(s1, _mm512_set1_ps(p.xs[i]), acc[r]);
    }
  }
  PAGODA_VNNI __m512 out(__m512 acc) const { return acc; }
};

// The 8-bit form's: q8_tile_vnni's epilogue (codes + 128, so 128 * qsum comes off).
template <bool kRowScale>
struct Q8Groups {
  const float* scales;
  PAGODA_VNNI void add(const Pass& p, int64_t g, const int32_t* dots, __m512* acc) const {
    const __m512 scale = kRowScale ? _mm512_setzero_ps() : _mm512_loadu_ps(scales + 16 * g);
    for (int r = 0; r < AMX_ROWS; ++r) {
      const int64_t i = r * p.groups + g;
      const __m512i dot = _mm512_add_epi32(_mm512_load_si512(dots + 16 * r),
                                           _mm512_set1_epi32(-128 * p.qsum[i]));
      const __m512 xd = _mm512_set1_ps(p.xd[i]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), kRowScale ? xd : _mm512_mul_ps(scale, xd), acc[r]);
    }
  }
  PAGODA_VNNI __m512 out(__m512 acc) const {
    return kRowScale ? _mm512_mul_ps(acc, _mm512_loadu_ps(scales)) : acc;
  }
};

// Group G's dot products into tile C, from activations in tile A and codes in tile B.
#define PAGODA_AMX_DOTS(C, A, B, G)                  \
  do {                                               \
    _tile_zero(C);                                   \
    _tile_loadd(A, p.q + (G) * GROUP, p.k);          \
    _tile_loadd(B, codes + 512 * (G), 64);           \
    _tile_dpbsud(C, A, B);                           \
  } while (0)

// One 16-row pass; the tiles are configured and `codes` holds the tile's groups of 8 code
// blocks (512 bytes a group), in the tile unit's layout. Two sets of tiles (0-2, 3-5) take the
// groups in turn, so that the unit computes a group's dot products while the vector units take
// the one before it (groups.add).
template <class Groups>
PAGODA_AMX void pass_amx(const Groups& groups, const uint8_t* codes, const Pass& p) {
  alignas(64) int32_t dots[AMX_ROWS * 16];
  __m512 acc[AMX_ROWS];
  for (int r = 0; r < AMX_ROWS; ++r) acc[r] = _mm512_setzero_ps();
  memory_barrier();
  PAGODA_AMX_DOTS(0, 1, 2, 0);
  for (int64_t g = 0; g < p.groups; g += 2) {
    if (g + 1 < p.groups) PAGODA_AMX_DOTS(3, 4, 5, g + 1);
    _tile_stored(0, dots, 64);
    memory_barrier();
    groups.add(p, g, dots, acc);
    memory_barrier();
    if (g + 1 < p.groups) {
      if (g + 2 < p.groups) PAGODA_AMX_DOTS(0, 1, 2, g + 2);
      _tile_stored(3, dots, 64);
      memory_barrier();
      groups.add(p, g + 1, dots, acc);
      memory_barrier();
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << p.valid) - 1u);
  for (int r = 0; r < AMX_ROWS; ++r) _mm512_mask_storeu_ps(p.y + r * p.ldy, keep, groups.out(acc[r]));
}
#undef PAGODA_AMX_DOTS

// The two-scale forms' (kHalves: Q6_K, Q3_K, Q2_K) share of group g: nibble_tile_vnni's
// epilogue on the halves' dot products d0, d1 (their codes' offset taken off in integers).
template <Form F>
struct HalvesGroups {
  const uint8_t* tile;
  PAGODA_VNNI void add(const Pass& p, int64_t g, const int32_t* dots0, const int32_t* dots1,
                       __m512* acc) const {
    __m512 s0, s1, o0, o1;
    group_scales_vnni<F>(tile, g, &s0, &s1);
    if constexpr (F == Form::kQ2K) q2k_offsets_vnni(unit_at<F>(tile, g), meta_of<F>(tile, g), &o0, &o1);
    for (int r = 0; r < AMX_ROWS; ++r) {
      const int64_t i = r * p.groups + g;
      const __m512i d0 = _mm512_add_epi32(_mm512_load_si512(dots0 + 16 * r),
                                          _mm512_set1_epi32(-kHalfOffset<F> * p.qsum16[2 * i]));
      const __m512i d1 = _mm512_add_epi32(_mm512_load_si512(dots1 + 16 * r),
                                          _mm512_set1_epi32(-kHalfOffset<F> * p.qsum16[2 * i + 1]));
      const __m512 xd = _mm512_set1_ps(p.xd[i]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_mul_ps(s0, xd), acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_mul_ps(s1, xd), acc[r]);
      if constexpr (F == Form::kQ2K) {
        acc[r] = _mm512_fmadd_ps(o0, _mm512_set1_ps(p.xd[i] * static_cast<float>(p.qsum16[2 * i])), acc[r]);
        acc[r] = _mm512_fmadd_ps(o1, _mm512_set1_ps(p.xd[i] * static_cast<float>(p.qsum16[2 * i + 1])), acc[r]);
      }
    }
  }
};

// ldtilecfg for the two-scale forms: tiles 0, 1 and 4, 5 the halves' dot products (16 x 16
// int32), 2 and 6 a half's activations (16 x 16 bytes), 3 and 7 its codes (4 x 64 bytes)
struct alignas(64) HalvesTileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 16, 64, 64, 64, 16, 64};
  uint8_t rows[16] = {16, 16, 16, 4, 16, 16, 16, 4};
};

// Group G's halves' dot products into tiles C0 and C1 (A a half's activations, B its codes).
#define PAGODA_AMX_HALVES(C0, C1, A, B, G)                    \
  do {                                                        \
    _tile_zero(C0);                                           \
    _tile_zero(C1);                                           \
    _tile_loadd(A, p.q + (G) * GROUP, p.k);                   \
    _tile_loadd(B, codes + 512 * (G), 64);                    \
    _tile_dpbsud(C0, A, B);                                   \
    _tile_loadd(A, p.q + (G) * GROUP + 16, p.k);              \
    _tile_loadd(B, codes + 512 * (G) + 256, 64);              \
    _tile_dpbsud(C1, A, B);                                   \
  } while (0)

// pass_amx for the two-scale forms, with HalvesTileConfig loaded.
template <Form F>
PAGODA_AMX void halves_pass_amx(const uint8_t* tile, const uint8_t* codes, const Pass& p) {
  const HalvesGroups<F> groups{tile};
  alignas(64) int32_t dots0[AMX_ROWS * 16], dots1[AMX_ROWS * 16];
  __m512 acc[AMX_ROWS];
  for (int r = 0; r < AMX_ROWS; ++r) acc[r] = _mm512_setzero_ps();
  memory_barrier();
  PAGODA_AMX_HALVES(0, 1, 2, 3, 0);
  for (int64_t g = 0; g < p.groups; g += 2) {
    if (g + 1 < p.groups) PAGODA_AMX_HALVES(4, 5, 6, 7, g + 1);
    _tile_stored(0, dots0, 64);
    _tile_stored(1, dots1, 64);
    memory_barrier();
    groups.add(p, g, dots0, dots1, acc);
    memory_barrier();
    if (g + 1 < p.groups) {
      if (g + 2 < p.groups) PAGODA_AMX_HALVES(0, 1, 2, 3, g + 2);
      _tile_stored(4, dots0, 64);
      _tile_stored(5, dots1, 64);
      memory_barrier();
      groups.add(p, g + 1, dots0, dots1, acc);
      memory_barrier();
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << p.valid) - 1u);
  for (int r = 0; r < AMX_ROWS; ++r) _mm512_mask_storeu_ps(p.y + r * p.ldy, keep, acc[r]);
}
#undef PAGODA_AMX_HALVES

// 64 bytes, aligned: a row of the codes' buffer
struct alignas(64) Line {
  uint8_t bytes[64];
};

// Rows [r, m) of p, the rows a tile-unit call leaves, in VNNI passes of up to MAX_M_VNNI:
// vnni(std::integral_constant<int, rows>, pass).
template <typename VnniFn>
void rest_on_vnni(const Pass& p, int64_t r, int64_t m, VnniFn&& vnni) {
  for (; r < m; r += MAX_M_VNNI) {
    const Pass rest = pass_from(p, r);
    with_rows<MAX_M_VNNI>(static_cast<int>(std::min<int64_t>(MAX_M_VNNI, m - r)),
                          [&](auto rows) { vnni(rows, rest); });
  }
}

// A tile against all `m` rows of p: 16-row passes on the tile unit, the rest on VNNI.
template <Form F>
PAGODA_AMX void nibble_tile_amx(const uint8_t* tile, const Pass& p, int64_t m) {
  int64_t r = 0;
  if (m >= AMX_ROWS) {
    thread_local std::vector<Line> codes;  // this thread's, as large as its largest tile
    if (codes.size() < static_cast<size_t>(8 * p.groups)) codes.resize(8 * p.groups);
    uint8_t* c = codes.data()->bytes;
    unpack_tile_vnni<F>(tile, p.groups, c);
    // other code (oneDNN) may have configured this thread's tiles: configured at every call
    if constexpr (kHalves<F>) {
      static const HalvesTileConfig config;
      _tile_loadconfig(&config);
      for (; r + AMX_ROWS <= m; r += AMX_ROWS) halves_pass_amx<F>(tile, c, pass_from(p, r));
    } else {
      static const TileConfig config;
      _tile_loadconfig(&config);
      for (; r + AMX_ROWS <= m; r += AMX_ROWS) pass_amx(NibbleGroups<F>{tile}, c, pass_from(p, r));
    }
  }
  rest_on_vnni(p, r, m, [&](auto rows, const Pass& rest) {
    nibble_tile_vnni<decltype(rows)::value, F>(tile, rest);
  });
}

template <int M, bool kRowScale>
PAGODA_VNNI void q8_tile_vnni(const uint8_t* tile, const float* scales, const Pass& p);

// The 8-bit form's tile against all `m` rows: its groups are already the tile unit's layout.
template <bool kRowScale>
PAGODA_AMX void q8_tile_amx(const uint8_t* tile, const float* scales, const Pass& p, int64_t m) {
  int64_t r = 0;
  if (m >= AMX_ROWS) {
    static const TileConfig config;
    _tile_loadconfig(&config);
    for (; r + AMX_ROWS <= m; r += AMX_ROWS) pass_amx(Q8Groups<kRowScale>{scales}, tile, pass_from(p, r));
  }
  rest_on_vnni(p, r, m, [&](auto rows, const Pass& rest) {
    q8_tile_vnni<decltype(rows)::value, kRowScale>(tile, scales, rest);
  });
}

// `value` in byte i where bit i of `word` is set (32 codes of rows 8h .. 8h + 7).
PAGODA_AVX2 inline __m256i fifth_bits_avx2(uint32_t word, int value) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(word)), spread);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(static_cast<char>(value)));
}

PAGODA_AVX2 inline __m256 fp16x8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

PAGODA_AVX2 inline __m256 int8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

PAGODA_AVX2 inline __m256 uint8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// The low (hi = 0) or high nibbles of 8 bytes, as floats.
PAGODA_AVX2 inline __m256 nibbles_x8(const uint8_t* p, int hi) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i n = _mm_and_si128(hi ? _mm_srli_epi16(v, 4) : v, _mm_set1_epi8(0x0F));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(n));
}

// Blocks a and a + 1 of a group against their activation words, widened to int32.
PAGODA_AVX2 inline __m256i dot_pair_avx2(const __m256i* w, const int8_t* qw, int a) {
  const __m256i sum = _mm256_add_epi16(_mm256_maddubs_epi16(w[a], word_x8(qw, a)),
                                       _mm256_maddubs_epi16(w[a + 1], word_x8(qw, a + 1)));
  return _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
}

// group_scales_vnni's numbers for rows 8h .. 8h + 7.
template <Form F>
PAGODA_AVX2 inline void group_scales_avx2(const uint8_t* tile, int64_t g, int h, __m256* s0, __m256* s1) {
  const uint8_t* b = codes_at<F>(tile, g) + 16 * h;  // (the fp16 numbers of rows 8h ..)
  const uint8_t* unit = unit_at<F>(tile, g) + 16 * h;
  if constexpr (F == Form::kQ4) {
    *s0 = fp16x8(b + 256);
    *s1 = fp16x8(b + 288);
  } else if constexpr (F == Form::kQ40 || F == Form::kIq4Nl) {
    *s0 = fp16x8(b + 256);
    *s1 = _mm256_mul_ps(*s0, _mm256_set1_ps(-8.f));
  } else if constexpr (F == Form::kQ5) {
    *s0 = fp16x8(b + 320);
    *s1 = _mm256_mul_ps(*s0, _mm256_set1_ps(-16.f));
  } else if constexpr (F == Form::kQ51) {
    *s0 = fp16x8(b + 320);
    *s1 = fp16x8(b + 352);
  } else if constexpr (kMinK<F>) {
    const uint8_t* meta = meta_of<F>(tile, g) + 8 * h;
    *s0 = _mm256_mul_ps(fp16x8(unit + d_at<F>()), uint8x8(meta));
    *s1 = _mm256_mul_ps(fp16x8(unit + d_at<F>() + 32), uint8x8(meta + 16));
  } else if constexpr (F == Form::kIq4Xs) {
    *s0 = _mm256_mul_ps(fp16x8(unit + d_at<F>()), int8x8(meta_of<F>(tile, g) + 8 * h));
    *s1 = *s0;
  } else if constexpr (F == Form::kQ2K) {
    const uint8_t* meta = meta_of<F>(tile, g) + 8 * h;
    const __m256 d = fp16x8(unit + d_at<F>());
    *s0 = _mm256_mul_ps(d, nibbles_x8(meta, 0));
    *s1 = _mm256_mul_ps(d, nibbles_x8(meta + 16, 0));
  } else {
    const uint8_t* sc = meta_of<F>(tile, g) + 8 * h;
    const __m256 d = fp16x8(unit + d_at<F>());
    *s0 = _mm256_mul_ps(d, int8x8(sc));
    *s1 = _mm256_mul_ps(d, int8x8(sc + 16));
  }
}

// Runs group(g, h, acc) over a tile's groups for its two 8-row halves (h: rows 8h .. 8h + 7; acc:
// the pass's M rows' sums of that half) and stores the pass's rows. Passes of up to FUSED_M_AVX2
// rows (decode) take both halves group by group: one walk over the tile's lines, in order, the
// lines ahead prefetched all the while. Larger passes keep only one half's sums in registers:
// rows 0-7 over every group (prefetching), then rows 8-15 from cache. Each row's arithmetic, in
// its order, is the same either way, so its bits are too. Batch 1 on the AVX2 EPYC, the 1.5B's
// Q4_K and Q6_K shapes from memory (benchmarks/prefill_matmuls.py --rows 1): the two walks read
// 10.9-11.2 GB/s, since the second one leaves the memory idle; one walk 15.1-16.8 (3 alternating
// rounds).
template <int M, typename Group>
PAGODA_AVX2 inline void walk_tile_avx2(const uint8_t* tile, const Pass& p, int64_t group_bytes, Group&& group) {
  if constexpr (M <= FUSED_M_AVX2) {
    __m256 acc[2][M];
    for (int r = 0; r < M; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < p.groups; ++g) {
      prefetch_ahead(tile + g * group_bytes, group_bytes);
      group(g, 0, acc[0]);
      group(g, 1, acc[1]);
    }
    for (int h = 0; h < 2; ++h) {
      for (int r = 0; r < M; ++r) store_half(p.y + r * p.ldy + 8 * h, p.valid - 8 * h, acc[h][r]);
    }
  } else {
    for (int h = 0; h < 2; ++h) {
      __m256 acc[M];
      for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t g = 0; g < p.groups; ++g) {
        if (h == 0) prefetch_ahead(tile + g * group_bytes, group_bytes);
        group(g, h, acc);
      }
      for (int r = 0; r < M; ++r) store_half(p.y + r * p.ldy + 8 * h, p.valid - 8 * h, acc[r]);
    }
  }
}

// A decode pass (M <= FUSED_M_AVX2 rows) over a tile whose group function takes both 8-row
// halves at once, group(g, acc): each block is loaded once and each activation word broadcast
// once for the two halves, where walk_tile_avx2's group(g, h, acc) does both per half. On a Zen 1
// EPYC, whose 256-bit operations run as two halves, a batch-1 pass is bound by its instruction
// count: one thread, the 1.5B's Q6_K down 1.16x, the 4-bit shapes 1.00-1.08x (benchmarks/results/
// issue42/part16/one_thread). Each half's integer sums are exact (no int16 overflow), and its
// float steps run in their order, so the bits are those of walk_tile_avx2's passes.
template <int M, typename Group>
PAGODA_AVX2 inline void walk_tile_both_avx2(const uint8_t* tile, const Pass& p, int64_t group_bytes, Group&& group) {
  static_assert(M <= FUSED_M_AVX2);
  __m256 acc[2][M];
  for (int r = 0; r < M; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    prefetch_ahead(tile + g * group_bytes, group_bytes);
    group(g, acc);
  }
  for (int h = 0; h < 2; ++h) {
    for (int r = 0; r < M; ++r) store_half(p.y + r * p.ldy + 8 * h, p.valid - 8 * h, acc[h][r]);
  }
}

// The AVX2 tiles of the forms not kByBlockAvx2 (those have plain4_tile_avx2 and
// q6k_tile_avx2, below), up to 4 rows a pass with a group's 8 unpacked blocks in registers.
// maddubs of a code and an activation (|q| <= 127) pair: <= 7874 for codes <= 31, so the 5-bit
// forms' 4 blocks add up to <= 31496, inside int16, and a group's 8 blocks are widened to int32
// in two halves; the 2- and 3-bit codes' halves (2 pairs) stay far inside int16; the IQ4 values
// (|v| <= 127, signs on the activations) <= 32258 a pair, so they widen every block. One group of
// rows 8h .. 8h + 7 against the pass's M rows, into acc:
template <int M, Form F>
PAGODA_AVX2 inline void nibble_group_avx2(const uint8_t* tile, const Pass& p, int64_t g, int h, __m256* acc) {
  static_assert(!kByBlockAvx2<F>);
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* b = codes_at<F>(tile, g);
  __m256i w[8];
  if constexpr (kCrumb<F>) {
    const __m256i three = _mm256_set1_epi8(3);
    for (int t = 0; t < 2; ++t) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * t + 32 * h));
      for (int c = 0; c < 4; ++c) w[4 * t + c] = _mm256_and_si256(_mm256_srli_epi16(v, 2 * c), three);
    }
  } else {
    for (int s = 0; s < 4; ++s) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * s + 32 * h));
      w[2 * s] = _mm256_and_si256(v, mask);
      w[2 * s + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    }
  }
  if constexpr (kFifth<F>) {
    for (int i = 0; i < 8; ++i) {
      const auto word = static_cast<uint32_t>(fifth_mask<F>(b, i) >> (32 * h));
      w[i] = _mm256_or_si256(w[i], fifth_bits_avx2(word, kMaskBit<F>));
    }
  } else if constexpr (kTable<F>) {
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kIq4)));
    for (int i = 0; i < 8; ++i) w[i] = _mm256_shuffle_epi8(lut, w[i]);
  }
  __m256 s0, s1;
  group_scales_avx2<F>(tile, g, h, &s0, &s1);
  for (int r = 0; r < M; ++r) {
    const int8_t* qw = p.q + r * p.k + g * GROUP;
    const int64_t i = r * p.groups + g;
    const __m256 xd = _mm256_set1_ps(p.xd[i]);
    if constexpr (kHalves<F>) {
      const __m256i d0 = _mm256_sub_epi32(_mm256_add_epi32(dot_pair_avx2(w, qw, 0), dot_pair_avx2(w, qw, 2)),
                                          _mm256_set1_epi32(kHalfOffset<F> * p.qsum16[2 * i]));
      const __m256i d1 = _mm256_sub_epi32(_mm256_add_epi32(dot_pair_avx2(w, qw, 4), dot_pair_avx2(w, qw, 6)),
                                          _mm256_set1_epi32(kHalfOffset<F> * p.qsum16[2 * i + 1]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_mul_ps(s0, xd), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_mul_ps(s1, xd), acc[r]);
      if constexpr (F == Form::kQ2K) {  // -dmin * m * (the half's sum of activations)
        const uint8_t* meta = meta_of<F>(tile, g) + 8 * h;
        const __m256 ndmin = fp16x8(unit_at<F>(tile, g) + d_at<F>() + 32 + 16 * h);
        const float xd0 = p.xd[i] * static_cast<float>(p.qsum16[2 * i]);
        const float xd1 = p.xd[i] * static_cast<float>(p.qsum16[2 * i + 1]);
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(ndmin, nibbles_x8(meta, 1)), _mm256_set1_ps(xd0), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(ndmin, nibbles_x8(meta + 16, 1)), _mm256_set1_ps(xd1), acc[r]);
      }
    } else if constexpr (kTable<F>) {
      __m256i dot = _mm256_setzero_si256();
      for (int s = 0; s < 8; ++s) {
        const __m256i u = _mm256_sign_epi8(w[s], w[s]);
        const __m256i sq = _mm256_sign_epi8(word_x8(qw, s), w[s]);
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(u, sq), ones));
      }
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s0, xd), acc[r]);
    } else {
      __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
      for (int s = 0; s < 4; ++s) {
        lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(w[s], word_x8(qw, s)));
        hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(w[s + 4], word_x8(qw, s + 4)));
      }
      const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s0, xd), acc[r]);
      acc[r] = _mm256_fmadd_ps(s1, _mm256_set1_ps(p.xs[i]), acc[r]);
    }
  }
}

template <int M, Form F>
PAGODA_AVX2 void nibble_tile_avx2(const uint8_t* tile, const Pass& p) {
  walk_tile_avx2<M>(tile, p, group_share<F>(),
                    [&](int64_t g, int h, __m256* acc) PAGODA_AVX2 { nibble_group_avx2<M, F>(tile, p, g, h, acc); });
}

// The plain 4-bit forms (kPlain4) on AVX2, for any number of rows: a group's 8 maddubs of a row
// fit one int16 sum (8 pairs of <= 2 * 15 * 127: <= 30480), so each 64-byte block is unpacked
// once and taken against up to 8 rows straight away, its activation words broadcast from the
// rows themselves, the rows' sums in registers (the block loop is kept rolled: unrolled, GCC
// computes all 64 products first and spills them). The integer dot and the float steps, in
// their order, are those nibble_tile_avx2 ran for these forms before, so the bits are too.
// Measured on an AVX2 EPYC (Zen 3), 2 threads, the 1.5B's Q4_K shapes at 512 rows
// (benchmarks/prefill_matmuls.py, 3 alternating rounds): 75-78 G multiply-adds/s against 52-55
// at 4 rows a pass (1.41-1.46x). One group of rows 8h .. 8h + 7 against the pass's M rows:
template <int M, Form F>
PAGODA_AVX2 inline void plain4_group_avx2(const uint8_t* tile, const Pass& p, int64_t g, int h, __m256* acc) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* b = codes_at<F>(tile, g);
  const int8_t* q = p.q + g * GROUP;
  __m256i sum[M];
  for (int r = 0; r < M; ++r) sum[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
  for (int s = 0; s < 4; ++s) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * s + 32 * h));
    const __m256i lo = _mm256_and_si256(v, mask);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) {
      const int8_t* qr = q + r * p.k + 8 * s;
      const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo, word_x8(qr, 0)),
                                            _mm256_maddubs_epi16(hi, word_x8(qr, 1)));
      sum[r] = _mm256_add_epi16(sum[r], pair);
    }
  }
  __m256 s0, s1;
  group_scales_avx2<F>(tile, g, h, &s0, &s1);
#pragma GCC unroll 8
  for (int r = 0; r < M; ++r) {
    const int64_t i = r * p.groups + g;
    const __m256i dot = _mm256_madd_epi16(sum[r], ones);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s0, _mm256_set1_ps(p.xd[i])), acc[r]);
    acc[r] = _mm256_fmadd_ps(s1, _mm256_set1_ps(p.xs[i]), acc[r]);
  }
}

// plain4_group_avx2 for both halves of a group (decode passes, walk_tile_both_avx2).
template <int M, Form F>
PAGODA_AVX2 inline void plain4_group_both_avx2(const uint8_t* tile, const Pass& p, int64_t g, __m256 (*acc)[M]) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* b = codes_at<F>(tile, g);
  const int8_t* q = p.q + g * GROUP;
  __m256i sum[2][M];
  for (int r = 0; r < M; ++r) sum[0][r] = sum[1][r] = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int s = 0; s < 4; ++s) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * s));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * s + 32));
    const __m256i lo0 = _mm256_and_si256(v0, mask), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), mask);
    const __m256i lo1 = _mm256_and_si256(v1, mask), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), mask);
    for (int r = 0; r < M; ++r) {
      const int8_t* qr = q + r * p.k + 8 * s;
      const __m256i w0 = word_x8(qr, 0), w1 = word_x8(qr, 1);
      sum[0][r] = _mm256_add_epi16(sum[0][r], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, w0), _mm256_maddubs_epi16(hi0, w1)));
      sum[1][r] = _mm256_add_epi16(sum[1][r], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, w0), _mm256_maddubs_epi16(hi1, w1)));
    }
  }
  for (int h = 0; h < 2; ++h) {
    __m256 s0, s1;
    group_scales_avx2<F>(tile, g, h, &s0, &s1);
    for (int r = 0; r < M; ++r) {
      const int64_t i = r * p.groups + g;
      const __m256i dot = _mm256_madd_epi16(sum[h][r], ones);
      acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s0, _mm256_set1_ps(p.xd[i])), acc[h][r]);
      acc[h][r] = _mm256_fmadd_ps(s1, _mm256_set1_ps(p.xs[i]), acc[h][r]);
    }
  }
}

template <int M, Form F>
PAGODA_AVX2 void plain4_tile_avx2(const uint8_t* tile, const Pass& p) {
  if constexpr (M <= FUSED_M_AVX2) {
    walk_tile_both_avx2<M>(tile, p, group_share<F>(), [&](int64_t g, __m256(*acc)[M]) PAGODA_AVX2 {
      plain4_group_both_avx2<M, F>(tile, p, g, acc);
    });
  } else {
    walk_tile_avx2<M>(tile, p, group_share<F>(), [&](int64_t g, int h, __m256* acc) PAGODA_AVX2 {
      plain4_group_avx2<M, F>(tile, p, g, h, acc);
    });
  }
}

// A Q6_K block's 6-bit codes of half h (rows 8h .. 8h + 7) from its low-nibble bytes v and the
// block's high-bit planes hb: lo holds the low nibbles' codes, hi the high ones'. A byte's bits
// 4-5 after a 16-bit shift left by 4 (by 2) are its own bits 0-1 (2-3), so each half's high bits
// move into place with one shift and one mask.
PAGODA_AVX2 inline void q6k_codes_avx2(__m256i v, __m256i hb, int h, __m256i* lo, __m256i* hi) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i bits45 = _mm256_set1_epi8(0x30);
  const __m256i high_lo = h == 0 ? _mm256_slli_epi16(hb, 4) : hb;
  const __m256i high_hi = h == 0 ? _mm256_slli_epi16(hb, 2) : _mm256_srli_epi16(hb, 2);
  *lo = _mm256_or_si256(_mm256_and_si256(v, mask), _mm256_and_si256(high_lo, bits45));
  *hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), mask), _mm256_and_si256(high_hi, bits45));
}

// kQ6K on AVX2, for any number of rows, as plain4_tile_avx2: a block's codes (low nibbles and
// high bits) unpacked once against up to 8 rows. A pair of maddubs of 6-bit codes is <= 32004,
// so each block's pair is widened to int32 at once; a half's two blocks, less 32 * its sum of
// activation codes, scale and add as nibble_tile_avx2's did, the same bits. 1.06x at 512 rows
// (45 against 42 G multiply-adds/s): widening every block costs what the unpacking saves.
template <int M>
PAGODA_AVX2 inline void q6k_group_avx2(const uint8_t* tile, const Pass& p, int64_t g, int h, __m256* acc) {
  constexpr Form F = Form::kQ6K;
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* b = codes_at<F>(tile, g);
  const int8_t* q = p.q + g * GROUP;
  __m256 s[2];
  group_scales_avx2<F>(tile, g, h, &s[0], &s[1]);
  for (int half = 0; half < 2; ++half) {
    __m256i sum[M];
    for (int r = 0; r < M; ++r) sum[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int blk = 2 * half; blk < 2 * half + 2; ++blk) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * blk + 32 * h));
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 256 + 32 * blk));
      __m256i lo, hi;
      q6k_codes_avx2(v, hb, h, &lo, &hi);
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r) {
        const int8_t* qr = q + r * p.k + 8 * blk;
        const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo, word_x8(qr, 0)),
                                              _mm256_maddubs_epi16(hi, word_x8(qr, 1)));
        sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(pair, ones));
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) {
      const int64_t i = r * p.groups + g;
      const __m256i d = _mm256_sub_epi32(sum[r], _mm256_set1_epi32(kHalfOffset<F> * p.qsum16[2 * i + half]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(s[half], _mm256_set1_ps(p.xd[i])), acc[r]);
    }
  }
}

// q6k_group_avx2 for both halves of a group (decode passes, walk_tile_both_avx2): a block's
// high-bit planes, shared by the halves, loaded once.
template <int M>
PAGODA_AVX2 inline void q6k_group_both_avx2(const uint8_t* tile, const Pass& p, int64_t g, __m256 (*acc)[M]) {
  constexpr Form F = Form::kQ6K;
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* b = codes_at<F>(tile, g);
  const int8_t* q = p.q + g * GROUP;
  __m256 s[2][2];
  for (int h = 0; h < 2; ++h) group_scales_avx2<F>(tile, g, h, &s[h][0], &s[h][1]);
  for (int half = 0; half < 2; ++half) {
    __m256i sum[2][M];
    for (int r = 0; r < M; ++r) sum[0][r] = sum[1][r] = _mm256_setzero_si256();
    for (int blk = 2 * half; blk < 2 * half + 2; ++blk) {
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 256 + 32 * blk));
      __m256i lo[2], hi[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * blk + 32 * h));
        q6k_codes_avx2(v, hb, h, &lo[h], &hi[h]);
      }
      for (int r = 0; r < M; ++r) {
        const int8_t* qr = q + r * p.k + 8 * blk;
        const __m256i w0 = word_x8(qr, 0), w1 = word_x8(qr, 1);
        for (int h = 0; h < 2; ++h) {
          const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], w0), _mm256_maddubs_epi16(hi[h], w1));
          sum[h][r] = _mm256_add_epi32(sum[h][r], _mm256_madd_epi16(pair, ones));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      for (int r = 0; r < M; ++r) {
        const int64_t i = r * p.groups + g;
        const __m256i d = _mm256_sub_epi32(sum[h][r], _mm256_set1_epi32(kHalfOffset<F> * p.qsum16[2 * i + half]));
        acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(s[h][half], _mm256_set1_ps(p.xd[i])), acc[h][r]);
      }
    }
  }
}

template <int M>
PAGODA_AVX2 void q6k_tile_avx2(const uint8_t* tile, const Pass& p) {
  constexpr Form F = Form::kQ6K;
  if constexpr (M <= FUSED_M_AVX2) {
    walk_tile_both_avx2<M>(tile, p, group_share<F>(), [&](int64_t g, __m256(*acc)[M]) PAGODA_AVX2 {
      q6k_group_both_avx2<M>(tile, p, g, acc);
    });
  } else {
    walk_tile_avx2<M>(tile, p, group_share<F>(),
                      [&](int64_t g, int h, __m256* acc) PAGODA_AVX2 { q6k_group_avx2<M>(tile, p, g, h, acc); });
  }
}

// Row j's code of block s, byte 4j + e, low (hi = 0) or high nibble (the crumb forms: the code
// kept in its place), with its upper bits; the IQ4 forms: its value.
template <Form F>
inline int nibble_code(const uint8_t* b, int s, int j, int e, int hi) {
  const int at = 4 * j + e, i = 2 * s + hi;
  int code;
  if constexpr (kCrumb<F>) {
    code = (b[64 * (i / 4) + at] >> (2 * (i % 4))) & 3;
  } else {
    const uint8_t byte = b[64 * s + at];
    code = hi ? byte >> 4 : byte & 0x0F;
  }
  if constexpr (kFifth<F>) {
    code |= static_cast<int>((fifth_mask<F>(b, i) >> at) & 1u) * kMaskBit<F>;
  } else if constexpr (kTable<F>) {
    code = kIq4[code];
  } else if constexpr (F == Form::kQ6K) {
    code |= ((q6k_high(b, s, at) >> (2 * hi)) & 3) << 4;
  }
  return code;
}

// Group g's scale and offset for row j; kQ6K: its halves' scales.
template <Form F>
inline void group_scales_scalar(const uint8_t* tile, int64_t g, int64_t j, float* s0, float* s1) {
  const uint8_t* b = codes_at<F>(tile, g);
  const uint8_t* unit = unit_at<F>(tile, g);
  if constexpr (F == Form::kQ4) {
    *s0 = fp16(b + 256 + 2 * j);
    *s1 = fp16(b + 288 + 2 * j);
  } else if constexpr (F == Form::kQ40 || F == Form::kIq4Nl) {
    *s0 = fp16(b + 256 + 2 * j);
    *s1 = *s0 * -8.f;
  } else if constexpr (F == Form::kQ5) {
    *s0 = fp16(b + 320 + 2 * j);
    *s1 = *s0 * -16.f;
  } else if constexpr (F == Form::kQ51) {
    *s0 = fp16(b + 320 + 2 * j);
    *s1 = fp16(b + 352 + 2 * j);
  } else if constexpr (kMinK<F>) {
    const uint8_t* meta = meta_of<F>(tile, g);
    *s0 = fp16(unit + d_at<F>() + 2 * j) * static_cast<float>(meta[j]);
    *s1 = fp16(unit + d_at<F>() + 32 + 2 * j) * static_cast<float>(meta[16 + j]);
  } else if constexpr (F == Form::kQ2K) {
    const uint8_t* meta = meta_of<F>(tile, g);
    const float d = fp16(unit + d_at<F>() + 2 * j);
    *s0 = d * static_cast<float>(meta[j] & 0x0F);
    *s1 = d * static_cast<float>(meta[16 + j] & 0x0F);
  } else {
    const auto* sc = reinterpret_cast<const int8_t*>(meta_of<F>(tile, g));
    const float d = fp16(unit + d_at<F>() + 2 * j);
    *s0 = d * static_cast<float>(sc[j]);
    *s1 = kHalves<F> ? d * static_cast<float>(sc[16 + j]) : *s0;
  }
}

template <Form F>
void nibble_tile_scalar(const uint8_t* tile, const Pass& p, int m) {
  for (int r = 0; r < m; ++r) {
    for (int64_t j = 0; j < p.valid; ++j) {
      float sum = 0.f;
      for (int64_t g = 0; g < p.groups; ++g) {
        const uint8_t* b = codes_at<F>(tile, g);
        const int8_t* q = p.q + r * p.k + g * GROUP;
        int dot[2] = {0, 0};  // values [0, 16) and [16, 32) of the group
        for (int s = 0; s < 4; ++s) {
          for (int e = 0; e < 4; ++e) {
            const int jj = static_cast<int>(j);
            dot[s / 2] += nibble_code<F>(b, s, jj, e, 0) * q[8 * s + e] +
                          nibble_code<F>(b, s, jj, e, 1) * q[8 * s + 4 + e];
          }
        }
        const int64_t i = r * p.groups + g;
        float s0, s1;
        group_scales_scalar<F>(tile, g, j, &s0, &s1);
        if constexpr (kHalves<F>) {
          sum += static_cast<float>(dot[0] - kHalfOffset<F> * p.qsum16[2 * i]) * (s0 * p.xd[i]);
          sum += static_cast<float>(dot[1] - kHalfOffset<F> * p.qsum16[2 * i + 1]) * (s1 * p.xd[i]);
          if constexpr (F == Form::kQ2K) {
            const uint8_t* meta = meta_of<F>(tile, g);
            const float ndmin = fp16(unit_at<F>(tile, g) + d_at<F>() + 32 + 2 * j);
            sum += ndmin * static_cast<float>(meta[j] >> 4) * (p.xd[i] * static_cast<float>(p.qsum16[2 * i]));
            sum += ndmin * static_cast<float>(meta[16 + j] >> 4) * (p.xd[i] * static_cast<float>(p.qsum16[2 * i + 1]));
          }
        } else if constexpr (kTable<F>) {
          sum += static_cast<float>(dot[0] + dot[1]) * (s0 * p.xd[i]);
        } else {
          sum += static_cast<float>(dot[0] + dot[1]) * (s0 * p.xd[i]) + s1 * p.xs[i];
        }
      }
      p.y[r * p.ldy + j] = sum;
    }
  }
}

// ---- 8-bit ----------------------------------------------------------------------------------

// scales: the tile's (groups, 16) float32, or (1, 16) when one scale serves a whole row
template <int M, bool kRowScale>
PAGODA_VNNI void q8_tile_vnni(const uint8_t* tile, const float* scales, const Pass& p) {
  __m512 acc[M];
  for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    const uint8_t* b = tile + g * Q8_BYTES;
    prefetch_ahead(b, Q8_BYTES);
    __m512i w[8];
    for (int s = 0; s < 8; ++s) w[s] = _mm512_loadu_si512(b + 64 * s);
    const __m512 scale = kRowScale ? _mm512_setzero_ps() : _mm512_loadu_ps(scales + 16 * g);
#pragma GCC unroll 8  // (as nibble_tile_vnni's rows)
    for (int r = 0; r < M; ++r) {
      const int8_t* qw = p.q + r * p.k + g * GROUP;
      const int64_t i = r * p.groups + g;
      __m512i d0 = _mm512_set1_epi32(-128 * p.qsum[i]), d1 = _mm512_setzero_si512();
      for (int s = 0; s < 8; s += 2) {
        d0 = _mm512_dpbusd_epi32(d0, w[s], word_x16(qw, s));
        d1 = _mm512_dpbusd_epi32(d1, w[s + 1], word_x16(qw, s + 1));
      }
      const __m512 d = _mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1));
      const __m512 xd = _mm512_set1_ps(p.xd[i]);
      acc[r] = _mm512_fmadd_ps(d, kRowScale ? xd : _mm512_mul_ps(scale, xd), acc[r]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << p.valid) - 1u);
  for (int r = 0; r < M; ++r) {
    const __m512 out = kRowScale ? _mm512_mul_ps(acc[r], _mm512_loadu_ps(scales)) : acc[r];
    _mm512_mask_storeu_ps(p.y + r * p.ldy, keep, out);
  }
}

// Signed codes: |w| as unsigned, w's sign moved onto the activations (maddubs pair <= 32512).
template <int M>
PAGODA_AVX2 void q8_tile_avx2(const uint8_t* tile, const float* scales, int64_t sstep,
                              const Pass& p) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  walk_tile_avx2<M>(tile, p, Q8_BYTES, [&](int64_t g, int h, __m256* acc) PAGODA_AVX2 {
    const uint8_t* b = tile + g * Q8_BYTES;
    __m256i w[8];
    for (int s = 0; s < 8; ++s) {
      w[s] = _mm256_xor_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * s + 32 * h)), flip);
    }
    const __m256 scale = _mm256_loadu_ps(scales + g * sstep + 8 * h);
    for (int r = 0; r < M; ++r) {
      const int8_t* qw = p.q + r * p.k + g * GROUP;
      __m256i dot = _mm256_setzero_si256();
      for (int s = 0; s < 8; ++s) {
        const __m256i u = _mm256_sign_epi8(w[s], w[s]);
        const __m256i sq = _mm256_sign_epi8(word_x8(qw, s), w[s]);
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(u, sq), ones));
      }
      const __m256 xd = _mm256_set1_ps(p.xd[r * p.groups + g]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, xd), acc[r]);
    }
  });
}

void q8_tile_scalar(const uint8_t* tile, const float* scales, int64_t sstep, const Pass& p,
                    int m) {
  for (int r = 0; r < m; ++r) {
    for (int64_t j = 0; j < p.valid; ++j) {
      float sum = 0.f;
      for (int64_t g = 0; g < p.groups; ++g) {
        const uint8_t* b = tile + g * Q8_BYTES;
        const int8_t* q = p.q + r * p.k + g * GROUP;
        int dot = 0;
        for (int s = 0; s < 8; ++s) {
          for (int e = 0; e < 4; ++e) {
            dot += (static_cast<int>(b[64 * s + 4 * j + e]) - 128) * q[4 * s + e];
          }
        }
        sum += static_cast<float>(dot) * (scales[g * sstep + j] * p.xd[r * p.groups + g]);
      }
      p.y[r * p.ldy + j] = sum;
    }
  }
}

// ---- dispatch -------------------------------------------------------------------------------

// isa_limit 3 lets a call take the tile unit (AMX) where amx_ready(), for its passes of 16
// rows (the same bits as VNNI's); below 16 rows there is no full pass.
bool use_amx(int64_t isa_limit, Isa isa, int64_t m) {
  return isa_limit >= 3 && isa == Isa::kVnni && m >= AMX_ROWS && amx_ready();
}

// Rows a block of a tile-unit call (AMX) or of a VNNI call: whole passes whose int8 activations
// fill at most about 1 MB, half a core's L2 (the other half holds a tile's unpacked codes and
// what y takes), read by every tile; at most 256, so that the rows of y a tile writes (N floats
// apart) stay within fewer pages. On VNNI, 2,048 rows of the 1.5B's shapes, 3 alternating runs
// against unblocked (benchmarks/results/issue42/part11/prefill_matmuls_2048_ab.json): down
// 1.32x (Q4_K) and 1.17x (Q6_K), whose K = 8,960 rows fill L2 many times over; qkv and gate/up
// (K = 1,536) level. 0 (the rows in one block) on AVX2 and scalar.
int64_t rows_per_block(bool amx, Isa isa, int64_t k) {
  if (!amx && isa != Isa::kVnni) return 0;
  return std::clamp<int64_t>((int64_t{1} << 20) / k / AMX_ROWS * AMX_ROWS, AMX_ROWS, 256);
}

int64_t rows_per_pass(Isa isa, bool by_block = false) {
  if (isa == Isa::kVnni) return MAX_M_VNNI;
  return by_block && isa == Isa::kAvx2 ? MAX_M_AVX2_BY_BLOCK : MAX_M_AVX2;
}

// x quantized for the tile functions (common.h's quantize; half_sums: the sums of codes per 16
// values the forms with a scale per 16 values take), and the pass over its rows from r on.
struct QuantizedRows {
  at::Tensor x;
  int64_t m, k, groups;
  Activations a;
  std::vector<int32_t> sums16;
  // a's data, read once (a pass is built per tile and row block: tens of thousands a call)
  const int8_t* q;
  const float *xd, *xs;
  const int32_t* qsum;

  QuantizedRows(const at::Tensor& x_in, Isa isa, bool half_sums)
      : x(float_rows(x_in)), m(x.size(0)), k(x.size(1)), groups(k / GROUP), a(quantize(x, isa)),
        sums16(half_sums ? m * k / 16 : 0), q(a.q.data_ptr<int8_t>()),
        xd(a.xd.data_ptr<float>()), xs(a.xs.data_ptr<float>()), qsum(a.qsum.data_ptr<int32_t>()) {
    at::parallel_for(0, static_cast<int64_t>(sums16.size()), QUANTIZE_GRAIN, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        int32_t sum = 0;
        for (int e = 0; e < 16; ++e) sum += q[16 * i + e];
        sums16[i] = sum;
      }
    });
  }

  // rows r .. of a pass whose 16 outputs of row i go to y + i * ldy (valid of them)
  Pass pass(int64_t r, float* y, int64_t ldy, int64_t valid) const {
    return Pass{q + r * k,
                k,
                xd + r * groups,
                xs + r * groups,
                qsum + r * groups,
                sums16.empty() ? nullptr : sums16.data() + r * 2 * groups,
                groups,
                y,
                ldy,
                valid};
  }
};

// Runs tile_fn(tile index, pass of up to per_pass rows, rows in it) over every tile
// and row block. Each row's arithmetic is the same whatever the pass holds: a row gives the same
// bits in any batch. lora: the adapters' products added to y (lora.h), taken between the tiles.
// row_block > 0 (without adapters): the rows in blocks of that many, each block over every tile
// (in passes of per_pass rows) before the next, so that a block's activations stay in the cache
// across the tiles.
template <typename TileFn>
at::Tensor run_tiles(const at::Tensor& x_in, int64_t n, int64_t tiles, Isa isa, int64_t per_pass,
                     TileFn&& tile_fn, bool half_sums, const LoraArgs& lora,
                     int64_t row_block = 0) {
  const QuantizedRows xq(x_in, isa, half_sums);
  const int64_t m = xq.m;
  auto y = at::empty({m, n}, at::kFloat);
  float* yp = y.data_ptr<float>();
  const std::unique_ptr<LoraStage> stage = lora_stage(xq.x, y, lora, isa);
  const auto pass_at = [&](int64_t t, int64_t r) {
    return xq.pass(r, yp + r * n + t * ROWS, n, std::min(ROWS, n - t * ROWS));
  };
  if (row_block > 0 && !stage && m > row_block) {
    for (int64_t r0 = 0; r0 < m; r0 += row_block) {
      const int64_t r1 = std::min(m, r0 + row_block);
      at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          for (int64_t r = r0; r < r1; r += per_pass) {
            tile_fn(t, pass_at(t, r), static_cast<int>(std::min(per_pass, r1 - r)));
          }
        }
      });
    }
    return y;
  }
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t r = 0; r < m; r += per_pass) {
        tile_fn(t, pass_at(t, r), static_cast<int>(std::min(per_pass, m - r)));
      }
      if (stage) stage->after_tile(t, begin, end, tiles);
    }
  });
  if (stage) stage->finish();
  return y;
}

// run_tiles for a gate | up weight (n = 2d rows, d a multiple of 16) with SiLU-and-mul after
// it: y (M, d) = silu(x W_gate^T) * (x W_up^T). A pass computes gate tile t and up tile t + d / 16
// into the thread's scratch and writes silu_mul of them straight into y, so the (M, 2d) product
// is never written whole nor read back by a silu_and_mul pass (at 2,048 rows of SmolLM2 that is
// 25 MB stored and loaded a layer). The same tiles and silu_mul on 16-value slices: the bits of
// silu_and_mul(run_tiles(...)) (common.h's silu_mul).
template <typename TileFn>
at::Tensor run_gated_tiles(const at::Tensor& x_in, int64_t d, Isa isa, int64_t per_pass,
                           TileFn&& tile_fn, bool half_sums, int64_t row_block) {
  const QuantizedRows xq(x_in, isa, half_sums);
  const int64_t m = xq.m, half = d / ROWS, block = row_block > 0 ? row_block : m;
  const int64_t step = std::min(per_pass, block);  // rows a pass (AMX's per_pass is every row)
  auto y = at::empty({m, d}, at::kFloat);
  float* yp = y.data_ptr<float>();
  for (int64_t r0 = 0; r0 < m; r0 += block) {
    const int64_t r1 = std::min(m, r0 + block);
    at::parallel_for(0, half, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> gate(step * ROWS), up(step * ROWS);
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t r = r0; r < r1; r += step) {
          const int rows = static_cast<int>(std::min(step, r1 - r));
          tile_fn(t, xq.pass(r, gate.data(), ROWS, ROWS), rows);
          tile_fn(t + half, xq.pass(r, up.data(), ROWS, ROWS), rows);
          for (int i = 0; i < rows; ++i) {
            silu_mul(gate.data() + i * ROWS, up.data() + i * ROWS, ROWS, yp + (r + i) * d + t * ROWS, isa);
          }
        }
      }
    });
  }
  return y;
}

void check_packed(const at::Tensor& packed, int64_t tiles, int64_t groups, int64_t bytes,
                  int64_t n, int64_t k) {
  TORCH_CHECK(packed.dtype() == at::kByte && packed.is_contiguous() && packed.dim() == 3,
              "packed: contiguous uint8 (tiles, groups, ", bytes, ")");
  TORCH_CHECK(packed.size(0) == tiles && packed.size(1) == groups && packed.size(2) == bytes,
              "packed shape: expected (", tiles, ", ", groups, ", ", bytes, ") for N=", n, ", K=",
              k, ", got ", packed.sizes());
}

// Calls fn(std::integral_constant<Form, F>) for F = form.
template <typename Fn>
void with_form(Form form, Fn&& fn) {
  switch (form) {
    case Form::kQ4: fn(std::integral_constant<Form, Form::kQ4>{}); break;
    case Form::kQ5: fn(std::integral_constant<Form, Form::kQ5>{}); break;
    case Form::kQ4K: fn(std::integral_constant<Form, Form::kQ4K>{}); break;
    case Form::kQ6K: fn(std::integral_constant<Form, Form::kQ6K>{}); break;
    case Form::kQ40: fn(std::integral_constant<Form, Form::kQ40>{}); break;
    case Form::kQ51: fn(std::integral_constant<Form, Form::kQ51>{}); break;
    case Form::kQ5K: fn(std::integral_constant<Form, Form::kQ5K>{}); break;
    case Form::kIq4Nl: fn(std::integral_constant<Form, Form::kIq4Nl>{}); break;
    case Form::kIq4Xs: fn(std::integral_constant<Form, Form::kIq4Xs>{}); break;
    case Form::kQ3K: fn(std::integral_constant<Form, Form::kQ3K>{}); break;
    case Form::kQ2K: fn(std::integral_constant<Form, Form::kQ2K>{}); break;
  }
}

// The tile function of q4x16_matmul's arguments and how to run it: run(tile_fn, isa, per_pass,
// half_sums, row_block, tiles) -> y. packed: (ceil(n / 16), K / 32 or K / 256, unit_bytes(form))
// uint8, the nibble tiles described at the top; form: Form's number.
template <typename Run>
at::Tensor with_nibble_tiles(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                             int64_t isa_limit, int64_t form_number, Run&& run) {
  check_rows(x);
  TORCH_CHECK(form_number >= 0 && form_number < FORMS, "form: 0 .. ", FORMS - 1, ", got ", form_number);
  const auto form = static_cast<Form>(form_number);
  bool super = false;
  with_form(form, [&](auto tag) { super = kSuper<decltype(tag)::value>; });
  const int64_t tiles = (n + ROWS - 1) / ROWS, k = x.size(-1), per_unit = super ? 8 * GROUP : GROUP;
  TORCH_CHECK(k % per_unit == 0, "K must be a multiple of ", per_unit, " for this form, got ", k);
  check_packed(packed, tiles, k / per_unit, unit_bytes(form), n, k);
  const Isa isa = pick_isa(isa_limit);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int64_t tile_bytes = (k / per_unit) * unit_bytes(form);
  bool halves = false, by_block = false;
  with_form(form, [&](auto tag) {
    halves = kHalves<decltype(tag)::value>;
    by_block = kByBlockAvx2<decltype(tag)::value>;
  });
  const bool amx = use_amx(isa_limit, isa, x.size(0));
  const auto tile_fn = [&](int64_t t, const Pass& p, int m) {
    const uint8_t* tile = w + t * tile_bytes;
    with_form(form, [&](auto tag) {
      constexpr Form F = decltype(tag)::value;
      if (amx) {
        nibble_tile_amx<F>(tile, p, m);
      } else if (isa == Isa::kVnni) {
        with_rows<MAX_M_VNNI>(m, [&](auto rows) { nibble_tile_vnni<decltype(rows)::value, F>(tile, p); });
      } else if (isa == Isa::kAvx2) {
        if constexpr (kPlain4<F>) {
          with_rows<MAX_M_AVX2_BY_BLOCK>(m, [&](auto rows) { plain4_tile_avx2<decltype(rows)::value, F>(tile, p); });
        } else if constexpr (F == Form::kQ6K) {
          with_rows<MAX_M_AVX2_BY_BLOCK>(m, [&](auto rows) { q6k_tile_avx2<decltype(rows)::value>(tile, p); });
        } else {
          with_rows<MAX_M_AVX2>(m, [&](auto rows) { nibble_tile_avx2<decltype(rows)::value, F>(tile, p); });
        }
      } else {
        nibble_tile_scalar<F>(tile, p, m);
      }
    });
  };
  const int64_t per_pass = amx ? x.size(0) : rows_per_pass(isa, by_block);
  return run(tile_fn, isa, per_pass, halves, rows_per_block(amx, isa, k), tiles);
}

at::Tensor q4x16_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                        int64_t isa_limit, int64_t form_number, const LoraOpt& lora_a,
                        const LoraOpt& lora_b, const LoraOpt& lora_slots,
                        at::IntArrayRef lora_offsets) {
  const LoraArgs lora{lora_a, lora_b, lora_slots, lora_offsets};
  return with_nibble_tiles(x, packed, n, isa_limit, form_number,
                           [&](auto& tile_fn, Isa isa, int64_t per_pass, bool halves,
                               int64_t row_block, int64_t tiles) {
                             return run_tiles(x, n, tiles, isa, per_pass, tile_fn, halves, lora, row_block);
                           });
}

// packed: (ceil(n / 16), K / 32, 512) uint8; scales: (ceil(n / 16), K / 32 or 1, 16) float32
at::Tensor q8x16_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        int64_t n, int64_t isa_limit, const LoraOpt& lora_a,
                        const LoraOpt& lora_b, const LoraOpt& lora_slots,
                        at::IntArrayRef lora_offsets) {
  check_rows(x);
  const int64_t tiles = (n + ROWS - 1) / ROWS, k = x.size(-1), groups = k / GROUP;
  check_packed(packed, tiles, groups, Q8_BYTES, n, k);
  TORCH_CHECK(scales.dtype() == at::kFloat && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == tiles && scales.size(2) == ROWS &&
                  (scales.size(1) == groups || scales.size(1) == 1),
              "scales: contiguous float32 (", tiles, ", ", groups, " or 1, 16), got ",
              scales.sizes());
  const bool row_scale = scales.size(1) == 1;
  const int64_t sstep = row_scale ? 0 : ROWS;
  const Isa isa = pick_isa(isa_limit);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  const LoraArgs lora{lora_a, lora_b, lora_slots, lora_offsets};
  const bool amx = use_amx(isa_limit, isa, x.size(0));
  const auto tile_fn = [&](int64_t t, const Pass& p, int m) {
    const uint8_t* tile = w + t * groups * Q8_BYTES;
    const float* s = sc + t * scales.size(1) * ROWS;
    if (amx) {
      row_scale ? q8_tile_amx<true>(tile, s, p, m) : q8_tile_amx<false>(tile, s, p, m);
    } else if (isa == Isa::kVnni) {
      with_rows<MAX_M_VNNI>(m, [&](auto rows) {
        constexpr int M = decltype(rows)::value;
        row_scale ? q8_tile_vnni<M, true>(tile, s, p) : q8_tile_vnni<M, false>(tile, s, p);
      });
    } else if (isa == Isa::kAvx2) {
      with_rows<MAX_M_AVX2>(m, [&](auto rows) { q8_tile_avx2<decltype(rows)::value>(tile, s, sstep, p); });
    } else {
      q8_tile_scalar(tile, s, sstep, p, m);
    }
  };
  const int64_t per_pass = amx ? x.size(0) : rows_per_pass(isa);
  return run_tiles(x, n, tiles, isa, per_pass, tile_fn, false, lora, rows_per_block(amx, isa, k));
}

// ---- with a prologue: the row op before the matmul in the same call ----------------------------
//
// A compiled decode step calls each custom op from its wrapper at a cost of microseconds, so the
// norm before a projection and the activation before down_proj run inside the projection's op:
// y = matmul(rms_norm(x + residual)) with x + residual returned too, or y =
// matmul(silu_and_mul(x)). The row ops are row_ops.cpp's, so eager steps (which call these ops
// too) and compiled ones compute the same bits.

std::tuple<at::Tensor, at::Tensor> q4x16_matmul_norm(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
    double eps, const at::Tensor& packed, int64_t n, int64_t isa_limit, int64_t form,
    const LoraOpt& lora_a, const LoraOpt& lora_b, const LoraOpt& lora_slots,
    at::IntArrayRef lora_offsets) {
  auto [normed, hidden] = add_rms_norm(x, residual, weight, eps, isa_limit);
  return {q4x16_matmul(normed, packed, n, isa_limit, form, lora_a, lora_b, lora_slots,
                       lora_offsets),
          hidden};
}

std::tuple<at::Tensor, at::Tensor> q8x16_matmul_norm(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
    double eps, const at::Tensor& packed, const at::Tensor& scales, int64_t n, int64_t isa_limit,
    const LoraOpt& lora_a, const LoraOpt& lora_b, const LoraOpt& lora_slots,
    at::IntArrayRef lora_offsets) {
  auto [normed, hidden] = add_rms_norm(x, residual, weight, eps, isa_limit);
  return {q8x16_matmul(normed, packed, scales, n, isa_limit, lora_a, lora_b, lora_slots,
                       lora_offsets),
          hidden};
}

// Rows from which q4x16_matmul_norm_silu runs gate and up tiles in pairs (run_gated_tiles);
// fewer take the whole product, then silu_and_mul (the same bits). A pass of few rows streams
// its weights from memory, and the pairs' two streams (tile t, then t + d / 16) leave each tile's
// first lines unprefetched: the 1.5B's 28 gate_up weights in turn, 2 threads on the Zen 5 EPYC,
// paired against whole (by hand): 1 row 0.78x, 8 rows 0.80x, 32 rows 1.03x, 128 rows 1.01x;
// SmolLM2's shapes at 2,048 rows 1.35x.
constexpr int64_t GATED_MIN_ROWS = 32;

// (silu_and_mul(y), h) for (y, h) = q4x16_matmul_norm(...) without adapters, y's n = 2d rows
// gate | up, d a multiple of 16: the gate_up projection with the SiLU after it in the same call
// (run_gated_tiles), the same bits. The down projection then takes the activation as it is.
std::tuple<at::Tensor, at::Tensor> q4x16_matmul_norm_silu(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
    double eps, const at::Tensor& packed, int64_t n, int64_t isa_limit, int64_t form) {
  TORCH_CHECK(n % (2 * ROWS) == 0, "n: gate | up, each a multiple of 16 rows, got ", n);
  auto [normed, hidden] = add_rms_norm(x, residual, weight, eps, isa_limit);
  if (normed.size(0) < GATED_MIN_ROWS) {
    const at::Tensor y = q4x16_matmul(normed, packed, n, isa_limit, form, c10::nullopt,
                                      c10::nullopt, c10::nullopt, {});
    return {silu_and_mul(y, isa_limit), hidden};
  }
  at::Tensor act = with_nibble_tiles(normed, packed, n, isa_limit, form,
                                     [&](auto& tile_fn, Isa isa, int64_t per_pass, bool halves,
                                         int64_t row_block, int64_t) {
                                       return run_gated_tiles(normed, n / 2, isa, per_pass, tile_fn,
                                                              halves, row_block);
                                     });
  return {act, hidden};
}

at::Tensor q4x16_matmul_silu(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                             int64_t isa_limit, int64_t form, const LoraOpt& lora_a,
                             const LoraOpt& lora_b, const LoraOpt& lora_slots,
                             at::IntArrayRef lora_offsets) {
  return q4x16_matmul(silu_and_mul(x, isa_limit), packed, n, isa_limit, form, lora_a, lora_b,
                      lora_slots, lora_offsets);
}

at::Tensor q8x16_matmul_silu(const at::Tensor& x, const at::Tensor& packed,
                             const at::Tensor& scales, int64_t n, int64_t isa_limit,
                             const LoraOpt& lora_a, const LoraOpt& lora_b,
                             const LoraOpt& lora_slots, at::IntArrayRef lora_offsets) {
  return q8x16_matmul(silu_and_mul(x, isa_limit), packed, scales, n, isa_limit, lora_a, lora_b,
                      lora_slots, lora_offsets);
}

// The activations as the kernels quantize them (for the tests): (q, xd, xs)
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x) {
  const Activations a = quantize(float_rows(x), best_isa());
  return {a.q, a.xd, a.xs};
}

int64_t isa() { return static_cast<int64_t>(best_isa()); }

}  // namespace
}  // namespace pagoda_cpu

// torch.ops.pagoda_cpu.*: custom ops, so torch.compile keeps them in its graph (their shapes are
// registered in Python, pagoda/kernels/cpu/__init__.py). The matmuls' optional lora_* arguments
// add the adapters' products to y (lora.h).
#define LORA_ARGS \
  ", Tensor? lora_a=None, Tensor? lora_b=None, Tensor? lora_slots=None, int[] lora_offsets=[]"
TORCH_LIBRARY(pagoda_cpu, m) {
  m.def("q4x16_matmul(Tensor x, Tensor packed, int n, int isa_limit, int form" LORA_ARGS
        ") -> Tensor");
  m.def("q8x16_matmul(Tensor x, Tensor packed, Tensor scales, int n, int isa_limit" LORA_ARGS
        ") -> Tensor");
  m.def(
      "q4x16_matmul_norm(Tensor x, Tensor? residual, Tensor weight, float eps, Tensor packed, "
      "int n, int isa_limit, int form" LORA_ARGS ") -> (Tensor, Tensor)");
  m.def(
      "q8x16_matmul_norm(Tensor x, Tensor? residual, Tensor weight, float eps, Tensor packed, "
      "Tensor scales, int n, int isa_limit" LORA_ARGS ") -> (Tensor, Tensor)");
  m.def("q4x16_matmul_silu(Tensor x, Tensor packed, int n, int isa_limit, int form" LORA_ARGS
        ") -> Tensor");
  m.def(
      "q4x16_matmul_norm_silu(Tensor x, Tensor? residual, Tensor weight, float eps, Tensor packed, "
      "int n, int isa_limit, int form) -> (Tensor, Tensor)");
  m.def("q8x16_matmul_silu(Tensor x, Tensor packed, Tensor scales, int n, int isa_limit"
        LORA_ARGS ") -> Tensor");
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("isa() -> int", &pagoda_cpu::isa);
  m.def("amx() -> bool", &pagoda_cpu::amx_ready);
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("q4x16_matmul", &pagoda_cpu::q4x16_matmul);
  m.impl("q8x16_matmul", &pagoda_cpu::q8x16_matmul);
  m.impl("q4x16_matmul_norm", &pagoda_cpu::q4x16_matmul_norm);
  m.impl("q8x16_matmul_norm", &pagoda_cpu::q8x16_matmul_norm);
  m.impl("q4x16_matmul_silu", &pagoda_cpu::q4x16_matmul_silu);
  m.impl("q4x16_matmul_norm_silu", &pagoda_cpu::q4x16_matmul_norm_silu);
  m.impl("q8x16_matmul_silu", &pagoda_cpu::q8x16_matmul_silu);
  m.impl("quantize_activations", &pagoda_cpu::quantize_activations);
}
