"""Image datasets (digits, npz, tfds when installed) and make_dataset's config handling."""

import numpy as np
import pytest
from sklearn.datasets import load_digits as sklearn_digits

import qjax.data
from qjax.data import images


@pytest.fixture(scope="module")
def digits():
    return images.load_digits(batch_size=32, seed=0)


def test_digits_batches(digits):
    assert digits.num_classes == 10 and digits.image_shape == (8, 8, 1)
    assert (digits.num_train, digits.num_test) == (1797 - images.DIGITS_TEST_SIZE, images.DIGITS_TEST_SIZE)
    batch = digits.batch(5)
    assert batch["images"].shape == (32, 8, 8, 1) and batch["images"].dtype == np.float32
    assert batch["labels"].shape == (32,) and batch["labels"].dtype == np.int32
    assert batch["images"].min() >= -1.0 and batch["images"].max() <= 1.0
    # Each (image, label) pair is a real digit: pixel values 0..16 mapped linearly onto [-1, 1].
    raw = sklearn_digits()
    pixels = (batch["images"][..., 0] + 1.0) * 8.0
    for image, label in zip(pixels, batch["labels"]):
        match = np.flatnonzero(np.all(np.abs(raw.images - image) < 1e-5, axis=(1, 2)))
        assert match.size and label in raw.target[match]


