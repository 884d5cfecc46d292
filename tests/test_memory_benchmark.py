"""benchmarks/memory.py's torch peer row and memory cap: the cap's fraction, the peer's fallback to a smaller batch
after an out-of-memory error, and (where torch, torchao and transformers import) the peer trained at a toy size."""

import argparse
import math
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import memory  # noqa: E402


def _args(**overrides):
    return argparse.Namespace(**{**dict(small=True, steps=1, warmup=1, memory_limit_gb=None), **overrides})


def test_memory_fraction():
    assert memory.memory_fraction(80, 150_000_000_000) == pytest.approx(80 / 150)
    assert memory.memory_fraction(80, 80_000_000_000) == 1.0
    with pytest.raises(ValueError, match="exceeds the GPU's 79.0 GB"):
        memory.memory_fraction(80, 79_000_000_000)
    with pytest.raises(ValueError, match="must be > 0"):
        memory.memory_fraction(0, 80_000_000_000)


def _fake_child(batches, fits):
    """A stand-in for memory.run_child: records each call's batch; batches above `fits` run out of memory."""
    def run(row, argv):
        batch = int(next(a for a in argv if a.startswith("--batch=")).split("=")[1])
        batches.append(batch)
        if batch > fits:
            return dict(row=row, error="OutOfMemoryError: CUDA out of memory", oom=True)
        return dict(row=row, tokens_per_s=123.0, peak_gb=70.0, limit_gb=80.0, compile=True, torch="t", torchao="a")
    return run


def test_peer_halves_the_batch_after_out_of_memory(monkeypatch):
    batches = []
    monkeypatch.setattr(memory, "run_child", _fake_child(batches, fits=1))
    monkeypatch.setitem(memory.PEER_ROWS, "8b_torch", ("8b", 4, 2048))
    result = memory.run_peer("8b_torch", _args(small=False, memory_limit_gb=80))
    assert batches == [4, 2, 1]
    assert result["batch"] == 1 and result["tokens_per_s"] == 123.0 and len(result["failed"]) == 2
    report = memory.table([result], _args(memory_limit_gb=80))
    assert "| 8b_torch | 8b | torch bf16 | torchao AdamW8bit | bf16 + SR | True | 1 x 2048 | 123 |" in report
    assert "8b_torch did not fit at batch 4: OutOfMemoryError" in report and "capped at 80 GB" in report

    batches.clear()  # not even batch 1 fits: the row reports the error
    monkeypatch.setattr(memory, "run_child", _fake_child(batches, fits=0))
    result = memory.run_peer("8b_torch", _args(small=False))
    assert batches == [4, 2, 1] and result["error"].startswith("OutOfMemoryError") and result["batch"] == 1
    assert "| 1 x 2048 | failed: OutOfMemoryError" in memory.table([result], _args())


def _torch_python():
    python = os.environ.get("QJAX_TORCH_PYTHON") or sys.executable
    probe = subprocess.run([python, "-c", "import torch, torchao, transformers"], capture_output=True)
    return python if probe.returncode == 0 else None


@pytest.mark.skipif(_torch_python() is None, reason="torch, torchao or transformers does not import (CI); set "
                    "QJAX_TORCH_PYTHON to an interpreter that has them")
def test_peer_trains_the_tiny_preset():
    result = memory.run_peer("8b_torch", _args())
    assert "error" not in result, result.get("error")
    assert result["size"] == "tiny" and result["batch"] == 2 and result["seq"] == 64 and not result["failed"]
    assert result["tokens_per_s"] > 0 and math.isfinite(result["loss_first"]) and math.isfinite(result["loss_last"])
    assert "OptimState8bit" in result["state_types"]  # torchao's 8-bit states, not a float fallback
    assert "| 8b_torch | tiny | torch bf16 |" in memory.table([result], _args())
