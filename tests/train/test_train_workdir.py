"""What a workdir holds across starts: unreadable checkpoints are skipped and kept aside, metrics rows after the
restored step are dropped, config changes are listed, the best checkpoint by eval loss is kept, TensorBoard event
files and a loss plot are written, and a run that fails its checks leaves no workdir."""

import io
import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys

import jax
import numpy as np
import pytest
from train_helpers import tiny_llama_config

from qjax.train import Checkpointer, ConfigError, loop, train
from qjax.train import metrics as plot_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = dict(size="tiny", n_layers=1, dim=32, n_heads=2, n_kv_heads=1, ffn_dim=64)


def _command(workdir, token_dir, steps, **model):
    """train.py on the tiny Llama: checkpoints every 2 steps (3 kept), eval every 3."""
    return ([sys.executable, str(ROOT / "train.py"), f"--config={ROOT / 'configs/llama_bf16.py'}",
             f"--workdir={workdir}", f"--config.data.path={token_dir}", "--config.batch_size=8",
             "--config.seq_len=32", f"--config.steps={steps}", "--config.optimizer.warmup_steps=1",
             "--config.log_every=2", "--config.eval_every=3", "--config.eval_batches=1",
             "--config.checkpoint_every=2", "--config.keep_checkpoints=3"]
            + [f"--config.model.{k}={v}" for k, v in {**TINY, **model}.items()])


