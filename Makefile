# Two set-up commands: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test train-default clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[sglang,train,test,bench]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/jetflow prepare
	$(VENV)/bin/jetflow bench --prompts demo --max-new-tokens 96 --show-text --out out/demo.json

test: $(STAMP)
	$(PY) -m pytest -q --durations=25 tests

# Regenerate data, train the JetFlow head and the DFlash-T baseline, evaluate, ship both
# under jetflow_sglang/heads/ (about 2 hours on 2 CPU cores; rerun to resume).
train-default: $(STAMP)
	$(VENV)/bin/jetflow prepare
	$(PY) -m jetflow_sglang.training.recipe

clean:
	rm -rf $(VENV) build *.egg-info
