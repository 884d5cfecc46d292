"""train(): losses fall, metrics and checkpoints are written, a resumed run is bit-identical, accumulation is exact."""

import copy
import io
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from train_helpers import tiny_llama_config, tiny_vit_config

from qjax.train import loop, train
from qjax.train.stopping import Interrupted


def _bits(tree):
    return [np.asarray(x).reshape(-1).view(np.uint8) for x in jax.tree.leaves(tree)]


def _records(workdir):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]


def _checkpoints(workdir):
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir())


def _check_resume(config, tmp_path, whole, stop_at, kill_after=None):
    """Runs `config` to `stop_at`, optionally deletes checkpoints after `kill_after` (a run killed between two
    saves), restarts it in the same workdir and checks that it ends bit-identical to the uninterrupted `whole`."""
    pieces = tmp_path / "pieces"
    first = train(config, pieces, stop_at=stop_at, stream=io.StringIO())
    assert int(first.state.step) == stop_at and _checkpoints(pieces)[-1] == stop_at
    if kill_after is not None:
        for step in _checkpoints(pieces):
            if step > kill_after:
                shutil.rmtree(pieces / "checkpoints" / str(step))
    out = io.StringIO()
    resumed = train(config, pieces, stream=out)
    assert f"resumed at step {kill_after or stop_at}" in out.getvalue()
    assert int(resumed.state.step) == config.steps
    assert jax.tree.structure(resumed.state) == jax.tree.structure(whole.state)
    for a, b in zip(_bits(resumed.state), _bits(whole.state)):  # params, optimizer state, step, key
        np.testing.assert_array_equal(a, b)
    assert resumed.train_metrics["loss"] == whole.train_metrics["loss"]
    assert resumed.eval_metrics == {**whole.eval_metrics, "time": resumed.eval_metrics["time"]}
    train_rows, eval_rows = _records(pieces)
    assert train_rows[-1]["step"] == config.steps  # the restart appended to the same metrics file
    # One row per step: the rows written after the restored checkpoint (kill_after) were dropped on resume (the
    # first piece also logged its last step, stop_at, which the uninterrupted run may not have).
    for rows, whole_rows in zip((train_rows, eval_rows), _records(tmp_path / "whole")):
        steps = [r["step"] for r in rows]
        assert steps == sorted(set(steps)) and {r["step"] for r in whole_rows} <= set(steps), steps


def test_llama_int8_run_falls_and_resumes_bit_identically(token_dir, tmp_path):
    # Quantized GEMMs, 8-bit Adam states and gradient accumulation together.
    config = tiny_llama_config(token_dir, steps=12, recipe="int8_rowwise", grad_accum_steps=2, checkpoint_every=4)
    config.optimizer.name = "adamw_8bit"
    whole = train(config, tmp_path / "whole", stream=io.StringIO())
    train_rows, eval_rows = _records(tmp_path / "whole")
    assert [r["step"] for r in train_rows] == [2, 4, 6, 8, 10, 12]
    assert [r["step"] for r in eval_rows] == [3, 6, 9, 12]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 0.5, [r["loss"] for r in train_rows]
    assert eval_rows[-1]["eval_loss"] < eval_rows[0]["eval_loss"]
    assert all(r["throughput"] > 0 and r["lr"] > 0 for r in train_rows[1:])
    assert _checkpoints(tmp_path / "whole") == [8, 12]  # keep_checkpoints=2, no temporary directories left
    assert json.loads((tmp_path / "whole/config.json").read_text())["recipe"] == "int8_rowwise"
    # Killed at step 9: the newest checkpoint (8) was saved mid-run, asynchronously, before later steps donated
    # the state's buffers, so this also checks that saving copies the arrays first.
    _check_resume(config, tmp_path, whole, stop_at=10, kill_after=8)


def test_bf16_params_with_stochastic_rounding_train_and_resume_bit_identically(token_dir, tmp_path):
    # No float32 master copy: params live in bfloat16 and each update is rounded with the step's own key, so a
    # resumed run replays the same roundings.
    config = tiny_llama_config(token_dir, steps=8, checkpoint_every=4)
    config.model.param_dtype = "bfloat16"
    config.optimizer.stochastic_rounding = True
    whole = train(config, tmp_path / "whole", stream=io.StringIO())
    assert {leaf.dtype for leaf in jax.tree.leaves(whole.state.params)} == {np.dtype("bfloat16")}
    train_rows, _ = _records(tmp_path / "whole")
    assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 0.3, [r["loss"] for r in train_rows]
    _check_resume(config, tmp_path, whole, stop_at=4)


