# lossless_hc: the two commands a new user needs are `make demo` and `make test`.
# Both create .venv on first use (torch CPU 2.13.0, Horovod 0.28.1 built with Gloo and MPI, the package
# built in editable mode) and are idempotent: a second run only rebuilds the extension when its sources
# changed. The Horovod wheel is cached in $(LHC_CACHE) (default ~/.cache/lossless_hc), outside the repo.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU build by its local version label: a plain "torch==2.13.0" would take PyPI's CUDA build (GBs of
# nvidia-* wheels) on a machine whose pip reaches PyPI. Where pip has no local wheel of it, name the CPU
# index: `make test TORCH_INDEX=https://download.pytorch.org/whl/cpu`.
TORCH_VERSION := 2.13.0+cpu
TORCH_INDEX ?=
TORCH_PIP_ARGS := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
# The stamp records that set-up finished; it depends on the files that define the environment.
STAMP  := $(VENV)/.setup-done
EXT_SOURCES := $(wildcard csrc/*.h csrc/*.cpp csrc/cpu/*.cpp csrc/cpu/*.h csrc/cuda/*.cu csrc/cuda/*.cuh csrc/cuda/*.h \
                 csrc/cuda/*.cpp) setup.py
# nvcc present: `make build` also builds lossless_hc._C_cuda, and `make test` compiles the CUDA sources.
NVCC := $(shell command -v nvcc 2>/dev/null || (test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc))

.PHONY: setup build demo test sanitize cuda-check bench clean

setup: $(STAMP) build

$(STAMP): requirements-dev.txt scripts/setup_horovod.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first and pinned, so nothing else can pull a CUDA build of several GB.
	$(PIP) install --quiet $(TORCH_PIP_ARGS) "torch==$(TORCH_VERSION)"
	$(PIP) install --quiet $(TORCH_PIP_ARGS) -r requirements-dev.txt "torch==$(TORCH_VERSION)"
	# Horovod 0.28.1 patched to C++17 (PyTorch, Gloo, MPI); minutes the first time, then from the cache.
	bash scripts/setup_horovod.sh $(PY)
	touch $@

# Editable install; --no-build-isolation reuses the venv's pybind11/setuptools (no network, no torch re-resolve).
build: $(STAMP) lossless_hc/_C.stamp

lossless_hc/_C.stamp: $(EXT_SOURCES) $(STAMP)
	$(PIP) install --quiet --no-build-isolation --no-deps -e .
	touch $@

# Two Horovod workers train the NCF recommender with and without Compression.lossless, side by side.
demo: setup
	$(PY) -m lossless_hc.bench train

# The whole suite, then the codec tests and the planner's DDP workers against an ASan/UBSan build, then (when
# nvcc is present) the compile check of the CUDA sources. The GPU tests skip here: run `pytest -m gpu`
# on a GPU machine (scripts/gpu_session.sh).
# The single-process tests run on TEST_JOBS pytest-xdist workers; OpenMP's waiting threads sleep instead
# of spinning (OMP_WAIT_POLICY=passive), so that two workers' kernels can share the cores. The
# multi-process tests run one at a time: their ranks already fill the cores.
TEST_JOBS ?= 2
export TEST_JOBS
test: setup
	OMP_WAIT_POLICY=passive $(PY) -m pytest -q -n $(TEST_JOBS) -m "not multiprocess" tests
	$(PY) -m pytest -q -m multiprocess tests
	bash scripts/sanitize.sh
ifneq ($(NVCC),)
	bash scripts/cuda_check.sh
endif

# Compile every CUDA source for sm_80 and sm_90 (nvcc), the CUDA bindings, and the kernels through
# NVRTC (the CuPy path). Needs no GPU.
cuda-check: $(STAMP)
	bash scripts/cuda_check.sh

sanitize: $(STAMP)
	# ASan/UBSan build of the extension in a separate build dir; the codec tests and the planner's DDP workers run against it.
	bash scripts/sanitize.sh

bench: setup
	$(PY) -m lossless_hc.bench codec --numel 67108864 --density 0.01 --workers 8

clean:
	rm -rf build build-cuda-check build-sanitize lossless_hc/_C*.so lossless_hc/_C.stamp *.egg-info
