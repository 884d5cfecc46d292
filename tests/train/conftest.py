"""Fixtures for the training tests: the repo root on sys.path (for `configs`) and a tiny token corpus."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from qjax.data import prepare_text  # noqa: E402


@pytest.fixture(scope="session")
def token_dir(tmp_path_factory):
    """Byte-token shards of a small, very regular corpus (a tiny model learns it within a few dozen steps)."""
    root = tmp_path_factory.mktemp("corpus")
    words = ["the cat sat on the mat", "a dog ran in the park", "we like to eat red apples", "it is a sunny day"]
    text = ". ".join(words[(i * 7) % len(words)] for i in range(400)) + ".\n"
    (root / "corpus.txt").write_text(text)
    prepare_text([root / "corpus.txt"], root / "tokens", val_fraction=0.1)
    return str(root / "tokens")
