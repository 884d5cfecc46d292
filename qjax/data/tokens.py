"""Language-model batches from token shards (train.bin / val.bin / meta.json written by `qjax.data.text`).

The train split is cut into non-overlapping windows of seq_len + 1 tokens (the last, shorter remainder is unused);
an epoch visits every window once in an order seeded by (seed, epoch) (`qjax.data.order`). A window w gives
inputs = w[:-1] and targets = w[1:]. Windows ignore document boundaries: the separator token is part of the stream,
so a model learns where documents end.

  ds = TokenDataset("data/shakespeare", batch_size=8, seq_len=256, seed=0)
  b = ds.batch(step)           # {"inputs": int32 (8, 256), "targets": int32 (8, 256)}, a pure function of (seed, step)
  evals = ds.eval_batches(4)   # the first 4 * 8 windows of val.bin, in order
"""

import pathlib

import numpy as np

from qjax.data import order, text



def _prepare_hint(directory, force: bool = False) -> str:
    flag = " --force" if force else ""
    return (f"run `python -m qjax.data.prepare shakespeare --out {directory}{flag}` (or `python -m "
            f"qjax.data.prepare text --out {directory}{flag} FILE...` for your own text)")


class TokenDataset:
    """Random-access batches of token windows.

    Args:
      directory: holds train.bin, val.bin (uint16) and meta.json.
      batch_size: windows per batch, B.
      seq_len: tokens per example, T (each window holds T + 1 tokens).
      seed: seeds the window order; the same (seed, step) always gives the same batch.

    Attributes:
      vocab_size: from meta.json. tokens_per_batch: B * T. num_train_windows, num_val_windows: full windows per split.
      meta: the meta.json dict.
    """

    def __init__(self, directory, *, batch_size: int, seq_len: int, seed: int):
        self.directory = pathlib.Path(directory)
        self.batch_size = order.check_int(batch_size, "batch_size", minimum=1)
        self.seq_len = order.check_int(seq_len, "seq_len", minimum=1)
        self.seed = order.check_int(seed, "seed", minimum=-(1 << 63))
        hint = _prepare_hint(self.directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"token directory {self.directory} does not exist: {hint}")
        self.meta = text.read_meta(self.directory)
        for name in ("train.bin", "val.bin"):
            if not (self.directory / name).is_file():
                raise FileNotFoundError(f"{self.directory / name} is missing: {hint}")
        if not text.shards_are_valid(self.directory):
            raise ValueError(f"the shards in {self.directory} do not match its meta.json (an interrupted or "
                             f"foreign prepare?): {_prepare_hint(self.directory, force=True)}")
        self.vocab_size = int(self.meta["vocab_size"])
        dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        self._train = np.memmap(self.directory / "train.bin", dtype=dtype, mode="r")
        self._val = np.memmap(self.directory / "val.bin", dtype=dtype, mode="r")

        window = self.seq_len + 1
        self.num_train_windows = self._train.size // window
        self.num_val_windows = self._val.size // window
        for split, size in (("train", self._train.size), ("val", self._val.size)):
            if size < window:
                raise ValueError(f"seq_len {self.seq_len} needs windows of {window} tokens but the {split} split "
                                 f"has only {size}: use a smaller seq_len or more text")
        if self.num_train_windows < self.batch_size:
            raise ValueError(f"batch_size {self.batch_size} is larger than the {self.num_train_windows} train "
                             f"windows of {window} tokens: use a smaller batch_size or seq_len")
        self._order = order.EpochOrder(self.num_train_windows, self.batch_size, self.seed)
        self.tokens_per_batch = self.batch_size * self.seq_len

    def _windows(self, tokens: np.memmap, split: str, window_ids: np.ndarray) -> dict:
        starts = window_ids * (self.seq_len + 1)
        rows = tokens[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)  # (B, T + 1)
        if rows.max() >= self.vocab_size:
            raise ValueError(f"{split}.bin holds token id {int(rows.max())} >= vocab_size {self.vocab_size} from "
                             f"meta.json: the shards are corrupt; {_prepare_hint(self.directory, force=True)}")
        return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}

    def batch(self, step) -> dict:
        """Training batch `step` (int >= 0): {"inputs": int32 (B, T), "targets": int32 (B, T)}, targets being the
        inputs shifted left by one token. Pure in (seed, step); consecutive steps tile each epoch without overlap."""
        return self._windows(self._train, "train", self._order.indices(step))

    def eval_batches(self, num_batches: int | None = None) -> list[dict]:
        """The first `num_batches` batches of val.bin's windows, in file order (all full batches when None)."""
        available = self.num_val_windows // self.batch_size
        if available == 0:
            raise ValueError(f"val.bin holds {self.num_val_windows} windows of {self.seq_len + 1} tokens, fewer than "
                             f"batch_size {self.batch_size}: use a larger val_fraction when preparing, or a smaller "
                             "batch_size or seq_len")
        if num_batches is None:
            num_batches = available
        num_batches = order.check_int(num_batches, "num_batches", minimum=1)
        if num_batches > available:
            raise ValueError(f"asked for {num_batches} eval batches but val.bin holds {self.num_val_windows} "
                             f"windows of {self.seq_len + 1} tokens = {available} full batches of "
                             f"{self.batch_size}: ask for at most {available}")
        ids = np.arange(num_batches * self.batch_size, dtype=np.int64).reshape(num_batches, self.batch_size)
        return [self._windows(self._val, "val", row) for row in ids]

    @property
    def steps_per_epoch(self) -> float:
        """Training batches per pass over the train windows."""
        return self._order.steps_per_epoch
