# The two commands of the README, each doing all set-up from a fresh clone:
#   make demo   FedAvg, FedNTD and DS-FL on scikit-learn's bundled digits over the embedded MQTT broker, one report
#   make test   lint, type-check and the full test suite (installs mosquitto and headless Chromium for the
#               broker and web-page tests if missing)
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: demo test test-isa test-fast lint typecheck install mosquitto chromium bench clean ort-training

install: $(VENV)/.installed

# constraints.txt pins the CPU build of torch; pyproject.toml keeps open ranges for Jetson's JetPack wheels.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,all]'
	@touch $@

# The onnxruntime-training client runtime lives in its own venv: the package owns the same onnxruntime/ folder as
# onnxruntime (in .venv) and needs onnx 1.17.0. No `export` extra here (it would pull onnxruntime); scikit-learn for
# the artifacts' parity gate (export.gates checks them on its bundled digits). docs/on_device.md
ORT_VENV ?= .venv-ort-training
ort-training: $(ORT_VENV)/.installed

$(ORT_VENV)/.installed: pyproject.toml constraints-ort-training.txt
	$(PYTHON) -m venv $(ORT_VENV)
	$(ORT_VENV)/bin/pip install -q -c constraints-ort-training.txt onnxruntime-training onnx scikit-learn -e .
	@touch $@

demo: install
	$(BIN)/fedge demo --out runs/demo

mosquitto:
	@bash scripts/install-debian-package.sh mosquitto mosquitto /usr/sbin/mosquitto

# For the test that loads `fedge status --web` in a browser (tests/fedge_io/test_web_status.py).
chromium:
	@bash scripts/install-debian-package.sh chromium-headless-shell chromium-headless-shell

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: install
	$(BIN)/mypy

# --durations: the slowest tests at the end of every run, to keep the suite well under 15 minutes on 2 cores.
# Two worker processes (pytest-xdist), one test file each at a time (module fixtures such as a fleet's mosquitto stay
# in one process): many tests wait on brokers, subprocesses and deadlines, so two workers on 2 cores cut the wall
# time (measured: 11.9 min for 1,636 tests from a fresh clone, 2-core Intel Xeon, 2026-11-29 15:00, beside two
# nice-19 experiments; 11.7 min for 1,589, 11.8 min for 1,530 and 10.4 min for 1,463
# and 8.3 min for 1,332 earlier that day; 16.3 min for 1,025 on 2026-11-27).
# Each worker computes on one torch thread (tests/conftest.py): with two, in-process training of small tensors ran
# tens of times slower than alone, its second OpenMP thread waiting for a core at every op. Files are taken in
# collection order, the slowest first (tests/conftest.py), so that no worker finishes a long file alone.
test: install ort-training mosquitto chromium lint typecheck
	$(BIN)/pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15
	$(MAKE) --no-print-directory test-isa

# The tests whose verdict rests on the CPU's float kernels (marker `isa`: the parity gate, its ties, the exported
# models' logits), again under each kernel choice this machine can make (scripts/isa-caps.sh): PyTorch's ATen dispatch
# (default = no SIMD, AVX2, AVX-512 where the CPU has them) and oneDNN's instruction-set cap (its convolutions and
# max-pools; a cap above what the CPU has runs its best), paired level with level: three runs. Another CPU (an Intel
# AVX-512/AMX host, an ARM board) picks other kernels and breaks other float32 ties; the gate must give every correct
# program the same verdict there.
# docs/on_device.md, "The same verdict on every CPU".
test-isa: install
	@bash scripts/isa-caps.sh | while read -r caps; do \
		echo "== $$caps"; env $$caps $(BIN)/pytest -q -p no:cacheprovider -n 2 -m isa tests/export || exit 1; \
	done

# The unit tests of the core, the journal, the CLI, the reports and the in-process simulator: no broker, no exported
# program, no fleet of processes, no venv built (tests/fedge_cli/test_packaging.py) and no Ctrl-C of a subprocess
# run (test_run_lifecycle.py). Two workers, as `make test` (654 tests in 58 s, quiet 2-core machine, 2026-11-27);
# `make test` stays the full suite.
FAST_TESTS := tests/fedge tests/fedge_io/test_journal.py tests/fedge_cli/test_cli.py tests/fedge_cli/test_help.py \
	tests/experiments tests/sim/test_report.py tests/sim/test_inprocess.py
test-fast: install
	$(BIN)/pytest -q -n 2 -m "not broker" --durations=10 $(FAST_TESTS)

bench: install
	$(BIN)/python benchmarks/local_training.py

clean:
	rm -rf $(VENV) $(ORT_VENV) runs .pytest_cache .mypy_cache .ruff_cache
