// The row-wise ops of a decoder layer on CPU: RMSNorm (with the residual add before it),
// SiLU-and-mul and rotary, on float32 rows, and on bfloat16 or float16 rows (a half model's),
// which round where torch's eager ops on half tensors do (the half rows' section). Eager steps
// and compiled decode steps (-O1 and up, where inductor keeps them as calls) run these same
// functions, so a position's activations are the same bits whichever kind of step computes it;
// each row's arithmetic depends on that row alone, never on the rows beside it or the threads
// (docs/determinism.md).
//
//   rms_norm(x, weight, eps, isa_limit): x (T, n) -> weight * (x * r), r = 1 / sqrt(mean(x^2) +
//     eps), the sum of squares in a fixed order (16 or 8 lanes, then a fixed tree).
//   add_rms_norm(x, residual, weight, eps, isa_limit) -> (rms_norm(h), h), h = x + residual
//     (x itself where residual is None: a model's first layer).
//   silu_and_mul(x, isa_limit): x (T, 2d), gate | up -> (T, d), gate * sigmoid(gate) * up, with
//     sigmoid from exp(-|gate|) (common.h's polynomial on the SIMD paths).
//   gelu_tanh_and_mul(x, isa_limit): the same with gelu(gate), torch's approximate="tanh" (Gemma's
//     GeGLU), as gate * sigmoid(2z) (the SIMD paths' exp as silu's).
//   rotary(x, cos, sin, head_dim, isa_limit): x (T, heads * head_dim) -> the same, each head's
//     halves (x1, x2) -> (x1 * cos - x2 * sin, x2 * cos + x1 * sin), cos and sin (T, head_dim / 2).
//
// residual, weight, cos and sin have x's dtype. Rows of x may be a view with a row stride (the
// q|k columns of a packed qkv); the outputs are contiguous, of x's dtype. AVX-512, AVX2 + FMA and
// scalar paths, chosen at run time. quant_gemm.cpp runs the float32 norm and activation as its
// matmuls' prologues (declared in common.h), so a compiled step calls one op where it would call
// two.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "common.h"

namespace pagoda_cpu {
namespace {

#define PAGODA_ROW_AVX512 __attribute__((target("avx2,fma,avx512f,avx512dq,avx512vl")))
#define PAGODA_ROW_AVX2 __attribute__((target("avx2,fma")))

constexpr int64_t GRAIN = 16;  // rows a thread takes at least

// ---- sum of squares -----------------------------------------------------------------------------

PAGODA_ROW_AVX512 float sum_squares_avx512(const float* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  float r = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) r += x[i] * x[i];
  return r;
}

PAGODA_ROW_AVX2 float sum_squares_avx2(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  float r = _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
  for (; i < n; ++i) r += x[i] * x[i];
  return r;
}

float sum_squares_scalar(const float* x, int64_t n) {
  float r = 0.f;
  for (int64_t i = 0; i < n; ++i) r += x[i] * x[i];
  return r;
}

float sum_squares(const float* x, int64_t n, Isa isa) {
  if (isa == Isa::kVnni) return sum_squares_avx512(x, n);
  if (isa == Isa::kAvx2) return sum_squares_avx2(x, n);
  return sum_squares_scalar(x, n);
}

// out = w * (x * r)
void scale_row(const float* x, const float* w, float r, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

float inverse_rms(const float* x, int64_t n, float eps, Isa isa) {
  return 1.f / std::sqrt(sum_squares(x, n, isa) / static_cast<float>(n) + eps);
}

// ---- the gated activations: SiLU-and-mul, GELU(tanh)-and-mul ------------------------------------

// act(gate) * up with act(g) = g * sigmoid(a), a = g (SiLU) or 2z (GELU, torch's
// approximate="tanh": g / 2 * (1 + tanh(z)) = g * sigmoid(2z), z = sqrt(2 / pi) * (g + 0.044715
// g^3), without the cancellation of 1 + tanh(z) for negative z); sigmoid(a) = 1 / (1 + e) for
// a >= 0, e / (1 + e) below, e = exp(-|a|)
enum class Gate { kSilu, kGelu };

constexpr float GELU_2C = 2.f * 0.7978845608028654f, GELU_A = 0.044715f;

template <Gate A>
inline float sigmoid_arg(float g) {
  if constexpr (A == Gate::kSilu) return g;
  return GELU_2C * (g + GELU_A * g * g * g);
}

template <Gate A>
PAGODA_ROW_AVX512 inline __m512 sigmoid_arg_avx512(__m512 g) {
  if constexpr (A == Gate::kSilu) return g;
  const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), _mm512_mul_ps(g, _mm512_set1_ps(GELU_A)));
  return _mm512_mul_ps(_mm512_set1_ps(GELU_2C), _mm512_add_ps(g, cube));
}

