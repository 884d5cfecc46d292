"""Offline training data: token shards for language models, images for classifiers.

Prepare text once (`python -m qjax.data.prepare shakespeare --out data/shakespeare`), then:

  import ml_collections, qjax.data
  cfg = ml_collections.ConfigDict({"kind": "tokens", "path": "data/shakespeare"})
  ds = qjax.data.make_dataset(cfg, batch_size=8, seq_len=256, seed=0)
  batch = ds.batch(0)                 # {"inputs", "targets"}: int32 (8, 256); same (seed, step) -> same batch
  evals = ds.eval_batches(4)          # fixed val batches; ds.vocab_size == 256
  digits = qjax.data.make_dataset({"kind": "digits"}, batch_size=32, seed=0)
  digits.batch(0)["images"].shape     # (32, 8, 8, 1) float32 in [-1, 1]; "labels" int32 (32,); digits.num_classes

Every dataset's `batch(step)` is a pure function of (seed, step), so a checkpoint's data position is its step.
Batches are dicts of NumPy arrays in host memory; the training loop moves them to devices.
"""

from collections.abc import Mapping

from qjax.data.images import ImageDataset, load_digits, load_npz, load_tfds
from qjax.data.instruct import InstructDataset
from qjax.data.text import ByteTokenizer, load_tokenizer, prepare_text
from qjax.data.tokens import TokenDataset

# kind -> (required fields, optional fields) besides "kind"
KINDS = {
    "tokens": (("path",), ()),
    "instruct": (("path",), ("tokenizer", "eos_token")),
    "digits": ((), ("image_size",)),
    "npz": (("path",), ("image_size",)),
    "tfds": (("name", "data_dir"), ("image_size", "train_split", "test_split", "image_key", "label_key")),
}


def field_problems(kind: str, data_config) -> tuple[list[str], list[str]]:
    """(missing required fields, fields `kind` does not take) of a data config (a mapping) of a known kind; a field
    set to None counts as unset."""
    required, optional = KINDS[kind]
    fields = [k for k, v in data_config.items() if k != "kind" and v is not None]
    return [k for k in required if k not in fields], sorted(set(fields) - set(required) - set(optional))


def make_dataset(data_config, *, batch_size: int, seq_len: int | None = None, seed: int):
    """Builds the dataset a config describes.

    Args:
      data_config: an ml_collections ConfigDict or a dict with "kind" in KINDS and that kind's fields:
        tokens: path (a directory of shards). instruct: path (a JSONL of prompt/answer pairs), tokenizer ("byte"
        or a tokenizer.json), eos_token (`qjax.data.instruct`). digits: image_size (optional). npz: path (a .npz
        file), image_size.
        tfds: name, data_dir, and optionally image_size, train_split ("train"), test_split ("test"), image_key
        ("image"), label_key ("label"). A field set to None counts as unset (the configs carry every kind's
        fields so that the command line can set them).
      batch_size: examples per batch.
      seq_len: tokens per example; required for "tokens", ignored by image kinds.
      seed: seeds the order of training examples.

    Returns:
      a `TokenDataset` or `InstructDataset` (attribute vocab_size) or an `ImageDataset` (num_classes,
      image_shape), all with batch(step) and eval_batches(num_batches).
    """
    if hasattr(data_config, "to_dict"):
        data_config = data_config.to_dict()
    if not isinstance(data_config, Mapping):
        raise TypeError(f"data_config must be a ConfigDict or dict, got {type(data_config).__name__}")
    kind = data_config.get("kind")
    if kind not in KINDS:
        raise ValueError(f"unknown data kind {kind!r}: set data_config.kind to one of {sorted(KINDS)}")
    missing, unknown = field_problems(kind, data_config)
    if missing:
        raise ValueError(f'data kind "{kind}" needs the field(s) {missing}')
    if unknown:
        raise ValueError(f'unknown field(s) {unknown} for data kind "{kind}": it takes {list(sum(KINDS[kind], ()))}')
    fields = {k: v for k, v in data_config.items() if k != "kind" and v is not None}

    if kind == "tokens":
        if seq_len is None:
            raise ValueError('data kind "tokens" needs seq_len')
        return TokenDataset(fields["path"], batch_size=batch_size, seq_len=seq_len, seed=seed)
    if kind == "instruct":
        if seq_len is None:
            raise ValueError('data kind "instruct" needs seq_len')
        return InstructDataset(fields.pop("path"), batch_size=batch_size, seq_len=seq_len, seed=seed, **fields)
    if kind == "digits":
        return load_digits(batch_size=batch_size, seed=seed, **fields)
    if kind == "npz":
        return load_npz(fields.pop("path"), batch_size=batch_size, seed=seed, **fields)
    return load_tfds(fields.pop("name"), batch_size=batch_size, seed=seed, **fields)


__all__ = ["KINDS", "ByteTokenizer", "ImageDataset", "InstructDataset", "TokenDataset", "load_digits", "load_npz",
           "load_tfds", "field_problems", "load_tokenizer", "make_dataset", "prepare_text"]
