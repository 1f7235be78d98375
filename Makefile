# The README's commands: `make demo`, `make test` (the user guide's strict build, then every
# tier: CI), one tier (`make test-unit`, `test-integration`, `test-scenario`), `make docs` and
# `make bench NAME=...`. All install on first use.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

.PHONY: install test test-unit test-integration test-scenario bench demo demo-fsdp docs clean

install: $(STAMP)

# One line per step, and pip's own progress for the long one (torch is large).
$(STAMP): pyproject.toml
	@echo "==> [1/4] creating $(VENV)"
	python3 -m venv $(VENV)
	@echo "==> [2/4] upgrading pip"
	$(PY) -m pip install --quiet --upgrade pip
	@echo "==> [3/4] installing $(TORCH) (a large download: pip shows its progress)"
	$(PY) -m pip install --progress-bar on $(TORCH)
	@echo "==> [4/4] installing elastic-trainer, its test tools (etcd, moto, s3fs, gcsfs, a GCS emulator, ...) and mkdocs"
	$(PY) -m pip install --quiet -e '.[test,docs]' $(TORCH)
	touch $(STAMP)
	@echo "==> installed; next time this step is skipped"

PYTEST := $(PY) -m pytest -p no:cacheprovider
# The tiers that start processes run in two pytest processes (pytest-xdist), a file each at a
# time: most of a test's time is spent waiting on its workers, so two keep two cores busy.
# `make test WORKERS=0` runs them in this process alone.
WORKERS ?= 2
PARALLEL = -n $(WORKERS) --dist loadfile

test: docs
	$(PYTEST) $(PARALLEL) --durations=15 tests

# One tier each (tests/conftest.py gives every test its marker).
test-unit: install
	$(PYTEST) -q -m unit tests

test-integration: install
	$(PYTEST) $(PARALLEL) --durations=15 -m integration tests

test-scenario: install
	$(PYTEST) $(PARALLEL) --durations=15 -m scenario tests

# `make bench NAME=recovery [ARGS="--reps 3"]`; `make bench` lists the names.
bench: install
	$(PY) -m benchmarks $(NAME) $(ARGS)

# The user guide (docs/, mkdocs.yml) into site/; --strict: a broken link fails the build.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

demo: install
	$(PY) examples/demo.py

# The FSDP2 language model (tiny) under `elastic run`, with a kill, a join and sharded checkpoints.
demo-fsdp: install
	$(PY) examples/demo.py --fsdp

clean:
	rm -rf $(VENV) site
