"""What quantization health metrics cost (`qjax.health`, config.health_every): the 1.1B train step with and
without them, per recipe.

  python benchmarks/health_cost.py                                  # 1b (TinyLlama shape), batch 8 x 2048, on a GPU
  python benchmarks/health_cost.py --recipes fp8_tensorwise --small # tiny model (the default without a GPU)

The plain step (`make_train_step(config)`, what train.py runs between measurements) and the measuring step
(`make_train_step(config, health=True)`) are compiled in one process and timed in alternating rounds of steps queued
back to back (`common.interleaved_ms`), on random tokens; each is the median over rounds. The cost with
health_every = N is (measuring - plain) / (N x plain), printed for N = 1, 25 (log_every's default) and 100. The
plain step is the program without the feature (nothing of it is traced: tests/test_health.py).
"""

import argparse
import statistics

from common import device_kind, interleaved_ms, llama_step_config, random_lm_batch, record_results, step_runner


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["int8_rowwise", "fp8_tensorwise", "fp8_rowwise"])
    parser.add_argument("--small", action="store_true", help="tiny model, batch 4 x 128")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()

    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from qjax.train import make_task  # noqa: PLC0415

    small = args.small or jax.default_backend() != "gpu"
    rows = ["| recipe | plain step ms | measuring step ms | health_every=1 | =25 | =100 |", "|---|---:|---:|---:|---:|---:|"]
    print("\n".join(rows))
    for recipe in args.recipes:
        config = llama_step_config(recipe, small)
        task = make_task(config)
        batch = random_lm_batch(np.random.default_rng(0), task.model_config.vocab_size, config.batch_size,
                                config.seq_len)
        steps = {"plain": step_runner(config, task, batch), "measuring": step_runner(config, task, batch, health=True)}
        samples = interleaved_ms(steps, warmup=3, rounds=args.rounds, inner=args.steps)
        plain, measuring = (statistics.median(samples[name]) for name in ("plain", "measuring"))
        cost = lambda every: f"{(measuring - plain) / (every * plain) * 100:+.2f}%"  # noqa: E731
        rows.append(f"| {recipe} | {plain:.1f} | {measuring:.1f} | {cost(1)} | {cost(25)} | {cost(100)} |")
        print(rows[-1], flush=True)
        del steps
    if not small:  # CPU times are no results
        shape = "Llama 1.1B, batch 8 x 2048, optax AdamW"
        record_results("Quantization health metrics: train step cost", "\n".join(rows) + f"\n\n{shape}, {device_kind()}.\n")


if __name__ == "__main__":
    main()
