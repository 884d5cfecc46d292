"""Image-classification batches from three sources, all served by one `ImageDataset`:

  load_digits(...)     scikit-learn's handwritten digits (offline, the default): 1797 images 8x8x1, 10 classes;
                       a fixed split of 1437 train / 360 test images
  load_npz(path, ...)  your own data offline: an .npz with train_images, test_images uint8 (N, H, W, C) and
                       train_labels, test_labels integer (N,); optional num_classes (else max label + 1)
  load_tfds(name, ...) a tensorflow_datasets dataset prepared as array_record (random access, no TensorFlow needed),
                       e.g. once: `tfds build cifar10 --data_dir DIR --file_format array_record` (add
                       `--manual_dir` for imagenet2012); tensorflow_datasets is imported only here

Batches: {"images": float32 (B, H, W, C) scaled to [-1, 1], "labels": int32 (B,)}. `batch(step)` is a pure function
of (seed, step) over the train split (`qjax.data.order`); `eval_batches` walks the test split in order and drops the
last partial batch (so every batch has the same shape and nothing is double counted).
`image_size` resizes to image_size x image_size, bilinearly and without antialiasing (enough for upscaling digits or
modest downscaling; preprocess real datasets offline if quality matters).
"""

import os
import zipfile

import numpy as np

from qjax.data import order

DIGITS_TEST_SIZE = 360
_DIGITS_SPLIT_SEED = 0  # fixes which digits are held out, whatever the training seed


class ArraySource:
    """Images in memory: images (N, H, W, C) with values in [0, max_value], labels integer (N,)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, max_value: float):
        self.images, self.labels, self.max_value = images, labels, max_value
        self.image_shape = tuple(images.shape[1:])

    def __len__(self):
        return len(self.labels)

    def get(self, indices: np.ndarray):
        return self.images[indices], self.labels[indices]


class TfdsSource:
    """A `tfds.data_source` (array_record, random access) of dicts with uint8 images and integer labels."""

    max_value = 255.0

    def __init__(self, source, image_key: str, label_key: str):
        self.source, self.image_key, self.label_key = source, image_key, label_key
        self.image_shape = tuple(source.dataset_info.features[image_key].shape)

    def __len__(self):
        return len(self.source)

    def get(self, indices: np.ndarray):
        records = self.source.__getitems__([int(i) for i in indices])
        return [np.asarray(r[self.image_key]) for r in records], np.array([r[self.label_key] for r in records])


def resize_bilinear(image: np.ndarray, size: int) -> np.ndarray:
    """(H, W, C) -> float32 (size, size, C), bilinear with half-pixel centres (as jax.image.resize 'linear' when
    upscaling), no antialiasing."""
    out = np.asarray(image, np.float32)
    for axis in (0, 1):
        n = out.shape[axis]
        coords = np.clip((np.arange(size) + 0.5) * (n / size) - 0.5, 0, n - 1)
        low = np.floor(coords).astype(np.int64)
        high = np.minimum(low + 1, n - 1)
        frac = (coords - low).astype(np.float32)
        shape = [1, 1, 1]
        shape[axis] = size
        frac = frac.reshape(shape)
        out = np.take(out, low, axis) * (1 - frac) + np.take(out, high, axis) * frac
    return out


class ImageDataset:
    """Random-access classification batches over a train and a test source.

    Args:
      train, test: `ArraySource` or `TfdsSource` (anything with __len__, get(indices), image_shape, max_value).
      num_classes: labels are in [0, num_classes).
      batch_size, seed: as for `TokenDataset`; the same (seed, step) always gives the same batch.
      image_size: resize to (image_size, image_size) per batch; None keeps the sources' shape (which must be fixed).

    Attributes:
      num_classes; image_shape: (H, W, C) of the batches; num_train, num_test: examples per split.
    """

    def __init__(self, train, test, *, num_classes: int, batch_size: int, seed: int, image_size: int | None = None):
        self.num_classes = order.check_int(num_classes, "num_classes", minimum=2)
        self.batch_size = order.check_int(batch_size, "batch_size", minimum=1)
        self.seed = order.check_int(seed, "seed", minimum=-(1 << 63))
        self.image_size = None if image_size is None else order.check_int(image_size, "image_size", minimum=1)
        self.train, self.test = train, test
        height, width, channels = train.image_shape
        if self.image_size is None and (height is None or width is None):
            raise ValueError(f"images have no fixed size (shape {train.image_shape}): pass image_size")
        if self.image_size is not None:
            height = width = self.image_size
        self.image_shape = (height, width, channels)
        self.num_train, self.num_test = len(train), len(test)
        self._order = order.EpochOrder(self.num_train, self.batch_size, self.seed)

    def _make_batch(self, source, indices: np.ndarray, split: str) -> dict:
        images, labels = source.get(indices)
        if self.image_size is not None:
            images = [resize_bilinear(image, self.image_size) for image in images]
        images = np.stack([np.asarray(image, np.float32) for image in images])
        if images.shape[1:] != self.image_shape:
            raise ValueError(f"a {split} image has shape {images.shape[1:]}, expected {self.image_shape}: pass "
                             "image_size to resize images of varying size")
        labels = np.asarray(labels)
        outside = labels[(labels < 0) | (labels >= self.num_classes)]
        if outside.size:
            raise ValueError(f"{split} label {int(outside[0])} is outside [0, num_classes={self.num_classes})")
        # [0, max_value] -> [-1, 1]
        images = images * np.float32(2.0 / source.max_value) - np.float32(1.0)
        return {"images": images, "labels": labels.astype(np.int32)}

    def batch(self, step) -> dict:
        """Training batch `step` (int >= 0): {"images": float32 (B, H, W, C), "labels": int32 (B,)}."""
        return self._make_batch(self.train, self._order.indices(step), "train")

    def eval_batches(self, num_batches: int | None = None) -> list[dict]:
        """The test split in order, `num_batches` full batches (all full batches when None; the remainder of
        num_test % batch_size images is dropped)."""
        available = self.num_test // self.batch_size
        if available == 0:
            raise ValueError(f"the test split has {self.num_test} images, fewer than batch_size {self.batch_size}: "
                             "use a smaller batch_size")
        if num_batches is None:
            num_batches = available
        num_batches = order.check_int(num_batches, "num_batches", minimum=1)
        if num_batches > available:
            raise ValueError(f"asked for {num_batches} eval batches but the test split holds {self.num_test} "
                             f"images = {available} full batches of {self.batch_size}: ask for at most {available}")
        return [self._make_batch(self.test, np.arange(i * self.batch_size, (i + 1) * self.batch_size), "test")
                for i in range(num_batches)]


def load_digits(*, batch_size: int, seed: int, image_size: int | None = None) -> ImageDataset:
    """scikit-learn's 8x8 digits (pixel values 0..16), split into 1437 train / 360 test images the same way always."""
    from sklearn.datasets import load_digits as sklearn_digits  # noqa: PLC0415 (import cost only when used)

    digits = sklearn_digits()
    images = digits.images.astype(np.float32)[..., None]  # (1797, 8, 8, 1)
    labels = digits.target.astype(np.int32)
    perm = order.epoch_permutation(_DIGITS_SPLIT_SEED, 0, len(labels))
    test, train = perm[:DIGITS_TEST_SIZE], perm[DIGITS_TEST_SIZE:]
    return ImageDataset(ArraySource(images[train], labels[train], 16.0), ArraySource(images[test], labels[test], 16.0),
                        num_classes=10, batch_size=batch_size, seed=seed, image_size=image_size)


