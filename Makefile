# sextant — the two commands a newcomer needs: `make demo` and `make test`.
# Both create .venv if missing and install everything (torch first, pinned: see DEVELOPERS.md).

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint bench coverage clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m sextant.demo

test: $(STAMP) lint
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n 2 -q

test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n 2 -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check sextant tests

coverage: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m sextant.tools.opinfo_coverage

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

bench: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error $(BIN)/python -m sextant.tools.bench
