# Every target sets up what it needs: `make demo` and `make test` work on a fresh machine.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.posjax-installed

.PHONY: help install demo test bench clean

help:
	@echo "make demo     set up .venv, then run the position probes (every method; results in workdir/probes)"
	@echo "make test     set up .venv with the dev and convert extras and run the test suite"
	@echo "make bench    the attention benchmark (per-method time and memory)"
	@echo "make install  only set up .venv"
	@echo "make clean    remove .venv and build files"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,convert]'
	touch $(STAMP)

# The aot extra's compilers (without jaxlib, which .venv has), outside .venv: the suite's compile tests put them on
# PYTHONPATH, every other process runs without them.
AOT := .aot
AOT_STAMP := $(AOT)/.posjax-installed
$(AOT_STAMP): pyproject.toml $(STAMP)
	rm -rf $(AOT)
	$(PY) -m pip install -q --no-deps --target $(AOT) $$($(PY) -c 'import tomllib; \
	  print(*[p for p in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["aot"] \
	          if not p.startswith("jaxlib")])')
	touch $(AOT_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m posjax.main --config=configs/probes.py --workdir=workdir/probes

test: $(STAMP) $(AOT_STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup

bench: $(STAMP)
	$(PY) benchmarks/attention.py

clean:
	rm -rf $(VENV) $(AOT) build *.egg-info
