"""Peak device memory and tokens/s of a Llama train step per configuration, beside qjax's analytical estimate.

  python benchmarks/memory.py                     # on a GPU: every row (8b, 1b, the torch peer); records its results
  python benchmarks/memory.py --rows 8b_bf16 8b_int8 8b_torch --memory-limit-gb 80   # as on an 80 GB GPU
  python benchmarks/memory.py --small             # every row on the tiny preset (the default without a GPU)

A row is one jitted train step of `qjax.train.make_train_step` (forward, backward, clipping, AdamW) on random
tokens, in its own subprocess (so the allocator's peak is the row's own). Measured: tokens/s (--steps steps queued
back to back, median of 2 rounds after --warmup steps), MFU, and the device's `peak_bytes_in_use`. Beside it the
analytical sum `qjax.train.step.estimate` (params + optimizer states + gradients + saved activations: what the
train loop checks before compiling); peak - estimate is XLA's temporaries and fragmentation. A row that does not
fit reports its error's first line.

The peer row (8b_torch) is Hugging Face LlamaForCausalLM of the same preset's shape trained by torch
(`benchmarks/memory_peer.py`, in its own subprocess after the jax rows: bf16, gradient checkpointing, torch.compile,
torchao's AdamW8bit with bf16 stochastic rounding), at the row's batch and, after an out-of-memory error, half that
down to 1: the table reports the largest batch that fit. MFU uses qjax's FLOPs formula for every row. torch runs
under $QJAX_TORCH_PYTHON if set, else this interpreter.

--memory-limit-gb N caps every row at N GB (1e9 bytes), so a larger GPU fails where an N GB one would: jax rows start
with XLA_CLIENT_MEM_FRACTION = N GB / the GPU's total memory (without it, jax's default fraction), the peer with
torch.cuda.set_per_process_memory_fraction. The "limit GB" column is the limit each row ran under, as its allocator
reports it (jax: bytes_limit; torch: the cap, else the GPU's total memory).
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
# name -> (size, batch, seq): Hugging Face LlamaForCausalLM of the preset's shape, trained by memory_peer.py
PEER_ROWS = {"8b_torch": ("8b", 2, 2048)}
PEER_LABELS = ("torch bf16", "torchao AdamW8bit", "bf16 + SR", True)  # the table's recipe ... remat columns
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

    from common import random_lm_batch, time_ms
    from qjax.train import make_mesh, make_train_step, peak_flops
    from qjax.train import step as step_lib

    config, task = build_row(row, args.small)
    init_state, train_step = make_train_step(config, task)
    estimate = step_lib.estimate(config, task, jax.eval_shape(init_state), make_mesh())
    result = dict(row=row, size=config.model.size, batch=config.batch_size, seq=config.seq_len,
                  estimate_gb=estimate.total / 1e9, estimate_parts=estimate._parts())
    holder, losses = [init_state()], []
    batch = random_lm_batch(np.random.default_rng(0), task.model_config.vocab_size, config.batch_size, config.seq_len)

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
            "limit_gb": stats["bytes_limit"] / 1e9 if "bytes_limit" in stats else None,
            "mfu": tokens_per_s * task.flops_per_unit / peak if peak else None}


def memory_fraction(limit_gb: float, total_bytes: int) -> float:
    """The fraction of a GPU of `total_bytes` that is `limit_gb` GB (1e9 bytes); ValueError if the GPU is smaller."""
    if not limit_gb > 0:
        raise ValueError(f"--memory-limit-gb must be > 0, got {limit_gb}")
    if limit_gb * 1e9 > total_bytes:
        raise ValueError(f"--memory-limit-gb {limit_gb:g} exceeds the GPU's {total_bytes / 1e9:.1f} GB: pass a "
                         "smaller limit, or none")
    return limit_gb * 1e9 / total_bytes


def gpu_total_bytes() -> int:
    """Total memory of the first visible GPU, from nvidia-smi: jax reads its memory fraction when it starts, so the
    fraction must be known before jax is imported."""
    from gpus import visible_gpus

    gpus = visible_gpus()
    if not gpus:
        raise ValueError("--memory-limit-gb needs a GPU (nvidia-smi lists none)")
    out = subprocess.run(["nvidia-smi", "-i", gpus[0], "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) * 2**20  # MiB


def run_child(row: str, argv: list[str]) -> dict:
    """Runs one row's process and returns its last JSON line (or an error); prints the outcome and the time taken."""
    start = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"error": f"exited {proc.returncode}, no result"}
    peak = f", peak {result['peak_gb']:.1f} GB" if result.get("peak_gb") else ""
    outcome = result.get("error") or f"{result['tokens_per_s']:,.0f} tok/s{peak}"
    print(f"{row} (batch {result.get('batch', '?')}): {outcome} ({time.perf_counter() - start:.0f} s with "
          "compilation)", flush=True)
    return {**result, "row": row}


def run_row_subprocess(row: str, args) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--child", row, "--steps", str(args.steps), "--warmup",
            str(args.warmup)] + (["--small"] if args.small else [])
    if args.memory_limit_gb is not None:
        argv += ["--memory-limit-gb", str(args.memory_limit_gb)]
    return run_child(row, argv)


