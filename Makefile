# The two set-up commands on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: install demo test lint format clean

# pip installs torch (the local CPU build where the machine has one) and uv; uv resolves and
# installs the other packages in parallel: 40 s on two cores where pip alone takes over two
# minutes (benchmarks/test_suite.md).
$(BIN)/.kiln-installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0 uv
	$(BIN)/python -m uv pip install -q --python $(BIN)/python -e ".[dev]"
	touch $@

install: $(BIN)/.kiln-installed

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

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf runs data .pytest_cache .ruff_cache