def test_digits_determinism_and_split(digits):
    again = images.load_digits(batch_size=32, seed=0)
    other = images.load_digits(batch_size=32, seed=1)
    np.testing.assert_array_equal(digits.batch(7)["images"], again.batch(7)["images"])
    assert not np.array_equal(digits.batch(7)["labels"], other.batch(7)["labels"])
    # The held-out split does not depend on the training seed and shares no image with train.
    np.testing.assert_array_equal(digits.test.images, other.test.images)
    # Train and test together are exactly the 1797 digits, each once.
    split = np.concatenate([digits.train.images, digits.test.images])[..., 0].reshape(1797, 64)
    split_labels = np.concatenate([digits.train.labels, digits.test.labels])
    raw = sklearn_digits()
    key = lambda x, y: np.lexsort(np.column_stack([x, y]).T)  # noqa: E731
    rows = np.column_stack([split, split_labels])[key(split, split_labels)]
    expected = np.column_stack([raw.data, raw.target])[key(raw.data, raw.target)]
    np.testing.assert_array_equal(rows, expected)
    one_epoch = np.concatenate([digits._order.indices(s) for s in range(digits.num_train // 32)])
    assert np.unique(one_epoch).size == one_epoch.size


def test_digits_eval_batches_drop_the_partial_batch(digits):
    evals = digits.eval_batches()
    assert len(evals) == images.DIGITS_TEST_SIZE // 32
    labels = np.concatenate([b["labels"] for b in evals])
    np.testing.assert_array_equal(labels, digits.test.labels[:len(evals) * 32])
    assert len(digits.eval_batches(2)) == 2
    with pytest.raises(ValueError, match="ask for at most 11"):
        digits.eval_batches(12)


def test_resize():
    ramp = np.arange(4, dtype=np.float32).reshape(1, 4, 1) * np.ones((4, 1, 1), np.float32)  # (4, 4, 1)
    up = images.resize_bilinear(ramp, 8)
    assert up.shape == (8, 8, 1)
    np.testing.assert_allclose(up[0, :, 0], [0, 0.25, 0.75, 1.25, 1.75, 2.25, 2.75, 3])
    np.testing.assert_array_equal(images.resize_bilinear(ramp, 4), ramp)
    ds = images.load_digits(batch_size=8, seed=0, image_size=16)
    assert ds.image_shape == (16, 16, 1) and ds.batch(0)["images"].shape == (8, 16, 16, 1)


def _write_npz(path, n_train=40, n_test=12, shape=(6, 5, 3), classes=4, **overrides):
    rng = np.random.default_rng(0)
    arrays = {"train_images": rng.integers(0, 256, (n_train, *shape), dtype=np.uint8),
              "train_labels": rng.integers(0, classes, n_train),
              "test_images": rng.integers(0, 256, (n_test, *shape), dtype=np.uint8),
              "test_labels": rng.integers(0, classes, n_test)}
    arrays.update(overrides)
    np.savez(path, **arrays)
    return arrays


def test_npz_dataset(tmp_path):
    arrays = _write_npz(tmp_path / "d.npz", num_classes=np.int64(7))
    ds = qjax.data.make_dataset({"kind": "npz", "path": str(tmp_path / "d.npz")}, batch_size=8, seed=2)
    assert ds.num_classes == 7 and ds.image_shape == (6, 5, 3)
    batch = ds.batch(4)
    order = ds._order.indices(4)
    np.testing.assert_allclose(batch["images"], arrays["train_images"][order] / 127.5 - 1.0, atol=1e-6)
    np.testing.assert_array_equal(batch["labels"], arrays["train_labels"][order])
    evals = ds.eval_batches()
    assert len(evals) == 1
    np.testing.assert_array_equal(evals[0]["labels"], arrays["test_labels"][:8])
    _write_npz(tmp_path / "e.npz")  # no num_classes: max label + 1
    inferred = images.load_npz(tmp_path / "e.npz", batch_size=8, seed=0)
    assert inferred.num_classes == max(inferred.train.labels.max(), inferred.test.labels.max()) + 1


def test_npz_errors(tmp_path):
    _write_npz(tmp_path / "float.npz", train_images=np.zeros((40, 6, 5, 3), np.float32))
    with pytest.raises(ValueError, match="train_images must be uint8"):
        images.load_npz(tmp_path / "float.npz", batch_size=8, seed=0)
    _write_npz(tmp_path / "gray.npz", test_images=np.zeros((12, 6, 5), np.uint8))
    with pytest.raises(ValueError, match=r"images\[\.\.\., None\]"):
        images.load_npz(tmp_path / "gray.npz", batch_size=8, seed=0)
    _write_npz(tmp_path / "count.npz", train_labels=np.zeros(39, np.int64))
    with pytest.raises(ValueError, match="N = 40 images"):
        images.load_npz(tmp_path / "count.npz", batch_size=8, seed=0)
    _write_npz(tmp_path / "range.npz", num_classes=np.int64(2))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, num_classes=2\)"):
        images.load_npz(tmp_path / "range.npz", batch_size=8, seed=0)
    np.savez(tmp_path / "partial.npz", train_images=np.zeros((4, 2, 2, 1), np.uint8))
    with pytest.raises(ValueError, match="no array 'train_labels'"):
        images.load_npz(tmp_path / "partial.npz", batch_size=2, seed=0)
    _write_npz(tmp_path / "ok.npz")
    with pytest.raises(ValueError, match="fewer than batch_size"):
        images.load_npz(tmp_path / "ok.npz", batch_size=20, seed=0).eval_batches()


def test_make_dataset_config_errors(tmp_path):
    import ml_collections

    with pytest.raises(ValueError, match=r"unknown data kind 'mnist'.*'digits', 'instruct', 'npz', 'tfds', 'tokens'"):
        qjax.data.make_dataset({"kind": "mnist"}, batch_size=8, seed=0)
    with pytest.raises(ValueError, match=r"needs the field\(s\) \['path'\]"):
        qjax.data.make_dataset(ml_collections.ConfigDict({"kind": "tokens"}), batch_size=8, seq_len=4, seed=0)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['imag_size'\]"):
        qjax.data.make_dataset({"kind": "digits", "imag_size": 8}, batch_size=8, seed=0)
    with pytest.raises(ValueError, match="needs seq_len"):
        qjax.data.make_dataset({"kind": "tokens", "path": str(tmp_path)}, batch_size=8, seed=0)
    with pytest.raises(TypeError, match="ConfigDict or dict"):
        qjax.data.make_dataset("digits", batch_size=8, seed=0)
    config = ml_collections.ConfigDict({"kind": "digits", "image_size": None})
    ds = qjax.data.make_dataset(config, batch_size=16, seq_len=128, seed=0)  # seq_len is ignored for images
    assert ds.image_shape == (8, 8, 1)


def test_tfds_missing_says_how_to_install():
    try:
        import tensorflow_datasets  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install tensorflow-datasets"):
            qjax.data.make_dataset({"kind": "tfds", "name": "cifar10", "data_dir": "/nonexistent"},
                                   batch_size=8, seed=0)
    else:
        pytest.skip("tensorflow_datasets is installed")


def test_tfds_tiny_local_dataset(tmp_path):
    """Builds a 26-image dataset with tfds (array_record, PIL encoding: no TensorFlow) and reads it back."""
    tfds = pytest.importorskip("tensorflow_datasets")
    pil_image = pytest.importorskip("PIL.Image")

    class QjaxTinyImages(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=(6, 6, 3)), "label": tfds.features.ClassLabel(num_classes=3)}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(20, 0), "test": self._generate_examples(6, 1)}

        def _generate_examples(self, n, seed):
            rng = np.random.default_rng(seed)
            for i in range(n):
                pixels = np.full((6, 6, 3), 10 * i, np.uint8) + rng.integers(0, 5, (6, 6, 3), dtype=np.uint8)
                yield i, {"image": pil_image.fromarray(pixels), "label": i % 3}

    QjaxTinyImages(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    config = {"kind": "tfds", "name": "qjax_tiny_images", "data_dir": str(tmp_path), "image_size": 4}
    ds = qjax.data.make_dataset(config, batch_size=4, seed=0)
    assert ds.num_classes == 3 and ds.image_shape == (4, 4, 3) and (ds.num_train, ds.num_test) == (20, 6)
    batch = ds.batch(1)
    assert batch["images"].shape == (4, 4, 4, 3) and batch["images"].dtype == np.float32
    # Image i is ~10 i + 2 everywhere and has label i % 3, so the label follows from the pixels.
    example_number = lambda b: np.rint((b["images"].mean(axis=(1, 2, 3)) + 1) * 127.5 / 10 - 0.2).astype(int)  # noqa: E731
    np.testing.assert_array_equal(batch["labels"], example_number(batch) % 3)
    np.testing.assert_array_equal(ds.batch(1)["images"], batch["images"])
    evals = ds.eval_batches()  # tfds shuffles records when writing: eval follows the stored order
    assert len(evals) == 1
    np.testing.assert_array_equal(evals[0]["labels"], [ds.test.source[i]["label"] for i in range(4)])
    np.testing.assert_array_equal(evals[0]["labels"], example_number(evals[0]) % 3)
    with pytest.raises(ValueError, match="tfds build qjax_tiny_images"):
        qjax.data.make_dataset(dict(config, test_split="validation"), batch_size=4, seed=0)


@pytest.mark.parametrize("content", [b"label,pixels\n1,0 0 0\n", None])
def test_npz_path_that_is_not_an_npz_says_so_without_allow_pickle(tmp_path, content):
    path = tmp_path / "images.npz"
    if content is None:
        np.save(path, np.zeros(3))  # a .npy written under an .npz name
        path = tmp_path / "images.npz.npy"
    else:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=r"is not a valid \.npz file") as error:
        images.load_npz(path, batch_size=8, seed=0)
    assert "allow_pickle" not in str(error.value)
