"""Shared test setup: GPU-marked tests run only where a GPU is the default backend; on the CPU, XLA compiles at -O0."""

import os

# The CPU suite's time is mostly XLA:CPU compiling small programs once each: LLVM at -O0 compiles them about a third
# faster, and the programs are too small for optimised code to pay off. Set before jax creates its backend (XLA
# reads XLA_FLAGS once); subprocesses inherit it. GPU runs keep XLA's default.
if os.environ.get("JAX_PLATFORMS") == "cpu" and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
