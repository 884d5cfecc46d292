"""Is a train step bit-reproducible on this device? One compiled step runs the same batches twice from the same
init, on one device; the table gives the first step whose loss differs, the largest relative difference of the
losses, and whether the final parameters are bit-identical.

  python benchmarks/reproducibility.py                        # 125m, batch 32 x 1024, bf16 and int8_rowwise (GPU)
  python benchmarks/reproducibility.py --attention auto xla   # cuDNN flash attention against XLA's attention
  python benchmarks/reproducibility.py --xla-deterministic   # with XLA's --xla_gpu_deterministic_ops=true

Without a GPU it runs the tiny model on batch 4 x 64, where every step is bit-identical (tests/test_reproducibility.py
checks it). On an H200 (jax 0.11.2) the step with cuDNN's flash attention differs from step 3, and the one with XLA's
attention is bit-identical at about twice the step time (benchmarks/README.md, "reproducibility"); the flag fails to
compile the cuDNN step. A row whose step fails to compile says so instead of stopping the table; rows finished
before a SIGTERM (the suite runner's deadline) are still recorded, the table noting how many.
"""

import argparse
import math
import os
import signal
import sys
import time

from common import REPO, apply_options, device_kind, random_lm_batch, record_results, split_options

sys.path.insert(0, str(REPO))  # the configs/ package
from configs import llama_base  # noqa: E402


def repeat_run(config, steps: int, seed: int = 0) -> tuple[list[float], list[float], bool, float]:
    """Trains `steps` steps twice from `config`'s init with one compiled step on the first device, on random tokens
    drawn from `seed` (the same batches both times). Returns (losses of run 1, losses of run 2, whether the final
    params are bit-identical, the second run's seconds per step)."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from qjax.train import make_mesh, make_task, make_train_step  # noqa: PLC0415

    task = make_task(config)
    rng = np.random.default_rng(seed)
    batches = [random_lm_batch(rng, task.model_config.vocab_size, config.batch_size, config.seq_len)
               for _ in range(steps)]
    # one device: a data-parallel mesh over several would add its all-reduce to what is measured
    init_state, train_step = make_train_step(config, task, make_mesh(jax.devices()[:1]))
    runs, params, seconds = [], [], 0.0
    for _ in range(2):
        state, losses = init_state(), []
        start = time.perf_counter()
        for batch in batches:
            state, metrics = train_step(state, batch)  # the state is donated: thread it through
            losses.append(metrics["loss"])
        runs.append([float(x) for x in jax.device_get(losses)])
        seconds = (time.perf_counter() - start) / steps  # the second run's: no compile in it
        params.append([np.asarray(leaf) for leaf in jax.tree.leaves(jax.device_get(state.params))])
        del state
    same_params = all(a.tobytes() == b.tobytes() for a, b in zip(*params, strict=True))
    return runs[0], runs[1], same_params, seconds


def compare(first: list[float], second: list[float]) -> tuple[int | None, float]:
    """(the first 1-based step whose losses differ, or None when all are bit-identical; the largest relative
    difference over the steps). Two NaNs count as the same loss."""
    same = [a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(first, second, strict=True)]
    drift = max((abs(a - b) / max(abs(a), 1e-30) for a, b, s in zip(first, second, same) if not s), default=0.0)
    return (same.index(False) + 1 if not all(same) else None), drift


def make_config(name: str, attention: str, gpu: bool):
    """The train config of a row: RECIPE[:OPTION...] with config.model.attention; 125m at batch 32 x 1024 on a GPU,
    else tiny at 4 x 64. ValueError for an unknown recipe or option."""
    import qjax  # noqa: PLC0415

    recipe, options = split_options(name)
    if recipe not in qjax.RECIPES:
        raise ValueError(f"unknown recipe in {name!r}: use one of {', '.join(qjax.RECIPES)}")
    config = llama_base.get_config()
    config.model.size = "125m" if gpu else "tiny"
    config.recipe, config.model.attention = recipe, attention
    apply_options(config, options)
    config.batch_size, config.seq_len = (32, 1024) if gpu else (4, 64)
    config.steps, config.optimizer.lr = 1000, 6e-4
    return config


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["bf16", "int8_rowwise"], help="RECIPE[:OPTION...]")
    parser.add_argument("--attention", nargs="+", default=["auto"], choices=["auto", "xla", "cudnn"],
                        help="config.model.attention values to compare (auto: cuDNN flash attention on a GPU)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 200; 20 without a GPU)")
    parser.add_argument("--xla-deterministic", action="store_true",
                        help="add --xla_gpu_deterministic_ops=true to XLA_FLAGS (read when the backend starts)")
    parser.add_argument("--no-record", action="store_true", help="print the table only")
    args = parser.parse_args()
    if args.steps is not None and args.steps < 1:
        raise SystemExit(f"error: --steps {args.steps}: use 1 or more")
    for name in args.recipes:  # a typo is the user's error, not a row that failed (no backend starts here)
        try:
            make_config(name, "auto", gpu=False)
        except ValueError as error:
            raise SystemExit(f"error: {error}") from None
    if args.xla_deterministic:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_deterministic_ops=true".strip()

    import jax  # noqa: PLC0415

    gpu = jax.default_backend() == "gpu"
    steps = args.steps or (200 if gpu else 20)
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "determinis" in f) or "–"
    rows = ["| recipe | attention | XLA determinism flags | steps | first step whose loss differs | "
            "largest relative loss difference | final params | ms per step |",
            "|---|---|---|---:|---|---:|---|---:|"]
    print("\n".join(rows), flush=True)
    # `timeout` and the suite runner send SIGTERM: end through the finally below, keeping the rows done so far
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        for name in args.recipes:
            for attention in args.attention:
                try:
                    first, second, same_params, seconds = repeat_run(make_config(name, attention, gpu), steps)
                except Exception as error:  # noqa: BLE001  a flag that breaks one program must not end the table
                    message = (str(error).splitlines() or [""])[0][:120].replace("|", "/")
                    rows.append(f"| {name} | {attention} | {flags} | {steps} | failed: {type(error).__name__}: "
                                f"{message} | – | – | – |")
                else:
                    differ, drift = compare(first, second)
                    rows.append(f"| {name} | {attention} | {flags} | {steps} | {differ or 'none: bit-identical'} | "
                                f"{drift:.2e} | {'bit-identical' if same_params else 'differ'} | "
                                f"{seconds * 1e3:.1f} |")
                print(rows[-1], flush=True)
    finally:
        shape = (f"Llama {'125m, batch 32 x 1024' if gpu else 'tiny, batch 4 x 64'}, random tokens, lr 6e-4, one "
                 f"{device_kind()}")
        planned = len(args.recipes) * len(args.attention)
        if len(rows) - 2 < planned:  # stopped by a deadline or Ctrl-C: say the table is partial
            shape += f"; stopped after {len(rows) - 2} of {planned} rows"
        if gpu and not args.no_record and len(rows) > 2:  # a CPU run is the test's, not a result
            record_results("Is a train step bit-reproducible?", "\n".join(rows) + f"\n\n{shape}.\n")


if __name__ == "__main__":
    main()
