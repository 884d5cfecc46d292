"""A tiny deterministic corpus and its shards, for tests and examples that need token data without a download."""

import pathlib

import numpy as np

from qjax.data import text

_WORDS = ("the king queen lord lady love night day sword crown speak hear heart blood fair foul sweet death life "
          "what why thou thee thy art hath doth shall will not and but or to of in my your his her").split()


def write_tiny_corpus(directory, *, num_files: int = 2, words_per_file: int = 800, seed: int = 0,
                      val_fraction: float = 0.1) -> pathlib.Path:
    """Writes `num_files` small text files (a few KB each, one line per ~10 words, a non-ASCII character or two)
    under directory/texts and byte-level shards under directory/shards; returns the shard directory."""
    directory = pathlib.Path(directory)
    rng = np.random.default_rng(seed)
    (directory / "texts").mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(num_files):
        words = rng.choice(_WORDS, size=words_per_file)
        lines = [" ".join(words[j:j + 10]) for j in range(0, words_per_file, 10)]
        path = directory / "texts" / f"doc{i}.txt"
        path.write_text(f"Act {i} — “scene”\n" + "\n".join(lines) + "\n", encoding="utf-8")
        files.append(path)
    text.prepare_text(files, directory / "shards", val_fraction=val_fraction)
    return directory / "shards"
