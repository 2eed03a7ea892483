# Entry points. `make test` (also .ci/run) sets everything up on a fresh machine first.
VENV    := .venv
PY      := $(VENV)/bin/python
RUN     := $(VENV)/bin/spark-hvd-run
NP      ?= 2
PYTEST_OPTS := -v --timeout=600 -p no:cacheprovider --durations=30
# The whole suite in two phases: the network-namespace bed with the mostly_waiting tests beside
# it in a second pytest process, then the rest (scripts/run_tests.py says why);
# SPARK_HVD_TESTS_SERIAL=1 runs it in one process.
PYTEST  := $(PY) scripts/run_tests.py $(PYTEST_OPTS)
PYTEST_ARGS ?=

.PHONY: all setup build build-debug wheel demo docs docs-serve test test-fast test-slow test-gpu bench \
        clean distclean

all: build

setup:
	bash scripts/setup.sh

build: setup
	$(PY) build.py

build-debug: setup
	$(PY) build.py --debug

# The manylinux wheel: built with zig's clang for glibc 2.28 (no system compiler in the wheel's
# libraries, LLVM's C++ runtime linked in privately), the torch allocator for the venv's torch and
# every torch wheel file named in TORCH_WHEELS (colon-separated), into build/wheel/dist/; then
# scripts/check_wheel.py: auditwheel repair confirms manylinux_2_28 with MPI and the frameworks
# excluded and grafts nothing, the libraries' exports, glibc and run paths; auditwheel's wheel
# goes to dist/.
TORCH_WHEELS ?=
wheel: setup
	rm -rf build/wheel/dist dist/spark_hvd-*.whl
	SPARK_HVD_TOOLCHAIN=zig SPARK_HVD_TORCH_WHEELS="$(TORCH_WHEELS)" \
	  $(PY) -m pip wheel --no-deps --no-build-isolation -w build/wheel/dist .
	$(PY) scripts/check_wheel.py --out dist build/wheel/dist/spark_hvd-*.whl

# The headline: a Pipeline with a TorchEstimator fitted on a generated DataFrame in local Spark,
# test accuracy printed, the PipelineModel saved and reloaded.
demo: build
	$(PY) examples/spark/torch_estimator_mnist.py --num-proc $(NP)

# The documentation site (docs/: Sphinx, MyST, furo) into docs/_build/html, strictly: a warning
# (a broken link or reference, a page outside the table of contents, a docstring that does not
# render, a public function without one) fails it. tests/test_docs_site.py builds it the same way.
DOCS_OUT  ?= docs/_build/html
DOCS_PORT ?= 8000
SPHINX    := $(PY) -m sphinx -b html -W --keep-going -n -q
docs: build
	$(SPHINX) docs $(DOCS_OUT)
	@echo "docs: $(CURDIR)/$(DOCS_OUT)/index.html"

# Build, then serve the site on http://localhost:$(DOCS_PORT)/ (Ctrl-C stops it).
docs-serve: docs
	$(PY) -m http.server --bind 127.0.0.1 --directory $(DOCS_OUT) $(DOCS_PORT)

# Every test, slow ones included.
test: build
	$(PYTEST) $(PYTEST_ARGS)

test-fast: build
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

test-slow: build
	$(PYTEST) -m slow $(PYTEST_ARGS)

# The GPU suite (tests/gpu: every collective, the optimizer and SyncBatchNorm on CUDA tensors,
# 1 and 2 ranks through the launcher, both ways of sharing one GPU) on a machine with a CUDA GPU
# and a CUDA build of torch. It needs no setup step (GPU machines often have no package index):
# the core is built with GPU_PYTHON and used from this tree. Skips, saying why, without a GPU.
GPU_PYTHON ?= python3
test-gpu:
	$(GPU_PYTHON) build.py --no-tensorflow
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) -m pytest tests/gpu -v -p no:cacheprovider $(PYTEST_ARGS)

# Each benchmarks/*.py script is self-contained (launches its own workers when it needs them);
# benchmarks/plots.py draws the figures from benchmarks/results/ and is not a benchmark.
bench: build
	@set -e; for f in benchmarks/*.py; do \
	  [ -e "$$f" ] || { echo "no benchmarks yet"; break; }; \
	  [ "$$f" != benchmarks/plots.py ] || continue; \
	  echo "== $$f"; $(PY) "$$f"; \
	done

clean:
	@if [ -x $(PY) ]; then $(PY) build.py --clean; else python3 build.py --clean; fi
	rm -rf build dist *.egg-info docs/_build docs/_generated docs/api
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
