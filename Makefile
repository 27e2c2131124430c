# fedsplit: the two commands a newcomer needs are `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.fedsplit-installed

.PHONY: setup demo test test-fast test-containers lint bench clean wheelhouse base-image image

setup: $(STAMP)

# torch 2.13.0 is installed first: its CPU wheel where one is provided, the platform's default
# build elsewhere. A GPU site installs its CUDA build of torch 2.13 before running this.
# Each step prints a line first and pip prints its own progress (every package it collects and
# downloads); run again, it does nothing until pyproject.toml changes.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "fedsplit needs Python >= 3.11: run make PYTHON=python3.11 ...")'
	@echo "== make setup 1/5: the virtual environment $(VENV)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "== make setup 2/5: torch 2.13.0 (the largest download; unpacking it takes a minute or more)"
	$(BIN)/python -m pip install --progress-bar on torch==2.13.0 || $(BIN)/python -m pip install --progress-bar on "torch>=2.13.0,<3"
	@echo "== make setup 3/5: fedsplit and its dependencies (Flower, pandas, FastAPI, ...)"
	@# pip says nothing while it installs what it collected (80 s of the 3 min on 2 cores):
	@# meanwhile, every 15 s, a line counts the packages in place when the count changed
	@echo '$(BIN)/python -m pip install --progress-bar on -e ".[dev]"'
	@( last=; while sleep 15; do n=$$(ls -d $(VENV)/lib/python3*/site-packages/*.dist-info 2>/dev/null | wc -l); \
	  [ "$$n" = "$$last" ] || echo "   ... $$n packages installed in $(VENV) so far"; last=$$n; done ) & watch=$$!; \
	$(BIN)/python -m pip install --progress-bar on -e ".[dev]"; status=$$?; kill $$watch 2>/dev/null; exit $$status
	@echo "== make setup 4/5: openmined-psi (vertical ID alignment)"
	# openmined-psi without its dependencies: its exact protobuf pin breaks Flower's gRPC stack
	$(BIN)/python -m pip install --progress-bar on --no-deps "openmined-psi==2.0.6"
	@echo "== make setup 5/5: compiling the streamed aggregation kernels (C, cffi)"
	# the streamed aggregation kernels (C, cffi): built now rather than by the first aggregation;
	# without a C compiler this says why and the passes stay in numpy
	-$(BIN)/python -c 'from fedsplit.aggregation._ckernels import main; raise SystemExit(main())'
	touch $(STAMP)
	@echo "== make setup: done ($(VENV); run again, it does nothing until pyproject.toml changes)"

demo: setup
	$(BIN)/fedsplit simulate --dataset heart-disease --rounds 10 --personalize prior --out runs/demo

# Two worker processes (pytest-xdist); TEST_WORKERS=0 runs in this process. --dist loadgroup keeps
# the tests of a module with a module-scoped fixture on one worker (tests/conftest.py).
# Bytecode caching stays on even where PYTHONDONTWRITEBYTECODE is set: otherwise every worker,
# and every fresh interpreter a test starts (servers, CLI probes), compiles fedsplit's modules
# and pytest rewrites every test module again (__pycache__/ is git-ignored).
TEST_WORKERS ?= 2

# Everything CI runs: the fast tests on two workers, then the slow ones (Flower federations,
# browser, containers) one at a time, as they start servers and processes of their own.
# Each group says what it runs before it starts; the fast group prints a dot per test (with the
# share done at each line's end), the slow group each test's name as it starts (-v: they take
# seconds to minutes each).
FAST_LINE := "== the fast tests on $(TEST_WORKERS) workers (a dot per test; about 1.5 min on 2 cores)"
SLOW_LINE := "== the slow tests one at a time: Flower federations, browser, containers, wheel (each test's name as it starts)"

test: setup
	@echo $(FAST_LINE)
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadgroup
	@echo $(SLOW_LINE)
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -v -m slow

test-fast: setup
	@echo $(FAST_LINE)
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadgroup

# The compose federation in real containers (also part of `make test`; needs a Docker engine).
test-containers: setup
	@echo "== the compose federation in Docker (builds the image first: minutes; each test's name as it starts)"
	$(BIN)/python -m pytest -v -m containers tests/containers

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf runs .pytest_cache .ruff_cache

# Containers (docs/deployment.md, "Containers"). wheelhouse: every wheel the image installs, for a
# build without a package index; base-image: Debian 12 + Python 3.11 from apt's mirror with
# debootstrap (root), for a build without an image registry; image: docker/build.sh (BuildKit),
# from the wheelhouse when there is one. IMAGE, BASE_IMAGE, TORCH_PIP_ARGS and EXTRA_CA pass through.
IMAGE      ?= fedsplit:latest
BASE_IMAGE ?= python:3.11-slim
EXTRA_CA   ?=

wheelhouse:
	PYTHON=$(PYTHON) docker/wheelhouse.sh wheelhouse

base-image:
	docker/base-image.sh fedsplit-base:bookworm

image:
	docker/build.sh -t $(IMAGE) --base-image $(BASE_IMAGE) $(if $(EXTRA_CA),--extra-ca $(EXTRA_CA))