template <Gate A>
PAGODA_ROW_AVX2 inline __m256 sigmoid_arg_avx2(__m256 g) {
  if constexpr (A == Gate::kSilu) return g;
  const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), _mm256_mul_ps(g, _mm256_set1_ps(GELU_A)));
  return _mm256_mul_ps(_mm256_set1_ps(GELU_2C), _mm256_add_ps(g, cube));
}

template <Gate A>
inline float gated(float g) {
  const float a = sigmoid_arg<A>(g);
  const float e = exp_nonpositive(-std::fabs(a));
  return g * ((a < 0.f ? e : 1.f) / (1.f + e));
}

template <Gate A>
PAGODA_ROW_AVX512 void gate_mul_avx512(const float* g, const float* u, int64_t d, float* out) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 sign = _mm512_set1_ps(-0.f);
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    const __m512 a = sigmoid_arg_avx512<A>(gv);
    const __m512 e = exp_nonpositive_avx512(_mm512_or_ps(a, sign));  // exp(-|a|)
    const __mmask16 neg = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 num = _mm512_mask_blend_ps(neg, one, e);
    const __m512 sig = _mm512_div_ps(num, _mm512_add_ps(one, e));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_loadu_ps(u + i)));
  }
  for (; i < d; ++i) out[i] = gated<A>(g[i]) * u[i];
}

template <Gate A>
PAGODA_ROW_AVX2 void gate_mul_avx2(const float* g, const float* u, int64_t d, float* out) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 sign = _mm256_set1_ps(-0.f);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 a = sigmoid_arg_avx2<A>(gv);
    const __m256 e = exp_nonpositive_avx2(_mm256_or_ps(a, sign));
    const __m256 neg = _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 num = _mm256_blendv_ps(one, e, neg);
    const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
  }
  for (; i < d; ++i) out[i] = gated<A>(g[i]) * u[i];
}

template <Gate A>
void gate_mul(const float* g, const float* u, int64_t d, float* out, Isa isa) {
  if (isa == Isa::kVnni) {
    gate_mul_avx512<A>(g, u, d, out);
  } else if (isa == Isa::kAvx2) {
    gate_mul_avx2<A>(g, u, d, out);
  } else {
    for (int64_t i = 0; i < d; ++i) out[i] = gated<A>(g[i]) * u[i];
  }
}

// ---- rotary -------------------------------------------------------------------------------------

// One head: (x1, x2) -> (x1 * c - x2 * s, x2 * c + x1 * s), each product rounded, then the sum.
void rotate_head(const float* x, const float* c, const float* s, int64_t half, float* out) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    const float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];
    out[i] = a - b;
    out[half + i] = e + f;
  }
}

// ---- half rows (bfloat16, float16) --------------------------------------------------------------
//
// A half model's rows round where torch's eager ops on half tensors round (each op's result to
// the tensor's dtype), in float32 between: add_rms_norm's h = H(x + residual), then H(h * r),
// then H(w * that); the gated activations' H(act(g)), then H(that * up); rotary's four products
// each rounded, then their difference and sum. A compiled step calls these same functions, where
// inductor would fuse the ops its own way in each graph (and so differently for a row decoded
// alone, in a batch, or verified among drafts).

// v rounded to bfloat16 (to nearest, ties to even; NaN to bfloat16's quiet NaN), as c10's
// conversion rounds, in integer steps without a branch, so that loops of it vectorize
inline uint32_t bfloat16_bits_high(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint32_t nearest = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : nearest;
}

template <typename H>
inline float rounded(float v) {
  if constexpr (std::is_same_v<H, c10::BFloat16>) {
    const uint32_t bits = bfloat16_bits_high(v);
    float r;
    std::memcpy(&r, &bits, 4);
    return r;
  } else {
    return static_cast<float>(H(v));
  }
}

// v rounded to H (rounded's value, as stored)
template <typename H>
inline H to_half(float v) {
  if constexpr (std::is_same_v<H, c10::BFloat16>) {
    const auto bits = static_cast<uint16_t>(bfloat16_bits_high(v) >> 16);
    return c10::BFloat16(bits, c10::BFloat16::from_bits());
  } else {
    return H(v);
  }
}

template <typename H>
void load_row(const H* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(x[i]);
}

// h = H(x + residual) (x where residual is null) into h (floats) and hidden; out = H(w * H(h * r))
template <typename H>
void norm_half_row(const H* x, const H* residual, const H* w, float eps, int64_t n, Isa isa,
                   float* h, H* hidden, H* out) {
  if (residual != nullptr) {
    for (int64_t i = 0; i < n; ++i) {
      h[i] = rounded<H>(static_cast<float>(x[i]) + static_cast<float>(residual[i]));
    }
  } else {
    load_row(x, n, h);
  }
  if (hidden != nullptr) {
    for (int64_t i = 0; i < n; ++i) hidden[i] = to_half<H>(h[i]);
  }
  const float r = inverse_rms(h, n, eps, isa);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = to_half<H>(static_cast<float>(w[i]) * rounded<H>(h[i] * r));
  }
}

