// Batched LoRA on CPU, float32 (layers/lora.py's lora_reference is the contract):
//
//   lora_apply(y, x, a, b, slots, offsets, isa_limit), in place on y:
//     y[t, o] += sum_r b[s, o, r] * h[t, l, r],   h[t, l, r] = sum_k a[s, l, r, k] * x[t, k]
//   for each token t whose slot s = slots[t] is in [0, S) (others, -1 among them, are left as
//   they are), l the slice whose columns [offsets[l], offsets[l + 1]) hold o.
//   y (T, N) contiguous; x (T, K), rows contiguous; a (S, L, R, K) contiguous; b (S, N, R)
//   contiguous, or stored by rank (the transpose of a contiguous (S, R, N), as LoRAWeights
//   keeps it for this kernel); slots (T,) int64; offsets L + 1 ascending ints within [0, N].
//   x and y float32; a and b float32, bfloat16 or float16 (the same), widened to float32
//   exactly as they are loaded, so a bfloat16 / float16 A and B give the bits their float32
//   copies give.
//
// Tokens are grouped by slot (a stable counting sort), so each slot's A and B are read once a
// step wherever its tokens sit in the batch. Shrink: h (T, L * R), split over (slot, block of 4
// rows of A); each block's rows are dotted with the slot's tokens a few at a time, k in order.
// Expand: split over blocks of 16 (8 on AVX2) output columns; a thread takes its columns 256 at
// a time and sweeps each slot's tokens over them, up to 8 at a time, r in order: B stored by
// rank is read in place (each rank's columns adjacent), an (S, N, R) B is first transposed
// there into blocks of (R, 16), once for all the slot's tokens. Each output's arithmetic depends
// on its token alone, not on the batch, the threads or B's layout. AVX-512 F, AVX2 + FMA and
// scalar paths, chosen at run time (isa_limit caps it, as the other kernels').
//
// lora_stage (lora.h) computes the same products inside a quantized matmul's call: the shrink's
// items between the matmul's tiles, the expand after them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"
#include "lora.h"

namespace pagoda_cpu {
namespace {

#define PAGODA_LORA_AVX512 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512dq,avx512vl,avx512bw")))
#define PAGODA_LORA_AVX2 __attribute__((target("avx2,fma,f16c")))
#define PAGODA_LORA_INLINE inline __attribute__((always_inline))

constexpr int64_t ROW_BLOCK = 4;      // rows of A a shrink pass holds
constexpr int64_t EXPAND_GRAIN = 16;  // column blocks a thread takes at least
// Multiply-adds below which a share of work is not worth a thread: a decode step's products
// are a few microseconds, the cost of waking the other threads (and far more on a busy machine).
constexpr int64_t MIN_THREAD_WORK = int64_t{1} << 17;
constexpr int64_t CHUNK = 256;        // columns transposed at once (a multiple of 16)

// Calls fn(std::integral_constant<int, n>) for n in [1, Max] (n above Max: Max).
template <int Max, typename Fn>
void with_count(int64_t n, Fn&& fn) {
  if constexpr (Max > 1) {
    if (n < Max) return with_count<Max - 1>(n, fn);
  }
  fn(std::integral_constant<int, Max>{});
}

// ---- loads: A's and B's elements (W: float, c10::BFloat16 or c10::Half) as float32 -------------

template <typename W>
constexpr bool kIsFloat = std::is_same_v<W, float>;

// 16 values, those outside m zero.
template <typename W>
PAGODA_LORA_AVX512 PAGODA_LORA_INLINE __m512 load16(const W* p, __mmask16 m) {
  if constexpr (kIsFloat<W>) {
    return _mm512_maskz_loadu_ps(m, p);
  } else {
    const __m256i v = _mm256_maskz_loadu_epi16(m, p);
    if constexpr (std::is_same_v<W, c10::BFloat16>) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
    } else {
      return _mm512_cvtph_ps(v);
    }
  }
}

template <typename W>
PAGODA_LORA_AVX2 PAGODA_LORA_INLINE __m256 load8(const W* p) {
  if constexpr (kIsFloat<W>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<W, c10::BFloat16>) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
    } else {
      return _mm256_cvtph_ps(v);
    }
  }
}

