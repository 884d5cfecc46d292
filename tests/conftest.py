"""Shared test setup: GPU-marked tests run only where a GPU is the default backend; on the CPU, XLA compiles at -O0
and compiled programs are cached across the test processes."""

import os

# The CPU suite's time is mostly XLA:CPU compiling small programs once each: LLVM at -O0 compiles them about a third
# faster, and the programs are too small for optimised code to pay off. Set before jax creates its backend (XLA
# reads XLA_FLAGS once); subprocesses inherit it. GPU runs keep XLA's default.
if os.environ.get("JAX_PLATFORMS") == "cpu" and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
# Many tests compile the same programs: every train.py subprocess of one config, each resume of a run, the README's
# commands. A persistent compilation cache (git-ignored .jax_cache/, shared by the xdist workers and the subprocesses
# they start) compiles each once; a cached executable computes what a fresh compile does. The size cap turns on
# jax's file lock, so that a worker never reads an entry another is still writing.
if os.environ.get("JAX_PLATFORMS") == "cpu":
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), ".jax_cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))

import jax  # noqa: E402
import pytest  # noqa: E402

import slow_tier  # noqa: E402


def pytest_collection_modifyitems(config, items):
    slow_tier.mark(items)
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, config):
    """Says what `-m "not slow"` left out, so that a default run never reads as the whole suite. (Under xdist the
    workers deselect, so the count is of slow_tier's entries, not of test cases.)"""
    if "not slow" in (config.option.markexpr or ""):
        functions = sum(map(len, slow_tier.SLOW_TESTS.values()))
        terminalreporter.write_line(
            f"not run here: the slow tier, {len(slow_tier.SLOW_FILES)} files and {functions} test functions of "
            "tests/slow_tier.py (some keep their first case here) and the docs/ commands (`make test-slow` runs them)")
