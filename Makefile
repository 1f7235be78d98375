# The README's two commands: `make demo` and `make test`. Both install on first use.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

.PHONY: install test demo clean

install: $(STAMP)

# One line per step, and pip's own progress for the long one (torch is large).
$(STAMP): pyproject.toml
	@echo "==> [1/4] creating $(VENV)"
	python3 -m venv $(VENV)
	@echo "==> [2/4] upgrading pip"
	$(PY) -m pip install --quiet --upgrade pip
	@echo "==> [3/4] installing $(TORCH) (a large download: pip shows its progress)"
	$(PY) -m pip install --progress-bar on $(TORCH)
	@echo "==> [4/4] installing elastic-trainer and its test tools (etcd, moto, s3fs, ...)"
	$(PY) -m pip install --quiet -e '.[test]' $(TORCH)
	touch $(STAMP)
	@echo "==> installed; next time this step is skipped"

test: install
	$(PY) -m pytest -p no:cacheprovider --durations=15 tests

demo: install
	$(PY) examples/demo.py

clean:
	rm -rf $(VENV)
