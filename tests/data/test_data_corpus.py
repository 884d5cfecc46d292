"""qjax.data.corpus: a sectioned .xz -> shards holding out the tail of every section, BPE trained on the rest."""

import json
import lzma

import numpy as np
import pytest

from qjax.data import TokenDataset, corpus, load_tokenizer, prepare

SECTIONS = {
    "alpha": "".join(f"alpha line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(60)),
    "beta": "".join(f"beta {i} def f(x): return x * {i}\n" for i in range(30)),
    "gamma": "".join(f"GAMMA, n. {i} A word of the dictionary.\n" for i in range(40)),
}


@pytest.fixture
def corpus_xz(tmp_path):
    text = "\n\n" + "".join(f"=== {name} ===\n{body}" for name, body in SECTIONS.items())
    path = tmp_path / "tiny.txt.xz"
    with lzma.open(path, "wt", encoding="utf-8") as f:
        f.write(text)
    return path


def test_each_section_holds_out_its_tail(corpus_xz, tmp_path):
    sections = corpus.split_sections(corpus_xz, tmp_path / "texts", val_fraction=0.1)
    assert [s["name"] for s in sections] == list(SECTIONS)
    for s, body in zip(sections, SECTIONS.values()):
        train, val = s["train"].read_text(), s["val"].read_text()
        assert train + val == body and train.endswith("\n")  # a contiguous tail, cut at a line end
        assert 0.05 * len(body) < len(val) < 0.2 * len(body)


def test_byte_shards_interleave_every_sections_held_out_slice(corpus_xz, tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "VAL_BLOCK", 64)
    meta = corpus.prepare_corpus(corpus_xz, tmp_path / "out", tokenizer="byte", val_fraction=0.1)
    assert [s["name"] for s in meta["sections"]] == list(SECTIONS)
    val = np.fromfile(tmp_path / "out" / "val.bin", "<u2")
    train = np.fromfile(tmp_path / "out" / "train.bin", "<u2")
    assert val.size == meta["val_tokens"] and train.size == meta["train_tokens"]
    # train.bin: every section's training part, each followed by the separator (byte 0)
    expected = b"".join(open(s["train"], "rb").read() + b"\0" for s in meta["sections"])
    assert train.astype(np.uint8).tobytes() == expected
    # val.bin: the same bytes as the held-out slices, in 64-token blocks mixed in proportion
    held_out = [open(s["val"], "rb").read() + b"\0" for s in meta["sections"]]
    assert sorted(val.astype(np.uint8).tobytes()) == sorted(b"".join(held_out))
    first = val[:val.size // 2].astype(np.uint8).tobytes().decode()  # in proportion: each section by halfway
    assert "alpha" in first and "beta" in first and "GAMMA" in first
    dataset = TokenDataset(tmp_path / "out", batch_size=2, seq_len=16, seed=0)
    assert dataset.vocab_size == 256 and dataset.eval_batches(1)[0]["inputs"].shape == (2, 16)


def test_interleave_keeps_each_arrays_order_and_share():
    a, b = np.arange(0, 40, dtype=np.uint16), np.arange(100, 110, dtype=np.uint16)
    out = corpus.interleave([a, b], block=5)
    assert out[np.isin(out, a)].tolist() == a.tolist() and out[np.isin(out, b)].tolist() == b.tolist()
    assert out[:25].tolist().count(100) == 1  # a 4:1 mix: b's first block among the first five


def test_cli_trains_bpe_on_the_training_text_and_is_idempotent(corpus_xz, tmp_path, capsys):
    out = tmp_path / "bpe"
    args = ["corpus", "--out", str(out), "--tokenizer", "bpe", "--bpe-vocab-size", "300", "--val-fraction", "0.1",
            str(corpus_xz)]
    assert prepare.main(args) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "bpe" and 256 < meta["vocab_size"] <= 300
    tok = load_tokenizer(out)
    val = np.fromfile(out / "val.bin", "<u2")
    assert "GAMMA" in tok.decode(val) and tok.decode(tok.encode("beta 3 def f(x)")) == "beta 3 def f(x)"
    assert prepare.main(args) == 0 and "nothing to do" in capsys.readouterr().out
    assert prepare.main(args[:5] + ["--val-fraction", "0.2", str(corpus_xz)]) == 1  # other settings: refused


def test_bad_input_is_named(tmp_path):
    (tmp_path / "bad.xz").write_bytes(b"not xz at all")
    with pytest.raises(ValueError, match="not a valid .xz"):
        corpus.prepare_corpus(tmp_path / "bad.xz", tmp_path / "o", tokenizer="byte")
    (tmp_path / "one.txt").write_text("=== only ===\nx\n")
    with pytest.raises(ValueError, match="section 'only'.*empty"):
        corpus.prepare_corpus(tmp_path / "one.txt", tmp_path / "o2", tokenizer="byte", val_fraction=0.1)
