# The two set-up commands of the README:
#   make demo   creates .venv if missing, installs everything and runs the offline quickstart recipe
#   make test   creates .venv if missing, installs everything and runs the test suite
#   make docs   also installs the [docs] extra, builds the site (docs/_build/html), runs its examples and
#               checks its internal links and anchors
#   make docs-check  also renders pages in a headless browser
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs
# -E: a fresh environment every time, so the API pages follow docstring edits; -W: warnings are errors
SPHINX := $(BIN)/python -m sphinx -E -W --keep-going

.PHONY: demo test install lint clean docs docs-check

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -e ".[all]"
	touch $(STAMP)

install: $(STAMP)

$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install -e ".[all,docs]"
	touch $(DOCS_STAMP)

demo: $(STAMP)
	$(BIN)/lightning-fedrep fit --config recipes/digits/fedrep.yaml

test: $(STAMP)
	WANDB_MODE=disabled $(BIN)/python -m pytest -q

docs: $(DOCS_STAMP)
	WANDB_MODE=disabled $(SPHINX) -n -b html docs docs/_build/html
	WANDB_MODE=disabled $(SPHINX) -b doctest docs docs/_build/doctest
	$(BIN)/python scripts/check_docs_links.py docs/_build/html

docs-check: docs
	cd docs/browser-check && (test -d node_modules || npm ci --no-audit --no-fund) && node check.mjs ../_build/html

lint: $(STAMP)
	$(BIN)/ruff check lightning_fedrep tests benchmarks scripts
	$(BIN)/ruff format --check lightning_fedrep tests benchmarks scripts

clean:
	rm -rf $(VENV) lightning_logs runs wandb .pytest_cache docs/_build
