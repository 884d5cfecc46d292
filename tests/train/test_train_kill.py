"""A `train.py` process killed (SIGKILL) mid-run and started again ends with exactly the parameters, optimizer state
and RNG of a run that was never interrupted."""

import json
import os
import pathlib
import signal
import subprocess
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from train_helpers import tiny_llama_command

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS, EVERY = 3000, 500  # long enough (seconds on a CPU) that the kill lands between two checkpoints


def _command(workdir, token_dir):
    return tiny_llama_command(workdir, token_dir, "--config.batch_size=4", "--config.seq_len=32",
                              f"--config.steps={STEPS}", "--config.optimizer.warmup_steps=10",
                              "--config.optimizer.name=adamw_8bit", "--config.log_every=250", "--config.eval_every=0",
                              f"--config.checkpoint_every={EVERY}", "--config.keep_checkpoints=2")


def _env():
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def _saved_steps(workdir):
    directory = workdir / "checkpoints"
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.exists() else []


def _final_state(workdir):
    leaves = jax.tree.leaves(ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(STEPS) / "default"))
    return [np.asarray(x) for x in leaves]


def test_killed_run_restarts_to_the_uninterrupted_result(token_dir, tmp_path):
    killed = tmp_path / "killed"
    log = tmp_path / "killed.log"  # a file, not a pipe: a full pipe would stall the run
    with open(log, "w") as out:
        proc = subprocess.Popen(_command(killed, token_dir), env=_env(), cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while not _saved_steps(killed) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        running = proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert running, f"the run ended before it could be killed (raise STEPS): {log.read_text()[-2000:]}"
    at_kill = _saved_steps(killed)
    assert at_kill and at_kill[-1] < STEPS, at_kill

    restarted = subprocess.run(_command(killed, token_dir), env=_env(), cwd=ROOT, capture_output=True, text=True,
                               timeout=300)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    resumed_at = max(s for s in at_kill)
    assert f"resumed at step {resumed_at}" in restarted.stdout, restarted.stdout[-2000:]
    rows = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == list(range(250, STEPS + 1, 250)), steps  # rows the killed run wrote after its checkpoint: dropped

    whole = tmp_path / "whole"
    uninterrupted = subprocess.run(_command(whole, token_dir), env=_env(), cwd=ROOT, capture_output=True, text=True,
                                   timeout=300)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    got, want = _final_state(killed), _final_state(whole)
    assert len(got) == len(want) > 10
    for a, b in zip(got, want):  # params, 8-bit Adam states, step, RNG key: bit for bit
        np.testing.assert_array_equal(a, b)
