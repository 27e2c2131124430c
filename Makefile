# fedsplit: the two commands a newcomer needs are `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.fedsplit-installed

.PHONY: setup demo test test-fast test-containers lint bench clean wheelhouse base-image image

setup: $(STAMP)

# torch 2.13.0 is installed first: its CPU wheel where one is provided, the platform's default
# build elsewhere. A GPU site installs its CUDA build of torch 2.13 before running this.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "fedsplit needs Python >= 3.11: run make PYTHON=python3.11 ...")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0 || $(BIN)/python -m pip install --quiet "torch>=2.13.0,<3"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	# openmined-psi without its dependencies: its exact protobuf pin breaks Flower's gRPC stack
	$(BIN)/python -m pip install --quiet --no-deps "openmined-psi==2.0.6"
	# the streamed aggregation kernels (C, cffi): built now rather than by the first aggregation;
	# without a C compiler this says why and the passes stay in numpy
	-$(BIN)/python -c 'from fedsplit.aggregation._ckernels import main; raise SystemExit(main())'
	touch $(STAMP)

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
test: setup
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadgroup
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -m slow

test-fast: setup
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadgroup

# The compose federation in real containers (also part of `make test`; needs a Docker engine).
test-containers: setup
	$(BIN)/python -m pytest -q -m containers tests/containers

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
