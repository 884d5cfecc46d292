"""Deterministic example order: which examples batch `step` holds, as a pure function of (seed, step).

Each epoch visits every example once, in a permutation seeded by (seed, epoch). Batch `step` takes positions
[step * B, (step + 1) * B) of the endless sequence epoch 0, epoch 1, ..., so a batch may straddle two epochs.
The data position of a checkpoint is therefore just its step: resuming at step s gives exactly the batches an
uninterrupted run would have seen.

The permutation comes from a counter-based hash (splitmix64 finaliser) of (seed, epoch, index) followed by a stable
argsort, not from NumPy's Generator, whose streams NumPy does not promise to keep across versions.
"""

import operator

import numpy as np

_MASK64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic): a bijection that scrambles all bits."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
    """The order of epoch `epoch`: int64 (num_examples,), a permutation of range(num_examples)."""
    with np.errstate(over="ignore"):
        # splitmix64: key i = mix(state + golden * (i + 1)), with a state derived from (seed, epoch). The "+ 1"s
        # keep the all-zero input (mix(0) == 0) from pinning example 0 first for seed 0, epoch 0.
        state = _mix64(np.array([seed & _MASK64], np.uint64) + _GOLDEN)
        state = _mix64(state + _GOLDEN * np.uint64((epoch + 1) & _MASK64))
        keys = _mix64(state + _GOLDEN * (np.arange(num_examples, dtype=np.uint64) + np.uint64(1)))
    return np.argsort(keys, kind="stable")


def check_int(value, name: str, *, minimum: int) -> int:
    """`value` as a Python int >= minimum; TypeError for non-integers (bools included), ValueError below minimum."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got the bool {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class EpochOrder:
    """Maps a training step to the indices of its examples.

    Args:
      num_examples: how many examples (token windows, images) one epoch holds; >= batch_size.
      batch_size: examples per batch.
      seed: any Python int; different seeds give different orders.
    """

    def __init__(self, num_examples: int, batch_size: int, seed: int):
        self.num_examples = check_int(num_examples, "num_examples", minimum=1)
        self.batch_size = check_int(batch_size, "batch_size", minimum=1)
        self.seed = check_int(seed, "seed", minimum=-(1 << 63))
        if self.batch_size > self.num_examples:
            raise ValueError(f"batch_size {self.batch_size} is larger than the {self.num_examples} examples of one "
                             "epoch: use a smaller batch_size (or, for tokens, a smaller seq_len or more data)")
        self._cache = {}  # epoch -> permutation; a pure memo, at most two epochs (a batch spans at most two)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            if len(self._cache) >= 2:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = epoch_permutation(self.seed, epoch, self.num_examples)
        return self._cache[epoch]

    def indices(self, step) -> np.ndarray:
        """Example indices of batch `step` (an int >= 0): int64 (batch_size,)."""
        step = check_int(step, "step", minimum=0)
        positions = step * self.batch_size + np.arange(self.batch_size, dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.num_examples)
        out = np.empty(self.batch_size, np.int64)
        for epoch in np.unique(epochs):
            where = epochs == epoch
            out[where] = self._permutation(int(epoch))[offsets[where]]
        return out

    @property
    def steps_per_epoch(self) -> float:
        """Batches per epoch (a float: batches straddle epochs when B does not divide the example count)."""
        return self.num_examples / self.batch_size
