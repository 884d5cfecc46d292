"""config.init_from for ViT runs: a Hugging Face ViT checkpoint's shape and weights start the run, its classifier head
kept when it has the data's classes and replaced (with a start-up line saying so) otherwise, and the loss of a short
int8_rowwise fine-tune on the 8x8 digits falls."""

import dataclasses
import io
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import save_hf_dir
from train_helpers import tiny_vit_config

from configs import vit_finetune
from qjax import models
from qjax.models import hf_vit
from qjax.train import ConfigError, make_task, train

DIGITS = {"num_classes": 10, "image_shape": (8, 8, 1)}  # what the default data (kind "digits") gives make_task


def _checkpoint(num_classes: int) -> tuple[models.ViTConfig, dict]:
    """A tiny HF-computable ViT for 8x8x1 images with random float32 weights (norm scales near 1, the head non-zero);
    shaped by eval_shape, so nothing compiles."""
    config = models.vit_config("tiny", channels=1, num_classes=num_classes, pool="cls", gelu_approximate=False,
                               norm_eps=1e-12)
    shapes = jax.eval_shape(models.ViT(config).init, jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]
    rng = np.random.default_rng(num_classes)
    return config, jax.tree_util.tree_map_with_path(
        lambda path, x: (path[-1].key == "scale") + 0.05 * rng.standard_normal(x.shape, np.float32), shapes)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: (directory, ViTConfig, params)}: "same" has the digits' 10 classes, "other" 5, "backbone" is a ViTModel
    (the "other" weights without classifier, written as transformers' ViTModel names them)."""
    root = tmp_path_factory.mktemp("hf_vit")
    out = {}
    for name, classes in (("same", 10), ("other", 5)):
        config, params = _checkpoint(classes)
        models.save_hf_vit(config, params, str(root / name))
        out[name] = (str(root / name), config, params)
    config, params = out["other"][1:]
    hf = dict(hf_vit.config_to_hf(config), architectures=["ViTModel"])
    for key in ("id2label", "label2id"):
        del hf[key]
    tensors = {name.removeprefix("vit."): x for name, x in hf_vit.hf_tensors(config, params).items()
               if not name.startswith("classifier.")}
    save_hf_dir(root / "backbone", hf, tensors)
    out["backbone"] = (str(root / "backbone"), config, params)
    return out


@pytest.mark.parametrize("name, note", [("same", None), ("other", "classifier has 5 classes, the data 10"),
                                        ("backbone", "is a ViTModel \\(no classifier\\), the data 10")])
def test_init_from_starts_at_the_checkpoint(checkpoints, name, note):
    path, source_config, source = checkpoints[name]
    task = make_task(tiny_vit_config(init_from=path, recipe="int8_rowwise"), **DIGITS)
    assert task.model_config == dataclasses.replace(source_config, num_classes=10, recipe="int8_rowwise")
    params = jax.jit(task.init)(jax.random.key(0))
    expected = dict(source)
    if note:  # a new zero head of the data's 10 classes, said in one line
        assert re.fullmatch(f"init_from: the checkpoint's {note}: a new zero-initialized head of 10 classes "
                            "replaces it", task.init_note), task.init_note
        expected["head"] = {"kernel": np.zeros((32, 10), np.float32), "bias": np.zeros(10, np.float32)}
    else:
        assert task.init_note is None
    jax.tree.map(np.testing.assert_array_equal, params, expected)


@pytest.mark.parametrize("change, image_shape, message", [
    ({"patch_size": 2}, (8, 8, 1), "sets the model's shape: unset config.model.patch_size"),
    ({"pool": "mean"}, (8, 8, 1), "unset config.model.pool"),
    ({}, (16, 16, 1), "the data's images are 16x16x1, the ViT at config.init_from takes 8x8x1: resize them with "
                      "--config.data.image_size=8"),
    ({}, (8, 8, 3), "takes 8x8x1: use 1-channel images"),
])
def test_init_from_mismatches_raise(checkpoints, change, image_shape, message):
    config = tiny_vit_config(init_from=checkpoints["same"][0])
    for field, value in change.items():
        setattr(config.model, field, value)
    with pytest.raises(ConfigError, match=message):
        make_task(config, num_classes=10, image_shape=image_shape)


def test_finetune_loss_falls_and_says_the_head_is_new(checkpoints, tmp_path):
    config = vit_finetune.get_config()
    config.lock()  # as train.py's flags hold it: only existing fields can be set
    config.init_from = checkpoints["other"][0]
    config.batch_size, config.steps, config.log_every, config.eval_every = 32, 30, 5, 0
    config.optimizer.lr = 3e-3  # the random "checkpoint" has nothing to keep: the tiny model learns faster so
    stream = io.StringIO()
    train(config, str(tmp_path / "run"), stream=stream)
    notes = [line for line in stream.getvalue().splitlines() if "init_from:" in line]
    assert len(notes) == 1 and "a new zero-initialized head of 10 classes replaces it" in notes[0], stream.getvalue()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.85 * losses[0], losses