template <typename W>
inline float widen(W v) {
  return static_cast<float>(v);
}

template <typename W>
struct Lora {
  const float* x;
  int64_t ldx;
  const W* a;  // (S, L * R, K)
  const W* b;  // (S, N, R), or (S, R, N) in memory when b_by_rank
  float* y;        // (T, N)
  int64_t k, n, rank, rows;  // rows = L * R
  std::vector<int64_t> offsets;
  bool b_by_rank;
};

// The tokens of each slot in batch order: order[start[s], start[s + 1]); `used` the slots that
// have any.
struct Groups {
  std::vector<int64_t> order, start, used;
};

Groups group_by_slot(const int64_t* slots, int64_t tokens, int64_t num_slots) {
  Groups g{{}, std::vector<int64_t>(num_slots + 1, 0), {}};
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] >= 0 && slots[t] < num_slots) ++g.start[slots[t] + 1];
  }
  for (int64_t s = 0; s < num_slots; ++s) {
    if (g.start[s + 1] > 0) g.used.push_back(s);
    g.start[s + 1] += g.start[s];
  }
  g.order.resize(g.start[num_slots]);
  std::vector<int64_t> next(g.start.begin(), g.start.end() - 1);
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] >= 0 && slots[t] < num_slots) g.order[next[slots[t]]++] = t;
  }
  return g;
}

// ---- shrink: h[t][r] = a[r * k, ...] . x[t] for NR rows of A and NT tokens ------------------

PAGODA_LORA_AVX2 inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

template <typename W, int NR, int NT>
PAGODA_LORA_AVX512 void dots_avx512(const W* a, int64_t k, const float* const* x,
                                    float* const* h) {
  __m512 acc[NR][NT];
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 m = k - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (k - i)) - 1u);
    __m512 xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = _mm512_maskz_loadu_ps(m, x[t] + i);
    for (int r = 0; r < NR; ++r) {
      const __m512 av = load16(a + r * k + i, m);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_fmadd_ps(av, xv[t], acc[r][t]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) h[t][r] = _mm512_reduce_add_ps(acc[r][t]);
  }
}

template <typename W, int NR, int NT>
PAGODA_LORA_AVX2 void dots_avx2(const W* a, int64_t k, const float* const* x,
                                float* const* h) {
  __m256 acc[NR][NT];
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  }
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    __m256 xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = _mm256_loadu_ps(x[t] + i);
    for (int r = 0; r < NR; ++r) {
      const __m256 av = load8(a + r * k + i);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_fmadd_ps(av, xv[t], acc[r][t]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) {
      float tail = 0.f;
      for (int64_t j = i; j < k; ++j) tail += widen(a[r * k + j]) * x[t][j];
      h[t][r] = sum8(acc[r][t]) + tail;
    }
  }
}

template <typename W>
void dots_scalar(const W* a, int64_t k, const float* const* x, float* const* h, int64_t nr,
                 int64_t nt) {
  for (int64_t r = 0; r < nr; ++r) {
    for (int64_t t = 0; t < nt; ++t) {
      float sum = 0.f;
      for (int64_t j = 0; j < k; ++j) sum += widen(a[r * k + j]) * x[t][j];
      h[t][r] = sum;
    }
  }
}

// Tokens a shrink pass dots with one block of rows: NR x NT accumulators stay in registers.
int64_t shrink_tokens(Isa isa) { return isa == Isa::kVnni ? 4 : isa == Isa::kAvx2 ? 2 : 1; }

template <typename W>
void dots(const W* a, int64_t k, const float* const* x, float* const* h, int64_t nr,
          int64_t nt, Isa isa) {
  if (isa == Isa::kVnni) {
    with_count<4>(nr, [&](auto r) {
      with_count<4>(nt, [&](auto t) { dots_avx512<W, decltype(r)::value, decltype(t)::value>(a, k, x, h); });
    });
  } else if (isa == Isa::kAvx2) {
    with_count<4>(nr, [&](auto r) {
      with_count<2>(nt, [&](auto t) { dots_avx2<W, decltype(r)::value, decltype(t)::value>(a, k, x, h); });
    });
  } else {
    dots_scalar(a, k, x, h, nr, nt);
  }
}

