"""Ctrl-C (SIGINT) or SIGTERM to a running `train.py`: the step in flight finishes and is saved, one line names the
step, the exit status is 130 / 143, and re-running the same command ends bit-identical to a run never interrupted.
A second signal exits at once without saving."""

import json
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

import pytest
from test_train_kill import ROOT, _env, _saved_steps
from train_helpers import tiny_llama_command

STEPS = 400  # a second or two on a CPU: the signal lands mid-run


def _command(workdir, token_dir, *extra):
    """train.py on a tiny Llama with checkpoints only at the end (and on a signal), no eval."""
    return tiny_llama_command(workdir, token_dir, "--config.batch_size=4", "--config.seq_len=32",
                              f"--config.steps={STEPS}", "--config.optimizer.warmup_steps=10",
                              "--config.optimizer.name=adamw_8bit", "--config.log_every=10", "--config.eval_every=0",
                              "--config.checkpoint_every=0", *extra)


@pytest.fixture(scope="module")
def env():
    """The runs' environment (a CPU; tests/conftest.py's compilation cache saves each start ~10 s), with SIGINT's
    default action: a shell's background job starts with SIGINT ignored, which its children would inherit."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a Python handler is reset to SIG_DFL at exec
    return _env()


def _state(workdir, step):
    leaves = jax.tree.leaves(ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / "default"))
    return [np.asarray(x) for x in leaves]


def _start_and_signal(argv, env, log, signum):
    """Starts `argv` with stdout into `log`, sends `signum` once a progress line is printed; (returncode, stderr)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while "\nstep " not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, f"the run ended before the signal: {log.read_text()[-2000:]}"
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def test_signals_save_the_step_and_the_rerun_ends_bit_identical(token_dir, tmp_path, env):
    """SIGINT, then SIGTERM on the resumed run, then a run to the end: the same state as one uninterrupted run."""
    workdir = tmp_path / "run"
    saved = []
    for signum, code, what in [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "stopped by SIGTERM")]:
        returncode, err = _start_and_signal(_command(workdir, token_dir), env, tmp_path / "log", signum)
        if saved:
            assert f"resumed at step {saved[-1]}," in (tmp_path / "log").read_text()
        assert returncode == code, err
        match = re.fullmatch(rf"{what} at step (\d+); checkpoint saved; re-run the same command to resume\n", err)
        assert match, err  # one line: no traceback, no "terminate called without an active exception"
        step = int(match.group(1))
        assert (saved[-1] if saved else 0) < step < STEPS, (saved, step)
        saved.append(step)
        assert _saved_steps(workdir)[-1] == step  # checkpoint_every=0: the signal's save

    rerun = subprocess.run(_command(workdir, token_dir), env=env, cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed at step {saved[-1]}," in rerun.stdout, rerun.stdout[-2000:]
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(10, STEPS + 1, 10))  # each log point once

    whole = tmp_path / "whole"
    uninterrupted = subprocess.run(_command(whole, token_dir), env=env, cwd=ROOT, capture_output=True, text=True,
                                   timeout=300)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    got, want = _state(workdir, STEPS), _state(whole, STEPS)
    assert len(got) == len(want) > 10
    for a, b in zip(got, want):  # params, 8-bit Adam states, step, RNG key: bit for bit
        np.testing.assert_array_equal(a, b)


# Runs train.py with Checkpointer.save sending the process a second SIGINT and then taking 60 s (a slow save): the
# second signal must end the process at once, before that save writes anything.
_SLOW_SAVE = """
import os, runpy, signal, sys, time
sys.argv = sys.argv[1:]  # train.py and its flags
sys.path.insert(0, os.path.dirname(sys.argv[0]))  # as `python train.py` has it: this checkout's qjax and configs
from qjax.train import checkpoint
def save(self, step, state, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(60)
    raise AssertionError("the second SIGINT did not end the process")
checkpoint.Checkpointer.save = save
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_second_sigint_during_the_save_exits_at_once_without_saving(token_dir, tmp_path, env):
    script = tmp_path / "slow_save.py"
    script.write_text(_SLOW_SAVE)
    argv = [sys.executable, str(script), *_command(tmp_path / "run", token_dir)[1:]]
    start = time.monotonic()
    returncode, err = _start_and_signal(argv, env, tmp_path / "log", signal.SIGINT)
    assert time.monotonic() - start < 50, "the second SIGINT waited for the save"
    assert returncode == 130, err
    assert err == ("interrupted again: exiting at once without saving; the newest checkpoint is kept, re-run the same "
                   "command to resume from it\n"), err
    assert _saved_steps(tmp_path / "run") == []


def test_signal_while_starting_up_exits_at_once(token_dir, tmp_path, env):
    """Before the loop there is nothing to save: the signal ends the run at once (it must not be swallowed, as a
    KeyboardInterrupt in one of jax's garbage-collection callbacks would be, letting the run go on)."""
    proc = subprocess.Popen(_command(tmp_path / "run", token_dir), env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # importing jax and qjax (seconds)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err == ("interrupted while no training step was running (starting up, or the run had ended): nothing to "
                   "save\n"), err
    assert not (tmp_path / "run").exists()
