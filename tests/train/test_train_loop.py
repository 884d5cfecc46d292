"""train(): losses fall, metrics and checkpoints are written, a resumed run is bit-identical, accumulation is exact."""

import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import tiny_llama_config, tiny_vit_config

from qjax.train import loop, make_mesh, make_task, make_train_step, train


def _bits(tree):
    return [np.asarray(x).reshape(-1).view(np.uint8) for x in jax.tree.leaves(tree)]


def _records(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_llama_loss_falls_and_run_leaves_metrics_and_last_k_checkpoints(token_dir, tmp_path):
    config = tiny_llama_config(token_dir, steps=12, recipe="int8_rowwise")
    result = train(config, tmp_path, stream=io.StringIO())
    records = _records(tmp_path)
    train_rows = [r for r in records if "loss" in r]
    eval_rows = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train_rows] == [2, 4, 6, 8, 10, 12]
    assert [r["step"] for r in eval_rows] == [3, 6, 9, 12]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 0.5, [r["loss"] for r in train_rows]
    assert eval_rows[-1]["eval_loss"] < eval_rows[0]["eval_loss"]
    assert all(r["throughput"] > 0 for r in train_rows[1:])
    assert int(result.state.step) == 12 and result.train_metrics["step"] == 12
    # checkpoint_every=2, keep_checkpoints=2: only the last two remain, and no temporary directories.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["10", "12"]
    assert json.loads((tmp_path / "config.json").read_text())["recipe"] == "int8_rowwise"


def test_vit_loss_falls(tmp_path):
    result = train(tiny_vit_config(steps=12, log_every=4), tmp_path, stream=io.StringIO())
    train_rows = [r for r in _records(tmp_path) if "loss" in r]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 0.05, [r["loss"] for r in train_rows]
    assert 0.0 <= result.eval_metrics["eval_accuracy"] <= 1.0 and result.eval_metrics["step"] == 12


@pytest.mark.parametrize("recipe, optimizer, accum", [("bf16", "adamw", 1), ("int8_rowwise", "adamw_8bit", 2)])
def test_resumed_run_is_bit_identical(token_dir, tmp_path, recipe, optimizer, accum):
    config = tiny_llama_config(token_dir, steps=6, recipe=recipe, grad_accum_steps=accum, checkpoint_every=0)
    config.optimizer.name = optimizer
    whole = train(config, tmp_path / "whole", stream=io.StringIO())

    first = train(config, tmp_path / "pieces", stop_at=4, stream=io.StringIO())  # the "killed" run
    assert int(first.state.step) == 4
    assert sorted(p.name for p in (tmp_path / "pieces/checkpoints").iterdir()) == ["4"]
    resumed = train(config, tmp_path / "pieces", stream=io.StringIO())
    assert int(resumed.state.step) == 6
    assert jax.tree.structure(resumed.state) == jax.tree.structure(whole.state)
    for a, b in zip(_bits(resumed.state), _bits(whole.state)):
        np.testing.assert_array_equal(a, b)
    assert resumed.train_metrics["loss"] == whole.train_metrics["loss"]
    assert resumed.eval_metrics["eval_loss"] == whole.eval_metrics["eval_loss"]


def test_grad_accumulation_equals_the_big_batch_step(token_dir):
    # float32 compute and a huge eps make the update ~ lr * grad, so parameters compare the gradients themselves.
    config = tiny_llama_config(token_dir, steps=3)
    config.model.compute_dtype = "float32"
    config.optimizer.eps, config.optimizer.weight_decay, config.optimizer.grad_clip = 1e3, 0.0, 0.0
    task = make_task(config, vocab_size=256)
    tokens = jax.random.randint(jax.random.key(1), (config.batch_size, config.seq_len + 1), 0, 256)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    results = {}
    for accum in (1, 4):
        config.grad_accum_steps = accum
        init_state, train_step = make_train_step(config, task, make_mesh())
        state0 = init_state()
        before = jax.tree.map(np.asarray, state0.params)
        state, metrics = train_step(state0, batch)
        results[accum] = (jax.tree.map(lambda a, b: np.asarray(a) - b, state.params, before), metrics)
    (delta1, m1), (delta4, m4) = results[1], results[4]
    np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-6)
    np.testing.assert_allclose(m4["grad_norm"], m1["grad_norm"], rtol=1e-5)
    assert float(m1["grad_norm"]) > 0
    for a, b in zip(jax.tree.leaves(delta4), jax.tree.leaves(delta1)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-10)


def test_nan_loss_stops_the_run_without_saving(tmp_path, monkeypatch):
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

    monkeypatch.setattr(loop, "make_dataset", poisoned)
    with pytest.raises(FloatingPointError, match="loss is nan at step 2"):
        train(tiny_vit_config(steps=6, log_every=2, checkpoint_every=2), tmp_path, stream=io.StringIO())
    assert not list((tmp_path / "checkpoints").iterdir())