// A gated activation's row: out = act(g) * u (gate_mul)
using GatedRow = void (*)(const float* g, const float* u, int64_t d, float* out, Isa isa);

// out = H(H(act(g)) * u); ones: d floats of 1 (act's product with them is exact)
template <typename H>
void gated_half_row(GatedRow act, const H* g, const H* u, int64_t d, Isa isa, const float* ones,
                    float* gf, float* sf, H* out) {
  load_row(g, d, gf);
  act(gf, ones, d, sf, isa);
  for (int64_t i = 0; i < d; ++i) {
    out[i] = to_half<H>(rounded<H>(sf[i]) * static_cast<float>(u[i]));
  }
}

template <typename H>
void rotate_head_half(const H* x, const H* c, const H* s, int64_t half, H* out) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[half + i]);
    const float ci = static_cast<float>(c[i]), si = static_cast<float>(s[i]);
    out[i] = to_half<H>(rounded<H>(x1 * ci) - rounded<H>(x2 * si));
    out[half + i] = to_half<H>(rounded<H>(x2 * ci) + rounded<H>(x1 * si));
  }
}

// Calls fn(H{}) for the half type of dtype (bfloat16 or float16).
template <typename Fn>
void with_half(at::ScalarType dtype, Fn&& fn) {
  if (dtype == at::kBFloat16) {
    fn(c10::BFloat16{});
  } else {
    fn(c10::Half{});
  }
}

bool is_half(const at::Tensor& x) {
  return x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
}

// ---- checks -------------------------------------------------------------------------------------

// x: float32, bfloat16 or float16 (T, n) whose rows are contiguous (any row stride)
void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2, name, " must be (rows, width)");
  TORCH_CHECK(x.scalar_type() == at::kFloat || is_half(x), name,
              " must be float32, bfloat16 or float16");
  TORCH_CHECK(x.size(1) <= 1 || x.stride(1) == 1, name, ": each row must be contiguous");
}

// weight: contiguous (n,), float32 for float32 rows, the rows' dtype for half ones
void check_weight(const at::Tensor& weight, int64_t n, at::ScalarType dtype) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == dtype &&
                  weight.is_contiguous(),
              "weight: contiguous (", n, ",) of the rows' dtype");
}

// The norm of half rows: out = norm(h), hidden = h (when given), h = x + residual.
void norm_half(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
               const at::Tensor& weight, float eps, Isa isa, at::Tensor& out,
               at::Tensor* hidden) {
  const int64_t rows = x.size(0), n = x.size(1), ldx = x.stride(0);
  const int64_t ldr = residual.has_value() ? residual->stride(0) : 0;
  with_half(x.scalar_type(), [&](auto tag) {
    using H = decltype(tag);
    const H* wp = static_cast<const H*>(weight.data_ptr());
    const H* xp = static_cast<const H*>(x.data_ptr());
    const H* rp = residual.has_value() ? static_cast<const H*>(residual->data_ptr()) : nullptr;
    H* op = static_cast<H*>(out.data_ptr());
    H* hp = hidden != nullptr ? static_cast<H*>(hidden->data_ptr()) : nullptr;
    at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
      std::vector<float> h(n);
      for (int64_t t = begin; t < end; ++t) {
        norm_half_row<H>(xp + t * ldx, rp != nullptr ? rp + t * ldr : nullptr, wp, eps, n, isa,
                         h.data(), hp != nullptr ? hp + t * n : nullptr, op + t * n);
      }
    });
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t isa_limit) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  check_weight(weight, n, x.scalar_type());
  const Isa isa = pick_isa(isa_limit);
  auto out = at::empty({rows, n}, x.options());
  if (is_half(x)) {
    norm_half(x, c10::nullopt, weight, static_cast<float>(eps), isa, out, nullptr);
    return out;
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * ld;
      scale_row(row, wp, inverse_rms(row, n, static_cast<float>(eps), isa), n, op + t * n);
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x,
                                                const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps,
                                                int64_t isa_limit) {
  check_rows(x, "x");
  const bool add = residual.has_value();  // none (a model's first layer): h = x
  if (add) {
    check_rows(*residual, "residual");
    TORCH_CHECK(x.sizes() == residual->sizes() && x.scalar_type() == residual->scalar_type(),
                "x and residual: the same shape and dtype");
  }
  const int64_t rows = x.size(0), n = x.size(1), ldx = x.stride(0);
  const int64_t ldr = add ? residual->stride(0) : 0;
  check_weight(weight, n, x.scalar_type());
  const Isa isa = pick_isa(isa_limit);
  auto out = at::empty({rows, n}, x.options());
  auto hidden = at::empty({rows, n}, x.options());
  if (is_half(x)) {
    norm_half(x, residual, weight, static_cast<float>(eps), isa, out, &hidden);
    return {out, hidden};
  }
  const float* xp = x.data_ptr<float>();
  const float* rp = add ? residual->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* hp = hidden.data_ptr<float>();
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* h = hp + t * n;
      if (add) {
        for (int64_t i = 0; i < n; ++i) h[i] = xp[t * ldx + i] + rp[t * ldr + i];
      } else {
        std::copy(xp + t * ldx, xp + t * ldx + n, h);
      }
      scale_row(h, wp, inverse_rms(h, n, static_cast<float>(eps), isa), n, op + t * n);
    }
  });
  return {out, hidden};
}

