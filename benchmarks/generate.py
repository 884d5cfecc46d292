"""Inference speed of `qjax.models.generate`: prefill time and decode tokens/s, bf16 vs quantized, with the logits'
SNR against bf16.

  python benchmarks/generate.py                     # the 1b preset (random weights), batch 1 and 8; appends a table
  python benchmarks/generate.py --size tiny         # auto-on without a GPU; prints only, unless --write
  python benchmarks/generate.py --rows bf16 int8_weights fp8_rowwise int8_rowwise

Rows: bf16 (bfloat16 weights and GEMMs), int8_weights (int8 weight-only: the kernels stored as int8 codes with one
scale per output feature, `qjax.models.int8_weights`, dequantized to bf16 inside the jitted step), and any recipe
name (its forward GEMMs quantized, weights bf16; the LM head stays bf16 as in training). Weights are random (the
preset's init); params are bfloat16. Prefill ms: `generate` of one token (the prompt's forward that fills the KV
cache, and an argmax). Decode: `generate` of --new_tokens greedy tokens minus that, i.e. --new_tokens - 1 one-token
forwards; tokens/s counts every row of the batch. SNR: the prompt's last-position logits against the bf16 row's,
in dB (at the first batch size only, to save compiles).
"""

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qjax import models  # noqa: E402
from common import record_results, snr_db  # noqa: E402


def _median_s(fn, reps):
    jax.block_until_ready(fn())  # compile + warm up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def run_row(row, config, params, prompt, new_tokens, reps, with_logits):
    """(prefill ms, decode tokens/s, last-position logits or None) of one row at one batch size."""
    if row == "int8_weights":
        params = models.int8_weights(params)
    else:
        config = dataclasses.replace(config, recipe=row)
    one = _median_s(lambda: models.generate(config, params, prompt, 1), reps)
    many = _median_s(lambda: models.generate(config, params, prompt, new_tokens), reps)
    tokens_per_s = prompt.shape[0] * (new_tokens - 1) / (many - one)
    logits = None
    if with_logits:
        forward = jax.jit(lambda p, x: models.Llama(config).apply({"params": models.dequantize_weights(
            p, jnp.bfloat16)}, x)[:, -1])
        logits = forward(params, prompt)
    return one * 1e3, tokens_per_s, logits


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    on_gpu = jax.default_backend() == "gpu"
    parser.add_argument("--size", default="1b" if on_gpu else "tiny", choices=list(models.LLAMA_SIZES))
    parser.add_argument("--rows", nargs="+", default=["bf16", "int8_weights", "fp8_rowwise"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="record results even off a GPU")
    args = parser.parse_args()
    if args.rows[0] != "bf16":
        args.rows = ["bf16"] + [r for r in args.rows if r != "bf16"]  # the baseline of the SNR column

    config = models.llama_config(args.size, compute_dtype="bfloat16", param_dtype="bfloat16",
                                 max_seq_len=args.prompt_len + args.new_tokens)
    params = jax.jit(models.Llama(config).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    lines = [f"| batch | row | prefill ms ({args.prompt_len} tokens) | decode tok/s | x bf16 | logits SNR dB |",
             "|---|---|---|---|---|---|"]
    for batch in args.batches:
        prompt = jax.random.randint(jax.random.key(batch), (batch, args.prompt_len), 0, config.vocab_size)
        base = None
        for row in args.rows:
            start = time.perf_counter()
            with_logits = batch == args.batches[0]  # one more compile per row: the SNR at the first batch size only
            prefill_ms, tok_s, logits = run_row(row, config, params, prompt, args.new_tokens, args.reps, with_logits)
            base = base or (tok_s, logits)
            snr = f"{snr_db(base[1], logits):.1f}" if with_logits else "-"
            line = f"| {batch} | {row} | {prefill_ms:.2f} | {tok_s:,.0f} | {tok_s / base[0]:.2f} | {snr} |"
            print(line, f"({time.perf_counter() - start:.0f} s with compiles)", flush=True)
            lines.append(line)
    report = "\n".join(lines) + (f"\n\nLlama {args.size} (random weights, bf16 params), greedy, {args.new_tokens} "
                                 "new tokens; decode = generate(N) - generate(1).\n")
    print(report)
    if on_gpu or args.write:
        record_results(f"Generation: prefill and decode, Llama {args.size}", report)


if __name__ == "__main__":
    main()
