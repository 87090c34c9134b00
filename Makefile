# Two commands for a fresh machine: `make demo` and `make test` (lint, then every test). Both set up .venv first.
# While developing: `make test-fast` (the single-process tests; docs/install.md says how long) and `make lint` (ruff).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
RUN_DIR ?= runs/demo

# DeepSpeed on CPU; its compiled ops are cached inside the venv (built once per machine).
export DS_ACCELERATOR ?= cpu
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: setup slurm demo lint test test-fast clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# CPU torch first (a local wheel on these machines), so the package's torch range is already met; then uv, which
	# resolves and installs the rest (the eval extra's large tree included) in seconds where pip takes minutes; its
	# --compile-bytecode writes the .pyc files every rank would otherwise compile at each start.
	$(PY) -m pip install -q torch==2.13.0 uv
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -e '.[dev]'
	touch $@

# The main job on the embedded default: tiny-h4b16k on 4 CPU ranks, first tp=2 x dp=2 (which also trains the
# tokenizer and prepares shards of the embedded corpus in its run directory), then pp=2 x dp=2 on those shards.
DEMO := $(VENV)/bin/mhf-dist train --preset tiny-h4b16k --nproc-per-node 4 \
	--set train.max_steps=40 --set train.log_interval=5 --set train.global_batch_size=8 --set train.micro_batch_size=2

demo: setup
	rm -rf $(RUN_DIR)
	$(DEMO) --run-dir $(RUN_DIR)/tp2-dp2 --set parallel.tp=2
	$(DEMO) --run-dir $(RUN_DIR)/pp2-dp2 --set parallel.pp=2 --set data.path=$(RUN_DIR)/tp2-dp2/data
	@echo "TensorBoard logs: $(abspath $(RUN_DIR)) (tensorboard --logdir $(abspath $(RUN_DIR)))"

# The real-scheduler test needs SLURM's daemons: Debian's packages, installed when we may (root with apt-get);
# elsewhere that one test is skipped with the reason (CI installs them).
slurm:
	@command -v slurmctld >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    slurmctld slurmd slurm-client munge >/dev/null; } || echo "SLURM not installed: its end-to-end test will skip"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The tests on two workers and, beside them, the SLURM tests in a session of their own (one SLURM cluster at a time;
# they mostly wait), whose output follows.
test: lint slurm
	log=$$(mktemp); $(PY) -m pytest -q --durations=10 -m slurm tests > $$log 2>&1 & slurm=$$!; \
	$(PY) -m pytest -q --durations=20 -n 2 -m "not slurm" tests; rest=$$?; \
	wait $$slurm; code=$$?; cat $$log; rm -f $$log; [ $$rest -eq 0 ] && [ $$code -eq 0 ]

# Leaves out the tests marked multirank, slurm or slow (pyproject.toml lists the markers).
test-fast: setup
	$(PY) -m pytest -q -m "not multirank and not slurm and not slow" tests

clean:
	rm -rf $(VENV) runs
