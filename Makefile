# make test   create .venv (Python 3.12) on first use and run the CPU test suite
# make bench  create .venv on first use and run the linear benchmark on whatever device is present
#             (the main job until train.py exists; on a GPU machine the jax CUDA 13 plugin is installed too)

VENV := .venv
PY := $(VENV)/bin/python
PYTHON312 ?= $(shell command -v python3.12 2>/dev/null || ls -d $(HOME)/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)
EXTRAS ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo dev,cuda13 || echo dev)

.PHONY: test bench clean

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON312)" || { echo "Python 3.12 not found: install it (pyenv install 3.12) or pass PYTHON312=/path/to/python3.12"; exit 1; }
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

test: $(VENV)/.installed
	JAX_PLATFORMS=cpu $(PY) -m pytest -n 2

bench: $(VENV)/.installed
	$(PY) benchmarks/linear.py

clean:
	rm -rf $(VENV)
