# Every target sets up what it needs: `make demo` and `make test` work on a fresh machine.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.posjax-installed
DEV_STAMP := $(VENV)/.posjax-dev-installed

.PHONY: help install demo test aot bench clean

help:
	@echo "make demo     set up .venv (posjax alone, about 2.6 GB), then run the position probes (results in workdir/probes)"
	@echo "make test     add the dev and convert extras to .venv (pytest, transformers, a CPU torch: about 1.0 GB more),"
	@echo "              and the aot compilers to .aot/ (about 1.3 GB), then run the test suite"
	@echo "make aot      only the aot compilers, in .aot/, where --target finds them"
	@echo "make bench    the attention benchmark (per-method time and memory)"
	@echo "make install  only set up .venv"
	@echo "make clean    remove .venv, .aot and build files"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[dev,convert]'
	touch $(DEV_STAMP)

# The aot extra's compilers (without jaxlib, which .venv has), outside .venv: `--target` puts them on its own path
# (posjax.aot.compile.setup), every other process runs without them (installed into .venv, the CUDA plugin and
# libtpu would look for their devices at every start).
AOT := .aot
AOT_STAMP := $(AOT)/.posjax-installed
$(AOT_STAMP): pyproject.toml $(STAMP)
	rm -rf $(AOT)
	$(PY) -m pip install -q --no-deps --target $(AOT) $$($(PY) -c 'import tomllib; \
	  print(*[p for p in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["aot"] \
	          if not p.startswith("jaxlib")])')
	touch $(AOT_STAMP)

install: $(STAMP)

aot: $(AOT_STAMP)

demo: $(STAMP)
	$(PY) -m posjax.main --config=configs/probes.py --workdir=workdir/probes

test: $(DEV_STAMP) $(AOT_STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup

bench: $(STAMP)
	$(PY) benchmarks/attention.py

clean:
	rm -rf $(VENV) $(AOT) build *.egg-info
