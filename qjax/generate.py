"""Text from a trained or pretrained Llama: `python -m qjax.generate`.

  python -m qjax.generate --workdir runs/llama_int8 --prompt "ROMEO:"       # up to 200 new tokens
  python -m qjax.generate --workdir runs/llama_int8 --prompt "ROMEO:" --temperature 0.8 --top_k 40 --num_samples 3
  python -m qjax.generate --hf_dir path/to/hf_model --prompt "The capital of France is" --int8_weights

--workdir: the newest checkpoint of a `train.py` workdir (its config.json says which model and data); the text is
encoded and decoded with the run's data tokenizer (the byte tokenizer or the local BPE of the token shards, or the
instruct data's tokenizer). --hf_dir: a Hugging Face Llama directory; alone, its weights; with --workdir, only its
tokenizer.json (the `tokenizers` package reads it). Greedy unless --temperature > 0; generation stops at
--max_new_tokens or at the end token: --eos_token, else the eos_token_id in --hf_dir's config.json, else the
instruct data's end token, else the tokenizer's document separator (if it has one). Prompt and new tokens fit in
the model's context (max_seq_len): --max_new_tokens defaults to 200 or what the context leaves, and a larger value is
cut to that with a one-line note on stderr.
"""

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from qjax import data as data_lib
from qjax import models
from qjax.data.text import BPETokenizer
from qjax.train import mesh as mesh_lib
from qjax.train.checkpoint import Checkpointer, abstract_like, has_checkpoint, join_background_threads
from qjax.train.config import ConfigError, read_saved_config
from qjax.train.step import make_train_step
from qjax.train.task import make_dataset, make_task


def restore_workdir(workdir: str):
    """(LlamaConfig, params, step, dataset) of the newest checkpoint of a train.py workdir; ConfigError if none."""
    saved = read_saved_config(workdir)
    if saved is None:
        raise ConfigError(f"{workdir} has no config.json: is it a train.py workdir?")
    config = ml_collections.ConfigDict(saved)
    if config.task != "lm":
        raise ConfigError(f"{workdir} trained config.task={config.task!r}; generation needs a language model ('lm')")
    if config.model.get("arch", "llama") != "llama":
        raise ConfigError(f"{workdir} trained a {config.model.arch} model; generation runs Llama models only")
    directory = os.path.join(workdir, "checkpoints")
    if not has_checkpoint(directory):
        raise ConfigError(f"{workdir} holds no checkpoint yet: train it first (python train.py --config ... --workdir "
                          f"{workdir}); a run saves at every config.checkpoint_every steps and at its end")
    dataset = make_dataset(config)
    task = make_task(config, vocab_size=dataset.vocab_size)
    mesh = mesh_lib.make_mesh(jax.devices()[:1])
    init_state, _ = make_train_step(config, task, mesh)
    checkpointer = Checkpointer(directory, config.keep_checkpoints)
    try:
        step = checkpointer.latest_step()
        state = checkpointer.restore(step, abstract_like(jax.eval_shape(init_state), mesh_lib.replicated(mesh)))
    finally:
        checkpointer.close()
    return task.model_config, state.params, step, dataset


DEFAULT_NEW_TOKENS = 200


def new_tokens(requested: int | None, prompt_len: int, context: int) -> tuple[int, str | None]:
    """(how many tokens to generate, a note when `requested` had to be cut): prompt and new tokens fit in the
    model's `context` (max_seq_len); None asks for DEFAULT_NEW_TOKENS or what the context leaves, without a note."""
    room = context - prompt_len
    if room < 1:
        raise ConfigError(f"the prompt is {prompt_len} tokens, the model's context (max_seq_len) {context}: it leaves "
                          "no room for a new token; shorten --prompt")
    if requested is None:
        return min(DEFAULT_NEW_TOKENS, room), None
    if requested > room:
        return room, (f"note: --max_new_tokens {requested} cut to {room}: the model's context is {context} tokens "
                      f"(max_seq_len) and the prompt takes {prompt_len}")
    return requested, None


def _hf_eos(hf_dir: str) -> int | None:
    """eos_token_id of the directory's config.json, when it is one int."""
    try:
        with open(os.path.join(hf_dir, "config.json")) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError):
        return None
    return eos if isinstance(eos, int) else None


def _hf_tokenizer(hf_dir: str):
    path = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{hf_dir} has no tokenizer.json")
    return BPETokenizer(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qjax.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", help="a train.py workdir: its newest checkpoint and data tokenizer")
    parser.add_argument("--hf_dir", help="a Hugging Face Llama directory (weights unless --workdir; tokenizer.json)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max_new_tokens", type=int, help=f"tokens to generate (default {DEFAULT_NEW_TOKENS}); cut "
                        "to what the model's context (max_seq_len) leaves after the prompt, with a note")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top_k", type=int)
    parser.add_argument("--top_p", type=float)
    parser.add_argument("--seed", type=int, default=0, help="sampling key")
    parser.add_argument("--num_samples", type=int, default=1, help="continuations of the prompt (one batch)")
    parser.add_argument("--eos_token", type=int, help="stop token id (default: --hf_dir's eos_token_id, else the "
                        "tokenizer's separator)")
    parser.add_argument("--recipe", help="forward GEMM recipe for inference, e.g. fp8_rowwise (default: the run's)")
    parser.add_argument("--int8_weights", action="store_true", help="int8 weight-only inference")
    args = parser.parse_args(argv)
    if not (args.workdir or args.hf_dir):
        parser.error("give --workdir or --hf_dir")
    try:
        if args.workdir:
            config, params, step, dataset = restore_workdir(args.workdir)
            tokenizer = (_hf_tokenizer(args.hf_dir) if args.hf_dir else
                         getattr(dataset, "tokenizer", None) or data_lib.load_tokenizer(dataset.directory))
            source, eos = f"{args.workdir} step {step}", getattr(dataset, "eos_token", None)  # instruct data's
        else:
            config, params = models.load_hf_llama(args.hf_dir)
            tokenizer, source, eos = _hf_tokenizer(args.hf_dir), args.hf_dir, None
        source += f", {models.num_params(params) / 1e6:.2f}M params"
        if args.int8_weights:
            params = models.int8_weights(params)
        prompt = np.asarray(tokenizer.encode(args.prompt), np.int32)
        if prompt.size == 0:
            raise ConfigError("--prompt encodes to no tokens")
        max_new_tokens, note = new_tokens(args.max_new_tokens, prompt.size, config.max_seq_len)
        if note:
            print(note, file=sys.stderr)
        for default in (args.eos_token, args.hf_dir and _hf_eos(args.hf_dir), eos, tokenizer.separator_id):
            if default is not None:
                eos = default
                break
        new = models.generate(config, params, jnp.asarray(np.tile(prompt, (args.num_samples, 1))),
                              max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              key=jax.random.key(args.seed), eos_token=eos, recipe=args.recipe)
    except (ConfigError, ValueError, OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        join_background_threads()  # orbax's, of a restore that failed: they would print at interpreter shutdown
        return 2
    print(f"# {source}", file=sys.stderr)
    for row in np.asarray(new):
        if eos is not None and (row == eos).any():
            row = row[:np.flatnonzero(row == eos)[0]]
        print(args.prompt + tokenizer.decode(row, errors="replace"))
        if args.num_samples > 1:
            print("-" * 40)
    return 0


if __name__ == "__main__":
    sys.exit(main())
