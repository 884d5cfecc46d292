"""A local corpus of named sections (one UTF-8 text file, or its .xz) -> token shards with a held-out slice of every
section, and a BPE trained on the training text only.

  python -m qjax.data.prepare corpus --out data/mixed-english --tokenizer bpe --bpe-vocab-size 16384 \
      ../shared/corpus/mixed-english.txt.xz

Sections start with a line `=== name ===` (shared/corpus/README.md lists the mixed-english corpus's seven); text
before the first heading, or a file without headings, is one section "text". The heading lines themselves are
dropped. The last `val_fraction` of each section's bytes (cut at a line end) is its held-out slice; the rest is
training text. Files written into `out`, in `qjax.data.text`'s format (`TokenDataset` reads them):

  texts/NN_name.train.txt, texts/NN_name.val.txt   each section's two parts, as UTF-8 text
  tokenizer.json                                   tokenizer="bpe": trained on the *.train.txt files alone
  train.bin    the sections' training tokens in file order, each followed by the separator token
  val.bin      the held-out slices interleaved in blocks of VAL_BLOCK tokens, each section's blocks in proportion to
               its share of the held-out tokens: the first eval windows (`TokenDataset.eval_batches` reads val.bin
               from its start) cover every section as the whole held-out set does, not the first section alone.
               A window may span two blocks (two sections), the same ones for every run.
  meta.json    as `prepare_text`'s, plus "sections": name, bytes and tokens of each part
"""

import json
import lzma
import pathlib
import re
import time

import numpy as np

from qjax.data import text

VAL_BLOCK = 4096  # tokens per block of val.bin's interleaving (longer than the eval windows of the small configs)
_HEADING = re.compile(r"=== (.+?) ===\n?")
_ENCODE_CHARS, _ENCODE_BATCH = 1 << 18, 32  # BPE encodes batches of 32 chunks of whole lines (~256k characters
# each) in parallel: a section of a few very long lines (sotu: one address a line) still spreads over the cores


def _open_text(path: pathlib.Path):
    """A text file or its .xz, read as UTF-8 lines (errors name the file)."""
    opener = lzma.open if path.suffix == ".xz" else open
    return opener(path, "rt", encoding="utf-8", newline="")


def split_sections(path, texts_dir, val_fraction: float) -> list[dict]:
    """Writes each section of `path` as texts_dir/NN_name.{train,val}.txt (module docstring); returns per section
    {"name", "train": path, "val": path, "train_bytes", "val_bytes"}."""
    path, texts_dir = pathlib.Path(path), pathlib.Path(texts_dir)
    texts_dir.mkdir(parents=True, exist_ok=True)
    whole = []  # (name, path of the section's whole text)
    out = None
    try:
        with _open_text(path) as f:
            for line in f:
                heading = _HEADING.fullmatch(line)
                if out is None and not heading and not line.strip():
                    continue  # blank lines before the first heading
                if heading or out is None:
                    if out is not None:
                        out.close()
                    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", heading.group(1)) if heading else "text"
                    whole.append((name, texts_dir / f"{len(whole):02d}_{name}.txt"))
                    out = open(whole[-1][1], "w", encoding="utf-8", newline="")
                    if heading:
                        continue
                out.write(line)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start} of a chunk)") from None
    except lzma.LZMAError as e:
        raise ValueError(f"{path} is not a valid .xz file ({e})") from None
    finally:
        if out is not None:
            out.close()
    if not whole:
        raise ValueError(f"{path} holds no text")
    sections = []
    for name, section_path in whole:
        data = section_path.read_bytes()
        cut = len(data) - int(round(len(data) * val_fraction))
        cut = data.rfind(b"\n", 0, cut) + 1 if data.rfind(b"\n", 0, cut) >= 0 else cut  # at a line end
        if cut == 0 or cut == len(data):
            raise ValueError(f"section {name!r} of {path} ({len(data)} bytes) leaves an empty "
                             f"{'train' if cut == 0 else 'val'} part at val_fraction={val_fraction}: use more "
                             "text or another fraction")
        parts = {"train": data[:cut], "val": data[cut:]}
        entry = {"name": name}
        for part, content in parts.items():
            entry[part] = section_path.with_suffix(f".{part}.txt")
            entry[part].write_bytes(content)
            entry[f"{part}_bytes"] = len(content)
        section_path.unlink()
        sections.append(entry)
    return sections


