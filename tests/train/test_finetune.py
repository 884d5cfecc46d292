"""Fine-tuning: instruction data (answer-only loss mask), config.init_from (a Hugging Face checkpoint's weights start
the run), and a short int8_rowwise fine-tune whose loss falls."""

import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import tiny_llama_config

from qjax import models
from qjax.data import InstructDataset, make_dataset
from qjax.train import ConfigError, make_task, train

# A small task a byte-level model picks up in a few dozen steps: the answer is the prompt's word, reversed.
WORDS = ["cat", "dog", "sun", "tree", "blue", "moon", "fish", "bird", "star", "rain", "red", "sea"]


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("instruct") / "pairs.jsonl"
    lines = [{"prompt": f"reverse {w}:", "answer": f" {w[::-1]}"} for w in WORDS * 4]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random tiny Llama (byte vocabulary) written in the Hugging Face layout."""
    path = tmp_path_factory.mktemp("hf") / "model"
    config = models.llama_config("tiny", n_layers=1, dim=32, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64)
    params = jax.jit(models.Llama(config).init)(jax.random.key(7), jnp.zeros((1, 8), jnp.int32))["params"]
    models.save_hf_llama(config, params, str(path))
    return str(path)


def test_instruct_batches_mask_the_answer_only(jsonl):
    ds = InstructDataset(jsonl, batch_size=4, seq_len=24, seed=0)
    assert ds.vocab_size == 256 and ds.eos_token == 0 and (ds.num_train_examples, ds.num_val_examples) == (46, 2)
    batch = ds.batch(3)
    assert batch["inputs"].shape == batch["targets"].shape == batch["loss_mask"].shape == (4, 24)
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    for inputs, targets, mask in zip(batch["inputs"], batch["targets"], batch["loss_mask"]):
        text = bytes(np.concatenate([inputs[:1], targets]).astype(np.uint8)).decode().rstrip("\0")
        prompt, answer = text.split(":")
        assert prompt.startswith("reverse ") and answer == " " + prompt[len("reverse "):][::-1]
        # The targets counted are the answer and its end token; nothing of the prompt, no padding.
        assert bytes(targets[mask == 1].astype(np.uint8)) == answer.encode() + b"\0"
    np.testing.assert_array_equal(ds.batch(3)["inputs"], batch["inputs"])  # a pure function of (seed, step)
    evals = ds.eval_batches(2)
    assert len(evals) == 2 and evals[0]["inputs"].shape == (4, 24)


def test_long_examples_are_cut(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "p" * 10, "answer": "a" * 30}) + "\n" + json.dumps(
        {"prompt": "x", "answer": "y"}) + "\n")
    batch = InstructDataset(str(path), batch_size=1, seq_len=16, seed=0).batch(0)  # the long one; "x" is held out
    assert batch["loss_mask"][0].sum() == 16 - 9  # targets 9..15 are answer bytes; the end token is cut off


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "a"}\n{"prompt": "b", "answer": "c"}\n', r"pairs.jsonl:1 needs string fields"),
    ('{"prompt": "a", "answer": "b"}\nnot json\n', r"pairs.jsonl:2 is not JSON"),
    ('{"prompt": "a", "answer": "b"}\n', "needs at least 2"),
])
def test_bad_instruct_files_raise(tmp_path, content, message):
    (tmp_path / "pairs.jsonl").write_text(content)
    with pytest.raises(ValueError, match=message):
        make_dataset({"kind": "instruct", "path": str(tmp_path / "pairs.jsonl")}, batch_size=1, seq_len=8, seed=0)


def test_masked_positions_do_not_contribute(jsonl, token_dir):
    config = tiny_llama_config(token_dir)
    task = make_task(config, vocab_size=256)
    params = jax.jit(task.init)(jax.random.key(0))
    batch = InstructDataset(jsonl, batch_size=4, seq_len=32, seed=0).batch(0)
    task_loss = jax.jit(lambda p, b: task.loss(p, b, jax.random.key(1))[0])
    loss = float(task_loss(params, batch))
    changed = dict(batch, targets=np.where(batch["loss_mask"] == 1, batch["targets"], 65))
    assert float(task_loss(params, changed)) == loss
    # = the mean cross-entropy over the masked-in positions
    logits = jax.jit(task.model.apply)({"params": params}, batch["inputs"])
    per_token = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], -1)[..., 0]
    np.testing.assert_allclose(loss, per_token[batch["loss_mask"] == 1].mean(), rtol=1e-5)


def _finetune_config(token_dir, jsonl, hf_dir, **top):
    config = tiny_llama_config(token_dir, init_from=hf_dir, recipe="int8_rowwise", **top)
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
        setattr(config.model, name, None)  # the shape comes from init_from
    config.data.kind, config.data.path = "instruct", jsonl
    return config


def test_init_from_starts_at_the_checkpoint(token_dir, jsonl, hf_dir):
    config = _finetune_config(token_dir, jsonl, hf_dir)
    task = make_task(config, vocab_size=256)
    assert task.model_config == models.load_hf_config(hf_dir, recipe="int8_rowwise")
    _, expected = models.load_hf_llama(hf_dir)
    params = jax.jit(task.init)(jax.random.key(0))
    jax.tree.map(np.testing.assert_array_equal, params, expected)
    config.model.dim = 48
    with pytest.raises(ConfigError, match="unset config.model.dim"):
        make_task(config, vocab_size=256)


def test_model_vocab_size_pads_the_data_vocabulary_and_never_cuts_it(token_dir):
    config = tiny_llama_config(token_dir)
    config.model.vocab_size = 384
    assert make_task(config, vocab_size=256).model_config.vocab_size == 384  # honoured, not replaced by the data's
    config.model.vocab_size = 100
    with pytest.raises(ConfigError, match=r"vocab_size=100 is smaller than the 256 tokens of the data's tokenizer"):
        make_task(config, vocab_size=256)


def test_finetune_loss_falls(token_dir, jsonl, hf_dir, tmp_path):
    config = _finetune_config(token_dir, jsonl, hf_dir, steps=40, log_every=5, eval_every=20, checkpoint_every=0)
    config.optimizer.lr, config.optimizer.warmup_steps = 3e-3, 4
    out = io.StringIO()
    train(config, str(tmp_path / "run"), stream=out)
    header = out.getvalue().splitlines()[0]
    assert f"; initialized from {hf_dir}, running to step 40/40" in header and "scratch" not in header, header
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < 0.6 * losses[0], losses
