"""TokenDataset: shapes, shift, determinism, epoch coverage, exact resume, eval windows, errors; EpochOrder."""

import json

import numpy as np
import pytest

from helpers import write_tiny_corpus
from qjax.data import order
from qjax.data.tokens import TokenDataset

B, T = 4, 16


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"))


def _train_tokens(shards):
    return np.fromfile(shards / "train.bin", np.uint16).astype(np.int32)


def test_batch_shapes_dtypes_and_shift(shards):
    ds = TokenDataset(shards, batch_size=B, seq_len=T, seed=0)
    assert ds.vocab_size == 256 and ds.tokens_per_batch == B * T
    batch = ds.batch(3)
    assert set(batch) == {"inputs", "targets"}
    for key in batch:
        assert batch[key].shape == (B, T) and batch[key].dtype == np.int32
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    # Every row is a window of train.bin starting at a multiple of T + 1.
    tokens = _train_tokens(shards)
    for inputs, targets in zip(batch["inputs"], batch["targets"]):
        starts = [s for s in range(0, tokens.size - T, T + 1) if np.array_equal(tokens[s:s + T], inputs)]
        assert starts and np.array_equal(tokens[starts[0] + 1:starts[0] + T + 1], targets)


def test_same_seed_same_batches_different_seed_different(shards):
    a = TokenDataset(shards, batch_size=B, seq_len=T, seed=7)
    b = TokenDataset(shards, batch_size=B, seq_len=T, seed=7)
    c = TokenDataset(shards, batch_size=B, seq_len=T, seed=8)
    for step in (0, 1, 50):
        np.testing.assert_array_equal(a.batch(step)["inputs"], b.batch(step)["inputs"])
    assert not all(np.array_equal(a.batch(s)["inputs"], c.batch(s)["inputs"]) for s in range(3))
    assert not np.array_equal(a.batch(0)["inputs"], a.batch(1)["inputs"])


def _window_ids(ds, step):
    return ds._order.indices(step)


def test_epoch_covers_every_window_once(shards):
    ds = TokenDataset(shards, batch_size=B, seq_len=T, seed=3)
    n = ds.num_train_windows
    assert n > 3 * B  # the fixture is large enough for a meaningful check
    full_steps = n // B
    seen = np.concatenate([_window_ids(ds, s) for s in range(full_steps)])
    assert np.unique(seen).size == seen.size == full_steps * B  # no window twice within the epoch
    # The batch that straddles the epoch boundary completes epoch 0, then starts epoch 1.
    straddle = _window_ids(ds, full_steps)
    rest = n - full_steps * B
    np.testing.assert_array_equal(np.sort(np.concatenate([seen, straddle[:rest]])), np.arange(n))
    np.testing.assert_array_equal(straddle[rest:], order.epoch_permutation(3, 1, n)[:B - rest])
    # Window ids decode to the actual tokens of those windows.
    tokens = _train_tokens(shards)
    for w, row in zip(straddle, ds.batch(full_steps)["inputs"]):
        np.testing.assert_array_equal(row, tokens[w * (T + 1):w * (T + 1) + T])


def test_resumed_run_equals_uninterrupted(shards):
    steps = range(0, 40)
    uninterrupted = TokenDataset(shards, batch_size=B, seq_len=T, seed=11)
    reference = [uninterrupted.batch(s) for s in steps]
    resumed = TokenDataset(shards, batch_size=B, seq_len=T, seed=11)  # a fresh process after a checkpoint at 25
    for s in steps[25:]:
        np.testing.assert_array_equal(resumed.batch(s)["inputs"], reference[s]["inputs"])
        np.testing.assert_array_equal(resumed.batch(s)["targets"], reference[s]["targets"])
    assert np.array_equal(resumed.batch(np.int64(3))["inputs"], reference[3]["inputs"])  # numpy ints work


