# The two set-up commands on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: install lock demo test test-gpu lint format clean

# The environment is locked: requirements.txt pins every package at an exact version, so CI, a
# user and the next developer install the same ones. `make lock` refreshes it; `pip install .`
# keeps pyproject's ranges. The installer is pinned too: it reads and writes the lock.
UV_VERSION := 0.13.9
# A directory with the CPU build of torch (`make lock` resolves torch's dependencies from it).
TORCH_WHEELS ?= /opt/wheels

$(BIN)/uv:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q uv==$(UV_VERSION)

# pip installs torch at the lock's version: the local CPU build where the machine has one (pip's
# find-links), else PyPI's with the CUDA packages that torch itself pins exactly. uv installs the
# rest of the lock in parallel, 40 s on two cores where pip alone takes over two minutes
# (benchmarks/test_suite.md). --no-deps: the lock is the whole environment, nothing is resolved
# again; `uv pip check` then fails if the lock missed a dependency. A package the lock drops stays
# in an existing .venv (`uv pip sync` would remove everything the lock does not list, a GPU
# machine's CUDA packages among them): `rm -rf .venv` for an exact copy.
$(BIN)/.kiln-installed: pyproject.toml requirements.txt | $(BIN)/uv
	$(BIN)/python -m pip install -q -c requirements.txt torch
	$(BIN)/uv pip install -q --python $(BIN)/python --no-deps -r requirements.txt
	$(BIN)/uv pip install -q --python $(BIN)/python --no-deps -e .
	$(BIN)/uv pip check -q --python $(BIN)/python
	touch $@

install: $(BIN)/.kiln-installed

# Resolves the newest versions that pyproject's ranges and the [dev] extra allow (--upgrade: uv
# would otherwise keep the old lock's pins), for CI's platform, Python 3.11 on x86-64 Linux,
# whichever machine runs it: a resolution differs by platform (wheels, markers), and the lock is
# the one CI installs. torch resolves to the CPU build, whose dependencies leave out the CUDA stack; its local
# label (+cpu) is dropped so that torch==2.13.0 also matches PyPI's build on a machine without
# the local wheel.
lock: $(BIN)/uv
	$(BIN)/uv pip compile -q --upgrade pyproject.toml --extra dev \
		--python-version 3.11 --python-platform x86_64-unknown-linux-gnu \
		--find-links $(TORCH_WHEELS) --custom-compile-command "make lock" -o requirements.txt
	sed -i 's/^torch==\([^+]*\)+cpu$$/torch==\1/' requirements.txt

demo: install
	$(BIN)/kiln prepare --demo
	$(BIN)/kiln train configs/train/demo.toml
	$(BIN)/kiln generate runs/demo/checkpoints --prompt "def read_config(path):" --max-new-tokens 80 --temperature 0.7 --top-k 40

# Bytecode written once for kiln and the tests, not compiled again in each of the suite's
# hundreds of processes (an environment with PYTHONDONTWRITEBYTECODE set would).
# Two phases: the parity tests on the gangs of worker processes (their ranks keep every core
# busy), then the rest, mostly one-process tests and subprocess runs that leave a core idle, on
# two pytest workers of one thread each (benchmarks/test_suite.md).
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q
test: install lint
	$(PYTEST) -m gang tests/distributed
	OMP_NUM_THREADS=1 $(PYTEST) -m "not gang" -n 2 --dist worksteal

# The GPU suite (tests/gpu; docs/architecture.md, "CPU and CUDA"): about 6 minutes on one H100,
# every test skipped, with its reason (-rs lists them), without a GPU. A GPU machine may have no .venv: then the
# system's python3 runs it, or name one, `make test-gpu PYTHON_FOR_TESTS=python3.12`. A Python
# that cannot import torch and pytest is named in one line instead of a collection traceback.
PYTHON_FOR_TESTS ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
test-gpu:
	@$(PYTHON_FOR_TESTS) -c 'import torch, pytest' 2>/dev/null || { echo "make test-gpu:" \
		"$(PYTHON_FOR_TESTS) cannot import torch and pytest: run make install (for .venv), or" \
		"name a Python with kiln's requirements: make test-gpu PYTHON_FOR_TESTS=/path/to/python" >&2; \
		exit 2; }
	PYTHONDONTWRITEBYTECODE= $(PYTHON_FOR_TESTS) -m pytest -q -rs -m gpu tests/gpu

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf runs data .pytest_cache .ruff_cache
