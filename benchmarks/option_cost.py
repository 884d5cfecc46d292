"""What a model option costs the train step: RECIPE:OPTION against RECIPE, both compiled in one process and timed in
alternating rounds.

  python benchmarks/option_cost.py --rows fp8_rowwise:smooth_swiglu            # 1b (TinyLlama shape), batch 8 x 2048
  python benchmarks/option_cost.py --rows fp8_rowwise:smooth_swiglu --small    # tiny model (the default without a GPU)

Rows of separate processes (benchmarks/train.py) move by up to 2.5% between runs on one GPU, as much as an option may
cost. Here the step without the option and the step with it stay compiled side by side, and each round times --steps
steps of one, then of the other (the order alternating; `common.interleaved_ms`), on random tokens. The cost is the
median over rounds of the paired ratio (with / without - 1), given with the range of those ratios: a cost inside
that range is not resolved. Options: common.MODEL_OPTIONS (smooth_swiglu, lm_head_8bit, recompute_attention).
"""

import argparse
import statistics

from common import (apply_options, device_kind, interleaved_ms, llama_step_config, random_lm_batch, record_results,
                    split_options, step_runner)


def paired_cost(without: list[float], with_option: list[float]) -> tuple[float, float, float]:
    """(median, min, max) over rounds of with / without - 1, in %: each round's two samples are a pair."""
    ratios = [(w / wo - 1) * 100 for wo, w in zip(without, with_option, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=["fp8_rowwise:smooth_swiglu"], metavar="RECIPE:OPTION")
    parser.add_argument("--small", action="store_true", help="tiny model, batch 4 x 128")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    for row in args.rows:
        if not split_options(row)[1]:
            parser.error(f"row {row!r} names no option: write RECIPE:OPTION (fp8_rowwise:smooth_swiglu)")

    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from qjax.train import make_task  # noqa: PLC0415

    small = args.small or jax.default_backend() != "gpu"
    rows = ["| row | without, step ms | with, step ms | cost, median of paired rounds | range over rounds |",
            "|---|---:|---:|---:|---:|"]
    print("\n".join(rows))
    for row in args.rows:
        recipe, options = split_options(row)
        steps = {}
        for name, applied in (("without", ()), ("with", options)):
            config = llama_step_config(recipe, small)
            apply_options(config, applied)
            task = make_task(config)
            batch = random_lm_batch(np.random.default_rng(0), task.model_config.vocab_size, config.batch_size,
                                    config.seq_len)
            steps[name] = step_runner(config, task, batch)
        samples = interleaved_ms(steps, warmup=3, rounds=args.rounds, inner=args.steps)
        median, low, high = paired_cost(samples["without"], samples["with"])
        rows.append(f"| {row} | {statistics.median(samples['without']):.1f} | {statistics.median(samples['with']):.1f}"
                    f" | {median:+.2f}% | {low:+.2f}% to {high:+.2f}% |")
        print(rows[-1], flush=True)
        del steps
    if not small:  # CPU times are no results
        notes = (f"Llama 1.1B (TinyLlama shape), batch 8 x 2048, optax AdamW, LM head in bf16 unless :lm_head_8bit, "
                 f"{device_kind()}; both steps compiled in one process, {args.rounds} alternating rounds of "
                 f"{args.steps} steps each.")
        record_results("Model option: train step cost", "\n".join(rows) + f"\n\n{notes}\n")


if __name__ == "__main__":
    main()
