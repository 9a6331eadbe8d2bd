// A paged KV cache's rows as float32, whatever the cache stores: float32 is read in place by the
// attention; bfloat16 and float16 are converted exactly; int8 and float8 e4m3 (with one float32
// scale per token and kv head, kernels/paged_cache.py) become code * scale, one float32
// multiplication, the bits layers/kv_cache.py:dequantize_kv gives. So attention over a
// converted row is attention over the float32 cache the torch path reads back.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <array>
#include <cstdint>
#include <cstring>

namespace pagoda_cpu {

enum class KvType { kF32, kBf16, kF16, kI8, kFp8 };

// One cache tensor (num_blocks, block_size, kv_heads, width), contiguous, and its scales
// (num_blocks, block_size, kv_heads) float32 when quantized (nullptr otherwise).
struct KvRows {
  const void* data = nullptr;
  const float* scale = nullptr;
  KvType type = KvType::kF32;
  int64_t kv_heads = 0, width = 0;
};

inline KvType kv_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return KvType::kF32;
    case at::kBFloat16: return KvType::kBf16;
    case at::kHalf: return KvType::kF16;
    case at::kChar: return KvType::kI8;
    case at::kFloat8_e4m3fn: return KvType::kFp8;
    default:
      TORCH_CHECK(false, "caches must be float32, bfloat16, float16, int8 or float8_e4m3fn, got ",
                  t);
  }
}

inline bool kv_scaled(KvType t) { return t == KvType::kI8 || t == KvType::kFp8; }

inline int64_t kv_bytes(KvType t) { return t == KvType::kF32 ? 4 : kv_scaled(t) ? 1 : 2; }

// Every float8 e4m3fn code as a float (exact).
inline const float* fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) {
      t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    }
    return t;
  }();
  return table.data();
}

// dst[0 .. n) = the n values at src as float32, times `scale` where the type is scaled.
inline void to_float_scalar(const KvRows& r, const void* src, int64_t n, float scale, float* dst) {
  switch (r.type) {
    case KvType::kF32: std::memcpy(dst, src, n * sizeof(float)); break;
    case KvType::kBf16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
        std::memcpy(dst + i, &bits, sizeof(float));
      }
      break;
    }
    case KvType::kF16: {
      const c10::Half* s = static_cast<const c10::Half*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
      break;
    }
    case KvType::kI8: {
      const int8_t* s = static_cast<const int8_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]) * scale;
      break;
    }
    case KvType::kFp8: {
      const uint8_t* s = static_cast<const uint8_t*>(src);
      const float* t = fp8_table();
      for (int64_t i = 0; i < n; ++i) dst[i] = t[s[i]] * scale;
      break;
    }
  }
}

// The same values, eight at a time where the type allows (the per-element arithmetic is the
// scalar one: exact conversions, one multiplication).
__attribute__((target("avx2,fma,f16c"))) inline void to_float_avx2(const KvRows& r, const void* src,
                                                                  int64_t n, float scale, float* dst) {
  int64_t i = 0;
  const __m256 sc = _mm256_set1_ps(scale);
  switch (r.type) {
    case KvType::kBf16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (; i + 8 <= n; i += 8) {
        const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
      }
      break;
    }
    case KvType::kF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
      }
      break;
    }
    case KvType::kI8: {
      const int8_t* s = static_cast<const int8_t*>(src);
      for (; i + 8 <= n; i += 8) {
        const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + i)));
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(x), sc));
      }
      break;
    }
    default: break;  // float32 (a copy), float8 (a table): the scalar loop
  }
  to_float_scalar(r, static_cast<const char*>(src) + i * kv_bytes(r.type), n - i, scale, dst + i);
}

// Asks for every line of position `slot`'s row (and its scales) ahead of its conversion.
inline void prefetch_slot(const KvRows& r, int64_t slot) {
  const int64_t bytes = r.kv_heads * r.width * kv_bytes(r.type);
  const char* base = static_cast<const char*>(r.data) + slot * bytes;
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(base + o, _MM_HINT_T0);
  if (r.scale != nullptr) _mm_prefetch(reinterpret_cast<const char*>(r.scale + slot * r.kv_heads), _MM_HINT_T0);
}

// dst = position `slot`'s row of every kv head (kv_heads x width floats).
inline void row_to_float(const KvRows& r, int64_t slot, bool simd, float* dst) {
  const int64_t size = kv_bytes(r.type);
  const char* base = static_cast<const char*>(r.data) + slot * r.kv_heads * r.width * size;
  for (int64_t h = 0; h < r.kv_heads; ++h) {
    const float scale = r.scale != nullptr ? r.scale[slot * r.kv_heads + h] : 1.f;
    const void* src = base + h * r.width * size;
    if (simd) {
      to_float_avx2(r, src, r.width, scale, dst + h * r.width);
    } else {
      to_float_scalar(r, src, r.width, scale, dst + h * r.width);
    }
  }
}

}  // namespace pagoda_cpu
