"""Byte tokenizer and prepare_text: round trips, shard contents, meta.json, streaming, errors."""

import importlib.util
import json

import numpy as np
import pytest

from helpers import write_tiny_corpus
from qjax.data import text

SAMPLES = ["", "hello, world\n", "Ünïcödé — “quotes” 日本語 🎭\ttab\r\n", "a" * 1000]


@pytest.mark.parametrize("sample", SAMPLES)
def test_byte_tokenizer_round_trip(sample):
    tok = text.ByteTokenizer()
    ids = tok.encode(sample)
    assert ids.dtype == np.uint16
    assert ids.tolist() == list(sample.encode("utf-8"))
    assert tok.decode(ids) == sample


def test_byte_tokenizer_decode_errors():
    tok = text.ByteTokenizer()
    split_char = tok.encode("🎭")[:2]  # half of a 4-byte character, as a model sample may produce
    with pytest.raises(UnicodeDecodeError):
        tok.decode(split_char)
    assert tok.decode(split_char, errors="replace") == "\ufffd"
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        tok.decode([65, 300])
    with pytest.raises(TypeError, match="str"):
        tok.encode(b"bytes")


def test_prepare_text_shards_and_meta(tmp_path):
    docs = ["First document — ünïcode.\n", "Second one\nwith two lines.\n", "third"]
    files = []
    for i, doc in enumerate(docs):
        files.append(tmp_path / f"d{i}.txt")
        files[-1].write_text(doc, encoding="utf-8")
    meta = text.prepare_text(files, tmp_path / "out", val_fraction=0.25)

    expected = b"".join(d.encode("utf-8") + b"\0" for d in docs)
    train = np.fromfile(tmp_path / "out" / "train.bin", np.uint16)
    val = np.fromfile(tmp_path / "out" / "val.bin", np.uint16)
    assert np.concatenate([train, val]).tolist() == list(expected)
    assert val.size == round(len(expected) * 0.25)

    stored = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert stored["vocab_size"] == 256 and stored["dtype"] == "uint16" and stored["tokenizer"] == "byte"
    assert stored["separator_id"] == 0
    assert (stored["train_tokens"], stored["val_tokens"]) == (train.size, val.size)
    assert [s["path"] for s in stored["sources"]] == [str(f) for f in files]
    assert [s["tokens"] for s in stored["sources"]] == [len(d.encode("utf-8")) + 1 for d in docs]
    assert meta["train_tokens"] == train.size and "seconds" in meta and "seconds" not in stored
    assert text.shards_are_valid(tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_prepare_text_streams_in_chunks(tmp_path, monkeypatch):
    # A tiny read size makes multi-byte characters straddle chunk boundaries; the result must not change.
    sample = "é🎭 ok\n" * 50
    (tmp_path / "a.txt").write_text(sample, encoding="utf-8")
    text.prepare_text([tmp_path / "a.txt"], tmp_path / "whole")
    monkeypatch.setattr(text, "_CHUNK_BYTES", 3)
    text.prepare_text([tmp_path / "a.txt"], tmp_path / "chunked")
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "chunked" / name).read_bytes()


def test_shards_are_valid_detects_truncation(tmp_path):
    shards = write_tiny_corpus(tmp_path)
    assert text.shards_are_valid(shards)
    with open(shards / "train.bin", "r+b") as f:
        f.truncate(100)
    assert not text.shards_are_valid(shards)
    assert not text.shards_are_valid(tmp_path / "nowhere")


def test_prepare_text_errors(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("some text " * 20)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (tmp_path / "nul.txt").write_bytes(b"abc\0def")
    (tmp_path / "cut.txt").write_bytes("🎭".encode("utf-8")[:3])
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"not UTF-8 text \(bad byte at offset 3\)"):
        text.prepare_text([tmp_path / "latin1.txt"], out)
    with pytest.raises(ValueError, match="NUL byte at offset 3"):
        text.prepare_text([tmp_path / "nul.txt"], out)
    with pytest.raises(ValueError, match="middle of a UTF-8 character"):
        text.prepare_text([tmp_path / "cut.txt"], out)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        text.prepare_text([tmp_path / "missing.txt"], out)
    with pytest.raises(TypeError, match="list of paths"):
        text.prepare_text(str(good), out)
    with pytest.raises(ValueError, match="at least one"):
        text.prepare_text([], out)
    with pytest.raises(ValueError, match="unknown tokenizer 'gpt2'"):
        text.prepare_text([good], out, tokenizer="gpt2")
    for bad in (0.0, 1.0, -0.1, "0.1"):
        with pytest.raises(ValueError, match="val_fraction"):
            text.prepare_text([good], out, val_fraction=bad)
    with pytest.raises(ValueError, match="empty val split"):
        text.prepare_text([good], out, val_fraction=1e-6)
    # A failed run leaves no meta.json and no temporary file behind.
    assert not (out / "meta.json").exists() and not list(out.glob("*.tmp"))


def test_read_meta_missing_says_how_to_prepare(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m qjax.data.prepare shakespeare --out"):
        text.read_meta(tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is not None, reason="tokenizers is installed")
def test_bpe_without_tokenizers_says_how_to_install(tmp_path):
    (tmp_path / "a.txt").write_text("text " * 100)
    with pytest.raises(ImportError, match="pip install tokenizers"):
        text.prepare_text([tmp_path / "a.txt"], tmp_path / "out", tokenizer="bpe")


def test_bpe_round_trip(tmp_path):
    pytest.importorskip("tokenizers")
    shards = write_tiny_corpus(tmp_path)  # reuse its text files for training
    files = sorted((tmp_path / "texts").glob("*.txt"))
    meta = text.prepare_text(files, tmp_path / "bpe", tokenizer="bpe", bpe_vocab_size=300)
    tok = text.load_tokenizer(tmp_path / "bpe")
    assert meta["tokenizer"] == "bpe" and meta["vocab_size"] == tok.vocab_size <= 300
    sample = files[0].read_text(encoding="utf-8")
    assert tok.decode(tok.encode(sample)) == sample
    tokens = np.concatenate([np.fromfile(tmp_path / "bpe" / n, np.uint16) for n in ("train.bin", "val.bin")])
    assert tokens.max() < tok.vocab_size and (tokens == tok.separator_id).sum() == len(files)
    assert tokens.size < sum(s["tokens"] for s in text.read_meta(shards)["sources"])  # BPE compresses
