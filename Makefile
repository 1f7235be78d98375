# The README's two commands: `make demo` and `make test`. Both install on first use.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

.PHONY: install test demo clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[test]' $(TORCH)
	touch $(STAMP)

test: install
	$(PY) -m pytest -p no:cacheprovider tests

demo: install
	$(PY) examples/demo.py

clean:
	rm -rf $(VENV)
