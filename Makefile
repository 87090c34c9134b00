# Two commands for a fresh machine: `make demo` and `make test`. Both set up .venv first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
RUN_DIR ?= runs/demo

# DeepSpeed on CPU; its compiled ops are cached inside the venv (built once per machine).
export DS_ACCELERATOR ?= cpu
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: setup demo test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# CPU torch first (a local wheel on these machines), so the package's torch range is already met.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

demo: setup
	$(VENV)/bin/mhf-dist train --preset tiny-h4b16k --run-dir $(RUN_DIR) \
		--set train.max_steps=60 --set train.log_interval=10

test: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) runs