def _bpe_tokens(path: pathlib.Path, tokenizer) -> np.ndarray:
    """uint16 tokens of one UTF-8 file: chunks of lines encoded in parallel batches (merges never cross a line
    end's chunk boundary, see `text._bpe_chunks`)."""
    pieces, chunks = [], []

    def flush():
        pieces.extend(np.asarray(e.ids, np.uint16) for e in tokenizer.encode_batch(chunks))
        chunks.clear()

    with open(path, encoding="utf-8", newline="") as f:
        lines, size = [], 0
        for line in f:
            lines.append(line)
            size += len(line)
            if size >= _ENCODE_CHARS:
                chunks.append("".join(lines))
                lines, size = [], 0
                if len(chunks) == _ENCODE_BATCH:
                    flush()
        if lines:
            chunks.append("".join(lines))
        flush()
    return np.concatenate(pieces) if pieces else np.zeros((0,), np.uint16)


def interleave(parts: list[np.ndarray], block: int = VAL_BLOCK) -> np.ndarray:
    """The arrays cut into blocks of `block` tokens and laid out so that every prefix holds each array's blocks in
    about its share of the total (the array furthest behind its share goes next); each array's blocks in order."""
    sizes = np.array([p.size for p in parts], np.float64)
    taken = np.zeros(len(parts), np.int64)
    out = []
    total = sizes.sum()
    while taken.sum() < total:
        done = taken.sum()
        behind = np.where(taken < sizes, sizes / total * (done + block) - taken, -np.inf)
        i = int(np.argmax(behind))
        out.append(parts[i][taken[i]:taken[i] + block])
        taken[i] += out[-1].size
    return np.concatenate(out) if out else np.zeros((0,), np.uint16)


def prepare_corpus(path, out_dir, *, tokenizer: str = "bpe", val_fraction: float = 0.01,
                   bpe_vocab_size: int = 16384) -> dict:
    """Splits the sectioned corpus at `path` (.txt or .xz) and tokenizes it into `out_dir` (module docstring);
    returns the meta dict (plus "seconds", not stored).

    Args:
      tokenizer: "bpe" (a byte-level BPE trained on the training parts, `qjax.data.text.train_bpe`) or "byte".
      val_fraction: share of each section's bytes held out for eval, in (0, 1).
      bpe_vocab_size: the BPE's vocabulary size (ignored for "byte").
    """
    start = time.perf_counter()
    path, out_dir = pathlib.Path(path), pathlib.Path(out_dir)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file not found: {path}")
    if tokenizer not in text.TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}: choose one of {text.TOKENIZERS}")
    if not (isinstance(val_fraction, (int, float)) and 0.0 < val_fraction < 1.0):
        raise ValueError(f"val_fraction must be a number in (0, 1), got {val_fraction!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "meta.json").unlink(missing_ok=True)  # written last: an interrupted prepare never looks finished
    sections = split_sections(path, out_dir / "texts", val_fraction)
    if tokenizer == "bpe":
        tok = text.train_bpe([s["train"] for s in sections], bpe_vocab_size, out_dir / "tokenizer.json")
        raw = text._import_tokenizers().Tokenizer.from_file(str(out_dir / "tokenizer.json"))
        tokens_of = lambda p: _bpe_tokens(p, raw)  # noqa: E731
    else:
        tok = text.ByteTokenizer()
        tokens_of = lambda p: np.concatenate(list(text._byte_chunks(p)) or [np.zeros((0,), np.uint16)])  # noqa: E731
    separator = np.array([tok.separator_id], "<u2")
    val_parts = []
    with open(out_dir / "train.bin", "wb") as train_file:
        for s in sections:
            train = tokens_of(s["train"])
            train_file.write(train.astype("<u2").tobytes() + separator.tobytes())
            val_parts.append(np.concatenate([tokens_of(s["val"]), separator]).astype("<u2"))
            s["train_tokens"], s["val_tokens"] = int(train.size) + 1, int(val_parts[-1].size)
    val = interleave(val_parts, VAL_BLOCK)
    (out_dir / "val.bin").write_bytes(val.astype("<u2").tobytes())
    train_tokens = sum(s["train_tokens"] for s in sections)
    meta = {"format": text.META_FORMAT, "vocab_size": int(tok.vocab_size), "dtype": "uint16", "tokenizer": tok.name,
            "separator_id": int(tok.separator_id), "train_tokens": train_tokens, "val_tokens": int(val.size),
            "val_fraction": val_fraction,
            "sources": [{"path": str(path), "bytes": path.stat().st_size, "tokens": train_tokens + int(val.size)}],
            "sections": [{k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in s.items()} for s in sections],
            "val_block": VAL_BLOCK}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    meta["seconds"] = time.perf_counter() - start
    return meta
