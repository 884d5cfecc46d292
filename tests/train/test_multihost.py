"""docs/distributed.md's multi-host recipe, on this machine: two `train.py` processes joined by `jax.distributed` (a
local coordinator, gloo collectives on the CPU), one CPU device each, FSDP over both. They compute bit for bit what
one process with two host devices computes, write one checkpoint together, and one process resumes from it.

Each run is a subprocess: the device count (XLA_FLAGS) and the distributed client are fixed when jax starts.
"""

import json
import os
import pathlib
import socket
import subprocess

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from qjax.train import mesh as mesh_lib
from train_helpers import tiny_llama_command

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS, SPLIT = 6, 4  # the two processes run steps 1-4 of a 6-step run; one process resumes for steps 5-6
TIMEOUT_S = 420  # generous: this machine's 2 cores are shared; each run takes ~10-30 s alone


def _command(workdir, token_dir, *extra):
    return tiny_llama_command(workdir, token_dir, "--config.batch_size=8", "--config.seq_len=32",
                              f"--config.steps={STEPS}", "--config.optimizer.warmup_steps=1", "--config.log_every=1",
                              "--config.eval_every=2", "--config.eval_batches=1", "--config.checkpoint_every=2",
                              "--config.keep_checkpoints=2", "--config.mesh.fsdp=2",
                              "--config.health_every=3", *extra)  # step 3 measures health in the two processes


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROC"))}
    return {**env, "JAX_PLATFORMS": "cpu", **extra}


def _one_process_env():
    return _env(XLA_FLAGS="--xla_force_host_platform_device_count=2")  # fsdp=2 over two host devices


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(command, env, log):
    with open(log, "w") as out:  # a file, not a pipe: a full pipe would stall the run
        return subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def _wait_all(procs: dict) -> None:
    """Waits for every process (killed at the timeout); asserts each exited 0, showing its log's tail if not."""
    try:
        for proc in procs.values():
            proc.wait(timeout=TIMEOUT_S)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for log, proc in procs.items():
        assert proc.returncode == 0, f"{log.name} exited {proc.returncode}:\n{log.read_text()[-3000:]}"


def _metrics(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _losses(rows):
    """(step, "loss" or "eval_loss", value) of each row, in file order."""
    return [(r["step"], key, r[key]) for r in rows for key in ("loss", "eval_loss") if key in r]


def _assert_close(got, want):
    """The same (step, kind) rows, values equal to float32 rounding."""
    assert [row[:2] for row in got] == [row[:2] for row in want], (got, want)
    np.testing.assert_allclose([row[2] for row in got], [row[2] for row in want], rtol=1e-5)


# Parameters may differ by far less than one AdamW step (lr 2e-3 per element): an ulp-level difference between the
# two programs can move one int8 rounding, which changes that gradient element by one code, not the run.
PARAM_ATOL = 2e-5


def _assert_same_checkpoint(got, want):
    assert len(got) == len(want) > 10
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=PARAM_ATOL)


def _checkpoint(workdir, step):
    """The arrays of checkpoint `step`, read onto this (one-device) process whatever mesh wrote them."""
    path = workdir / "checkpoints" / str(step) / "default"
    checkpointer = ocp.StandardCheckpointer()
    tree = checkpointer.metadata(path).item_metadata.tree
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), tree)
    return [np.asarray(x) for x in jax.tree.leaves(checkpointer.restore(path, target))]


def test_two_processes_train_as_one_and_one_process_resumes(token_dir, tmp_path):
    shared, whole = tmp_path / "two_processes", tmp_path / "one_process"
    address = f"127.0.0.1:{_free_port()}"
    procs = {tmp_path / f"process{i}.log": _start(
                 _command(shared, token_dir, f"--stop_at={SPLIT}"),
                 _env(JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)),
                 tmp_path / f"process{i}.log")
             for i in range(2)}
    # The reference (one process, two host devices, never interrupted) runs meanwhile.
    procs[tmp_path / "whole.log"] = _start(_command(whole, token_dir), _one_process_env(), tmp_path / "whole.log")
    _wait_all(procs)

    logs = {i: (tmp_path / f"process{i}.log").read_text() for i in range(2)}
    assert "2 cpu devices (data x fsdp x tensor = 1 x 2 x 1)" in logs[0], logs[0][-2000:]
    assert f"step {SPLIT}/{STEPS}" in logs[0] and "step 1/" not in logs[1], logs[1][-2000:]  # process 0 prints
    reference = _losses(_metrics(whole))
    # Process 0 alone wrote metrics.jsonl (one row per step and kind); FSDP over two processes computes what FSDP
    # over two devices of one process does. Usually bit for bit, but in the full suite's runs the two programs were
    # once 1 ulp apart (a cross-process reduction may be compiled differently): equal to float32 rounding.
    _assert_close(_losses(_metrics(shared)), [row for row in reference if row[0] <= SPLIT])
    assert [r["step"] for r in _metrics(shared) if "health_saturation_max" in r and "loss" not in r] == [3]
    # One checkpoint, written by both processes (each its shards), equal to the one-process run's.
    written = shared / "checkpoints" / str(SPLIT) / "default"
    assert (written / "ocdbt.process_0").is_dir() and (written / "ocdbt.process_1").is_dir(), os.listdir(written)
    _assert_same_checkpoint(_checkpoint(shared, SPLIT), _checkpoint(whole, SPLIT))

    resumed = subprocess.run(_command(shared, token_dir), env=_one_process_env(), cwd=ROOT, capture_output=True,
                             text=True, timeout=TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert f"resumed at step {SPLIT}" in resumed.stdout, resumed.stdout[-2000:]
    _assert_close(_losses(_metrics(shared)), reference)
    _assert_same_checkpoint(_checkpoint(shared, STEPS), _checkpoint(whole, STEPS))


def test_coordinator_without_process_count_is_one_line_error(monkeypatch):
    """JAX_COORDINATOR_ADDRESS alone (no SLURM / Open MPI to fill in the rest): an error naming the two missing
    variables, before jax.distributed would stop with "Number of processes must be defined"."""
    for name in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES and JAX_PROCESS_ID"):
        mesh_lib.initialize_distributed()
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "first")
    with pytest.raises(ValueError, match="JAX_PROCESS_ID='first' must be an integer"):
        mesh_lib.initialize_distributed()
