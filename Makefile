# Every target sets up what it needs: `make demo` and `make test` work on a fresh machine.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.posjax-installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m posjax.main --config=configs/probes.py --workdir=workdir/probes

test: $(STAMP)
	$(PY) -m pytest -n 2

bench: $(STAMP)
	$(PY) benchmarks/attention.py

clean:
	rm -rf $(VENV) build *.egg-info