// Asks for [p, p + bytes) in this core's L2 ahead of its reads (lora.h says why).
inline void prefetch_l2(const void* p, int64_t bytes) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(p), end = start + std::max<int64_t>(0, bytes);
  for (uintptr_t line = start & ~uintptr_t{63}; line < end; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
  }
}

// The shrink's work items: (used slot, block of ROW_BLOCK rows of A), in A's memory order.
template <typename W>
int64_t row_blocks(const Lora<W>& p) {
  return (p.rows + ROW_BLOCK - 1) / ROW_BLOCK;
}

// Item `item`'s slot s, first row j0 of the slot's rows of A, and its nr rows there.
template <typename W>
struct Item {
  int64_t s, j0, nr;
  const W* a;
};

template <typename W>
Item<W> item_at(const Lora<W>& p, const Groups& g, int64_t item) {
  const int64_t blocks = row_blocks(p);
  const int64_t s = g.used[item / blocks], j0 = (item % blocks) * ROW_BLOCK;
  return {s, j0, std::min(ROW_BLOCK, p.rows - j0), p.a + (s * p.rows + j0) * p.k};
}

// h's rows of items [begin, end) for every token of their slots.
template <typename W>
void shrink_items(const Lora<W>& p, const Groups& g, Isa isa, float* h, int64_t begin,
                  int64_t end) {
  const int64_t per_pass = shrink_tokens(isa);
  const float* xs[4];
  float* hs[4];
  for (int64_t item = begin; item < end; ++item) {
    const Item<W> it = item_at(p, g, item);
    for (int64_t i = g.start[it.s]; i < g.start[it.s + 1]; i += per_pass) {
      const int64_t nt = std::min(per_pass, g.start[it.s + 1] - i);
      for (int64_t t = 0; t < nt; ++t) {
        xs[t] = p.x + g.order[i + t] * p.ldx;
        hs[t] = h + g.order[i + t] * p.rows + it.j0;
      }
      dots(it.a, p.k, xs, hs, it.nr, nt, isa);
    }
  }
}

// h (T, rows): the rows of tokens with a slot.
template <typename W>
void shrink(const Lora<W>& p, const Groups& g, Isa isa, float* h) {
  const int64_t items = static_cast<int64_t>(g.used.size()) * row_blocks(p);
  const int64_t tokens = static_cast<int64_t>(g.order.size());
  const int64_t item_work = ROW_BLOCK * p.k * tokens / std::max<int64_t>(1, g.used.size());
  const int64_t grain = std::max<int64_t>(1, MIN_THREAD_WORK / std::max<int64_t>(1, item_work));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    shrink_items(p, g, isa, h, begin, end);
  });
}

// ---- expand: y[t, o] += sum_r col[r][o] * h[t][r] over a block of columns -------------------

// A block of B's rows (one per output column; rows past the block's end repeat its last row)
// as columns: buf[r * W + j] = rows[j][r].
template <typename W>
void transpose_tail(const W* const* rows, int64_t from, int64_t rank, int64_t w, float* buf) {
  for (int64_t r = from; r < rank; ++r) {
    for (int64_t j = 0; j < w; ++j) buf[r * w + j] = widen(rows[j][r]);
  }
}

// 16 rows' values [r0, r0 + 8) into buf[(r0 + c) * 16 + j]; register j of v holds row j's in its
// low half, row j + 8's in its high half: the AVX2 8 x 8 transpose on both halves at once.
template <typename W>
PAGODA_LORA_AVX512 void transpose16(const W* const* rows, int64_t rank, float* buf) {
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
  const __m512i hi = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  int64_t r0 = 0;
  for (; r0 + 8 <= rank; r0 += 8) {
    __m512 v[8], t[8];
    for (int j = 0; j < 8; ++j) {
      const __m256 top = load8(rows[j] + r0);
      v[j] = _mm512_insertf32x8(_mm512_castps256_ps512(top), load8(rows[j + 8] + r0), 1);
    }
    for (int j = 0; j < 8; j += 2) {
      t[j] = _mm512_unpacklo_ps(v[j], v[j + 1]);
      t[j + 1] = _mm512_unpackhi_ps(v[j], v[j + 1]);
    }
    for (int q = 0; q < 8; q += 4) {
      v[q] = _mm512_shuffle_ps(t[q], t[q + 2], 0x44);
      v[q + 1] = _mm512_shuffle_ps(t[q], t[q + 2], 0xEE);
      v[q + 2] = _mm512_shuffle_ps(t[q + 1], t[q + 3], 0x44);
      v[q + 3] = _mm512_shuffle_ps(t[q + 1], t[q + 3], 0xEE);
    }
    for (int c = 0; c < 4; ++c) {
      _mm512_storeu_ps(buf + (r0 + c) * 16, _mm512_permutex2var_ps(v[c], lo, v[c + 4]));
      _mm512_storeu_ps(buf + (r0 + c + 4) * 16, _mm512_permutex2var_ps(v[c], hi, v[c + 4]));
    }
  }
  transpose_tail(rows, r0, rank, 16, buf);
}

