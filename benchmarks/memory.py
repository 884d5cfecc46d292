"""Peak device memory and tokens/s of a Llama train step per configuration, beside qjax's analytical estimate.

  python benchmarks/memory.py                     # on a GPU: every row (8b and 1b); appends to RESULTS.md
  python benchmarks/memory.py --rows 8b_bf16 8b_int8
  python benchmarks/memory.py --small             # every row on the tiny preset (the default without a GPU)

A row is one jitted train step of `qjax.train.make_train_step` (forward, backward, clipping, AdamW) on random
tokens, in its own subprocess (so the allocator's peak is the row's own). Measured: tokens/s (--steps steps queued
back to back, median of 2 rounds after --warmup steps), MFU, and the device's `peak_bytes_in_use`. Beside it the
analytical sum `qjax.train.memory.estimate` (params + optimizer states + gradients + saved activations: what the
train loop checks before compiling); peak - estimate is XLA's temporaries and fragmentation. A row that does not
fit reports its error's first line.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # rows run in subprocesses, one after another

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

# name -> (size, recipe, optimizer, bf16 params + stochastic rounding, remat, batch, seq)
ROWS = {
    "8b_bf16": ("8b", "bf16", "adamw_8bit", True, True, 2, 2048),
    "8b_int8": ("8b", "int8_rowwise", "adamw_8bit", True, True, 2, 2048),
    "1b_bf16_adamw": ("1b", "bf16", "adamw", False, False, 8, 2048),
    "1b_bf16_sr_8bit": ("1b", "bf16", "adamw_8bit", True, False, 8, 2048),
    "1b_int8_sr_8bit": ("1b", "int8_rowwise", "adamw_8bit", True, False, 8, 2048),
}
SMALL = ("tiny", 2, 64)  # --small: every row's size, batch, seq
ROUNDS = 2


def build_row(row: str, small: bool):
    """(config, task) of one row (module docstring)."""
    from common import REPO

    sys.path.insert(0, str(REPO))  # the configs/ package
    from configs import llama_base
    from qjax.train import make_task

    size, recipe, optimizer, sr, remat, batch, seq = ROWS[row]
    if small:
        size, batch, seq = SMALL
    config = llama_base.get_config()
    config.model.size = size
    config.model.remat = remat
    config.recipe = recipe
    config.optimizer.name = optimizer
    if sr:
        config.model.param_dtype = "bfloat16"
        config.optimizer.stochastic_rounding = True
    config.seq_len, config.batch_size = seq, batch
    config.steps = 1000  # the LR schedule's length; irrelevant here
    return config, make_task(config)


def measure_row(row: str, args) -> dict:
    """Runs in the child process: the estimate, then tokens/s, MFU and peak memory of the timed steps."""
    import jax
    import numpy as np

    from common import time_ms
    from qjax.train import make_mesh, make_train_step, memory, peak_flops

    config, task = build_row(row, args.small)
    init_state, train_step = make_train_step(config, task)
    estimate = memory.estimate(config, task, jax.eval_shape(init_state), make_mesh())
    result = dict(row=row, size=config.model.size, batch=config.batch_size, seq=config.seq_len,
                  estimate_gb=estimate.total / 1e9, estimate_parts=estimate._parts())
    holder, losses = [init_state()], []
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, task.model_config.vocab_size, (config.batch_size, config.seq_len + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def run_one():  # the state is donated: thread it through; wait on the loss
        holder[0], metrics = train_step(holder[0], batch)
        losses.append(metrics["loss"])
        return losses[-1]

    try:
        ms = time_ms(run_one, (), warmup=args.warmup, reps=ROUNDS, inner=args.steps)
    except Exception as e:  # out of memory: the table says so, with the estimate beside it
        return {**result, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"[:300]}
    if not all(np.isfinite([float(x) for x in losses])):
        return {**result, "error": "non-finite loss"}
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    tokens_per_s = config.batch_size * config.seq_len / ms * 1e3
    peak = peak_flops(device)
    return {**result, "tokens_per_s": tokens_per_s, "step_ms": ms, "device": device.device_kind,
            "peak_gb": stats["peak_bytes_in_use"] / 1e9 if "peak_bytes_in_use" in stats else None,
            "mfu": tokens_per_s * task.flops_per_unit / peak if peak else None}


def run_row_subprocess(row: str, args) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--child", row, "--steps", str(args.steps), "--warmup",
            str(args.warmup)] + (["--small"] if args.small else [])
    start = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"row": row, "error": f"exited {proc.returncode}, no result"}
    outcome = result.get("error") or f"{result['tokens_per_s']:,.0f} tok/s"
    print(f"{row}: {outcome} ({time.perf_counter() - start:.0f} s with compilation)", flush=True)
    return result


def table(results: list[dict], args) -> str:
    lines = ["| row | size | recipe | optimizer | params + SR | remat | batch x seq | tokens/s | MFU | peak GB | "
             "estimate GB | estimate parts |", "|---|---|---|---|---|---|---|---:|---:|---:|---:|---|"]
    for r in results:
        _, recipe, optimizer, sr, remat, _, _ = ROWS[r["row"]]
        head = (f"| {r['row']} | {r.get('size', '?')} | {recipe} | {optimizer} | {'bf16 + SR' if sr else 'fp32'} | "
                f"{remat} | {r.get('batch', '?')} x {r.get('seq', '?')} |")
        estimate = f"{r['estimate_gb']:.2f} | {r['estimate_parts']} |" if "estimate_gb" in r else "– | – |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error'][:160]} | | | {estimate}")
            continue
        peak = f"{r['peak_gb']:.1f}" if r.get("peak_gb") else "–"
        mfu = f"{r['mfu']:.2f}" if r.get("mfu") else "–"
        lines.append(f"{head} {r['tokens_per_s']:,.0f} | {mfu} | {peak} | {estimate}")
    note = (f"Random tokens, one subprocess per row; tokens/s: {args.steps} steps queued back to back, median of "
            f"{ROUNDS} rounds after {args.warmup} warm-up steps. peak GB: the device's peak_bytes_in_use; estimate: "
            "qjax.train.memory.estimate (params + optimizer, gradients, saved activations; no XLA temporaries).")
    return "\n".join(lines) + "\n\n" + note + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--small", action="store_true", help="tiny preset (default without a GPU)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-append", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        try:
            print(json.dumps(measure_row(args.child, args)), flush=True)
        except Exception as e:  # reported in the table rather than ending the benchmark
            print(json.dumps({"row": args.child, "error": f"{type(e).__name__}: {e}"[:2000]}), flush=True)
        return
    import jax

    from common import append_results, device_kind

    args.small = args.small or jax.default_backend() != "gpu"
    print(f"train-step memory on {device_kind()}, jax {jax.__version__}: {len(args.rows)} rows", flush=True)
    report = table([run_row_subprocess(row, args) for row in args.rows], args)
    print("\n" + report)
    if not args.no_append and not args.small:
        append_results("Llama train step: peak memory and tokens/s against the estimate", report)


if __name__ == "__main__":
    main()
