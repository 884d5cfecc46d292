#!/bin/bash
# On the lent GPU machine: install the carried wheels, then run benchmark suites (python -m benchmarks run).
#   here:    echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: \
#              --python-version 3.12 --platform manylinux2014_x86_64 -d .whl torchao==0.17.0 ml_collections==1.1.0 \
#              tensorboardX==2.6.5     (the GPU image lacks these; its tokenizers is the 0.23.2 pyproject.toml pins)
#   device:  QJAX_COMMIT=<local HEAD> bash benchmarks/device.sh e2e linear      (carry [".whl"])
# Results and logs land in $OUT; a suite written SUITE@DIR runs in DIR, an exported tree of another commit
# (git archive REV | tar -x -C DIR), so a before/after pair runs in one call.
set -euo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export QJAX_SITE=/tmp/site PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader || true
exec python3 -m benchmarks run --out "${OUT:-runs/benchmarks}" --budget "${BUDGET:-570}" "$@"