template <typename W>
PAGODA_LORA_AVX2 void transpose8(const W* const* rows, int64_t rank, float* buf) {
  int64_t r0 = 0;
  for (; r0 + 8 <= rank; r0 += 8) {
    __m256 v[8], t[8];
    for (int j = 0; j < 8; ++j) v[j] = load8(rows[j] + r0);
    for (int j = 0; j < 8; j += 2) {
      t[j] = _mm256_unpacklo_ps(v[j], v[j + 1]);
      t[j + 1] = _mm256_unpackhi_ps(v[j], v[j + 1]);
    }
    for (int q = 0; q < 8; q += 4) {
      v[q] = _mm256_shuffle_ps(t[q], t[q + 2], 0x44);
      v[q + 1] = _mm256_shuffle_ps(t[q], t[q + 2], 0xEE);
      v[q + 2] = _mm256_shuffle_ps(t[q + 1], t[q + 3], 0x44);
      v[q + 3] = _mm256_shuffle_ps(t[q + 1], t[q + 3], 0xEE);
    }
    for (int c = 0; c < 4; ++c) {
      _mm256_storeu_ps(buf + (r0 + c) * 8, _mm256_permute2f128_ps(v[c], v[c + 4], 0x20));
      _mm256_storeu_ps(buf + (r0 + c + 4) * 8, _mm256_permute2f128_ps(v[c], v[c + 4], 0x31));
    }
  }
  transpose_tail(rows, r0, rank, 8, buf);
}

// B's values for a run of columns, as float32 (S = float) or as stored (S = W): column c's value
// at rank r is at p[(c - c % w) * cmul + c % w + r * rs], w the ISA's block width. Transposed
// blocks in a buffer: cmul = rank, rs = w; B stored by rank, read in place: cmul = 1, rs = N.
template <typename S>
struct Cols {
  const S* p;
  int64_t cmul, rs;
};

// A run of `cols` output columns for up to 8 tokens: b its B columns, h[t] the token's slice of
// h, y[t] its row at the run's first column.
template <typename S>
struct ExpandRun {
  Cols<S> b;
  int64_t rank, cols;
  const float* const* h;
  float* const* y;
};

// NB adjacent blocks for NT tokens, r in order; of the last block only the first `last` columns
// are read and written.
template <typename S, int NT, int NB>
PAGODA_LORA_AVX512 void blocks_avx512(const ExpandRun<S>& e, int64_t c, int64_t last) {
  const __mmask16 tail = static_cast<__mmask16>((1u << last) - 1u);
  __m512 acc[NB][NT];
  for (int i = 0; i < NB; ++i) {
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
  }
  for (int64_t r = 0; r < e.rank; ++r) {
    __m512 col[NB];
    for (int i = 0; i < NB; ++i) {
      const S* p = e.b.p + (c + 16 * i) * e.b.cmul + r * e.b.rs;
      col[i] = load16(p, i == NB - 1 ? tail : static_cast<__mmask16>(0xFFFF));
    }
    for (int t = 0; t < NT; ++t) {
      const __m512 ht = _mm512_set1_ps(e.h[t][r]);
      for (int i = 0; i < NB; ++i) acc[i][t] = _mm512_fmadd_ps(col[i], ht, acc[i][t]);
    }
  }
  for (int i = 0; i < NB; ++i) {
    const __mmask16 m = i == NB - 1 ? tail : static_cast<__mmask16>(0xFFFF);
    for (int t = 0; t < NT; ++t) {
      float* y = e.y[t] + c + 16 * i;
      _mm512_mask_storeu_ps(y, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, y), acc[i][t]));
    }
  }
}

