"""Text -> token shards: a byte-level tokenizer (the default), an optional locally trained BPE, and `prepare_text`.

`prepare_text(files, out_dir)` writes, in the nanoGPT format:
  train.bin, val.bin   uint16 token ids, raw little-endian, no header (read with np.memmap)
  meta.json            vocab_size, dtype, tokenizer, separator_id, token counts, source files
  tokenizer.json       only for tokenizer="bpe" (the `tokenizers` library's own format)

Documents (files) are concatenated in the order given, each followed by one separator token; the last
`val_fraction` of the concatenation is the validation split (so val is the end of the last document(s), as in
nanoGPT's shakespeare_char). Files are read and encoded in chunks, and tokens go straight to disk.

The byte tokenizer maps text to its UTF-8 bytes (vocab 256) and uses byte 0 (NUL) as the document separator, so
input files must not contain NUL (a text file never does; `prepare_text` rejects one that does).
"""

import codecs
import json
import os
import pathlib
import tempfile
import time

import numpy as np

META_FORMAT = "qjax-tokens-v1"
TOKENIZERS = ("byte", "bpe")
BYTE_VOCAB_SIZE = 256
BYTE_SEPARATOR_ID = 0
BPE_SEPARATOR = "<|endoftext|>"
_CHUNK_BYTES = 1 << 22  # 4 MiB per read: bounds memory for any corpus size
_BPE_CHUNK_LINES = 4096


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, no training, exact round trip of any str."""

    name = "byte"
    vocab_size = BYTE_VOCAB_SIZE
    separator_id = BYTE_SEPARATOR_ID

    def encode(self, text: str) -> np.ndarray:
        """str -> uint16 (n,) token ids, one per UTF-8 byte."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.uint16)

    def decode(self, ids, errors: str = "strict") -> str:
        """Token ids (any integer array-like) -> str. Model samples may split a multi-byte character: pass
        errors="replace" to show those as U+FFFD instead of raising UnicodeDecodeError."""
        ids = np.asarray(ids)
        if ids.size and (not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= 256):
            raise ValueError("byte token ids must be integers in [0, 256)")
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors=errors)


class BPETokenizer:
    """A byte-level BPE from the `tokenizers` library (optional dependency), trained locally by `prepare_text`."""

    name = "bpe"

    def __init__(self, path):
        tokenizers = _import_tokenizers()
        self._tokenizer = tokenizers.Tokenizer.from_file(os.fspath(path))
        self.vocab_size = self._tokenizer.get_vocab_size()
        self.separator_id = self._tokenizer.token_to_id(BPE_SEPARATOR)

    def encode(self, text: str) -> np.ndarray:
        """str -> uint16 (n,) token ids."""
        return np.asarray(self._tokenizer.encode(text).ids, np.uint16)

    def decode(self, ids, errors: str = "strict") -> str:
        """Token ids -> str (byte-level BPE decodes exactly; `errors` is accepted for symmetry with bytes)."""
        del errors
        return self._tokenizer.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=False)


def _import_tokenizers():
    try:
        import tokenizers  # noqa: PLC0415 (optional dependency)
    except ImportError:
        raise ImportError('tokenizer="bpe" needs the `tokenizers` package: `pip install tokenizers`, or use the '
                          'default tokenizer="byte"') from None
    return tokenizers


def train_bpe(text_files, vocab_size: int, path) -> BPETokenizer:
    """Trains a byte-level BPE on `text_files` (streamed by `tokenizers`) and saves it to `path` (tokenizer.json)."""
    tokenizers = _import_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    if not 256 < vocab_size <= 65535:
        raise ValueError(f"bpe vocab_size must be in (256, 65535] (uint16 shards), got {vocab_size}")
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPE_SEPARATOR],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train([os.fspath(f) for f in text_files], trainer)
    tokenizer.save(os.fspath(path))
    return BPETokenizer(path)


def load_tokenizer(directory):
    """The tokenizer that wrote the shards in `directory` (from its meta.json)."""
    meta = read_meta(directory)
    if meta["tokenizer"] == "byte":
        return ByteTokenizer()
    return BPETokenizer(pathlib.Path(directory) / "tokenizer.json")


def read_meta(directory) -> dict:
    """meta.json of a shard directory, with a clear error when it is missing."""
    path = pathlib.Path(directory) / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"no token shards in {directory} (missing meta.json): run `python -m "
                                f"qjax.data.prepare shakespeare --out {directory}` (or `prepare text --out "
                                f"{directory} FILE...` for your own text)")
    return json.loads(path.read_text())


def shards_are_valid(directory) -> bool:
    """True when `directory` holds meta.json and train/val shards whose sizes match it (a finished prepare)."""
    directory = pathlib.Path(directory)
    try:
        meta = read_meta(directory)
        itemsize = np.dtype(meta["dtype"]).itemsize
        return (meta.get("format") == META_FORMAT
                and (directory / "train.bin").stat().st_size == meta["train_tokens"] * itemsize
                and (directory / "val.bin").stat().st_size == meta["val_tokens"] * itemsize)
    except (FileNotFoundError, KeyError, TypeError, ValueError):
        return False