def _check_npz_split(data, path, split: str):
    for key in (f"{split}_images", f"{split}_labels"):
        if key not in data:
            raise ValueError(f"{path} has no array {key!r} (has {sorted(data.files)}); an image npz needs "
                             "train_images, train_labels, test_images, test_labels")
    images, labels = data[f"{split}_images"], data[f"{split}_labels"]
    if images.dtype != np.uint8 or images.ndim != 4:
        raise ValueError(f"{path}: {split}_images must be uint8 (N, H, W, C), got {images.dtype} {images.shape} "
                         "(add a channel axis with images[..., None]; scale floats to 0..255 and cast to uint8)")
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer) or len(labels) != len(images):
        raise ValueError(f"{path}: {split}_labels must be integer (N,) with N = {len(images)} images, got "
                         f"{labels.dtype} {labels.shape}")
    return images, labels


def load_npz(path, *, batch_size: int, seed: int, image_size: int | None = None) -> ImageDataset:
    """Images from a local .npz (see the module docstring for its arrays); loaded into memory."""
    if os.path.isfile(path) and not zipfile.is_zipfile(path):
        # np.load would try it as a pickle and suggest allow_pickle=True, which runs code from the file: never that.
        raise ValueError(f"{path} is not a valid .npz file (a zip of arrays, as np.savez writes): save "
                         "train_images, train_labels, test_images and test_labels with np.savez")
    with np.load(path) as data:
        train_images, train_labels = _check_npz_split(data, path, "train")
        test_images, test_labels = _check_npz_split(data, path, "test")
        num_classes = int(data["num_classes"]) if "num_classes" in data else int(
            max(train_labels.max(), test_labels.max()) + 1)
    if train_images.shape[1:] != test_images.shape[1:]:
        raise ValueError(f"{path}: train images {train_images.shape[1:]} and test images {test_images.shape[1:]} "
                         "differ in shape")
    for split, labels in (("train", train_labels), ("test", test_labels)):
        if labels.min() < 0 or labels.max() >= num_classes:
            raise ValueError(f"{path}: {split}_labels must lie in [0, num_classes={num_classes})")
    return ImageDataset(ArraySource(train_images, train_labels, 255.0), ArraySource(test_images, test_labels, 255.0),
                        num_classes=num_classes, batch_size=batch_size, seed=seed, image_size=image_size)


def load_tfds(name: str, *, data_dir, batch_size: int, seed: int, image_size: int | None = None,
              train_split: str = "train", test_split: str = "test", image_key: str = "image",
              label_key: str = "label") -> ImageDataset:
    """A prepared tensorflow_datasets dataset, read through `tfds.data_source` (never downloads)."""
    try:
        import tensorflow_datasets as tfds  # noqa: PLC0415 (optional dependency)
    except ImportError:
        raise ImportError('kind="tfds" needs tensorflow_datasets (and pillow to decode images): `pip install '
                          'tensorflow-datasets pillow`; or use kind="digits" or kind="npz" offline') from None

    sources = {}
    for split in (train_split, test_split):
        try:
            sources[split] = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
        except (ValueError, RuntimeError, FileNotFoundError) as e:
            raise ValueError(f"cannot open tfds dataset {name!r} split {split!r} in {data_dir}: {e}\nBuild it once "
                             f"with `tfds build {name} --data_dir {data_dir} --file_format array_record`") from e
    train = TfdsSource(sources[train_split], image_key, label_key)
    test = TfdsSource(sources[test_split], image_key, label_key)
    num_classes = sources[train_split].dataset_info.features[label_key].num_classes
    return ImageDataset(train, test, num_classes=num_classes, batch_size=batch_size, seed=seed,
                        image_size=image_size)
