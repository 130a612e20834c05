# The two set-up commands of the README:
#   make demo   creates .venv if missing, installs everything and runs the offline quickstart recipe
#   make test   creates .venv if missing, installs everything and runs the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -e ".[all]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/lightning-fedrep fit --config recipes/digits/fedrep.yaml

test: $(STAMP)
	WANDB_MODE=disabled $(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check lightning_fedrep tests benchmarks scripts
	$(BIN)/ruff format --check lightning_fedrep tests benchmarks scripts

clean:
	rm -rf $(VENV) lightning_logs runs wandb .pytest_cache