def _byte_chunks(path):
    """Yields uint16 token chunks of one file for the byte tokenizer, checking UTF-8 and NUL on the way."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
    offset = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                raise ValueError(f"{path} is not UTF-8 text (bad byte at offset {offset + e.start}); convert it "
                                 "with e.g. `iconv -t utf-8`") from None
            nul = chunk.find(b"\0")
            if nul >= 0:
                raise ValueError(f"{path} contains a NUL byte at offset {offset + nul}: not a text file? (byte 0 "
                                 "is the document separator of the byte tokenizer)")
            offset += len(chunk)
            yield np.frombuffer(chunk, np.uint8).astype(np.uint16)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise ValueError(f"{path} ends in the middle of a UTF-8 character: not valid UTF-8 text") from None


def _bpe_chunks(path, tokenizer: BPETokenizer):
    """Yields token chunks of one file, encoding a few thousand lines at a time (tokens may differ from encoding the
    whole file at once only where a merge would cross a chunk boundary, which is always after a newline)."""
    with open(path, encoding="utf-8") as f:
        lines = []
        for line in f:
            lines.append(line)
            if len(lines) == _BPE_CHUNK_LINES:
                yield tokenizer.encode("".join(lines))
                lines = []
        if lines:
            yield tokenizer.encode("".join(lines))


def prepare_text(text_files, out_dir, *, tokenizer: str = "byte", val_fraction: float = 0.05,
                 bpe_vocab_size: int = 4096) -> dict:
    """Tokenizes `text_files` into `out_dir`/{train.bin, val.bin, meta.json}; returns the meta dict.

    Args:
      text_files: paths of UTF-8 text files, one document each, concatenated in this order.
      out_dir: created if missing; existing shards are overwritten (the CLI checks `shards_are_valid` first).
      tokenizer: "byte" (vocab 256) or "bpe" (needs `tokenizers`; trained on these files, saved as tokenizer.json).
      val_fraction: share of tokens, taken from the end, that goes to val.bin; in (0, 1).
      bpe_vocab_size: vocabulary size of the BPE (ignored for "byte").
    """
    start = time.perf_counter()
    if isinstance(text_files, (str, os.PathLike)):
        raise TypeError("text_files must be a list of paths, not a single path: write [path]")
    text_files = [pathlib.Path(f) for f in text_files]
    if not text_files:
        raise ValueError("prepare_text needs at least one text file")
    for f in text_files:
        if not f.is_file():
            raise FileNotFoundError(f"text file not found: {f}")
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}: choose one of {TOKENIZERS}")
    if not (isinstance(val_fraction, (int, float)) and 0.0 < val_fraction < 1.0):
        raise ValueError(f"val_fraction must be a number in (0, 1), got {val_fraction!r}")
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # meta.json goes last, so an interrupted run never looks finished to `shards_are_valid`.
    (out_dir / "meta.json").unlink(missing_ok=True)

    if tokenizer == "byte":
        tok = ByteTokenizer()
        chunks_of = _byte_chunks
    else:
        tok = train_bpe(text_files, bpe_vocab_size, out_dir / "tokenizer.json")
        chunks_of = lambda path: _bpe_chunks(path, tok)  # noqa: E731
    separator = np.array([tok.separator_id], np.uint16)

    # All tokens go to one temporary file first (the total is unknown until the end for BPE), then the tail is cut
    # off as val. Both passes stream.
    sources = []
    with tempfile.NamedTemporaryFile(dir=out_dir, prefix="all.", suffix=".tmp", delete=False) as tmp:
        tmp_path = pathlib.Path(tmp.name)
        try:
            for path in text_files:
                count = 0
                for chunk in chunks_of(path):
                    tmp.write(chunk.astype("<u2").tobytes())
                    count += chunk.size
                tmp.write(separator.astype("<u2").tobytes())
                sources.append({"path": str(path), "bytes": path.stat().st_size, "tokens": count + 1})
        except BaseException:
            tmp.close()
            tmp_path.unlink(missing_ok=True)
            raise
    try:
        total = sum(s["tokens"] for s in sources)
        val_tokens = int(round(total * val_fraction))
        train_tokens = total - val_tokens
        if val_tokens == 0 or train_tokens == 0:
            raise ValueError(f"{total} tokens with val_fraction={val_fraction} leave an empty "
                             f"{'val' if val_tokens == 0 else 'train'} split: use more text or another fraction")
        all_tokens = np.memmap(tmp_path, dtype="<u2", mode="r")
        _copy_tokens(all_tokens[:train_tokens], out_dir / "train.bin")
        _copy_tokens(all_tokens[train_tokens:], out_dir / "val.bin")
        del all_tokens
    finally:
        tmp_path.unlink(missing_ok=True)

    meta = {"format": META_FORMAT, "vocab_size": int(tok.vocab_size), "dtype": "uint16", "tokenizer": tok.name,
            "separator_id": int(tok.separator_id), "train_tokens": train_tokens, "val_tokens": val_tokens,
            "val_fraction": val_fraction, "sources": sources}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    meta["seconds"] = time.perf_counter() - start  # returned for reporting, not stored (shards are reproducible)
    return meta


def _copy_tokens(tokens: np.ndarray, path: pathlib.Path):
    with open(path, "wb") as f:
        for i in range(0, tokens.size, _CHUNK_BYTES):
            f.write(np.ascontiguousarray(tokens[i:i + _CHUNK_BYTES]).tobytes())