template <typename S, int NT>
PAGODA_LORA_AVX512 void expand_avx512(const ExpandRun<S>& e) {
  int64_t c = 0;
  for (; e.cols - c > 16; c += 32) {
    blocks_avx512<S, NT, 2>(e, c, std::min<int64_t>(16, e.cols - c - 16));
  }
  if (c < e.cols) blocks_avx512<S, NT, 1>(e, c, e.cols - c);
}

// As blocks_avx512, 8 columns a block; every block's 8 columns are read (the caller's Cols hold
// them: a buffer's last block repeats its last column).
template <typename S, int NT, int NB>
PAGODA_LORA_AVX2 void blocks_avx2(const ExpandRun<S>& e, int64_t c, int64_t last) {
  __m256 acc[NB][NT];
  for (int i = 0; i < NB; ++i) {
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm256_setzero_ps();
  }
  for (int64_t r = 0; r < e.rank; ++r) {
    __m256 col[NB];
    for (int i = 0; i < NB; ++i) col[i] = load8(e.b.p + (c + 8 * i) * e.b.cmul + r * e.b.rs);
    for (int t = 0; t < NT; ++t) {
      const __m256 ht = _mm256_set1_ps(e.h[t][r]);
      for (int i = 0; i < NB; ++i) acc[i][t] = _mm256_fmadd_ps(col[i], ht, acc[i][t]);
    }
  }
  for (int i = 0; i < NB; ++i) {
    const int64_t cols = i == NB - 1 ? last : 8;
    for (int t = 0; t < NT; ++t) {
      float* y = e.y[t] + c + 8 * i;
      if (cols == 8) {
        _mm256_storeu_ps(y, _mm256_add_ps(_mm256_loadu_ps(y), acc[i][t]));
      } else {
        float sum[8];
        _mm256_storeu_ps(sum, acc[i][t]);
        for (int64_t j = 0; j < cols; ++j) y[j] += sum[j];
      }
    }
  }
}

template <typename S, int NT>
PAGODA_LORA_AVX2 void expand_avx2(const ExpandRun<S>& e) {
  int64_t c = 0;
  for (; e.cols - c > 8; c += 16) {
    blocks_avx2<S, NT, 2>(e, c, std::min<int64_t>(8, e.cols - c - 8));
  }
  if (c < e.cols) blocks_avx2<S, NT, 1>(e, c, e.cols - c);
}

template <typename S>
void expand_scalar(const ExpandRun<S>& e, int64_t w, int64_t nt) {
  for (int64_t t = 0; t < nt; ++t) {
    for (int64_t j = 0; j < e.cols; ++j) {
      const S* col = e.b.p + (j - j % w) * e.b.cmul + j % w;
      float sum = 0.f;
      for (int64_t r = 0; r < e.rank; ++r) sum += widen(col[r * e.b.rs]) * e.h[t][r];
      e.y[t][j] += sum;
    }
  }
}

int64_t expand_width(Isa isa) { return isa == Isa::kAvx2 ? 8 : 16; }

// Tokens an expand pass applies one block to (their accumulators stay in registers).
int64_t expand_tokens(Isa isa) { return isa == Isa::kVnni ? 8 : isa == Isa::kAvx2 ? 4 : 1; }

// Slot s's B at columns [o, o + cols) as blocks of W columns, each (rank, W) transposed
// (buf[(block * rank + r) * W + j]); a last, partial block repeats its last column. B (S, N, R).
template <typename W>
void transpose_columns(const Lora<W>& p, int64_t s, int64_t o, int64_t cols, Isa isa, float* buf) {
  const int64_t w = expand_width(isa);
  const W* rows[16];
  for (int64_t c = 0; c < cols; c += w) {
    for (int64_t j = 0; j < w; ++j) {
      rows[j] = p.b + (s * p.n + o + c + std::min(j, cols - c - 1)) * p.rank;
    }
    float* block = buf + c * p.rank;
    if (isa == Isa::kVnni) {
      transpose16(rows, p.rank, block);
    } else if (isa == Isa::kAvx2) {
      transpose8(rows, p.rank, block);
    } else {
      transpose_tail(rows, 0, p.rank, w, block);
    }
  }
}

