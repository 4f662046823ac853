# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
DOCS_VENV := .venv-docs
PY := $(VENV)/bin/python
# torch is installed on its own, pinned, before the package: on this project's CPU machines the pin resolves
# to a local CPU build, on GPU machines to the standard CUDA build. Elsewhere, a CPU-only machine can avoid the
# multi-GB CUDA build by pointing TORCH_PIP_ARGS="--index-url ..." at PyTorch's CPU wheel index.
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
# The suite runs on TEST_WORKERS pytest processes, one test file per worker at a time (its module fixtures are built
# once); multi-process runs and the SLURM cluster's waits leave a core idle that the other worker uses.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile
DATA := data/stdlib
RUN := runs/tiny

.PHONY: venv demo test test-quick test-unit docs docs-serve s3-server clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e .
	touch $@

# The test tools, and DeepSpeed's ops compiled ahead (tools/build_ops.py: CPU Adam for the offload runs and, without
# a GPU, the shared-memory collectives): on first use every run would wait on their compilation. It takes the core
# pip leaves idle; if it fails, the runs that need the ops compile them.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) tools/build_ops.py & ops=$$!; \
	$(PY) -m pip install --quiet -e ".[test]" || { wait $$ops; exit 1; }; \
	wait $$ops || echo "tools/build_ops.py failed: the runs that need DeepSpeed's ops will compile them."
	touch $@

venv: $(VENV)/.installed-test

$(DATA)/meta.json: | $(VENV)/.installed
	$(PY) tools/prepare_data.py --output $(DATA) --vocab-size 8192

# Prepare the embedded corpus (Python's standard library), train recipes/tiny.yaml, evaluate the export. The demo
# also scores the next_line task at each validation (the tests train recipes/tiny.yaml without it).
demo: $(VENV)/.installed $(DATA)/meta.json
	$(PY) train.py recipes/tiny.yaml out_dir=$(RUN) data.path=$(DATA) 'eval.tasks=[next_line]'
	$(PY) eval.py $(RUN)/export --data $(DATA) --output $(RUN)/eval.json --overwrite --generate "def main("

# The slowest tests are listed at the end, to keep the suite's time in view. The files go out in the order
# tests/conftest.py gives them, longest first: xdist's default sends those with the most tests first, and the longest
# files, which hold few tests, ran alone at the end (237 s more). The quick set keeps the default: its long files are
# others.
test: $(VENV)/.installed-test
	$(PYTEST) --no-loadscope-reorder --durations=15

# The quick set: everything but the multi-process runs.
test-quick: $(VENV)/.installed-test
	$(PYTEST) -m "not slow"

# The tests that run in one process (seconds).
test-unit: $(VENV)/.installed-test
	$(PY) -m pytest -q tests/unit

# A local S3 server (SeaweedFS, every port free) to try checkpoint.remote and data URLs against, until Ctrl-C: it
# prints the variables to export in another shell (docs/object-storage.md).
s3-server: $(VENV)/.installed-test
	$(PY) tests/s3_server.py --folder runs/s3 --bucket lmrecipe

# The documentation site (mkdocs.yml, docs/) into site/; --strict fails on a broken link or #anchor. mkdocs needs
# none of the package's dependencies: its own small venv holds the packages of the docs extra alone (read from
# pyproject.toml), so a docs build installs no torch, no test tools and compiles nothing. Open site/index.html from
# disk: links and search work without a server.
$(DOCS_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(DOCS_VENV)/bin/python -m pip install --quiet $$($(DOCS_VENV)/bin/python -c 'import tomllib; \
		print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))')
	touch $@

docs: $(DOCS_VENV)/.installed
	$(DOCS_VENV)/bin/mkdocs build --strict --site-dir site

docs-serve: $(DOCS_VENV)/.installed
	$(DOCS_VENV)/bin/mkdocs serve --strict

clean:
	rm -rf $(VENV) $(DOCS_VENV) site runs data
