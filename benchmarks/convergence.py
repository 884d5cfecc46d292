"""Convergence: the same Llama run in bf16, int8_rowwise and fp8_tensorwise; final eval loss vs bf16 and a PNG.

  python benchmarks/convergence.py                       # the default config (tiny Llama, Shakespeare bytes)
  python benchmarks/convergence.py --size 125m --seq-len 1024 --batch-size 32 --steps 2000     # on a GPU

Each recipe trains from the same seed, data order and schedule (`qjax.train.train`, workdir
runs/convergence/<size-steps-batch-seq-lr>/<recipe>; a finished run with the same settings is reused). Prints the
final eval loss per recipe and its relative difference to bf16 (target: within 1%), appends the table to
RESULTS.md, and plots the train and eval loss curves to benchmarks/convergence.png.
Needs the corpus: `make data` (or python -m qjax.data.prepare shakespeare --out data/shakespeare).
"""

import argparse
import json
import pathlib
import sys

from common import REPO, append_results

sys.path.insert(0, str(REPO))  # the configs/ package
from configs import llama_base  # noqa: E402
from qjax.train import train  # noqa: E402

RECIPES = ("bf16", "int8_rowwise", "fp8_tensorwise")


def read_metrics(workdir: pathlib.Path) -> tuple[list, list]:
    """(train [(step, loss)], eval [(step, eval_loss)]) from a run's metrics.jsonl (last record per step wins,
    so a resumed run's repeated steps count once)."""
    train_curve, eval_curve = {}, {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            train_curve[record["step"]] = record["loss"]
        if "eval_loss" in record:
            eval_curve[record["step"]] = record["eval_loss"]
    return sorted(train_curve.items()), sorted(eval_curve.items())


def plot(curves: dict, path: pathlib.Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for recipe, (train_curve, eval_curve) in curves.items():
        line, = ax.plot(*zip(*train_curve), label=f"{recipe} train", linewidth=1.2)
        ax.plot(*zip(*eval_curve), "o--", color=line.get_color(), label=f"{recipe} eval", markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="*", default=list(RECIPES))
    parser.add_argument("--size", help="Llama preset (default: the config's)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--workdir", default=str(REPO / "runs" / "convergence"))
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()

    curves, finals = {}, {}
    for recipe in args.recipes:
        config = llama_base.get_config()
        config.recipe = recipe
        config.data.path = str(REPO / "data" / "shakespeare")
        for field, value in (("steps", args.steps), ("seq_len", args.seq_len), ("batch_size", args.batch_size)):
            if value is not None:
                setattr(config, field, value)
        if args.size:
            config.model.size = args.size
        if args.lr:
            config.optimizer.lr = args.lr
        config.eval_every = max(config.steps // 6, 1)
        # One workdir per recipe and run shape: a finished run with the same settings is reused, never a different one.
        tag = (f"{config.model.size}-steps{config.steps}-b{config.batch_size}-t{config.seq_len}"
               f"-lr{config.optimizer.lr:g}")
        workdir = pathlib.Path(args.workdir) / tag / recipe
        print(f"== {recipe} -> {workdir}", flush=True)
        train(config, str(workdir))
        curves[recipe] = read_metrics(workdir)
        finals[recipe] = curves[recipe][1][-1]

    base = finals.get("bf16")
    lines = ["| recipe | final step | final eval loss | vs bf16 |", "|---|---:|---:|---:|"]
    for recipe, (step, loss) in finals.items():
        rel = f"{(loss - base[1]) / base[1] * 100:+.2f}%" if base else "–"
        lines.append(f"| {recipe} | {step} | {loss:.4f} | {rel} |")
    config = llama_base.get_config()
    size = args.size or config.model.size
    note = (f"Llama {size}, Shakespeare bytes, steps {args.steps or config.steps}, batch "
            f"{args.batch_size or config.batch_size} x seq {args.seq_len or config.seq_len}, same seed and data "
            "order per recipe; eval loss = mean over the config's eval batches.")
    report = "\n".join(lines) + "\n\n" + note + "\n"
    print("\n" + report)
    png = REPO / "benchmarks" / "convergence.png"
    plot(curves, png, f"Llama {size} on Shakespeare: bf16 vs int8 vs fp8")
    report += f"\nLoss curves: benchmarks/{png.name}\n"
    if not args.no_append:
        append_results("convergence", report)


if __name__ == "__main__":
    main()
