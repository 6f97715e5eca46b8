# sextant — the two commands a newcomer needs: `make demo` and `make test`.
# Both create .venv if missing and install everything (torch first, pinned: the README's Development section).

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-all lint bench coverage coverage-grad clean chromium ptxas

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m sextant.demo

# `make test`: lint and every test not marked `slow` (~15 minutes on 2 cores); `make test-slow`: the
# `slow` ones (OpInfo conformance, whole models through cuda-sim, the docs' snippets; ~20 minutes);
# CI (.ci/run) runs both: `make test-all`.
test: $(STAMP) lint chromium ptxas
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n 2 -q -m "not slow"

test-slow: $(STAMP) chromium ptxas
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n 2 -q -m slow

test-all: test test-slow

# The compile report's browser test (tests/report) needs headless Chromium: Debian's package, installed
# here when missing and we are root (as in CI); otherwise that test fails and says how to install it.
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	else \
		echo "warning: chromium is missing and installing it needs root: apt-get install chromium" >&2; \
	fi

# The GPU tests assemble every kernel with ptxas: the CUDA toolkit's when installed, else PyPI's
# nvidia-cuda-nvcc wheel (ptxas only, ~50 MB), installed into the venv here. They never skip for want of it.
ptxas: $(STAMP)
	@$(BIN)/python -c "from sextant.codegen.ptxas import find_ptxas; find_ptxas()" 2>/dev/null || \
		$(BIN)/python -m pip install -q nvidia-cuda-nvcc

lint: $(STAMP)
	$(BIN)/ruff check sextant tests

coverage: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m sextant.tools.opinfo_coverage

coverage-grad: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m sextant.tools.opinfo_coverage --grad

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

bench: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error $(BIN)/python -m sextant.tools.bench
	HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error $(BIN)/python -m sextant.tools.dynamic_bench --markdown docs/benchmarks.md
	$(BIN)/python -m sextant.tools.decode_bench
	HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error $(BIN)/python -m sextant.tools.train_bench --markdown docs/benchmarks.md
	$(BIN)/python -m sextant.tools.dist_bench --markdown docs/benchmarks.md
	HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error $(BIN)/python -m sextant.tools.bench --real-size
	HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error $(BIN)/python -m sextant.tools.bench --real-size-bf16