def test_eval_batches_are_fixed_val_windows(shards):
    ds = TokenDataset(shards, batch_size=B, seq_len=T, seed=0)
    val = np.fromfile(shards / "val.bin", np.uint16).astype(np.int32)
    evals = ds.eval_batches(2)
    assert len(evals) == 2
    for i, batch in enumerate(evals):
        for j in range(B):
            start = (i * B + j) * (T + 1)
            np.testing.assert_array_equal(batch["inputs"][j], val[start:start + T])
            np.testing.assert_array_equal(batch["targets"][j], val[start + 1:start + T + 1])
    other_seed = TokenDataset(shards, batch_size=B, seq_len=T, seed=5).eval_batches(2)
    np.testing.assert_array_equal(other_seed[1]["inputs"], evals[1]["inputs"])
    assert len(ds.eval_batches()) == ds.num_val_windows // B
    with pytest.raises(ValueError, match="ask for at most"):
        ds.eval_batches(ds.num_val_windows // B + 1)


def test_errors(shards, tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m qjax.data.prepare shakespeare --out"):
        TokenDataset(tmp_path / "absent", batch_size=B, seq_len=T, seed=0)
    with pytest.raises(FileNotFoundError, match="missing meta.json"):
        TokenDataset(tmp_path, batch_size=B, seq_len=T, seed=0)
    train_size = np.fromfile(shards / "train.bin", np.uint16).size
    val_size = np.fromfile(shards / "val.bin", np.uint16).size
    with pytest.raises(ValueError, match=f"the val split has only {val_size}"):
        TokenDataset(shards, batch_size=1, seq_len=val_size, seed=0)
    with pytest.raises(ValueError, match=f"the train split has only {train_size}"):
        TokenDataset(shards, batch_size=1, seq_len=train_size, seed=0)
    with pytest.raises(ValueError, match="batch_size 100000 is larger than"):
        TokenDataset(shards, batch_size=100_000, seq_len=T, seed=0)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        TokenDataset(shards, batch_size=0, seq_len=T, seed=0)
    with pytest.raises(TypeError, match="batch_size must be an integer"):
        TokenDataset(shards, batch_size=4.0, seq_len=T, seed=0)
    with pytest.raises(ValueError, match="fewer than batch_size"):
        TokenDataset(shards, batch_size=val_size // (T + 1) + 1, seq_len=T, seed=0).eval_batches(1)
    ds = TokenDataset(shards, batch_size=B, seq_len=T, seed=0)
    with pytest.raises(ValueError, match="step must be >= 0"):
        ds.batch(-1)
    with pytest.raises(TypeError, match="step must be an integer"):
        ds.batch(1.5)


def test_corrupt_shards(shards, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("train.bin", "val.bin"):
        (copy / name).write_bytes((shards / name).read_bytes())
    meta = json.loads((shards / "meta.json").read_text())
    (copy / "meta.json").write_text(json.dumps(dict(meta, vocab_size=100)))  # the text holds bytes >= 100
    ds = TokenDataset(copy, batch_size=B, seq_len=T, seed=0)
    with pytest.raises(ValueError, match=r"token id \d+ >= vocab_size 100"):
        for step in range(ds.num_train_windows // B + 1):
            ds.batch(step)
    (copy / "meta.json").write_text(json.dumps(dict(meta, train_tokens=meta["train_tokens"] + 1)))
    with pytest.raises(ValueError, match="do not match its meta.json"):
        TokenDataset(copy, batch_size=B, seq_len=T, seed=0)
    (copy / "meta.json").write_text(json.dumps(meta))
    (copy / "val.bin").unlink()
    with pytest.raises(FileNotFoundError, match="val.bin is missing"):
        TokenDataset(copy, batch_size=B, seq_len=T, seed=0)


def test_epoch_permutation_is_a_permutation_and_seeded():
    p = order.epoch_permutation(0, 0, 1000)
    np.testing.assert_array_equal(np.sort(p), np.arange(1000))
    np.testing.assert_array_equal(p, order.epoch_permutation(0, 0, 1000))
    assert not np.array_equal(p, order.epoch_permutation(1, 0, 1000))
    assert not np.array_equal(p, order.epoch_permutation(0, 1, 1000))
    # Position 0 is not biased towards example 0 (mix(0) == 0 would pin it for seed 0 without the offsets).
    firsts = np.array([order.epoch_permutation(s, 0, 10)[0] for s in range(2000)])
    assert np.bincount(firsts, minlength=10).min() > 120