// Columns [o, o + cols) of slice l for every token of slot s, B's columns in b; a pass of tokens
// sweeps the columns in order.
template <typename W, typename S>
void expand_columns(const Lora<W>& p, const Groups& g, Isa isa, const float* h, int64_t s,
                    int64_t l, int64_t o, int64_t cols, Cols<S> b) {
  const int64_t per_pass = expand_tokens(isa);
  const float* hs[8];
  float* ys[8];
  for (int64_t i = g.start[s]; i < g.start[s + 1]; i += per_pass) {
    const int64_t nt = std::min(per_pass, g.start[s + 1] - i);
    for (int64_t t = 0; t < nt; ++t) {
      hs[t] = h + g.order[i + t] * p.rows + l * p.rank;
      ys[t] = p.y + g.order[i + t] * p.n + o;
    }
    const ExpandRun<S> e{b, p.rank, cols, hs, ys};
    if (isa == Isa::kVnni) {
      with_count<8>(nt, [&](auto t) { expand_avx512<S, decltype(t)::value>(e); });
    } else if (isa == Isa::kAvx2) {
      with_count<4>(nt, [&](auto t) { expand_avx2<S, decltype(t)::value>(e); });
    } else {
      expand_scalar(e, expand_width(isa), nt);
    }
  }
}

// expand_columns for B stored by rank: its whole blocks read in place, a last partial block's
// columns copied into buf as transpose_columns lays them out (no load passes the run's end).
template <typename W>
void expand_by_rank(const Lora<W>& p, const Groups& g, Isa isa, const float* h, int64_t s,
                    int64_t l, int64_t o, int64_t cols, float* buf) {
  const int64_t w = expand_width(isa), whole = cols - cols % w, rest = cols - whole;
  const W* b = p.b + s * p.rank * p.n;
  if (whole > 0) expand_columns(p, g, isa, h, s, l, o, whole, Cols<W>{b + o, 1, p.n});
  if (rest == 0) return;
  for (int64_t r = 0; r < p.rank; ++r) {
    const W* row = b + r * p.n + o + whole;
    for (int64_t j = 0; j < w; ++j) buf[r * w + j] = widen(row[std::min(j, rest - 1)]);
  }
  expand_columns(p, g, isa, h, s, l, o + whole, rest, Cols<float>{buf, p.rank, w});
}

// Columns split over the threads in blocks of W; a thread's columns are cut at the slices'
// edges and taken CHUNK at a time, each slot's B there transposed once for all its tokens (or,
// stored by rank, read in place).
template <typename W>
void expand(const Lora<W>& p, const Groups& g, Isa isa, const float* h) {
  const int64_t w = expand_width(isa), blocks = (p.n + w - 1) / w;
  const int64_t slices = static_cast<int64_t>(p.offsets.size()) - 1;
  const int64_t block_work = w * p.rank * static_cast<int64_t>(g.order.size() + g.used.size());
  const int64_t grain =
      std::max(EXPAND_GRAIN, MIN_THREAD_WORK / std::max<int64_t>(1, block_work));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    // B by rank needs room for one partial block; an (S, N, R) B for a chunk's transposed blocks
    std::vector<float> buf(p.rank * ((p.b_by_rank ? 0 : CHUNK) + w));
    const int64_t lo = begin * w, hi = std::min(end * w, p.n);
    for (int64_t l = 0; l < slices; ++l) {
      const int64_t first = std::max(lo, p.offsets[l]), last = std::min(hi, p.offsets[l + 1]);
      for (int64_t o = first; o < last; o += CHUNK) {
        const int64_t cols = std::min(CHUNK, last - o);
        for (const int64_t s : g.used) {
          if (p.b_by_rank) {
            expand_by_rank(p, g, isa, h, s, l, o, cols, buf.data());
          } else {
            transpose_columns(p, s, o, cols, isa, buf.data());
            expand_columns(p, g, isa, h, s, l, o, cols, Cols<float>{buf.data(), p.rank, w});
          }
        }
      }
    }
  });
}