def run_peer(row: str, args) -> dict:
    """The torch peer row (module docstring): memory_peer.py at the row's batch, halved after each out-of-memory
    error down to 1; "failed" lists the batches that did not fit."""
    import jax

    from qjax.models import flops_per_token, llama_config
    from qjax.train import peak_flops

    size, batch, seq = SMALL if args.small else PEER_ROWS[row]
    config = llama_config(size)
    shape = dict(dim=config.dim, layers=config.n_layers, heads=config.n_heads, kv_heads=config.n_kv_heads,
                 ffn=config.ffn_dim, vocab=config.vocab_size, rope_theta=config.rope_theta, seq=seq,
                 steps=args.steps, rounds=ROUNDS, warmup=args.warmup)
    argv = [os.environ.get("QJAX_TORCH_PYTHON") or sys.executable,
            os.path.join(os.path.dirname(os.path.abspath(__file__)), "memory_peer.py")]
    argv += [f"--{key.replace('_', '-')}={value}" for key, value in shape.items()]
    argv += ["--no-compile"] if args.small else []  # the toy shape's CPU check: inductor would take a minute
    if args.memory_limit_gb is not None:
        argv.append(f"--memory-limit-gb={args.memory_limit_gb}")
    failed = []
    while True:
        result = run_child(row, argv + [f"--batch={batch}"])
        if not result.get("oom") or batch == 1:
            break
        failed.append(f"batch {batch}: {result['error'][:120]}")
        batch //= 2
    result.update(size=size, batch=batch, seq=seq, failed=failed)
    peak = peak_flops(jax.devices()[0])
    if "tokens_per_s" in result and peak:
        result["mfu"] = result["tokens_per_s"] * flops_per_token(config, seq) / peak
    return result


def labels(row: str) -> tuple:
    """The table's recipe, optimizer, params and remat columns of `row`."""
    if row in PEER_ROWS:
        return PEER_LABELS
    _, recipe, optimizer, sr, remat, _, _ = ROWS[row]
    return recipe, optimizer, "bf16 + SR" if sr else "fp32", remat


def table(results: list[dict], args) -> str:
    lines = ["| row | size | recipe | optimizer | params | remat | batch x seq | tokens/s | MFU | peak GB | limit GB | "
             "estimate GB | estimate parts |", "|---|---|---|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    notes = []
    for r in results:
        head = f"| {r['row']} | {r.get('size', '?')} | " + " | ".join(map(str, labels(r["row"]))) + \
            f" | {r.get('batch', '?')} x {r.get('seq', '?')} |"
        estimate = f"{r['estimate_gb']:.2f} | {r['estimate_parts']} |" if "estimate_gb" in r else "– | – |"
        limit = f"{r['limit_gb']:.1f}" if r.get("limit_gb") else "–"
        if r.get("failed"):
            notes.append(f"{r['row']} did not fit at " + "; ".join(r["failed"]) + ".")
        if r["row"] in PEER_ROWS:
            notes.append(f"{r['row']}: Hugging Face LlamaForCausalLM of the preset's shape, bf16 params, gradient "
                         "checkpointing, torchao AdamW8bit with bf16 stochastic rounding, "
                         f"{'torch.compile per decoder layer' if r.get('compile') else 'eager'}, torch "
                         f"{r.get('torch', '?')}, torchao {r.get('torchao', '?')}; MFU with qjax's FLOPs per token.")
        if "error" in r:
            lines.append(f"{head} failed: {r['error'][:160]} | | | {limit} | {estimate}")
            continue
        peak = f"{r['peak_gb']:.1f}" if r.get("peak_gb") else "–"
        mfu = f"{r['mfu']:.2f}" if r.get("mfu") else "–"
        lines.append(f"{head} {r['tokens_per_s']:,.0f} | {mfu} | {peak} | {limit} | {estimate}")
    cap = (f"Each row capped at {args.memory_limit_gb:g} GB (jax: XLA_CLIENT_MEM_FRACTION; torch: "
           "set_per_process_memory_fraction)" if args.memory_limit_gb is not None else "No memory cap set")
    note = (f"Random tokens, one subprocess per row; tokens/s: {args.steps} steps queued back to back, median of "
            f"{ROUNDS} rounds after {args.warmup} warm-up steps. peak GB: the device's peak_bytes_in_use (torch: "
            "max_memory_allocated); limit GB: the allocator's limit the row ran under. "
            f"{cap}. estimate: qjax.train.step.estimate (params + optimizer, gradients, saved activations; no XLA "
            "temporaries).")
    return "\n".join(lines) + "\n\n" + " ".join([note, *notes]) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", choices=[*ROWS, *PEER_ROWS], default=[*ROWS, *PEER_ROWS])
    parser.add_argument("--small", action="store_true", help="tiny preset (default without a GPU)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--memory-limit-gb", type=float, help="cap every row at this many GB (default: none)")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        try:
            if args.memory_limit_gb is not None:  # read once, when jax starts its GPU client
                os.environ.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)  # the old name: jax refuses both
                os.environ["XLA_CLIENT_MEM_FRACTION"] = str(memory_fraction(args.memory_limit_gb, gpu_total_bytes()))
            print(json.dumps(measure_row(args.child, args)), flush=True)
        except Exception as e:  # reported in the table rather than ending the benchmark
            print(json.dumps({"row": args.child, "error": f"{type(e).__name__}: {e}"[:2000]}), flush=True)
        return
    import jax

    from common import record_results, device_kind

    args.small = args.small or jax.default_backend() != "gpu"
    if args.memory_limit_gb is not None:
        if jax.default_backend() != "gpu":
            parser.error("--memory-limit-gb needs a GPU")
        try:
            memory_fraction(args.memory_limit_gb, gpu_total_bytes())
        except ValueError as e:
            parser.error(str(e))
    print(f"train-step memory on {device_kind()}, jax {jax.__version__}: {len(args.rows)} rows", flush=True)
    # The peer last: by then every jax row's process has ended and released the GPU.
    results = [run_row_subprocess(row, args) for row in args.rows if row in ROWS]
    results += [run_peer(row, args) for row in args.rows if row in PEER_ROWS]
    report = table(results, args)
    print("\n" + report)
    if not args.no_record and not args.small:
        record_results("Llama train step: peak memory and tokens/s against the estimate", report)


if __name__ == "__main__":
    main()