def _run(workdir, token_dir, steps, **model):
    return subprocess.run(_command(workdir, token_dir, steps, **model), env={**os.environ, "JAX_PLATFORMS": "cpu"},
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def _steps(workdir):
    return sorted(p.name for p in (workdir / "checkpoints").iterdir())


def _rows(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished_run(token_dir, tmp_path_factory):
    """A 6-step train.py run with checkpoints 2, 4 and 6."""
    workdir = tmp_path_factory.mktemp("finished") / "run"
    result = _run(workdir, token_dir, steps=6)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _steps(workdir) == ["2", "4", "6"]
    return workdir


def _truncate_largest_data_file(step_dir):
    files = sorted((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = files[-1].read_bytes()
    files[-1].write_bytes(data[: len(data) // 2])


def _delete_tree_metadata(step_dir):
    (step_dir / "default" / "_METADATA").unlink()


@pytest.mark.parametrize("corrupt", [_truncate_largest_data_file, _delete_tree_metadata])
def test_unreadable_newest_checkpoint_is_moved_aside_and_the_run_resumes_from_the_previous(
        finished_run, token_dir, tmp_path, corrupt):
    workdir = tmp_path / "run"
    shutil.copytree(finished_run, workdir)
    corrupt(workdir / "checkpoints" / "6")
    result = _run(workdir, token_dir, steps=8)
    assert result.returncode == 0, result.stderr[-3000:]
    skipped = [line for line in result.stdout.splitlines() if "does not restore" in line]
    assert len(skipped) == 1, result.stdout
    assert skipped[0].startswith(f"checkpoint 6 in {workdir / 'checkpoints'} does not restore (")
    assert skipped[0].endswith(f"): moved aside to {workdir / 'checkpoints' / '6.corrupt-1'}; resuming from 4")
    assert "resumed at step 4, running to step 8/8" in result.stdout
    assert len(result.stderr.splitlines()) < 5, result.stderr[:3000]  # no orbax / TensorStore traces
    # Kept (not deleted) beside the new checkpoints, and orbax does not take it for a step.
    assert (workdir / "checkpoints" / "6.corrupt-1" / "default").is_dir()
    assert _steps(workdir) == ["4", "6", "6.corrupt-1", "8"]
    assert Checkpointer(workdir / "checkpoints", keep=3).latest_step() == 8


def test_no_readable_checkpoint_is_one_error_line_and_nothing_is_moved(finished_run, token_dir, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(finished_run, workdir)
    for step in ("2", "4", "6"):
        _delete_tree_metadata(workdir / "checkpoints" / step)
    result = _run(workdir, token_dir, steps=8)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: no checkpoint in {workdir / 'checkpoints'} restores (6: "), result.stderr
    assert "to start this run from scratch" in result.stderr and len(result.stderr.splitlines()) == 1
    assert _steps(workdir) == ["2", "4", "6"]


def test_checkpoint_of_another_model_is_an_error_not_a_corrupt_checkpoint(finished_run, token_dir, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(finished_run, workdir)
    result = _run(workdir, token_dir, steps=8, dim=64)
    assert result.returncode == 2
    assert "checkpoint 6" in result.stderr and "does not fit this run's train state" in result.stderr
    assert "is (256, 32), this run's is (256, 64)" in result.stderr and len(result.stderr.splitlines()) == 1
    assert _steps(workdir) == ["2", "4", "6"]  # nothing moved aside


def test_shorter_steps_than_the_checkpoint_is_an_error_and_changes_are_listed(token_dir, tmp_path):
    config = tiny_llama_config(token_dir, steps=6)
    train(config, tmp_path, stream=io.StringIO())
    saved = (tmp_path / "config.json").read_text()
    with pytest.raises(ConfigError, match=r"config.steps=4 is below step 6 of the newest checkpoint in .*"
                                          r"--config.steps=6 or more"):
        train(tiny_llama_config(token_dir, steps=4), tmp_path, stream=io.StringIO())
    assert (tmp_path / "config.json").read_text() == saved  # the failed start did not rewrite it

    longer = tiny_llama_config(token_dir, steps=8, log_every=4)
    out = io.StringIO()
    train(longer, tmp_path, stream=out)
    changed = [line for line in out.getvalue().splitlines() if line.startswith("config changed")]
    assert changed == ["config changed since the last start: log_every 2 -> 4, steps 6 -> 8"], out.getvalue()
    assert json.loads((tmp_path / "config.json").read_text())["steps"] == 8


def test_metrics_rows_after_the_restored_step_are_dropped(token_dir, tmp_path):
    """A run killed after step 5 whose newest checkpoint is 4 (checkpoint 6 never made it to disk): the restart
    recomputes steps 5 and 6, and metrics.jsonl ends with one row per step, as the uninterrupted run's."""
    config = tiny_llama_config(token_dir, steps=8, checkpoint_every=2, keep_checkpoints=5)
    train(config, tmp_path / "whole", stream=io.StringIO())
    train(config, tmp_path / "killed", stop_at=6, stream=io.StringIO())
    shutil.rmtree(tmp_path / "killed" / "checkpoints" / "6")
    with open(tmp_path / "killed" / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 1.')  # a row cut short by the kill
    out = io.StringIO()
    train(config, tmp_path / "killed", stream=out)
    assert "resumed at step 4" in out.getvalue()
    assert "metrics.jsonl: dropped 3 rows after step 4" in out.getvalue()
    got, want = _rows(tmp_path / "killed"), _rows(tmp_path / "whole")
    assert [(r["step"], "loss" in r) for r in got] == [(r["step"], "loss" in r) for r in want]
    assert [r.get("loss", r.get("eval_loss")) for r in got] == [r.get("loss", r.get("eval_loss")) for r in want]


def test_best_checkpoint_by_eval_loss_is_kept_and_resume_takes_the_newest(token_dir, tmp_path, monkeypatch):
    losses = iter([3.0, 1.0, 2.0, 4.0])  # the evals at steps 3, 6, 9, 12: the best is 6, then it overfits
    monkeypatch.setattr(loop, "evaluate", lambda eval_step, params, batches, key: {"loss": next(losses)})
    config = tiny_llama_config(token_dir, steps=12, checkpoint_every=4, keep_checkpoints=2)
    first = train(config, tmp_path, stop_at=9, stream=io.StringIO())
    assert json.loads((tmp_path / "best" / "best.json").read_text())["step"] == 6
    assert sorted(p.name for p in (tmp_path / "best").iterdir()) == ["6", "best.json"]

    out = io.StringIO()
    train(config, tmp_path, stream=out)
    assert "resumed at step 9" in out.getvalue()  # the newest checkpoint, not the best
    best = json.loads((tmp_path / "best" / "best.json").read_text())
    assert best == {"step": 6, "eval_loss": 1.0, "checkpoint": str(tmp_path / "best" / "6")}
    best_line = f"best eval loss 1.0000 at step 6: checkpoint {tmp_path / 'best' / '6'} (the newest is in checkpoints/)"
    assert out.getvalue().splitlines()[-1] == best_line
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), first.state)
    restored = Checkpointer(tmp_path / "best", keep=1).restore_latest(abstract)
    assert int(restored.step) == 6


def _event_scalars(workdir) -> dict:
    """{tag: [(step, value)]} from the TensorBoard event files in `workdir` (TFRecord framing: length, its CRC,
    the serialized Event, its CRC)."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    for path in sorted(workdir.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + length])
            i += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_tensorboard_event_files_hold_the_metrics(token_dir, tmp_path):
    config = tiny_llama_config(token_dir, steps=6)
    result = train(config, tmp_path, stream=io.StringIO())
    scalars = _event_scalars(tmp_path)
    assert {"train/loss", "train/lr", "train/grad_norm", "eval/loss"} <= scalars.keys(), scalars.keys()
    assert [step for step, _ in scalars["train/loss"]] == [2, 4, 6]
    assert [step for step, _ in scalars["eval/loss"]] == [3, 6]
    np.testing.assert_allclose(scalars["train/loss"][-1][1], result.train_metrics["loss"], rtol=1e-6)
    np.testing.assert_allclose(scalars["eval/loss"][-1][1], result.eval_metrics["eval_loss"], rtol=1e-6)


def test_a_health_row_goes_to_tensorboard_whole_and_a_nan_only_to_metrics_jsonl(tmp_path):
    meter = plot_lib.ProgressMeter(tmp_path, 100, "tokens", 64, None, stream=io.StringIO())
    row = {f"health/layers_{i}/mlp/down_proj/x/{stat}": i + k / 10 for i in range(200)
           for k, stat in enumerate(("amax", "saturated", "underflow"))}
    meter.health(100, {**row, "health/lm_head/x/amax": float("nan")})
    meter.close()
    scalars = _event_scalars(tmp_path)
    assert scalars == {tag: [(100, pytest.approx(value))] for tag, value in row.items()}
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(line)["health/lm_head/x/amax"] != json.loads(line)["health/lm_head/x/amax"]  # NaN kept


def test_plot_writes_a_png_of_the_loss_curves(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 3.0 / s ** 0.5, "lr": 1e-3} for s in range(10, 210, 10)]
    rows += [{"step": s, "eval_loss": 3.2 / s ** 0.5} for s in range(50, 250, 50)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_lib.main([str(run)]) == 0
    png = run / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    import matplotlib.image

    pixels = matplotlib.image.imread(png)
    assert pixels.shape[0] > 300 and pixels.shape[1] > 500
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 20  # curves, axes and text, not blank
    assert capsys.readouterr().out.strip() == f"wrote {png}"
    assert plot_lib.main([str(tmp_path / "missing"), "--out", str(tmp_path / "x.png")]) == 2
    assert "no metrics in" in capsys.readouterr().err and not (tmp_path / "x.png").exists()


def test_plot_of_several_runs_adds_their_eval_gap_to_the_first(tmp_path):
    runs = {}
    for name, scale in (("bf16", 1.0), ("int8", 1.02), ("fp8", 0.99)):
        run = tmp_path / name
        run.mkdir()
        rows = [{"step": s, "loss": 3.0 * scale / s ** 0.5} for s in range(10, 210, 10)]
        rows += [{"step": s, "eval_loss": 3.2 * scale / s ** 0.5} for s in range(50, 250, 50)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs[name] = plot_lib.curves(str(run))
    gaps = plot_lib.eval_gaps(runs)
    assert list(gaps) == ["int8", "fp8"]  # the first run is the reference
    assert [step for step, _ in gaps["int8"]] == [50, 100, 150, 200]
    np.testing.assert_allclose([gap for _, gap in gaps["int8"]], 2.0, rtol=1e-9)
    np.testing.assert_allclose([gap for _, gap in gaps["fp8"]], -1.0, rtol=1e-9)
    runs["late"] = ([(10, 1.0)], [(999, 1.0)])  # no eval step shared with the reference: no gap curve
    assert "late" not in plot_lib.eval_gaps(runs)
    import matplotlib.image

    one = plot_lib.plot_runs([str(tmp_path / "bf16")], str(tmp_path / "one.png"))
    both = plot_lib.plot_runs([str(tmp_path / n) for n in ("bf16", "int8", "fp8")], str(tmp_path / "gaps.png"))
    assert matplotlib.image.imread(both).shape[1] > 1.5 * matplotlib.image.imread(one).shape[1]  # a second panel


@pytest.mark.parametrize("problem", ["negative steps", "empty data directory", "heads do not divide dim"])
def test_a_run_that_fails_its_checks_leaves_no_workdir(token_dir, tmp_path, problem):
    config = tiny_llama_config(token_dir)
    if problem == "negative steps":
        config.steps = -1
    elif problem == "empty data directory":
        (tmp_path / "empty").mkdir()
        config.data.path = str(tmp_path / "empty")
    else:
        config.model.n_heads = 3
    with pytest.raises(ConfigError):
        train(config, tmp_path / "runs" / "bad", stream=io.StringIO())
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("error", [ValueError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.00GiB"),
                                   PermissionError(13, "Permission denied"), OSError(5, "Input/output error")],
                         ids=["out_of_memory", "permission", "io_error"])
def test_a_failure_that_is_not_the_checkpoints_is_raised_and_nothing_is_moved(tmp_path, monkeypatch, error):
    """Out of memory, permissions or a storage I/O error would fail every restore alike: raised as is, no checkpoint
    moved aside (only missing or garbled files make a checkpoint corrupt)."""
    from qjax.train.checkpoint import abstract_like

    state = {"params": np.ones(4, np.float32)}
    checkpointer = Checkpointer(tmp_path, keep=2)
    for step in (1, 2):
        checkpointer.save(step, state)
    checkpointer.close()

    def fail(*args, **kwargs):
        raise error

    checkpointer = Checkpointer(tmp_path, keep=2)
    monkeypatch.setattr(checkpointer._manager, "restore", fail)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(type(error)):
        checkpointer.restore_latest(abstract_like(state, sharding), report=pytest.fail)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]


def test_a_start_from_scratch_sets_an_earlier_runs_metrics_aside(token_dir, tmp_path):
    """Checkpoints moved away, the rest of the workdir kept: the new run neither appends to the old metrics nor
    reports the old best checkpoint; both are kept in previous-1/."""
    workdir = tmp_path / "run"
    assert _run(workdir, token_dir, steps=4).returncode == 0
    old_rows = _rows(workdir)
    shutil.rmtree(workdir / "checkpoints")
    result = _run(workdir, token_dir, steps=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"were moved to {workdir / 'previous-1'}" in result.stdout
    assert {row["step"] for row in _rows(workdir)} == {2}  # this run's log and final eval rows only
    assert [json.loads(line) for line in (workdir / "previous-1" / "metrics.jsonl").read_text().splitlines()] \
        == old_rows
    old_best = json.loads((workdir / "previous-1" / "best" / "best.json").read_text())
    assert old_best["step"] in (3, 4) and (workdir / "previous-1" / "best" / str(old_best["step"])).is_dir()
    assert f"at step 2: checkpoint {workdir / 'best' / '2'}" in result.stdout  # this run's, not the old one


def test_saving_a_step_again_replaces_it_only_when_asked(tmp_path):
    """The best checkpoint of a step recomputed after a kill replaces the lost run's one; regular saves of an
    existing step stay no-ops."""
    from qjax.train.checkpoint import abstract_like

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    ones, twos, threes = ({"x": np.full(4, v, np.float32)} for v in (1, 2, 3))
    checkpointer = Checkpointer(tmp_path, keep=1)
    checkpointer.save(5, ones)
    checkpointer.save(5, twos)
    checkpointer.close()
    checkpointer = Checkpointer(tmp_path, keep=1)
    assert float(checkpointer.restore_latest(abstract_like(ones, sharding))["x"][0]) == 1.0
    checkpointer.save(5, threes, replace=True)
    checkpointer.close()
    restored = Checkpointer(tmp_path, keep=1).restore_latest(abstract_like(ones, sharding))
    assert float(restored["x"][0]) == 3.0 and sorted(p.name for p in tmp_path.iterdir()) == ["5"]