// ---- the op ---------------------------------------------------------------------------------

void check_float(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), name, " must be on CPU");
}

void check_weights(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.dim() == 4 && b.dim() == 3, "a must be (S, L, R, K) and b (S, N, R), got ",
              a.sizes(), " and ", b.sizes());
  const at::ScalarType t = a.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf,
              "a and b must be float32, bfloat16 or float16, got ", t);
  TORCH_CHECK(b.scalar_type() == t, "a and b must have one dtype, got ", t, " and ",
              b.scalar_type());
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu(), "a and b must be on CPU");
}

// Whether b (S, N, R) is the transpose of a contiguous (S, R, N) tensor: B stored by rank, so the
// expand reads each rank's columns in place (one row of N), with no transposes.
bool stored_by_rank(const at::Tensor& b) {
  const int64_t n = b.size(1), r = b.size(2);
  return !b.is_contiguous() && b.stride(0) == n * r && b.stride(1) == 1 && b.stride(2) == n;
}

void check_shapes(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
                  const at::Tensor& b, const at::Tensor& slots, at::IntArrayRef offsets) {
  check_float(y, "y", 2);
  check_float(x, "x", 2);
  check_weights(a, b);
  const int64_t t = x.size(0), n = y.size(1);
  TORCH_CHECK(y.size(0) == t && y.is_contiguous(), "y must be contiguous (T, N), T = x's rows");
  TORCH_CHECK(a.size(3) == x.size(1), "a (S, L, R, K): K = x's columns");
  TORCH_CHECK(b.size(0) == a.size(0) && b.size(1) == n && b.size(2) == a.size(2),
              "b must be (S, N, R) for a (S, L, R, K) and y (T, N), got ", b.sizes());
  TORCH_CHECK(a.is_contiguous() && (b.is_contiguous() || stored_by_rank(b)),
              "a must be contiguous, b (S, N, R) contiguous or the transpose of an (S, R, N) one");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == t && slots.scalar_type() == at::kLong &&
                  slots.device().is_cpu(),
              "slots must be int64 (T,) on CPU");
  TORCH_CHECK(static_cast<int64_t>(offsets.size()) == a.size(1) + 1,
              "offsets: L + 1 column edges for a's L slices");
  for (size_t l = 0; l < offsets.size(); ++l) {
    const bool ordered = l == 0 ? offsets[0] >= 0 : offsets[l] >= offsets[l - 1];
    TORCH_CHECK(ordered && offsets[l] <= n, "offsets must ascend within [0, N], got ", offsets);
  }
}

template <typename W>
Lora<W> lora_of(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
                const at::Tensor& b, at::IntArrayRef offsets) {
  return Lora<W>{x.data_ptr<float>(), x.stride(0), a.data_ptr<W>(), b.data_ptr<W>(),
                 y.data_ptr<float>(), x.size(1), y.size(1), a.size(2),
                 a.size(1) * a.size(2), offsets.vec(), stored_by_rank(b)};
}

// Calls fn(W{}) for a's element type W.
template <typename Fn>
void with_weight_type(const at::Tensor& a, Fn&& fn) {
  if (a.scalar_type() == at::kBFloat16) {
    fn(c10::BFloat16{});
  } else if (a.scalar_type() == at::kHalf) {
    fn(c10::Half{});
  } else {
    fn(float{});
  }
}

void lora_apply(const at::Tensor& y, const at::Tensor& x_in, const at::Tensor& a,
                const at::Tensor& b, const at::Tensor& slots_in, at::IntArrayRef offsets,
                int64_t isa_limit) {
  check_shapes(y, x_in, a, b, slots_in, offsets);
  const at::Tensor x = x_in.size(1) <= 1 || x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const at::Tensor slots = slots_in.contiguous();
  const Groups g = group_by_slot(slots.data_ptr<int64_t>(), x.size(0), a.size(0));
  if (g.used.empty() || a.size(1) * a.size(2) == 0) return;
  const Isa isa = pick_isa(isa_limit);
  with_weight_type(a, [&](auto w) {
    using W = decltype(w);
    const Lora<W> p = lora_of<W>(y, x, a, b, offsets);
    at::Tensor h = at::empty({x.size(0), p.rows}, at::kFloat);
    shrink(p, g, isa, h.data_ptr<float>());
    expand(p, g, isa, h.data_ptr<float>());
  });
}