def test_vit_run_falls_resumes_bit_identically_and_stops_on_nan(tmp_path):
    config = tiny_vit_config(steps=12, log_every=4, checkpoint_every=0)
    config.optimizer.lr = 1e-2
    whole = train(config, tmp_path / "whole", stream=io.StringIO())
    train_rows, _ = _records(tmp_path / "whole")
    assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 0.2, [r["loss"] for r in train_rows]
    assert 0.0 <= whole.eval_metrics["eval_accuracy"] <= 1.0 and whole.eval_metrics["step"] == 12
    assert _checkpoints(tmp_path / "whole") == [12]  # checkpoint_every=0: only at the end
    _check_resume(config, tmp_path, whole, stop_at=5)
    _check_nan_stops_the_run(config, tmp_path / "nan")


def _check_nan_stops_the_run(config, workdir):
    """A NaN batch at step index 1 makes step 2's loss NaN; step 2 is a checkpoint step (not a log step), so
    train() must raise there instead of saving the NaN state."""
    config = copy.deepcopy(config)
    config.checkpoint_every = 2
    real_make_dataset = loop.make_dataset

    def poisoned(config):
        dataset = real_make_dataset(config)
        clean_batch = dataset.batch

        def batch(step):
            out = clean_batch(step)
            if step == 1:
                out["images"] = np.full_like(out["images"], np.nan)
            return out

        dataset.batch = batch
        return dataset

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "make_dataset", poisoned)
        assert config.log_every != 2
        with pytest.raises(FloatingPointError, match="loss is nan at step 2"):
            train(config, workdir, stream=io.StringIO())
    assert not list((workdir / "checkpoints").iterdir())


_ACCUM_AND_DATA_PARALLEL = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from train_helpers import tiny_llama_config
    from qjax.train import make_mesh, make_task, make_train_step
    assert len(jax.devices()) == 2, jax.devices()
    mesh1, mesh2 = make_mesh(jax.devices()[:1]), make_mesh()
    # float32 compute and a huge eps make the update ~ lr * grad / eps, so parameters compare the gradients.
    config = tiny_llama_config(sys.argv[1], steps=3)
    config.model.compute_dtype = "float32"
    config.optimizer.lr, config.optimizer.eps, config.optimizer.weight_decay, config.optimizer.grad_clip = (
        1.0, 1e3, 0.0, 0.0)
    task = make_task(config, vocab_size=256)
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (config.batch_size, config.seq_len + 1), 0, 256))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    init_state, step_1dev = make_train_step(config, task, mesh1)
    config.grad_accum_steps = 4
    _, step_accum_2dev = make_train_step(config, task, mesh2)
    state = init_state()
    before = jax.tree.map(np.array, state.params)
    on2 = lambda s: jax.device_put(jax.tree.map(jnp.copy, s), jax.sharding.NamedSharding(mesh2, jax.sharding.PartitionSpec()))
    accum_state = on2(state)  # a copy: the steps donate their input state
    ref, m_ref = step_1dev(state, batch)
    accum, m_accum = step_accum_2dev(accum_state, batch)
    assert len(accum.params["embed"]["embedding"].sharding.device_set) == 2  # replicated on both devices
    assert float(m_ref["grad_norm"]) > 0
    np.testing.assert_allclose(m_accum["loss"], m_ref["loss"], rtol=1e-6)
    np.testing.assert_allclose(m_accum["grad_norm"], m_ref["grad_norm"], rtol=1e-5)
    for a, b, p in zip(jax.tree.leaves(accum.params), jax.tree.leaves(ref.params), jax.tree.leaves(before)):
        assert np.any(np.asarray(b) != p), "the step must move every tensor"
        # atol: a few float32 ulps of params near 1 (norm scales); a wrong mean would be off by a factor of 4.
        np.testing.assert_allclose(np.asarray(a) - p, np.asarray(b) - p, rtol=1e-3, atol=3e-7)
    print("ok")
