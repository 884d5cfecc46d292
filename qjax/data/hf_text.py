"""Text from a Hugging Face dataset, streamed (only where a network is there; never needed by the default run).

  python -m qjax.data.prepare hf --dataset roneneldan/TinyStories --max-mb 50 --out data/tinystories

`fetch_hf_text` streams the dataset's records with `datasets.load_dataset(..., streaming=True)` (nothing is
downloaded beyond what is read), writes their text field to UTF-8 files of about `file_mb` MB each under
`out_dir`, and stops after `max_mb` MB; `qjax.data.prepare` then tokenizes those files like any local text. Records
are separated by a blank line. The `datasets` package is optional: `pip install datasets`.
"""

import pathlib

_MB = 2**20


def _load_dataset():
    try:
        from datasets import load_dataset  # noqa: PLC0415 (optional dependency)
    except ImportError:
        raise ImportError("the hf corpus needs the `datasets` package (`pip install datasets`) and a network; "
                          "offline, use `prepare shakespeare` or `prepare text FILE...`") from None
    return load_dataset


def fetch_hf_text(dataset: str, out_dir, *, name: str | None = None, split: str = "train", text_field: str = "text",
                  max_mb: float = 100.0, file_mb: float = 32.0) -> list[pathlib.Path]:
    """Streams `dataset` (config `name`, `split`) and writes up to `max_mb` MB of its `text_field` into text files.

    Returns:
      the files written, in order (out_dir/part-00000.txt, ...).
    """
    if not max_mb > 0 or not file_mb > 0:
        raise ValueError(f"max_mb and file_mb must be > 0, got {max_mb} and {file_mb}")
    records = _load_dataset()(dataset, name, split=split, streaming=True)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files, written, handle, in_file = [], 0, None, 0
    try:
        for record in records:
            if text_field not in record:
                raise ValueError(f"{dataset} records have no field {text_field!r} (they have {sorted(record)}): "
                                 "pass --text-field")
            data = (record[text_field].strip() + "\n\n").encode("utf-8")
            if handle is None or in_file >= file_mb * _MB:
                if handle is not None:
                    handle.close()
                files.append(out_dir / f"part-{len(files):05d}.txt")
                handle, in_file = open(files[-1], "wb"), 0
            handle.write(data)
            in_file += len(data)
            written += len(data)
            if written >= max_mb * _MB:
                break
    finally:
        if handle is not None:
            handle.close()
    if not written:
        raise ValueError(f"{dataset} split {split!r} streamed no records")
    return files
