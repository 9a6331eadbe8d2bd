// A matmul's batched LoRA products taken inside the matmul's own call (lora.cpp; the quantized
// matmuls of quant_gemm.cpp take them through their optional lora_* arguments):
//
//   y = x W^T, then y[t, o] += sum_r b[s, o, r] * (a[s, l] x[t])[r]   s = slots[t], as lora_apply
//
// A decode step would otherwise call two ops a projection and take three parallel regions (the
// matmul's tiles, lora_apply's shrink, its expand), lose the norm or activation that runs inside
// the matmul's call, and read the adapter's rows after the base weight's megabytes have swept the
// caches, in runs too short for the hardware prefetcher. Here each thread of the tiles' region,
// after each of its tiles, takes its share of the shrink h = A x (the used slots' blocks of A's
// rows, split over the threads in proportion to their tiles), prefetches the rows of A its next
// share reads and its share of B; after the region, the expand y += B h. Each output's
// arithmetic is lora_apply's whatever the split, so the bits are those of the matmul's y plus
// lora_apply's products (tests/unit/test_lora_in_matmul.py). What it does to B1's rate:
// benchmarks/README.md (issue 45).

#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <memory>

#include "common.h"

namespace pagoda_cpu {

using LoraOpt = c10::optional<at::Tensor>;

// The optional lora_* arguments of a matmul op: all of a, b and slots, or none of them.
struct LoraArgs {
  const LoraOpt& a;         // (S, L, R, K), float32, bfloat16 or float16
  const LoraOpt& b;         // (S, N, R), a's dtype; contiguous or stored by rank (lora.cpp)
  const LoraOpt& slots;     // (T,) int64, -1: no adapter
  at::IntArrayRef offsets;  // L + 1 ascending column edges within [0, N]
};

class LoraStage {
 public:
  virtual ~LoraStage() = default;
  // By each thread of the tiles' region after its tile t, its tiles [begin, end) of `tiles`.
  virtual void after_tile(int64_t t, int64_t begin, int64_t end, int64_t tiles) = 0;
  // After the region, every tile done: y += B h.
  virtual void finish() = 0;
};

// x (T, K) float32 rows, contiguous; y (T, N) float32, contiguous. nullptr when the arguments
// hold no adapter or no token has a slot; a TORCH_CHECK error when they are malformed.
std::unique_ptr<LoraStage> lora_stage(const at::Tensor& x, const at::Tensor& y,
                                      const LoraArgs& args, Isa isa);

}  // namespace pagoda_cpu
