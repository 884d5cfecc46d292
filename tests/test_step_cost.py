"""benchmarks/option_cost.py and health_cost.py: the interleaved timing they share (common.interleaved_ms), the
paired cost, and a run of each on the tiny model on a CPU."""

import os
import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import common  # noqa: E402
import option_cost  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_interleaved_ms_alternates_the_order_every_round():
    calls = []
    fns = {name: (lambda name=name: calls.append(name) or 0) for name in ("a", "b")}
    samples = common.interleaved_ms(fns, warmup=1, rounds=3, inner=2)
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] + ["b", "b", "a", "a"] + ["a", "a", "b", "b"]
    assert {name: len(times) for name, times in samples.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for times in samples.values() for t in times)


def test_paired_cost_pairs_each_round():
    median, low, high = option_cost.paired_cost([100.0, 110.0, 90.0], [101.0, 112.2, 90.0])
    assert (round(median, 6), round(low, 6), round(high, 6)) == (1.0, 0.0, 2.0)
    with pytest.raises(ValueError):
        option_cost.paired_cost([1.0, 2.0], [1.0])


@pytest.mark.parametrize("script, argv, row, columns", [
    ("option_cost.py", ["--rows", "int8_rowwise:smooth_swiglu"], "| int8_rowwise:smooth_swiglu |", 5),
    ("health_cost.py", ["--recipes", "int8_rowwise"], "| int8_rowwise |", 6),
])
def test_runs_on_the_tiny_model(script, argv, row, columns):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, f"benchmarks/{script}", *argv, "--small", "--rounds", "2", "--steps", "1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert any(line.startswith(row) and line.count("|") == columns + 1 for line in out.stdout.splitlines()), out.stdout


def test_a_row_without_an_option_is_refused():
    out = subprocess.run([sys.executable, "benchmarks/option_cost.py", "--rows", "fp8_rowwise", "--small"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "names no option: write RECIPE:OPTION" in out.stderr
