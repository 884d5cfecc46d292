"""What quantization health metrics cost (`qjax.health`, config.health_every): the 1.1B train step with and
without them, per recipe.

  python benchmarks/health_cost.py                                  # 1b (TinyLlama shape), batch 8 x 2048, on a GPU
  python benchmarks/health_cost.py --recipes fp8_tensorwise --small # tiny model (the default without a GPU)

The plain step (`make_train_step(config)`, what train.py runs between measurements) and the measuring step
(`make_train_step(config, health=True)`) are timed alike on random tokens: steps queued back to back, the median of
rounds. The cost with health_every = N is (measuring - plain) / (N x plain), printed for N = 1, 25 (log_every's
default) and 100. The plain step is the program without the feature (nothing of it is traced: tests/test_health.py).
"""

import argparse
import sys

from common import REPO, device_kind, random_lm_batch, record_results, time_ms
from train import TINYLLAMA

sys.path.insert(0, str(REPO))  # the configs/ package
from configs import llama_base  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["int8_rowwise", "fp8_tensorwise", "fp8_rowwise"])
    parser.add_argument("--small", action="store_true", help="tiny model, batch 4 x 128")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round")
    args = parser.parse_args()

    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from qjax.train import make_task, make_train_step  # noqa: PLC0415

    small = args.small or jax.default_backend() != "gpu"
    rows = ["| recipe | plain step ms | measuring step ms | health_every=1 | =25 | =100 |", "|---|---:|---:|---:|---:|---:|"]
    print("\n".join(rows))
    for recipe in args.recipes:
        config = llama_base.get_config()
        config.model.size = "tiny" if small else "1b"
        for field, value in (() if small else TINYLLAMA.items()):
            setattr(config.model, field, value)
        config.recipe = recipe
        config.batch_size, config.seq_len = (4, 128) if small else (8, 2048)
        config.steps = 1000
        task = make_task(config)
        batch = random_lm_batch(np.random.default_rng(0), task.model_config.vocab_size, config.batch_size,
                                config.seq_len)
        times = []
        for health in (False, True):
            init_state, train_step = make_train_step(config, task, health=health)
            holder = [init_state()]

            def run_one():  # the state is donated: thread it through; wait on the loss
                holder[0], metrics = train_step(holder[0], batch)
                return metrics["loss"]

            times.append(time_ms(run_one, (), warmup=3, reps=5, inner=args.steps))
            del holder
        plain, measuring = times
        cost = lambda every: f"{(measuring - plain) / (every * plain) * 100:+.2f}%"  # noqa: E731
        rows.append(f"| {recipe} | {plain:.1f} | {measuring:.1f} | {cost(1)} | {cost(25)} | {cost(100)} |")
        print(rows[-1], flush=True)
    if not small:  # CPU times are no results
        shape = "Llama 1.1B, batch 8 x 2048, optax AdamW"
        record_results("Quantization health metrics: train step cost", "\n".join(rows) + f"\n\n{shape}, {device_kind()}.\n")


if __name__ == "__main__":
    main()
