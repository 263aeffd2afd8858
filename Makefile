# The two commands of the README, each doing all set-up from a fresh clone:
#   make demo   FedAvg, FedNTD and DS-FL on scikit-learn's bundled digits over the embedded MQTT broker, one report
#   make test   lint, type-check and the full test suite (installs mosquitto for the broker tests if missing)
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: demo test lint typecheck install mosquitto bench clean

install: $(VENV)/.installed

# constraints.txt pins the CPU build of torch; pyproject.toml keeps open ranges for Jetson's JetPack wheels.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,export,ray]'
	@touch $@

demo: install
	$(BIN)/fedge demo --out runs/demo

mosquitto:
	@bash scripts/install-mosquitto.sh

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: install
	$(BIN)/mypy

test: install mosquitto lint typecheck
	$(BIN)/pytest -q

bench: install
	$(BIN)/python benchmarks/local_training.py

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