""")


def test_accumulated_data_parallel_step_equals_the_big_batch_step(token_dir):
    """4 accumulated micro-batches, each split over 2 CPU devices' "data" axis, give the single-device big-batch
    update (XLA_FLAGS must be set before jax starts, hence a subprocess)."""
    here = pathlib.Path(__file__).resolve().parent
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "PYTHONPATH": os.pathsep.join([str(here), str(here.parents[1])])}
    result = subprocess.run([sys.executable, "-c", _ACCUM_AND_DATA_PARALLEL, token_dir], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]




def test_checkpoint_of_another_state_layout_gives_a_clear_error(tmp_path):
    """A checkpoint whose tree differs from the run's train state (e.g. the pre-2026-11-23 optimizer state that
    nested grad clipping's empty state) raises a ValueError that says what to do, not only orbax's message."""
    from qjax.train import Checkpointer
    from qjax.train.checkpoint import abstract_like

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    old = {"params": np.zeros(4, np.float32), "opt_state": (np.zeros(1, np.float32), np.ones(4, np.float32))}
    checkpointer = Checkpointer(tmp_path / "ckpt", keep=1)
    checkpointer.save(1, old)
    checkpointer.close()
    new = {"params": np.zeros(4, np.float32), "opt_state": (np.ones(4, np.float32),)}
    with pytest.raises(ValueError, match="does not fit this run's train state.*new workdir"):
        Checkpointer(tmp_path / "ckpt", keep=1).restore_latest(abstract_like(new, sharding))


def test_checkpoint_with_other_dtypes_gives_a_clear_error(tmp_path):
    """Resuming float32 params as bfloat16 (a changed config.model.param_dtype in the same workdir) raises a
    ValueError naming the entry and both dtypes; orbax alone would cast the checkpoint silently."""
    from qjax.train import Checkpointer
    from qjax.train.checkpoint import abstract_like

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    saved = {"params": {"w": np.ones((4, 2), np.float32)}, "step": np.int32(3)}
    checkpointer = Checkpointer(tmp_path / "ckpt", keep=1)
    checkpointer.save(3, saved)
    checkpointer.close()
    resumed = {"params": {"w": np.ones((4, 2), jax.numpy.bfloat16)}, "step": np.int32(0)}
    with pytest.raises(ValueError, match="params/w is float32, this run's is bfloat16.*new workdir"):
        Checkpointer(tmp_path / "ckpt", keep=1).restore_latest(abstract_like(resumed, sharding))
    same = Checkpointer(tmp_path / "ckpt", keep=1).restore_latest(abstract_like(saved, sharding))
    np.testing.assert_array_equal(np.asarray(same["params"]["w"]), saved["params"]["w"])


class _SignalOnLastStep(io.StringIO):
    """A progress stream that sends this process SIGINT when the line of the run's last step is written."""

    def __init__(self, steps: int):
        super().__init__()
        self.line = f"step {steps}/{steps} "

    def write(self, text: str) -> int:
        if text.startswith(self.line):
            os.kill(os.getpid(), signal.SIGINT)
        return super().write(text)


def test_a_signal_during_the_last_step_is_passed_on_once_the_run_has_saved(token_dir, tmp_path):
    config = tiny_llama_config(token_dir, eval_every=0)  # 6 steps
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        result = train(config, tmp_path / "run", stream=_SignalOnLastStep(config.steps))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert int(result.state.step) == 6 and _checkpoints(tmp_path / "run")[-1] == 6  # the run completed and saved
    assert received == [signal.SIGINT]  # then the caller's handler got the signal, once


class _SetAfter:
    """A stop_event whose is_set() turns True on its (n + 1)-th call: the loop asks once before the first step and
    once after each step."""

    def __init__(self, n: int):
        self.calls, self.n = 0, n

    def is_set(self) -> bool:
        self.calls += 1
        return self.calls > self.n


def test_a_set_stop_event_stops_the_run_after_the_step_in_flight_and_saves_it(token_dir, tmp_path):
    config = tiny_llama_config(token_dir, eval_every=0)  # 6 steps, checkpoints every 2
    with pytest.raises(Interrupted, match=r"^stopped by stop_event at step 3; checkpoint saved") as stopped:
        train(config, tmp_path / "run", stop_event=_SetAfter(3))
    assert stopped.value.saved and stopped.value.exit_code == 75
    assert _checkpoints(tmp_path / "run")[-1] == 3
    with pytest.raises(Interrupted, match=r"^stopped by stop_event at step 3; no step ran since the start"):
        train(config, tmp_path / "run", stop_event=_SetAfter(0))  # set before the first step: nothing new to save
    assert train(config, tmp_path / "run").train_metrics["step"] == 6  # the next start resumes at step 3
    with pytest.raises(TypeError, match=r"^stop_event must be a threading.Event \(or None\), got True"):
        train(config, tmp_path / "other", stop_event=True)
