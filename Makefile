# One command sets up and tests (`make test`); one runs the demo pipeline (`make demo`).
# Everything installs into .venv from PyPI; the Kafka jars come from Maven Central on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup test lint demo clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest

demo: setup
	$(BIN)/detok demo

clean:
	rm -rf $(VENV) .kafka-local deploy/kafka-local/lib
