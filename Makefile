# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# torch, FBGEMM and TorchRec are pinned and installed in this order on purpose: torchrec's
# metadata asks for the CUDA build `fbgemm-gpu`, which cannot load without CUDA, so the CPU
# build goes in first and torchrec follows with --no-deps (its other needs are in pyproject).
# On a GPU machine: make install FBGEMM=fbgemm-gpu==1.8.0 TORCH_INDEX=<your CUDA wheel index>

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
FBGEMM ?= fbgemm-gpu-cpu==1.8.0
TORCH_INDEX ?=
PIP    := $(BIN)/python -m pip install -q --disable-pip-version-check
STAMP  := $(VENV)/.installed
TEST_WORKERS ?= 2

.PHONY: install browser demo test lint bench bench-ett gpu-check mutate breaks stack stack-down clean

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) $(FBGEMM)
	$(PIP) --no-deps torchrec==1.8.0
	$(PIP) -c constraints.txt -e ".[dev,triton]"
	touch $(STAMP)

install: $(STAMP)

# The UI tests (tests/flows/test_deployments.py) read the MLflow and Prefect pages in headless
# Chromium, driven over its DevTools protocol (tests/browser.py): Debian's package, installed
# where missing (apt-get, through sudo unless root).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
		echo "installing Chromium (Debian package chromium) for the UI tests"; \
		$(SUDO) apt-get update -q && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; }

demo: install
	$(BIN)/ett demo

test: install browser
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=30 -n $(TEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: install
	$(BIN)/python benchmarks/run_all.py

# The headline: the same 5-minute job with the same failures, baseline vs optimized (~15 min).
bench-ett: install
	$(BIN)/python benchmarks/bench_ett.py

# On a GPU machine (<= 8 min); `make test` runs its --dry-run (tests/test_gpu_check.py).
gpu-check: install
	$(BIN)/python benchmarks/gpu_check.py

# Mutation testing of the core (mutation/run.py, docs/testing.md): CPU-heavy, not in `make
# test`. MUTATE_ARGS: target names, --fresh, --survivors, --report, --pause-file F.
mutate: install
	$(BIN)/python mutation/run.py $(MUTATE_ARGS)

# The break table of docs/testing.md: deliberate one-line bugs, each must fail a fast test.
breaks: install
	$(BIN)/python mutation/breaks.py

stack: install
	$(BIN)/ett stack up

stack-down: install
	$(BIN)/ett stack down

clean:
	rm -rf runs .stack mlflow.db mlruns benchmarks/results