namespace {

// x (T, 2d), gate | up -> (T, d), act(gate) * up
at::Tensor gated_rows(const at::Tensor& x, int64_t isa_limit, GatedRow act) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x: (rows, 2 * d), gate then up");
  const int64_t rows = x.size(0), d = x.size(1) / 2, ld = x.stride(0);
  const Isa isa = pick_isa(isa_limit);
  auto out = at::empty({rows, d}, x.options());
  if (is_half(x)) {
    const std::vector<float> ones(d, 1.f);
    with_half(x.scalar_type(), [&](auto tag) {
      using H = decltype(tag);
      const H* xp = static_cast<const H*>(x.data_ptr());
      H* op = static_cast<H*>(out.data_ptr());
      at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
        std::vector<float> gf(d), sf(d);
        for (int64_t t = begin; t < end; ++t) {
          const H* g = xp + t * ld;
          gated_half_row<H>(act, g, g + d, d, isa, ones.data(), gf.data(), sf.data(), op + t * d);
        }
      });
    });
    return out;
  }
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = xp + t * ld;
      act(g, g + d, d, op + t * d, isa);
    }
  });
  return out;
}

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& x, int64_t isa_limit) {
  return gated_rows(x, isa_limit, gate_mul<Gate::kSilu>);
}

void silu_mul(const float* g, const float* u, int64_t d, float* out, Isa isa) {
  gate_mul<Gate::kSilu>(g, u, d, out, isa);
}

at::Tensor gelu_tanh_and_mul(const at::Tensor& x, int64_t isa_limit) {
  return gated_rows(x, isa_limit, gate_mul<Gate::kGelu>);
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t head_dim, int64_t isa_limit) {
  check_rows(x, "x");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && x.size(1) % head_dim == 0,
              "x: (rows, heads * head_dim), head_dim even");
  const int64_t rows = x.size(0), width = x.size(1), half = head_dim / 2, ld = x.stride(0);
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == rows && t->size(1) == half &&
                    t->scalar_type() == x.scalar_type() && t->stride(1) == 1,
                "cos, sin: (rows, head_dim / 2) of x's dtype, rows contiguous");
  }
  (void)isa_limit;  // one path: products and sums of single elements vectorize as they are
  auto out = at::empty({rows, width}, x.options());
  const int64_t ldc = cos.stride(0), lds = sin.stride(0);
  if (is_half(x)) {
    with_half(x.scalar_type(), [&](auto tag) {
      using H = decltype(tag);
      const H* xp = static_cast<const H*>(x.data_ptr());
      const H* cp = static_cast<const H*>(cos.data_ptr());
      const H* sp = static_cast<const H*>(sin.data_ptr());
      H* op = static_cast<H*>(out.data_ptr());
      at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          for (int64_t h = 0; h < width; h += head_dim) {
            rotate_head_half<H>(xp + t * ld + h, cp + t * ldc, sp + t * lds, half,
                                op + t * width + h);
          }
        }
      });
    });
    return out;
  }
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < width; h += head_dim) {
        rotate_head(xp + t * ld + h, cp + t * ldc, sp + t * lds, half, op + t * width + h);
      }
    }
  });
  return out;
}

}  // namespace pagoda_cpu

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, int isa_limit) -> Tensor");
  m.def(
      "add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps, int isa_limit) -> "
      "(Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x, int isa_limit) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor x, int isa_limit) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, int head_dim, int isa_limit) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("rms_norm", &pagoda_cpu::rms_norm);
  m.impl("add_rms_norm", &pagoda_cpu::add_rms_norm);
  m.impl("silu_and_mul", &pagoda_cpu::silu_and_mul);
  m.impl("gelu_tanh_and_mul", &pagoda_cpu::gelu_tanh_and_mul);
  m.impl("rotary", &pagoda_cpu::rotary);
}
