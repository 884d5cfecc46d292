"""Fine-tuning from a Hugging Face checkpoint with quantized GEMMs: a random HF-layout Llama, a generated JSONL task,
`train.py`'s loop with `config.init_from`; the loss must fall.

  python benchmarks/finetune.py                     # dim 256, 4 layers, int8_rowwise, 300 steps (GPU); appends a row
  python benchmarks/finetune.py --steps 20 --dim 64 # a CPU smoke run; prints only, unless --write

The task: prompt "reverse <word>:" and answer " <the word reversed>", byte tokens, loss on the answer only (a random
model starts near ln 256 = 5.5, letters guessed uniformly cost ln 26 = 3.3, and below that the model copies from the
prompt). Exits 1 if the last logged training loss is not below 0.7 times the first.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import llama_finetune  # noqa: E402
from qjax import models  # noqa: E402
from qjax.train import train  # noqa: E402
from common import record_results  # noqa: E402


def write_task(path, num_examples, seed=0):
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    with open(path, "w") as f:
        for _ in range(num_examples):
            word = "".join(rng.choice(letters, rng.integers(3, 9)))
            f.write(json.dumps({"prompt": f"reverse {word}:", "answer": f" {word[::-1]}"}) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="int8_rowwise")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--write", action="store_true", help="record results even off a GPU")
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="qjax_finetune_")
    hf_dir, jsonl = os.path.join(work, "hf"), os.path.join(work, "task.jsonl")
    heads = max(1, args.dim // 64)
    model_config = models.llama_config("tiny", vocab_size=256, dim=args.dim, n_layers=args.layers, n_heads=heads,
                                       n_kv_heads=heads, ffn_dim=4 * args.dim, max_seq_len=64)
    params = jax.jit(models.Llama(model_config).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    models.save_hf_llama(model_config, params, hf_dir)
    write_task(jsonl, 4000)

    config = llama_finetune.get_config()
    config.init_from, config.recipe = hf_dir, args.recipe
    config.data.path, config.data.tokenizer = jsonl, "byte"
    config.batch_size, config.seq_len, config.steps = args.batch_size, 32, args.steps
    config.optimizer.lr, config.optimizer.warmup_steps = 1e-3, 20
    config.log_every, config.eval_every, config.eval_batches = 10, args.steps, 4
    config.checkpoint_every = 0
    start = time.perf_counter()
    train(config, os.path.join(work, "run"))
    seconds = time.perf_counter() - start
    with open(os.path.join(work, "run", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    losses = [r["loss"] for r in rows if "loss" in r]
    eval_loss = [r["eval_loss"] for r in rows if "eval_loss" in r][-1]
    ok = losses[-1] < 0.7 * losses[0]
    report = ("| recipe | model | steps | first loss | last loss | eval loss | wall s | falls |\n"
              "|---|---|---|---|---|---|---|---|\n"
              f"| {args.recipe} | dim {args.dim}, {args.layers} layers, {models.num_params(params) / 1e6:.1f}M | "
              f"{args.steps} | {losses[0]:.3f} | {losses[-1]:.3f} | {eval_loss:.3f} | {seconds:.0f} | {ok} |\n\n"
              f"Random HF-layout model written by save_hf_llama, loaded by config.init_from; answer-only loss; "
              f"batch {args.batch_size} x 32 byte tokens; wall time includes compilation.\n")
    print(report)
    if jax.default_backend() == "gpu" or args.write:
        record_results("Fine-tuning from an HF checkpoint (reverse-a-word JSONL)", report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
