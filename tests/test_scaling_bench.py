"""benchmarks/scaling.py's row names, its model-FLOPs count (NeMo's), the profile's categories
(benchmarks/profile_train.py) and a run on two CPU host devices with row options."""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import profile_train  # noqa: E402
import scaling  # noqa: E402

from qjax.models import llama_config  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_rows_take_a_gather_and_model_options():
    assert scaling.parse_row("int8_rowwise") == ("int8_rowwise", "8bit", ())
    assert scaling.parse_row("bf16") == ("bf16", "bf16", ())
    assert scaling.parse_row("int8_rowwise:bf16:lm_head_8bit") == ("int8_rowwise", "bf16", ("lm_head_8bit",))
    assert scaling.parse_row("fp8_tensorwise:smooth_swiglu") == ("fp8_tensorwise", "8bit", ("smooth_swiglu",))
    for bad in ("int4_rowwise", "int8_rowwise:fp4", "int8_rowwise:lm_head_8bit:bf16"):
        with pytest.raises(Exception, match="use RECIPE\\[:GATHER\\]\\[:OPTION...\\]"):
            scaling.parse_row(bad)


def test_nemo_flops_per_token_of_llama3_8b_at_seq_8192_is_51_5_g():
    # NeMo's published 744 TFLOP/s per GPU at 14,451 tokens/s per GPU: 51.5 GFLOP per token
    flops = scaling.nemo_flops_per_token(llama_config("8b"), 8192)
    assert abs(flops / 1e9 - 51.5) < 0.05, flops / 1e9
    assert abs(14_451 * flops / 1e12 - 744) < 1


def test_profile_categories_per_step_and_idle_time():
    # (start us, duration us, hlo op, kernel) over 2 steps: a GEMM, a Pallas kernel, a fusion; 30 us idle in all
    events = [(0.0, 100.0, "dot.1", "nvjet_gemm"), (110.0, 40.0, "q.2", "mosaic_gpu_quantize"),
              (150.0, 60.0, "fusion.3", "loop_fusion"), (230.0, 100.0, "dot.1", "nvjet_gemm")]
    got = profile_train.category_ms(events, steps=2)
    assert got == pytest.approx({"gemm (cuBLAS, XLA Triton)": 0.1, "pallas": 0.02, "xla fusion / other": 0.03,
                                 "idle": 0.015})


def test_runs_on_two_cpu_devices_with_row_options():
    out = subprocess.run([sys.executable, "benchmarks/scaling.py", "--size", "tiny", "--cpu-devices", "2", "--rows",
                          "bf16", "int8_rowwise:lm_head_8bit", "--steps", "1", "--warmup", "1", "--no-record"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 1 x 2 x 1 |")]
    assert [row.split(" | ")[1:3] for row in rows] == [["bf16", "bf16"], ["int8_rowwise:lm_head_8bit", "8bit"]]
    assert "failed" not in out.stdout
