"""benchmarks/reproducibility.py: on a CPU one compiled train step, run twice over the same batches from the same
init, gives bit-identical losses (what docs/training.md's resume guarantee rests on), and the comparison finds a
difference where there is one."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import reproducibility  # noqa: E402
from configs import llama_base  # noqa: E402


def tiny_config(recipe):
    config = llama_base.get_config()
    config.model.size, config.recipe = "tiny", recipe
    config.batch_size, config.seq_len, config.steps = 2, 32, 100
    return config


def test_a_cpu_step_run_twice_is_bit_identical():
    first, second, same_params, seconds = reproducibility.repeat_run(tiny_config("int8_rowwise"), steps=4)
    assert len(first) == 4 and first == second and same_params and seconds > 0
    assert first[0] != first[-1]  # the steps trained: a stuck run would compare equal trivially
    assert reproducibility.compare(first, second) == (None, 0.0)


def test_compare_names_the_first_step_that_differs():
    first, second = [3.0, 2.5, 2.0, 1.5], [3.0, 2.5, 2.0 * (1 + 1e-6), 1.6]
    differ, drift = reproducibility.compare(first, second)
    assert differ == 3 and abs(drift - 0.1 / 1.5) < 1e-12
    nan = float("nan")
    assert reproducibility.compare([3.0, nan], [3.0, nan]) == (None, 0.0)  # diverged alike: the same
    assert reproducibility.compare([3.0, nan], [3.0, 2.0])[0] == 2


@pytest.mark.parametrize("argv, error", [
    (["--recipes", "int8_rowwise", "int4_rowwise"], "unknown recipe in 'int4_rowwise': use one of .*int8_rowwise"),
    (["--recipes", "bf16:smooth"], "unknown option 'smooth' in 'bf16:smooth': use any of .*:smooth_swiglu"),
    (["--steps", "0"], "--steps 0: use 1 or more"),
])
def test_bad_arguments_are_one_line_errors(monkeypatch, argv, error):
    monkeypatch.setattr(sys, "argv", ["reproducibility.py", *argv])
    with pytest.raises(SystemExit, match=error):
        reproducibility.main()