// ---- inside a matmul (lora.h) -----------------------------------------------------------------

template <typename W>
class Stage final : public LoraStage {
  static constexpr int64_t kBytes = sizeof(W);

 public:
  Stage(Lora<W> p, Groups g, Isa isa, int64_t tokens)
      : p_(std::move(p)), g_(std::move(g)), isa_(isa),
        h_(at::empty({tokens, p_.rows}, at::kFloat)),
        items_(static_cast<int64_t>(g_.used.size()) * row_blocks(p_)) {}

  void after_tile(int64_t t, int64_t begin, int64_t end, int64_t tiles) override {
    // This thread's items [i0, i1) and B's columns [c0, c1), in proportion to its tiles: after
    // each tile, its share of the items (whose rows of A the tile before prefetched), the next
    // share's rows of A prefetched, and its share of B's columns.
    const int64_t i0 = items_ * begin / tiles, i1 = items_ * end / tiles;
    const int64_t c0 = p_.n * begin / tiles, c1 = p_.n * end / tiles;
    const int64_t span = end - begin, done = t + 1 - begin;
    const auto upto = [&](int64_t lo, int64_t hi, int64_t d) { return lo + (hi - lo) * d / span; };
    const int64_t first = upto(i0, i1, done - 1), last = upto(i0, i1, done);
    shrink_items(p_, g_, isa_, h_.data_ptr<float>(), first, last);
    const int64_t next = upto(i0, i1, std::min(done + 1, span));
    for (int64_t item = last; item < next; ++item) {
      const Item<W> it = item_at(p_, g_, item);
      prefetch_l2(it.a, it.nr * p_.k * kBytes);
    }
    prefetch_b(upto(c0, c1, done - 1), upto(c0, c1, done));
  }

  void finish() override { expand(p_, g_, isa_, h_.data_ptr<float>()); }

 private:
  // The used slots' B at columns [from, to).
  void prefetch_b(int64_t from, int64_t to) const {
    for (const int64_t s : g_.used) {
      if (!p_.b_by_rank) {
        prefetch_l2(p_.b + (s * p_.n + from) * p_.rank, (to - from) * p_.rank * kBytes);
        continue;
      }
      for (int64_t r = 0; r < p_.rank; ++r) {
        prefetch_l2(p_.b + (s * p_.rank + r) * p_.n + from, (to - from) * kBytes);
      }
    }
  }

  Lora<W> p_;
  Groups g_;
  Isa isa_;
  at::Tensor h_;
  int64_t items_;
};

}  // namespace

std::unique_ptr<LoraStage> lora_stage(const at::Tensor& x, const at::Tensor& y,
                                      const LoraArgs& args, Isa isa) {
  const int present = args.a.has_value() + args.b.has_value() + args.slots.has_value();
  TORCH_CHECK(present == 0 || present == 3, "lora_a, lora_b and lora_slots: all or none");
  if (present == 0) return nullptr;
  const at::Tensor &a = *args.a, &b = *args.b;
  check_shapes(y, x, a, b, *args.slots, args.offsets);
  const at::Tensor slots = args.slots->contiguous();
  Groups g = group_by_slot(slots.data_ptr<int64_t>(), x.size(0), a.size(0));
  if (g.used.empty() || a.size(1) * a.size(2) == 0) return nullptr;
  std::unique_ptr<LoraStage> stage;
  with_weight_type(a, [&](auto w) {
    using W = decltype(w);
    stage = std::make_unique<Stage<W>>(lora_of<W>(y, x, a, b, args.offsets), std::move(g), isa,
                                       x.size(0));
  });
  return stage;
}

}  // namespace pagoda_cpu

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def(
      "lora_apply(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor slots, int[] offsets, "
      "int isa_limit) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) { m.impl("lora_apply", &pagoda_cpu::lora_apply); }
